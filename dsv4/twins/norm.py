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


__all__ = ["rms_norm"]
