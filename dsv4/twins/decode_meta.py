"""Twin of ``kernels.decode_meta``: the step's plan (``formats.decode_plan``) as PyTorch ops (exact
integer arithmetic; RoPE rows gathered from the same tables)."""
from __future__ import annotations

import torch

from ..formats.decode_plan import ROPE_HALF, TABLE_NEG, DecodeMeta, MetaPlan, check_args
from ..formats.paging import WINDOW, block_entry_ids
from .paging import entry_ids


def decode_meta(pos, slots, bt, tables, plan: MetaPlan, scratch_block: int) -> DecodeMeta:
    check_args(pos, slots, bt, tables, plan)
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
        visible.append(entry_ids(bt, e, pb, ratio).to(torch.int32))
    return DecodeMeta(rope, win_slot, widx, write_ids, visible, ((pos + 1) // 4).to(torch.int32))


__all__ = ["decode_meta"]
