"""Model runner: one model step for a mixed batch of prefill chunks and decode tokens.

Prefill chunks (any chunk that is not a single token past position 0) run as one
``PrefillContext`` forward; decode tokens as one ``DecodeContext`` forward, replayed from a CUDA
graph per batch-size bucket where the model's ops allow it (``DeepseekV4.graph_safe``, not
``enforce_eager``). The step's host-side inputs (positions, slots, block tables) are built once,
as int64 tensors in pinned memory on a GPU, and copied without blocking.

Prefix caching: a step first restores the snapshots of the sequences it admitted on a cache hit
(``KVCache.restore``), then runs; the snapshots it takes at block boundaries come from inside the
prefill forward (``Segment.snaps``, ``layers.attention``) or, for decode rows, from the slot after
the forward (``KVCache.capture``).

On the torch twins (CPU) each sequence's chunk runs as its own forward: the twins' vectorised
elementwise ops (rsqrt, exp, ...) round a value's last ulp by where it sits in the batch tensor,
so a request's tokens would otherwise depend on what it is batched with (n > 1 greedy samples
would differ). Run alone, a request's numbers depend only on its own chunks.
"""
from __future__ import annotations

import torch

from ..model.deepseek_v4 import CudaGraphDecoder, DeepseekV4
from .scheduler import ScheduledChunk


class ModelRunner:
    def __init__(self, model: DeepseekV4, max_num_seqs: int, cuda_graphs: bool = True, broadcast=None):
        """``broadcast(chunks, scores, restores, captures)``: called with each step's chunks before
        they run (tensor parallelism: rank 0 sends them to the workers, ``engine.tp_workers``)."""
        self.model, self.device = model, model.device
        self.broadcast = broadcast
        self.graphs = None
        if cuda_graphs and self.device.type == "cuda" and model.graph_safe:
            self.graphs = CudaGraphDecoder(model, max_num_seqs)
        self.pin = self.device.type == "cuda"
        self.per_sequence = not model.ops.kernels

    def _host(self, rows: list[list[int]], width: int) -> torch.Tensor:
        t = torch.full((len(rows), width), -1, dtype=torch.long, pin_memory=self.pin)
        for r, row in enumerate(rows):
            t[r, :len(row)] = torch.as_tensor(row, dtype=torch.long)
        return t.to(self.device, non_blocking=True)

    def forward(self, chunks: list[tuple[torch.Tensor, object]], scores: dict | None = None,
                all_rows: set | frozenset = frozenset(), keep: set | frozenset = frozenset(),
                restores: list | None = None, captures: dict | None = None) -> list[torch.Tensor]:
        """Run each (token ids, sequence state) chunk; fp32 logits of each chunk's last token.
        Advances every state's position. ``scores`` {chunk index: (next-token ids of its first
        rows, k)}: those rows are scored (``PrefillContext.score``); the results land in
        ``self.scored`` {chunk index: (logprob, rank, top-k logprobs, top-k ids)}. Speculative
        decoding: the chunks in ``all_rows`` (verify chunks) return the logits of every row [n, V];
        those in ``keep`` (every chunk of a speculating sequence; a superset of ``all_rows``) leave
        their final residual streams in ``self.hidden`` {chunk index: [n, hc, d]} for the drafter.
        Prefix caching: ``restores`` [(snapshot, slot, position)] are put into the slots before
        anything runs; ``captures`` {chunk index: [(block boundary, snapshot)]} are taken as the
        chunk passes them."""
        model, cache = self.model, self.model.cache
        scores, restores, captures = scores or {}, restores or [], captures or {}
        self.scored, self.hidden = {}, {}
        if self.broadcast is not None:
            self.broadcast(chunks, scores, restores, captures)
        for snap, slot, pos in restores:
            cache.restore(snap, slot, pos)
        dec = [i for i, (ids, st) in enumerate(chunks)
               if ids.numel() == 1 and st.pos > 0 and i not in scores and i not in keep]
        is_dec = set(dec)
        rest = [i for i in range(len(chunks)) if i not in is_dec]
        out: list = [None] * len(chunks)
        groups = [[i] for i in rest] if self.per_sequence else ([rest] if rest else [])
        for g in groups:
            part = [chunks[i] for i in g]
            ctx = model.prefill_context(part, [i in all_rows for i in g], snaps=[captures.get(i, []) for i in g])
            ctx.keep_hidden = any(i in keep for i in g)
            asked, r0 = [], 0
            for i in g:
                if i in scores:
                    nxt, k = scores[i]
                    ctx.score.append((torch.arange(r0, r0 + len(nxt), device=model.device),
                                      torch.as_tensor(nxt, dtype=torch.long), k))
                    asked.append(i)
                r0 += chunks[i][0].numel()
            logits = model(ctx)
            self.scored.update(zip(asked, ctx.scored))
            row = 0
            for i, (ids, st), seg in zip(g, part, ctx.segs):
                n = ids.numel() if i in all_rows else 1
                out[i] = logits[row] if i not in all_rows else logits[row:row + n]
                row += n
                if i in keep:
                    self.hidden[i] = ctx.hidden[seg.r0:seg.r1]
                st.advance_to(st.pos + ids.numel())
        for rows in ([[i] for i in dec] if self.per_sequence else ([dec] if dec else [])):
            sts = [chunks[i][1] for i in rows]
            tokens, pos, slots = self._host([[int(chunks[i][0]) for i in rows], [st.pos for st in sts],
                                             [st.slot for st in sts]], len(rows))
            bt = self._host([st.block_table for st in sts], model.max_blocks)
            if self.graphs is not None:
                logits = self.graphs(tokens, pos, slots, bt)
            else:
                logits = model(model.decode_context(tokens, pos, slots, bt))
            for r, (i, st) in enumerate(zip(rows, sts)):
                out[i] = logits[r]
                st.advance_to(st.pos + 1)
                for pos, snap in captures.get(i, []):
                    cache.capture(st.slot, snap, pos)
        return out

    def run(self, batch: list[ScheduledChunk], all_rows: set | frozenset = frozenset(),
            keep: set | frozenset = frozenset()) -> list[torch.Tensor]:
        """Advance every scheduled sequence by its chunk (a speculating sequence's decode chunk
        carries its draft tokens); per chunk fp32 logits: [V] of its last row, or [n, V] of every
        row for the chunks in ``all_rows`` (see ``forward``)."""
        chunks, scores, restores, captures = [], {}, [], {}
        for i, c in enumerate(batch):
            s = c.seq
            p0 = s.num_computed
            chunks.append((torch.tensor(s.chunk_ids(p0, c.num_tokens), dtype=torch.long), s.state))
            nxt = s.prompt_targets(p0, c.num_tokens)
            if nxt:
                scores[i] = (nxt, s.params.prompt_logprobs)
            if c.restore is not None:
                restores.append((c.restore, s.slot, p0))
            if c.captures:
                captures[i] = [(x.pos, x.snap) for x in c.captures]
        logits = self.forward(chunks, scores, all_rows, keep, restores, captures)
        for i, res in self.scored.items():
            batch[i].seq.add_prompt_logprobs(batch[i].seq.num_computed, res)
        for c in batch:
            c.seq.num_computed += c.num_tokens
        return logits
