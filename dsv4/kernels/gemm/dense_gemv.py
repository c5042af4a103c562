"""fp32-output GEMV of a bf16 or fp32 weight at one row, split K summed in the kernel.

``y [1, N] fp32 = float(x) [1, K] @ float(w) [N, K]^T``: the official fp32 GEMMs of the compressor /
indexer projection (``Bf16Linear`` "fp32": bf16 weight, bf16 input) and of the router's gate (fp32
weight, bf16 input upcast) at a batch-1 decode step. Every product of a bf16 x bf16 pair is exact in
fp32; bf16 x fp32 products are rounded once, as in an fp32 GEMM. Sums in fp32; only their order differs
from torch's GEMMs.

Why a kernel: torch runs these as a cuBLAS split-K GEMM plus its reduce (the projection) and as an x
upcast plus a cuBLAS GEMV (the router): four launches, none of them with programmatic dependent launch,
where two stream the weights. GPU times: ``gemm.route``'s comment on ``DENSE_GEMV_MAX_WEIGHT``.

Grid (column blocks of ``BN`` weight rows, ``S`` K splits). Each program accumulates weight x row
products elementwise in a [BN, BK] fp32 register tile over its K range and sums it over K once at the
end. With S > 1 each program stores its fp32 partial into ``PART [S, N]`` and arrives on its column
block's counter (``counters.arrival_counters``); the last to arrive sums the S partials in split order
(deterministic whatever the arrival order), writes y and resets the counter.
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
    from ..lib import add_splits4, pdl_wait, prefetch_l2

    @triton.jit(do_not_specialize=["N", "K", "k_per_split"])
    def _dense_gemv_kernel(X, W, PART, Y, CNT, N, K, stride_wn, k_per_split, BN: tl.constexpr, BK: tl.constexpr,
                           SPLIT: tl.constexpr, PF: tl.constexpr = False, PFL: tl.constexpr = 1):
        """PF: the program's first W tile (BN rows x PFL 128-byte lines of fp32) hinted into L2 before the
        wait."""
        if PF:
            prefetch_l2(W + (tl.program_id(0) * BN + tl.arange(0, BN)).to(tl.int64)[:, None] * stride_wn
                        + tl.program_id(1) * k_per_split + tl.arange(0, PFL)[None, :] * 32,
                        ((tl.program_id(0) * BN + tl.arange(0, BN)) < N)[:, None]
                        & (tl.program_id(1) * k_per_split + tl.arange(0, PFL)[None, :] * 32 < K))
        pdl_wait()
        pid_n = tl.program_id(0)
        ks = tl.program_id(1)
        rn = pid_n * BN + tl.arange(0, BN)
        mn = rn < N
        rn64 = rn.to(tl.int64)
        rk = tl.arange(0, BK)
        k_lo = ks * k_per_split
        k_hi = tl.minimum(K, k_lo + k_per_split)
        acc2 = tl.zeros([BN, BK], tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            k = k0 + rk
            mk = k < k_hi
            w = tl.load(W + rn64[:, None] * stride_wn + k[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
            xv = tl.load(X + k, mask=mk, other=0.0).to(tl.float32)
            acc2 += w.to(tl.float32) * xv[None, :]
        acc = tl.sum(acc2, axis=1)
        if SPLIT:
            tile = PART + rn64
            tl.store(tile + ks.to(tl.int64) * N, acc, mask=mn)
            S = tl.num_programs(1)
            if arrive(CNT + pid_n) == S - 1:
                tot = tl.zeros([BN], tl.float32)
                for s0 in range(0, S, 4):     # four partials per L2 round trip, in split order
                    tot = add_splits4(tot, tile, N, mn, s0, S)
                    tile += 4 * N
                tl.store(Y + rn64, tot, mask=mn)
                tl.store(CNT + pid_n, 0)
        else:
            tl.store(Y + rn64, acc, mask=mn)


def takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The kernel serves ``x @ w.T`` on this device at this size (``route.dense_gemv``)."""
    if not (x.is_cuda and triton_available()) or x.dim() != 2:
        return False
    return route.dense_gemv(x.shape[0], w.shape[0], w.shape[1], w.dtype, target(x.device))


def dense_gemv(x: torch.Tensor, w: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """fp32 [1, N] = float(x) @ float(w).T for one row x [1, K] (bf16 or fp32, unit stride along K) and
    w [N, K] (bf16 or fp32) (module doc). ``config`` overrides ``route.dense_gemv_config`` (keys BN, BK,
    SPLIT, num_warps, num_stages)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"dense_gemv: expected x [1, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.shape[0] != 1:
        raise ValueError(f"dense_gemv: one row, got {x.shape[0]}")
    N, K = w.shape
    for name, t_ in (("x", x), ("w", w)):
        if t_.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"dense_gemv: {name} must be bf16 or fp32, got {t_.dtype}")
    x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    t = target(x.device)
    cfg = dict(route.dense_gemv_config(N, K, w.element_size(), t))
    if config:
        cfg.update(config)
    BN, BK = cfg.pop("BN"), cfg.pop("BK")
    S = max(1, min(cfg.pop("SPLIT"), triton.cdiv(K, BK)))
    kps = triton.cdiv(triton.cdiv(K, S), BK) * BK
    S = triton.cdiv(K, kps)
    y = torch.empty(1, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(N, BN), S)
    part = torch.empty(S, N, dtype=torch.float32, device=x.device) if S > 1 else y
    cnt = arrival_counters(x.device, grid[0]) if S > 1 else y
    kw = {} if interpreting() else {k: v for k, v in cfg.items() if k in ("num_warps", "num_stages")}
    _dense_gemv_kernel[grid](x, w, part, y, cnt, N, K, w.stride(0), kps, BN=BN, BK=BK, SPLIT=S > 1,
                             PF=prefetch_on() and w.dtype == torch.float32, PFL=max(1, BK // 32), **kw, **PDL_LAUNCH)
    return y


__all__ = ["dense_gemv", "takes"]
