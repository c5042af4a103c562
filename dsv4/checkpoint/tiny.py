"""Deterministic random V4 weights (canonical form) and the tiny test checkpoint.

``build_tiny_tensors(cfg, seed)`` draws every tensor of ``cfg`` from ONE ``torch.Generator``
seeded with ``seed`` (same seed -> bit-identical tensors) and quantises them to the official
formats (FP8 + e8m0 block scales, MXFP4 routed experts — or FP8 ones when ``cfg.expert_dtype`` is
'fp8' / null — and ``attn.wo_a`` in FP8 as released).

The weights are random but scaled like a trained network so that every code path matters while
the network stays well-conditioned (rounding-order noise is not amplified layer after layer):

* linears: normal * gain / sqrt(fan_in); norms ~ mean * (1 + 0.05 N(0,1));
* token embedding std ``embed_std`` = 5 and update gains 0.5 (below): the residual stream dominates
  each block's update. V4's discrete steps (FP8 act-quant steps, MoE routing and indexer top-k
  picks) amplify rounding noise; with these values two roundings of the same math (official vs
  invariant numerics) agree on ~97% of greedy argmaxes instead of ~88% with 2.5 / 0.7;
* ``attn.kv_norm`` weight ~1.5: K = V and q is unit-RMS per head, so this weight is the attention
  temperature (peaked, not uniform, attention); main compressor norm ~2 (temperature of the
  compressed entries); indexer compressor norm ~1;
* mHC: small ``hc_*_fn`` (std 0.6/sqrt(hc*d)), ``hc_*_base`` comb part biased to 3 * identity so
  the Sinkhorn mixing matrix stays near the identity, scales ~1;
* attention sinks mean 1, std 1.5; wo_b and expert w2 gain 0.5;
* router gain 3 (clear score separation, few near-ties), gate bias std 0.1, valid ``tid2eid``
  with ``num_experts_per_tok`` distinct experts per token;
* lm head gain 2 with log-normal (std 0.5) row norms: clear greedy argmax margins;
* 4 "hot" SwiGLU channels per expert (w1/w3 rows x8, matching w2 columns /8): pre-activations
  ~N(0, 8^2), so the ``swiglu_limit`` clamp is really exercised.

``make_tiny(out_dir, layout, seed, shards)`` builds ``preset('tiny')`` and writes it with the
real V4 tokenizer files.
"""
from __future__ import annotations

import math

import torch

from ..config import ModelConfig, preset
from ..formats.fp4 import quant_mxfp4
from ..formats.fp8 import quant_fp8_weight

KNOBS = {
    "embed_std": 5.0,
    "kv_norm": 1.5,
    "compressor_norm": 2.0,
    "indexer_compressor_norm": 1.0,
    "wo_b_gain": 0.5,
    "w2_gain": 0.5,
    "gate_gain": 3.0,
    "gate_bias_std": 0.1,
    "head_gain": 2.0,
    "head_row_logstd": 0.5,
    "sink_mean": 1.0,
    "sink_std": 1.5,
    "hc_fn_gain": 0.6,
    "hc_base_std": 0.5,
    "hc_comb_identity": 3.0,
    "hc_scale_std": 0.2,
    "ape_std": 0.5,
    "compressor_gate_gain": 1.5,
    "hot_channels": 4,
    "hot_gain": 8.0,
}


