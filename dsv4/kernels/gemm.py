"""Block-scaled FP8 and FP4 GEMMs of the hot path (spec §3, §11.3; kernels-and-formats §3, §5).

Entry points (Triton) and their torch twins:

* ``act_quant_fp8(x)``: bf16 ``[M, K]`` -> (e4m3 ``[M, K]``, fp32 scales ``[M, K/128]``), the
  official ``act_quant`` (1x128 blocks, amax floor 1e-4, UE8M0 scale ``2^ceil(log2(amax*fp32(1/448)))``
  read off the fp32 bits, values ``clamp(x/s, +-448)`` rounded to nearest even). Bit-exact to
  ``dsv4.formats.fp8.act_quant_fp8`` (twin), also under the CPU interpreter (integer rounding there).
  ``with_f16=True`` also returns the FP4 GEMM's activation operand (below).
* ``fp8_gemm(xq, xs, w, ws)``: e4m3 activations (per 1x128 scale) x e4m3 weights ``[N, K]`` (per
  128x128 scale, e8m0 or fp32) -> bf16 ``[M, N]`` with the official accumulation: for every 128-wide
  K block a fresh fp32 partial ``P = A_blk . B_blk^T`` (tensor-core fp8 ``tl.dot`` on Hopper), then
  ``acc += P * (sA[row, kb] * sB[col // 128, kb])`` in increasing K order, one bf16 rounding.
  ``fp8_linear(x, w, ws)`` fuses the activation quantisation (in the GEMM prologue for small M, where
  re-quantising the A tile per N block costs nothing; a separate ``act_quant_fp8`` launch otherwise).
  Twin: ``dsv4.reference.linear.Linear`` (kind ``fp8``), which computes the same exact products
  (power-of-two scales) and sums them in another fp32 order: results agree within bf16 rounding
  (tests: error vs the fp64-accumulated product sum <= ~1 bf16 ulp + fp32 summation noise).
* ``fp4_gemm(xq, xs, w_packed, w_scale, fmt, w_scale_2)``: FP8 activations x FP4 e2m1 weights
  ``[N, K/2]`` (low nibble = even element), MXFP4 (e8m0 scale per 32) or NVFP4 (e4m3 scale per 16,
  fp32 global ``w_scale_2``). Twin: ``Linear`` kind ``fp4`` over the dequantised weights.

FP4 on Hopper (``path="dequant"``, the default everywhere but Blackwell MXFP4): the weights are
dequantised in registers and fed to fp16 tensor-core MMAs with fp32 accumulation. Choice and
exactness:
  - an e2m1 code ``c`` (sign bit 3) becomes the e4m3 byte ``(c & 8) << 4 | (c & 7) << 2``, which is
    exactly ``value(c) * 2^-6`` (0.5 lands on the e4m3 subnormal 2^-7), and the hardware's
    e4m3x2 -> f16x2 conversion turns it into an exact f16. On CUDA this runs as four bytes per 32-bit
    word in inline PTX (3 logic ops + 2 conversions per 8 values); elsewhere (the interpreter, other
    backends) the same arithmetic is plain Triton.
  - activations: e4m3 values are exact in f16, so the A operand is the f16 copy of the quantised
    activation (``f16_operand``, a torch cast: an f16 copy written by the quantisation kernel came
    out wrong on the H200 under Triton 3.6 for >= 4 values per thread, cause not isolated); the kernel loads
    its even and odd elements separately (stride 2), so the low and the high nibbles of a weight
    byte multiply them in two K=16 dots per 32-group, with no byte interleaving in registers.
  - every product (f16 x f16) is exact in fp32 and the MMA accumulates in fp32.
  - MXFP4, tiles of < 64 rows (decode): per 32-group ``blk += P_32 * (sB[col, g] * 2^6)``, per
    128-block ``acc += blk * sA[row, kb]``: the official ``fp4_gemm`` structure (fp32 promotion per
    32-group, exact power-of-two scaling) up to fp32 summation order, exact for every e8m0 scale.
  - MXFP4, tiles of >= 64 rows (prefill, wgmma): the per-32 scale relative to the largest of its
    128-block, ``2^(s_g - s_max)``, is folded into the f16 weight (one K=128 MMA chain per block,
    ``acc += blk * sA * 2^(s_max+6)``): exact while a row's four group scales inside one 128-block
    span <= 2^16 (e2m1 * 2^-6 * 2^-16 stays on f16's subnormal grid); beyond that the smallest
    groups round (relative 2^-17 of the block's largest values). ``mx_fold=False`` keeps the
    per-group promotion at any tile size.
  - NVFP4: the e4m3 block scale is folded into the f16 weight (e2m1 x e4m3 has <= 6 significant
    bits and stays in f16's normal/subnormal range: exact), ``acc += P_32 * sA``, and the fp32
    global scale (times 2^6) multiplies once at the end. vs the twin (``w = (code*bs)*ws2`` rounded
    per element in fp32) this moves one fp32 rounding: far below bf16 resolution.
  fp16 rather than FP8 tensor-core math: FP8 MMAs need K=32 per instruction and Hopper has no fp8
  ``mma.sync`` in Triton's lowering (it upcasts to f16 anyway); fp16 keeps the NVFP4 fold exact.

Measured on the H200 (Triton 3.6, BENCHMARKS.md): ``fp8_gemm`` 490-560 TFLOP/s at 4K-token prefill
(34-41% of ``torch._scaled_mm``'s 1351: the fp32 promotion after every 128-K wgmma block serialises
MMA and FFMA); FP4 decode ~970 GB/s on the weight bytes (~23% of the copy bandwidth: 16-row MMA tiles
whose dot-operand layout conversion goes through shared memory); at 1-2 rows per expert the CUDA-core
GEMV (``gemv.py``, ~1.7 TB/s) replaces it. On Hopper the
FP8 MMA keeps ~14 bits while it sums a 128-K partial (as in the official kernel, which promotes per
128 for that reason): ``fp8_gemm`` then differs from the fp64 sum by up to ~2^-12 sum|products|.
GPU validation: act quant (q, s), ``fp8_gemm``/``fp8_linear`` and the non-grouped ``fp4_gemm`` (both
formats, M 1-300, V4-Flash shapes) passed on the H200; the grouped dequant path fed by an f16 copy
made inside the act-quant kernel failed at V4 sizes (cause not isolated); that copy is now a torch
cast, and this version is not yet GPU-validated.
FP4 on Blackwell (``path="scaled"``, MXFP4 only): ``tl.dot_scaled(e4m3 x e2m1)`` with the e8m0
  activation scale repeated per 32 (native ``tcgen05.mma ... kind::mxf8f6f4.block_scale.block32``
  for 128-row tiles; compile-tested here, not run). NVFP4 stays on the dequant path there: Triton
  3.9 requires equal scale groups for both operands (an e4m3 x nvfp4 ``dot_scaled`` is rejected)
  and 3.6 miscompiles it.

Grouped (MoE) mode of the FP4 kernel: one launch over all active experts. Rows are pair rows
sorted by expert (``offs[e] .. offs[e+1]``), m-tiles of ``BM`` rows per expert enumerated by
``tile_cum`` (inclusive prefix sum of ``ceil(count_e / BM)``), found per program by a binary
search; ``perm`` gathers the activation row of each pair (token = pair // top_k). The SwiGLU mode
computes the w1 and w3 tiles of the same 128 output columns in one program and emits the
routing-weighted, bf16-rounded, FP8-quantised ``h`` (next GEMM's operand) directly.
"""
from __future__ import annotations

