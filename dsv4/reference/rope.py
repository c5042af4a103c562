"""Rotary embeddings with YaRN per layer type (spec §4.1).

Interleaved (GPT-J) pairs on the LAST 64 dims. Ratio-0 layers (incl. MTP): base rope_theta, no
YaRN. Compressed layers: base compress_rope_theta with YaRN. Tables are complex64, angles are the
fp32 product pos * f_i, as in the official ``precompute_freqs_cis``.
"""
from __future__ import annotations

import torch

from ..config import ModelConfig, rope_frequencies


class RopeTable:
    """cos/sin (as complex64) of one layer type, computed for any positions on demand.
    ``fp64_trig``: cos/sin of the fp32 angle evaluated in fp64 and rounded once (invariant modes:
    vectorised and scalar fp32 sin/cos differ in the last ulp)."""

    def __init__(self, cfg: ModelConfig, ratio: int, device: torch.device | str = "cpu", fp64_trig: bool = False):
        self.freqs = rope_frequencies(cfg, ratio).to(device)
        self.fp64_trig = fp64_trig

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        angles = torch.outer(positions.to(torch.float32), self.freqs)
        if self.fp64_trig:
            a = angles.double()
            return torch.complex(a.cos().float(), a.sin().float())
        return torch.polar(torch.ones_like(angles), angles)  # [n, rd/2] complex64


def apply_rope(x: torch.Tensor, freqs_cis: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 64 dims of ``x`` [n, ..., D]; ``freqs_cis`` [n, 32]. fp32 math, x's dtype out."""
    rd = freqs_cis.shape[-1] * 2
    rot = x[..., -rd:].float().unflatten(-1, (-1, 2)).contiguous()
    f = freqs_cis.conj() if inverse else freqs_cis
    f = f.view(f.shape[0], *([1] * (x.dim() - 2)), f.shape[-1])
    y = torch.view_as_real(torch.view_as_complex(rot) * f).flatten(-2)
    return torch.cat([x[..., :-rd], y.to(x.dtype)], dim=-1)
