"""Twin of ``kernels.kv_insert``: q head RMSNorm (the official bf16 op chain) + RoPE, kv RoPE + FP8
QDQ of the nope dims, the 584-byte entries written into the paged cache (``formats.kv_entry``)."""
from __future__ import annotations

import torch

from ..formats.contracts import check_kv_insert
from ..formats.fp8 import fp8_qdq
from ..formats.kv_entry import NOPE_DIM, write_kv_entries
from ..reference.norm import head_rms_norm
from ..reference.numerics import OFFICIAL
from ..reference.rope import apply_rope


def q_transform(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """q's half of the insert: the weightless head RMSNorm (official bf16 op chain), then RoPE by (cos, sin)."""
    return apply_rope(head_rms_norm(q, eps, OFFICIAL), torch.complex(cos.float(), sin.float()))


def kv_insert(q: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              pages: torch.Tensor, slot_mapping: torch.Tensor, page_size: int, eps: float = 1e-6, **_
              ) -> tuple[torch.Tensor, torch.Tensor]:
    check_kv_insert(q, kv, cos, sin, pages, slot_mapping, page_size)
    q_out = None if q is None else q_transform(q, cos, sin, eps)
    kvr = apply_rope(kv, torch.complex(cos.float(), sin.float()))
    kv_out = torch.cat([fp8_qdq(kvr[:, :NOPE_DIM], 64), kvr[:, NOPE_DIM:]], dim=-1)
    write_kv_entries(pages, slot_mapping, kv_out, page_size)
    return q_out, kv_out


__all__ = ["kv_insert", "q_transform"]
