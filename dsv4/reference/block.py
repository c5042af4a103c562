"""A V4 transformer block (spec §4-§8): mHC around sliding-window / compressed attention and
the MoE; main layers, the April MTP block and the DSpark stages are all built from it."""
from __future__ import annotations

from ..config import ModelConfig
from .attention import Attention
from .compressor import Compressor
from .indexer import Indexer
from .linear import make_linear
from .mhc import HyperConnection
from .moe import MoE, Expert
from .norm import rms_norm
from .numerics import Numerics
from .rope import RopeTable
from .state import CompressorState, LayerState


class Block:
    def __init__(self, cfg: ModelConfig, layer_id: int, prefix: str, t: dict, num: Numerics,
                 ropes: dict[int, RopeTable]):
        self.cfg, self.layer_id, self.num = cfg, layer_id, num
        ratio = cfg.layer_ratio(layer_id)
        self.ratio = ratio
        eps = cfg.rms_norm_eps
        hc = lambda kind: HyperConnection(t[f"{prefix}hc_{kind}_fn"], t[f"{prefix}hc_{kind}_base"],
                                          t[f"{prefix}hc_{kind}_scale"], cfg.hc_mult, cfg.hc_sinkhorn_iters,
                                          cfg.hc_eps, eps, num)
        self.hc_attn, self.hc_ffn = hc("attn"), hc("ffn")
        self.attn_norm = t[prefix + "attn_norm.weight"].float()
        self.ffn_norm = t[prefix + "ffn_norm.weight"].float()
        a = prefix + "attn."
        lin = {n: make_linear(t, a + n, num) for n in ("wq_a", "wq_b", "wkv", "wo_b")}
        lin["wo_a"] = make_linear(t, a + "wo_a", num, kind="bf16")   # convert.py: bf16 einsum
        rope = ropes[ratio]
        comp = idx = None
        if ratio:
            comp = self._compressor(t, a + "compressor.", ratio, cfg.head_dim, rope, num, indexer=False)
            if ratio == 4:
                icomp = self._compressor(t, a + "indexer.compressor.", ratio, cfg.index_head_dim, rope, num,
                                         indexer=True)
                idx = Indexer(make_linear(t, a + "indexer.wq_b", num),
                              make_linear(t, a + "indexer.weights_proj", num), icomp,
                              cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, num)
        small = {"q_norm": t[a + "q_norm.weight"], "kv_norm": t[a + "kv_norm.weight"], "attn_sink": t[a + "attn_sink"]}
        self.attn = Attention(cfg, layer_id, lin, small, rope, comp, idx, num)
        f = prefix + "ffn."
        expert = lambda p: Expert(make_linear(t, p + "w1", num), make_linear(t, p + "w2", num),
                                  make_linear(t, p + "w3", num), cfg.swiglu_limit, num)
        hash_layer = layer_id < cfg.num_hidden_layers and cfg.is_hash_layer(layer_id)
        self.moe = MoE(t[f + "gate.weight"], None if hash_layer else t[f + "gate.bias"],
                       t[f + "gate.tid2eid"] if hash_layer else None,
                       [expert(f"{f}experts.{e}.") for e in range(cfg.n_routed_experts)],
                       expert(f + "shared_experts."), cfg.num_experts_per_tok, cfg.routed_scaling_factor, num)

    def _compressor(self, t, p, ratio, dim, rope, num, indexer):
        return Compressor(make_linear(t, p + "wkv", num, kind="fp32"), make_linear(t, p + "wgate", num, kind="fp32"),
                          t[p + "ape"], t[p + "norm.weight"], ratio, dim, rope, self.cfg.rms_norm_eps, num, indexer)

    def new_state(self, device) -> LayerState:
        cfg, dt = self.cfg, self.num.act_dtype
        comp = idx = None
        if self.ratio:
            comp = CompressorState(self.ratio, cfg.head_dim, dt, device)
            if self.ratio == 4:
                idx = CompressorState(4, cfg.index_head_dim, dt, device)
        return LayerState(cfg.sliding_window, cfg.head_dim, dt, device, comp, idx)

    def __call__(self, x, positions, segs, ids):
        return self.run(x, lambda a: self.attn(a, positions, segs), ids)

    def run(self, x, attend, ids):
        """The block around an attention: hc_pre -> attn_norm -> ``attend`` -> hc_post, then
        hc_pre -> ffn_norm -> MoE -> hc_post. ``attend`` maps the normed rows [T, d] to the
        attention output [T, d] (the DSpark draft passes its block attention)."""
        eps, t, L = self.cfg.rms_norm_eps, self.attn.trace, f"L{self.layer_id}."
        a, post, comb = self.hc_attn.pre(x)
        if t is not None:
            t[L + "hc_pre"] = a.clone()
        a = attend(rms_norm(a, self.attn_norm, eps, self.num))
        x = self.hc_attn.post(a, x, post, comb)
        f, post, comb = self.hc_ffn.pre(x)
        f = self.moe(rms_norm(f, self.ffn_norm, eps, self.num), ids)
        out = self.hc_ffn.post(f, x, post, comb)
        if t is not None:
            t[L + "moe"], t[L + "hc_post"] = f.clone(), out.clone()
        return out
