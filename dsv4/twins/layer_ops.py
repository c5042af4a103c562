"""Twins of ``kernels.layer_ops`` (same signatures): DeepSeek's official numerics as
``dsv4.reference`` computes them, one weight dequantised at a time.

``linear`` computes every merged member on its own (the reference's GEMM shapes); ``wo_a`` is the
official fp32 grouped einsum of the dequantised weight; ``moe`` runs ``twins.moe`` on the layer's
stored experts (FP4 or FP8), all-reducing the routed sum over expert-parallel ranks before the
shared expert is added. GEMMs whose M is the token count run on padded rows (``twins.lib``).
"""
from __future__ import annotations

import weakref

import torch

from ..formats.fp8 import dequant_fp8_weight
from ..reference.linear import dequant_activation_fp8
from ..reference.numerics import OFFICIAL
from . import moe as _moe
from .lib import padded_rows

QBLOCK = 128
# fp32 values of constant CPU weights (dequantised FP8 spans, bf16 spans, routed and shared experts), kept
# on their module so that a twin GEMM does not convert its weight on every call: the lm head's
# bf16 -> fp32 alone was 40% of a CPU engine test's time. CPU only (on a GPU the twins are the fallback of
# an op whose kernel failed, and device memory belongs to the KV cache), and at most
# ``WEIGHT_CACHE_BYTES`` in a process.
WEIGHT_CACHE_BYTES = 2 << 30
_cached = [0]                     # bytes held by live caches (a finalizer gives a module's back)


def _release(nbytes: int) -> None:
    _cached[0] -= nbytes


def _cached_fp32(owner, what, sources, convert):
    """``convert()`` (fp32 tensors made from the tensors ``sources``), cached on ``owner`` under ``what``
    while every source is unchanged (same storage, same version counter). CPU sources only."""
    if any(t.device.type != "cpu" for t in sources) or type(owner).__weakrefoffset__ == 0:
        return convert()                 # (an owner with no weak references can't give its bytes back)
    key = tuple(x for t in sources for x in (t.data_ptr(), t._version))
    cache = owner.__dict__.setdefault("_twin_fp32", {})
    hit = cache.get(what)
    if hit is not None and hit[0] == key:
        return hit[1]
    out = convert()
    if hit is None:                      # a new entry: counted once, given back when ``owner`` goes
        nbytes = sum(t.numel() * t.element_size() for t in (out if isinstance(out, tuple) else (out,)))
        if _cached[0] + nbytes > WEIGHT_CACHE_BYTES:
            return out
        _cached[0] += nbytes
        weakref.finalize(owner, _release, nbytes)
    cache[what] = (key, out)
    return out


def _weight_fp32(lin, a: int, b: int, convert) -> torch.Tensor:
    """``convert()`` (the fp32 values of rows [a, b) of ``lin``'s weight), cached (``_cached_fp32``)."""
    sc = getattr(lin, "scale", None) if lin.kind == "fp8" else None
    return _cached_fp32(lin, (a, b), (lin.weight,) if sc is None else (lin.weight, sc), convert)


def fp8_rows(w: torch.Tensor, s: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """fp32 values of rows [a, b) of an FP8 weight (a a multiple of 128)."""
    return dequant_fp8_weight(w[a:b], s[a // QBLOCK:-(-b // QBLOCK)])


def linear(lin, x: torch.Tensor) -> torch.Tensor:
    lead, M = x.shape[:-1], x.reshape(-1, x.shape[-1]).shape[0]
    return _linear(lin, padded_rows(x.reshape(M, -1)))[:M].reshape(*lead, -1)


def _linear(lin, x: torch.Tensor) -> torch.Tensor:
    if lin.kind == "fp8":
        xq = dequant_activation_fp8(x.to(torch.bfloat16))
        outs = [(xq @ _weight_fp32(lin, a, b, lambda: fp8_rows(lin.weight, lin.scale, a, b)).T).to(torch.bfloat16)
                for _, a, b in lin.spans()]
    elif lin.kind == "bf16":
        xf = x.to(torch.bfloat16).float()
        outs = [(xf @ _weight_fp32(lin, a, b, lambda: lin.weight[a:b].float()).T).to(torch.bfloat16)
                for _, a, b in lin.spans()]
    else:
        xf = x.float()
        outs = [xf @ _weight_fp32(lin, a, b, lambda: lin.weight[a:b].float()).T for _, a, b in lin.spans()]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def wo_a(g, o: torch.Tensor) -> torch.Tensor:
    lin, M = g.lin, o.shape[0]
    n = lin.out_features
    w = _weight_fp32(lin, 0, n, (lambda: fp8_rows(lin.weight, lin.scale, 0, n)) if lin.kind == "fp8"
                     else lin.weight.float)
    z = OFFICIAL.einsum("tgd,grd->tgr", padded_rows(o.float()), w.view(g.groups, g.rank, -1))
    return OFFICIAL.round(z[:M])


def moe(layer, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``reference.moe.MoE.__call__`` on the layer's stored experts."""
    idx, rw = _moe.route(x, ids, layer)
    kind = "fp8" if layer.fmt == "fp8" else "fp4"
    stacked = tuple(t for t in (layer.w13, layer.w13_s, layer.w13_s2, layer.w2, layer.w2_s, layer.w2_s2)
                    if t is not None)
    y = _moe.experts(x, idx, rw, layer.expert0, layer.n_experts,
                     lambda e: _cached_fp32(layer, ("expert", e), stacked, lambda: _moe.stacked_expert(
                         layer.w13, layer.w13_s, layer.w13_s2, layer.w2, layer.w2_s, layer.w2_s2, layer.fmt, e)),
                     kind, layer.limit)
    y = layer.group.all_reduce(y)                        # expert parallelism: every rank's experts
    shared = (layer.sh13, layer.sh13_s, layer.sh2, layer.sh2_s)
    sh = _moe.shared_expert(x, *shared, layer.limit,
                            weights=_cached_fp32(layer, "shared", shared, lambda: _moe.shared_weights(*shared)))
    return OFFICIAL.round(y + sh.float())


__all__ = ["fp8_rows", "linear", "moe", "wo_a"]
