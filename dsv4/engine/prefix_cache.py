"""Automatic prefix caching over the compressed KV caches (vLLM's ``enable_prefix_caching``).

What a block holds. A full 256-token KV block holds, in every compressed layer, the compressed
entries of its tokens (CSA: 64, HCA: 2) and, in CSA layers, their 64 indexer keys. 256 is a
multiple of both compress ratios, so every entry of a full block is complete and depends only on
the tokens up to the block's end: the block is keyed by a hash chain of its token ids (SHA-256 of
the parent block's hash and the block's 256 ids) and can be shared by any sequence with the same
tokens up to there.

What a block does not hold. To continue at a block boundary ``b`` a sequence also needs its
per-slot state there: every layer's 128-token window (positions b-128 .. b-1) and, in CSA layers,
the main and indexer compressors' 4 pending rows (positions b-4 .. b-1, which the next entry's
overlap pools); HCA's ratio-128 group is empty at b. That state cannot be recomputed from the
blocks exactly: position q's window rows at layer l are computed from layer l-1's outputs at q-127
.. q, so the window at b reaches back 127 tokens per layer, and a recompute starting anywhere but
position 0 would itself need a window. So a hit needs a **snapshot** of that state, taken when
some sequence passed b (``KVCache.capture``, and inside a prefill chunk ``layers.attention``),
and restored into the new sequence's slot (``KVCache.restore``); the hit then continues exactly
as the sequence that was snapshotted.

Cost (``KVCache.bytes_per_snapshot``): 128 x 584 B of window per layer, plus 40 KiB of fp32
compressor rows per CSA layer: V4-Flash (43 layers) 3.89 MiB, 4.47 times a block's 0.87 MiB;
V4-Pro 5.53 MiB, 4.43 blocks; the tiny model 0.51 MiB, 6.1 blocks. A snapshot with every block
would cut the cache's tokens by a factor of ~5.5, so snapshots live in a pool of their own
(``num_snapshots``, default 4 per sequence slot, taken out of the KV budget), captured at every
block boundary a sequence computes (in a prefill chunk or a decode step) that has none yet, and
evicted on their own: segmented LRU (new snapshots enter a probation segment; one that gives a
hit moves to a protected segment of at most half the pool), so a long prompt's many boundaries
cannot flush the hot ones (a shared system prompt's). A hit is the longest chain of cached blocks
whose last block boundary has a snapshot; the blocks beyond it are recomputed (and snapshotted).
A capture copies those bytes (after a decode step ~130 small copies for V4-Flash's 43 layers,
1.2 ms on one CPU core; inside a prefill chunk one gather per layer for all its boundaries); a
restore copies them back (1.4 ms).

Exactness. A hit's blocks and snapshot hold the bits the computing sequence wrote, so the hit
continues with the state that sequence had. Against the same request without caching, the
difference is the one a chunk boundary makes (the hit starts a chunk at ``b``): bit-identical when
the uncached run's chunks also end at ``b``, else within the engine's batching tolerance. A
snapshot and the blocks before it may come from two computations of the same tokens (one
sequence's blocks, another's recompute after a shorter hit): the same kind of difference.

Accounting. Blocks are reference counted in ``KVCache`` (sequences sharing a prefix hold the
same blocks; a block is only ever written before it is full, and a full block is never written
again, so sharing needs no copy-on-write). At count 0 a cached block joins an LRU of evictable
blocks (a released table's tail first, so a prefix's deepest blocks go first) that allocations
reuse after the empty blocks; eviction forgets the block's hash and the snapshot at its end.
Blocks and snapshots are registered only after the step that computed them succeeded. A request
asking for prompt logprobs does not read the cache (vLLM's rule: the prompt is scored, not
skipped), but its blocks are cached for others. Under tensor parallelism every decision is rank
0's (the scheduler lives there); the workers get each step's restores and captures with its
chunks and copy the same bytes in their own caches.

Speculative decoding. A snapshot also holds the drafter's rings and, for MTP, the target's streams
before the boundary (``kv_cache`` module doc); their part is taken after the step, when the drafter
has seen the rows (``spec_decode.draft_step``), and a committed snapshot whose draft part was not
taken is dropped (``drop``). The engine clips drafts so that no verify chunk has a draft token on
the last position before a boundary (``LLMEngine._k_of``): a boundary a verify chunk passes is
always passed by its pending token, so every capture and block hash covers committed tokens.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from ..formats.paging import BLOCK_TOKENS
from .kv_cache import KVCache


@dataclass
class Hit:
    """A cached prefix: ``blocks`` (the sequence's first table entries), ``tokens`` =
    256 * len(blocks), and the snapshot of the state at its end."""
    blocks: list[int]
    tokens: int = 0
    snapshot: int | None = None


@dataclass
class Capture:
    """A snapshot to take of a sequence at block boundary ``pos`` (its block ``pos // 256 - 1``
    has hash ``key``) into snapshot ``snap``."""
    pos: int
    snap: int
    key: bytes


def _chain(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class PrefixCache:
    """Rank 0's table of cached blocks (hash -> block) and snapshots (hash of the block that ends
    at the boundary -> snapshot), over ``cache``'s reference-counted blocks (module doc)."""

    def __init__(self, cache: KVCache):
        if cache.num_snapshots < 1:
            raise ValueError("prefix caching needs a KV cache with at least one snapshot")
        self.cache = cache
        cache.evict_hook = self._evicted
        self.block_of: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        n = cache.num_snapshots
        self.snap_of: dict[bytes, int] = {}
        self.snap_key: list[bytes | None] = [None] * n
        self.free_snaps = list(range(n - 1, -1, -1))
        self.probation: OrderedDict[int, None] = OrderedDict()
        self.protected: OrderedDict[int, None] = OrderedDict()
        self.protected_cap = n // 2
        self._pending: dict[bytes, int] = {}     # captures planned for the running step
        self.queries = 0                          # tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0                             # tokens found (vLLM's prefix_cache_hits)

    # ------------------------------------------------------------------ hashes
    @staticmethod
    def hashes(seq, n_blocks: int) -> list[bytes]:
        """The hash chain of the sequence's first ``n_blocks`` full blocks (extended and kept on
        the sequence: its tokens never change)."""
        h = seq.block_hashes
        while len(h) < n_blocks:
            i = len(h)
            h.append(_chain(h[-1] if h else b"", seq.token_slice(i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS)))
        return h[:n_blocks]

    # ------------------------------------------------------------------ lookup
    def match(self, seq) -> Hit:
        """The longest cached prefix of ``seq`` with a snapshot at its end, leaving at least one
        token to compute (its logits give the next token). No side effect."""
        hs = self.hashes(seq, (seq.num_tokens - 1) // BLOCK_TOKENS)
        blocks = []
        for h in hs:
            b = self.block_of.get(h)
            if b is None:
                break
            blocks.append(b)
        for k in range(len(blocks), 0, -1):
            t = self.snap_of.get(hs[k - 1])
            if t is not None:
                return Hit(blocks[:k], k * BLOCK_TOKENS, t)
        return Hit([])

    def evictable_among(self, hit: Hit) -> int:
        """Blocks of ``hit`` that are now counted free (unreferenced): taking them shrinks the pool."""
        return sum(b in self.cache._evictable for b in hit.blocks)

    def admit(self, seq, hit: Hit | None) -> None:
        """``seq`` is admitted with ``hit`` (its table starts with the hit's blocks), or without a
        lookup (None: it does not read the cache); counts the lookup."""
        seq.num_registered = 0
        if hit is None:
            return
        self.queries += seq.num_tokens
        self.hits += hit.tokens
        if hit.blocks:
            self.cache.share_blocks(hit.blocks)
            self._promote(hit.snapshot)
            seq.num_registered = len(hit.blocks)

    # ------------------------------------------------------------------ snapshots
    def _promote(self, t: int) -> None:
        self.probation.pop(t, None)
        self.protected.pop(t, None)
        self.protected[t] = None
        while len(self.protected) > self.protected_cap:
            u, _ = self.protected.popitem(last=False)
            self.probation[u] = None

    def _forget_snapshot(self, t: int) -> None:
        del self.snap_of[self.snap_key[t]]
        self.snap_key[t] = None
        self.probation.pop(t, None)
        self.protected.pop(t, None)

    def _take_snapshot(self) -> int | None:
        """A free snapshot, else the least recently used of the probation segment; None when
        the rest are protected or taken by this step's captures (a capture is then skipped)."""
        if self.free_snaps:
            return self.free_snaps.pop()
        if self.probation:
            t = next(iter(self.probation))
            self._forget_snapshot(t)
            return t
        return None

    def plan_captures(self, seq, p0: int, end: int) -> list[Capture]:
        """Snapshots to take while ``seq`` computes positions p0 .. end-1: every block boundary
        in (p0, end] whose prefix has none yet (nor one planned in this step)."""
        out = []
        first = p0 // BLOCK_TOKENS + 1
        last = end // BLOCK_TOKENS
        if last < first:
            return out
        hs = self.hashes(seq, last)
        for k in range(first, last + 1):
            h = hs[k - 1]
            if h in self.snap_of or h in self._pending:
                continue
            t = self._take_snapshot()
            if t is None:
                break
            self._pending[h] = t
            out.append(Capture(k * BLOCK_TOKENS, t, h))
        return out

    def cancel(self, captures: list[Capture]) -> None:
        """The step that was to take ``captures`` failed: their snapshots go back unused."""
        for c in captures:
            if self._pending.pop(c.key, None) is not None:
                self.free_snaps.append(c.snap)

    # ------------------------------------------------------------------ after a step
    def commit(self, seq, captures: list[Capture]) -> None:
        """``seq``'s step succeeded: its full blocks join the table (a prefix already cached by
        another block keeps that block), then the snapshots it took."""
        k = seq.num_computed // BLOCK_TOKENS
        if k > seq.num_registered:
            hs = self.hashes(seq, k)
            for i in range(seq.num_registered, k):
                h = hs[i]
                if h not in self.block_of:
                    b = seq.block_table[i]
                    self.block_of[h] = b
                    self.hash_of[b] = h
                    self.cache.mark_cached(b)
            seq.num_registered = k
        for c in captures:
            del self._pending[c.key]
            self.snap_of[c.key] = c.snap
            self.snap_key[c.snap] = c.key
            self.probation[c.snap] = None

    def drop(self, captures: list[Capture]) -> None:
        """Committed ``captures`` whose snapshots turned out incomplete (speculative decoding: the
        drafter's part was not taken, ``LLMEngine._draft``): forgotten and freed."""
        for c in captures:
            if self.snap_of.get(c.key) == c.snap:
                self._forget_snapshot(c.snap)
                self.free_snaps.append(c.snap)

    def _evicted(self, block: int) -> None:
        """``KVCache`` reuses cached ``block``: the prefix through it is gone, and with it the
        snapshot at its end."""
        h = self.hash_of.pop(block)
        del self.block_of[h]
        t = self.snap_of.get(h)
        if t is not None:
            self._forget_snapshot(t)
            self.free_snaps.append(t)

    def reset(self) -> None:
        """Forget every cached prefix and snapshot and zero the counters (the engine's warm-up,
        ``engine.warmup``). Only while no sequence holds a block: cached blocks in use would stay
        in tables nothing can find any more. Every snapshot is keyed by a cached block's hash, so
        evicting the blocks (``_evicted``) frees them all."""
        if self._pending or any(self.cache._ref[b] > 0 for b in self.hash_of):
            raise RuntimeError("prefix cache reset while sequences hold cached blocks")
        self.cache.drop_cached()
        self.queries = self.hits = 0

    # ------------------------------------------------------------------ reporting
    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a cached prefix (in use or not)."""
        return len(self.block_of)

    @property
    def num_snapshots_held(self) -> int:
        return len(self.snap_of)
