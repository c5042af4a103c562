"""Paged, quantised KV caches for DeepSeek-V4 and a paged stand-in for the reference state.

``PagedSequenceState`` implements the per-sequence state interface of ``dsv4.reference.state``
(``layers``, ``pos``, ``read_window``/``write_window``, ``pending``/``set_pending``,
``entries``/``append_entries``) on top of one ``KVCache``, so ``ReferenceModel.forward([(ids,
paged_state), ...])`` runs unchanged and gives bit-identical logits to ``model.new_state()``:
every stored value is one the reference has already quantised, and the codecs are exact on them.

Layout (spec §10; one pool tensor per layer and kind, allocated once at start; the geometry
constants and ``blocks_needed`` / ``block_table_tensor`` live in ``formats.paging``, the codecs in
``formats.kv_entry`` and ``formats.index_key``):

* **KV block** = allocation unit of ``BLOCK_TOKENS = 256`` tokens. Block id ``b`` indexes, in
  EVERY compressed layer, one page per cache kind (vLLM-style: one block table per sequence,
  shared by all layers):
    - CSA layers (ratio 4): a page of 64 compressed entries, 584-byte FlashMLA
      "MODEL1_FP8Sparse" entries in the FlashMLA page layout (``formats.kv_entry``), and a page
      of 64 indexer keys;
    - HCA layers (ratio 128): a page of 2 compressed entries, same 584-byte format
      (``page_bytes(2)`` = 1728 B with the 576-byte alignment).
  Entry j of a ratio-m layer lives in block ``block_table[j*m // 256]`` at offset
  ``j % (256 // m)``: the block that holds its tokens.
* **Indexer keys: MXFP4** (``formats.index_key``) — 128 e2m1 codes packed in 64 B + one e8m0 scale per 32 values (4 B)
  = 68 B per entry; page = ``[64 x 64 B codes][64 x 4 B scales]`` (4352 B). FP4 because it is
  LOSSLESS here (the reference's keys are already FP4-QDQ'd with power-of-two scales per 32; a
  re-encode may pick a smaller power of two for a block whose largest code is < 4, the decoded
  values are bit-identical) and half the size of FP8 + a per-entry fp32 scale (132 B).
* **Per sequence slot** (fixed, allocated with ``allocate_slot``), in every main layer:
    - sliding window: a 128-token ring = 2 pages of 64 entries (584-byte FlashMLA layout);
      position q sits at ring row ``q % 128``, i.e. global entry ``slot * 128 + q % 128`` of the
      layer's window pool (``[2 * max_num_seqs, page_bytes(64)]``);
    - compressed layers: compressor state as fp32 ring buffers of ``coff * m`` rows (coff = 2 for
      ratio 4, else 1), one for the main compressor and (ratio 4) one for the indexer's; a row
      is ``[K (coff*c) | score (coff*c)]`` and position q sits at row ``q % (coff*m)``.
  A new slot needs no reset: the state keeps Python-int counters (window end, pending range,
  entry count) and only ever reads rows this sequence wrote.
* Draft layers (``CacheConfig.draft_layers``, the MTP block of speculative decoding): a window
  ring per slot each, as a main sliding-window layer's (``KVCache.draft_layers``); the
  reference-state stand-in does not cover them (``PagedSequenceState.mtp is None``).
* Prefix-cache snapshots (``CacheConfig.num_snapshots``; ``engine.prefix_cache``): the state a
  sequence needs beyond its blocks to continue at a block boundary ``b`` (a multiple of 256, so of
  128 and 4): in every main layer the 128-entry window ring (positions b-128 .. b-1 at ring row
  ``q % 128``, the slot's layout: ``snap_window`` [2 * num_snapshots, page_bytes(64)]) and, in CSA
  layers, the 4 pending rows of the main and the indexer compressor (positions b-4 .. b-1, the
  previous window the next entry overlaps: ``snap_comp`` / ``snap_index`` [num_snapshots, 4,
  2*2*dim] fp32). A ratio-128 compressor has nothing pending at b. ``capture`` / ``restore`` copy
  a slot's state to / from a snapshot; ``layers.attention`` captures boundaries inside a prefill
  chunk straight from the chunk's rows. Under speculative decoding a snapshot also holds each draft
  layer's window ring (``capture_draft``: the drafter writes its rows after the target's step) and,
  for the MTP block, the target's residual streams at b-1 (``snap_rows``): MTP's row b-1 reads
  token b, which a sequence continuing from the snapshot may not share, so it recomputes that row.

Memory: ``bytes_per_block`` (all layers' block pages), ``bytes_per_slot`` (windows + compressor
states) and ``bytes_per_snapshot``; with ``CacheConfig.memory_bytes`` the cache takes
``num_blocks = (memory_bytes - max_num_seqs * bytes_per_slot - num_snapshots * bytes_per_snapshot)
// bytes_per_block``.

The engine allocates a slot and blocks, grows the sequence's block table (a Python list, shared
by reference with its ``PagedSequenceState``) to ``blocks_needed(pos + n)`` before each forward of
n new tokens, and frees both when the sequence ends. Blocks are reference counted (sequences
sharing a cached prefix hold the same blocks); a block whose count drops to 0 goes back to the
free stack, or, when it holds a cached prefix (``mark_cached``), to an LRU of evictable cached
blocks that ``allocate_blocks`` reuses (oldest first, after the free stack runs dry), calling
``evict_hook(block)`` so the prefix cache forgets it. The state checks the table and raises
``KVCacheError`` if it is too short (a programming error: the forward is then aborted midway and
the states of that batch are no longer usable).
"""
from __future__ import annotations

