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
    def _rms_norm_kernel(X, W, Y, D, stride_x, stride_y, eps, BD: tl.constexpr, INTERP: tl.constexpr):
        pdl_wait()
        r = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BD)
        m = d < D
        x = tl.load(X + r * stride_x + d, mask=m, other=0.0).to(tl.float32)
        ms = tl.sum(x * x, axis=0) / D
        y = x * tl.rsqrt(ms + eps)
        w = tl.load(W + d, mask=m, other=0.0).to(tl.float32)
        store_bf16(Y + r * stride_y + d, w * y, m, INTERP)


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
        kw = {} if interpreting() else {"num_warps": 4 if BD <= 2048 else 8}
        _rms_norm_kernel[(x2.shape[0],)](x2, weight.contiguous(), y, D, x2.stride(0), y.stride(0), float(eps),
                                         BD=BD, INTERP=interpreting(), **kw, **PDL_LAUNCH)
    return y.view(x.shape)


__all__ = ["rms_norm"]
