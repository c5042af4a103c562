"""Decode-sized block-scaled FP8 GEMM on tensor cores (Gluon), split-K summed inside the kernel.

The ``fp8.fp8_gemm`` contract (official numerics): e4m3 weights ``w [N, K]`` with 128x128 block
scales (e8m0 bytes or fp32; per-row ``[N, K/128]`` also accepted), activations quantised 1x128
(``act_quant_fp8``: e4m3 + power-of-two scales) either beforehand (``xq``, ``xs``) or in this kernel
from bf16 ``x`` (``x_bf16``: ``lib.quant_rows``' rule, the same bytes and scales). Per 128-K block a
fresh fp32 partial of exact products, then ``acc += P * (sA * sB)``; one bf16 rounding at the end.
``act="bf16"`` keeps bf16 activations as they are (weights e4m3 -> bf16 in the load, exact; bf16 mma;
``acc += P * sB``): the official bf16 GEMM of the dequantised weight up to fp32 summation order, with
``groups`` for wo_a's grouped einsum (the FP8 weight read instead of its bf16 copy: half the bytes).

Layout, as ``fp4_mma.py`` (whose notes on the operand layouts apply): output features are the mma M
side (16 weight rows per warp), up to ``BM_ROWS`` = 8 activation rows the N side of
``mma.sync`` m16n8k16 (f16 in, fp32 accumulate; e4m3 -> f16 is exact). Per 128-K block a thread loads
16 contiguous bytes of each of its weight rows for each 64-K half (one ``ld.global.nc.L2::128B.v4``
and eight ``cvt.rn.f16x2.e4m3x2``, ``_ld_e4m3_f16``), straight into the ``DotOperandLayout(k_width=16)``
operand; no shared memory. ``UNROLL`` 2 issues two K blocks' loads before their math (more bytes in
flight per warp; the same additions in the same order).

Split K without a second launch: with S > 1 K splits every program stores its fp32 partial, then
arrives on its output tile's counter (``atomic_add``, acq_rel, gpu scope); the last to arrive sums
the S partials in split order (``common.sum_splits``' order: deterministic whatever the arrival
order), writes bf16 and resets the counter (``counters.arrival_counters``: per device, zero between
calls, so calls on one device must be stream-ordered; the engine's are). ``partial=True`` returns the fp32
partials [S, M, N] instead (for a consumer that sums them in its own pass).

Gluon has no CPU interpreter: CPU CI compiles this kernel for sm_90 / sm_100; the GPU tests compare
it with ``twins.gemm.fp8_gemm``. Needs sm_89+ (e4m3 -> f16 conversion).
"""
from __future__ import annotations

import torch

from ..lib import QBLOCK, asm_text, gluon_available, pdl_launch, prefetch_on, target, u8
from . import route
from .common import check_fp8_weight, launch_plan, weight_scales

GLUON = gluon_available()
if GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    from ..lib import add_splits4, exp2i, pdl_wait, prefetch_l2, ue8m0_exp
    # CTA barrier: ``thread_barrier`` in triton 3.6 (the H200 image), ``barrier`` in later releases
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

BM_ROWS = 8            # activation rows per tile: the n side of one m16n8k16 mma

