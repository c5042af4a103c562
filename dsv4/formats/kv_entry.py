"""FlashMLA "MODEL1_FP8Sparse" KV token entries and their paged layout (spec §10.1).

One entry = 448 e4m3 nope values ‖ 64 bf16 rope values (128 B) = 576 data bytes, plus 7 ue8m0
scale bytes (one per 64 nope values, value 2^(byte-127)) and 1 pad byte = 584 bytes.
A page of B tokens is NOT interleaved: [B x 576 data][B x 8 scales][pad to a multiple of 576].
The nope quantisation is exactly the model's FP8 QDQ (fp8_qdq(kv[:, :448], 64)), so
decode(encode(kv)) reproduces the official bf16 KV bit-for-bit.
"""
import torch
from torch import Tensor

from .fp8 import act_quant_fp8, e8m0_to_fp32

NOPE_DIM = 448
ROPE_DIM = 64
KV_DIM = NOPE_DIM + ROPE_DIM  # 512
KV_QUANT_BLOCK = 64
N_SCALES = NOPE_DIM // KV_QUANT_BLOCK  # 7
TOKEN_DATA_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576
SCALE_BYTES = N_SCALES + 1  # 8: 7 scales + 1 pad byte
ENTRY_BYTES = TOKEN_DATA_BYTES + SCALE_BYTES  # 584
PAGE_ALIGN = 576


def page_bytes(page_size: int) -> int:
    """Bytes of one page of `page_size` tokens: round_up(page_size * 584, 576)."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    return -(-page_size * ENTRY_BYTES // PAGE_ALIGN) * PAGE_ALIGN


def encode_kv_entries(kv: Tensor) -> tuple[Tensor, Tensor]:
    """bf16 [N, 512] -> (data uint8 [N, 576], scales uint8 [N, 8])."""
    _check_kv(kv)
    q, s = act_quant_fp8(kv[:, :NOPE_DIM], KV_QUANT_BLOCK)  # s: exact powers of two [N, 7]
    rope = kv[:, NOPE_DIM:].contiguous().view(torch.uint8)  # raw bf16 bytes, torch byte order
    data = torch.cat([q.view(torch.uint8), rope], dim=1)
    # a power-of-two fp32 casts to e8m0 exactly; its byte is the biased exponent 127 + log2(s)
    sbytes = s.to(torch.float8_e8m0fnu).view(torch.uint8)
    scales = torch.cat([sbytes, sbytes.new_zeros(kv.shape[0], SCALE_BYTES - N_SCALES)], dim=1)
    return data, scales


def decode_kv_entries(data: Tensor, scales: Tensor) -> Tensor:
    """(data uint8 [N, 576], scales uint8 [N, 8]) -> bf16 [N, 512]."""
    _check_bytes("data", data, TOKEN_DATA_BYTES)
    n = data.shape[0]
    _check_bytes("scales", scales, SCALE_BYTES, n)
    q = data[:, :NOPE_DIM].view(torch.float8_e4m3fn).float().view(n, N_SCALES, KV_QUANT_BLOCK)
    s = e8m0_to_fp32(scales[:, :N_SCALES]).unsqueeze(-1)
    # same fp32 product and single bf16 rounding as fp8_qdq
    nope = (q * s).view(n, NOPE_DIM).to(torch.bfloat16)
    rope = data[:, NOPE_DIM:].contiguous().view(torch.bfloat16)
    return torch.cat([nope, rope], dim=1)


def page_views(pages: Tensor, page_size: int) -> tuple[Tensor, Tensor]:
    """Views [num_pages, B, 576] (token data) and [num_pages, B, 8] (scales) into `pages`
    (shape checks only, no device sync)."""
    want = page_bytes(page_size)
    if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.shape[1] != want:
        raise ValueError(f"pages: expected uint8 [num_pages, {want}] for page_size={page_size}, "
                         f"got {pages.dtype} {tuple(pages.shape)}")
    data_end = page_size * TOKEN_DATA_BYTES
    data = pages[:, :data_end].unflatten(1, (page_size, TOKEN_DATA_BYTES))
    scales = pages[:, data_end:data_end + page_size * SCALE_BYTES].unflatten(1, (page_size, SCALE_BYTES))
    return data, scales


def _split_slots(slots: Tensor, num_pages: int, page_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Validate slots (-1 = none) and split them into (valid mask, page index, offset)."""
    if slots.dtype != torch.int64 or slots.dim() != 1:
        raise ValueError(f"slots: expected int64 [N], got {slots.dtype} {tuple(slots.shape)}")
    capacity = num_pages * page_size
    bad = (slots < -1) | (slots >= capacity)
    if bool(bad.any()):
        raise ValueError(f"slots out of range [-1, {capacity}): {slots[bad][:4].tolist()}")
    valid = slots >= 0
    s = slots.clamp(min=0)
    return valid, s // page_size, s % page_size


