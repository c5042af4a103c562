"""Model runner: one forward for a mixed batch of prefill chunks and decode tokens.

The model is reached through a backend: today ``ReferenceBackend`` (the reference ops on CPU or
GPU, reading and writing the paged quantised cache through the format codecs, so its numbers are
the ones a fused kernel must reproduce). The GPU kernel backends plug in behind the same
``forward(chunks) -> logits`` call.
"""
from __future__ import annotations

from typing import Protocol

import torch

from ..reference.model import ReferenceModel
from .scheduler import ScheduledChunk


class Backend(Protocol):
    name: str

    def forward(self, chunks: list[tuple[torch.Tensor, object]]) -> list[torch.Tensor]:
        """Run each (token ids, sequence state) chunk; fp32 logits of each chunk's last token."""


class ReferenceBackend:
    name = "reference"

    def __init__(self, model: ReferenceModel):
        self.model = model

    def forward(self, chunks):
        return self.model.forward(chunks)


class ModelRunner:
    def __init__(self, backend: Backend, device: torch.device | str = "cpu"):
        self.backend, self.device = backend, torch.device(device)

    def run(self, batch: list[ScheduledChunk]) -> torch.Tensor:
        """Advance every scheduled sequence by its chunk; [B, V] fp32 logits (one row per chunk)."""
        chunks = []
        for c in batch:
            s = c.seq
            ids = torch.tensor(s.all_ids[s.num_computed:s.num_computed + c.num_tokens], dtype=torch.long,
                               device=self.device)
            chunks.append((ids, s.state))
        logits = self.backend.forward(chunks)
        for c in batch:
            c.seq.num_computed += c.num_tokens
        return torch.stack(logits)
