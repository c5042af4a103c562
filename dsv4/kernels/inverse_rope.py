"""Inverse RoPE on the attention output, fused with the write of the grouped wo_a input (spec §4
steps 6-7, §4.1).

``o [T, H, 512]`` bf16 -> the last 64 dims of every head rotated by ``-theta`` (``cos``, ``-sin``
of the query position; fp32 math, one bf16 rounding) and written as ``[T, H*512]`` bf16, which is
the memory of ``o.view(T, G, H*512/G)`` that the grouped einsum ``"tgd,grd->tgr"`` reads. With
``fp8=True`` the kernel writes instead the FP8 1x128 activation quantisation of that bf16 row
(e4m3 values + UE8M0 power-of-two scales, ``dsv4.formats.fp8.act_quant_fp8(x, 128)`` bit-for-bit):
``(x_fp8 float8_e4m3fn [T, H*512], scale fp32 [T, H*4])``; the scales are exact powers of two
(``scale.to(torch.float8_e8m0fnu)`` is lossless).

The rotation is bit-identical to the reference's complex64 multiply by the conjugate (products and
sums rounded separately: launched with ``enable_fp_fusion=False``). Prefill chunks and DSpark drafts do
not call it: ``sparse_prefill(..., rope=)`` rotates in the attention kernel's epilogue (no pass over o).
"""
from __future__ import annotations

import torch

from ..formats.contracts import check_inverse_rope
from .lib import PDL_LAUNCH, interpreting, triton_available

if triton_available():
    import triton
    import triton.language as tl

    from .lib import e4m3_bits, exp2i, pdl_wait, rne_bf16, rope_rows, ue8m0_exp

    @triton.jit
    def _inverse_rope_kernel(O, COS, SIN, Y, YQ, YS, H, stride_ot, stride_oh, stride_yt,
                             HPB: tl.constexpr, FP8: tl.constexpr):
        pdl_wait()
        t = tl.program_id(0)
        hb = tl.program_id(1)
        t64 = t.to(tl.int64)
        h = hb * HPB + tl.arange(0, HPB)
        hm = h < H
        d = tl.arange(0, 512)
        x = tl.load(O + t64 * stride_ot + h[:, None] * stride_oh + d[None, :], mask=hm[:, None],
                    other=0.0).to(tl.float32)
        y = rne_bf16(rope_rows(x, COS + t * 32, SIN + t * 32, HPB, True))
        col = h[:, None] * 512 + d[None, :]
        if FP8:
            yb = tl.reshape(y, [HPB * 4, 128])
            e = ue8m0_exp(tl.max(tl.abs(yb), axis=1))
            s = exp2i(e)
            qv = tl.minimum(tl.maximum(yb * exp2i(-e)[:, None], -448.0), 448.0)
            q8 = tl.reshape(e4m3_bits(qv).to(tl.uint8), [HPB, 512])
            tl.store(YQ + t64 * stride_yt + col, q8, mask=hm[:, None])
            sidx = hb * HPB * 4 + tl.arange(0, HPB * 4)
            tl.store(YS + t64 * (H * 4) + sidx, s, mask=sidx < H * 4)
        else:
            tl.store(Y + t64 * stride_yt + col, y.to(Y.dtype.element_ty), mask=hm[:, None])


def inverse_rope(o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fp8: bool = False,
                 out: torch.Tensor | None = None, heads_per_program: int = 4):
    """Triton. ``fp8=False``: bf16 [T, H*512]. ``fp8=True``: (float8_e4m3fn [T, H*512], fp32
    power-of-two scales [T, H*4]). cos/sin: fp32 [T, 32] of each row's query position."""
    check_inverse_rope(o, cos, sin)
    T, H, _ = o.shape
    if o.stride(2) != 1:
        raise ValueError("o needs a contiguous last dim")
    cos, sin = cos.contiguous(), sin.contiguous()
    hpb = heads_per_program
    kw = {} if interpreting() else {"enable_fp_fusion": False, "num_warps": 4}
    if fp8:
        yq = torch.empty(T, H * 512, dtype=torch.float8_e4m3fn, device=o.device)
        ys = torch.empty(T, H * 4, dtype=torch.float32, device=o.device)
        if T:
            _inverse_rope_kernel[(T, triton.cdiv(H, hpb))](
                o, cos, sin, ys, yq.view(torch.uint8), ys, H, o.stride(0), o.stride(1), yq.stride(0),
                HPB=hpb, FP8=True, **kw, **PDL_LAUNCH)
        return yq, ys
    y = torch.empty(T, H * 512, dtype=torch.bfloat16, device=o.device) if out is None else out
    if T:
        _inverse_rope_kernel[(T, triton.cdiv(H, hpb))](
            o, cos, sin, y, y, y, H, o.stride(0), o.stride(1), y.stride(0), HPB=hpb, FP8=False, **kw, **PDL_LAUNCH)
    return y


__all__ = ["inverse_rope"]
