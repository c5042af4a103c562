"""Twin of ``kernels.sparse_attention``: the listed entries dequantised and gathered
(``formats.kv_entry``), then the reference's ``sparse_attention`` (64-index blocks, running max, sink
in the denominator, bf16 probabilities), the output optionally rotated back (``rope``, both ops).
``sparse_decode`` is ``sparse_prefill`` (the kernels differ only in how they split the work) without the optional
q transform of its input and the bf16 workspaces."""
from __future__ import annotations

import torch

from ..formats.contracts import check_inverse_rope, check_sparse_attention, check_sparse_workspaces
from ..formats.kv_entry import read_kv_entries
from ..reference.attention import ATTN_BLOCK, sparse_attention
from ..reference.numerics import OFFICIAL
from .inverse_rope import inverse_rope
from .kv_insert import q_transform

HEAD_DIM = 512


def _gather_rows(window_idx, window_pages, window_page_size, extra_idx, extra_pages, extra_page_size,
                 kv_bf16=None):
    """Dequantised rows [T, K, 512] bf16 of the concatenated list and its validity [T, K]; with ``kv_bf16`` =
    (window, extra) bf16 workspaces, the lists' ids are their rows (the kernels' contract)."""
    parts, valid = [], []
    for i, (idx, pages, psz) in enumerate(((window_idx, window_pages, window_page_size),
                                           (extra_idx, extra_pages, extra_page_size))):
        if idx is None or idx.shape[1] == 0:
            continue
        T, K = idx.shape
        if kv_bf16 is not None:
            flat = idx.reshape(-1).long()       # -1 -> a zero row, as the pages' path (a workspace row may be junk)
            parts.append(kv_bf16[i][flat.clamp(min=0)].masked_fill((flat < 0)[:, None], 0).view(T, K, HEAD_DIM))
        else:
            # each distinct entry decoded once (prefill rows share most of their lists), then gathered
            uniq, inv = torch.unique(idx.reshape(-1).long(), return_inverse=True)
            parts.append(read_kv_entries(pages, uniq, psz)[inv].view(T, K, HEAD_DIM))
        valid.append(idx >= 0)
    return torch.cat(parts, 1), torch.cat(valid, 1)


def sparse_decode(q: torch.Tensor, window_idx: torch.Tensor | None, window_pages: torch.Tensor | None,
                  window_page_size: int, extra_idx: torch.Tensor | None = None,
                  extra_pages: torch.Tensor | None = None, extra_page_size: int = 64,
                  sinks: torch.Tensor | None = None, scale: float = HEAD_DIM ** -0.5,
                  rope: tuple[torch.Tensor, torch.Tensor] | None = None, **_) -> torch.Tensor:
    """With ``rope=(cos, sin)`` the output after ``inverse_rope`` (same shape): ``sparse_prefill``'s math."""
    return sparse_prefill(q, window_idx, window_pages, window_page_size, extra_idx, extra_pages, extra_page_size,
                          sinks, scale, rope=rope)


