"""Every per-step index and RoPE row of the fused decode step (``formats.decode_plan``), in one launch.

As PyTorch ops these are ~120 launches of 1-3 us at batch 1 (docs/benchmarks-2026-12-01.md, session
12); here one. The outputs are ``formats.decode_plan.DecodeMeta``'s, exactly the twin's
(``twins.decode_meta``: integer arithmetic; the RoPE rows are copies of table rows). Grid (B, entry
chunks of ``VIS_BLOCK``): chunk 0 of each row writes everything but ``visible``; every chunk writes its
part of each ``visible`` row. ``pos`` must be >= 0 (Triton's ``%`` / ``//`` truncate where PyTorch
floors).
"""
from __future__ import annotations

import torch

from ..formats.decode_plan import ROPE_HALF, TABLE_NEG, DecodeMeta, MetaPlan, check_args
from ..formats.paging import BLOCK_TOKENS, WINDOW
from .lib import PDL_LAUNCH, interpreting, triton_available

VIS_BLOCK = 1024        # visible entries per program

if triton_available():
    import triton
    import triton.language as tl

    from .lib import pdl_wait

    @triton.jit
    def _decode_meta_kernel(POS, SLOTS, BT, TABS, ROPE_REQ, ROPE_OUT, WIN_SLOT, WIDX, WRITE_REQ, WRITE_OUT,
                            VIS_REQ, VIS0, VIS1, NVALID, B, W, tab_rows, scratch_block,
                            N_ROPE: tl.constexpr, N_WRITE: tl.constexpr, N_VIS: tl.constexpr,
                            WIN: tl.constexpr, HALF: tl.constexpr, NEG: tl.constexpr, VB: tl.constexpr,
                            BLOCK_TOK: tl.constexpr):
        pdl_wait()
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


def decode_meta(pos, slots, bt, tables, plan: MetaPlan, scratch_block: int) -> DecodeMeta:
    """One launch: the step's ``DecodeMeta`` (module doc). tables: fp32 [n, rows, 64] stacked
    ``rope_table``s."""
    check_args(pos, slots, bt, tables, plan)
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
                                     BLOCK_TOK=BLOCK_TOKENS, **kw, **PDL_LAUNCH)
    return meta


__all__ = ["decode_meta"]