import torch

from . import interpreting, triton_available
from .counters import arrival_counters

QBLOCK = 128        # activation / FP8 weight block
GEMV_MAX_ROWS = 4   # rows up to which the benchmarks sweep the decode GEMV (no engine path routes by it now)
PREFILL_MIN_ROWS = 128   # from this many rows fp8_gemm takes the TMA kernel of fp8_prefill.py (Hopper)
FP8_MAX = 448.0

if triton_available():
    import triton
    import triton.language as tl

    from .counters import arrive
    from .kv_insert import _e4m3_bits, _exp2i, _rne_bf16, _ue8m0_exp

    # ---------------------------------------------------------------------------------------
    # shared helpers

    @triton.jit
    def _quant_rows(x, INTERP: tl.constexpr):
        """fp32 x [R, 128] (one quantisation block per row) -> (e4m3 [R, 128], e int32 [R]);
        scale = 2^e, values clamp(x * 2^-e, +-448) rounded to nearest even."""
        e = _ue8m0_exp(tl.max(tl.abs(x), axis=1))
        v = x * _exp2i(-e)[:, None]
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)
        if INTERP:   # the interpreter's fp8 cast mis-rounds: integer RNE (kv_insert._e4m3_bits)
            q = _e4m3_bits(v).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
        else:        # cvt.rn.satfinite: round to nearest even
            q = v.to(tl.float8e4nv)
        return q, e

    @triton.jit
    def _store_bf16(ptrs, acc, mask, INTERP: tl.constexpr):
        if INTERP:   # the interpreter's bf16 cast truncates
            acc = _rne_bf16(acc)
        tl.store(ptrs, acc.to(tl.bfloat16), mask=mask)

    @triton.jit
    def _swiglu_h(g_acc, u_acc, pw, limit, HAS_W: tl.constexpr):
        """Official routed/shared expert middle (spec §8): w1/w3 outputs rounded to bf16, upcast,
        u clamped to +-limit, g to <= limit, silu(g) * u in fp32, times the routing weight, rounded
        to bf16 once. Returns the fp32 value of that bf16 [BM, 128]."""
        g = _rne_bf16(g_acc)
        u = _rne_bf16(u_acc)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        g = tl.minimum(g, limit)
        h = tl.math.div_rn(g, 1.0 + tl.exp(-g)) * u
        if HAS_W:
            h = pw[:, None] * h
        return _rne_bf16(h)

    @triton.jit
    def _e2m1_f16(b, USE_ASM: tl.constexpr):
        """packed e2m1 bytes [R, C] -> (low nibbles, high nibbles) as f16 [R, C], value * 2^-6, exact."""
        if USE_ASM:
            lo = tl.inline_asm_elementwise(
                "{ .reg .b32 t, u; .reg .b16 l, h;\n"
                "and.b32 t, $2, 0x08080808; shl.b32 t, t, 4;\n"
                "and.b32 u, $2, 0x07070707; shl.b32 u, u, 2; or.b32 t, t, u;\n"
                "mov.b32 {l, h}, t; cvt.rn.f16x2.e4m3x2 $0, l; cvt.rn.f16x2.e4m3x2 $1, h; }",
                "=r,=r,r", [b], dtype=tl.float16, is_pure=True, pack=4)
            hi = tl.inline_asm_elementwise(
                "{ .reg .b32 t, u; .reg .b16 l, h;\n"
                "and.b32 t, $2, 0x80808080; shr.b32 u, $2, 2; and.b32 u, u, 0x1C1C1C1C; or.b32 t, t, u;\n"
                "mov.b32 {l, h}, t; cvt.rn.f16x2.e4m3x2 $0, l; cvt.rn.f16x2.e4m3x2 $1, h; }",
                "=r,=r,r", [b], dtype=tl.float16, is_pure=True, pack=4)
        else:
            lo8 = ((b & 8) << 4) | ((b & 7) << 2)
            hi8 = (b & 0x80) | ((b >> 2) & 0x1C)
            lo = lo8.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            hi = hi8.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        return lo, hi

    @triton.jit
    def _find_tile(TCUM, OFFS, t, n_groups, BM: tl.constexpr, LOG2G: tl.constexpr):
        """grouped mode: (expert, first row, end row, valid) of m-tile t (binary search in TCUM,
        the inclusive prefix sum of per-expert tile counts, TCUM[0] = 0)."""
        lo = 0
        hi = n_groups
        for _ in tl.static_range(LOG2G):
            mid = (lo + hi) // 2
            right = tl.load(TCUM + mid + 1) <= t
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(right, hi, mid)
        e = tl.minimum(lo, n_groups - 1)
        m0 = tl.load(OFFS + e) + (t - tl.load(TCUM + e)) * BM
        m_end = tl.load(OFFS + e + 1)
        return e, m0, m_end

    @triton.jit
    def _tile_rows(TCUM, OFFS, M, t, n_groups, BM: tl.constexpr, LOG2G: tl.constexpr, GROUPED: tl.constexpr):
        """(expert, first row, end row, live) of m-tile t: grouped (``_find_tile``; tiles past the
        real count are not live) or plain (tile t of M rows, expert 0)."""
        if GROUPED:
            live = t < tl.load(TCUM + n_groups)
            e, m0, m_end = _find_tile(TCUM, OFFS, t, n_groups, BM, LOG2G)
        else:
            live = t >= 0
            e = t * 0
            m0 = t * BM
            m_end = M + t * 0
        return e, m0, m_end, live

    @triton.jit
    def _tile(TCUM, OFFS, PERM, M, N_out, t, pid_n, n_groups, top_k, BM: tl.constexpr, BN: tl.constexpr,
              LOG2G: tl.constexpr, GROUPED: tl.constexpr, GATHER: tl.constexpr):
        """Output tile (m-tile t, column block pid_n) of the FP4 MMA kernels: (live, row ids int64,
        row mask, pair ids, activation rows, column ids int64, column mask, expert int64)."""
        e, m0, m_end, live = _tile_rows(TCUM, OFFS, M, t, n_groups, BM, LOG2G, GROUPED)
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
    def _fp4_epilogue(C, CS, PW, acc, acc2, pair, r64, mrow, rn64, nmask, pid_n, stride_cm, stride_csm, limit,
                      SWIGLU: tl.constexpr, HAS_PW: tl.constexpr, BM: tl.constexpr, INTERP: tl.constexpr):
        """SwiGLU mode: h = the expert middle of the w1 / w3 tiles (times the pair's routing weight),
        FP8-quantised (bytes + one scale per 128 columns); else the bf16 output tile."""
        if SWIGLU:
            if HAS_PW:
                pw = tl.load(PW + pair, mask=mrow, other=0.0)
            else:
                pw = tl.zeros([BM], tl.float32)
            h = _swiglu_h(acc, acc2, pw, limit, HAS_PW)
            q, eh = _quant_rows(h, INTERP)
            tl.store(C + r64[:, None] * stride_cm + rn64[None, :], q.to(tl.uint8, bitcast=True),
                     mask=mrow[:, None])
            tl.store(CS + r64 * stride_csm + pid_n, _exp2i(eh), mask=mrow)
        else:
            _store_bf16(C + r64[:, None] * stride_cm + rn64[None, :], acc,
                        mrow[:, None] & nmask[None, :], INTERP)

    # ---------------------------------------------------------------------------------------
    # activation quantisation

    @triton.jit
    def _act_quant_kernel(X, Q, S, K, stride_x, stride_q, stride_s,
                          BLOCKS: tl.constexpr, INTERP: tl.constexpr):
        _quant_blocks(X, Q, S, tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCKS, K // 128,
                      stride_x, stride_q, stride_s, BLOCKS, INTERP)

    @triton.jit
    def _quant_blocks(X, Q, S, row, b0, nb, stride_x, stride_q, stride_s, BLOCKS: tl.constexpr,
                      INTERP: tl.constexpr):
        """Row ``row``'s 128-blocks b0 .. b0 + BLOCKS (< nb) of bf16 X -> e4m3 bytes Q and fp32 scales S."""
        blk = b0 + tl.arange(0, BLOCKS)
        bm = blk < nb
        cols = blk[:, None] * 128 + tl.arange(0, 128)[None, :]
        x = tl.load(X + row * stride_x + cols, mask=bm[:, None], other=0.0).to(tl.float32)
        q, e = _quant_rows(x, INTERP)
        tl.store(S + row * stride_s + blk, _exp2i(e), mask=bm)
        tl.store(Q + row * stride_q + cols, q.to(tl.uint8, bitcast=True), mask=bm[:, None])

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

    @triton.jit
    def _grouped_tile(tile, num_m, num_n, GROUP_M: tl.constexpr):
        """(pid_m, pid_n) of output tile ``tile`` in grouped order (GROUP_M row blocks per group: the
        programs running together share weight column blocks in L2)."""
        width = GROUP_M * num_n
        first_m = (tile // width) * GROUP_M
        gsize = tl.minimum(num_m - first_m, GROUP_M)
        return first_m + (tile % width) % gsize, (tile % width) // gsize

    @triton.jit
    def _fp8_gemm_kernel(A, SA, B, SB, C, CS, OUT, CNT, M, N_out, K, n_half,
                         stride_am, stride_sam, stride_bn, stride_sbn, stride_cm, stride_csm, stride_om, limit,
                         k_per_split,
                         SB_SHIFT: tl.constexpr, A_BF16: tl.constexpr, SB_E8M0: tl.constexpr,
                         SWIGLU: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr,
                         SPLIT: tl.constexpr, SUM: tl.constexpr, INTERP: tl.constexpr):
        """SPLIT: program axis 1 takes K range [ks * k_per_split, ...) and stores its fp32 partial
        in C = workspace [S, M, N]. SUM: the tile's last program to arrive on its counter (CNT, per
        output tile, reset to 0 by that program: ``counters.arrival_counters``) adds the S partials in
        split order, from 0 (``_splitk_sum``'s sums, bit for bit, without its launch), into bf16 OUT."""
        ks = tl.program_id(1)
        pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N_out, BN), GROUP_M)
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
                a, ea = _quant_rows(x.to(tl.float32), INTERP)
                sa = _exp2i(ea)
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
            h = _swiglu_h(acc, acc2, acc2, limit, False)
            q, e = _quant_rows(h, INTERP)
            tl.store(C + rm64[:, None] * stride_cm + rn64[None, :], q.to(tl.uint8, bitcast=True),
                     mask=mm[:, None] & mn[None, :])
            tl.store(CS + rm64 * stride_csm + pid_n, _exp2i(e), mask=mm)
        elif SPLIT:
            tile = C + rm64[:, None] * N_out + rn64[None, :]
            tl.store(tile + ks.to(tl.int64) * M * N_out, acc, mask=mm[:, None] & mn[None, :])
            if SUM:
                S = tl.num_programs(1)
                if arrive(CNT + tl.program_id(0)) == S - 1:
                    tot = tl.zeros([BM, BN], tl.float32)
                    plane = tl.full([], 0, tl.int64) + M * N_out
                    for _s in range(0, S):
                        tot += tl.load(tile, mask=mm[:, None] & mn[None, :], other=0.0, cache_modifier=".cg")
                        tile += plane
                    _store_bf16(OUT + rm64[:, None] * stride_om + rn64[None, :], tot,
                                mm[:, None] & mn[None, :], INTERP)
                    tl.store(CNT + tl.program_id(0), 0)
        else:
            _store_bf16(C + rm64[:, None] * stride_cm + rn64[None, :], acc,
                        mm[:, None] & mn[None, :], INTERP)

    @triton.jit
    def _splitk_sum(WS, C, M, N, S, stride_cm, BLOCK: tl.constexpr, INTERP: tl.constexpr):
        """C[m, n] = bf16(sum over splits s = 0.. of WS[s, m, n]) (fp32, fixed order)."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        msk = i < M * N
        acc = tl.zeros([BLOCK], tl.float32)
        for s in range(0, S):
            acc += tl.load(WS + s * M * N + i, mask=msk, other=0.0)
        m = i // N
        _store_bf16(C + m.to(tl.int64) * stride_cm + (i - m * N), acc, msk, INTERP)

    # ---------------------------------------------------------------------------------------
    # FP8 x FP4 GEMM, Hopper / portable: in-register dequant, fp16 MMAs, grouped + SwiGLU modes

    @triton.jit
    def _fp4_block(acc, A16, SA, arow, mrow, wrow, srow, nmask, k0, stride_am, stride_sam,
                   FMT: tl.constexpr, USE_ASM: tl.constexpr, BN: tl.constexpr):
        """acc += the 128-wide K block starting at k0 of this tile: four 32-groups, each two K=16
        f16 dots (even / odd elements). MXFP4: blk = sum_g P_g * (sB_g * 2^6), acc += blk * sA
        (power-of-two scalings: exact, the official per-32 promotion up to fp32 summation order).
        NVFP4: e4m3 block scales folded into the f16 weights, acc += P * sA."""
        j16 = tl.arange(0, 16)
        sa = tl.load(SA + arow * stride_sam + k0 // 128, mask=mrow, other=0.0)
        blk = tl.zeros(acc.shape, tl.float32)
        if FMT == 2:   # MXFP4, large tiles: the per-32 scale relative to the block's largest, in f16
            j4 = tl.arange(0, 4)
            s4 = tl.load(srow[:, None] + k0 // 32 + j4[None, :], mask=nmask[:, None], other=0).to(tl.int32)
            smax = tl.max(s4, axis=1)
            d = s4 - smax[:, None]                                  # <= 0
            rbits = tl.where(d >= -14, (d + 15) << 10, tl.where(d >= -24, 1 << (d + 24), 0))
            rel = rbits.to(tl.int16).to(tl.float16, bitcast=True)  # 2^d (f16 subnormal below 2^-14)
        for g in tl.static_range(4):
            kk = k0 + g * 32
            ae = tl.load(A16 + arow[:, None] * stride_am + kk + 2 * j16[None, :], mask=mrow[:, None], other=0.0)
            ao = tl.load(A16 + arow[:, None] * stride_am + kk + 1 + 2 * j16[None, :], mask=mrow[:, None],
                         other=0.0)
            b = tl.load(wrow[:, None] + kk // 2 + j16[None, :], mask=nmask[:, None], other=0)
            wl, wh = _e2m1_f16(b, USE_ASM)
            if FMT == 2:
                rg = tl.sum(tl.where(j4[None, :] == g, rel, 0.0), axis=1)   # [BN] f16 (exact)
                wl = wl * rg[:, None]
                wh = wh * rg[:, None]
                blk = tl.dot(ae, tl.trans(wl), blk)
                blk = tl.dot(ao, tl.trans(wh), blk)
            elif FMT == 0:
                p = tl.dot(ae, tl.trans(wl))
                p = tl.dot(ao, tl.trans(wh), p)
                sbb = tl.load(srow + kk // 32, mask=nmask, other=0).to(tl.int32)
                sb = ((sbb + 6) << 23).to(tl.float32, bitcast=True)   # 2^(byte-127) * 2^6
                blk += p * sb[None, :]
            else:
                j2 = tl.arange(0, 2)
                bs = tl.load(srow[:, None] + kk // 16 + j2[None, :], mask=nmask[:, None], other=0)
                bs = bs.to(tl.float8e4nv, bitcast=True).to(tl.float16)          # [BN, 2], exact
                wl = tl.reshape(tl.reshape(wl, [BN, 2, 8]) * bs[:, :, None], [BN, 16])
                wh = tl.reshape(tl.reshape(wh, [BN, 2, 8]) * bs[:, :, None], [BN, 16])
                blk = tl.dot(ae, tl.trans(wl), blk)
                blk = tl.dot(ao, tl.trans(wh), blk)
        if FMT == 2:
            sb = ((smax + 6) << 23).to(tl.float32, bitcast=True)
            acc += blk * (sa[:, None] * sb[None, :])
        else:
            acc += blk * sa[:, None]
        return acc

    @triton.jit
    def _fp4_gemm_kernel(A16, SA, W, WS, WS2, C, CS, PERM, OFFS, TCUM, PW,
                         M, N_out, K, n_half, n_groups, top_k,
                         stride_am, stride_sam, stride_we, stride_wn, stride_wse, stride_wsn,
                         stride_w2e, stride_cm, stride_csm, limit,
                         FMT: tl.constexpr, GROUPED: tl.constexpr, GATHER: tl.constexpr,
                         SWIGLU: tl.constexpr, HAS_PW: tl.constexpr, USE_ASM: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, LOG2G: tl.constexpr,
                         INTERP: tl.constexpr):
        pid_n = tl.program_id(1)
        live, r64, mrow, pair, arow, rn64, nmask, e64 = _tile(TCUM, OFFS, PERM, M, N_out, tl.program_id(0), pid_n,
                                                              n_groups, top_k, BM, BN, LOG2G, GROUPED, GATHER)
        if not live:
            return
        wrow = W + e64 * stride_we + rn64 * stride_wn
        srow = WS + e64 * stride_wse + rn64 * stride_wsn
        acc = tl.zeros([BM, BN], tl.float32)
        acc2 = tl.zeros([BM, BN], tl.float32)
        if SWIGLU:
            wrow2 = wrow + n_half * stride_wn
            srow2 = srow + n_half * stride_wsn
        for k0 in range(0, K, 128):
            acc = _fp4_block(acc, A16, SA, arow, mrow, wrow, srow, nmask, k0, stride_am, stride_sam,
                             FMT, USE_ASM, BN)
            if SWIGLU:
                acc2 = _fp4_block(acc2, A16, SA, arow, mrow, wrow2, srow2, nmask, k0, stride_am,
                                  stride_sam, FMT, USE_ASM, BN)
        if FMT == 1:
            s2 = tl.load(WS2 + e64 * stride_w2e + rn64, mask=nmask, other=0.0) * 64.0
            acc = acc * s2[None, :]
            if SWIGLU:
                s2b = tl.load(WS2 + e64 * stride_w2e + n_half + rn64, mask=nmask, other=0.0) * 64.0
                acc2 = acc2 * s2b[None, :]
        _fp4_epilogue(C, CS, PW, acc, acc2, pair, r64, mrow, rn64, nmask, pid_n, stride_cm, stride_csm, limit,
                      SWIGLU, HAS_PW, BM, INTERP)

    # ---------------------------------------------------------------------------------------
    # FP8 x MXFP4 via tl.dot_scaled (Blackwell: native block-scaled tcgen05 MMA)

    @triton.jit
    def _scaled_loop(A, SA, W, WS, arow, mrow, rn64, nmask, e64, K, stride_am, stride_sam,
                     stride_we, stride_wn, stride_wse, stride_wsn, BM: tl.constexpr, BN: tl.constexpr):
        kc = tl.arange(0, 128)
        k2 = tl.arange(0, 64)
        k4 = tl.arange(0, 4)
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, 128):
            kb = k0 // 128
            a = tl.load(A + arow[:, None] * stride_am + k0 + kc[None, :], mask=mrow[:, None], other=0)
            a = a.to(tl.float8e4nv, bitcast=True)
            sa = tl.load(SA + arow * stride_sam + kb, mask=mrow, other=1.0)
            sa8 = ((sa.to(tl.int32, bitcast=True) >> 23) & 0xFF).to(tl.uint8)     # 2^e -> e8m0 byte
            sa8 = tl.broadcast_to(sa8[:, None], [BM, 4])
            w = tl.load(W + e64 * stride_we + rn64[:, None] * stride_wn + kb * 64 + k2[None, :],
                        mask=nmask[:, None], other=0)
            ws = tl.load(WS + e64 * stride_wse + rn64[:, None] * stride_wsn + kb * 4 + k4[None, :],
                         mask=nmask[:, None], other=127)
            acc = tl.dot_scaled(a, sa8, "e4m3", tl.trans(w), ws, "e2m1", acc)
        return acc

    @triton.jit
    def _fp4_scaled_kernel(A, SA, W, WS, C, CS, PERM, OFFS, TCUM, PW,
                           M, N_out, K, n_half, n_groups, top_k,
                           stride_am, stride_sam, stride_we, stride_wn, stride_wse, stride_wsn,
                           stride_cm, stride_csm, limit,
                           GROUPED: tl.constexpr, GATHER: tl.constexpr, SWIGLU: tl.constexpr,
                           HAS_PW: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                           LOG2G: tl.constexpr, INTERP: tl.constexpr):
        pid_n = tl.program_id(1)
        live, r64, mrow, pair, arow, rn64, nmask, e64 = _tile(TCUM, OFFS, PERM, M, N_out, tl.program_id(0), pid_n,
                                                              n_groups, top_k, BM, BN, LOG2G, GROUPED, GATHER)
        if not live:
            return
        acc = _scaled_loop(A, SA, W, WS, arow, mrow, rn64, nmask, e64, K, stride_am, stride_sam,
                           stride_we, stride_wn, stride_wse, stride_wsn, BM, BN)
        if SWIGLU:   # a second loop (one accumulator per loop: Triton 3.6's tmem pass wants that)
            acc2 = _scaled_loop(A, SA, W, WS, arow, mrow, rn64 + n_half, nmask, e64, K, stride_am,
                                stride_sam, stride_we, stride_wn, stride_wse, stride_wsn, BM, BN)
        else:
            acc2 = acc
        _fp4_epilogue(C, CS, PW, acc, acc2, pair, r64, mrow, rn64, nmask, pid_n, stride_cm, stride_csm, limit,
                      SWIGLU, HAS_PW, BM, INTERP)


# -------------------------------------------------------------------------------------------------
# host side

def _on_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" and not interpreting()


def capability(device) -> tuple[int, int]:
    if interpreting() or torch.device(device).type != "cuda":
        return (0, 0)
    return torch.cuda.get_device_capability(device)


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def f16_operand(q: torch.Tensor) -> torch.Tensor:
    """e4m3 [M, K] -> the FP4 GEMM's A operand: the same values in f16 (exact), same layout."""
    return q.float().to(torch.float16).contiguous()


