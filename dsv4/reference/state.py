"""Per-sequence state of the reference model: explicit objects, never module buffers.

Attention and compressors talk to the state only through the methods below, so a paged,
quantised cache (``dsv4.engine.kv_cache``) can stand in for these in-memory objects. A
``SequenceState`` holds, per layer, the last ``window`` raw KV rows, the compressed entries and
the compressor's pending rows; any call pattern (prefill at 0, chunked prefill, 1-token decode,
a batch of sequences at different positions) reads and extends it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


class CompressorState:
    """Compressed entries of one compressor plus its not-yet-pooled input rows (fp32 K and
    score rows; for the overlapping ratio-4 compressor also the previous window's rows)."""

    def __init__(self, ratio: int, dim: int, dtype: torch.dtype, device):
        coff = 2 if ratio == 4 else 1
        self.ratio, self.dim, self.overlap = ratio, dim, ratio == 4
        self._k = torch.zeros(0, coff * dim, dtype=torch.float32, device=device)
        self._s = self._k.clone()
        self._start = 0
        self._entries = torch.zeros(0, dim, dtype=dtype, device=device)

    @property
    def num_entries(self) -> int:
        return self._entries.shape[0]

    def pending(self, p0: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(K rows, score rows, position of the first row) for positions start .. p0-1."""
        assert self._start + self._k.shape[0] == p0, "state is not at this position"
        return self._k, self._s, self._start

    def set_pending(self, k: torch.Tensor, s: torch.Tensor, start: int) -> None:
        self._k, self._s, self._start = k, s, start

    def entries(self) -> torch.Tensor:
        return self._entries

    def append_entries(self, new: torch.Tensor) -> None:
        self._entries = torch.cat([self._entries, new])


class LayerState:
    """One layer's state: the last ``window`` KV rows, and the compressor/indexer states."""

    def __init__(self, window: int, head_dim: int, dtype: torch.dtype, device,
                 compressor: CompressorState | None = None, indexer: CompressorState | None = None):
        self.win = window
        self._rows = torch.zeros(0, head_dim, dtype=dtype, device=device)
        self._end = 0
        self.compressor, self.indexer = compressor, indexer

    def read_window(self, p0: int) -> torch.Tensor:
        """KV rows of positions max(0, p0 - window) .. p0-1."""
        assert self._end == p0, "state is not at this position"
        return self._rows

    def write_window(self, rows: torch.Tensor, end_pos: int) -> None:
        """Store the rows of positions end_pos - len(rows) .. end_pos-1 (len <= window; every
        position of the last window must be among them or already stored)."""
        keep = max(0, min(self._rows.shape[0], self.win - rows.shape[0]))
        self._rows = torch.cat([self._rows[self._rows.shape[0] - keep:], rows])
        self._end = end_pos


class WindowRing:
    """One DSpark stage's sliding window of context KV rows, in the official layout: the row of
    position p sits in slot p % window, so positions max(0, end - window) .. end-1 are present and
    slots 0 .. min(window, end)-1 are the written ones. Holds committed context only (never draft
    block rows), so a rejected draft leaves nothing to roll back."""

    def __init__(self, window: int, head_dim: int, dtype: torch.dtype, device):
        self.win = window
        self._slots = torch.zeros(window, head_dim, dtype=dtype, device=device)
        self.end = 0

    def write(self, rows: torch.Tensor, p0: int) -> None:
        """Store the rows of positions p0 .. p0+len(rows)-1; p0 must continue the ring."""
        if p0 != self.end:
            raise ValueError(f"DSpark context rows must continue at position {self.end}, got position {p0}")
        n = rows.shape[0]
        keep = rows[max(0, n - self.win):]
        pos = torch.arange(p0 + n - keep.shape[0], p0 + n, device=rows.device)
        self._slots[pos % self.win] = keep.to(self._slots.dtype)
        self.end = p0 + n

    def keys(self) -> tuple[torch.Tensor, int]:
        """(all ``window`` slots, how many of them are written: slots 0 .. count-1)."""
        return self._slots, min(self.win, self.end)


@dataclass
class DSparkState:
    """One sequence's DSpark draft state: a ring per stage, all at the same context position."""
    rings: list[WindowRing]

    @property
    def pos(self) -> int:
        """Context positions written (the next anchor sits at this position)."""
        return self.rings[0].end


@dataclass
class SequenceState:
    layers: list[LayerState]
    pos: int = 0                               # tokens already processed
    mtp: LayerState | None = None
    mtp_pos: int = 0
    last_hidden: torch.Tensor | None = field(default=None, repr=False)  # [n, hc, d] pre-hc_head residual
    dspark: DSparkState | None = None
    # [n, stages*d] DSpark target features of the last forward's rows (``forward(capture=True)``)
    last_features: torch.Tensor | None = field(default=None, repr=False)
