"""Twins of ``kernels.mhc``: the reference's mHC functions (official numerics); ``hc_pre`` and
``hc_head`` run their mix GEMM (M = tokens) on padded rows (``twins.lib``)."""
from __future__ import annotations

import torch

from ..reference import mhc as ref
from ..reference.numerics import OFFICIAL
from .lib import row_invariant
from .norm import rms_norm

HC = 4


@row_invariant
def hc_pre(x, fn, base, scale, iters: int = 20, hc_eps: float = 1e-6, rms_eps: float = 1e-6, **_):
    """x bf16 [T, 4, d] -> (layer input bf16 [T, d], post fp32 [T, 4], comb fp32 [T, 4, 4])."""
    return ref.hc_pre(x, fn, base, scale, HC, iters, hc_eps, rms_eps, OFFICIAL)


def hc_post(y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, **_) -> torch.Tensor:
    return ref.hc_post(y, res, post, comb, OFFICIAL)


def hc_post_pre(y, res, post, comb, fn, base, scale, norm_w, iters: int = 20, hc_eps: float = 1e-6,
                rms_eps: float = 1e-6, norm_eps: float = 1e-6, **_):
    """One mHC boundary (``kernels.mhc.hc_post_pre``): the previous site's hc_post (none when ``y`` is
    None), this site's hc_pre, the weighted RMSNorm of its output -> (h, normed input, post, comb)."""
    h = res if y is None else hc_post(y, res, post, comb)
    a, p2, c2 = hc_pre(h, fn, base, scale, iters, hc_eps, rms_eps)
    return h, rms_norm(a, norm_w, norm_eps), p2, c2


@row_invariant
def hc_head(x, fn, base, scale, hc_eps: float = 1e-6, rms_eps: float = 1e-6, **_):
    return ref.hc_head(x, fn, base, scale, hc_eps, rms_eps, OFFICIAL)


__all__ = ["hc_head", "hc_post", "hc_post_pre", "hc_pre"]
