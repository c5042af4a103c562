"""KV compressor (spec §5): softmax pooling of m-token windows (CSA: overlapping 2m rows).

Prefill, chunked prefill and decode share one path: new K / score rows are appended to the
state's pending rows, every window completed by them is pooled, post-processed and appended to
the entries. Pooling arithmetic is fp32; the pooled vector is rounded before its RMSNorm.
"""
from __future__ import annotations

import torch

from .hadamard import hadamard_128
from .linear import Linear
from .norm import rms_norm
from .numerics import Numerics
from .rope import RopeTable, apply_rope
from .state import CompressorState
from ..formats.fp4 import fp4_qdq
from ..formats.fp8 import fp8_qdq


class Compressor:
    def __init__(self, wkv: Linear, wgate: Linear, ape: torch.Tensor, norm_w: torch.Tensor,
                 ratio: int, dim: int, rope: RopeTable, eps: float, num: Numerics, indexer: bool):
        self.wkv, self.wgate = wkv, wgate
        self.ape = ape.float()                 # [m, coff*c]
        self.norm_w = norm_w.float()
        self.ratio, self.dim, self.rope, self.eps, self.num = ratio, dim, rope, eps, num
        self.overlap = ratio == 4
        self.is_indexer = indexer

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 K rows and scores Z + ape[pos % m] for the normalised layer input ``x`` [T, d]."""
        k = self.wkv(x.float())
        s = self.wgate(x.float()) + self.ape[positions % self.ratio]
        return k, s

    def update(self, st: CompressorState, k: torch.Tensor, s: torch.Tensor, end_pos: int) -> torch.Tensor:
        """Append one sequence's new rows (ending at ``end_pos``); returns all entries [E, c]."""
        m = self.ratio
        p0 = end_pos - k.shape[0]
        pk, ps, start = st.pending(p0)
        rows_k, rows_s = torch.cat([pk, k]), torch.cat([ps, s])
        first, last = st.num_entries, end_pos // m              # entries [first, last) complete now
        if last > first:
            j = torch.arange(first, last, device=k.device)
            cur = (j * m - start)[:, None] + torch.arange(m, device=k.device)  # [nE, m]
            prev = (cur - m).clamp(min=0)
            pooled = self.pool(rows_k[cur], rows_s[cur], rows_k[prev], rows_s[prev], (j > 0)[:, None, None])
            st.append_entries(self.postprocess(pooled, j * m))
        keep_from = m * max(0, last - 1) if self.overlap else m * last
        st.set_pending(rows_k[keep_from - start:], rows_s[keep_from - start:], keep_from)
        return st.entries()

    def pool(self, ck, cs, pk, ps, prev_valid) -> torch.Tensor:
        return pool(ck, cs, pk, ps, prev_valid, self.dim, self.overlap, self.num)

    def postprocess(self, pooled: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return postprocess(pooled, self.norm_w, self.rope(positions), self.eps, self.is_indexer, self.num)


def pool(ck, cs, pk, ps, prev_valid, dim: int, overlap: bool, num: Numerics) -> torch.Tensor:
    """Softmax pooling of windows: current rows ``ck``/``cs`` [n, m, coff*c] fp32; with overlap
    the previous window's rows ``pk``/``ps`` contribute their first channel half ("b" series,
    K=0 / score=-inf where ``prev_valid`` is False) and the current rows their second half.
    -> fp32 [n, c]."""
    c = dim
    if overlap:
        pk = torch.where(prev_valid, pk[..., :c], 0.0)
        ps = torch.where(prev_valid, ps[..., :c], float("-inf"))
        ck = torch.cat([pk, ck[..., c:]], dim=1)          # [n, 2m, c]
        cs = torch.cat([ps, cs[..., c:]], dim=1)
    return num.fn(lambda k, s: (k * s.softmax(dim=1)).sum(dim=1), ck, cs)


def postprocess(pooled: torch.Tensor, norm_w: torch.Tensor, freqs: torch.Tensor, eps: float, indexer: bool,
                num: Numerics) -> torch.Tensor:
    """norm(bf16(pooled)) -> RoPE (``freqs``: complex64 [n, 32] of the windows' first positions) -> QDQ
    (indexer: Hadamard first)."""
    kv = rms_norm(num.round(pooled), norm_w.float(), eps, num)
    kv = apply_rope(kv, freqs)
    if indexer:
        kv = hadamard_128(kv, num)
        return kv if num.exact else fp4_qdq(kv, 32)
    if num.exact:
        return kv
    nope = kv.shape[-1] - 64
    return torch.cat([fp8_qdq(kv[..., :nope], 64), kv[..., nope:]], dim=-1)
