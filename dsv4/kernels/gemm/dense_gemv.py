"""fp32-output GEMV of a bf16 or fp32 weight at a few rows, split K summed in the kernel.

``y [M, N] fp32 = float(x) [M, K] @ float(w) [N, K]^T``: the official fp32 GEMMs of the compressor /
indexer projection (``Bf16Linear`` "fp32": bf16 weight, bf16 input) and of the router's gate (fp32
weight, bf16 input upcast) at a decode step. Every product of a bf16 x bf16 pair is exact in
fp32; bf16 x fp32 products are rounded once, as in an fp32 GEMM. Sums in fp32; only their order differs
from torch's GEMMs.

Why a kernel: torch runs these as a cuBLAS split-K GEMM plus its reduce (the projection) and as an x
upcast plus a cuBLAS GEMV (the router): four launches, none of them with programmatic dependent launch,
where two stream the weights. GPU times: ``gemm.route``'s comment on ``DENSE_GEMV_MAX_WEIGHT``.

Grid (column blocks of ``BN`` weight rows, ``S`` K splits, row blocks of ``RB`` <= 4 rows). Each program
loads a [BN, BK] weight tile once per K step and accumulates its products with each of its rows elementwise
in that row's own [BN, BK] fp32 register tile, summed over K once at the end: a row's sums are the one-row
launch's whatever M is (same tiles, same order), bits included. With S > 1 each program stores its fp32
partials into ``PART [S, M, N]`` and arrives on its (column block, row block) counter
(``counters.arrival_counters``); the last to arrive sums the S partials in split order (deterministic whatever
the arrival order), writes y and resets the counter.
"""
from __future__ import annotations

import torch

from ..counters import arrival_counters
from ..lib import PDL_LAUNCH, interpreting, prefetch_on, target, triton_available
from . import route


