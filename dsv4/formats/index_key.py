"""MXFP4 indexer-key entries and their pages (spec §10; the CSA layers' indexer cache).

An entry is 128 e2m1 codes packed in 64 B + one e8m0 scale byte per 32 values (4 B) = 68 B; a
page of ``page_size`` entries is ``[page_size x D/2 B codes][page_size x D/32 B scales]``, no
padding (``index_page_bytes(64)`` = 4352 B). The rounding is ``fp4_qdq(keys, 32)``'s, so the
codec is lossless on keys the reference has already FP4-QDQ'd.

Two forms of page access, one encoder:

* ``write_index_entries`` / ``read_index_entries`` (and ``encode_index_keys``): checked — slot
  ranges, dtypes, NaN inputs and the scales' power-of-two property are validated, some of it on
  the host (device syncs);
* ``write_index_keys`` / ``read_index_keys``: sync-free (no host round trip; usable inside a CUDA
  graph): the same page views and the same encode core without the checks (writes expect valid
  slots; a read of a slot < 0 returns key 0, for the caller to mask).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .fp4 import E2M1_MAX, MXFP4_BLOCK, magnitude_codes, e2m1_decode, pack_fp4, unpack_fp4
from .fp8 import e8m0_to_fp32, fp32_to_e8m0, ue8m0_scale
from .paging import INDEX_PAGE

_FP4_SCALE_FLOOR = E2M1_MAX * 2.0 ** -126      # fp4_qdq's amax floor (all-zero blocks)


def index_entry_bytes(dim: int = 128) -> int:
    return dim // 2 + dim // MXFP4_BLOCK


def index_page_bytes(page_size: int = INDEX_PAGE, dim: int = 128) -> int:
    """One page: [page_size x D/2 B codes][page_size x D/32 B scales], no padding."""
    return page_size * index_entry_bytes(dim)


# ------------------------------------------------------------------ the encoder
def _scale_blocks(keys: Tensor) -> tuple[Tensor, Tensor]:
    """Sync-free: bf16 [N, D] -> (scaled values fp32 [N, D/32, 32] clamped to +-6, fp32
    power-of-two scales [N, D/32]); scale = ue8m0_scale(amax, 6) as in ``fp4_qdq(keys, 32)``."""
    n, d = keys.shape
    xb = keys.float().view(n, d // MXFP4_BLOCK, MXFP4_BLOCK)
    s = ue8m0_scale(xb.abs().amax(dim=-1, keepdim=True).clamp(min=_FP4_SCALE_FLOOR), E2M1_MAX)
    return (xb / s).clamp(-E2M1_MAX, E2M1_MAX), s.squeeze(-1)


def _pack(v: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """Sync-free: (scaled values, scales) -> (packed codes uint8 [N, D/2], e8m0 bytes uint8 [N, D/32])
    (e2m1 codes: RNE magnitude | sign bit, as ``e2m1_encode`` without its NaN check)."""
    codes = magnitude_codes(v).to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3)
    return pack_fp4(codes.flatten(1)), s.to(torch.float8_e8m0fnu).view(torch.uint8)


def encode_index_keys(keys: Tensor) -> tuple[Tensor, Tensor]:
    """bf16 [N, D] -> (packed codes uint8 [N, D/2], e8m0 scale bytes uint8 [N, D/32]).

    Same rounding as ``fp4_qdq(keys, 32)`` (scale = ue8m0_scale(amax, 6)), so decode(encode(x))
    == fp4_qdq(x) for every x, and == x for values that are already FP4-QDQ'd. Checked: the
    shape, NaN values (``e2m1_encode``'s error) and the scales' e8m0 exactness (host syncs)."""
    if keys.dim() != 2 or keys.shape[1] % MXFP4_BLOCK != 0:
        raise ValueError(f"keys: expected [N, D] with D % 32 == 0, got {tuple(keys.shape)}")
    v, s = _scale_blocks(keys)
    if bool(torch.isnan(v).any()):
        raise ValueError("e2m1_encode: input contains NaN")
    fp32_to_e8m0(s)                    # raises unless every scale is an exact e8m0 power of two
    return _pack(v, s)


def decode_index_keys(packed: Tensor, scales: Tensor) -> Tensor:
    """(uint8 [N, D/2], uint8 [N, D/32]) -> bf16 [N, D] (fp32 product, one bf16 rounding)."""
    n, d = packed.shape[0], packed.shape[1] * 2
    v = e2m1_decode(unpack_fp4(packed)).view(n, d // MXFP4_BLOCK, MXFP4_BLOCK)
    return (v * e8m0_to_fp32(scales).unsqueeze(-1)).view(n, d).to(torch.bfloat16)


# ------------------------------------------------------------------ pages
def index_page_views(pages: Tensor, page_size: int, dim: int) -> tuple[Tensor, Tensor]:
    """Views [num_pages, page_size, D/2] (codes) and [num_pages, page_size, D/32] (scales) into
    ``pages`` (uint8 [num_pages, index_page_bytes(page_size, dim)]; shape checks only, no sync)."""
    want = index_page_bytes(page_size, dim)
    if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.shape[1] != want:
        raise ValueError(f"index pages: expected uint8 [num_pages, {want}], got {pages.dtype} {tuple(pages.shape)}")
    code_end = page_size * (dim // 2)
    codes = pages[:, :code_end].unflatten(1, (page_size, dim // 2))
    scales = pages[:, code_end:].unflatten(1, (page_size, dim // MXFP4_BLOCK))
    return codes, scales


def write_index_entries(pages: Tensor, slots: Tensor, keys: Tensor, page_size: int = INDEX_PAGE) -> None:
    """Encode bf16 keys [N, D] into ``pages`` at ``slots`` (slot = page * page_size + offset). Checked."""
    codes_v, scales_v = index_page_views(pages, page_size, keys.shape[1])
    if keys.dtype != torch.bfloat16 or keys.shape[0] != slots.shape[0]:
        raise ValueError(f"keys: expected bfloat16 [{slots.shape[0]}, D], got {keys.dtype} {tuple(keys.shape)}")
    _check_slots(slots, pages.shape[0] * page_size)
    packed, sc = encode_index_keys(keys)
    codes_v[slots // page_size, slots % page_size] = packed
    scales_v[slots // page_size, slots % page_size] = sc


def read_index_entries(pages: Tensor, slots: Tensor, page_size: int = INDEX_PAGE, dim: int = 128) -> Tensor:
    """Gather and decode the keys at ``slots`` -> bf16 [N, D]. Checked."""
    codes_v, scales_v = index_page_views(pages, page_size, dim)
    _check_slots(slots, pages.shape[0] * page_size)
    return decode_index_keys(codes_v[slots // page_size, slots % page_size],
                             scales_v[slots // page_size, slots % page_size])


def _check_slots(slots: Tensor, capacity: int) -> None:
    if slots.dtype != torch.int64 or slots.dim() != 1:
        raise ValueError(f"slots: expected int64 [N], got {slots.dtype} {tuple(slots.shape)}")
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= capacity):
        raise ValueError(f"slots out of range [0, {capacity})")


# ------------------------------------------------------------------ sync-free page access
def write_index_keys(pages: Tensor, slots: Tensor, keys: Tensor) -> None:
    """Sync-free ``write_index_entries`` (pages of ``INDEX_PAGE`` keys): ``encode_index_keys``'
    rounding (exact for already-QDQ'd keys) minus its NaN and power-of-two checks, and scatter.
    ``slots``: valid global key ids (not checked)."""
    n, d = keys.shape
    cv, sv = index_page_views(pages, INDEX_PAGE, d)
    packed, sc = _pack(*_scale_blocks(keys))
    cv[slots // INDEX_PAGE, slots % INDEX_PAGE] = packed
    sv[slots // INDEX_PAGE, slots % INDEX_PAGE] = sc


def read_index_keys(pages: Tensor, slots: Tensor, dim: int = 128) -> Tensor:
    """Sync-free ``read_index_entries``: bf16 keys [*slots.shape, dim] of global key ids ``slots``
    (any shape; a slot < 0 reads key 0, the caller masks it)."""
    cv, sv = index_page_views(pages, INDEX_PAGE, dim)
    s = slots.clamp(min=0).long().reshape(-1)
    keys = decode_index_keys(cv[s // INDEX_PAGE, s % INDEX_PAGE], sv[s // INDEX_PAGE, s % INDEX_PAGE])
    return keys.view(*slots.shape, dim)