if GLUON:
    # 16 e4m3 bytes (pointers $8-$23) -> 16 f16 in 8 registers $0-$7, element order kept
    _LD_E4M3_ASM = gl.constexpr(asm_text(
        [".reg .b32 w0, w1, w2, w3; .reg .b16 l, h;",
         "ld.global.nc.L2::128B.v4.b32 {w0, w1, w2, w3}, [$8];"]
        + [f"mov.b32 {{l, h}}, w{j}; cvt.rn.f16x2.e4m3x2 ${2 * j}, l; cvt.rn.f16x2.e4m3x2 ${2 * j + 1}, h;"
           for j in range(4)]))
    _LD_E4M3_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 8 + ["l"] * 16))

    # the same 16 bytes -> 16 bf16 (exact: e4m3 -> f16 -> f32 -> bf16, no rounding on the way)
    _LD_E4M3_BF16_ASM = gl.constexpr(asm_text(
        [".reg .b32 w0, w1, w2, w3, a; .reg .b16 l, h; .reg .f32 f0, f1;",
         "ld.global.nc.L2::128B.v4.b32 {w0, w1, w2, w3}, [$8];"]
        + [line for j in range(4) for q, half in ((0, "l"), (1, "h")) for line in (
            f"mov.b32 {{l, h}}, w{j}; cvt.rn.f16x2.e4m3x2 a, {half};",
            "mov.b32 {l, h}, a; cvt.f32.f16 f0, l; cvt.f32.f16 f1, h;",
            f"cvt.rn.bf16x2.f32 ${2 * j + q}, f1, f0;")]))

    @gluon.jit
    def _ld_e4m3_bf16(p):
        """``_ld_e4m3_f16`` with bf16 results (for a bf16 activation operand)."""
        return gl.inline_asm_elementwise(_LD_E4M3_BF16_ASM, _LD_E4M3_CONSTRAINTS, [p], dtype=gl.bfloat16,
                                         is_pure=True, pack=16)

    @gluon.jit
    def _ld_e4m3_f16(p):
        """16 consecutive e4m3 bytes (p: their pointers, p[0] 16-byte aligned) -> f16, exact: one
        16-byte load on the read-only path (L2 fetches the whole 128-byte line: the next 64-K half)
        and eight e4m3x2 -> f16x2 conversions, the bytes never unpacked into Triton values."""
        return gl.inline_asm_elementwise(_LD_E4M3_ASM, _LD_E4M3_CONSTRAINTS, [p], dtype=gl.float16,
                                         is_pure=True, pack=16)

    @gluon.jit
    def _quant_half(x, e):
        """fp32 values -> e4m3-rounded f16 at scale 2^e (``lib.quant_rows``: clamp to +-448, round
        to nearest even)."""
        v = x * exp2i(-e)[None, :]
        v = gl.minimum(gl.maximum(v, -448.0), 448.0)
        return v.to(gl.float8e4nv).to(gl.float16)

    @gluon.jit
    def _kload(kb, wptr, aptr, amask, saptr, swptr, mma: gl.constexpr, ACT: gl.constexpr,
               SB_E8M0: gl.constexpr):
        """Operands of 128-K block kb: weight halves, activation halves (quantised here for ACT 1),
        the activation scales (ones for ACT 2) and the weight block scales."""
        if ACT == 2:
            w0 = _ld_e4m3_bf16(wptr + kb * 128)
            w1 = _ld_e4m3_bf16(wptr + kb * 128 + 64)
            x0 = gl.load(aptr + kb * 128, mask=amask, other=0.0)
            x1 = gl.load(aptr + kb * 128 + 64, mask=amask, other=0.0)
            sa = gl.full([x0.shape[1]], 1.0, gl.float32, layout=gl.SliceLayout(0, mma))
        else:
            w0 = _ld_e4m3_f16(wptr + kb * 128)
            w1 = _ld_e4m3_f16(wptr + kb * 128 + 64)
            if ACT == 1:   # 1x128 act quant of this block, per activation row (column of the operand)
                y0 = gl.load(aptr + kb * 128, mask=amask, other=0.0).to(gl.float32)
                y1 = gl.load(aptr + kb * 128 + 64, mask=amask, other=0.0).to(gl.float32)
                e = ue8m0_exp(gl.maximum(gl.max(gl.abs(y0), axis=0), gl.max(gl.abs(y1), axis=0)))
                x0 = _quant_half(y0, e)
                x1 = _quant_half(y1, e)
                sa = gl.convert_layout(exp2i(e), gl.SliceLayout(0, mma))
            else:
                x0 = _ld_e4m3_f16(aptr + kb * 128)
                x1 = _ld_e4m3_f16(aptr + kb * 128 + 64)
                sa = gl.load(saptr + kb)
        if SB_E8M0:   # 2^(byte-127); byte 0 is the subnormal 2^-127
            sbb = gl.load(swptr + kb).to(gl.int32)
            sw = gl.where(sbb == 0, 5.877471754111438e-39, (sbb << 23).to(gl.float32, bitcast=True))
        else:
            sw = gl.load(swptr + kb)
        return w0, w1, x0, x1, sa, sw

    @gluon.jit
    def _kpart(zero, w0, w1, x0, x1, sa, sw, ACT: gl.constexpr):
        """The block's fp32 partial times its scale factor (sB for ACT 2, sB * sA otherwise)."""
        part = mma_v2(w1, x1, mma_v2(w0, x0, zero))
        if ACT == 2:
            f = part * sw[:, None]
        else:
            f = part * (sw[:, None] * sa[None, :])
        return f

    @gluon.jit(do_not_specialize=['M'])
    def _fp8_mma_kernel(A, SA, W, WS, C, PART, CNT, M, N, K, k_per_split, group_rows,
                        stride_am, stride_ag, stride_sam, stride_wn, stride_wsn, stride_cm,
                        ACT: gl.constexpr, SB_E8M0: gl.constexpr, SB_ROW: gl.constexpr, BM: gl.constexpr,
                        BN: gl.constexpr, SPLIT: gl.constexpr, REDUCE: gl.constexpr, NUM_WARPS: gl.constexpr,
                        UNROLL: gl.constexpr, PF: gl.constexpr = False):
        """Program (m-tile, BN weight rows, K split ks). ACT: 0 e4m3 activations + scales SA, 1 bf16
        activations quantised here, 2 bf16 activations as they are (bf16 mma, weights e4m3 -> bf16).
        Weight rows come in groups of ``group_rows`` (a multiple of BN); group g reads the activation
        columns from g * stride_ag (wo_a's grouped einsum; one group: all N rows). SPLIT: fp32
        partials into PART [S, M, N]; REDUCE: the tile's last arriving split sums them into bf16 C.
        Not SPLIT: bf16 C directly. PF: the program's first two K blocks of its BN weight rows hinted
        into L2 before the wait."""
        _PF_ROWS: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
        if PF:
            prefetch_l2(W + (gl.program_id(1) * BN + gl.arange(0, BN, layout=_PF_ROWS)).to(gl.int64) * stride_wn
                        + gl.program_id(2) * k_per_split,
                        gl.program_id(1) * BN + gl.arange(0, BN, layout=_PF_ROWS) < N)
            prefetch_l2(W + (gl.program_id(1) * BN + gl.arange(0, BN, layout=_PF_ROWS)).to(gl.int64) * stride_wn
                        + gl.program_id(2) * k_per_split + 128,
                        (gl.program_id(1) * BN + gl.arange(0, BN, layout=_PF_ROWS) < N)
                        & (gl.program_id(2) * k_per_split + 128 < K))
        pdl_wait()
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, 8])
        la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=16)
        lb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=16)
        pid_m = gl.program_id(0)
        pid_n = gl.program_id(1)
        ks = gl.program_id(2)
        m0 = pid_m * BM
        # weight operand [BN, 64] per half: rows clamped into range (their outputs are masked)
        rn_a = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, la))
        jb = gl.arange(0, 64, layout=gl.SliceLayout(0, la))
        wptr = W + gl.minimum(rn_a, N - 1).to(gl.int64)[:, None] * stride_wn + jb[None, :]
        # activation operand [64, BM] per half: rows past M read row M-1, masked at the store
        ja = gl.arange(0, 64, layout=gl.SliceLayout(1, lb))
        cb = m0 + gl.arange(0, BM, layout=gl.SliceLayout(0, lb))
        grp = (pid_n * BN) // group_rows
        aptr = A + grp.to(gl.int64) * stride_ag + gl.minimum(cb, M - 1).to(gl.int64)[None, :] * stride_am + ja[:, None]
        amask = (cb < M)[None, :]
        # scales in the accumulator's layout
        rn_c = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
        rc = m0 + gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
        rnc = gl.minimum(rn_c, N - 1).to(gl.int64)
        if SB_ROW:
            swptr = WS + rnc * stride_wsn
        else:
            swptr = WS + (rnc >> 7) * stride_wsn
        saptr = SA + gl.minimum(rc, M - 1).to(gl.int64) * stride_sam
        acc = gl.zeros([BN, BM], gl.float32, layout=mma)
        zero = gl.zeros([BN, BM], gl.float32, layout=mma)
        kb_lo = (ks * k_per_split) // 128
        kb_hi = gl.minimum(K, ks * k_per_split + k_per_split) // 128
        for kb in range(kb_lo, kb_hi, UNROLL):
            # UNROLL 2: both blocks' loads issued before either block's math (block kb+1 clamped and
            # its sum skipped past the split's end: the same additions in the same order as UNROLL 1)
            wa0, wa1, xa0, xa1, saa, swa = _kload(kb, wptr, aptr, amask, saptr, swptr, mma, ACT, SB_E8M0)
            if UNROLL == 2:
                wb0, wb1, xb0, xb1, sab, swb = _kload(gl.minimum(kb + 1, kb_hi - 1), wptr, aptr, amask, saptr,
                                                      swptr, mma, ACT, SB_E8M0)
            acc += _kpart(zero, wa0, wa1, xa0, xa1, saa, swa, ACT)
            if UNROLL == 2:
                acc = gl.where(kb + 1 < kb_hi, acc + _kpart(zero, wb0, wb1, xb0, xb1, sab, swb, ACT), acc)
        rn64 = rn_c.to(gl.int64)
        rc64 = rc.to(gl.int64)
        omask = (rn_c < N)[:, None] & (rc < M)[None, :]
        if SPLIT:
            # (ks, row, col) of PART [S, M, N]; M may arrive as a specialised constant 1, hence the
            # int64 product is formed from tensors
            gl.store(PART + (ks.to(gl.int64) * M + rc64[None, :]) * N + rn64[:, None], acc, mask=omask)
            if REDUCE:
                _cta_barrier()   # every thread's partial is stored before the release below
                tile = pid_m * gl.num_programs(1) + pid_n
                if gl.atomic_add(CNT + tile, 1, sem="acq_rel", scope="gpu") == gl.num_programs(2) - 1:
                    tot = gl.zeros([BN, BM], gl.float32, layout=mma)
                    S = gl.num_programs(2)
                    for s in range(0, S, 4):       # four partials per L2 round trip, in split order
                        tot = add_splits4(tot, PART + (s.to(gl.int64) * M + rc64[None, :]) * N + rn64[:, None],
                                          N.to(gl.int64) * M, omask, s, S)
                    gl.store(C + rc64[None, :] * stride_cm + rn64[:, None], tot.to(gl.bfloat16), mask=omask)
                    gl.store(CNT + tile, 0)
        else:
            gl.store(C + rc64[None, :] * stride_cm + rn64[:, None], acc.to(gl.bfloat16), mask=omask)


