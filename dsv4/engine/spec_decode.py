"""Speculative decoding: vLLM's ``speculative_config``, the drafters, and the acceptance rule.

Interface (vLLM's names): ``LLM(..., speculative_config={"method": "mtp", "num_speculative_tokens": K})``
and ``--speculative-config '{"method": "mtp", "num_speculative_tokens": K}'`` on ``serve``,
``generate`` and ``bench``. ``method`` 'mtp' drafts with the checkpoint's April MTP block
(``mtp.0.*``), reused for every draft step as vLLM and the official inference code do.

One engine step of a speculating sequence (``LLMEngine.step``):

1. **verify**: the target runs ``[pending token, d_1 .. d_k]`` at positions ``N .. N+k``
   (``N`` = tokens already in the cache) and returns the logits of every row. It runs on the decode
   path (``engine.runner``): a ``DecodeContext`` of ``k + 1`` rows per sequence, the verify chunks
   of one length batched into one forward, replayed from a CUDA graph captured for ``K + 1`` rows
   where graphs are on (shorter chunks, near ``max_tokens`` or ``max_model_len``, run it eagerly).
   Everything row-wise runs once over all rows; each layer advances the per-slot rings row by row
   in position order, as ``k + 1`` plain decode steps would (``layers.attention``);
2. **accept**: row j is sampled exactly as a plain decode step would sample it with ``d_1 .. d_j``
   appended to the output (penalties, logit_bias, min_tokens, temperature / top-k / top-p, the
   request's generator). The draft tokens are accepted while row j's token equals ``d_{j+1}``; the
   first row whose token differs, or row k, gives the bonus token. For a drafter that proposes one
   token with certainty (greedy drafting) this is the standard rejection sampling: ``d`` is kept
   with probability ``p(d)``, and on rejection the token is drawn from ``p`` without ``d``, so every
   emitted token has the target's distribution. Greedy requests therefore get exactly the tokens of
   plain greedy decoding (up to the last-bit differences between a verify chunk and a decode step,
   which the engine's batching tolerance covers). ``rejection_sample`` is the general rule for a
   drafter that samples from a distribution ``q``; it is tested on its own;
3. **roll back**: everything the cache keeps is indexed by position (window ring, compressed
   entries and indexer keys by entry number, the counters) except the compressors' fp32 rings of
   pending rows, which a rejected position may have overwritten while they still hold rows an
   accepted position needs (a ring of ``coff * m`` rows wraps inside a verify chunk). Whatever
   the path, after a verify chunk ring row ``q % rows`` holds position ``q``'s row for the last
   ``rows`` positions of the chunk and is untouched elsewhere (the decode path writes each row's,
   the prefill path keeps the chunk's last ``rows``). The engine
   copies what a verify chunk's positions map to in every per-slot ring (the window pages and the
   compressor rings) before it runs and writes back those of the rejected positions
   (``KVCache.save_positions`` / ``restore_positions``), then sets the state to the accepted
   length; entries a rejected position completed are not visible (entry counts follow the
   position) and are written again when that position is recomputed;
4. **draft**: the drafter sees every row the target computed and kept (prefill chunks, accepted
   verify rows) with the token that follows it, and proposes ``k`` tokens for the next step.

The acceptance criterion of steps 1-3: after a verify chunk is cut back, nothing depends on what
the rejected draft tokens were (tests/test_spec_decode.py checks the logits that follow for bit
equality under two different sets of rejected tokens).

The MTP drafter (``MTPDrafter``): MTP row ``i`` combines the target's pre-``hc_head`` residual at
position ``i`` with the embedding of token ``i + 1`` and predicts token ``i + 2`` (vLLM's and
DeepSeek-V3's convention; spec §9); it has its own 128-token window (a draft layer of the KV cache)
at the target's positions. Draft step 1 is the MTP row of the last committed position; step
``s > 1`` feeds the previous step's output residual and draft token at the next position. Fills of
up to K + 1 rows (the accepted rows of a verify) and the draft steps run through the decode step
(``DeepseekV4.mtp_decode``), replayed from CUDA graphs on the GPU (``CudaGraphMTP``); longer fills
(prefill chunks) through the prefill path. What those
speculative MTP rows overwrite in the MTP window is put back once the drafts are made.

Sequences with structured outputs do not speculate (their grammar would have to walk the draft
tokens); they decode one token per step beside the others. ``num_speculative_tokens`` is clipped per
sequence so that drafts never pass ``max_tokens`` or ``max_model_len``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

METHODS = ("mtp", "dspark")
DRAFT_SAMPLE_METHODS = {"mtp": ("greedy",), "dspark": ("greedy", "probabilistic")}
_KNOWN_KEYS = {"method", "num_speculative_tokens", "model", "draft_sample_method"}
_HAS = {"none": "no draft (no mtp.* tensors)",
        "mtp": "the April MTP block (mtp.0: e_proj, h_proj, ...)",
        "dspark": "a DSpark draft (mtp.0-2 with main_proj and the Markov head: V4-*-DSpark / 0731 / 0813)"}


class SpeculativeConfigError(ValueError):
    """A ``speculative_config`` the engine cannot run; the message names the field."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int | None        # None: dspark's default, the block size (``resolve``)
    draft_sample_method: str = "greedy"

    def describe(self) -> str:
        return (f"{self.method}, {self.num_speculative_tokens} speculative token(s) per step"
                + (f", {self.draft_sample_method} drafts" if self.method == "dspark" else ""))


