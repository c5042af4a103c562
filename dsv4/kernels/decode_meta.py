"""Every per-step index and RoPE row of the fused decode step, in one launch.

Each decode step needs, per sequence row b (position ``pos[b]``, window slot ``slots[b]``, block
table ``bt[b]``), a few small index vectors and RoPE rows that every layer shares: the window slot it
writes, the 128 window entries it reads, the compressed-cache entry each compressor writes, the
entries an HCA layer attends to, the indexer's count of visible keys, and cos / sin of the position
for every RoPE table (offset by ``1 - ratio`` for the compressors). As PyTorch ops these were ~120
launches of 1-3 us at batch 1 (H200 profile, session 12); here they are one launch (``decode_meta``)
and the RoPE rows come from tables computed once (``rope_table``), as vLLM's ``cos_sin_cache``.

Outputs (``DecodeMeta``), the formulas of the twin ``decode_meta_torch`` (exact integer arithmetic;
the RoPE rows are copies of table rows, and a table row equals ``rope(p)`` bitwise: both are the same
elementwise fp32 ops on the same angle):

* ``rope[r]`` = (cos, sin) fp32 [B, 32] each, of table ``rope_reqs[r][0]`` at ``pos + rope_reqs[r][1]``;
* ``win_slot`` int64 [B] = ``slots * WINDOW + pos % WINDOW``;
* ``widx`` int32 [B, WINDOW]: window slots of positions ``max(0, pos - WINDOW + 1) ..``, -1 beyond pos;
* ``write_ids[q]`` int64 [B]: the global id of entry ``pos // ratio`` (``write_reqs[q]`` = (ratio,
  per_block)), or the scratch block's first entry (``scratch_block * per_block``) where its block is
  unallocated;
* ``visible[v]`` int32 [B, max_blocks * per_block]: global ids of entries ``0 .. (pos + 1) // ratio -
  1`` (``visible_reqs[v]`` = (ratio, per_block)), -1 for the others and unallocated blocks;
* ``n_valid`` int32 [B] = ``(pos + 1) // 4`` (the indexer's visible keys).

``pos`` must be >= 0 (the engine's positions; Triton's ``%`` / ``//`` truncate where PyTorch floors).
Grid (B, entry chunks): chunk 0 of each row writes everything but ``visible``; every chunk writes its
part of each ``visible`` row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats.paging import BLOCK_TOKENS, WINDOW
from . import interpreting, triton_available

ROPE_HALF = 32          # rope_dim / 2 = 32 complex rotations per position
TABLE_NEG = 128         # rope_table rows start at position -TABLE_NEG (compressor offsets reach -127)
VIS_BLOCK = 1024        # visible entries per program


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


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _decode_meta_kernel(POS, SLOTS, BT, TABS, ROPE_REQ, ROPE_OUT, WIN_SLOT, WIDX, WRITE_REQ, WRITE_OUT,
                            VIS_REQ, VIS0, VIS1, NVALID, B, W, tab_rows, scratch_block,
                            N_ROPE: tl.constexpr, N_WRITE: tl.constexpr, N_VIS: tl.constexpr,
                            WIN: tl.constexpr, HALF: tl.constexpr, NEG: tl.constexpr, VB: tl.constexpr,
                            BLOCK_TOK: tl.constexpr):
        b = tl.program_id(0)
        chunk = tl.program_id(1)
        p = tl.load(POS + b)
        s = tl.load(SLOTS + b)
        bt_row = BT + b.to(tl.int64) * W
        if chunk == 0:
            h = tl.arange(0, HALF)
            for r in tl.static_range(N_ROPE):
                t = tl.load(ROPE_REQ + 2 * r)
                row = tl.minimum(tl.maximum(p + tl.load(ROPE_REQ + 2 * r + 1) + NEG, 0), tab_rows - 1)
                src = TABS + (t.to(tl.int64) * tab_rows + row) * (2 * HALF)
                dst = ROPE_OUT + (r * 2 * B + b).to(tl.int64) * HALF
                tl.store(dst + h, tl.load(src + h))
                tl.store(dst + B * HALF + h, tl.load(src + HALF + h))
            tl.store(WIN_SLOT + b, s * WIN + p % WIN)
            o = tl.arange(0, WIN)
            wpos = tl.maximum(p - (WIN - 1), 0) + o
            tl.store(WIDX + b * WIN + o, tl.where(wpos <= p, s * WIN + wpos % WIN, -1).to(tl.int32))
            tl.store(NVALID + b, ((p + 1) // 4).to(tl.int32))
            for q in tl.static_range(N_WRITE):
                ratio = tl.load(WRITE_REQ + 2 * q)
                per_block = tl.load(WRITE_REQ + 2 * q + 1)
                e = p // ratio
                blk = tl.load(bt_row + tl.minimum((e * ratio) // BLOCK_TOK, W - 1))
                ids = tl.where(blk >= 0, blk * per_block + e % per_block, scratch_block * per_block)
                tl.store(WRITE_OUT + q * B + b, ids)
        j = chunk * VB + tl.arange(0, VB)
        for v in tl.static_range(N_VIS):
            ratio = tl.load(VIS_REQ + 2 * v)
            per_block = tl.load(VIS_REQ + 2 * v + 1)
            n = W * per_block
            m = j < n
            vis = j < (p + 1) // ratio
            blk = tl.load(bt_row + tl.minimum((j * ratio) // BLOCK_TOK, W - 1), mask=m & vis, other=-1)
            ids = tl.where(vis & (blk >= 0), blk * per_block + j % per_block, -1).to(tl.int32)
            if v == 0:
                tl.store(VIS0 + b.to(tl.int64) * n + j, ids, mask=m)
            else:
                tl.store(VIS1 + b.to(tl.int64) * n + j, ids, mask=m)


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


def _check(pos, slots, bt, tables, plan):
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


def decode_meta(pos, slots, bt, tables, plan: MetaPlan, scratch_block: int) -> DecodeMeta:
    """One launch: the step's ``DecodeMeta`` (module doc). tables: fp32 [n, rows, 64] stacked
    ``rope_table``s."""
    _check(pos, slots, bt, tables, plan)
    B, W = bt.shape
    dev = pos.device
    R = len(plan.rope_reqs)
    rope_out = torch.empty(R, 2, B, ROPE_HALF, dtype=torch.float32, device=dev)
    win_slot = torch.empty(B, dtype=torch.int64, device=dev)
    widx = torch.empty(B, WINDOW, dtype=torch.int32, device=dev)
    write_out = torch.empty(len(plan.write_reqs), B, dtype=torch.int64, device=dev)
    vis = [torch.empty(B, n, dtype=torch.int32, device=dev) for n in plan.sizes]
    n_valid = torch.empty(B, dtype=torch.int32, device=dev)
    meta = DecodeMeta([(rope_out[r, 0], rope_out[r, 1]) for r in range(R)], win_slot, widx,
                      list(write_out.unbind(0)), vis, n_valid)
    if B == 0:
        return meta
    v0, v1 = (vis + [n_valid, n_valid])[:2]          # unused pointers where fewer
    nr, nw = 2 * R, 2 * len(plan.write_reqs)
    chunks = max([1] + [triton.cdiv(n, VIS_BLOCK) for n in plan.sizes])
    kw = {} if interpreting() else {"num_warps": 4}
    _decode_meta_kernel[(B, chunks)](pos, slots, bt.contiguous(), tables, plan.req, rope_out, win_slot, widx,
                                     plan.req[nr:], write_out, plan.req[nr + nw:], v0, v1, n_valid, B, W,
                                     tables.shape[1], scratch_block,
                                     N_ROPE=R, N_WRITE=len(plan.write_reqs), N_VIS=len(vis),
                                     WIN=WINDOW, HALF=ROPE_HALF, NEG=TABLE_NEG, VB=VIS_BLOCK,
                                     BLOCK_TOK=BLOCK_TOKENS, **kw)
    return meta


def decode_meta_torch(pos, slots, bt, tables, plan: MetaPlan, scratch_block: int) -> DecodeMeta:
    """Twin: the fast decoder's former PyTorch formulas (``rope`` rows gathered from the tables)."""
    _check(pos, slots, bt, tables, plan)
    from .paging import block_entry_ids, entry_ids_torch
    B, W = bt.shape
    rope = []
    for t, off in plan.rope_reqs:
        rows = tables[t][(pos + off + TABLE_NEG).clamp(0, tables.shape[1] - 1)]
        rope.append((rows[:, :ROPE_HALF].contiguous(), rows[:, ROPE_HALF:].contiguous()))
    win_slot = slots * WINDOW + pos % WINDOW
    wpos = (pos - (WINDOW - 1)).clamp(min=0)[:, None] + torch.arange(WINDOW, device=pos.device)
    widx = torch.where(wpos <= pos[:, None], slots[:, None] * WINDOW + wpos % WINDOW, -1).to(torch.int32)
    write_ids = []
    for ratio, pb in plan.write_reqs:
        ids, blk = block_entry_ids(bt, (pos // ratio)[:, None], pb, ratio)
        write_ids.append(torch.where(blk >= 0, ids, scratch_block * pb)[:, 0])
    visible = []
    for ratio, pb in plan.visible_reqs:
        j = torch.arange(W * pb, device=pos.device)[None, :].expand(B, -1)
        e = torch.where(j < ((pos + 1) // ratio)[:, None], j, -1)
        visible.append(entry_ids_torch(bt, e, pb, ratio).to(torch.int32))
    return DecodeMeta(rope, win_slot, widx, write_ids, visible, ((pos + 1) // 4).to(torch.int32))


__all__ = ["DecodeMeta", "MetaPlan", "decode_meta", "decode_meta_torch", "rope_table", "TABLE_NEG", "WINDOW"]
