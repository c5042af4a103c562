"""Torch twins of the layer ops on native weights: DeepSeek's official numerics, computed as
``dsv4.reference`` computes them (``Numerics('official')``), one weight dequantised at a time.

``linear`` computes every merged member on its own (the reference's GEMM shapes); ``moe``
dequantises only the experts a batch routes to, in increasing expert id, as the reference's loop
does.

Batch invariance: a CPU BLAS picks its fp32 GEMM kernel by the row count M (at M = 1 a GEMV,
small M their own tails), so a row's bits would depend on how many rows share the call. Every
twin GEMM whose M is the number of tokens therefore runs on rows zero-padded to a multiple of 8
(at least 8): a token's result is then the same alone, batched, chunked or decoded (checked for
this machine's BLAS by ``tests/test_model.py``). The products and fp32 sums are still the
official fp32 GEMM's; only the order BLAS sums in is pinned.
"""
from __future__ import annotations

import torch

from ..formats.fp4 import dequant_mxfp4, dequant_nvfp4
from ..formats.fp8 import dequant_fp8_weight
from ..reference.linear import Linear as RefLinear
from ..reference.linear import dequant_activation_fp8
from ..reference.moe import MoE as RefMoE
from ..reference.moe import Expert
from ..reference.numerics import OFFICIAL

QBLOCK = 128
ROW_PAD = 8


def padded_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, ...] zero-padded along dim 0 to a multiple of ROW_PAD (at least ROW_PAD)."""
    M = x.shape[0]
    P = max(ROW_PAD, -(-M // ROW_PAD) * ROW_PAD)
    return x if P == M else torch.cat([x, x.new_zeros(P - M, *x.shape[1:])])


def row_invariant(fn):
    """``fn(x, *args)`` on x padded by ``padded_rows``; every tensor output sliced back to M rows."""
    def run(x, *args, **kw):
        M = x.shape[0]
        out = fn(padded_rows(x), *args, **kw)
        if isinstance(out, tuple):
            return tuple(o[:M] for o in out)
        return out[:M]
    run.__name__ = run.__qualname__ = getattr(fn, "__name__", "twin")
    run.__doc__ = fn.__doc__
    return run


def fp8_rows(w: torch.Tensor, s: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """fp32 values of rows [a, b) of an FP8 weight (a a multiple of 128)."""
    return dequant_fp8_weight(w[a:b], s[a // QBLOCK:-(-b // QBLOCK)])


def linear(lin, x: torch.Tensor) -> torch.Tensor:
    lead, M = x.shape[:-1], x.reshape(-1, x.shape[-1]).shape[0]
    return _linear(lin, padded_rows(x.reshape(M, -1)))[:M].reshape(*lead, -1)


def _linear(lin, x: torch.Tensor) -> torch.Tensor:
    if lin.kind == "fp8":
        xq = dequant_activation_fp8(x.to(torch.bfloat16))
        outs = [(xq @ fp8_rows(lin.weight, lin.scale, a, b).T).to(torch.bfloat16) for _, a, b in lin.spans()]
    elif lin.kind == "bf16":
        xf = x.to(torch.bfloat16).float()
        outs = [(xf @ lin.weight[a:b].float().T).to(torch.bfloat16) for _, a, b in lin.spans()]
    else:
        xf = x.float()
        outs = [xf @ lin.weight[a:b].float().T for _, a, b in lin.spans()]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def wo_a(g, o: torch.Tensor) -> torch.Tensor:
    lin, M = g.lin, o.shape[0]
    w = fp8_rows(lin.weight, lin.scale, 0, lin.out_features) if lin.kind == "fp8" else lin.weight.float()
    z = OFFICIAL.einsum("tgd,grd->tgr", padded_rows(o.float()), w.view(g.groups, g.rank, -1))
    return OFFICIAL.round(z[:M])


def _expert_weights(layer, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 (w1, w3, w2) of routed expert e."""
    I = layer.inter
    if layer.fmt == "fp8":
        w13 = dequant_fp8_weight(layer.w13[e], layer.w13_s[e])
        w2 = dequant_fp8_weight(layer.w2[e], layer.w2_s[e])
    elif layer.fmt == "mxfp4":
        w13 = dequant_mxfp4(layer.w13[e], layer.w13_s[e])
        w2 = dequant_mxfp4(layer.w2[e], layer.w2_s[e])
    else:       # nvfp4: one global scale per (expert, tensor), spread over its rows at load
        e4 = torch.float8_e4m3fn
        w13 = torch.cat([dequant_nvfp4(layer.w13[e, r], layer.w13_s[e, r].view(e4), layer.w13_s2[e, r.start])
                         for r in (slice(0, I), slice(I, 2 * I))])
        w2 = dequant_nvfp4(layer.w2[e], layer.w2_s[e].view(e4), layer.w2_s2[e, 0])
    return w13[:I], w13[I:], w2


