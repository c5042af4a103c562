"""Block-scaled FP8 GEMM of the hot path (spec §3, §11.3; kernels-and-formats §3) and the activation
quantisation, Triton tile kernel (portable: every CUDA GPU with e4m3, sm_89+; the CPU interpreter).

* ``act_quant_fp8(x)``: bf16 ``[M, K]`` -> (e4m3 ``[M, K]``, fp32 scales ``[M, K/128]``), the official
  ``act_quant`` (1x128 blocks, amax floor 1e-4, UE8M0 scale ``2^ceil(log2(amax*fp32(1/448)))`` read
  off the fp32 bits, values ``clamp(x/s, +-448)`` rounded to nearest even). Bit-exact to
  ``dsv4.formats.fp8.act_quant_fp8``, also under the CPU interpreter (integer rounding there).
  ``with_f16=True`` also returns the FP4 GEMM's activation operand (``common.f16_operand``).
* ``fp8_gemm(xq, xs, w, ws)``: e4m3 activations (per 1x128 scale) x e4m3 weights ``[N, K]`` (per
  128x128 scale, e8m0 or fp32, or per row) -> bf16 ``[M, N]`` with the official accumulation: for every
  128-wide K block a fresh fp32 partial ``P = A_blk . B_blk^T`` (tensor-core fp8 ``tl.dot``), then
  ``acc += P * (sA[row, kb] * sB[col // 128, kb])`` in increasing K order, one bf16 rounding. Split K
  at decode sizes (``route.fp8_split_k``): each split stores its fp32 partial and the tile's last
  program to arrive (``counters.arrival_counters``) sums them in split order into bf16.
  ``fp8_gemm_bf16`` quantises bf16 activations in the A-tile load instead (bit-identical to
  ``act_quant_fp8`` + ``fp8_gemm``); ``fp8_swiglu``: the shared expert's w1|w3 with the official
  SwiGLU middle and FP8 quantisation of h in the epilogue; ``fp8_gemm_partials``: the split partials
  unsummed.

Twin: ``dsv4.twins.gemm`` (the same exact products, power-of-two scales; another fp32 summation
order: results agree within bf16 rounding). On Hopper the FP8 MMA keeps ~14 bits while it sums a
128-K partial (as in the official kernel, which promotes per 128 for that reason): the result then
differs from the fp64 sum by up to ~2^-12 sum|products|. Tiles: ``route.fp8_tiles``.
"""
from __future__ import annotations

import torch

from ..counters import arrival_counters
from ..lib import PDL_LAUNCH, QBLOCK, interpreting, prefetch_on, target, triton_available, u8
from . import route
from .common import check_fp8_gemm_args, check_fp8_weight, weight_scales

