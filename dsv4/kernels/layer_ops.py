"""The layer-level ops on native weights, kernel side: ``linear``, ``wo_a``, ``moe`` (twins:
``dsv4.twins.layer_ops``, same signatures).

``linear(lin, x)``: FP8 layers run the block-scaled FP8 GEMM (``gemm.linear.fp8_linear``, routed by
size in ``gemm.route``); bf16-stored layers one bf16 tensor-core GEMM with fp32 output (exact
products, fp32 sums: the official fp32 GEMM of bf16 operands up to summation order): ``gemm.dense_gemv``
at decode sizes (``route.dense_gemv``), cuBLAS otherwise and in the portable form.
``wo_a(g, o)``: the official bf16 grouped einsum: ``fp8_mma`` reads the FP8 weight (bf16 activations,
``act="bf16"``) where ``route.wo_a_kernel`` says, otherwise the weight is dequantised to bf16 for the
call (exact: e4m3 x 2^k fits bf16; one kernel pass) and one batched GEMM runs on strided views (no
copies of o or of the result).
``moe(layer, x, ids)``: ``kernels.moe.moe_forward`` on the layer's stacked FP4 experts (MXFP4 /
NVFP4); FP8 routed experts have no kernel (``takes_moe`` says which layers it takes). Under expert
parallelism each rank's kernels return the fp32 sum of its experts, which is all-reduced before the
shared expert is added and the sum rounded (the twin's and the official order).
"""
from __future__ import annotations

import torch

from .gemm import dense_gemv
from .gemm import fp8_mma as mma
from .gemm import route
from .gemm.fp8 import dequant_bf16 as fp8_dequant_bf16
from .gemm.linear import fp8_linear
from .lib import target
from .moe import MoEWeights, moe_forward


def linear(lin, x: torch.Tensor) -> torch.Tensor:
    return _linear(lin, x, False)


def _linear(lin, x: torch.Tensor, portable: bool) -> torch.Tensor:
    if lin.kind == "fp8":
        return fp8_linear(x, lin.weight, lin.scale, portable=portable)
    x2 = x.reshape(-1, x.shape[-1])
    if lin.kind == "fp32" and not portable and dense_gemv.takes(x2, lin.weight):
        y = dense_gemv.dense_gemv(x2, lin.weight)
    elif x2.dtype == torch.bfloat16 and x2.is_cuda:
        y = torch.mm(x2, lin.weight.t(), out_dtype=torch.float32)
    else:
        y = x2.float() @ lin.weight.float().t()
    if lin.kind == "bf16":
        y = y.to(torch.bfloat16)
    return y.view(*x.shape[:-1], -1)


def dequant_bf16(lin, portable: bool = True) -> torch.Tensor:
    """bf16 values of an FP8 linear's weight (exact), or its bf16 weight. ``portable``: torch ops (the
    scales expanded to [N, K], five passes); else ``fp8.dequant_bf16`` (one kernel pass, the same bits)."""
    if lin.kind != "fp8":
        return lin.weight
    if not portable:
        return fp8_dequant_bf16(lin.weight, lin.scale)
    N, K = lin.weight.shape
    s = lin.scale.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    return (lin.weight.to(torch.bfloat16) * s.to(torch.bfloat16))


def wo_a(g, o: torch.Tensor) -> torch.Tensor:
    return _wo_a(g, o, False)


def _wo_a(g, o: torch.Tensor, portable: bool) -> torch.Tensor:
    """[T, G, rank] bf16. The dequantised path runs one batched GEMM on strided views (o read as [G, T, D]
    in place, the result written as [T, G, rank] in place): the layout ``wo_b`` reads, no copies."""
    T, G = o.shape[0], g.groups
    o = o.to(torch.bfloat16)
    if not portable and route.wo_a_kernel(T, g.fmt, target(o.device)) == "mma":
        z = mma.fp8_mma(g.lin.weight, g.lin.scale, x_bf16=o.reshape(T, -1), act="bf16", groups=G)
        return z.view(T, G, -1)
    wd = dequant_bf16(g.lin, portable).view(G, g.rank, -1)
    if portable:
        return torch.einsum("tgd,grd->tgr", o, wd)
    o3 = o.reshape(T, G, -1)
    z = torch.empty(T, G, g.rank, dtype=torch.bfloat16, device=o.device)
    torch.bmm(o3.transpose(0, 1), wd.transpose(1, 2), out=z.transpose(0, 1))
    return z


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


def takes_moe(layer, *_) -> bool:
    """Whether ``moe`` has a kernel for this layer's experts (FP4: yes; FP8: no)."""
    return layer.fmt != "fp8"


def moe(layer, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return _moe(layer, x, ids, False)


def _moe(layer, x: torch.Tensor, ids: torch.Tensor, portable: bool) -> torch.Tensor:
    if not takes_moe(layer):
        raise ValueError("moe: FP8 routed experts have no kernel (the op table runs their twin)")
    if not layer.group.active:
        return moe_forward(x, ids, kernel_weights(layer), portable=portable)
    y, sh = moe_forward(x, ids, kernel_weights(layer), partial=True, portable=portable)
    y = layer.group.all_reduce(y)
    return (y if sh is None else y + sh.float()).to(torch.bfloat16)


def linear_portable(lin, x: torch.Tensor) -> torch.Tensor:
    """``linear`` on the portable Triton tile kernel only (no Gluon, no TMA)."""
    return _linear(lin, x, True)


def wo_a_portable(g, o: torch.Tensor) -> torch.Tensor:
    """``wo_a`` as the weight dequantised to bf16 and one batched torch GEMM (no Triton kernel)."""
    return _wo_a(g, o, True)


def moe_portable(layer, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``moe`` on the portable kernels only: the CUDA-core GEMV at decode sizes, the in-register dequant
    FP4 kernel above (no Gluon, no prefill tiles, no ``dot_scaled``)."""
    return _moe(layer, x, ids, True)


__all__ = ["dequant_bf16", "kernel_weights", "linear", "linear_portable", "moe", "moe_portable", "takes_moe", "wo_a",
           "wo_a_portable"]
