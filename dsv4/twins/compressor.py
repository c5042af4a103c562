"""Twin of ``kernels.compressor``: the reference's window pooling and post-processing
(``reference.compressor.pool`` / ``postprocess``, official numerics) with the kernels' arguments,
including the ring writes and the paged cache writes (``formats.kv_entry`` / ``formats.index_key``)."""
from __future__ import annotations

import torch

from ..formats.contracts import check_compress_decode, check_compress_prefill
from ..formats.index_key import write_index_entries
from ..formats.kv_entry import write_kv_entries
from ..reference.compressor import pool, postprocess
from ..reference.numerics import OFFICIAL


def _write_pages(pages, slots, entries, page_size, indexer):
    """Main entries as 584-byte FP8 entries, indexer keys as MXFP4 (slot -1: skip)."""
    if indexer:
        sel = slots >= 0
        if bool(sel.any()):
            write_index_entries(pages, slots[sel], entries[sel], page_size)
    else:
        write_kv_entries(pages, slots, entries, page_size)


def compress_decode(state, slots, pos, k, s, norm_w, cos, sin, *, ratio, indexer=False, ape=None, eps=1e-6,
                    pages=None, page_slots=None, page_size=64, return_pooled=False, **_):
    c, coff = check_compress_decode(state, slots, pos, k, s, cos, sin, ratio, indexer)
    m = ratio
    slots, pos = slots.long(), pos.long()
    if ape is not None:
        s = s + ape.float()[pos % m]
    R = state.shape[1]
    state[slots, pos % R] = torch.cat([k, s], dim=1).float()
    complete = (pos + 1) % m == 0
    start = pos + 1 - m
    cur = start[:, None] + torch.arange(m, device=pos.device)
    rows = state[slots[:, None], cur.clamp(min=0) % R]
    prev = cur - m
    prows = state[slots[:, None], prev.clamp(min=0) % R]
    w = rows.shape[-1] // 2
    pooled = pool(rows[..., :w], rows[..., w:], prows[..., :w], prows[..., w:], (prev >= 0)[..., None], c, m == 4,
                  OFFICIAL)
    out = postprocess(pooled, norm_w, torch.complex(cos.float(), sin.float()), eps, indexer, OFFICIAL)
    out = torch.where(complete[:, None], out, torch.zeros_like(out))
    pooled = torch.where(complete[:, None], pooled, torch.zeros_like(pooled))
    if pages is not None:
        _write_pages(pages, torch.where(complete & (page_slots >= 0), page_slots.long(), -1), out, page_size, indexer)
    return (out, complete, pooled) if return_pooled else (out, complete)


def compress_prefill(rows_k, rows_s, base, first, last, norm_w, cos, sin, *, ratio, indexer=False, eps=1e-6,
                     pages=None, page_slots=None, page_size=64, return_pooled=False, **_):
    c, coff, n = check_compress_prefill(rows_k, rows_s, base, first, last, norm_w, cos, sin, ratio, indexer)
    m = ratio
    dev = rows_k.device
    j = torch.arange(int(first), int(last), device=dev)
    cur = (j * m - int(base))[:, None] + torch.arange(m, device=dev)          # [n, m]
    prev = (cur - m).clamp(min=0)
    pooled = pool(rows_k[cur], rows_s[cur], rows_k[prev], rows_s[prev], (j > 0)[:, None, None], c, m == 4, OFFICIAL)
    out = postprocess(pooled, norm_w, torch.complex(cos.float(), sin.float()), eps, indexer, OFFICIAL)
    if pages is not None:
        _write_pages(pages, page_slots.long(), out, page_size, indexer)
    return (out, pooled) if return_pooled else out


__all__ = ["compress_decode", "compress_prefill"]