if triton_available():
    import triton
    import triton.language as tl

    from ..counters import arrive
    from ..lib import (exp2i, add_splits4, grouped_tile, pdl_wait, prefetch_l2, quant_blocks, quant_rows, rne_bf16,
                       store_bf16, swiglu_h)

    @triton.jit(do_not_specialize=['stride_s'])
    def _act_quant_kernel(X, Q, S, K, stride_x, stride_q, stride_s,
                          BLOCKS: tl.constexpr, INTERP: tl.constexpr):
        pdl_wait()
        quant_blocks(X, Q, S, tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCKS, K // 128,
                      stride_x, stride_q, stride_s, BLOCKS, INTERP)

    # ---------------------------------------------------------------------------------------
    # FP8 x FP8 block-scaled GEMM (official accumulation); optional fused act-quant / SwiGLU

    @triton.jit
    def _load_sb(SB, rn64, pid_n, kb, mn, stride_sbn, SB_SHIFT: tl.constexpr, SB_E8M0: tl.constexpr,
                 BN: tl.constexpr):
        """weight scales of the tile's rows for K block kb: a scalar (128-row block scales, BN = 128:
        the whole tile is one block) or a [BN] vector (per-row scales / other tiles)."""
        if SB_SHIFT == 7 and BN == 128:
            ptr = SB + pid_n.to(tl.int64) * stride_sbn + kb
            if SB_E8M0:
                sbb = tl.load(ptr).to(tl.int32)
            else:
                sb = tl.load(ptr)
        else:
            ptr = SB + (rn64 >> SB_SHIFT) * stride_sbn + kb
            if SB_E8M0:
                sbb = tl.load(ptr, mask=mn, other=127).to(tl.int32)
            else:
                sb = tl.load(ptr, mask=mn, other=0.0)
        if SB_E8M0:   # 2^(byte-127); byte 0 is the subnormal 2^-127
            sb = tl.where(sbb == 0, 5.877471754111438e-39, (sbb << 23).to(tl.float32, bitcast=True))
        return sb

    @triton.jit(do_not_specialize=['M'])
    def _fp8_gemm_kernel(A, SA, B, SB, C, CS, OUT, CNT, M, N_out, K, n_half,
                         stride_am, stride_sam, stride_bn, stride_sbn, stride_cm, stride_csm, stride_om, limit,
                         k_per_split,
                         SB_SHIFT: tl.constexpr, A_BF16: tl.constexpr, SB_E8M0: tl.constexpr,
                         SWIGLU: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr,
                         SPLIT: tl.constexpr, SUM: tl.constexpr, INTERP: tl.constexpr, PF: tl.constexpr = False):
        """SPLIT: program axis 1 takes K range [ks * k_per_split, ...) and stores its fp32 partial
        in C = workspace [S, M, N]. SUM: the tile's last program to arrive on its counter (CNT, per
        output tile, reset to 0 by that program: ``counters.arrival_counters``) adds the S partials in
        split order, from 0 (``_splitk_sum``'s sums, bit for bit, without its launch), into bf16 OUT. PF:
        the tile's first two K blocks of weight rows (and of their SwiGLU partners) hinted into L2 before
        the wait."""
        ks = tl.program_id(1)
        pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N_out, BN), GROUP_M)
        if PF:
            prefetch_l2(B + (pid_n * BN + tl.arange(0, BN)).to(tl.int64)[:, None] * stride_bn
                        + ks * k_per_split + tl.arange(0, 2)[None, :] * 128,
                        ((pid_n * BN + tl.arange(0, BN)) < N_out)[:, None]
                        & (ks * k_per_split + tl.arange(0, 2)[None, :] * 128 < K))
            if SWIGLU:
                prefetch_l2(B + (pid_n * BN + n_half + tl.arange(0, BN)).to(tl.int64)[:, None] * stride_bn
                            + ks * k_per_split + tl.arange(0, 2)[None, :] * 128,
                            ((pid_n * BN + tl.arange(0, BN)) < N_out)[:, None]
                            & (ks * k_per_split + tl.arange(0, 2)[None, :] * 128 < K))
        pdl_wait()
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        mm = rm < M
        mn = rn < N_out
        rm64 = rm.to(tl.int64)
        rn64 = rn.to(tl.int64)
        kc = tl.arange(0, 128)
        acc = tl.zeros([BM, BN], tl.float32)
        acc2 = tl.zeros([BM, BN], tl.float32)
        for k0 in range(ks * k_per_split, tl.minimum(K, (ks + 1) * k_per_split), 128):
            kb = k0 // 128
            k = k0 + kc
            if A_BF16:
                x = tl.load(A + rm64[:, None] * stride_am + k[None, :], mask=mm[:, None], other=0.0)
                a, ea = quant_rows(x.to(tl.float32), INTERP)
                sa = exp2i(ea)
            else:
                a = tl.load(A + rm64[:, None] * stride_am + k[None, :], mask=mm[:, None], other=0)
                a = a.to(tl.float8e4nv, bitcast=True)
                sa = tl.load(SA + rm64 * stride_sam + kb, mask=mm, other=0.0)
            b = tl.load(B + rn64[:, None] * stride_bn + k[None, :], mask=mn[:, None], other=0)
            b = b.to(tl.float8e4nv, bitcast=True)
            sb = _load_sb(SB, rn64, pid_n, kb, mn, stride_sbn, SB_SHIFT, SB_E8M0, BN)
            p = tl.dot(a, tl.trans(b))
            if SB_SHIFT == 7 and BN == 128:     # one weight block per tile: a per-row factor
                acc += p * (sa * sb)[:, None]
            else:
                acc += p * (sa[:, None] * sb[None, :])
            if SWIGLU:
                r2 = rn64 + n_half
                b2 = tl.load(B + r2[:, None] * stride_bn + k[None, :], mask=mn[:, None], other=0)
                b2 = b2.to(tl.float8e4nv, bitcast=True)
                sb2 = _load_sb(SB, r2, pid_n + n_half // 128, kb, mn, stride_sbn, SB_SHIFT, SB_E8M0, BN)
                p2 = tl.dot(a, tl.trans(b2))
                if SB_SHIFT == 7 and BN == 128:
                    acc2 += p2 * (sa * sb2)[:, None]
                else:
                    acc2 += p2 * (sa[:, None] * sb2[None, :])
        if SWIGLU:
            h = swiglu_h(acc, acc2, acc2, limit, False)
            q, e = quant_rows(h, INTERP)
            tl.store(C + rm64[:, None] * stride_cm + rn64[None, :], q.to(tl.uint8, bitcast=True),
                     mask=mm[:, None] & mn[None, :])
            tl.store(CS + rm64 * stride_csm + pid_n, exp2i(e), mask=mm)
        elif SPLIT:
            tile = C + rm64[:, None] * N_out + rn64[None, :]
            tl.store(tile + ks.to(tl.int64) * M * N_out, acc, mask=mm[:, None] & mn[None, :])
            if SUM:
                S = tl.num_programs(1)
                if arrive(CNT + tl.program_id(0)) == S - 1:
                    tot = tl.zeros([BM, BN], tl.float32)
                    plane = tl.full([], 0, tl.int64) + M * N_out
                    msk = mm[:, None] & mn[None, :]
                    for s0 in range(0, S, 4):          # four partials per L2 round trip, in split order
                        tot = add_splits4(tot, tile, plane, msk, s0, S)
                        tile += 4 * plane
                    store_bf16(OUT + rm64[:, None] * stride_om + rn64[None, :], tot,
                                mm[:, None] & mn[None, :], INTERP)
                    tl.store(CNT + tl.program_id(0), 0)
        else:
            store_bf16(C + rm64[:, None] * stride_cm + rn64[None, :], acc,
                        mm[:, None] & mn[None, :], INTERP)


    @triton.jit
    def _dequant_bf16_kernel(W, SB, Y, N, K, stride_wn, stride_sbn, stride_yn, SB_SHIFT: tl.constexpr,
                             SB_E8M0: tl.constexpr, BN: tl.constexpr, INTERP: tl.constexpr):
        """Y[n, k] = bf16(bf16(e4m3 W[n, k]) * bf16(scale of (n, k))): torch's ``w.to(bf16) * s.to(bf16)``
        bit for bit (an e4m3 value is exact in bf16; the product of two bf16 values is exact in fp32
        and rounded once, to nearest even). The e4m3 bytes are decoded in integer arithmetic (the
        interpreter's fp8 casts are not trusted). Grid (row blocks of BN, 128-column blocks)."""
        pdl_wait()
        pid_n = tl.program_id(0)
        kb = tl.program_id(1)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = kb * 128 + tl.arange(0, 128)
        mn = rn < N
        msk = mn[:, None] & (rk < K)[None, :]
        rn64 = rn.to(tl.int64)
        b = tl.load(W + rn64[:, None] * stride_wn + rk[None, :], mask=msk, other=0).to(tl.int32)
        e = (b >> 3) & 15
        m = b & 7
        mag = tl.where(e == 0, m.to(tl.float32) * (1.0 / 512.0),
                       (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True))     # 2^(e-7) (1 + m/8)
        v = tl.where((b & 128) != 0, -mag, mag)
        sb = _load_sb(SB, rn64, pid_n, kb, mn, stride_sbn, SB_SHIFT, SB_E8M0, BN)
        y = rne_bf16(v * rne_bf16(sb)[:, None])
        store_bf16(Y + rn64[:, None] * stride_yn + rk[None, :], y, msk, INTERP)


def act_quant_fp8(x: torch.Tensor, block: int = QBLOCK, with_f16: bool = False):
    """Triton act_quant (module doc). x bf16 [..., K], K % 128 == 0. Returns (q e4m3, s fp32) or, with
    ``with_f16``, (q, s, a16) where a16 is the FP4 GEMM operand (``common.f16_operand(q)``, a torch
    conversion: an in-kernel f16 copy came out wrong on the H200 with Triton 3.6 for >= 4 values per
    thread, cause not isolated)."""
    from .common import f16_operand
    if block != QBLOCK:
        raise ValueError("act_quant_fp8: only 1x128 blocks")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"act_quant_fp8: expected bf16, got {x.dtype}")
    shape = x.shape
    K = shape[-1]
    if K % QBLOCK:
        raise ValueError(f"act_quant_fp8: last dim {K} is not a multiple of 128")
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    dev = x.device
    q = torch.empty(M, K, dtype=torch.uint8, device=dev)
    s = torch.empty(M, K // QBLOCK, dtype=torch.float32, device=dev)
    if M:
        nb = K // QBLOCK
        blocks = min(8, triton.next_power_of_2(nb))
        kw = {} if interpreting() else {"num_warps": 4}
        _act_quant_kernel[(M, triton.cdiv(nb, blocks))](
            x2, q, s, K, x2.stride(0), K, s.stride(0), BLOCKS=blocks, INTERP=interpreting(), **kw, **PDL_LAUNCH)
    qo = q.view(torch.float8_e4m3fn).reshape(shape)
    so = s.reshape(*shape[:-1], K // QBLOCK)
    if with_f16:
        return qo, so, f16_operand(qo.reshape(-1, K)).reshape(shape)
    return qo, so


def launch(a, sa, w, ws, out, out_s, M, N_out, K, n_half, a_bf16, swiglu, limit, config, partial=False):
    """The tile kernel (+ its in-kernel split-K sum). ``partial``: return the fp32 split partials
    [S, M, N_out] unsummed (S = 1 included; ``out`` unused). ``config`` overrides ``route.fp8_tiles``
    (keys BM, BN, GROUP_M, num_warps, num_stages, SPLIT_K)."""
    t = target(a.device)
    cfg = dict(route.fp8_tiles(M, N_out, K, t, swiglu=swiglu and not config))
    if config:
        cfg.update(config)
    if swiglu:
        cfg["BN"] = QBLOCK
    BM, BN, GM = cfg.pop("BM"), cfg.pop("BN"), cfg.pop("GROUP_M", 8)
    S = cfg.pop("SPLIT_K", None) or route.fp8_split_k(M, N_out, K, BM, BN, t, swiglu)
    S = 1 if swiglu else S                   # the SwiGLU epilogue needs the whole K sum
    kps = triton.cdiv(K // QBLOCK, S) * QBLOCK
    S = triton.cdiv(K, kps)
    kw = {} if interpreting() else {k: v for k, v in cfg.items() if k in ("num_warps", "num_stages")}
    wsv, sb_e8m0, per_row = weight_scales(w, ws)
    grid = (triton.cdiv(M, BM) * triton.cdiv(N_out, BN), S)
    split = (S > 1 or partial) and not swiglu
    dst = torch.empty(S, M, N_out, dtype=torch.float32, device=a.device) if split else out
    fused_sum = split and not partial       # the split sum by each tile's last program (no second launch)
    cnt = arrival_counters(a.device, grid[0]) if fused_sum else dst
    _fp8_gemm_kernel[grid](
        a, sa if sa is not None else wsv, u8(w), wsv, dst, out_s if out_s is not None else dst,
        out if fused_sum else dst, cnt,
        M, N_out, K, n_half, a.stride(0), sa.stride(0) if sa is not None else 0, w.stride(0),
        wsv.stride(0), dst.stride(-2), out_s.stride(0) if out_s is not None else 0,
        out.stride(0) if fused_sum else 0, float(limit), kps,
        SB_SHIFT=0 if per_row else 7, A_BF16=a_bf16, SB_E8M0=sb_e8m0, SWIGLU=swiglu,
        BM=BM, BN=BN, GROUP_M=GM, SPLIT=split, SUM=fused_sum, INTERP=interpreting(), PF=prefetch_on(), **kw,
        **PDL_LAUNCH)
    if partial:
        return dst


def fp8_weight_exact(w: torch.Tensor, what: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [N, K], fp32 [N/128, K/128]) of an exactly dequantised FP8 weight (the reference keeps
    weights as fp32 values): re-quantising gives the checkpoint's codes and power-of-two scales back,
    which is checked."""
    from ...formats.fp8 import dequant_fp8_weight, quant_fp8_weight
    q, s = quant_fp8_weight(w)
    if not torch.equal(dequant_fp8_weight(q, s), w.float()):
        raise ValueError(f"{what} {tuple(w.shape)} is not FP8 128x128-block representable")
    return q, s.float()


def fp8_gemm_partials(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
                      config: dict | None = None) -> torch.Tensor:
    """fp32 [S, M, N]: the tile kernel's split-K partials of ``fp8_gemm`` (each the per-block scaled
    sum over its K range; the split count fills the GPU at decode sizes), for a pass that sums them
    itself (``gemv.swiglu_quant``)."""
    M, K = check_fp8_gemm_args("fp8_gemm_partials", xq, xs, w, ws)
    return launch(u8(xq.contiguous()), xs.float().contiguous(), w.contiguous(), ws.contiguous(), None, None,
                  M, w.shape[0], K, 0, False, False, 0.0, config, partial=True)


def fp8_gemm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
             out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """bf16 [M, N] = official block-scaled FP8 GEMM of act_quant output (xq e4m3 [M, K], xs fp32
    [M, K/128]) and an FP8 weight (w e4m3 [N, K], ws e8m0/fp32 [N/128, K/128], or per-row
    [N, K/128]) on the tile kernel."""
    M, K = check_fp8_gemm_args("fp8_gemm", xq, xs, w, ws)
    N = w.shape[0]
    out = torch.empty(M, N, dtype=torch.bfloat16, device=xq.device) if out is None else out
    if M:
        launch(u8(xq.contiguous()), xs.float().contiguous(), w.contiguous(), ws.contiguous(), out, None,
               M, N, K, 0, False, False, 0.0, config)
    return out


def fp8_gemm_bf16(x2: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, out: torch.Tensor | None = None,
                  config: dict | None = None) -> torch.Tensor:
    """bf16 [M, N] of bf16 x2 [M, K] on the tile kernel with the activation quantisation in its A-tile
    load (the same bits as ``act_quant_fp8`` + ``fp8_gemm``)."""
    check_fp8_weight(w, ws)
    M, K = x2.shape
    N = w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"fp8_gemm_bf16: x {tuple(x2.shape)} vs w {tuple(w.shape)}")
    out = torch.empty(M, N, dtype=torch.bfloat16, device=x2.device) if out is None else out
    if M:
        launch(x2 if x2.stride(-1) == 1 else x2.contiguous(), None, w.contiguous(), ws.contiguous(), out, None,
               M, N, K, 0, True, False, 0.0, config)
    return out


def dequant_bf16(w: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] values of an FP8 weight (e4m3 [N, K], 128x128 block or per-row [N, K/128] scales, e8m0
    or fp32) in one pass: the bits of ``w.to(bf16) * s.to(bf16)`` with ``s`` the scales expanded to
    [N, K] (exact where the scales are powers of two)."""
    check_fp8_weight(w, ws)
    wsv, e8m0, per_row = weight_scales(w, ws)
    N, K = w.shape
    y = torch.empty(N, K, dtype=torch.bfloat16, device=w.device)
    if N and K:
        BN = 64
        kw = {} if interpreting() else {"num_warps": 4}
        _dequant_bf16_kernel[(triton.cdiv(N, BN), triton.cdiv(K, QBLOCK))](
            u8(w), wsv, y, N, K, w.stride(0), wsv.stride(0), y.stride(0), SB_SHIFT=0 if per_row else 7,
            SB_E8M0=e8m0, BN=BN, INTERP=interpreting(), **kw, **PDL_LAUNCH)
    return y


def fp8_swiglu(xq, xs, w13, w13s, limit: float, config: dict | None = None, x_bf16=None):
    """Shared-expert first half: [w1; w3] stacked FP8 [2I, K] -> (h e4m3 [M, I], hs fp32 [M, I/128])
    with h = act_quant(bf16(silu(clamp(bf16(x w1))) * clamp(bf16(x w3)))). Pass ``x_bf16`` (and
    xq = xs = None) to quantise x in the GEMM prologue."""
    N2, K = w13.shape
    I = N2 // 2
    if I % QBLOCK:
        raise ValueError(f"fp8_swiglu: intermediate size {I} must be a multiple of 128")
    a = x_bf16 if x_bf16 is not None else xq
    M = a.shape[0]
    h = torch.empty(M, I, dtype=torch.uint8, device=a.device)
    hs = torch.empty(M, I // QBLOCK, dtype=torch.float32, device=a.device)
    if M:
        if x_bf16 is not None:
            launch(x_bf16.contiguous(), None, w13, w13s, h, hs, M, I, K, I, True, True, limit, config)
        else:
            launch(u8(xq.contiguous()), xs.contiguous(), w13, w13s, h, hs, M, I, K, I, False, True, limit, config)
    return h.view(torch.float8_e4m3fn), hs


__all__ = ["act_quant_fp8", "dequant_bf16", "fp8_gemm", "fp8_gemm_bf16", "fp8_gemm_partials", "fp8_swiglu", "fp8_weight_exact",
           "launch"]
