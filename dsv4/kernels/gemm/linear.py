"""The FP8 linear as the model calls it: one entry point per form, dispatched by ``route``.

* ``fp8_linear(x, w, ws)``: bf16 x [..., K] -> bf16 [..., N]: the official ``act_quant`` + block-scaled
  FP8 GEMM. ``route.fp8_kernel`` picks ``fp8_mma`` (the quantisation in its operand load) at decode
  sizes on sm_89+, else the tile kernel with the quantisation fused in its prologue up to
  ``route.FUSE_QUANT_MAX_ROWS`` rows, or ``act_quant_fp8`` + ``fp8_gemm`` above.
* ``fp8_gemm(xq, xs, w, ws)``: the same GEMM of pre-quantised activations (the shared expert's w2):
  ``fp8_mma``, ``fp8_prefill`` (128+ rows on sm_90) or the tile kernel.
Every path computes the same quantisation and exact products; only the fp32 summation order differs.
"""
from __future__ import annotations

import torch

from ..lib import target
from . import fp8_mma as mma
from . import route
from .common import check_fp8_gemm_args, check_fp8_weight
from .fp8 import act_quant_fp8, fp8_gemm_bf16
from .fp8 import fp8_gemm as fp8_gemm_tiles


def fp8_gemm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 [M, N] = block-scaled FP8 GEMM of e4m3 xq [M, K] (scales xs [M, K/128]) and the FP8 weight w
    [N, K] (ws [N/128, K/128] or per row), on the kernel ``route.fp8_kernel`` picks."""
    M, K = check_fp8_gemm_args("fp8_gemm", xq, xs, w, ws)
    N = w.shape[0]
    kern = route.fp8_kernel(M, N, K, target(xq.device), prequantised=True)
    if out is not None and out.stride(-1) != 1:
        kern = "tiles"
    if kern == "mma":
        return mma.fp8_mma(w, ws, xq, xs.float(), out=out)
    if kern == "prefill":
        from .fp8_prefill import fp8_gemm_prefill
        return fp8_gemm_prefill(xq, xs, w, ws, out=out)
    return fp8_gemm_tiles(xq, xs, w, ws, out=out)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, portable: bool = False) -> torch.Tensor:
    """bf16 x [..., K] -> bf16 [..., N] (module doc). ``portable``: the Triton tile kernel only (no
    Gluon, no TMA): the op table's fallback where a target-tuned kernel failed its self-check."""
    check_fp8_weight(w, ws)
    K = x.shape[-1]
    N = w.shape[0]
    x2 = x.reshape(-1, K).to(torch.bfloat16)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    kern = "tiles" if portable else route.fp8_kernel(M, N, K, target(x.device))
    if kern == "mma":
        y = mma.fp8_mma(w, ws, x_bf16=x2)
    elif M <= route.FUSE_QUANT_MAX_ROWS:
        y = fp8_gemm_bf16(x2, w, ws)
    else:
        q, s = act_quant_fp8(x2)
        y = fp8_gemm_tiles(q, s, w, ws) if portable else fp8_gemm(q, s, w, ws)
    return y.reshape(*x.shape[:-1], N)


__all__ = ["fp8_gemm", "fp8_linear"]
