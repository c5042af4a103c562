"""Kernel-side implementations of the layer ops (``linear``, ``wo_a``, ``moe``) on native weights.

``linear``: FP8 layers run the block-scaled FP8 GEMM (``kernels.gemm.fp8_linear``, which routes
decode / prefill tiles by size); bf16-stored layers one bf16 tensor-core GEMM with fp32 output
(exact products, fp32 sums: the official fp32 GEMM of bf16 operands up to summation order).
``wo_a``: the official bf16 grouped einsum: at decode sizes the FP8 weight is read by ``fp8_mma``
(bf16 activations, ``act="bf16"``), above that the weight is dequantised to bf16 for the call
(exact: e4m3 x 2^k fits bf16) and one batched GEMM runs. ``moe``: ``kernels.moe.moe_forward`` on
the layer's stacked experts (MXFP4 / NVFP4); FP8 experts have no kernel and run the twin. Under
expert parallelism each rank's kernels return the fp32 sum of its experts, which is all-reduced
before the shared expert is added and the sum rounded (the twin's and the official order).
"""
from __future__ import annotations

import torch

from ..kernels import fp8_mma
from ..kernels.gemm import fp8_linear
from ..kernels.moe import MoEWeights, moe_forward
from . import twins


def linear(lin, x: torch.Tensor) -> torch.Tensor:
    if lin.kind == "fp8":
        return fp8_linear(x, lin.weight, lin.scale)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype == torch.bfloat16:
        y = torch.mm(x2, lin.weight.t(), out_dtype=torch.float32)
    else:
        y = x2.float() @ lin.weight.float().t()
    if lin.kind == "bf16":
        y = y.to(torch.bfloat16)
    return y.view(*x.shape[:-1], -1)


def dequant_bf16(lin) -> torch.Tensor:
    """bf16 values of an FP8 linear's weight (exact), or its bf16 weight."""
    if lin.kind != "fp8":
        return lin.weight
    N, K = lin.weight.shape
    s = lin.scale.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    return (lin.weight.to(torch.bfloat16) * s.to(torch.bfloat16))


def wo_a(g, o: torch.Tensor) -> torch.Tensor:
    T, G = o.shape[0], g.groups
    o = o.to(torch.bfloat16)
    if g.fmt == "fp8" and T <= fp8_mma.WO_A_MAX_ROWS and fp8_mma.available(o.device):
        z = fp8_mma.fp8_mma(g.lin.weight, g.lin.scale, x_bf16=o.reshape(T, -1), act="bf16", groups=G)
        return z.view(T, G, -1)
    return torch.einsum("tgd,grd->tgr", o, dequant_bf16(g.lin).view(G, g.rank, -1))


def kernel_weights(layer) -> MoEWeights:
    """The ``MoEWeights`` view of an MoE layer's tensors (no copies), built once."""
    w = getattr(layer, "_kernel_weights", None)
    if w is None:
        w = MoEWeights(gate_w=layer.gate_w, bias=layer.bias, tid2eid=layer.tid2eid, topk=layer.topk,
                       route_scale=layer.route_scale, limit=layer.limit, fmt=layer.fmt,
                       w13=layer.w13, w13_s=layer.w13_s, w13_s2=layer.w13_s2,
                       w2=layer.w2, w2_s=layer.w2_s, w2_s2=layer.w2_s2,
                       sh13=layer.sh13, sh13_s=layer.sh13_s, sh2=layer.sh2, sh2_s=layer.sh2_s,
                       expert0=layer.expert0)
        object.__setattr__(layer, "_kernel_weights", w)
    return w


def moe(layer, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    if layer.fmt == "fp8":
        return twins.moe(layer, x, ids)
    if not layer.group.active:
        return moe_forward(x, ids, kernel_weights(layer))
    y, sh = moe_forward(x, ids, kernel_weights(layer), partial=True)
    y = layer.group.all_reduce(y)
    return (y if sh is None else y + sh.float()).to(torch.bfloat16)