def _expert(w1, w3, w2, kind: str, limit: float) -> Expert:
    return Expert(RefLinear(w1, kind, OFFICIAL), RefLinear(w2, kind, OFFICIAL), RefLinear(w3, kind, OFFICIAL),
                  limit, OFFICIAL)


def shared_expert(layer) -> Expert:
    I = layer.inter
    s13 = dequant_fp8_weight(layer.sh13, layer.sh13_s)
    return _expert(s13[:I], s13[I:], dequant_fp8_weight(layer.sh2, layer.sh2_s), "fp8", layer.limit)


def router(layer) -> RefMoE:
    """The reference layer's routing over this layer's gate (no experts attached)."""
    return RefMoE(layer.gate_w, layer.bias, layer.tid2eid, [], None, layer.topk, layer.route_scale, OFFICIAL)


def moe(layer, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``reference.moe.MoE.__call__`` on the layer's stored experts (GEMMs on padded rows)."""
    M = x.shape[0]
    idx, w = router(layer).route(padded_rows(x), padded_rows(ids))
    idx, w = idx[:M], w[:M]
    y = torch.zeros(M, x.shape[1], dtype=torch.float32, device=x.device)
    kind = "fp8" if layer.fmt == "fp8" else "fp4"
    e0, e1 = layer.expert0, layer.expert0 + layer.n_experts    # this rank's experts (all of them on one)
    for e in torch.unique(idx).tolist():                 # increasing expert id, as the official loop
        if not e0 <= e < e1:
            continue
        hit = idx == e
        rows = hit.any(dim=1).nonzero().squeeze(1)
        col = hit[rows].float().argmax(dim=1)            # a repeated hash id contributes once
        n = rows.numel()
        ex = _expert(*_expert_weights(layer, e - e0), kind, layer.limit)
        y[rows] += ex(padded_rows(x[rows]), padded_rows(w[rows, col]))[:n].float()
    y = layer.group.all_reduce(y)                        # expert parallelism: every rank's experts
    return OFFICIAL.round(y + row_invariant(shared_expert(layer))(x).float())


def _mhc():
    from ..kernels import mhc
    return mhc


def hc_pre(x, *args, **kw):
    """``kernels.mhc.hc_pre_torch`` on padded rows (its mix GEMM has M = tokens)."""
    return row_invariant(_mhc().hc_pre_torch)(x, *args, **kw)


def hc_head(x, *args, **kw):
    """``kernels.mhc.hc_head_torch`` on padded rows."""
    return row_invariant(_mhc().hc_head_torch)(x, *args, **kw)


def reference_moe(mw, num=None):
    """The twin of a ``kernels.moe.MoEWeights``: a ``reference.moe.MoE`` over its dequantised tensors (CPU)."""
    Linear, MoE = RefLinear, RefMoE
    num = num or OFFICIAL
    I = mw.inter
    cpu = mw.to("cpu")

    def deq(w, s, s2):
        if mw.fmt == "mxfp4":
            return dequant_mxfp4(w, s)
        # per-row global scales: dequantise row blocks sharing one value
        out = torch.empty(w.shape[0], w.shape[1] * 2)
        for v in torch.unique(s2):
            r = (s2 == v).nonzero().squeeze(1)
            out[r] = dequant_nvfp4(w[r], s[r].view(torch.float8_e4m3fn), v.reshape(()))
        return out

    experts = []
    for e in range(mw.n_experts):
        w13 = deq(cpu.w13[e], cpu.w13_s[e], None if cpu.w13_s2 is None else cpu.w13_s2[e])
        w2 = deq(cpu.w2[e], cpu.w2_s[e], None if cpu.w2_s2 is None else cpu.w2_s2[e])
        experts.append(Expert(Linear(w13[:I], "fp4", num), Linear(w2, "fp4", num),
                              Linear(w13[I:], "fp4", num), mw.limit, num))
    shared = None
    if cpu.sh13 is not None:
        s13 = dequant_fp8_weight(cpu.sh13.view(torch.float8_e4m3fn), cpu.sh13_s)
        s2 = dequant_fp8_weight(cpu.sh2.view(torch.float8_e4m3fn), cpu.sh2_s)
        Is = s13.shape[0] // 2
        shared = Expert(Linear(s13[:Is], "fp8", num), Linear(s2, "fp8", num), Linear(s13[Is:], "fp8", num),
                        mw.limit, num)
    return MoE(cpu.gate_w, cpu.bias, cpu.tid2eid, experts, shared, mw.topk, mw.route_scale, num)
