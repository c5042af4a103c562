"""RMSNorm variants (spec §2, §4 step 1)."""
from __future__ import annotations

import torch

from .numerics import Numerics


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, num: Numerics) -> torch.Tensor:
    """Weighted RMSNorm: fp32 math, fp32 weight, one rounding to the activation dtype."""
    xf = x.float()
    xf = xf * num.fn(torch.rsqrt, xf.square().mean(-1, keepdim=True) + eps)
    return num.round(weight * xf)


def head_rms_norm(q: torch.Tensor, eps: float, num: Numerics) -> torch.Tensor:
    """Weightless per-head RMSNorm of q. The official code runs it as plain bf16 tensor ops, so
    the square, mean, +eps, rsqrt and product are each rounded to bf16; we do the same."""
    q = num.round(q)
    ms = q.square().mean(-1, keepdim=True) + eps
    return q * (torch.rsqrt(ms) if not num.fp64_accumulate else num.round(num.fn(torch.rsqrt, ms)))