def act_quant_fp8(x: torch.Tensor, block: int = QBLOCK, with_f16: bool = False):
    """Triton act_quant (see module doc). x bf16 [..., K], K % 128 == 0. Returns (q e4m3, s fp32)
    or, with ``with_f16``, (q, s, a16) where a16 is the FP4 GEMM operand (``f16_operand(q)``, a
    torch conversion: an in-kernel f16 copy was wrong on the H200 with Triton 3.6, see module doc)."""
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
            x2, q, s, K, x2.stride(0), K, s.stride(0), BLOCKS=blocks, INTERP=interpreting(), **kw)
    qo = q.view(torch.float8_e4m3fn).reshape(shape)
    so = s.reshape(*shape[:-1], K // QBLOCK)
    if with_f16:
        return qo, so, f16_operand(qo.reshape(-1, K)).reshape(shape)
    return qo, so


def act_quant_fp8_torch(x: torch.Tensor, block: int = QBLOCK):
    from ..formats.fp8 import act_quant_fp8 as _aq
    return _aq(x, block)


def _fp8_config(M: int, N: int, K: int, dev) -> dict:
    if interpreting() or dev.type != "cuda":
        return {"BM": 16, "BN": 32 if N <= 32 else 64, "GROUP_M": 8}
    # decode sizes (split-K fills the GPU): tiles from the H200 sweep of the V4-Flash decode linears
    # (benchmarks/gemm_moe.py --only fp8dec); above N = 4096, 128 columns where K >= 1536 (V4-Pro's
    # wq_b / wo_b at one row: 29.1 / 40.1 us against 36.4 / 50.7 with 64, experiments/exp_fp8_big_decode.py;
    # Flash's wq_b, K = 1024, stays faster with 64)
    if M <= 16:
        bn = 32 if N <= 1024 else (128 if 2048 < N <= 4096 or (N > 4096 and K >= 1536) else 64)
        return {"BM": 16, "BN": bn, "GROUP_M": 8, "num_warps": 4, "num_stages": 5 if bn == 32 else 3}
    if M <= 64:
        return {"BM": 64, "BN": 128 if N > 1024 else 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
    return {"BM": 128, "BN": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 4}


def _sm_count(dev) -> int:
    if interpreting() or dev.type != "cuda":
        return 4                                   # small, so CPU tests exercise the split path
    return torch.cuda.get_device_properties(dev).multi_processor_count


def _split_k(M, N, K, BM, BN, dev, swiglu) -> int:
    """K splits for decode-sized GEMMs whose output tiles cannot fill the GPU (latency-bound
    weight streaming): about two programs per SM, at least two 128-K blocks per split."""
    if swiglu or M > 64:
        return 1
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    kb = K // QBLOCK
    return max(1, min(kb // 2, triton.cdiv(2 * _sm_count(dev), tiles)))


def _launch_fp8(a, sa, w, ws, out, out_s, M, N_out, K, n_half, a_bf16, swiglu, limit, config, partial=False):
    """The MMA kernel (+ the split-K sum). ``partial``: return the fp32 split partials [S, M, N_out]
    unsummed (S = 1 included; ``out`` unused)."""
    cfg = dict(_fp8_config(M, N_out, K, a.device))
    if config:
        cfg.update(config)
    if swiglu:
        cfg["BN"] = QBLOCK
        if not config and not interpreting() and a.device.type == "cuda" and M > 16:
            cfg.update(BM=64, num_warps=8, num_stages=3)   # two accumulators (ptxas: no spills)
    BM, BN, GM = cfg.pop("BM"), cfg.pop("BN"), cfg.pop("GROUP_M")
    S = cfg.pop("SPLIT_K", None) or _split_k(M, N_out, K, BM, BN, a.device, swiglu)
    S = 1 if swiglu else S                   # the SwiGLU epilogue needs the whole K sum
    kps = triton.cdiv(K // QBLOCK, S) * QBLOCK
    S = triton.cdiv(K, kps)
    kw = {} if interpreting() else {k: v for k, v in cfg.items() if k in ("num_warps", "num_stages")}
    sb_e8m0 = ws.dtype in (torch.float8_e8m0fnu, torch.uint8)
    wsv = _u8(ws) if sb_e8m0 else ws.float()
    per_row = wsv.shape[0] == w.shape[0] and w.shape[0] != triton.cdiv(w.shape[0], QBLOCK)
    grid = (triton.cdiv(M, BM) * triton.cdiv(N_out, BN), S)
    split = (S > 1 or partial) and not swiglu
    dst = torch.empty(S, M, N_out, dtype=torch.float32, device=a.device) if split else out
    fused_sum = split and not partial       # the split sum by each tile's last program (no second launch)
    cnt = arrival_counters(a.device, grid[0]) if fused_sum else dst
    _fp8_gemm_kernel[grid](
        a, sa if sa is not None else wsv, _u8(w), wsv, dst, out_s if out_s is not None else dst,
        out if fused_sum else dst, cnt,
        M, N_out, K, n_half, a.stride(0), sa.stride(0) if sa is not None else 0, w.stride(0),
        wsv.stride(0), dst.stride(-2), out_s.stride(0) if out_s is not None else 0,
        out.stride(0) if fused_sum else 0, float(limit), kps,
        SB_SHIFT=0 if per_row else 7, A_BF16=a_bf16, SB_E8M0=sb_e8m0, SWIGLU=swiglu,
        BM=BM, BN=BN, GROUP_M=GM, SPLIT=split, SUM=fused_sum, INTERP=interpreting(), **kw)
    if partial:
        return dst


def _check_fp8_weight(w, ws):
    if w.dim() != 2 or w.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(f"fp8 weight: expected e4m3 [N, K], got {w.dtype} {tuple(w.shape)}")
    N, K = w.shape
    if K % QBLOCK:
        raise ValueError(f"fp8 weight: K={K} must be a multiple of 128")
    nb = (triton.cdiv(N, QBLOCK), K // QBLOCK)
    if tuple(ws.shape) not in (nb, (N, K // QBLOCK)):
        raise ValueError(f"fp8 weight scale: expected {nb} (or per-row {(N, K // QBLOCK)}), got {tuple(ws.shape)}")


def fp8_weight_exact(w: torch.Tensor, what: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [N, K], fp32 [N/128, K/128]) of an exactly dequantised FP8 weight (the reference keeps
    weights as fp32 values): re-quantising gives the checkpoint's codes and power-of-two scales back,
    which is checked."""
    from ..formats.fp8 import dequant_fp8_weight, quant_fp8_weight
    q, s = quant_fp8_weight(w)
    if not torch.equal(dequant_fp8_weight(q, s), w.float()):
        raise ValueError(f"{what} {tuple(w.shape)} is not FP8 128x128-block representable")
    return q, s.float()


def _check_fp8_gemm_args(name, xq, xs, w, ws) -> tuple[int, int]:
    """(M, K) of a quantised activation xq [M, K] with scales xs [M, K/128] against the FP8 weight w."""
    _check_fp8_weight(w, ws)
    M, K = xq.shape
    if w.shape[1] != K or tuple(xs.shape) != (M, K // QBLOCK):
        raise ValueError(f"{name}: shapes xq {tuple(xq.shape)} xs {tuple(xs.shape)} w {tuple(w.shape)}")
    return M, K


def fp8_gemm_partials(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
                      config: dict | None = None) -> torch.Tensor:
    """fp32 [S, M, N]: the MMA kernel's split-K partials of ``fp8_gemm`` (each the per-block scaled
    sum over its K range; the split count fills the GPU at decode sizes), for a pass that sums them
    itself (``gemv.swiglu_quant``)."""
    M, K = _check_fp8_gemm_args("fp8_gemm_partials", xq, xs, w, ws)
    return _launch_fp8(_u8(xq.contiguous()), xs.float().contiguous(), w.contiguous(), ws.contiguous(), None, None,
                       M, w.shape[0], K, 0, False, False, 0.0, config, partial=True)


def fp8_gemm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
             out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """bf16 [M, N] = official block-scaled FP8 GEMM of act_quant output (xq e4m3 [M, K], xs fp32
    [M, K/128]) and an FP8 weight (w e4m3 [N, K], ws e8m0/fp32 [N/128, K/128], or per-row
    [N, K/128])."""
    M, K = _check_fp8_gemm_args("fp8_gemm", xq, xs, w, ws)
    N = w.shape[0]
    out = torch.empty(M, N, dtype=torch.bfloat16, device=xq.device) if out is None else out
    if M == 0:
        return out
    if config is None and _mma_decode_ok(M, N, K, xq.device) and out.stride(-1) == 1:
        from .fp8_mma import fp8_mma     # tensor-core decode kernel, split K summed in-kernel
        return fp8_mma(w, ws, xq, xs.float(), out=out)
    if config is None and M >= PREFILL_MIN_ROWS and _on_cuda(xq) and capability(xq.device)[0] == 9 \
            and out.stride(-1) == 1:
        from .fp8_prefill import fp8_gemm_prefill      # TMA tiles: 1.4-1.7x at prefill sizes on the H200
        return fp8_gemm_prefill(xq, xs, w, ws, out=out)
    _launch_fp8(_u8(xq.contiguous()), xs.float().contiguous(), w.contiguous(), ws.contiguous(), out, None,
                M, N, K, 0, False, False, 0.0, config)
    return out


def _mma_decode_ok(M: int, N: int, K: int, dev) -> bool:
    """Decode-sized calls on small weights go to ``fp8_mma`` (tensor-core, in-kernel split-K sum) where
    it runs: measured faster there on the H200 (``fp8_mma.MAX_ROWS`` / ``MAX_WEIGHT`` say where)."""
    from . import fp8_mma     # available(): a CUDA sm_89+ device, Gluon, not the interpreter
    return 0 < M <= fp8_mma.MAX_ROWS and N * K <= fp8_mma.MAX_WEIGHT and fp8_mma.available(dev)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, fuse_quant: bool | None = None,
               config: dict | None = None, gemv: bool = False) -> torch.Tensor:
    """bf16 x [..., K] -> bf16 [..., N]: act_quant_fp8 + fp8_gemm (the quantisation fused into the
    GEMM's A-tile load when M <= 64, unless ``fuse_quant`` says otherwise). Bit-identical to the
    two-step path. ``gemv=True`` runs the CUDA-core GEMV instead (``gemv.fp8_gemv``: same products
    and quantisation, another fp32 summation order); not the default: at 1-4 rows the split-K MMA
    kernel measured faster on the H200 for every V4-Flash linear (BENCHMARKS.md). On sm_89+ the
    decode-size calls on small weights (``_mma_decode_ok``) run ``fp8_mma`` instead: the same
    quantisation, products and per-block promotion, another fp32 summation order."""
    _check_fp8_weight(w, ws)
    K = x.shape[-1]
    N = w.shape[0]
    x2 = x.reshape(-1, K).to(torch.bfloat16)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if fuse_quant is None:
        fuse_quant = M <= 64
    if gemv:
        from .gemv import fp8_gemv
        return fp8_gemv(x2, w, ws, config=config).reshape(*x.shape[:-1], N)
    if config is None and fuse_quant and _mma_decode_ok(M, N, K, x.device):
        from .fp8_mma import fp8_mma     # the act quant in its operand load, split K summed in-kernel
        return fp8_mma(w, ws, x_bf16=x2).reshape(*x.shape[:-1], N)
    out = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    if M:
        if fuse_quant:
            _launch_fp8(x2, None, w.contiguous(), ws.contiguous(), out, None, M, N, K, 0, True, False,
                        0.0, config)
        else:
            q, s = act_quant_fp8(x2)
            fp8_gemm(q, s, w, ws, out=out, config=config)
    return out.reshape(*x.shape[:-1], N)


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
            _launch_fp8(x_bf16.contiguous(), None, w13, w13s, h, hs, M, I, K, I, True, True, limit, config)
        else:
            _launch_fp8(_u8(xq.contiguous()), xs.contiguous(), w13, w13s, h, hs, M, I, K, I, False, True,
                        limit, config)
    return h.view(torch.float8_e4m3fn), hs


def fp8_gemm_torch(xq, xs, w, ws) -> torch.Tensor:
    """Torch twin with the official accumulation order (per 128-block fp32 partial, scaled, summed
    in increasing K order, one bf16 rounding)."""
    from ..formats.fp8 import e8m0_to_fp32
    M, K = xq.shape
    N = w.shape[0]
    s = e8m0_to_fp32(ws) if ws.dtype in (torch.float8_e8m0fnu, torch.uint8) else ws.float()
    if s.shape[0] != N:
        s = s.repeat_interleave(QBLOCK, 0)[:N]
    a = xq.float().view(M, K // QBLOCK, QBLOCK)
    b = w.float().view(N, K // QBLOCK, QBLOCK)
    acc = torch.zeros(M, N, dtype=torch.float32, device=xq.device)
    for kb in range(K // QBLOCK):
        acc += (a[:, kb] @ b[:, kb].T) * (xs[:, kb, None].float() * s[None, :, kb])
    return acc.to(torch.bfloat16)


# ------------------------------------------------------------------------------ FP4

FP4_FORMATS = ("mxfp4", "nvfp4")


def fp4_path(fmt: str, device) -> str:
    """'scaled' (tl.dot_scaled) on Blackwell for MXFP4, else 'dequant'."""
    cap = capability(device)
    return "scaled" if (fmt == "mxfp4" and cap >= (10, 0)) else "dequant"


def fp4_config(rows_per_group: float, device, swiglu: bool = False) -> dict:
    """Tile for the FP4 kernel from the (average) rows per expert (decode: 1-64)."""
    if interpreting() or torch.device(device).type != "cuda":
        return {"BM": 16, "BN": 32}
    bm = 16 if rows_per_group <= 16 else (32 if rows_per_group <= 32 else 64)
    if rows_per_group > 256:
        bm = 128
    cfg = {"BM": bm, "BN": 128, "num_warps": 4, "num_stages": 3}
    if bm >= 128 or (swiglu and bm >= 32):     # two accumulators: 4 warps would spill (ptxas report)
        cfg.update(num_warps=8, num_stages=3)
    if capability(device) >= (10, 0):
        cfg["BM"] = max(bm, 128)
        cfg["num_warps"] = 8
    return cfg


def _use_asm(device) -> bool:
    return torch.device(device).type == "cuda" and not interpreting() and torch.version.hip is None


def fp4_launch(a, sa, w, ws, ws2, out, out_s, M, N_out, K, n_half, *, fmt, swiglu=False, limit=0.0,
               perm=None, offs=None, tcum=None, pw=None, top_k=1, n_groups=1, n_tiles=None,
               path=None, config=None, use_asm=None, mx_fold=True):
    """Low-level launch of the FP4 GEMM (plain or grouped, optional SwiGLU epilogue).

    a: for path 'dequant' the f16 operand (``f16_operand``), for 'scaled' e4m3 bytes; [rows, K].
    w: packed uint8 [G, N, K/2]; ws: uint8 scales [G, N, K/32] (mx) or e4m3 bytes [G, N, K/16] (nv);
    ws2: fp32 [G, N] per-row global scales (nv). Grouped when ``tcum`` is given: rows are sorted
    pair rows, ``offs`` [G+1] their per-expert starts, ``tcum`` [G+1] the tile prefix sum, ``perm``
    (optional) the pair id of each sorted row (activation row = pair // top_k), ``pw`` the fp32
    routing weight per pair id. Output: bf16 [rows, N_out], or with ``swiglu`` the f16-layout
    e4m3 bytes of h [rows, N_out] and its scales ``out_s`` [rows, N_out/128]."""
    dev = a.device
    path = path or fp4_path(fmt, dev)
    cfg = fp4_config(M / max(1, n_groups), dev, swiglu)
    if config:
        cfg.update(config)
        if swiglu and "num_warps" not in config:
            cfg.update({k: v for k, v in fp4_config(0, dev, True).items() if k == "num_warps"})
            if cfg["BM"] >= 32 and not interpreting() and torch.device(dev).type == "cuda":
                cfg["num_warps"] = 8
    if swiglu:
        cfg["BN"] = QBLOCK
    BM, BN = cfg.pop("BM"), cfg.pop("BN")
    kw = {} if interpreting() else {k: v for k, v in cfg.items() if k in ("num_warps", "num_stages")}
    grouped = tcum is not None
    if grouped:
        grid_m = n_tiles if n_tiles is not None else min(M, triton.cdiv(M, BM) + min(n_groups, M))
    else:
        grid_m = triton.cdiv(M, BM)
    grid = (max(grid_m, 1), triton.cdiv(N_out, BN))
    dummy = out_s if out_s is not None else sa
    log2g = max(1, (max(n_groups, 1)).bit_length())
    common = dict(GROUPED=grouped, GATHER=perm is not None, SWIGLU=swiglu, HAS_PW=pw is not None,
                  BM=BM, BN=BN, LOG2G=log2g, INTERP=interpreting())
    if path == "scaled":
        if fmt != "mxfp4":
            raise ValueError("the dot_scaled path takes MXFP4 weights only")
        _fp4_scaled_kernel[grid](
            a, sa, w, ws, out, out_s if out_s is not None else dummy,
            perm if perm is not None else sa, offs if offs is not None else sa,
            tcum if tcum is not None else sa, pw if pw is not None else sa,
            M, N_out, K, n_half, n_groups, top_k, a.stride(0), sa.stride(0), w.stride(0), w.stride(1),
            ws.stride(0), ws.stride(1), out.stride(0), out_s.stride(0) if out_s is not None else 0,
            float(limit), **common, **kw)
        return
    if use_asm is None:
        use_asm = _use_asm(dev)
    _fp4_gemm_kernel[grid](
        *fp4_kernel_args(a, sa, w, ws, ws2, out, out_s, perm, offs, tcum, pw, M, N_out, K, n_half, n_groups,
                         top_k, limit),
        FMT=(2 if (BM >= 64 and mx_fold) else 0) if fmt == "mxfp4" else 1, USE_ASM=use_asm, **common, **kw)


def fp4_kernel_args(a, sa, w, ws, ws2, out, out_s, perm, offs, tcum, pw, M, N_out, K, n_half, n_groups, top_k,
                    limit) -> tuple:
    """The runtime arguments shared by the dequant FP4 kernels (``_fp4_gemm_kernel`` and
    ``fp4_prefill``'s): absent optional tensors replaced by a dummy pointer (never read)."""
    dummy = out_s if out_s is not None else sa
    return (a, sa, w, ws, ws2 if ws2 is not None else sa, out, dummy,
            perm if perm is not None else sa, offs if offs is not None else sa,
            tcum if tcum is not None else sa, pw if pw is not None else sa,
            M, N_out, K, n_half, n_groups, top_k, a.stride(0), sa.stride(0), w.stride(0), w.stride(1),
            ws.stride(0), ws.stride(1), ws2.stride(0) if ws2 is not None else 0, out.stride(0),
            out_s.stride(0) if out_s is not None else 0, float(limit))


def _check_fp4(w_packed, w_scale, fmt, w_scale_2):
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


def fp4_gemm(xq: torch.Tensor, xs: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor,
             fmt: str = "mxfp4", w_scale_2: torch.Tensor | None = None, path: str | None = None,
             config: dict | None = None, a16: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 [M, N] = FP8 activations (xq e4m3 [M, K], xs fp32 [M, K/128]) x FP4 weights (module
    doc). ``a16`` (the f16 operand from ``act_quant_fp8(x, with_f16=True)``) saves a conversion."""
    N, K = _check_fp4(w_packed, w_scale, fmt, w_scale_2)
    M = xq.shape[0] if xq is not None else a16.shape[0]
    dev = w_packed.device
    path = path or fp4_path(fmt, dev)
    out = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
    if M == 0:
        return out
    w = _u8(w_packed).contiguous().unsqueeze(0)
    ws = _u8(w_scale).contiguous().unsqueeze(0)
    ws2 = None
    if fmt == "nvfp4":
        ws2 = w_scale_2.float().reshape(-1).to(dev)
        ws2 = (ws2.expand(N) if ws2.numel() == 1 else ws2).contiguous().unsqueeze(0)
    if path == "scaled":
        a = _u8(xq.contiguous())
    else:
        a = a16 if a16 is not None else f16_operand(xq)
    fp4_launch(a, xs.float().contiguous(), w, ws, ws2, out, None, M, N, K, 0, fmt=fmt, path=path,
               config=config)
    return out


def fp4_gemm_torch(xq, xs, w_packed, w_scale, fmt="mxfp4", w_scale_2=None) -> torch.Tensor:
    """Torch twin: bf16(dequant(x) @ dequant(W)^T) in fp32, as ``reference.linear.Linear`` (fp4)."""
    from ..formats.fp4 import dequant_mxfp4, dequant_nvfp4
    W = dequant_mxfp4(w_packed, w_scale) if fmt == "mxfp4" else dequant_nvfp4(w_packed, w_scale, w_scale_2)
    M, K = xq.shape
    x = (xq.float().view(M, K // QBLOCK, QBLOCK) * xs.float()[..., None]).view(M, K)
    return (x @ W.T).to(torch.bfloat16)


__all__ = ["act_quant_fp8", "act_quant_fp8_torch", "fp8_gemm", "fp8_gemm_torch", "fp8_linear",
           "fp8_swiglu", "fp4_gemm", "fp4_gemm_torch", "fp4_launch", "fp4_path", "fp4_config",
           "f16_operand", "FP4_FORMATS"]
