"""Twin of ``kernels.paging``: the compressed-cache entry ids as PyTorch ops (int64)."""
from __future__ import annotations

import torch

from ..formats.paging import block_entry_ids


def entry_ids(bt: torch.Tensor, e: torch.Tensor, per_block: int, ratio: int) -> torch.Tensor:
    ids, blk = block_entry_ids(bt, e, per_block, ratio)
    return torch.where((e >= 0) & (blk >= 0), ids, -1)


__all__ = ["entry_ids"]
