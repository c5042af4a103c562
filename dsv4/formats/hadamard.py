"""The Sylvester Hadamard matrix of the indexer's rotation (spec §6), shared by the kernels and the
oracle."""
from __future__ import annotations

import functools

import torch


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
