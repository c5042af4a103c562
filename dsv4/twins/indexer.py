"""Twins of ``kernels.indexer``: the q prologue (RoPE, Hadamard, FP4 QDQ), the scores over the paged
MXFP4 keys with the reference's bf16 rounding points and causal rule, and the top-k as a stable
descending sort (the reference's tie rule)."""
from __future__ import annotations

import torch

from ..formats.fp4 import fp4_qdq
from ..formats.index_key import read_index_keys
from ..formats.paging import INDEX_PAGE
from ..reference.hadamard import hadamard_128
from ..reference.numerics import OFFICIAL
from ..reference.rope import apply_rope


def index_q_prologue(q, cos, sin, **_):
    x = apply_rope(q, torch.complex(cos.float(), sin.float()))
    return fp4_qdq(hadamard_128(x, OFFICIAL), 32)


def index_scores(q, w, pages, block_table, pos, n=None, out_dtype=torch.bfloat16, w_scale=None, **_):
    """The scoring part of ``reference.indexer.Indexer.select`` on the paged cache (official numerics).
    Only the entries some row can see are decoded and scored (the reference's own key count; the
    rest are -inf): the table may span ``max_model_len`` while the sequences hold a few entries.
    ``w_scale``: ``w`` is the fp32 ``weights_proj`` output; the head weights are then its bf16
    rounding times ``w_scale``, rounded to bf16 (the reference's order)."""
    if w_scale is not None:
        w = (w.to(torch.bfloat16) * w_scale).to(torch.bfloat16)
    num = OFFICIAL
    B = q.shape[0]
    n_bt = block_table.shape[1]
    n_out = INDEX_PAGE * n_bt if n is None else n
    n = min(n_out, int((pos.long().max() + 1) // 4)) if B else 0        # the twin synchronises anyway
    if n < n_out:
        out = torch.full((B, n_out), float("-inf"), dtype=out_dtype, device=q.device)
        if n:
            out[:, :n] = index_scores(q, w, pages, block_table, pos, n, out_dtype)
        return out
    j = torch.arange(n, device=q.device)[None, :].expand(B, -1)
    blk = block_table.long().gather(1, (j // INDEX_PAGE).clamp(max=n_bt - 1))
    ids = torch.where(blk >= 0, blk * INDEX_PAGE + j % INDEX_PAGE, -1)
    r = num.round
    if B > 1 and (block_table.stride(0) == 0 or bool((block_table == block_table[:1]).all())):
        # one sequence's rows (a prefill chunk): its keys once, the reference's "nhd,td->nht"
        keys = read_index_keys(pages, ids[0])                            # [n, 128] bf16
        sc = r(num.einsum("bhd,td->bht", q.float(), keys.float()))
    else:
        keys = read_index_keys(pages, ids)                               # [B, n, 128] bf16
        sc = r(num.einsum("bhd,btd->bht", q.float(), keys.float()))
    sc = r(sc.relu() * w.bfloat16().unsqueeze(-1))
    sc = r(sc.float().sum(dim=1))
    visible = ((pos.long() + 1) // 4)[:, None]
    sc = sc.masked_fill((j >= visible) | (blk < 0), float("-inf"))
    return sc.to(out_dtype)


def index_topk(scores, k, n_valid=None, out_dtype=torch.int32, **_):
    """Stable descending sort (the reference's tie rule), -1 past min(k, n_valid). Only the first max(n_valid)
    columns are sorted: every later one is -inf at an index >= each row's n_valid, so the full sort puts it after
    them and it comes out -1 (a decode step's scores span the whole context, its n_valid the position's)."""
    B, N = scores.shape
    if n_valid is None:
        n_valid = torch.full((B,), N, device=scores.device)
    nv = n_valid.long()[:, None]
    if B:
        N = min(N, int(nv.max()))                   # a device sync: the twin synchronises anyway
        scores = scores[:, :N]
    j = torch.arange(N, device=scores.device)[None, :]
    s = scores.float().masked_fill(j >= nv, float("-inf"))
    idx = s.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    idx = idx.masked_fill(idx >= nv, -1)
    if idx.shape[1] < k:
        idx = torch.cat([idx, idx.new_full((B, k - idx.shape[1]), -1)], dim=1)
    return idx.to(out_dtype)


__all__ = ["index_q_prologue", "index_scores", "index_topk"]
