"""Model runner: one model step for a mixed batch of prefill chunks, decode tokens and speculative
verify chunks.

Decode rows run as ``DecodeContext`` forwards, replayed from a CUDA graph per (batch-size bucket,
rows per sequence) where the model's ops allow it (``DeepseekV4.graph_safe``, not
``enforce_eager``): single tokens past position 0 as one forward, and the verify chunks (the
pending token and its K drafts, ``all_rows``) grouped by length, one forward per length with every
sequence's rows at consecutive positions (``verify_path = "decode"``, the default; ``"prefill"``
runs them as prefill chunks, for comparisons). Everything else -- prompt chunks, chunks whose prompt
rows are scored, verify chunks that pass a prefix-cache snapshot boundary -- runs as one
``PrefillContext`` forward. The step's host-side inputs (tokens, positions, slots, block tables)
are built once, as int64 tensors in pinned memory on a GPU, and copied without blocking.

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
    def __init__(self, model: DeepseekV4, max_num_seqs: int, cuda_graphs: bool = True, broadcast=None,
                 verify_rows: int = 1):
        """``broadcast(chunks, scores, restores, captures, all_rows, keep)``: called with each step's
        chunks before they run (tensor parallelism: rank 0 sends them to the workers,
        ``engine.tp_workers``). ``verify_rows``: K + 1 of speculative decoding (1: none); the decode
        step is captured for 1 row per sequence and for ``verify_rows``."""
        self.model, self.device = model, model.device
        self.broadcast = broadcast
        self.graphs = None
        if cuda_graphs and self.device.type == "cuda" and model.graph_safe:
            self.graphs = CudaGraphDecoder(model, max_num_seqs, rows=(1, verify_rows))
        self.pin = self.device.type == "cuda"
        self.per_sequence = not model.ops.kernels
        self.verify_path = "decode"

    def _host(self, rows: list[list[int]], width: int, device: bool = True) -> torch.Tensor:
        t = torch.full((len(rows), width), -1, dtype=torch.long, pin_memory=self.pin)
        for r, row in enumerate(rows):
            t[r, :len(row)] = torch.as_tensor(row, dtype=torch.long)
        return t.to(self.device, non_blocking=True) if device else t

    def _decodes(self, chunks, scores, all_rows, captures) -> list[list[int]]:
        """Groups of chunk indices that run as one decode forward each: single tokens past position
        0, and verify chunks of one length (module doc); one chunk per group on the twins."""
        groups: dict[int, list[int]] = {}
        for i, (ids, st) in enumerate(chunks):
            n = ids.numel()
            if st.pos == 0 or i in scores:
                continue
            if n > 1 and (i not in all_rows or self.verify_path != "decode" or captures.get(i)):
                continue
            groups.setdefault(n, []).append(i)
        if self.per_sequence:
            return [[i] for n in sorted(groups) for i in groups[n]]
        return [groups[n] for n in sorted(groups)]

    def _decode(self, rows: list[int], chunks, keep) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """One decode forward of the chunks ``rows`` (all of one length R) -> (logits [W * R, V],
        final streams [W * R, hc, d] or None, W): rows j-major over W >= len(rows) sequences (a
        graph bucket's padding after the real ones)."""
        model = self.model
        sts = [chunks[i][1] for i in rows]
        toks = [chunks[i][0].reshape(-1).tolist() for i in rows]
        R, n = len(toks[0]), len(rows)
        b = self.graphs.bucket(n, R) if self.graphs is not None else None
        if b is not None:
            inp = self._host(self.graphs.layout(toks, [st.pos for st in sts], [st.slot for st in sts], b), b * R,
                             device=False)
            bt = self._host([st.block_table for st in sts] + [[]] * (b - n), model.max_blocks, device=False)
            logits, hidden = self.graphs.replay(b, R, inp, bt)
            return logits, hidden, b
        inp = self._host([[t[j] for j in range(R) for t in toks], [st.pos for st in sts], [st.slot for st in sts]],
                         n * R)
        bt = self._host([st.block_table for st in sts], model.max_blocks)
        ctx = model.decode_context(inp[0], inp[1, :n], inp[2, :n], bt, R)
        ctx.keep_hidden = any(i in keep for i in rows)
        return model(ctx), ctx.hidden, n

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
        chunk passes them. Results that come from a CUDA graph are views of its static outputs:
        use them before the next step."""
        model, cache = self.model, self.model.cache
        scores, restores, captures = scores or {}, restores or [], captures or {}
        self.scored, self.hidden = {}, {}
        if self.broadcast is not None:
            self.broadcast(chunks, scores, restores, captures, all_rows, keep)
        for snap, slot, pos in restores:
            cache.restore(snap, slot, pos)
        dec = self._decodes(chunks, scores, all_rows, captures)
        is_dec = {i for g in dec for i in g}
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
        for rows in dec:
            logits, hidden, W = self._decode(rows, chunks, keep)
            R = chunks[rows[0]][0].numel()
            logits = logits.view(R, W, -1)
            if hidden is not None:
                hidden = hidden.view(R, W, *hidden.shape[1:])
            for r, i in enumerate(rows):
                st = chunks[i][1]
                out[i] = logits[:, r] if i in all_rows else logits[R - 1, r]
                if i in keep:
                    self.hidden[i] = hidden[:, r]
                st.advance_to(st.pos + R)
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
