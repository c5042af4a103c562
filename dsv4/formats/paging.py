"""Paged KV-cache geometry shared by the cache pools, the model and the kernels (spec §10).

A KV block is the allocation unit of ``BLOCK_TOKENS`` tokens (one block table per sequence,
shared by all layers); a sequence slot holds a ``WINDOW``-token sliding-window ring of
``WINDOW // WINDOW_PAGE`` pages; a CSA block holds ``INDEX_PAGE`` MXFP4 indexer keys
(``formats.index_key``). ``dsv4.engine.kv_cache`` allocates the pools laid out this way.
"""
from __future__ import annotations

import torch
from torch import Tensor

BLOCK_TOKENS = 256          # tokens per KV block (allocation unit)
WINDOW = 128                # sliding-window tokens per sequence slot
WINDOW_PAGE = 64            # entries per window page (2 pages per slot and layer)
INDEX_PAGE = 64             # indexer keys per block (= BLOCK_TOKENS // 4)


def blocks_needed(num_tokens: int) -> int:
    """KV blocks a sequence of ``num_tokens`` tokens needs: ceil(num_tokens / 256)."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return -(-num_tokens // BLOCK_TOKENS)


def block_table_tensor(tables: list[list[int]], width: int | None = None, device="cpu") -> Tensor:
    """Block tables of a batch as int32 [B, width] (default: the longest table), padded with -1."""
    w = max((len(t) for t in tables), default=0) if width is None else width
    out = torch.full((len(tables), w), -1, dtype=torch.int32)
    for i, t in enumerate(tables):
        if len(t) > w:
            raise ValueError(f"block table {i} has {len(t)} blocks, more than width={w}")
        if t:
            out[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    return out.to(device)


def block_entry_ids(bt: Tensor, e: Tensor, per_block: int, ratio: int) -> tuple[Tensor, Tensor]:
    """(global ids of compressed entries max(e, 0), their block numbers: -1 = unallocated) through the
    block tables bt [B, W]: entry e (covering tokens e * ratio ..) lives in block bt[b, e * ratio // 256]
    at offset e % per_block, global id block * per_block + e % per_block."""
    blk_idx = (e.clamp(min=0) * ratio) // BLOCK_TOKENS
    blk = bt.gather(1, blk_idx.view(bt.shape[0], -1).clamp(max=bt.shape[1] - 1)).view_as(e)
    return blk * per_block + e.clamp(min=0) % per_block, blk
