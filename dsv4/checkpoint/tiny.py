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
  ~N(0, 8^2), so the ``swiglu_limit`` clamp is really exercised;
* DSpark Markov head: ``markov_w1`` rows ~N(0, 1), ``markov_w2`` gain 0.5 (a logit bump of std 0.5
  next to the head's), confidence head a plain fan-in linear.

``make_tiny(out_dir, layout, seed, shards)`` builds ``preset('tiny')`` and writes it with the
real V4 tokenizer files.
"""
from __future__ import annotations

import math
from collections import OrderedDict

import torch

from ..config import DSPARK_MARKOV_RANK, ModelConfig, preset, with_draft
from ..formats.fp4 import quant_mxfp4
from ..formats.fp8 import quant_fp8_weight
from .schema import Unit, base_expert_format, walk

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
    "markov_std": 1.0,
    "markov_gain": 0.5,
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


#: How many builds ``build_tiny_tensors`` keeps for later calls with the same arguments (0: none). The
#: test suite builds the same few tiny models many times, ~1.3 s a build on two cores (tests/conftest.py
#: sets it); a kept build costs its bytes (~150 MiB for ``preset('tiny')``).
BUILD_CACHE = 0
_builds: OrderedDict = OrderedDict()


def build_tiny_tensors(cfg: ModelConfig, seed: int, threads: int = 1, draft: bool = True,
                       knobs: dict | None = None) -> dict[str, torch.Tensor]:
    """Canonical official-layout tensors for ``cfg`` (MXFP4 experts unless expert_dtype is fp8/null),
    one value per unit of ``schema.walk`` in its order; ``draft=False`` leaves out ``mtp.*``;
    ``knobs`` overrides entries of ``KNOBS``.

    Runs single-threaded by default (the tiny tensors are small; intra-op threads only add overhead
    on a busy machine; real-shaped synthetic layers pass more) and restores the caller's torch
    thread count; the result does not depend on it. With ``BUILD_CACHE`` set, a build is kept and
    each call gets its own copy of the tensors (a caller may change them).
    """
    k = {**KNOBS, **(knobs or {})}
    key = (cfg, int(seed), bool(draft), tuple(sorted(k.items())))
    sd = _builds.get(key) if BUILD_CACHE > 0 else None
    if sd is None:
        threads, n = torch.get_num_threads(), threads
        torch.set_num_threads(max(1, n))
        try:
            sd = _build(cfg, seed, draft, k)
        finally:
            torch.set_num_threads(threads)
        if BUILD_CACHE <= 0:
            return sd
        _builds[key] = sd
        while len(_builds) > BUILD_CACHE:
            _builds.popitem(last=False)
    _builds.move_to_end(key)
    return {name: t.clone() for name, t in sd.items()}


def _build(cfg: ModelConfig, seed: int, draft: bool, k: dict) -> dict[str, torch.Tensor]:
    r = _Draw(seed)
    sd: dict[str, torch.Tensor] = {}
    hc = cfg.hc_mult

    def knob(u: Unit) -> float:
        return k[u.knob] if u.knob else 1.0

    def quant(name: str, w: torch.Tensor, dtype: torch.dtype) -> None:
        if dtype == torch.int8:
            q, s = quant_mxfp4(w)
        elif dtype == torch.float8_e4m3fn:
            q, s = quant_fp8_weight(w)
        else:
            raise ValueError(f"{name}: the tiny builder draws MXFP4 or FP8 weights, not {dtype}")
        sd[name + ".weight"], sd[name + ".scale"] = q, s

    for u in walk(cfg, base_expert_format(cfg), draft=draft):
        (name, sp), kind = u.specs[0], u.kind
        if kind == "embed":
            sd[name] = r.normal(*sp.shape, std=k["embed_std"]).to(torch.bfloat16)
        elif kind == "head":
            head = r.linear(*sp.shape, gain=k["head_gain"])
            head *= torch.exp(r.normal(sp.shape[0], 1, std=k["head_row_logstd"]))
            sd[name] = head.to(torch.bfloat16)
            del head
        elif kind == "norm":
            sd[name] = r.norm(sp.shape[0], knob(u)).to(torch.bfloat16)
        elif kind == "fp8_linear":
            quant(u.key, r.linear(*sp.shape, gain=knob(u)), torch.float8_e4m3fn)
        elif kind == "bf16_linear":
            sd[name] = r.linear(*sp.shape, gain=knob(u)).to(torch.bfloat16)
        elif kind == "rows":
            sd[name] = r.normal(*sp.shape, std=knob(u)).to(torch.bfloat16)
        elif kind == "hc_mix":
            mix = sp.shape[0]
            fn = r.normal(mix, sp.shape[1], std=k["hc_fn_gain"] / math.sqrt(sp.shape[1]))
            pre = r.normal(hc, std=k["hc_base_std"])
            post = r.normal(hc, std=k["hc_base_std"])
            comb = k["hc_comb_identity"] * torch.eye(hc) + r.normal(hc, hc, std=k["hc_base_std"])
            scale = r.normal(3, std=k["hc_scale_std"], mean=1.0)
            for (n, _), t in zip(u.specs, (fn, torch.cat([pre, post, comb.flatten()]), scale)):
                sd[n] = t.float()
        elif kind == "hc_head":
            fn = r.normal(hc, sp.shape[1], std=k["hc_fn_gain"] / math.sqrt(sp.shape[1]))
            base = r.normal(hc, std=k["hc_base_std"])
            scale = r.normal(1, std=k["hc_scale_std"], mean=1.0)
            for (n, _), t in zip(u.specs, (fn, base, scale)):
                sd[n] = t.float()
        elif kind == "ape":
            sd[name] = r.normal(*sp.shape, std=k["ape_std"]).float()
        elif kind == "sink":
            sd[name] = r.normal(*sp.shape, std=k["sink_std"], mean=k["sink_mean"]).float()
        elif kind == "gate_bias":
            sd[name] = r.normal(*sp.shape, std=k["gate_bias_std"]).float()
        elif kind == "tid2eid":
            # K distinct experts per token: the first K of a random permutation per row
            V, K = sp.shape
            perm = torch.argsort(torch.rand(V, cfg.n_routed_experts, generator=r.g), dim=-1)
            sd[name] = perm[:, :K].to(torch.int64).contiguous()
        elif kind == "swiglu":
            spec = dict(u.specs)
            inter, d = spec[u.key + "w1.weight"].shape[0], spec[u.key + "w2.weight"].shape[0]
            w1, w3 = r.linear(inter, d), r.linear(inter, d)
            w2 = r.linear(d, inter, gain=k["w2_gain"])
            hot = torch.randperm(inter, generator=r.g)[: k["hot_channels"]]
            w1[hot] *= k["hot_gain"]
            w3[hot] *= k["hot_gain"]
            w2[:, hot] /= k["hot_gain"]
            dtype = spec[u.key + "w1.weight"].dtype
            for w, t in (("w1", w1), ("w2", w2), ("w3", w3)):
                quant(u.key + w, t, dtype)
        else:
            raise AssertionError(f"unknown unit kind {kind!r}")
    for n, t in sd.items():
        sd[n] = t.contiguous()
    return sd


def make_tiny(out_dir: str, layout: str = "official", seed: int = 0, shards: int = 1,
              cfg: ModelConfig | None = None, overwrite: bool = False, draft: str | None = None) -> str:
    """Build ``preset('tiny')`` (or ``cfg``) from ``seed`` and save it with the tokenizer files.
    ``draft`` 'none' | 'mtp' | 'dspark' rewrites the config for that draft (config.with_draft); None
    keeps the config's own draft."""
    from .writer import save_checkpoint
    cfg = cfg or preset("tiny")
    if draft is not None:
        cfg = with_draft(cfg, draft, DSPARK_MARKOV_RANK["tiny"] if cfg.dspark_markov_rank is None
                         else cfg.dspark_markov_rank)
    tensors = build_tiny_tensors(cfg, seed, draft=draft != "none")
    return save_checkpoint(tensors, cfg, out_dir, layout=layout, shards=shards, tokenizer=True,
                           overwrite=overwrite)
