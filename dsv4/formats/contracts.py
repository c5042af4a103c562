"""Argument contracts of the cache-touching ops: the shapes, dtypes and cache layouts that a kernel
(``dsv4.kernels``) and its twin (``dsv4.twins``) both check, with the same ValueError naming the
argument."""
from __future__ import annotations

import torch

from .kv_entry import KV_DIM as HEAD_DIM
from .kv_entry import ROPE_DIM, page_bytes


def check_kv_insert(q, kv, cos, sin, pages, slot_mapping, page_size):
    """The ``kv_insert`` contract (kernels and twins): ValueError naming the argument. ``q`` None: kv only."""
    T = kv.shape[0]
    if q is not None and (q.dim() != 3 or q.shape[0] != T or q.shape[2] != HEAD_DIM or q.dtype != torch.bfloat16):
        raise ValueError(f"q: expected bf16 [T={T}, H, 512], got {q.dtype} {tuple(q.shape)}")
    if kv.dim() != 2 or kv.shape[1] != HEAD_DIM or kv.dtype != torch.bfloat16:
        raise ValueError(f"kv: expected bf16 [T, 512], got {kv.dtype} {tuple(kv.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (T, ROPE_DIM // 2) or t.dtype != torch.float32:
            raise ValueError(f"{name}: expected fp32 [{T}, 32], got {t.dtype} {tuple(t.shape)}")
    if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.shape[1] != page_bytes(page_size):
        raise ValueError(f"pages: expected uint8 [num_pages, {page_bytes(page_size)}], got "
                         f"{pages.dtype} {tuple(pages.shape)}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (T,):
        raise ValueError(f"slot_mapping: expected int64 [{T}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")


def check_inverse_rope(o, cos, sin):
    if o.dim() != 3 or o.shape[2] != 512 or o.dtype != torch.bfloat16:
        raise ValueError(f"o: expected bf16 [T, H, 512], got {o.dtype} {tuple(o.shape)}")
    T = o.shape[0]
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (T, 32) or t.dtype != torch.float32:
            raise ValueError(f"{name}: expected fp32 [{T}, 32], got {t.dtype} {tuple(t.shape)}")


def check_sparse_attention(q, window_idx, extra_idx, window_pages, extra_pages, sinks, window_page_size,
                  extra_page_size):
    if q.dim() != 3 or q.shape[2] != HEAD_DIM or q.dtype != torch.bfloat16:
        raise ValueError(f"q: expected bf16 [T, H, 512], got {q.dtype} {tuple(q.shape)}")
    T, H = q.shape[:2]
    for name, idx in (("window_idx", window_idx), ("extra_idx", extra_idx)):
        if idx is None:
            continue
        if idx.dim() != 2 or idx.shape[0] != T or idx.dtype != torch.int32:
            raise ValueError(f"{name}: expected int32 [{T}, K], got {idx.dtype} {tuple(idx.shape)}")
    for name, pages, psz in (("window_pages", window_pages, window_page_size),
                             ("extra_pages", extra_pages, extra_page_size)):
        if pages is None:
            continue
        if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.shape[1] != page_bytes(psz):
            raise ValueError(f"{name}: expected uint8 [num_pages, {page_bytes(psz)}], got "
                             f"{pages.dtype} {tuple(pages.shape)}")
    if sinks.shape != (H,) or sinks.dtype != torch.float32:
        raise ValueError(f"sinks: expected fp32 [{H}], got {sinks.dtype} {tuple(sinks.shape)}")


def check_sparse_workspaces(kv_bf16, window_idx, extra_idx):
    """The sparse attention's ``kv_bf16`` = (window, extra): dense contiguous bf16 [rows, 512] workspaces of
    dequantised entries, one for each list given (None for a list not given) -> the two tensors a launch passes
    in the pages' places (a missing one stands in for the other)."""
    if not isinstance(kv_bf16, (tuple, list)) or len(kv_bf16) != 2:
        raise ValueError("kv_bf16: expected (window workspace, extra workspace)")
    for name, ws, idx in (("window", kv_bf16[0], window_idx), ("extra", kv_bf16[1], extra_idx)):
        if idx is None or idx.shape[1] == 0:
            continue
        if ws is None or ws.dtype != torch.bfloat16 or ws.dim() != 2 or ws.shape[1] != HEAD_DIM \
                or not ws.is_contiguous():
            got = None if ws is None else f"{ws.dtype} {tuple(ws.shape)}"
            raise ValueError(f"kv_bf16: the {name} workspace must be contiguous bf16 [slots, {HEAD_DIM}], got {got}")
    w, e = kv_bf16
    return (w if w is not None else e), (e if e is not None else w)


def compressor_dims(state: torch.Tensor, ratio: int) -> tuple[int, int, bool]:
    overlap = ratio == 4
    coff = 2 if overlap else 1
    if state.dim() != 3 or state.dtype != torch.float32 or state.shape[1] != coff * ratio \
            or state.shape[2] % (2 * coff) != 0:
        raise ValueError(f"state: expected fp32 [slots, {coff * ratio}, 2*{coff}*c], got {state.dtype} "
                         f"{tuple(state.shape)}")
    c = state.shape[2] // (2 * coff)
    return c, coff, overlap


def check_compressor_pages(pages, page_slots, page_size, indexer, n):
    """The paged cache a kernel writes: main 584-byte entries or indexer 68-byte MXFP4 keys."""
    want = page_size * 68 if indexer else page_bytes(page_size)
    if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.shape[1] != want:
        raise ValueError(f"pages: expected uint8 [num_pages, {want}], got {pages.dtype} {tuple(pages.shape)}")
    if page_slots is None or page_slots.shape != (n,):
        raise ValueError(f"page_slots: expected [{n}] slot ids with pages")


def check_compress_decode(state, slots, pos, k, s, cos, sin, ratio, indexer):
    c, coff, _ = compressor_dims(state, ratio)
    B = pos.shape[0]
    if c != (128 if indexer else 512):
        raise ValueError(f"{'indexer' if indexer else 'main'} compressor needs c = {128 if indexer else 512}, got {c}")
    for name, t in (("k", k), ("s", s)):
        if t.shape != (B, coff * c) or t.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"{name}: expected fp32 or bf16 [{B}, {coff * c}], got {t.dtype} {tuple(t.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (B, ROPE_DIM // 2) or t.dtype != torch.float32:
            raise ValueError(f"{name}: expected fp32 [{B}, 32], got {t.dtype} {tuple(t.shape)}")
    if slots.shape != (B,) or pos.shape != (B,):
        raise ValueError(f"slots/pos: expected [{B}], got {tuple(slots.shape)} / {tuple(pos.shape)}")
    return c, coff


def check_compress_prefill(rows_k, rows_s, base, first, last, norm_w, cos, sin, ratio, indexer):
    """Validate a prefill chunk's arguments (host ints and shapes); -> (c, coff, n entries)."""
    if ratio not in (4, 128):
        raise ValueError(f"ratio must be 4 (CSA) or 128 (HCA), got {ratio}")
    overlap = ratio == 4
    coff = 2 if overlap else 1
    c = 128 if indexer else 512
    base, first, last = int(base), int(first), int(last)
    for name, t in (("rows_k", rows_k), ("rows_s", rows_s)):
        if t.dim() != 2 or t.dtype != torch.float32 or t.shape[1] != coff * c:
            raise ValueError(f"{name}: {'indexer' if indexer else 'main'} compressor (ratio {ratio}) needs fp32 "
                             f"[R, {coff * c}], got {t.dtype} {tuple(t.shape)}")
        if t.shape[0] and t.stride(1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim")
    if rows_s.shape[0] != rows_k.shape[0]:
        raise ValueError(f"rows_k / rows_s: {rows_k.shape[0]} vs {rows_s.shape[0]} rows")
    if norm_w.shape != (c,):
        raise ValueError(f"norm_w: expected [{c}], got {tuple(norm_w.shape)}")
    if base < 0 or first < 0 or last < first:
        raise ValueError(f"need 0 <= base and 0 <= first <= last, got base={base}, first={first}, last={last}")
    n = last - first
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (n, ROPE_DIM // 2) or t.dtype != torch.float32:
            raise ValueError(f"{name}: expected fp32 [{n}, 32] (rows for positions j*{ratio}, j = first .. last-1), "
                             f"got {t.dtype} {tuple(t.shape)}")
    if n:
        lo = (first - 1) * ratio if overlap and first > 0 else first * ratio
        hi = last * ratio
        R = rows_k.shape[0]
        if base > lo or base + R < hi:
            raise ValueError(f"rows cover positions [{base}, {base + R}) but entries {first} .. {last - 1} "
                             f"(ratio {ratio}{', overlapping windows' if overlap else ''}) need [{lo}, {hi})")
    return c, coff, n