def _collapse_masked_runs(window_idx, extra_idx):
    """The two lists with every run of consecutive ``ATTN_BLOCK``-column blocks (of their concatenation) that no
    row uses cut to the run's first block: the same bits from ``sparse_attention``, for less work where the lists
    are padded to their capacity (a decode step's compressed-entry list spans the whole context; at a short
    position almost all of it is -1). Why the bits hold: a block that no row uses leaves the running max and the
    denominator as they are (alpha = 1 exactly, or 0 and 0 before any used entry) and adds to the accumulator a
    sum of zeros that is the same for every such block (the masked keys are all row 0 times 0), and adding the
    same signed zero twice is adding it once. Blocks stay aligned (whole blocks go), column 0 stays (the masked
    keys' row), the order of what stays is unchanged."""
    Kw = 0 if window_idx is None else window_idx.shape[1]
    K = Kw + (0 if extra_idx is None else extra_idx.shape[1])
    nb = -(-K // ATTN_BLOCK)
    if nb <= 2:
        return window_idx, extra_idx
    dev = (window_idx if window_idx is not None else extra_idx).device
    used = torch.zeros(nb * ATTN_BLOCK, dtype=torch.bool, device=dev)
    if Kw:
        used[:Kw] = (window_idx >= 0).any(0)
    if K > Kw:
        used[Kw:K] = (extra_idx >= 0).any(0)
    live = used.view(nb, ATTN_BLOCK).any(1)
    keep = live.clone()                         # a used block, the block after one (a run's first) and block 0
    keep[0] = True
    keep[1:] |= live[:-1]
    if bool(keep.all()):
        return window_idx, extra_idx
    cols = keep.repeat_interleave(ATTN_BLOCK)[:K].nonzero().squeeze(1)
    w = window_idx[:, cols[cols < Kw]] if Kw else window_idx
    e = extra_idx[:, cols[cols >= Kw] - Kw] if K > Kw else extra_idx
    return w, e


def _attend(q, window_idx, window_pages, window_page_size, extra_idx, extra_pages, extra_page_size, sinks, scale,
            kv_bf16=None):
    """Both ops' attention; ``kv_bf16``: the entries from bf16 workspaces (sparse_prefill's argument)."""
    T, H, _ = q.shape
    if sinks is None:
        sinks = torch.full((H,), float("-inf"), dtype=torch.float32, device=q.device)
    check_sparse_attention(q, window_idx, extra_idx, window_pages, extra_pages, sinks, window_page_size,
                           extra_page_size)
    if kv_bf16 is not None:
        kv_bf16 = check_sparse_workspaces(kv_bf16, window_idx, extra_idx)
    if window_idx is None and extra_idx is None:
        raise ValueError("need at least one of window_idx / extra_idx")
    window_idx, extra_idx = _collapse_masked_runs(window_idx, extra_idx)
    rows, valid = _gather_rows(window_idx, window_pages, window_page_size, extra_idx, extra_pages,
                               extra_page_size, kv_bf16)
    K = rows.shape[1]
    loc = torch.arange(T * K, device=q.device).view(T, K)
    idx = torch.where(valid, loc, -1)
    out = sparse_attention(q, rows.reshape(T * K, HEAD_DIM), idx, sinks.float(), scale, OFFICIAL)
    # the reference keeps a row whose every index is masked finite only through the sink; with a
    # -inf sink it would be 0/0: the kernels define that row as 0
    return torch.nan_to_num(out, nan=0.0)


def sparse_prefill(q: torch.Tensor, window_idx: torch.Tensor | None, window_pages: torch.Tensor | None,
                   window_page_size: int, extra_idx: torch.Tensor | None = None,
                   extra_pages: torch.Tensor | None = None, extra_page_size: int = 64,
                   sinks: torch.Tensor | None = None, scale: float = HEAD_DIM ** -0.5,
                   rope: tuple[torch.Tensor, torch.Tensor] | None = None, q_norm_eps: float | None = None,
                   kv_bf16: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
                   **_) -> torch.Tensor:
    """``sparse_decode``; with ``rope=(cos, sin)`` the output after ``inverse_rope`` (same shape); with
    ``q_norm_eps`` too, q first takes ``kv_insert``'s q transform (head RMSNorm, RoPE); ``kv_bf16``: the
    entries from bf16 workspaces (``kernels.sparse_attention.sparse_prefill``'s argument)."""
    if rope is not None:
        check_inverse_rope(q, *rope)
    if q_norm_eps is not None:
        if rope is None:
            raise ValueError("sparse attention: q_norm_eps (q's RMSNorm + RoPE in the kernel) needs rope=(cos, sin)")
        q = q_transform(q, *rope, q_norm_eps)
    o = _attend(q, window_idx, window_pages, window_page_size, extra_idx, extra_pages, extra_page_size, sinks, scale,
                kv_bf16)
    return o if rope is None else inverse_rope(o, *rope).view(o.shape)

__all__ = ["sparse_decode", "sparse_prefill"]
