"""Twins of ``kernels.mhc``: the reference's mHC functions (official numerics); ``hc_pre`` and
``hc_head`` run their mix GEMM (M = tokens) on padded rows (``twins.lib``)."""
from __future__ import annotations

import torch

from ..reference import mhc as ref
from ..reference.numerics import OFFICIAL
from .lib import row_invariant

HC = 4


@row_invariant
def hc_pre(x, fn, base, scale, iters: int = 20, hc_eps: float = 1e-6, rms_eps: float = 1e-6, **_):
    """x bf16 [T, 4, d] -> (layer input bf16 [T, d], post fp32 [T, 4], comb fp32 [T, 4, 4])."""
    return ref.hc_pre(x, fn, base, scale, HC, iters, hc_eps, rms_eps, OFFICIAL)


def hc_post(y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, **_) -> torch.Tensor:
    return ref.hc_post(y, res, post, comb, OFFICIAL)


@row_invariant
def hc_head(x, fn, base, scale, hc_eps: float = 1e-6, rms_eps: float = 1e-6, **_):
    return ref.hc_head(x, fn, base, scale, hc_eps, rms_eps, OFFICIAL)


__all__ = ["hc_head", "hc_post", "hc_pre"]