def parse_speculative_config(value: Any) -> SpeculativeConfig | None:
    """vLLM's ``speculative_config``: a dict, a JSON object string (the CLI's form) or None."""
    if value is None:
        return None
    if isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise SpeculativeConfigError(f"speculative_config: not a JSON object ({e.msg} at position {e.pos})") \
                from None
    if not isinstance(value, dict):
        raise SpeculativeConfigError(f"speculative_config: expected a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - _KNOWN_KEYS)
    if unknown:
        raise SpeculativeConfigError(f"speculative_config.{unknown[0]}: not supported (supported keys: "
                                     f"{', '.join(sorted(_KNOWN_KEYS))})")
    method = value.get("method")
    if method not in METHODS:
        raise SpeculativeConfigError(f"speculative_config.method: {method!r} is not supported; supported: "
                                     f"{', '.join(METHODS)}")
    if value.get("model") is not None:
        raise SpeculativeConfigError("speculative_config.model: the draft is read from the target checkpoint's "
                                     "mtp.* tensors; a separate draft model is not supported")
    k = value.get("num_speculative_tokens")
    if not (k is None and method == "dspark") and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
        raise SpeculativeConfigError(f"speculative_config.num_speculative_tokens: must be an integer >= 1, got {k!r}")
    dsm = value.get("draft_sample_method", "greedy")
    if dsm not in DRAFT_SAMPLE_METHODS[method]:
        raise SpeculativeConfigError(f"speculative_config.draft_sample_method: method {method!r} supports "
                                     f"{' or '.join(repr(m) for m in DRAFT_SAMPLE_METHODS[method])}, got {dsm!r}")
    return SpeculativeConfig(method, k, dsm)


def check_draft(spec: SpeculativeConfig, draft: str) -> None:
    """The checkpoint's draft (``CheckpointReader.draft``: 'none' | 'mtp' | 'dspark') must be the
    one ``spec.method`` drafts with."""
    if draft != spec.method:
        need = {"mtp": "the checkpoint's April MTP block", "dspark": "the checkpoint's DSpark draft"}[spec.method]
        hint = f" (use method '{draft}')" if draft in METHODS else ""
        raise SpeculativeConfigError(f"speculative_config.method: {spec.method!r} needs {need}, but this "
                                     f"checkpoint has {_HAS[draft]}{hint}")


def resolve(spec: SpeculativeConfig, cfg) -> SpeculativeConfig:
    """``spec`` against the model's config: dspark's ``num_speculative_tokens`` defaults to, and may
    not exceed, ``dspark_block_size`` (the draft proposes one block per step)."""
    if spec.method != "dspark":
        return spec
    B = cfg.dspark_block_size
    k = B if spec.num_speculative_tokens is None else spec.num_speculative_tokens
    if k > B:
        raise SpeculativeConfigError(f"speculative_config.num_speculative_tokens: {k} exceeds the DSpark draft's "
                                     f"block size (dspark_block_size={B})")
    return SpeculativeConfig(spec.method, k, spec.draft_sample_method)


def make_drafter(model, spec: SpeculativeConfig, runner, max_num_seqs: int):
    """The drafter ``spec`` (resolved) asks for, on ``model``, with its CUDA graphs wherever ``runner``
    (a ``ModelRunner``) captures the decode step. Rank 0 and every tensor-parallel worker build it
    the same way, in the same order after the runner: the graphs' captures run collectives that
    pair up across ranks."""
    k = spec.num_speculative_tokens
    if spec.method == "mtp":
        graphs = None
        if runner.graphs is not None:          # the decode step is captured: so are the MTP calls
            from ..model.deepseek_v4 import CudaGraphMTP
            graphs = CudaGraphMTP(model, max_num_seqs, k + 1)
        return MTPDrafter(model, runner.per_sequence, graphs, max_rows=k + 1)
    graphs = None
    if runner.graphs is not None:              # the decode step is captured: so is the draft
        from ..model.dspark import CudaGraphDraft
        graphs = CudaGraphDraft(model, max_num_seqs, k)
    return DSparkDrafter(model, runner.per_sequence, spec.draft_sample_method, graphs)


def draft_step(drafter, cache, items, k_of: dict) -> set:
    """One step's drafting with prefix-cache snapshots (``LLMEngine._draft``, and every tensor-parallel
    worker alike). ``items`` [(seq, p0, streams [n, ...], next token ids [n], captures [(pos, snap)])]:
    the drafter's fills (``propose``) and the block boundaries in (p0, p0 + n] where this step takes
    a snapshot. A snapshot's draft part (``KVCache.capture_draft``) must see the drafter's rings
    holding exactly the positions before its boundary, so each fill is cut at its boundaries and
    the pieces run in rounds (piece r of every fill in round r), each boundary captured after the
    round its piece ends in; a sequence drafts (``k_of``) in the round of its last piece. Without
    captures this is one ``propose``. Returns the snapshots whose draft part was taken."""
    pieces = []
    for seq, p0, h, nxt, caps in items:
        n = len(nxt)
        bounds = [0] + sorted({pos - p0 for pos, _ in caps if 0 < pos - p0 < n}) + [n]
        pieces.append(list(zip(bounds[:-1], bounds[1:])))
    done = set()
    for r in range(max(map(len, pieces), default=1)):
        fills, ks, after = [], {}, []
        for (seq, p0, h, nxt, caps), ps in zip(items, pieces):
            if r >= len(ps):
                continue
            a, b = ps[r]
            fills.append((seq, p0 + a, h[a:b], nxt[a:b]))
            if r == len(ps) - 1 and seq in k_of:
                ks[seq] = k_of[seq]
            after += [(seq.slot, snap, pos, h[pos - 1 - p0]) for pos, snap in caps if pos - p0 == b]
        drafter.propose(fills, ks)
        for slot, snap, pos, row in after:
            cache.capture_draft(slot, snap, pos, row)
            done.add(snap)
    return done


def accept_greedy_draft(sampled: list[int], draft: list[int]) -> int:
    """Number of draft tokens kept when row j of the verify chunk sampled ``sampled[j]`` (k + 1
    rows for k drafts): the longest prefix with ``sampled[j] == draft[j]``."""
    a = 0
    while a < len(draft) and sampled[a] == draft[a]:
        a += 1
    return a


def rejection_sample(target: torch.Tensor, draft_probs: torch.Tensor, draft: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[int, int]:
    """Standard speculative rejection sampling for one sequence (Leviathan et al.; vLLM's
    ``rejection_sample_method: standard``): ``target`` [k+1, V] and ``draft_probs`` [k, V]
    probabilities, ``draft`` [k] the drafted tokens (drawn from ``draft_probs``). Returns
    ``(accepted, next token)``: draft token j is kept with probability min(1, p_j(d_j) / q_j(d_j));
    at the first rejection the next token is drawn from normalize(max(0, p_j - q_j)); when all k
    are kept it is drawn from ``target[k]``. The emitted tokens follow the target distribution."""
    k = draft.numel()
    dev = target.device
    for j in range(k):
        d = int(draft[j])
        p, q = float(target[j, d]), float(draft_probs[j, d])
        u = float(torch.rand((), generator=generator, device=dev))
        if q > 0 and u < min(1.0, p / q):
            continue
        resid = (target[j] - draft_probs[j]).clamp(min=0)
        if float(resid.sum()) <= 0:         # p == q: any rejection leaves the target itself
            resid = target[j]
        return j, int(torch.multinomial(resid / resid.sum(), 1, generator=generator))
    return k, int(torch.multinomial(target[k], 1, generator=generator))


@dataclass
class _At:
    """Where a long MTP fill's rows go: ``prefill_context`` reads a chunk's position, slot and block
    table. The MTP block has only a window (ring per slot), so the table is only checked for length:
    it is padded with the model's scratch block where rows run past the sequence's blocks."""
    pos: int
    slot: int
    block_table: list


class MTPDrafter:
    """Drafts with the target's April MTP block (module doc). ``propose`` fills the MTP window with
    the rows the target computed and drafts for the sequences that speculate next step. Every MTP
    call goes through the decode step (``DeepseekV4.mtp_decode``: a fill of n rows per sequence,
    then single draft rows), replayed from ``graphs`` (a ``CudaGraphMTP``) when given; fills are
    grouped by length. The draft tokens stay on the device until the last step."""

    def __init__(self, model, per_sequence: bool, graphs=None, max_rows: int = 8):
        """``max_rows``: fills up to this many rows go through the decode step; longer ones (prefill
        chunks) through the prefill path, whose cost does not grow with a per-row cache loop."""
        self.model, self.per_sequence, self.graphs, self.max_rows = model, per_sequence, graphs, max_rows

    def _prefill_fill(self, g):
        """A group of long fills through the prefill path -> per fill (logits of its last row [V],
        output streams of its last row [hc, d])."""
        from ..formats.paging import blocks_needed
        m = self.model
        chunks = []
        for seq, p0, _, nxt in g:
            bt = list(seq.block_table)
            bt += [m.scratch_block] * max(0, blocks_needed(p0 + len(nxt)) - len(bt))
            chunks.append((torch.tensor(nxt, dtype=torch.long), _At(p0, seq.slot, bt)))
        ctx = m.prefill_context(chunks)
        logits, x = m.mtp_forward(ctx, torch.cat([h for _, _, h, _ in g]))
        return [(logits[j], x[sg.r1 - 1]) for j, sg in enumerate(ctx.segs)]

    def _call(self, tokens, seqs, pos, rows, h):
        m, dev = self.model, self.model.device
        bt = torch.full((len(seqs), m.max_blocks), -1, dtype=torch.long)
        for r, s in enumerate(seqs):
            bt[r, :len(s.block_table)] = torch.as_tensor(s.block_table, dtype=torch.long)
        args = (tokens, torch.tensor(pos, device=dev), torch.tensor([s.slot for s in seqs], device=dev), bt.to(dev),
                rows, h)
        return self.graphs(*args) if self.graphs is not None else m.mtp_decode(*args)

    def _groups(self, items, key):
        if self.per_sequence:
            return [[it] for it in items]
        by = {}
        for it in items:
            by.setdefault(key(it), []).append(it)
        return list(by.values())

    @torch.no_grad()
    def propose(self, fills, k_of: dict) -> None:
        """``fills``: [(seq, p0, streams [n, hc, d], next token ids [n])]: the target's rows at
        positions p0 .. p0+n-1 and the token after each. Writes them into the MTP window; then every
        sequence with ``k_of[seq] = k > 0`` gets ``k`` greedy draft tokens in ``seq.draft_ids``
        (its fill ends at its last committed position)."""
        dev = self.model.device
        live = []                      # [seq, N, k, last output streams [hc, d], draft tokens (device)]
        long = [it for it in fills if len(it[3]) > self.max_rows]
        for g in self._groups(long, key=lambda it: 0):
            for (seq, p0, _, nxt), (logits, x) in zip(g, self._prefill_fill(g)):
                k = k_of.get(seq, 0)
                if k > 0:
                    live.append([seq, p0 + len(nxt), k, x.clone(), [logits.argmax()]])
        for g in self._groups([it for it in fills if len(it[3]) <= self.max_rows], key=lambda it: len(it[3])):
            n, B = len(g[0][3]), len(g)
            tokens = torch.tensor([[nxt[j] for _, _, _, nxt in g] for j in range(n)], device=dev).view(-1)
            h = torch.stack([h for _, _, h, _ in g], 1).reshape(n * B, *g[0][2].shape[1:])
            logits, x = self._call(tokens, [s for s, *_ in g], [p0 for _, p0, _, _ in g], n, h)
            d1 = logits.argmax(dim=-1)
            xl = x.view(n, B, *x.shape[1:])[n - 1]
            for b, (seq, p0, _, _) in enumerate(g):
                k = k_of.get(seq, 0)
                if k > 0:
                    live.append([seq, p0 + n, k, xl[b].clone(), [d1[b].clone()]])
        # the speculative MTP rows (positions N .. N+k-2) overwrite ring entries of positions 128
        # earlier that later drafts still read: they are put back once the drafts are made
        saved = [(it[0], it[1], self.model.cache.save_positions(it[0].slot, it[1], it[1] + it[2] - 1, draft=True))
                 for it in live if it[2] > 1]
        for step in range(1, max((it[2] for it in live), default=0)):
            for g in self._groups([it for it in live if it[2] > step], key=lambda it: 0):
                tokens = torch.stack([it[4][-1] for it in g])
                h = torch.stack([it[3] for it in g])
                logits, x = self._call(tokens, [it[0] for it in g], [it[1] + step - 1 for it in g], 1, h)
                nxt = logits.argmax(dim=-1)
                for b, it in enumerate(g):
                    it[4].append(nxt[b].clone())
                    it[3] = x[b].clone()
        for it in live:
            it[0].draft_ids = torch.stack(it[4]).tolist()
        for seq, pos, rows in saved:
            n = len(seq.draft_ids) - 1
            self.model.cache.restore_positions(seq.slot, pos, pos + n, rows, pos, draft=True)


class DSparkDrafter:
    """Drafts with the checkpoint's DSpark draft (``model.dspark``; math: ``reference.dspark``).
    ``propose`` writes the context rows of the positions the target committed (the DSpark feature
    of each row, ``DeepseekV4.forward`` with ``keep_hidden``) into the stages' rings, then drafts one
    block for every sequence that speculates next step: the anchor is the token after its last
    committed row (the pending token, at position ``num_computed``), the drafts are the first ``k``
    of the block's Markov chain. The rings only ever hold committed positions, so a rejected draft
    needs no roll-back; a preempted sequence's rings are written again by its recomputed prefill.

    ``draft_sample_method`` 'greedy': argmax drafts (accepted by the engine's exact-match rule, the
    rejection sampling of a deterministic drafter). 'probabilistic': a request sampled at temperature
    T > 0 gets drafts drawn from ``softmax(draft logits / T)`` with its generator; the engine then
    verifies them by ``rejection_sample`` against the target's distribution (``probs`` holds each
    draft's q rows); greedy requests get argmax drafts either way."""

    def __init__(self, model, per_sequence: bool, sample_method: str = "greedy", graphs=None):
        """``graphs``: a ``model.dspark.CudaGraphDraft`` of the configured number of drafts: greedy
        draft calls replay it (the sequences that draft fewer take the first ones)."""
        self.model, self.per_sequence, self.sample_method = model, per_sequence, sample_method
        self.graphs = graphs
        self.probs: dict = {}            # seq -> [k, V] draft distributions of its probabilistic drafts

    def _groups(self, items):
        return [[it] for it in items] if self.per_sequence else ([items] if items else [])

    def _inputs(self, g):
        """Device (slots, anchors, anchor positions) of the live items ``g`` [(seq, position, anchor, k)]."""
        dev = self.model.device
        return (torch.tensor([s.slot for s, *_ in g], device=dev), torch.tensor([a for _, _, a, _ in g], device=dev),
                torch.tensor([p for _, p, _, _ in g], device=dev))

    def _temperature(self, seq) -> float:
        p = seq.params
        return 0.0 if self.sample_method == "greedy" or p.is_greedy else float(p.temperature)

    @torch.no_grad()
    def propose(self, fills, k_of: dict) -> None:
        """``fills``: [(seq, p0, features [n, S*d], next token ids [n])]: the target's rows at
        positions p0 .. p0+n-1 and the token after each. Every sequence with ``k_of[seq] = k > 0``
        gets ``k`` draft tokens in ``seq.draft_ids`` (its fill ends at its last committed position)."""
        m, dev = self.model, self.model.device
        for g in self._groups(fills):
            m.dspark_extend([(seq.slot, p0, h) for seq, p0, h, _ in g])
        live = [(seq, p0 + len(nxt), nxt[-1], k_of[seq]) for seq, p0, _, nxt in fills if k_of.get(seq, 0) > 0]
        # sequences sampled at T > 0 with probabilistic drafts run on their own (their generator)
        greedy = [it for it in live if self._temperature(it[0]) == 0.0]
        if greedy and self.graphs is not None and max(k for *_, k in greedy) <= self.graphs.n_tokens:
            toks = self.graphs(*self._inputs(greedy)).tolist()
            for r, (seq, _, _, k) in enumerate(greedy):
                seq.draft_ids = toks[r][:k]
            greedy = []
        for g in self._groups(greedy) + [[it] for it in live if self._temperature(it[0]) > 0.0]:
            t = self._temperature(g[0][0])
            out = m.dspark_draft(*self._inputs(g), max(k for *_, k in g),
                                 None if t == 0.0 else torch.tensor([t], device=dev),
                                 None if t == 0.0 else _device_generator(g[0][0], dev))
            toks = out["tokens"].tolist()
            for r, (seq, _, _, k) in enumerate(g):
                seq.draft_ids = toks[r][:k]
                if t > 0.0:
                    self.probs[seq] = torch.softmax(out["logits"][r, :k].float() / t, dim=-1)


# the draft generator's seed: the request's seed mixed with this constant, so the draft stream and the
# sampler's are distinct streams of the same seed
_DRAFT_SEED_MIX = 0x9E3779B97F4A7C15


def _device_generator(seq, dev):
    """A seeded request's generator on ``dev`` (its draws then depend on its seed only, not on its batch
    or on other requests): its own when that lives on ``dev``, else one made on ``dev`` at its first
    draft from the same seed and kept on the sequence. None for an unseeded request (the global one)."""
    g = getattr(seq, "generator", None)
    if g is None:
        return None
    dev = torch.device(dev)
    if g.device.type == dev.type:
        return g
    dg = getattr(seq, "draft_generator", None)
    if dg is None:
        dg = torch.Generator(device=dev)
        dg.manual_seed((g.initial_seed() ^ _DRAFT_SEED_MIX) & 0xFFFF_FFFF_FFFF_FFFF)
        seq.draft_generator = dg
    return dg
