"""Weighted RMSNorm in one launch (spec §2: q_norm, kv_norm, attn_norm, ffn_norm, the final norm).

``rms_norm(x, w, eps)``: bf16 ``w * (x * rsqrt(mean(x^2) + eps))`` with fp32 math and one rounding,
one program per row. Twin: ``twins.norm.rms_norm`` (the reference's, official numerics), which PyTorch runs as
eight kernels (cast, square, mean, add, rsqrt, two products, cast): at decode those launches cost
more than the math. The only difference is the fp32 order of the sum of squares and the rsqrt's
last-bit behaviour, so results agree with the twin within one bf16 rounding step.
"""
from __future__ import annotations

import torch

from .lib import PDL_LAUNCH, interpreting, triton_available

if triton_available():
    import triton
    import triton.language as tl

    from .lib import pdl_wait, store_bf16

    @triton.jit
    def norm_store(x, W, Y, d, m, D, eps, INTERP: tl.constexpr):
        """Y[d] = bf16(W[d] * (x * rsqrt(mean(x^2) + eps))) where m, for one row x fp32 [BD] in registers
        (zeros off m; fp32 math, one rounding): the RMSNorm of every kernel that ends in one."""
        norm_store_w(x, tl.load(W + d, mask=m, other=0.0), Y, d, m, D, eps, INTERP)

    @triton.jit
    def norm_store_w(x, w, Y, d, m, D, eps, INTERP: tl.constexpr):
        """``norm_store`` with the weight's elements d already loaded (w, any float dtype)."""
        ms = tl.sum(x * x, axis=0) / D
        y = x * tl.rsqrt(ms + eps)
        store_bf16(Y + d, w.to(tl.float32) * y, m, INTERP)

    @triton.jit
    def _norm_row(X, W, Y, D, eps, BD: tl.constexpr, INTERP: tl.constexpr):
        """Y[:D] = bf16(W * (X * rsqrt(mean(X^2) + eps))) for one row (fp32 math)."""
        d = tl.arange(0, BD)
        m = d < D
        norm_store(tl.load(X + d, mask=m, other=0.0).to(tl.float32), W, Y, d, m, D, eps, INTERP)

    @triton.jit
    def _rms_norm_kernel(X, W, Y, D, stride_x, stride_y, eps, BD: tl.constexpr, INTERP: tl.constexpr):
        pdl_wait()
        r = tl.program_id(0).to(tl.int64)
        _norm_row(X + r * stride_x, W, Y + r * stride_y, D, eps, BD, INTERP)

    @triton.jit
    def _rms_norm_pair_kernel(X, WA, WB, YA, YB, DA, DB, stride_x, stride_ya, stride_yb, eps,
                              BDA: tl.constexpr, BDB: tl.constexpr, INTERP: tl.constexpr):
        """Grid (rows, 2): program (r, 0) norms row r's columns [0, DA) with WA into YA, (r, 1) its
        columns [DA, DA + DB) with WB into YB (each ``_rms_norm_kernel``'s math and tile: the same bits)."""
        pdl_wait()
        r = tl.program_id(0).to(tl.int64)
        if tl.program_id(1) == 0:
            _norm_row(X + r * stride_x, WA, YA + r * stride_ya, DA, eps, BDA, INTERP)
        else:
            _norm_row(X + r * stride_x + DA, WB, YB + r * stride_yb, DB, eps, BDB, INTERP)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """bf16 [..., D] = RMSNorm of x (any float dtype) with weight [D] (module doc)."""
    D = x.shape[-1]
    if weight.numel() != D:
        raise ValueError(f"rms_norm: weight has {weight.numel()} elements, x has last dim {D}")
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=torch.bfloat16, device=x.device)
    if x2.shape[0]:
        BD = triton.next_power_of_2(D)
        kw = {} if interpreting() else {"num_warps": _warps(BD)}
        _rms_norm_kernel[(x2.shape[0],)](x2, weight.contiguous(), y, D, x2.stride(0), y.stride(0), float(eps),
                                         BD=BD, INTERP=interpreting(), **kw, **PDL_LAUNCH)
    return y.view(x.shape)


def _warps(bd: int) -> int:
    return 4 if bd <= 2048 else 8


def rms_norm_pair(x: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor, eps: float):
    """(RMSNorm of x[:, :Da] with wa, RMSNorm of x[:, Da:] with wb) bf16, Da = wa.numel(), in one launch
    (the attention's q_norm and kv_norm of the one wq_a|wkv GEMM's output): ``rms_norm`` of each slice,
    the same bits."""
    DA, DB = wa.numel(), wb.numel()
    if x.dim() != 2 or x.shape[1] != DA + DB:
        raise ValueError(f"rms_norm_pair: x must be [T, {DA} + {DB}] (the two weights' sizes), got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    T = x.shape[0]
    ya = torch.empty(T, DA, dtype=torch.bfloat16, device=x.device)
    yb = torch.empty(T, DB, dtype=torch.bfloat16, device=x.device)
    if T:
        BDA, BDB = triton.next_power_of_2(DA), triton.next_power_of_2(DB)
        kw = {} if interpreting() else {"num_warps": _warps(max(BDA, BDB))}
        _rms_norm_pair_kernel[(T, 2)](x, wa.contiguous(), wb.contiguous(), ya, yb, DA, DB, x.stride(0), ya.stride(0),
                                      yb.stride(0), float(eps), BDA=BDA, BDB=BDB, INTERP=interpreting(), **kw,
                                      **PDL_LAUNCH)
    return ya, yb


__all__ = ["rms_norm", "rms_norm_pair"]
