"""fp32-output GEMM of bf16 operands on tensor cores, promoted to fp32 registers every BK columns.

``y [M, N] fp32 = float(x) [M, K] @ float(w) [N, K]^T`` for bf16 x and w: the router's gate at prefill
sizes (the official gate GEMM upcasts its bf16 input and its bf16-stored weight to fp32,
``MoEWeights.gate_bf16``). Every bf16 x bf16 product is exact in fp32, so only the sums can differ
from an fp32 GEMM's.

Why the promotion: a tensor-core GEMM that keeps one accumulator over all of K (cuBLAS's bf16 GEMM
with fp32 output) is several times less accurate than an fp32 GEMM: Hopper's MMA adds each
instruction's products into the fp32 accumulator with truncation, a bias that grows with the number
of additions (H200, 2026-12-06, the V4-Flash gate at 4096 tokens: largest error 3.3e-5 against the
exact sums, the fp32 GEMM's 4.4e-6). Routing takes the top-k of these logits, so their error decides
how often an expert flips on a near tie. Here each program's dot over one BK block starts from zero
and is added to the fp32 accumulator in an ordinary rounded add (``acc += part * one``: ``one`` is a
runtime 1.0, so that the add is not folded into the dot's accumulator), as DeepGEMM promotes its FP8
partials: the truncating chain is BK / 16 additions long.

Grid (M / BM, N / BN), one output tile per program, pointer loads (Triton pipelines them over
``num_stages``). Under the interpreter the dot runs on fp32 copies (its bf16 dot is wrong).
"""
from __future__ import annotations

import torch

from ..lib import PDL_LAUNCH, interpreting, target, triton_available
from . import route

if triton_available():
    import triton
    import triton.language as tl

    from ..lib import pdl_wait

    @triton.jit(do_not_specialize=["M", "one"])
    def _dense_mm_kernel(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym, one, BM: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr, INTERP: tl.constexpr):
        pdl_wait()
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        mm = rm < M
        mn = rn < N
        xp = X + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :]
        wp = W + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None]
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            mk = (k0 + rk) < K
            a = tl.load(xp, mask=mm[:, None] & mk[None, :], other=0.0)
            b = tl.load(wp, mask=mk[:, None] & mn[None, :], other=0.0)
            if INTERP:
                part = tl.dot(a.to(tl.float32), b.to(tl.float32))
            else:
                part = tl.dot(a, b)
            acc += part * one
            xp += BK
            wp += BK
        tl.store(Y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc, mask=mm[:, None] & mn[None, :])


def takes(x: torch.Tensor) -> bool:
    """The kernel serves ``x`` (bf16 [M, K]) times a bf16 weight on this device at this M (``route.dense_mm``)."""
    if not (x.is_cuda and triton_available()) or x.dim() != 2 or x.dtype != torch.bfloat16:
        return False
    return route.dense_mm(x.shape[0], target(x.device))


def dense_mm(x: torch.Tensor, w: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """fp32 [M, N] = float(x) @ float(w).T for bf16 x [M, K] and w [N, K] (module doc). ``config`` overrides
    ``route.dense_mm_config`` (BM, BN, BK, num_warps, num_stages)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"dense_mm: expected x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    for name, t_ in (("x", x), ("w", w)):
        if t_.dtype != torch.bfloat16:
            raise ValueError(f"dense_mm: {name} must be bf16, got {t_.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=torch.float32, device=x.device)
    if M == 0 or N == 0:
        return y
    cfg = dict(route.dense_mm_config(target(x.device)), **(config or {}))
    BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
    kw = {} if interpreting() else {k: v for k, v in cfg.items() if k in ("num_warps", "num_stages")}
    _dense_mm_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](
        x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0), 1.0, BM=BM, BN=BN, BK=BK, INTERP=interpreting(),
        **kw, **PDL_LAUNCH)
    return y


__all__ = ["dense_mm", "takes"]
