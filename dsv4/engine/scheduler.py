"""Continuous-batching scheduler.

Policy, per step, under a budget of ``max_num_batched_tokens`` tokens:
1. decodes first: every running sequence whose prompt is done gets its 1 pending token;
2. then prefill chunks, oldest first: running sequences with an unfinished (chunked) prefill,
   then waiting sequences admitted FCFS while a cache slot, ``max_num_seqs`` and the budget allow;
   a prefill is cut to what the budget has left (chunked prefill), so steps mix prefills and
   decodes;
3. every scheduled sequence must hold KV blocks up to its new end; when the pool runs dry the
   most recently admitted running sequence is preempted (recompute: its slot and blocks are
   freed, it goes back to the front of the waiting queue and later re-prefills prompt + output).
Prefix caching: not implemented (each sample of ``n > 1`` prefills its own prompt).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .kv_cache import KVCache, PagedSequenceState
from .sequence import Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int
    samples: bool = False   # the chunk reaches the end of the sequence: its logits give a token

    def __post_init__(self):
        self.samples = self.seq.num_computed + self.num_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, cache: KVCache):
        self.cfg, self.cache = cfg, cache
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
        # 1. decodes
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running or seq.num_computed < len(seq.prompt_ids):
                continue
            if self._grow(seq, seq.num_computed + 1):
                out.append(ScheduledChunk(seq, 1))
                budget -= 1
        out = [c for c in out if c.seq in self.running]    # a later grow may have preempted one
        # 2a. unfinished prefills of running sequences
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running or seq.num_computed >= len(seq.prompt_ids):
                continue
            n = min(seq.num_uncomputed, budget)
            if self._grow(seq, seq.num_computed + n):
                out.append(ScheduledChunk(seq, n))
                budget -= n
        out = [c for c in out if c.seq in self.running]
        # 2b. admit waiting sequences
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs \
                and self.cache.num_free_slots > 0:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed, budget)
            if not self.cache.can_allocate(self.cache.blocks_needed(n)):
                break                            # wait for blocks; never preempt to admit
            self.waiting.popleft()
            seq.slot = self.cache.allocate_slot()
            seq.block_table = self.cache.allocate_blocks(self.cache.blocks_needed(n))
            seq.state = PagedSequenceState(self.cache, seq.slot, seq.block_table)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.append(ScheduledChunk(seq, n))
            budget -= n
        return out