def fp8_mma(w: torch.Tensor, ws: torch.Tensor, xq: torch.Tensor | None = None, xs: torch.Tensor | None = None, *,
            x_bf16: torch.Tensor | None = None, act: str = "fp8", groups: int = 1, out: torch.Tensor | None = None,
            partial: bool = False, split: int | None = None, config: dict | None = None) -> torch.Tensor:
    """bf16 [M, N] = ``x . w^T`` for the FP8 weight ``w`` e4m3 [N, K] / ``ws`` [N/128, K/128] (or per-row
    [N, K/128]; e8m0 bytes or fp32) and either pre-quantised activations (``xq`` e4m3 [M, K], ``xs``
    fp32 [M, K/128]: the block-scaled FP8 GEMM of the module doc) or bf16 ``x_bf16``, quantised in the
    kernel (``act="fp8"``, the same bits as ``act_quant_fp8`` + ``xq``) or taken as is (``act="bf16"``:
    the bf16 GEMM of the dequantised weight, fp32 accumulation, as the official wo_a einsum).
    ``groups`` G (bf16 activations only): x_bf16 [M, G*K], weight rows in G equal groups, group g
    reading x columns g*K ..: out [M, N] = the grouped einsum "mgk,grk->mgr" flattened.
    ``partial``: return the fp32 split partials [S, M, N] (summed in split order they are the result).
    ``config``: ``BN`` (16 rows per warp) / ``num_warps`` / ``UNROLL`` (K blocks loaded per step: 1, 2)."""
    check_fp8_weight(w, ws)
    N, K = w.shape
    if act not in ("fp8", "bf16"):
        raise ValueError(f"fp8_mma: act must be 'fp8' or 'bf16', got {act!r}")
    if (x_bf16 is None) == (xq is None):
        raise ValueError("fp8_mma: pass either xq and xs (pre-quantised) or x_bf16")
    if groups < 1 or N % groups:
        raise ValueError(f"fp8_mma: {N} weight rows do not split into {groups} groups")
    if x_bf16 is not None:
        if x_bf16.dim() != 2 or x_bf16.dtype != torch.bfloat16 or x_bf16.shape[1] != groups * K:
            raise ValueError(f"fp8_mma: x_bf16 must be bf16 [M, {groups * K}], got {x_bf16.dtype} "
                             f"{tuple(x_bf16.shape)}")
        a = x_bf16 if x_bf16.stride(-1) == 1 else x_bf16.contiguous()
        sa = a                                          # unused
        mode = 2 if act == "bf16" else 1
    else:
        if act != "fp8" or groups != 1:
            raise ValueError("fp8_mma: pre-quantised activations take act='fp8' and one group")
        if xq.dim() != 2 or xq.shape[1] != K or xs is None or tuple(xs.shape) != (xq.shape[0], K // QBLOCK):
            raise ValueError(f"fp8_mma: shapes xq {tuple(xq.shape)} xs {None if xs is None else tuple(xs.shape)} "
                             f"w {tuple(w.shape)}")
        a = u8(xq)
        sa = xs.float()
        mode = 0
    M = a.shape[0]
    dev = w.device
    if a.device != dev or sa.device != dev or ws.device != dev:
        raise ValueError("fp8_mma: activations, scales and weight must be on one device")
    # 16-byte operand loads (e4m3 rows, and bf16 activations 32 bytes per thread)
    for name, t in (("activation", a), ("weight", w)):
        if t.stride(-1) != 1 or t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
            raise ValueError(f"fp8_mma: {name} must be row-contiguous with 16-byte aligned rows")
    cfg = route.fp8_mma_config(act)
    if config:
        unknown = set(config) - set(cfg)
        if unknown:
            raise ValueError(f"fp8_mma: unknown config keys {sorted(unknown)}")
        cfg.update(config)
    BN, nw = cfg["BN"], cfg["num_warps"]
    if BN != 16 * nw:
        raise ValueError(f"fp8_mma: BN must be 16 rows per warp, got BN={BN}, num_warps={nw}")
    if cfg["UNROLL"] not in (1, 2):
        raise ValueError(f"fp8_mma: UNROLL must be 1 or 2, got {cfg['UNROLL']}")
    if (N // groups) % BN and groups > 1:
        raise ValueError(f"fp8_mma: {N // groups} rows per group must be a multiple of BN={BN}")
    if out is not None and (tuple(out.shape) != (M, N) or out.dtype != torch.bfloat16 or out.stride(-1) != 1):
        raise ValueError(f"fp8_mma: out must be bf16 [{M}, {N}] with unit column stride")
    t = target(dev)
    if not t.gluon_mma:
        raise RuntimeError("fp8_mma: needs a CUDA GPU of sm_89+ and triton with Gluon")
    grid, kps, dst = launch_plan(M, N, K, BM_ROWS, BN, grouped=False, n_tiles=None, n_groups=1, split=split,
                                 partial=partial, out=out, dev=dev, t=t)
    if M == 0:
        return dst
    S = grid[2]
    res = dst if (partial or S == 1) else (out if out is not None else
                                           torch.empty(M, N, dtype=torch.bfloat16, device=dev))
    reduce = S > 1 and not partial
    if reduce:
        from ..counters import arrival_counters
        cnt = arrival_counters(dev, grid[0] * grid[1])
    else:
        cnt = dst
    wsv, sb_e8m0, sb_row = weight_scales(w, ws)
    wsv = wsv.contiguous()
    _fp8_mma_kernel[grid](
        a, sa, u8(w), wsv, res, dst, cnt, M, N, K, kps, N // groups,
        a.stride(0), K, sa.stride(0), w.stride(0), wsv.stride(0), res.stride(-2),
        ACT=mode, SB_E8M0=sb_e8m0, SB_ROW=sb_row, BM=BM_ROWS, BN=BN,
        SPLIT=dst.dtype == torch.float32, REDUCE=reduce, NUM_WARPS=nw, UNROLL=cfg["UNROLL"], PF=prefetch_on(),
        num_warps=nw, **pdl_launch(grid, t))
    return res


__all__ = ["BM_ROWS", "GLUON", "fp8_mma"]
