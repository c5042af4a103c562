"""The fused decode step's per-step plan: what ``decode_meta`` (kernel and twin) computes and the
tables it reads (spec §4.1, §10).

Each decode step needs, per sequence row b (position ``pos[b]``, window slot ``slots[b]``, block
table ``bt[b]``), a few small index vectors and RoPE rows that every layer shares: the window slot it
writes, the 128 window entries it reads, the compressed-cache entry each compressor writes, the
entries an HCA layer attends to, the indexer's count of visible keys, and cos / sin of the position
for every RoPE table (offset by ``1 - ratio`` for the compressors). ``MetaPlan`` lists those
requests once per decoder; ``rope_table`` computes a RoPE table once (as vLLM's ``cos_sin_cache``);
``DecodeMeta`` is the step's result:

* ``rope[r]`` = (cos, sin) fp32 [B, 32] each, of table ``rope_reqs[r][0]`` at ``pos + rope_reqs[r][1]``;
* ``win_slot`` int64 [B] = ``slots * WINDOW + pos % WINDOW``;
* ``widx`` int32 [B, WINDOW]: window slots of positions ``max(0, pos - WINDOW + 1) ..``, -1 beyond pos;
* ``write_ids[q]`` int64 [B]: the global id of entry ``pos // ratio`` (``write_reqs[q]`` = (ratio,
  per_block)), or the scratch block's first entry (``scratch_block * per_block``) where its block is
  unallocated;
* ``visible[v]`` int32 [B, max_blocks * per_block]: global ids of entries ``0 .. (pos + 1) // ratio -
  1`` (``visible_reqs[v]`` = (ratio, per_block)), -1 for the others and unallocated blocks;
* ``n_valid`` int32 [B] = ``(pos + 1) // 4`` (the indexer's visible keys).

``pos`` must be >= 0 (the engine's positions).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .paging import BLOCK_TOKENS

ROPE_HALF = 32          # rope_dim / 2 = 32 complex rotations per position
TABLE_NEG = 128         # rope_table rows start at position -TABLE_NEG (compressor offsets reach -127)


@dataclass
class DecodeMeta:
    rope: list          # [(cos, sin)] per rope request
    win_slot: torch.Tensor
    widx: torch.Tensor
    write_ids: list     # [int64 [B]] per write request
    visible: list       # [int32 [B, n]] per visible request
    n_valid: torch.Tensor


def rope_table(rope, max_pos: int) -> torch.Tensor:
    """fp32 [TABLE_NEG + max_pos, 64]: row i = (cos | sin) of ``rope`` (a ``RopeTable``) at position
    i - TABLE_NEG, computed by ``rope`` itself (the same values it gives per step)."""
    f = rope(torch.arange(-TABLE_NEG, max_pos, device=rope.freqs.device))
    return torch.cat([f.real.float(), f.imag.float()], dim=1).contiguous()


class MetaPlan:
    """What a decoder's steps need (fixed per decoder): rope_reqs [(table index, position offset)],
    write_reqs / visible_reqs [(ratio, per_block)] over block tables of ``max_blocks`` columns. The
    request list is a device tensor built once (a host copy inside a CUDA-graph capture is not
    allowed)."""

    def __init__(self, rope_reqs, write_reqs, visible_reqs, max_blocks: int, device):
        for ratio, per_block in list(write_reqs) + list(visible_reqs):
            if ratio <= 0 or per_block <= 0 or per_block * ratio != BLOCK_TOKENS:
                raise ValueError(f"decode_meta: (ratio {ratio}, per_block {per_block}) is not a cache layout "
                                 f"of {BLOCK_TOKENS}-token blocks")
        if len(visible_reqs) > 2:
            raise ValueError(f"decode_meta: at most 2 visible requests (the kernel's outputs), got {len(visible_reqs)}")
        self.rope_reqs, self.write_reqs, self.visible_reqs = list(rope_reqs), list(write_reqs), list(visible_reqs)
        self.max_blocks = max_blocks
        self.sizes = [max_blocks * pb for _r, pb in self.visible_reqs]
        flat = [x for r in self.rope_reqs for x in r] + [x for r in self.write_reqs for x in r]
        flat += [x for r, pb in self.visible_reqs for x in (r, pb)]
        self.req = torch.tensor(flat + [0], dtype=torch.int64, device=device)


def check_args(pos, slots, bt, tables, plan: "MetaPlan") -> None:
    """ValueError naming the problem unless the arguments fit ``plan`` (module doc)."""
    if pos.dim() != 1 or slots.shape != pos.shape or bt.dim() != 2 or bt.shape[0] != pos.shape[0]:
        raise ValueError(f"decode_meta: expected pos, slots [B] and bt [B, W], got {tuple(pos.shape)}, "
                         f"{tuple(slots.shape)}, {tuple(bt.shape)}")
    for name, t in (("pos", pos), ("slots", slots), ("bt", bt)):
        if t.dtype != torch.int64:
            raise ValueError(f"decode_meta: {name} must be int64, got {t.dtype}")
    if bt.shape[1] != plan.max_blocks:
        raise ValueError(f"decode_meta: block tables have {bt.shape[1]} columns, the plan {plan.max_blocks}")
    if tables.dim() != 3 or tables.shape[2] != 2 * ROPE_HALF or tables.dtype != torch.float32:
        raise ValueError(f"decode_meta: tables must be fp32 [n, rows, {2 * ROPE_HALF}], got "
                         f"{tables.dtype} {tuple(tables.shape)}")
    for t, _off in plan.rope_reqs:
        if not 0 <= t < tables.shape[0]:
            raise ValueError(f"decode_meta: rope request names table {t} of {tables.shape[0]}")


__all__ = ["DecodeMeta", "MetaPlan", "ROPE_HALF", "TABLE_NEG", "check_args", "rope_table"]
