"""Compressed-cache entry ids through the block table, in one launch (spec §10 cache layout).

``entry_ids(bt, e, per_block, ratio)``: entry ``e[b, j]`` (the j-th compressed entry of sequence b,
covering tokens ``e * ratio ..``) lives in block ``bt[b, e * ratio // 256]`` at offset ``e %
per_block``: its global id is ``block * per_block + e % per_block``; -1 where ``e < 0`` or the block is
unallocated (-1). The decode step turns the indexer's top-k picks into attention indices with it
(PyTorch needs ~12 index kernels for the same). Twin: ``twins.paging.entry_ids``
(``formats.paging.block_entry_ids``). Exact integer arithmetic: equal to the twin.
"""
from __future__ import annotations

import torch

from ..formats.paging import BLOCK_TOKENS    # tokens per cache block
from .lib import PDL_LAUNCH, interpreting, triton_available

if triton_available():
    import triton
    import triton.language as tl

    from .lib import pdl_wait

    BLOCK_TOKENS_C = tl.constexpr(BLOCK_TOKENS)

    @triton.jit(do_not_specialize=['n', 'n_blocks', 'per_block', 'ratio', 'stride_bt', 'stride_e', 'stride_o'])
    def _entry_ids_kernel(BT, E, OUT, n, n_blocks, per_block, ratio, stride_bt, stride_e, stride_o,
                          BLOCK: tl.constexpr):
        pdl_wait()
        b = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = j < n
        e = tl.load(E + b * stride_e + j, mask=m, other=-1).to(tl.int64)
        ec = tl.maximum(e, 0)
        bi = tl.minimum((ec * ratio) // BLOCK_TOKENS_C, n_blocks - 1)
        blk = tl.load(BT + b * stride_bt + bi, mask=m, other=-1).to(tl.int64)
        ids = blk * per_block + ec % per_block
        tl.store(OUT + b * stride_o + j, tl.where((e >= 0) & (blk >= 0), ids, -1).to(tl.int32), mask=m)


def entry_ids(bt: torch.Tensor, e: torch.Tensor, per_block: int, ratio: int) -> torch.Tensor:
    """int32 [B, n] global entry ids of local entries e [B, n] (any int dtype; < 0 = none) of
    ratio-``ratio`` layers through the block table bt [B, W] (int, -1 = unallocated)."""
    if e.dim() != 2 or bt.dim() != 2 or e.shape[0] != bt.shape[0]:
        raise ValueError(f"entry_ids: expected e [B, n] and bt [B, W], got {tuple(e.shape)} and {tuple(bt.shape)}")
    B, n = e.shape
    out = torch.empty(B, n, dtype=torch.int32, device=e.device)
    if B and n:
        e2 = e if e.stride(1) == 1 else e.contiguous()
        bt2 = bt if bt.stride(1) == 1 else bt.contiguous()
        BLOCK = 128 if n <= 128 else 1024          # two tiles: few compiled variants over all context lengths
        kw = {} if interpreting() else {"num_warps": 4}
        _entry_ids_kernel[(B, triton.cdiv(n, BLOCK))](bt2, e2, out, n, bt.shape[1], per_block, ratio, bt2.stride(0),
                                                      e2.stride(0), out.stride(0), BLOCK=BLOCK, **kw, **PDL_LAUNCH)
    return out


__all__ = ["entry_ids"]