class _Draw:
    """All randomness of one build, from a single generator."""

    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(int(seed))

    def normal(self, *shape, std=1.0, mean=0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g) * std + mean

    def linear(self, out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        return self.normal(out_f, in_f, std=gain / math.sqrt(in_f))

    def norm(self, dim: int, mean: float = 1.0) -> torch.Tensor:
        return self.normal(dim, std=0.05 * mean, mean=mean)


def build_tiny_tensors(cfg: ModelConfig, seed: int, threads: int = 1,
                       knobs: dict | None = None) -> dict[str, torch.Tensor]:
    """Canonical official-layout tensors for ``cfg`` (MXFP4 experts unless expert_dtype is fp8/null);
    ``knobs`` overrides entries of ``KNOBS``.

    Runs single-threaded by default (the tiny tensors are small; intra-op threads only add overhead
    on a busy machine; real-shaped synthetic layers pass more) and restores the caller's torch
    thread count; the result does not depend on it.
    """
    threads, n = torch.get_num_threads(), threads
    torch.set_num_threads(max(1, n))
    try:
        return _build(cfg, seed, {**KNOBS, **(knobs or {})})
    finally:
        torch.set_num_threads(threads)


def _build(cfg: ModelConfig, seed: int, k: dict) -> dict[str, torch.Tensor]:
    r = _Draw(seed)
    sd: dict[str, torch.Tensor] = {}
    d, V = cfg.hidden_size, cfg.vocab_size
    H, D = cfg.num_attention_heads, cfg.head_dim
    dq, G, R = cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    E, K, inter = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    hc, mix = cfg.hc_mult, cfg.hc_mix_dim
    nI, dI = cfg.index_n_heads, cfg.index_head_dim
    expert_fp4 = cfg.expert_dtype == "fp4"

    def bf16(name, t):
        sd[name] = t.to(torch.bfloat16).contiguous()

    def f32(name, t):
        sd[name] = t.float().contiguous()

    def fp8(name, w):
        q, s = quant_fp8_weight(w)
        sd[name + ".weight"], sd[name + ".scale"] = q, s

    def mxfp4(name, w):
        q, s = quant_mxfp4(w)
        sd[name + ".weight"], sd[name + ".scale"] = q, s

    def hc_mix(p, kind):
        f32(f"{p}hc_{kind}_fn", r.normal(mix, hc * d, std=k["hc_fn_gain"] / math.sqrt(hc * d)))
        pre = r.normal(hc, std=k["hc_base_std"])
        post = r.normal(hc, std=k["hc_base_std"])
        comb = k["hc_comb_identity"] * torch.eye(hc) + r.normal(hc, hc, std=k["hc_base_std"])
        f32(f"{p}hc_{kind}_base", torch.cat([pre, post, comb.flatten()]))
        f32(f"{p}hc_{kind}_scale", r.normal(3, std=k["hc_scale_std"], mean=1.0))

    def hc_head(p):
        f32(f"{p}hc_head_fn", r.normal(hc, hc * d, std=k["hc_fn_gain"] / math.sqrt(hc * d)))
        f32(f"{p}hc_head_base", r.normal(hc, std=k["hc_base_std"]))
        f32(f"{p}hc_head_scale", r.normal(1, std=k["hc_scale_std"], mean=1.0))

    def compressor(p, head_dim, ratio, norm_mean):
        coff = 2 if ratio == 4 else 1
        bf16(p + "wkv.weight", r.linear(coff * head_dim, d))
        bf16(p + "wgate.weight", r.linear(coff * head_dim, d, gain=k["compressor_gate_gain"]))
        f32(p + "ape", r.normal(ratio, coff * head_dim, std=k["ape_std"]))
        bf16(p + "norm.weight", r.norm(head_dim, norm_mean))

    def swiglu(p, quant):
        w1, w3 = r.linear(inter, d), r.linear(inter, d)
        w2 = r.linear(d, inter, gain=k["w2_gain"])
        hot = torch.randperm(inter, generator=r.g)[: k["hot_channels"]]
        w1[hot] *= k["hot_gain"]
        w3[hot] *= k["hot_gain"]
        w2[:, hot] /= k["hot_gain"]
        quant(p + "w1", w1)
        quant(p + "w2", w2)
        quant(p + "w3", w3)

    def block(p, layer_id):
        ratio = cfg.layer_ratio(layer_id)
        bf16(p + "attn_norm.weight", r.norm(d))
        bf16(p + "ffn_norm.weight", r.norm(d))
        hc_mix(p, "attn")
        hc_mix(p, "ffn")
        a = p + "attn."
        fp8(a + "wq_a", r.linear(dq, d))
        bf16(a + "q_norm.weight", r.norm(dq))
        fp8(a + "wq_b", r.linear(H * D, dq))
        fp8(a + "wkv", r.linear(D, d))
        bf16(a + "kv_norm.weight", r.norm(D, k["kv_norm"]))
        fp8(a + "wo_a", r.linear(G * R, H * D // G))
        fp8(a + "wo_b", r.linear(d, G * R, gain=k["wo_b_gain"]))
        f32(a + "attn_sink", r.normal(H, std=k["sink_std"], mean=k["sink_mean"]))
        if ratio:
            compressor(a + "compressor.", D, ratio, k["compressor_norm"])
            if ratio == 4:
                fp8(a + "indexer.wq_b", r.linear(nI * dI, dq))
                bf16(a + "indexer.weights_proj.weight", r.linear(nI, d))
                compressor(a + "indexer.compressor.", dI, ratio, k["indexer_compressor_norm"])
        f = p + "ffn."
        bf16(f + "gate.weight", r.linear(E, d, gain=k["gate_gain"]))
        if layer_id < cfg.num_hidden_layers and cfg.is_hash_layer(layer_id):
            # K distinct experts per token: the first K of a random permutation per row
            perm = torch.argsort(torch.rand(V, E, generator=r.g), dim=-1)
            sd[f + "gate.tid2eid"] = perm[:, :K].to(torch.int64).contiguous()
        else:
            f32(f + "gate.bias", r.normal(E, std=k["gate_bias_std"]))
        for e in range(E):
            swiglu(f"{f}experts.{e}.", mxfp4 if expert_fp4 else fp8)
        swiglu(f + "shared_experts.", fp8)

    bf16("embed.weight", r.normal(V, d, std=k["embed_std"]))
    for i in range(cfg.num_hidden_layers):
        block(f"layers.{i}.", i)
    bf16("norm.weight", r.norm(d))
    hc_head("")
    head = r.linear(V, d, gain=k["head_gain"])
    head *= torch.exp(r.normal(V, 1, std=k["head_row_logstd"]))
    bf16("head.weight", head)
    del head
    for j in range(cfg.num_nextn_predict_layers):
        p = f"mtp.{j}."
        fp8(p + "e_proj", r.linear(d, d))
        fp8(p + "h_proj", r.linear(d, d))
        bf16(p + "enorm.weight", r.norm(d))
        bf16(p + "hnorm.weight", r.norm(d))
        bf16(p + "norm.weight", r.norm(d))
        hc_head(p)
        block(p, cfg.num_hidden_layers + j)
    return sd


def make_tiny(out_dir: str, layout: str = "official", seed: int = 0, shards: int = 1,
              cfg: ModelConfig | None = None, overwrite: bool = False) -> str:
    """Build ``preset('tiny')`` (or ``cfg``) from ``seed`` and save it with the tokenizer files."""
    from .writer import save_checkpoint
    cfg = cfg or preset("tiny")
    tensors = build_tiny_tensors(cfg, seed)
    return save_checkpoint(tensors, cfg, out_dir, layout=layout, shards=shards, tokenizer=True,
                           overwrite=overwrite)