import inspect
import math
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import ModelConfig
from ..formats.index_key import index_page_bytes, read_index_entries, write_index_entries
from ..formats.kv_entry import KV_DIM, page_bytes, page_views, read_kv_entries, write_kv_entries
from ..formats.paging import BLOCK_TOKENS, INDEX_PAGE, WINDOW, WINDOW_PAGE, block_table_tensor, blocks_needed


class KVCacheError(RuntimeError):
    """Out of blocks / slots, or a block table that does not cover the positions written."""


# ---------------------------------------------------------------------------------------------
# sizes
def _coff(ratio: int) -> int:
    return 2 if ratio == 4 else 1


def _state_bytes(ratio: int, dim: int) -> int:
    """One compressor state ring: coff*m rows of [K | score], each coff*dim fp32."""
    coff = _coff(ratio)
    return coff * ratio * 2 * coff * dim * 4


def layer_block_bytes(cfg: ModelConfig, layer: int) -> int:
    """Bytes of one KV block in main layer ``layer`` (0 for sliding-window-only layers)."""
    r = cfg.layer_ratio(layer)
    if r == 0:
        return 0
    n = page_bytes(BLOCK_TOKENS // r)
    if r == 4:
        n += index_page_bytes(INDEX_PAGE, cfg.index_head_dim)
    return n


def layer_slot_bytes(cfg: ModelConfig, layer: int) -> int:
    """Bytes of one sequence slot in main layer ``layer``: window ring + compressor states."""
    r = cfg.layer_ratio(layer)
    n = (WINDOW // WINDOW_PAGE) * page_bytes(WINDOW_PAGE)
    if r:
        n += _state_bytes(r, cfg.head_dim)
        if r == 4:
            n += _state_bytes(r, cfg.index_head_dim)
    return n


SNAP_ROWS = 4                    # CSA compressor rows pending at a block boundary (positions b-4 .. b-1)


def layer_snapshot_bytes(cfg: ModelConfig, layer: int) -> int:
    """Bytes of one prefix-cache snapshot in main layer ``layer``: the window ring, plus the CSA
    compressors' pending rows."""
    n = (WINDOW // WINDOW_PAGE) * page_bytes(WINDOW_PAGE)
    if cfg.layer_ratio(layer) == 4:
        n += SNAP_ROWS * 2 * 2 * (cfg.head_dim + cfg.index_head_dim) * 4
    return n


def bytes_per_snapshot(cfg: ModelConfig, draft_layers: int = 0, draft_row: tuple = ()) -> int:
    """A snapshot's bytes: every main layer's part, plus each draft layer's window ring and the bf16
    draft row (``CacheConfig``) under speculative decoding."""
    row = 2 * math.prod(draft_row) if draft_row else 0
    return (sum(layer_snapshot_bytes(cfg, i) for i in range(cfg.num_hidden_layers))
            + draft_layers * (WINDOW // WINDOW_PAGE) * page_bytes(WINDOW_PAGE) + row)


def bytes_per_block(cfg: ModelConfig) -> int:
    return sum(layer_block_bytes(cfg, i) for i in range(cfg.num_hidden_layers))


def bytes_per_slot(cfg: ModelConfig, draft_layers: int = 0) -> int:
    """A sequence slot's bytes: every main layer's part, plus each draft layer's window ring."""
    return (sum(layer_slot_bytes(cfg, i) for i in range(cfg.num_hidden_layers))
            + draft_layers * (WINDOW // WINDOW_PAGE) * page_bytes(WINDOW_PAGE))


@dataclass
class CacheConfig:
    """``max_num_seqs`` sequence slots; ``num_snapshots`` prefix-cache snapshots; KV blocks:
    ``num_blocks``, or as many as fit in ``memory_bytes`` after the slots and snapshots.
    ``device``: where the pools live. ``draft_layers``: window-only layers of a speculative drafter
    (the MTP block, the DSpark stages' rings), one 128-token ring per slot each, snapshotted with the
    main layers. ``draft_row``: the shape of a bf16 row each snapshot also keeps for the drafter (the
    MTP block's: the target's residual streams before the boundary, [hc, d]; ``()``: none)."""
    max_num_seqs: int
    num_blocks: int | None = None
    memory_bytes: int | None = None
    device: str | torch.device = "cpu"
    num_snapshots: int = 0
    draft_layers: int = 0
    draft_row: tuple = ()


@dataclass
class LayerCache:
    """The pools of one main layer (kernels index them directly).

    window:        uint8 [2 * max_num_seqs, page_bytes(64)]; slot s owns pages 2s, 2s+1
    entries:       uint8 [num_blocks, page_bytes(entries_per_block)] (compressed layers)
    index_keys:    uint8 [num_blocks, 64 * 68] MXFP4 (CSA layers)
    comp_state:    fp32 [max_num_seqs, coff*m, 2*coff*head_dim] (compressed layers)
    index_state:   fp32 [max_num_seqs, 8, 2*2*index_head_dim] (CSA layers)
    snap_window:   uint8 [2 * num_snapshots, page_bytes(64)]; snapshot t owns pages 2t, 2t+1
    snap_comp:     fp32 [num_snapshots, 4, 2*2*head_dim] (CSA layers)
    snap_index:    fp32 [num_snapshots, 4, 2*2*index_head_dim] (CSA layers)
    """
    ratio: int
    window: Tensor
    entries: Tensor | None = None
    entries_per_block: int = 0
    index_keys: Tensor | None = None
    comp_state: Tensor | None = None
    index_state: Tensor | None = None
    snap_window: Tensor | None = None
    snap_comp: Tensor | None = None
    snap_index: Tensor | None = None


class KVCache:
    def __init__(self, model_cfg: ModelConfig, cache_cfg: CacheConfig):
        self.model_cfg, self.cache_cfg = model_cfg, cache_cfg
        if model_cfg.head_dim != KV_DIM or model_cfg.sliding_window != WINDOW:
            raise ValueError(f"the cache layout needs head_dim={KV_DIM} and sliding_window={WINDOW}")
        S = cache_cfg.max_num_seqs
        if not isinstance(S, int) or S < 1:
            raise ValueError(f"max_num_seqs must be a positive integer, got {S!r}")
        ns = cache_cfg.num_snapshots
        if not isinstance(ns, int) or ns < 0:
            raise ValueError(f"num_snapshots must be a non-negative integer, got {ns!r}")
        self.max_num_seqs, self.num_snapshots = S, ns
        self.bytes_per_block = bytes_per_block(model_cfg)
        self.bytes_per_slot = bytes_per_slot(model_cfg, cache_cfg.draft_layers)
        self.bytes_per_snapshot = bytes_per_snapshot(model_cfg, cache_cfg.draft_layers, cache_cfg.draft_row)
        fixed = S * self.bytes_per_slot + ns * self.bytes_per_snapshot
        what = f"max_num_seqs={S} slots ({self.bytes_per_slot} bytes each)" + (
            f" and {ns} prefix-cache snapshots ({self.bytes_per_snapshot} bytes each)" if ns else "")
        mem = cache_cfg.memory_bytes
        if cache_cfg.num_blocks is not None:
            nb = cache_cfg.num_blocks
            if not isinstance(nb, int) or nb < 1:
                raise ValueError(f"num_blocks must be a positive integer, got {nb!r}")
            if mem is not None and fixed + nb * self.bytes_per_block > mem:
                raise ValueError(f"num_blocks={nb} and {what} need "
                                 f"{fixed + nb * self.bytes_per_block} bytes, more than memory_bytes={mem}")
        elif mem is not None and self.bytes_per_block == 0:
            # no compressed layer: blocks hold no bytes, so every slot can reach the full length
            if mem < fixed:
                raise ValueError(f"memory_bytes={mem} is too small: {what} take {fixed} bytes; raise "
                                 f"memory_bytes or lower max_num_seqs")
            nb = S * -(-model_cfg.max_position_embeddings // BLOCK_TOKENS)
        elif mem is not None:
            if mem < fixed + self.bytes_per_block:
                raise ValueError(
                    f"memory_bytes={mem} is too small: {what} take {fixed} bytes and one KV block of "
                    f"{BLOCK_TOKENS} tokens takes {self.bytes_per_block} bytes; raise memory_bytes or lower "
                    f"max_num_seqs")
            nb = (mem - fixed) // self.bytes_per_block
        else:
            raise ValueError("CacheConfig needs num_blocks or memory_bytes")
        self.num_blocks = nb
        self.device = torch.device(cache_cfg.device)
        dev = self.device
        self.layers: list[LayerCache] = []
        for i in range(model_cfg.num_hidden_layers):
            r = model_cfg.layer_ratio(i)
            lc = LayerCache(r, torch.zeros(2 * S, page_bytes(WINDOW_PAGE), dtype=torch.uint8, device=dev))
            lc.snap_window = torch.zeros(2 * ns, page_bytes(WINDOW_PAGE), dtype=torch.uint8, device=dev)
            if r:
                if BLOCK_TOKENS % r:
                    raise ValueError(f"compress ratio {r} of layer {i} does not divide {BLOCK_TOKENS}")
                c = _coff(r)
                lc.entries_per_block = BLOCK_TOKENS // r
                lc.entries = torch.zeros(nb, page_bytes(lc.entries_per_block), dtype=torch.uint8, device=dev)
                lc.comp_state = torch.zeros(S, c * r, 2 * c * model_cfg.head_dim, dtype=torch.float32, device=dev)
                if r == 4:
                    lc.index_keys = torch.zeros(nb, index_page_bytes(INDEX_PAGE, model_cfg.index_head_dim),
                                                dtype=torch.uint8, device=dev)
                    lc.index_state = torch.zeros(S, c * r, 2 * c * model_cfg.index_head_dim,
                                                 dtype=torch.float32, device=dev)
                    lc.snap_comp = torch.zeros(ns, SNAP_ROWS, lc.comp_state.shape[2], dtype=torch.float32,
                                               device=dev)
                    lc.snap_index = torch.zeros(ns, SNAP_ROWS, lc.index_state.shape[2], dtype=torch.float32,
                                                device=dev)
            self.layers.append(lc)
        self.draft_layers = [LayerCache(0, torch.zeros(2 * S, page_bytes(WINDOW_PAGE), dtype=torch.uint8, device=dev),
                                        snap_window=torch.zeros(2 * ns, page_bytes(WINDOW_PAGE), dtype=torch.uint8,
                                                                device=dev))
                             for _ in range(cache_cfg.draft_layers)]
        self.snap_rows = (torch.zeros(ns, *cache_cfg.draft_row, dtype=torch.bfloat16, device=dev)
                          if cache_cfg.draft_row else None)
        self.restored_rows: dict[int, Tensor] = {}     # slot -> its restored snapshot's draft row
        # free lists: stacks, lowest id handed out first
        self._free_blocks = list(range(nb - 1, -1, -1))
        self.reserved_blocks = 0
        self._ref = [0] * nb                  # sequences (or the model's scratch) holding each block
        self._cacheable = [False] * nb        # the block holds a cached prefix (``mark_cached``)
        self._evictable: OrderedDict[int, None] = OrderedDict()   # cached blocks at ref 0, oldest first
        self._evict_hook = None               # called with a cached block when it is reused (``evict_hook``)
        self._free_slots = list(range(S - 1, -1, -1))
        self._slot_used = [False] * S

    # ------------------------------------------------------------------ sizes
    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * BLOCK_TOKENS

    @property
    def total_bytes(self) -> int:
        return (self.num_blocks * self.bytes_per_block + self.max_num_seqs * self.bytes_per_slot
                + self.num_snapshots * self.bytes_per_snapshot)

    def describe(self) -> str:
        gib = 2.0 ** 30
        snaps = (f" + {self.num_snapshots} prefix-cache snapshots x {self.bytes_per_snapshot / 2**20:.2f} MiB "
                 f"({self.num_snapshots * self.bytes_per_snapshot / gib:.3f} GiB)" if self.num_snapshots else "")
        return (f"KV cache: {self.num_blocks} blocks x {BLOCK_TOKENS} tokens = {self.capacity_tokens} tokens, "
                f"{self.bytes_per_block / BLOCK_TOKENS:.0f} B/token compressed "
                f"({self.num_blocks * self.bytes_per_block / gib:.3f} GiB) + {self.max_num_seqs} sequence slots "
                f"x {self.bytes_per_slot / 2**20:.2f} MiB window+compressor state "
                f"({self.max_num_seqs * self.bytes_per_slot / gib:.3f} GiB){snaps}; total "
                f"{self.total_bytes / gib:.3f} GiB on {self.device}")

    # ------------------------------------------------------------------ allocation
    @staticmethod
    def blocks_needed(num_tokens: int) -> int:
        """ceil(num_tokens / 256) (same as the module function)."""
        return blocks_needed(num_tokens)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: empty ones plus unreferenced cached ones."""
        return len(self._free_blocks) + len(self._evictable)

    @property
    def num_cached_free_blocks(self) -> int:
        """Unreferenced blocks that hold a cached prefix (reused, oldest first, when needed)."""
        return len(self._evictable)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def can_allocate(self, n_blocks: int) -> bool:
        return 0 <= n_blocks <= self.num_free_blocks

    def usage(self) -> float:
        """Fraction of the sequences' KV blocks in use (reserved blocks not counted; unreferenced
        cached blocks count as free)."""
        usable = self.num_blocks - self.reserved_blocks
        return (usable - self.num_free_blocks) / max(1, usable)

    def reserve_block(self) -> int:
        """A block taken out of the sequences' pool for good (a model's scratch writes)."""
        b = self.allocate_blocks(1)[0]
        self.reserved_blocks += 1
        return b

    def allocate_slot(self) -> int:
        if not self._free_slots:
            raise KVCacheError(f"no free sequence slot (max_num_seqs={self.max_num_seqs})")
        s = self._free_slots.pop()
        self._slot_used[s] = True
        return s

    def free_slot(self, slot: int) -> None:
        if not (isinstance(slot, int) and 0 <= slot < self.max_num_seqs):
            raise ValueError(f"slot {slot!r} out of range [0, {self.max_num_seqs})")
        if not self._slot_used[slot]:
            raise ValueError(f"slot {slot} is not allocated (double free?)")
        self._slot_used[slot] = False
        self._free_slots.append(slot)

    def allocate_blocks(self, n: int) -> list[int]:
        """``n`` blocks at reference count 1: empty ones first, then the least recently released
        cached ones (``evict_hook`` is told of each)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free_blocks:
            raise KVCacheError(f"out of KV blocks: need {n}, {self.num_free_blocks} of {self.num_blocks} free")
        out = []
        for _ in range(n):
            b = self._free_blocks.pop() if self._free_blocks else self._evict_oldest()
            self._ref[b] = 1
            out.append(b)
        return out

    def share_blocks(self, blocks: list[int]) -> None:
        """One more reference to each of ``blocks`` (cached blocks a sequence reuses); an
        unreferenced one leaves the evictable LRU."""
        for b in blocks:
            if not (self._ref[b] > 0 or b in self._evictable):
                raise ValueError(f"block {b} is neither in use nor cached")
        for b in blocks:
            self._evictable.pop(b, None)
            self._ref[b] += 1

    def _evict_oldest(self) -> int:
        """The least recently released cached block, no longer cached (``evict_hook`` is told)."""
        b, _ = self._evictable.popitem(last=False)
        self._cacheable[b] = False
        hook = self.evict_hook
        if hook is not None:
            hook(b)
        return b

    @property
    def evict_hook(self):
        """The callable told of each evicted cached block, or None. A bound method is held weakly: the
        prefix cache that owns it also holds this cache, and a strong cycle would keep the pools (most of
        the GPU's free memory) alive after the engine is dropped, until the cycle collector runs."""
        h = self._evict_hook
        return h() if isinstance(h, weakref.WeakMethod) else h

    @evict_hook.setter
    def evict_hook(self, fn) -> None:
        self._evict_hook = weakref.WeakMethod(fn) if inspect.ismethod(fn) else fn

    def drop_cached(self) -> None:
        """Every unreferenced cached block back to the empty stack (``evict_hook`` is told of each):
        nothing cached survives."""
        while self._evictable:
            self._free_blocks.append(self._evict_oldest())

    def mark_cached(self, block: int) -> None:
        """``block`` (in use) holds a cached prefix: at reference count 0 it stays reusable."""
        if self._ref[block] < 1:
            raise ValueError(f"block {block} is not allocated")
        self._cacheable[block] = True

    def free_blocks(self, blocks: list[int]) -> None:
        """Drop one reference to each block; at 0 a block is free, or evictable if it is cached.
        The table's tail goes first into the LRU, so a prefix's deepest blocks are reused first."""
        blocks = list(blocks)
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"free_blocks: repeated block ids in {blocks}")
        for b in blocks:   # validate everything before changing anything
            if not (isinstance(b, int) and 0 <= b < self.num_blocks):
                raise ValueError(f"block {b!r} out of range [0, {self.num_blocks})")
            if self._ref[b] < 1:
                raise ValueError(f"block {b} is not allocated (double free?)")
        for b in reversed(blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._cacheable[b]:
                    self._evictable[b] = None
                else:
                    self._free_blocks.append(b)

    # ------------------------------------------------------------------ prefix-cache snapshots
    def _snap_check(self, snap: int, slot: int, pos: int) -> None:
        if not (0 <= snap < self.num_snapshots):
            raise ValueError(f"snapshot {snap!r} out of range [0, {self.num_snapshots})")
        if not (0 <= slot < self.max_num_seqs):
            raise ValueError(f"slot {slot!r} out of range [0, {self.max_num_seqs})")
        if pos <= 0 or pos % BLOCK_TOKENS:
            raise ValueError(f"snapshots are taken at block boundaries (multiples of {BLOCK_TOKENS}), not {pos}")

    def _pending_rows(self, pos: int) -> Tensor:
        """CSA compressor ring rows of positions pos-4 .. pos-1 (position q at row q % 8)."""
        return torch.arange(pos - SNAP_ROWS, pos, device=self.device) % (_coff(4) * 4)

    def capture(self, slot: int, snap: int, pos: int) -> None:
        """Copy the state of the sequence in ``slot``, which stands at block boundary ``pos``, into
        snapshot ``snap`` (the window ring is aligned there: ring row i holds position pos-128+i)."""
        self._snap_check(snap, slot, pos)
        rows = self._pending_rows(pos)
        for lc in self.layers:
            lc.snap_window[2 * snap:2 * snap + 2] = lc.window[2 * slot:2 * slot + 2]
            if lc.ratio == 4:
                lc.snap_comp[snap] = lc.comp_state[slot, rows]
                lc.snap_index[snap] = lc.index_state[slot, rows]

    def capture_draft(self, slot: int, snap: int, pos: int, row: Tensor | None = None) -> None:
        """The draft layers' part of snapshot ``snap``: their window rings of the sequence in
        ``slot``, which must hold exactly positions pos-128 .. pos-1 of its drafter (taken once the
        drafter has seen the rows before ``pos`` and none after), and the draft row (``row``, when
        the cache keeps one)."""
        self._snap_check(snap, slot, pos)
        for lc in self.draft_layers:
            lc.snap_window[2 * snap:2 * snap + 2] = lc.window[2 * slot:2 * slot + 2]
        if self.snap_rows is not None:
            if row is None:
                raise ValueError("this cache keeps a draft row per snapshot: capture_draft needs one")
            self.snap_rows[snap] = row

    def restore(self, snap: int, slot: int, pos: int) -> None:
        """Put snapshot ``snap`` (taken at block boundary ``pos``) into ``slot``: the sequence there
        continues at ``pos`` as the one the snapshot was taken from. The draft row, if kept, is left
        in ``restored_rows[slot]`` for the drafter (which clears it)."""
        self._snap_check(snap, slot, pos)
        rows = self._pending_rows(pos)
        for lc in self.layers:
            lc.window[2 * slot:2 * slot + 2] = lc.snap_window[2 * snap:2 * snap + 2]
            if lc.ratio == 4:
                lc.comp_state[slot, rows] = lc.snap_comp[snap]
                lc.index_state[slot, rows] = lc.snap_index[snap]
        for lc in self.draft_layers:
            lc.window[2 * slot:2 * slot + 2] = lc.snap_window[2 * snap:2 * snap + 2]
        if self.snap_rows is not None:
            self.restored_rows[slot] = self.snap_rows[snap].clone()

    def block_tables_tensor(self, tables: list[list[int]], width: int | None = None) -> Tensor:
        return block_table_tensor(tables, width, self.device)

    # ------------------------------------------------------------------ speculative decoding
    def _position_rows(self, draft: bool):
        """(tensor, rows per slot, page size or 0) of every per-slot ring that a position indexes:
        the window pages (FlashMLA entries, 128 per slot) and the compressor rings (fp32 rows) of
        the main layers, or the draft layers' windows."""
        out = []
        for lc in (self.draft_layers if draft else self.layers):
            out.append((lc.window, WINDOW, WINDOW_PAGE))
            for ring in (lc.comp_state, lc.index_state):
                if ring is not None:
                    out.append((ring, ring.shape[1], 0))
        return out

    def save_positions(self, slot: int, start: int, end: int, draft: bool = False) -> list:
        """Copies of what positions ``start .. end-1`` of ``slot`` map to in every position-indexed
        ring of the main layers (``draft``: of the draft layers): what a speculative chunk over those
        positions overwrites while it may still be needed (``engine.spec_decode``)."""
        out = []
        pos = torch.arange(start, end, device=self.device)
        for t, rows, page in self._position_rows(draft):
            if page:
                data, scales = page_views(t, page)
                e = slot * rows + pos % rows
                out.append((data[e // page, e % page].clone(), scales[e // page, e % page].clone()))
            else:
                out.append(t[slot, pos % rows].clone())
        return out

    def restore_positions(self, slot: int, start: int, end: int, saved: list, keep: int,
                          draft: bool = False) -> None:
        """Write back what ``save_positions(slot, start, end, draft)`` copied, for positions
        ``keep .. end-1`` (the rejected ones): the accepted positions keep what the chunk wrote."""
        if keep >= end:
            return
        pos = torch.arange(keep, end, device=self.device)
        for (t, rows, page), old in zip(self._position_rows(draft), saved):
            if page:
                data, scales = page_views(t, page)
                e = slot * rows + pos % rows
                data[e // page, e % page] = old[0][keep - start:]
                scales[e // page, e % page] = old[1][keep - start:]
            else:
                t[slot, pos % rows] = old[keep - start:]


# ---------------------------------------------------------------------------------------------
# the reference state interface on top of the pools
def _entry_slots(cache: KVCache, block_table: list[int], first: int, n: int, per_block: int, what: str) -> Tensor:
    """Global page-entry ids of entries first .. first+n-1 (entry j: block_table[j // per_block])."""
    last_block = (first + n - 1) // per_block
    if last_block >= len(block_table):
        raise KVCacheError(
            f"{what}: entry {first + n - 1} needs block-table index {last_block} (tokens up to "
            f"{(last_block + 1) * BLOCK_TOKENS}) but the table has {len(block_table)} blocks; grow it to "
            f"blocks_needed(pos + n) before the forward")
    blocks = block_table[first // per_block:last_block + 1]
    for b in blocks:
        if not (isinstance(b, int) and 0 <= b < cache.num_blocks and cache._ref[b] > 0):
            raise KVCacheError(f"{what}: block {b!r} in the block table is not an allocated block")
    j = torch.arange(first, first + n)
    bt = torch.tensor(blocks, dtype=torch.int64)
    ids = bt[j // per_block - first // per_block] * per_block + j % per_block
    return ids.to(cache.device)


class PagedCompressorState:
    """One compressor's state: pending rows in the slot's fp32 ring, entries in the block pages."""

    def __init__(self, cache: KVCache, seq: "PagedSequenceState", layer: int, indexer: bool):
        lc = cache.layers[layer]
        # the sequence state owns this one: a weak back-reference, so that a dropped sequence state (and with
        # it the pools it reaches through ``cache``) goes at once, not at the next cycle collection
        self.cache, self.seq, self.layer, self.is_indexer = cache, weakref.proxy(seq), layer, indexer
        self.ratio = lc.ratio
        self.overlap = lc.ratio == 4
        self.dim = cache.model_cfg.index_head_dim if indexer else cache.model_cfg.head_dim
        self._ring = (lc.index_state if indexer else lc.comp_state)[seq.slot]   # [coff*m, 2*coff*c] view
        self._width = _coff(self.ratio) * self.dim
        self._start = self._end = 0           # pending positions [start, end)
        self._n = 0                           # entries written

    @property
    def num_entries(self) -> int:
        return self._n

    def _rows(self, start: int, end: int) -> Tensor:
        return torch.arange(start, end, device=self._ring.device) % self._ring.shape[0]

    def pending(self, p0: int) -> tuple[Tensor, Tensor, int]:
        """(K rows, score rows, position of the first row) for positions start .. p0-1 (fp32)."""
        if p0 != self._end:
            raise KVCacheError(f"compressor state of layer {self.layer} is at position {self._end}, not {p0}")
        rows = self._ring[self._rows(self._start, self._end)]
        return rows[:, :self._width], rows[:, self._width:], self._start

    def set_pending(self, k: Tensor, s: Tensor, start: int) -> None:
        n = k.shape[0]
        if n > self._ring.shape[0] or s.shape[0] != n:
            raise KVCacheError(f"{n} pending rows do not fit the ring of {self._ring.shape[0]} rows")
        if n:
            self._ring[self._rows(start, start + n)] = torch.cat([k, s], dim=1).to(self._ring)
        self._start, self._end = start, start + n

    def _slots(self, first: int, n: int) -> Tensor:
        per = INDEX_PAGE if self.is_indexer else self.cache.layers[self.layer].entries_per_block
        what = f"layer {self.layer} {'indexer' if self.is_indexer else 'compressor'}"
        return _entry_slots(self.cache, self.seq.block_table, first, n, per, what)

    def entries(self) -> Tensor:
        lc = self.cache.layers[self.layer]
        if self._n == 0:
            return torch.zeros(0, self.dim, dtype=torch.bfloat16, device=self.cache.device)
        slots = self._slots(0, self._n)
        if self.is_indexer:
            return read_index_entries(lc.index_keys, slots, INDEX_PAGE, self.dim)
        return read_kv_entries(lc.entries, slots, lc.entries_per_block)

    def append_entries(self, new: Tensor) -> None:
        n = new.shape[0]
        if n == 0:
            return
        _check_bf16(new, self.layer)
        lc = self.cache.layers[self.layer]
        slots = self._slots(self._n, n)
        new = new.to(self.cache.device)
        if self.is_indexer:
            write_index_entries(lc.index_keys, slots, new, INDEX_PAGE)
        else:
            write_kv_entries(lc.entries, slots, new, lc.entries_per_block)
        self._n += n


class PagedLayerState:
    """One main layer: the slot's 128-token window ring plus the compressor / indexer states."""

    def __init__(self, cache: KVCache, seq: "PagedSequenceState", layer: int):
        self.cache, self.seq, self.layer = cache, weakref.proxy(seq), layer    # owned by seq (as above)
        self.win = WINDOW
        self._end = 0
        r = cache.layers[layer].ratio
        self.compressor = PagedCompressorState(cache, seq, layer, False) if r else None
        self.indexer = PagedCompressorState(cache, seq, layer, True) if r == 4 else None

    def _slots(self, start: int, end: int) -> Tensor:
        return torch.arange(start, end, device=self.cache.device) % WINDOW + self.seq.slot * WINDOW

    def read_window(self, p0: int) -> Tensor:
        """KV rows of positions max(0, p0 - 128) .. p0-1 (bf16 [min(p0, 128), 512])."""
        if p0 != self._end:
            raise KVCacheError(f"window of layer {self.layer} is at position {self._end}, not {p0}")
        return read_kv_entries(self.cache.layers[self.layer].window,
                               self._slots(max(0, p0 - WINDOW), p0), WINDOW_PAGE)

    def write_window(self, rows: Tensor, end_pos: int) -> None:
        """Store the rows of positions end_pos - len(rows) .. end_pos-1 (len <= 128)."""
        n = rows.shape[0]
        if n > WINDOW:
            raise ValueError(f"write_window: {n} rows, at most {WINDOW}")
        if end_pos > len(self.seq.block_table) * BLOCK_TOKENS:
            raise KVCacheError(
                f"layer {self.layer}: position {end_pos - 1} is beyond the block table "
                f"({len(self.seq.block_table)} blocks = {len(self.seq.block_table) * BLOCK_TOKENS} tokens); "
                f"grow it to blocks_needed(pos + n) before the forward")
        _check_bf16(rows, self.layer)
        write_kv_entries(self.cache.layers[self.layer].window, self._slots(end_pos - n, end_pos),
                         rows.to(self.cache.device), WINDOW_PAGE)
        self._end = end_pos


def _check_bf16(t: Tensor, layer: int) -> None:
    if t.dtype != torch.bfloat16:
        raise ValueError(f"layer {layer}: the paged cache stores bf16/FP8 values, got {t.dtype} "
                         f"(numerics='exact' runs only on model.new_state())")


class PagedSequenceState:
    """Stand-in for ``reference.state.SequenceState`` on a ``KVCache`` slot and block table.

    ``block_table`` is kept by reference: the engine appends blocks to the same list before a
    forward that needs them. MTP is not cached (``mtp`` stays None)."""

    def __init__(self, cache: KVCache, slot: int, block_table: list[int]):
        if not (0 <= slot < cache.max_num_seqs and cache._slot_used[slot]):
            raise ValueError(f"slot {slot} is not an allocated slot")
        self.cache, self.slot, self.block_table = cache, slot, block_table
        self.pos = 0
        self.mtp = None
        self.mtp_pos = 0
        self.last_hidden: Tensor | None = None
        self.layers = [PagedLayerState(cache, self, i) for i in range(cache.model_cfg.num_hidden_layers)]

    def advance_to(self, pos: int) -> None:
        """Set every counter to ``pos`` after a fused kernel path wrote the cache rows and entries
        of the tokens up to ``pos`` directly (the counters are all functions of the position)."""
        self.pos = pos
        for ls in self.layers:
            ls._end = pos
            for cs in (ls.compressor, ls.indexer):
                if cs is not None:
                    m = cs.ratio
                    cs._n = pos // m
                    cs._start = m * max(0, cs._n - 1) if cs.overlap else m * cs._n
                    cs._end = pos

    def blocks_missing(self, num_new_tokens: int) -> int:
        """Blocks to append to the table before a forward of ``num_new_tokens`` more tokens."""
        return max(0, blocks_needed(self.pos + num_new_tokens) - len(self.block_table))

    def block_table_tensor(self, width: int | None = None) -> Tensor:
        return block_table_tensor([self.block_table], width, self.cache.device)[0]

    def release(self) -> None:
        """Give the blocks and the slot back to the cache (the state is unusable afterwards)."""
        self.cache.free_blocks(self.block_table)
        self.block_table.clear()
        self.cache.free_slot(self.slot)
        self.layers = []
