"""Pieces every GEMM implementation of this package shares: argument checks, the weight-scale and
FP4 argument forms the kernels read, the grouped (MoE) output tile and its epilogue, and the split-K
plan and sum of the decode-sized kernels.

Grouped (MoE) mode of the FP4 kernels: rows are pair rows sorted by expert (``offs[e] ..
offs[e+1]``), m-tiles of ``BM`` rows per expert enumerated by ``tile_cum`` (inclusive prefix sum
of ``ceil(count_e / BM)``), found per program by a binary search (``lib.find_tile``); ``perm``
gathers the activation row of each pair (token = pair // top_k).
"""
from __future__ import annotations

import torch

from ..lib import PDL_LAUNCH, QBLOCK, Target, interpreting, triton_available, u8

FP4_FORMATS = ("mxfp4", "nvfp4")

if triton_available():
    import triton
    import triton.language as tl

    from ..lib import exp2i, pdl_wait, quant_rows, store_bf16, swiglu_h, tile_rows

    @triton.jit
    def tile(TCUM, OFFS, PERM, M, N_out, t, pid_n, n_groups, top_k, BM: tl.constexpr, BN: tl.constexpr,
             LOG2G: tl.constexpr, GROUPED: tl.constexpr, GATHER: tl.constexpr):
        """Output tile (m-tile t, column block pid_n) of the FP4 MMA kernels: (live, row ids int64,
        row mask, pair ids, activation rows, column ids int64, column mask, expert int64)."""
        e, m0, m_end, live = tile_rows(TCUM, OFFS, M, t, n_groups, BM, LOG2G, GROUPED)
        rn = pid_n * BN + tl.arange(0, BN)
        r = m0 + tl.arange(0, BM)
        mrow = r < m_end
        r64 = r.to(tl.int64)
        if GATHER:
            pair = tl.load(PERM + r64, mask=mrow, other=0).to(tl.int64)
            arow = pair // top_k
        else:
            pair = r64
            arow = r64
        return live, r64, mrow, pair, arow, rn.to(tl.int64), rn < N_out, e.to(tl.int64)

    @triton.jit
    def fp4_epilogue(C, CS, PW, acc, acc2, pair, r64, mrow, rn64, nmask, pid_n, stride_cm, stride_csm, limit,
                     SWIGLU: tl.constexpr, HAS_PW: tl.constexpr, BM: tl.constexpr, INTERP: tl.constexpr):
        """SwiGLU mode: h = the expert middle of the w1 / w3 tiles (times the pair's routing weight),
        FP8-quantised (bytes + one scale per 128 columns); else the bf16 output tile."""
        if SWIGLU:
            if HAS_PW:
                pw = tl.load(PW + pair, mask=mrow, other=0.0)
            else:
                pw = tl.zeros([BM], tl.float32)
            h = swiglu_h(acc, acc2, pw, limit, HAS_PW)
            q, eh = quant_rows(h, INTERP)
            tl.store(C + r64[:, None] * stride_cm + rn64[None, :], q.to(tl.uint8, bitcast=True),
                     mask=mrow[:, None])
            tl.store(CS + r64 * stride_csm + pid_n, exp2i(eh), mask=mrow)
        else:
            store_bf16(C + r64[:, None] * stride_cm + rn64[None, :], acc,
                       mrow[:, None] & nmask[None, :], INTERP)

    @triton.jit
    def splitk_sum_kernel(WS, C, M, N, S, stride_cm, BLOCK: tl.constexpr, INTERP: tl.constexpr):
        """C[m, n] = bf16(sum over splits s = 0.. of WS[s, m, n]) (fp32, fixed order)."""
        pdl_wait()
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        msk = i < M * N
        acc = tl.zeros([BLOCK], tl.float32)
        for s in range(0, S):
            acc += tl.load(WS + s * M * N + i, mask=msk, other=0.0)
        m = i // N
        store_bf16(C + m.to(tl.int64) * stride_cm + (i - m * N), acc, msk, INTERP)


