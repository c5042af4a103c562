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


class FastDecodeBackend:
    """Decode tokens (1-token chunks of sequences past position 0) go through the tensorised
    ``FastDecoder`` — CUDA-graph replays on a GPU — with attention by the Triton kernels
    (``attention='triton'``) or the reference twin. Prefill chunks run the reference ops on the
    same paged cache, or with ``fused`` the kernels (``FastPrefiller``). All write the same cache
    layout, so they mix freely."""

    def __init__(self, model: ReferenceModel, cache, max_model_len: int, attention: str = "triton",
                 cuda_graphs: bool = True, fused: bool = False):
        from ..model.decode import CudaGraphDecoder, FastDecoder
        self.model, self.cache = model, cache
        self.name = attention
        self.decoder = FastDecoder(model, cache, max_model_len, attention, fused)
        self.step = self.decoder.forward
        self.prefill = self.model.forward
        if fused:
            from ..model.prefill import FastPrefiller
            self.prefill = FastPrefiller(self.decoder).forward
        if cuda_graphs and cache.device.type == "cuda":
            self.step = CudaGraphDecoder(self.decoder).forward

    def forward(self, chunks):
        dec = [i for i, (ids, st) in enumerate(chunks) if ids.numel() == 1 and st.pos > 0]
        rest = [i for i in range(len(chunks)) if i not in set(dec)]
        out: list = [None] * len(chunks)
        if rest:
            for i, lg in zip(rest, self.prefill([chunks[i] for i in rest])):
                out[i] = lg
        if dec:
            dev = self.cache.device
            sts = [chunks[i][1] for i in dec]
            tokens = torch.cat([chunks[i][0].view(1) for i in dec]).to(dev)
            pos = torch.tensor([st.pos for st in sts], dtype=torch.long, device=dev)
            slots = torch.tensor([st.slot for st in sts], dtype=torch.long, device=dev)
            bt = torch.full((len(dec), self.decoder.max_blocks), -1, dtype=torch.long)
            for r, st in enumerate(sts):
                bt[r, :len(st.block_table)] = torch.tensor(st.block_table, dtype=torch.long)
            logits = self.step(tokens, pos, slots, bt.to(dev))
            for r, (i, st) in enumerate(zip(dec, sts)):
                out[i] = logits[r]
                st.advance_to(st.pos + 1)
        return out


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
