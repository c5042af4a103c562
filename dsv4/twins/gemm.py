"""Twins of the block-scaled GEMM contracts of ``kernels.gemm`` (same names and arguments).

* ``act_quant_fp8``: ``formats.fp8.act_quant_fp8`` (the official ``act_quant``), bit for bit.
* ``fp8_gemm``: the official accumulation order: per 128-K block an fp32 partial of exact products,
  scaled, summed in increasing K order, one bf16 rounding.
* ``fp4_gemm``: bf16(dequant(x) @ dequant(W)^T) in fp32, as ``reference.linear.Linear`` (fp4).
"""
from __future__ import annotations

import torch

from ..formats.fp4 import dequant_mxfp4, dequant_nvfp4
from ..formats.fp8 import act_quant_fp8 as _act_quant
from ..formats.fp8 import e8m0_to_fp32

QBLOCK = 128


def act_quant_fp8(x: torch.Tensor, block: int = QBLOCK):
    return _act_quant(x, block)


def fp8_gemm(xq, xs, w, ws, out=None, **_) -> torch.Tensor:
    M, K = xq.shape
    N = w.shape[0]
    s = e8m0_to_fp32(ws) if ws.dtype in (torch.float8_e8m0fnu, torch.uint8) else ws.float()
    if s.shape[0] != N:
        s = s.repeat_interleave(QBLOCK, 0)[:N]
    a = xq.float().view(M, K // QBLOCK, QBLOCK)
    b = w.float().view(N, K // QBLOCK, QBLOCK)
    acc = torch.zeros(M, N, dtype=torch.float32, device=xq.device)
    for kb in range(K // QBLOCK):
        acc += (a[:, kb] @ b[:, kb].T) * (xs[:, kb, None].float() * s[None, :, kb])
    y = acc.to(torch.bfloat16)
    if out is not None:
        out.copy_(y)
        return out
    return y


def fp4_gemm(xq, xs, w_packed, w_scale, fmt="mxfp4", w_scale_2=None, **_) -> torch.Tensor:
    W = dequant_mxfp4(w_packed, w_scale) if fmt == "mxfp4" else dequant_nvfp4(w_packed, w_scale, w_scale_2)
    M, K = xq.shape
    x = (xq.float().view(M, K // QBLOCK, QBLOCK) * xs.float()[..., None]).view(M, K)
    return (x @ W.T).to(torch.bfloat16)


__all__ = ["act_quant_fp8", "fp4_gemm", "fp8_gemm"]