def write_kv_entries(pages: Tensor, slots: Tensor, kv: Tensor, page_size: int) -> None:
    """Encode kv [N, 512] bf16 into `pages` in place at `slots` (slot = page*B + offset; -1 = skip).

    Slots should be distinct: for a repeated slot, which row lands is unspecified (index_put).
    """
    data_v, scale_v = page_views(pages, page_size)
    valid, page, off = _split_slots(slots, pages.shape[0], page_size)
    _check_kv(kv)
    if kv.shape[0] != slots.shape[0]:
        raise ValueError(f"kv has {kv.shape[0]} rows but slots has {slots.shape[0]}")
    data, scales = encode_kv_entries(kv)
    data_v[page[valid], off[valid]] = data[valid]
    scale_v[page[valid], off[valid]] = scales[valid]


def read_kv_entries(pages: Tensor, slots: Tensor, page_size: int) -> Tensor:
    """Gather and decode entries at `slots` -> bf16 [N, 512]; slot -1 gives a zero row."""
    data_v, scale_v = page_views(pages, page_size)
    valid, page, off = _split_slots(slots, pages.shape[0], page_size)
    kv = decode_kv_entries(data_v[page, off], scale_v[page, off])  # -1 reads slot 0, masked below
    return kv.masked_fill(~valid.unsqueeze(-1), 0)


# ------------------------------------------------------------------ sync-free page access
# write_kv_entries / read_kv_entries validate slot ranges on the host (a device sync, not allowed in
# a CUDA graph); these use the same page views and codecs without that check.
def write_entries(pages: Tensor, slots: Tensor, kv: Tensor, page_size: int) -> None:
    """Sync-free ``write_kv_entries``: encode kv [N, 512] bf16 into ``pages`` at ``slots`` (valid
    global entry ids, not checked)."""
    data, scales = page_views(pages, page_size)
    d, s = encode_kv_entries(kv)
    data[slots // page_size, slots % page_size] = d
    scales[slots // page_size, slots % page_size] = s


def read_entries(pages: Tensor, slots: Tensor, page_size: int) -> Tensor:
    """bf16 rows of global entry ids ``slots`` (any shape; -1 -> zero row), sync-free."""
    data, scales = page_views(pages, page_size)
    s = slots.clamp(min=0).long().reshape(-1)
    rows = decode_kv_entries(data[s // page_size, s % page_size], scales[s // page_size, s % page_size])
    rows = rows * (slots.reshape(-1, 1) >= 0)
    return rows.view(*slots.shape, -1)


def _check_kv(kv: Tensor) -> None:
    if kv.dtype != torch.bfloat16 or kv.dim() != 2 or kv.shape[1] != KV_DIM:
        raise ValueError(f"kv: expected bfloat16 [N, {KV_DIM}], got {kv.dtype} {tuple(kv.shape)}")


def _check_bytes(name: str, t: Tensor, width: int, n: int | None = None) -> None:
    rows = "N" if n is None else n
    if t.dtype != torch.uint8 or t.dim() != 2 or t.shape[1] != width or (n is not None and t.shape[0] != n):
        raise ValueError(f"{name}: expected uint8 [{rows}, {width}], got {t.dtype} {tuple(t.shape)}")
