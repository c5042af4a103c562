"""Scaled Walsh-Hadamard rotation of the indexer (spec §6): y = (x @ H) * 128^-0.5, fp32 inside."""
from __future__ import annotations

import functools

import torch

from .numerics import Numerics


@functools.lru_cache(maxsize=4)
def hadamard_matrix(n: int, device: str = "cpu") -> torch.Tensor:
    """Unnormalised Sylvester Hadamard matrix H[i, j] = (-1)^popcount(i & j), natural order."""
    i = torch.arange(n)
    bits = (i[:, None] & i[None, :])
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return (1 - 2 * parity).to(torch.float32).to(device)


def hadamard_128(x: torch.Tensor, num: Numerics) -> torch.Tensor:
    n = x.shape[-1]
    h = hadamard_matrix(n, str(x.device))
    return num.round(num.mm(x.float(), h) * n ** -0.5)
