"""Lightning indexer of CSA layers (spec §6): picks the top-k compressed entries per query.

Scores I[i, t] = sum_h relu(q_h . K_t) * w_h with bf16 rounding after the dot product, after the
weighting and after the head sum (as the official bf16 einsum); causal rule: entry t is visible
to position i once i >= 4t + 3.
"""
from __future__ import annotations

import torch

from .compressor import Compressor
from .hadamard import hadamard_128
from .linear import Linear
from .numerics import Numerics
from .rope import apply_rope
from .state import CompressorState
from ..formats.fp4 import fp4_qdq


class Indexer:
    def __init__(self, wq_b: Linear, weights_proj: Linear, compressor: Compressor,
                 n_heads: int, head_dim: int, topk: int, num: Numerics):
        self.wq_b, self.weights_proj, self.compressor = wq_b, weights_proj, compressor
        self.n_heads, self.head_dim, self.topk, self.num = n_heads, head_dim, topk, num

    def queries(self, qr: torch.Tensor, x: torch.Tensor, freqs_cis: torch.Tensor):
        """Row-wise part for all T tokens: rotated, Hadamard'd, FP4-QDQ'd q [T, h, 128] and head weights [T, h]."""
        q = self.wq_b(qr).view(qr.shape[0], self.n_heads, self.head_dim)
        q = apply_rope(q, freqs_cis)
        q = hadamard_128(q, self.num)
        if not self.num.exact:
            q = fp4_qdq(q, 32)
        w = self.num.round(self.weights_proj(x) * (self.head_dim ** -0.5 * self.n_heads ** -0.5))
        return q, w

    def select(self, q: torch.Tensor, w: torch.Tensor, st: CompressorState, ck: torch.Tensor,
               cs: torch.Tensor, positions: torch.Tensor, end_pos: int) -> torch.Tensor:
        """Update this sequence's indexer cache, then return entry ids [n, k] in descending score
        order, -1 where the pick is not causal for that query (k = min(topk, end_pos // 4))."""
        keys = self.compressor.update(st, ck, cs, end_pos)       # [E, 128]
        n, E = q.shape[0], keys.shape[0]
        k = min(self.topk, E)
        if k == 0:
            return torch.zeros(n, 0, dtype=torch.long, device=q.device)
        r = self.num.round
        scores = r(self.num.einsum("nhd,td->nht", q.float(), keys.float()))
        scores = r(scores.relu() * w.unsqueeze(-1))
        scores = r(scores.float().sum(dim=1))                    # [n, E]
        visible = (positions + 1) // 4                           # entries t < visible are causal
        causal = torch.arange(E, device=q.device)[None, :] < visible[:, None]
        scores = scores.masked_fill(~causal, float("-inf"))
        # bf16 scores tie often; a stable sort makes the lower entry id win, so the picks do not
        # depend on how many (masked) entries the row holds: prefill, chunk and decode agree.
        idx = scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]
        return idx.masked_fill(idx >= visible[:, None], -1)
