"""Twin of ``kernels.norm``: the reference RMSNorm with official numerics."""
from __future__ import annotations

import torch

from ..reference.norm import rms_norm as _rms_norm
from ..reference.numerics import OFFICIAL


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    D = x.shape[-1]
    if weight.numel() != D:
        raise ValueError(f"rms_norm: weight has {weight.numel()} elements, x has last dim {D}")
    return _rms_norm(x, weight, eps, OFFICIAL)


def rms_norm_pair(x: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor, eps: float):
    """(rms_norm(x[:, :Da], wa), rms_norm(x[:, Da:], wb)), Da = wa.numel()."""
    DA, DB = wa.numel(), wb.numel()
    if x.dim() != 2 or x.shape[1] != DA + DB:
        raise ValueError(f"rms_norm_pair: x must be [T, {DA} + {DB}] (the two weights' sizes), got {tuple(x.shape)}")
    return rms_norm(x[:, :DA], wa, eps), rms_norm(x[:, DA:], wb, eps)


__all__ = ["rms_norm", "rms_norm_pair"]