def f16_operand(q: torch.Tensor) -> torch.Tensor:
    """e4m3 [M, K] -> the FP4 GEMM's A operand: the same values in f16 (exact), same layout."""
    return q.float().to(torch.float16).contiguous()


_ALLOCATOR_SET = False


def ensure_tma_allocator(device) -> None:
    """Device-side tensor descriptors (``tl.make_tensor_descriptor``) need a global scratch allocator
    (``triton.set_allocator``): set once per process, on the first launch that builds one."""
    global _ALLOCATOR_SET
    if _ALLOCATOR_SET:
        return

    def alloc_fn(size: int, alignment: int, stream):
        return torch.empty(size, device=device, dtype=torch.int8)

    triton.set_allocator(alloc_fn)
    _ALLOCATOR_SET = True


def check_fp8_weight(w, ws):
    """ValueError naming the problem unless w is e4m3 [N, K] (K % 128 == 0) with 128x128 block scales
    [N/128, K/128] or per-row scales [N, K/128]."""
    if w.dim() != 2 or w.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(f"fp8 weight: expected e4m3 [N, K], got {w.dtype} {tuple(w.shape)}")
    N, K = w.shape
    if K % QBLOCK:
        raise ValueError(f"fp8 weight: K={K} must be a multiple of 128")
    nb = (-(-N // QBLOCK), K // QBLOCK)
    if tuple(ws.shape) not in (nb, (N, K // QBLOCK)):
        raise ValueError(f"fp8 weight scale: expected {nb} (or per-row {(N, K // QBLOCK)}), got {tuple(ws.shape)}")


def check_fp8_gemm_args(name, xq, xs, w, ws) -> tuple[int, int]:
    """(M, K) of a quantised activation xq [M, K] with scales xs [M, K/128] against the FP8 weight w."""
    check_fp8_weight(w, ws)
    M, K = xq.shape
    if w.shape[1] != K or tuple(xs.shape) != (M, K // QBLOCK):
        raise ValueError(f"{name}: shapes xq {tuple(xq.shape)} xs {tuple(xs.shape)} w {tuple(w.shape)}")
    return M, K


def weight_scales(w: torch.Tensor, ws: torch.Tensor) -> tuple[torch.Tensor, bool, bool]:
    """(the scales as the FP8 kernels read them: e8m0 bytes or fp32, whether e8m0, whether per row)."""
    e8m0 = ws.dtype in (torch.float8_e8m0fnu, torch.uint8)
    wsv = u8(ws) if e8m0 else ws.float()
    N = w.shape[0]
    per_row = wsv.shape[0] == N and N != -(-N // QBLOCK)
    return wsv, e8m0, per_row


def check_fp4(w_packed, w_scale, fmt, w_scale_2) -> tuple[int, int]:
    """(N, K) of a packed FP4 weight [N, K/2] with its scales (ValueError naming the problem)."""
    if fmt not in FP4_FORMATS:
        raise ValueError(f"fmt must be one of {FP4_FORMATS}, got {fmt!r}")
    if w_packed.dim() != 2:
        raise ValueError(f"fp4 weight: expected packed [N, K/2], got {tuple(w_packed.shape)}")
    N, K = w_packed.shape[0], w_packed.shape[1] * 2
    g = 32 if fmt == "mxfp4" else 16
    if K % QBLOCK or tuple(w_scale.shape) != (N, K // g):
        raise ValueError(f"fp4 {fmt}: weight {tuple(w_packed.shape)} scale {tuple(w_scale.shape)}")
    if fmt == "nvfp4" and w_scale_2 is None:
        raise ValueError("nvfp4 needs w_scale_2")
    return N, K


def nvfp4_row_scales(w_scale_2: torch.Tensor, N: int, device) -> torch.Tensor:
    """An NVFP4 global scale (scalar or per row) as the kernels read it: fp32 [1, N]."""
    ws2 = w_scale_2.float().reshape(-1).to(device)
    return (ws2.expand(N) if ws2.numel() == 1 else ws2).contiguous().unsqueeze(0)


def fp4_kernel_args(a, sa, w, ws, ws2, out, out_s, perm, offs, tcum, pw, M, N_out, K, n_half, n_groups, top_k,
                    limit) -> tuple:
    """The runtime arguments shared by the dequant FP4 kernels (``fp4._fp4_gemm_kernel`` and
    ``fp4_prefill``'s): absent optional tensors replaced by a dummy pointer (never read)."""
    dummy = out_s if out_s is not None else sa
    return (a, sa, w, ws, ws2 if ws2 is not None else sa, out, dummy,
            perm if perm is not None else sa, offs if offs is not None else sa,
            tcum if tcum is not None else sa, pw if pw is not None else sa,
            M, N_out, K, n_half, n_groups, top_k, a.stride(0), sa.stride(0), w.stride(0), w.stride(1),
            ws.stride(0), ws.stride(1), ws2.stride(0) if ws2 is not None else 0, out.stride(0),
            out_s.stride(0) if out_s is not None else 0, float(limit))


def log2_groups(n_groups: int) -> int:
    """Binary-search steps of ``lib.find_tile`` over ``n_groups`` experts."""
    return max(1, max(n_groups, 1).bit_length())


def decode_splits(tiles: int, K: int, t: Target) -> int:
    """K splits of a decode GEMM so that ~4 programs per SM exist, >= 2 K blocks of 128 per split,
    at most 16."""
    kb = K // QBLOCK
    target = 4 * t.sm_count
    s = 1
    while s < 16 and tiles * s < target and kb // (2 * s) >= 2:
        s *= 2
    return s


# A fixed K split for every grouped (MoE) decode GEMM launch without an explicit ``split``: the decode-step
# benchmark's A/B switch (``benchmarks/decode_step.py --moe-split``); None: ``decode_splits``.
GROUPED_SPLIT: int | None = None


def launch_plan(M: int, N: int, K: int, bm: int, BN: int, *, grouped: bool, n_tiles, n_groups: int, split,
                partial: bool, out, dev, t: Target):
    """(grid (m-tiles, column blocks, K splits), K per split, output buffer) of a decode GEMM: m-tiles of
    ``bm`` rows (grouped: ``n_tiles``, else the per-expert bound), ``BN``-column blocks, ``split`` K
    splits (default ``decode_splits``); fp32 partials [S, M, N] when split or ``partial``, else bf16 ``out``."""
    grid_m = (n_tiles if n_tiles is not None else triton.cdiv(M, bm) + min(n_groups, M)) if grouped \
        else triton.cdiv(M, bm)
    grid_m = max(grid_m, 1)
    grid_n = triton.cdiv(N, BN)
    S = split or (GROUPED_SPLIT if grouped else None) or decode_splits(grid_m * grid_n, K, t)
    kps = triton.cdiv(K // QBLOCK, S) * QBLOCK
    S = triton.cdiv(K, kps)
    if partial or S > 1:
        dst = torch.empty(S, M, N, dtype=torch.float32, device=dev)
    else:
        dst = out if out is not None else torch.empty(M, N, dtype=torch.bfloat16, device=dev)
    return (grid_m, grid_n, S), kps, dst


def sum_splits(dst: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A decode GEMM's result: bf16 ``dst`` as is, or fp32 split partials [S, M, N] summed in split
    order (``splitk_sum_kernel``) into bf16 ``out`` [M, N]."""
    if dst.dtype != torch.float32:
        return dst
    S, M, N = dst.shape
    out = out if out is not None else torch.empty(M, N, dtype=torch.bfloat16, device=dst.device)
    BLOCK = 1024
    splitk_sum_kernel[(triton.cdiv(M * N, BLOCK),)](dst, out, M, N, S, out.stride(0), BLOCK=BLOCK,
                                                    INTERP=interpreting(),
                                                    **({} if interpreting() else {"num_warps": 4}), **PDL_LAUNCH)
    return out


__all__ = ["FP4_FORMATS", "check_fp4", "check_fp8_gemm_args", "check_fp8_weight", "decode_splits",
           "ensure_tma_allocator",
           "f16_operand", "fp4_kernel_args", "launch_plan", "log2_groups", "nvfp4_row_scales", "sum_splits",
           "weight_scales"]
