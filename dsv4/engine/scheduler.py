"""Continuous-batching scheduler.

Policy, per step, under a budget of ``max_num_batched_tokens`` tokens:
1. decodes first: every running sequence whose prompt is done gets its 1 pending token;
2. then prefill chunks, oldest first: running sequences with an unfinished (chunked) prefill,
   then waiting sequences admitted FCFS while a cache slot, ``max_num_seqs`` and the budget allow;
   a prefill is cut to what the budget has left (chunked prefill), so steps mix prefills and
   decodes; with ``long_prefill_token_threshold`` > 0 (vLLM's flag) every prefill chunk is also cut
   to that many tokens, so that one long prompt neither takes a whole step's budget nor stretches
   the running decodes' step (shorter prompts then start beside it);
3. every scheduled sequence must hold KV blocks up to its new end; when the pool runs dry the
   most recently admitted running sequence is preempted (recompute: its slot and blocks are
   freed, it goes back to the front of the waiting queue and later re-prefills prompt + output).
Prefix caching (``prefix``: an ``engine.prefix_cache.PrefixCache``, None = off): an admitted
sequence starts with the longest cached prefix it can continue from (its blocks shared, the
snapshot restored into its slot by the runner before the step's forward: ``ScheduledChunk.restore``);
a preempted one finds its own blocks again. Every scheduled chunk carries the snapshots to take at
the block boundaries it passes (``captures``), registered by ``commit`` after the step. Samples
1.. of an ``n > 1`` request wait while sample 0 prefills their shared prompt, then reuse it.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..formats.paging import BLOCK_TOKENS
from .kv_cache import KVCache, PagedSequenceState
from .prefix_cache import Capture, PrefixCache
from .sequence import Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    long_prefill_token_threshold: int = 0     # > 0: the most prefill tokens of one sequence in a step

    def chunk_cap(self, budget: int) -> int:
        """The most prefill tokens one sequence may take in a step with ``budget`` tokens left."""
        t = self.long_prefill_token_threshold
        return min(budget, t) if t > 0 else budget


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int
    samples: bool = False   # the chunk reaches the end of the sequence: its logits give a token
    num_draft: int = 0      # draft tokens it carries after the pending token (speculative verify)
    restore: int | None = None          # snapshot to put into the slot first (a prefix-cache hit)
    captures: list[Capture] = field(default_factory=list)

    def __post_init__(self):
        self.num_draft = max(0, self.seq.num_computed + self.num_tokens - self.seq.num_tokens)
        self.samples = self.seq.num_computed + self.num_tokens == self.seq.num_tokens + self.num_draft


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, cache: KVCache, prefix: PrefixCache | None = None):
        self.cfg, self.cache, self.prefix = cfg, cache, prefix
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []       # in admission order
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue management
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Release everything the sequence holds (finish, abort or error)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED

    def _release(self, seq: Sequence) -> None:
        if seq.block_table:
            self.cache.free_blocks(seq.block_table)
            seq.block_table = []
        if seq.slot is not None:
            self.cache.free_slot(seq.slot)
            seq.slot = None
        seq.state = None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        seq.draft_ids = []
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _grow(self, seq: Sequence, end: int) -> bool:
        """Give ``seq`` blocks up to token ``end``, preempting later sequences if needed.
        False if ``seq`` itself had to be preempted."""
        need = self.cache.blocks_needed(end) - len(seq.block_table)
        while need > 0 and not self.cache.can_allocate(need):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.block_table.extend(self.cache.allocate_blocks(need))
        return True

    # ------------------------------------------------------------------ one step
    def schedule(self) -> list[ScheduledChunk]:
        budget = self.cfg.max_num_batched_tokens
        out: list[ScheduledChunk] = []
        # 1. decodes (a speculating sequence's pending token and its drafts, cut to the budget)
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running or seq.num_computed < len(seq.prompt_ids):
                continue
            del seq.draft_ids[budget - 1:]
            n = 1 + len(seq.draft_ids)
            if self._grow(seq, seq.num_computed + n):
                out.append(ScheduledChunk(seq, n))
                budget -= n
        out = [c for c in out if c.seq in self.running]    # a later grow may have preempted one
        # 2a. unfinished prefills of running sequences
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running or seq.num_computed >= len(seq.prompt_ids):
                continue
            n = min(seq.num_uncomputed, self.cfg.chunk_cap(budget))
            if self._grow(seq, seq.num_computed + n):
                out.append(ScheduledChunk(seq, n))
                budget -= n
        out = [c for c in out if c.seq in self.running]
        # 2b. admit waiting sequences
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) >= self.cfg.max_num_seqs or self.cache.num_free_slots == 0:
                break
            if self._held(seq):
                continue
            hit = self._lookup(seq)
            start = hit.tokens if hit else 0
            n = min(seq.num_tokens - start, self.cfg.chunk_cap(budget))
            need = self.cache.blocks_needed(start + n) - (len(hit.blocks) if hit else 0)
            taken = self.prefix.evictable_among(hit) if hit else 0
            if need + taken > self.cache.num_free_blocks:
                break                            # wait for blocks; never preempt to admit
            self.waiting.remove(seq)
            seq.slot = self.cache.allocate_slot()
            if self.prefix is not None:
                self.prefix.admit(seq, hit)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = start
            seq.block_table = (list(hit.blocks) if hit else []) + self.cache.allocate_blocks(need)
            seq.state = PagedSequenceState(self.cache, seq.slot, seq.block_table)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if start:
                seq.num_computed = start
                seq.state.advance_to(start)
            out.append(ScheduledChunk(seq, n, restore=hit.snapshot if start else None))
            budget -= n
        if self.prefix is not None:
            for c in out:
                c.captures = self.prefix.plan_captures(c.seq, c.seq.num_computed, c.seq.num_computed + c.num_tokens)
        return out

    def _lookup(self, seq: Sequence):
        """The prefix-cache hit ``seq`` starts from (a ``Hit``, maybe empty), or None when it does
        not read the cache (caching off, or prompt logprobs to compute)."""
        if self.prefix is None or seq.prompt_logprobs is not None:
            return None
        return self.prefix.match(seq)

    def _held(self, seq: Sequence) -> bool:
        """Sample i > 0 of a request waits while sample 0 is still to compute a block of their
        shared prompt it could reuse."""
        lead = seq.leader
        return (self.prefix is not None and lead is not seq and lead.status != SequenceStatus.FINISHED
                and lead.num_computed < len(lead.prompt_ids)
                and (len(seq.prompt_ids) - 1) // BLOCK_TOKENS > lead.num_computed // BLOCK_TOKENS)
