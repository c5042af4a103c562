"""Per-sequence state of the reference model: explicit objects, never module buffers.

A ``SequenceState`` holds, per layer, the last ``window`` raw KV rows, the compressed entries and
the compressor's pending rows. Any call pattern (prefill at 0, chunked prefill, 1-token decode,
a batch of sequences at different positions) reads and extends the same state.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class CompressorState:
    ratio: int
    overlap: bool
    dim: int                       # c: 512 (main) or 128 (indexer)
    rows_k: torch.Tensor           # fp32 [n, coff*c] K rows of not-yet-pooled (and, overlap: previous) windows
    rows_s: torch.Tensor           # fp32 [n, coff*c] matching scores Z + ape
    rows_start: int                # position of rows_k[0]
    entries: torch.Tensor          # [n_entries, c] finished compressed entries (post-processed)

    @classmethod
    def empty(cls, ratio: int, dim: int, dtype: torch.dtype, device) -> "CompressorState":
        coff = 2 if ratio == 4 else 1
        z = torch.zeros(0, coff * dim, dtype=torch.float32, device=device)
        return cls(ratio, ratio == 4, dim, z, z.clone(), 0, torch.zeros(0, dim, dtype=dtype, device=device))


@dataclass
class LayerState:
    window: torch.Tensor                      # [<=win, 512] KV rows of positions pos-len .. pos-1
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None


@dataclass
class SequenceState:
    layers: list[LayerState]
    pos: int = 0                               # tokens already processed
    mtp: LayerState | None = None
    mtp_pos: int = 0
    last_hidden: torch.Tensor | None = field(default=None, repr=False)  # [n, hc, d] pre-hc_head residual
