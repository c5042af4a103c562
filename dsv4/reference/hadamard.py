"""Scaled Walsh-Hadamard rotation of the indexer (spec §6): y = (x @ H) * 128^-0.5, fp32 inside."""
from __future__ import annotations

import torch

from ..formats.hadamard import hadamard_matrix
from .numerics import Numerics


def hadamard_128(x: torch.Tensor, num: Numerics) -> torch.Tensor:
    n = x.shape[-1]
    h = hadamard_matrix(n, str(x.device))
    return num.round(num.mm(x.float(), h) * n ** -0.5)
