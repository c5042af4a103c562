"""Twin of ``kernels.moe``: the reference MoE's math (``reference.moe.route`` / ``swiglu``,
``reference.linear.linear``, official numerics) on the stacked experts as stored, one routed expert
dequantised at a time, in increasing expert id (the official loop's order); GEMMs on padded rows
(``twins.lib``). No reference module is built: the weights are read where they are.

``experts(...)`` is the core the layer op (``twins.layer_ops.moe``) shares; ``moe_forward(x, ids, w)``
takes the kernel's ``MoEWeights`` (FP4 experts) and has its signature.
"""
from __future__ import annotations

import torch

from ..formats.fp4 import dequant_mxfp4, dequant_nvfp4
from ..formats.fp8 import dequant_fp8_weight
from ..reference.linear import linear as ref_linear
from ..reference.moe import route as ref_route
from ..reference.moe import swiglu
from ..reference.numerics import OFFICIAL
from .lib import padded_rows, row_invariant

_ONE = torch.ones(())


def expert(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, kind: str, limit: float,
           weight: torch.Tensor | None = None) -> torch.Tensor:
    """One expert on fp32 weights: w2(swiglu(w1 x, w3 x) * weight), the GEMMs of ``kind`` ("fp8" / "fp4")."""
    h = swiglu(ref_linear(x, w1.T, kind, OFFICIAL), ref_linear(x, w3.T, kind, OFFICIAL), limit, weight, OFFICIAL)
    return ref_linear(h, w2.T, kind, OFFICIAL)


def fp4_rows(codes: torch.Tensor, scales: torch.Tensor, s2: torch.Tensor | None, fmt: str) -> torch.Tensor:
    """fp32 values of packed FP4 rows: MXFP4 (e8m0 bytes per 32) or NVFP4 (e4m3 bytes per 16 and an fp32
    global scale per row, applied last: the official product order)."""
    if fmt == "mxfp4":
        return dequant_mxfp4(codes, scales)
    return dequant_nvfp4(codes, scales.view(torch.float8_e4m3fn), _ONE) * s2.float()[:, None]


def stacked_expert(w13, w13_s, w13_s2, w2, w2_s, w2_s2, fmt: str, e: int):
    """fp32 (w1, w3, w2) of local expert e of stacked tensors ([E, 2I, ...], w1 rows then w3 rows)."""
    if fmt == "fp8":
        w13e = dequant_fp8_weight(w13[e], w13_s[e])
        w2e = dequant_fp8_weight(w2[e], w2_s[e])
    else:
        w13e = fp4_rows(w13[e], w13_s[e], None if w13_s2 is None else w13_s2[e], fmt)
        w2e = fp4_rows(w2[e], w2_s[e], None if w2_s2 is None else w2_s2[e], fmt)
    I = w13e.shape[0] // 2
    return w13e[:I], w13e[I:], w2e


def experts(x: torch.Tensor, idx: torch.Tensor, rw: torch.Tensor, expert0: int, n_local: int, weights_of,
            kind: str, limit: float) -> torch.Tensor:
    """fp32 [M, d]: sum over each row's routed experts held here (global ids [expert0, expert0 + n_local))
    of their outputs, in increasing expert id; ``weights_of(local e)`` -> fp32 (w1, w3, w2)."""
    M = x.shape[0]
    y = torch.zeros(M, x.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(idx).tolist():                 # increasing expert id, as the official loop
        if not expert0 <= e < expert0 + n_local:
            continue
        hit = idx == e
        rows = hit.any(dim=1).nonzero().squeeze(1)
        col = hit[rows].float().argmax(dim=1)            # a repeated hash id contributes once
        n = rows.numel()
        out = expert(padded_rows(x[rows]), *weights_of(e - expert0), kind, limit, padded_rows(rw[rows, col]))
        y[rows] += out[:n].float()
    return y


def route(x: torch.Tensor, ids: torch.Tensor | None, w) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [T, k] int64, routing weights [T, k] fp32) of ``w`` (``MoEWeights`` or an MoE layer)."""
    M = x.shape[0]
    ids_p = None if ids is None else padded_rows(ids)
    idx, rw = ref_route(padded_rows(x), ids_p, w.gate_w, w.bias, w.tid2eid, w.topk, w.route_scale, OFFICIAL)
    return idx[:M], rw[:M]


def shared_weights(sh13, sh13_s, sh2, sh2_s):
    """fp32 (w1, w3, w2) of the FP8 shared expert."""
    s13 = dequant_fp8_weight(sh13.view(torch.float8_e4m3fn), sh13_s)
    s2 = dequant_fp8_weight(sh2.view(torch.float8_e4m3fn), sh2_s)
    Is = s13.shape[0] // 2
    return s13[:Is], s13[Is:], s2


def shared_expert(x: torch.Tensor, sh13, sh13_s, sh2, sh2_s, limit: float, weights=None) -> torch.Tensor:
    """``weights``: ``shared_weights`` of the same tensors, where the caller keeps them."""
    return row_invariant(expert)(x, *(weights or shared_weights(sh13, sh13_s, sh2, sh2_s)), "fp8", limit)


def moe_forward(x: torch.Tensor, ids: torch.Tensor | None, w, routing: tuple | None = None,
                partial: bool = False, **_):
    """``kernels.moe.moe_forward``'s result: bf16 [T, d], or with ``partial`` (the fp32 routed sum of
    the experts held here, the bf16 shared-expert output or None)."""
    x = x.to(torch.bfloat16)
    if routing is None:
        idx, rw = route(x, ids, w)
    else:
        idx, rw = routing
    kind = "fp8" if w.fmt == "fp8" else "fp4"
    y = experts(x, idx, rw, w.expert0, w.n_experts,
                lambda e: stacked_expert(w.w13, w.w13_s, w.w13_s2, w.w2, w.w2_s, w.w2_s2, w.fmt, e), kind, w.limit)
    sh = None if w.sh13 is None else shared_expert(x, w.sh13, w.sh13_s, w.sh2, w.sh2_s, w.limit)
    if partial:
        return y, sh
    return OFFICIAL.round(y if sh is None else y + sh.float())


__all__ = ["expert", "experts", "fp4_rows", "moe_forward", "route", "shared_expert", "stacked_expert"]