if triton_available():
    import triton
    import triton.language as tl

    from ..counters import arrive
    from ..lib import add_splits4, pdl_wait, prefetch_l2, split_live

    @triton.jit
    def _row_partial(acc, w, X, r, M, k, mk, stride_xm):
        """acc + the products of weight tile w [BN, BK] with row r's x[k] (a row past M adds nothing)."""
        xv = tl.load(X + r.to(tl.int64) * stride_xm + k, mask=split_live(mk, r, M), other=0.0).to(tl.float32)
        return acc + w * xv[None, :]

    @triton.jit
    def _row_store(acc, PART, Y, r, M, N, rn64, mn, SPLIT: tl.constexpr):
        """Row r's [BN] sums: straight into y (no split) or as the split's partial (the sum: ``_split_finish``)."""
        if SPLIT:
            tl.store(PART + (tl.program_id(1).to(tl.int64) * M + r) * N + rn64, acc, mask=split_live(mn, r, M))
        else:
            tl.store(Y + r.to(tl.int64) * N + rn64, acc, mask=split_live(mn, r, M))

    @triton.jit
    def _split_finish(PART, Y, r, M, N, rn64, mn, S, BN: tl.constexpr):
        """y[r] = row r's S partials summed in split order (four per L2 round trip)."""
        if r < M:
            tile = PART + r.to(tl.int64) * N + rn64
            tot = tl.zeros([BN], tl.float32)
            for s0 in range(0, S, 4):
                tot = add_splits4(tot, tile, M * N, mn, s0, S)
                tile += 4 * M * N
            tl.store(Y + r.to(tl.int64) * N + rn64, tot, mask=mn)

    @triton.jit(do_not_specialize=["M", "N", "K", "k_per_split"])
    def _dense_gemv_kernel(X, W, PART, Y, CNT, M, N, K, stride_xm, stride_wn, k_per_split, BN: tl.constexpr,
                           BK: tl.constexpr, SPLIT: tl.constexpr, RB: tl.constexpr = 1, PF: tl.constexpr = False,
                           PFL: tl.constexpr = 1):
        """RB (1, 2 or 4): rows per program, each with its own accumulator. PF: the program's first W tile (BN rows
        x PFL 128-byte lines of fp32) hinted into L2 before the wait."""
        if PF:
            prefetch_l2(W + (tl.program_id(0) * BN + tl.arange(0, BN)).to(tl.int64)[:, None] * stride_wn
                        + tl.program_id(1) * k_per_split + tl.arange(0, PFL)[None, :] * 32,
                        ((tl.program_id(0) * BN + tl.arange(0, BN)) < N)[:, None]
                        & (tl.program_id(1) * k_per_split + tl.arange(0, PFL)[None, :] * 32 < K))
        pdl_wait()
        pid_n = tl.program_id(0)
        ks = tl.program_id(1)
        r0 = tl.program_id(2) * RB
        rn = pid_n * BN + tl.arange(0, BN)
        mn = rn < N
        rn64 = rn.to(tl.int64)
        rk = tl.arange(0, BK)
        k_lo = ks * k_per_split
        k_hi = tl.minimum(K, k_lo + k_per_split)
        acc0 = tl.zeros([BN, BK], tl.float32)
        acc1 = tl.zeros([BN, BK], tl.float32)
        acc2 = tl.zeros([BN, BK], tl.float32)
        acc3 = tl.zeros([BN, BK], tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            k = k0 + rk
            mk = k < k_hi
            w = tl.load(W + rn64[:, None] * stride_wn + k[None, :], mask=mn[:, None] & mk[None, :],
                        other=0.0).to(tl.float32)
            acc0 = _row_partial(acc0, w, X, r0, M, k, mk, stride_xm)
            if RB > 1:
                acc1 = _row_partial(acc1, w, X, r0 + 1, M, k, mk, stride_xm)
            if RB > 2:
                acc2 = _row_partial(acc2, w, X, r0 + 2, M, k, mk, stride_xm)
                acc3 = _row_partial(acc3, w, X, r0 + 3, M, k, mk, stride_xm)
        _row_store(tl.sum(acc0, axis=1), PART, Y, r0, M, N, rn64, mn, SPLIT)
        if RB > 1:
            _row_store(tl.sum(acc1, axis=1), PART, Y, r0 + 1, M, N, rn64, mn, SPLIT)
        if RB > 2:
            _row_store(tl.sum(acc2, axis=1), PART, Y, r0 + 2, M, N, rn64, mn, SPLIT)
            _row_store(tl.sum(acc3, axis=1), PART, Y, r0 + 3, M, N, rn64, mn, SPLIT)
        if SPLIT:
            S = tl.num_programs(1)
            cnt = CNT + tl.program_id(2) * tl.num_programs(0) + pid_n
            if arrive(cnt) == S - 1:
                _split_finish(PART, Y, r0, M, N, rn64, mn, S, BN)
                if RB > 1:
                    _split_finish(PART, Y, r0 + 1, M, N, rn64, mn, S, BN)
                if RB > 2:
                    _split_finish(PART, Y, r0 + 2, M, N, rn64, mn, S, BN)
                    _split_finish(PART, Y, r0 + 3, M, N, rn64, mn, S, BN)
                tl.store(cnt, 0)


def takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The kernel serves ``x @ w.T`` on this device at this size (``route.dense_gemv``)."""
    if not (x.is_cuda and triton_available()) or x.dim() != 2:
        return False
    return route.dense_gemv(x.shape[0], w.shape[0], w.shape[1], w.dtype, target(x.device))


def dense_gemv(x: torch.Tensor, w: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """fp32 [M, N] = float(x) @ float(w).T for rows x [M, K] (bf16 or fp32, unit stride along K; any M >= 1:
    ``route.dense_gemv`` decides where the kernel serves) and w [N, K] (bf16 or fp32) (module doc). ``config``
    overrides ``route.dense_gemv_config`` (keys BN, BK, SPLIT, num_warps, num_stages) and RB, the rows per program
    (default: up to 4)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"dense_gemv: expected x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.shape[0] < 1:
        raise ValueError(f"dense_gemv: at least one row, got {x.shape[0]}")
    M = x.shape[0]
    N, K = w.shape
    for name, t_ in (("x", x), ("w", w)):
        if t_.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"dense_gemv: {name} must be bf16 or fp32, got {t_.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    t = target(x.device)
    cfg = dict(route.dense_gemv_config(N, K, w.element_size(), t))
    if config:
        cfg.update(config)
    BN, BK = cfg.pop("BN"), cfg.pop("BK")
    RB = cfg.pop("RB", None) or min(4, triton.next_power_of_2(M))
    if RB not in (1, 2, 4):
        raise ValueError(f"dense_gemv: RB (rows per program) must be 1, 2 or 4, got {RB}")
    S = max(1, min(cfg.pop("SPLIT"), triton.cdiv(K, BK)))
    kps = triton.cdiv(triton.cdiv(K, S), BK) * BK
    S = triton.cdiv(K, kps)
    y = torch.empty(M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(N, BN), S, triton.cdiv(M, RB))
    part = torch.empty(S, M, N, dtype=torch.float32, device=x.device) if S > 1 else y
    cnt = arrival_counters(x.device, grid[0] * grid[2]) if S > 1 else y
    kw = {} if interpreting() else {k: v for k, v in cfg.items() if k in ("num_warps", "num_stages")}
    _dense_gemv_kernel[grid](x, w, part, y, cnt, M, N, K, x.stride(0), w.stride(0), kps, BN=BN, BK=BK, SPLIT=S > 1,
                             RB=RB, PF=prefetch_on() and w.dtype == torch.float32, PFL=max(1, BK // 32), **kw,
                             **PDL_LAUNCH)
    return y


__all__ = ["dense_gemv", "takes"]
