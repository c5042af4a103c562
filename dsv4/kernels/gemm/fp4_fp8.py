"""Prefill MXFP4 expert GEMM on FP8 tensor cores (sm_90 wgmma e4m3), the weights FP4 in memory.

Same host interface and numerics contract as ``fp4_prefill.fp4_prefill_launch`` (grouped tiles from
``moe.sort_pairs(eflat, E, BM)``, gather by ``perm``, the SwiGLU + FP8-quantise epilogue of
``common.fp4_epilogue`` or a plain bf16 output), except for the activation operand: the e4m3 bytes
themselves, not an f16 copy.

Per 128-K block and weight row the packed e2m1 codes become e4m3 bytes in registers, the MXFP4
per-32 scales folded in relative to the row's largest scale of the block ``s_max``:

    byte(code, group g) = e4m3(e2m1(code) * 2^(s_g - s_max + 6)),   weight = byte * 2^(s_max - 133)

then ONE ``tl.dot`` of e4m3 operands (K = 128: a chain of four k32 wgmmas) into a fresh fp32 partial and
the official per-128 promotion ``acc += partial * (sa[row] * 2^(s_max - 133))`` (DeepGEMM's structure:
the tensor core's own accumulation never runs longer than 128 K).

Exactness of the fold. e2m1 magnitudes are {0, 0.5, 1, 1.5, 2, 3, 4, 6}; times 2^(6 + d), d = s_g - s_max
<= 0, the largest (6 * 64 = 384) stays below e4m3's 448, and every nonzero value is an e4m3 *normal*
number while d >= -11 (smallest 0.5 * 2^-5 = 2^-6): exact, so every product is exact and the block's
sum differs from the twin's only by the tensor core's accumulation. Where a group's scale lies more than
2^11 below its row's block maximum (d <= -12) the kernel flushes that group to zero. That is exact when
the group's codes are all zero (the usual reason for such a scale: an all-zero group quantises to the
smallest scale) and otherwise drops values below 2^-11 of the block row's largest magnitude
(6 * 2^(s_max - 127)): an absolute error per weight < 6 * 2^(s_max - 138). ``wide_spread(ws)`` tells
a caller whether a weight has such groups (the MoE layer then keeps such weights on ``fp4_prefill``,
exact to 2^28). NVFP4 (e4m3 per-16 scales: e2m1 x e4m3 products need up to 6 significant bits, e4m3
has 4) is not folded here: ``fp4_prefill`` keeps it.

Pre-decoded tiles (``predecode``): the same bytes and factors written once to memory for the kernel to load
by TMA. ``predecode(tile=True)`` folds against the maximum over each 128 x 128 weight tile instead of each
row's block (exact under the same 2^11 bound, now relative to the tile: ``wide_spread(ws, tile=True)``),
so that one factor per tile and K block promotes the partial (``SB_TILE``): every row's bytes are the row
fold's times 2^(row max - tile max) and its factor the inverse, the products and the per-block sums the
same (tested bit for bit against the decoding kernel on the interpreter and on the H100's wgmma).

Decode (``USE_ASM``): per 32-bit word of 4 packed bytes, byte-lane-parallel integer ops (shifts, logic,
adds, one ``prmt`` to widen the live-lane mask): ~30 instructions per 8 values, no conversion
instruction, each byte lane independent (the result does not depend on how Triton lays the packed bytes
out in registers). The portable decode (interpreter, ``use_asm=False``) computes the same bytes with
plain integer ops. The weight tile's K order is natural, so the activations and GEMM 1's h are the
operands as they are.

``SWAP`` (default): the weight tile is the dot's first operand ([BN weight rows, 128] x [128, BM tokens]
-> [BN, BM]), so wgmma takes the decoded weights from registers and only the activation tile goes
through shared memory; the token count per tile is the wgmma's N (16 .. 256). ``SWAP=False``: the
[BM, 128] x [128, BN] orientation of ``fp4_prefill``.
"""
from __future__ import annotations

import torch

from ..lib import PDL_LAUNCH, QBLOCK, interpreting, target, triton_available, u8
from . import route
from .common import ensure_tma_allocator, fp4_kernel_args, log2_groups

FLUSH_SPREAD = 12     # a group whose scale is >= 2^12 below its row's 128-block maximum is flushed to zero

if triton_available():
    import triton
    import triton.language as tl

    from ..lib import exp2i, pdl_wait, quant_rows, store_bf16, swiglu_h, tile_rows
    from .common import tile

    # per byte lane (4 bytes of a word, each lane independent, so correct for any register layout):
    # p = m << 2 (m = the nibble's magnitude code), kb = k << 3 (0: flushed); magnitude byte
    # p + kb - (4 if m == 1), zero where m == 0 or kb == 0, sign bit from the nibble's bit 3
    DEC_ASM = tl.constexpr(
        "{ .reg .b32 rp, rf, rg, rn, rk, rs;\n"
        "add.u32 rk, $3, 0x78787878;\n"
        # low nibbles
        "shl.b32 rp, $2, 2; and.b32 rp, rp, 0x1C1C1C1C;\n"
        "shr.b32 rf, rp, 1; shr.b32 rg, rp, 2; or.b32 rf, rf, rg; not.b32 rf, rf; and.b32 rf, rf, rp;"
        " and.b32 rf, rf, 0x04040404;\n"
        "add.u32 rn, rp, 0x7C7C7C7C; and.b32 rn, rn, rk; and.b32 rn, rn, 0x80808080; prmt.b32 rn, rn, 0, 0xBA98;\n"
        "add.u32 rp, rp, $3; sub.u32 rp, rp, rf; shl.b32 rs, $2, 4; and.b32 rs, rs, 0x80808080;\n"
        "or.b32 rp, rp, rs; and.b32 $0, rp, rn;\n"
        # high nibbles
        "shr.b32 rp, $2, 2; and.b32 rp, rp, 0x1C1C1C1C;\n"
        "shr.b32 rf, rp, 1; shr.b32 rg, rp, 2; or.b32 rf, rf, rg; not.b32 rf, rf; and.b32 rf, rf, rp;"
        " and.b32 rf, rf, 0x04040404;\n"
        "add.u32 rn, rp, 0x7C7C7C7C; and.b32 rn, rn, rk; and.b32 rn, rn, 0x80808080; prmt.b32 rn, rn, 0, 0xBA98;\n"
        "add.u32 rp, rp, $3; sub.u32 rp, rp, rf; and.b32 rs, $2, 0x80808080;\n"
        "or.b32 rp, rp, rs; and.b32 $1, rp, rn; }")

    @triton.jit
    def _mag_byte(c, kb):
        """Portable decode of e2m1 codes c (int32, 0..15) with group shifts kb (int32, same shape) ->
        the e4m3 byte of e2m1(c) * 2^(kb - 6) (0 when kb < 1: flushed; +0 for a zero code)."""
        m = c & 7
        e = tl.where(m >= 2, (m >> 1) + kb, kb)
        mant = tl.where(m >= 2, (m & 1) << 2, 0)
        live = (m != 0) & (kb >= 1)
        return tl.where(live, (e << 3) | mant | ((c & 8) << 4), 0)

    @triton.jit
    def _fp8_weight_tile(b, k, USE_ASM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr = 4):
        """packed e2m1 bytes b (uint8 [BN, 16 G]) and per-group shifts k = s_g - s_max + 12 (int32 [BN, G])
        -> e4m3 [BN, 32 G], natural K order (element 2j = the low nibble of byte j)."""
        kb = tl.reshape(tl.broadcast_to(k[:, :, None], [BN, G, 16]), [BN, 16 * G])
        if USE_ASM:
            kb8 = tl.where(kb >= 1, kb << 3, 0).to(tl.uint8)
            lo, hi = tl.inline_asm_elementwise(DEC_ASM, "=r,=r,r,r", [b, kb8], dtype=(tl.uint8, tl.uint8),
                                               is_pure=True, pack=4)
        else:
            bi = b.to(tl.int32)
            lo = _mag_byte(bi & 15, kb).to(tl.uint8)
            hi = _mag_byte(bi >> 4, kb).to(tl.uint8)
        w = tl.reshape(tl.join(lo, hi), [BN, 32 * G])
        return w.to(tl.float8e4nv, bitcast=True)

    @triton.jit
    def _fp8_decode(wrow, srow, nmask, k0, USE_ASM: tl.constexpr, BN: tl.constexpr):
        """(e4m3 [BN, 128] weight tile of the 128-block at k0, fp32 [BN] factor 2^(s_max - 133))."""
        j4 = tl.arange(0, 4)
        sg = tl.load(srow[:, None] + k0 // 32 + j4[None, :], mask=nmask[:, None], other=0).to(tl.int32)
        smax = tl.max(sg, axis=1)
        sb = ((smax + 6) << 23).to(tl.float32, bitcast=True) * (1.0 / 4096.0)      # 2^(smax - 133)
        jb = tl.arange(0, 64)
        b = tl.load(wrow[:, None] + k0 // 2 + jb[None, :], mask=nmask[:, None], other=0)
        return _fp8_weight_tile(b, sg - smax[:, None] + 12, USE_ASM, BN), sb

    @triton.jit
    def _wfactor(srow, nmask, kb, wsk, SB_TILE: tl.constexpr):
        """Predecoded weight factors of K block kb: the tile's scalar (SB_TILE) or the [BN] column vector."""
        if SB_TILE:
            sb = tl.load(srow + kb * wsk)
        else:
            sb = tl.load(srow + kb * wsk, mask=nmask, other=0.0)
        return sb

    @triton.jit
    def _tile_dot(a, w, SWAP: tl.constexpr):
        """Fresh fp32 partial of one 128-K block: [BN, BM] with SWAP (weights first), else [BM, BN]."""
        if SWAP:
            blk = tl.dot(w, tl.trans(a))
        else:
            blk = tl.dot(a, tl.trans(w))
        return blk

    @triton.jit
    def _fp8_block(a, wrow, srow, nmask, k0, WD, wr0, wsk, SWAP: tl.constexpr, USE_ASM: tl.constexpr,
                   BN: tl.constexpr, PREDEC: tl.constexpr, SB_TILE: tl.constexpr):
        """(fresh fp32 partial of the 128-block at k0: [BN, BM] with SWAP else [BM, BN], fp32 [BN] weight
        factor, or one scalar with SB_TILE). PREDEC 1: wrow / srow address ``predecode``'s e4m3 rows and
        fp32 factors; 2: the same tile through the TMA descriptor WD at row wr0 (all of a tile's rows lie
        inside one expert's weight: N_out and n_half are multiples of BN); 0: wrow / srow address the
        MXFP4 bytes and e8m0 scales, decoded here. ``wsk``: the predecoded factors' 128-block stride.
        SB_TILE (PREDEC 2): srow is the scalar address of the tile's factors (``predecode(tile=True)``)."""
        if PREDEC == 2:
            w = WD.load([wr0, k0])
            sb = _wfactor(srow, nmask, k0 // 128, wsk, SB_TILE)
        elif PREDEC == 1:
            kc = tl.arange(0, 128)
            w = tl.load(wrow[:, None] + k0 + kc[None, :], mask=nmask[:, None], other=0)
            w = w.to(tl.float8e4nv, bitcast=True)
            sb = _wfactor(srow, nmask, k0 // 128, wsk, False)
        else:
            w, sb = _fp8_decode(wrow, srow, nmask, k0, USE_ASM, BN)
        return _tile_dot(a, w, SWAP), sb

    @triton.jit
    def _promo(sa, sb, SWAP: tl.constexpr, SB_TILE: tl.constexpr):
        """Promotion factor of a K block's partial: sa [BM] x sb ([BN], or a scalar with SB_TILE), laid out
        as the partial ([BN, BM] with SWAP, else [BM, BN]; a broadcast column / row for a scalar sb)."""
        if SB_TILE:
            if SWAP:
                f = (sa * sb)[None, :]
            else:
                f = (sa * sb)[:, None]
        elif SWAP:
            f = sb[:, None] * sa[None, :]
        else:
            f = sa[:, None] * sb[None, :]
        return f

    @triton.jit(do_not_specialize=['M'])
    def _fp4_fp8_kernel(A, SA, W, WS, WS2, C, CS, PERM, OFFS, TCUM, PW,
                        M, N_out, K, n_half, n_groups, top_k,
                        stride_am, stride_sam, stride_we, stride_wn, stride_wse, stride_wsn,
                        stride_w2e, stride_cm, stride_csm, limit, stride_sak, stride_wsk,
                        GROUPED: tl.constexpr, GATHER: tl.constexpr, SWIGLU: tl.constexpr, HAS_PW: tl.constexpr,
                        USE_ASM: tl.constexpr, SWAP: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, LOG2G: tl.constexpr, PREDEC: tl.constexpr, ATMA: tl.constexpr,
                        SB_TILE: tl.constexpr, HOST_TMA: tl.constexpr, PREFETCH: tl.constexpr,
                        INTERP: tl.constexpr):
        """A: e4m3 bytes [rows, K]; W uint8 [G, N, K/2]; WS e8m0 bytes [G, N, K/32]; with PREDEC W e4m3
        [G, N, K] (bytes for 1, float8 for 2: TMA) and WS fp32 [G, N, K/128] (``predecode``). WS2 unused:
        the launcher signature of ``fp4_prefill``. One program = one [BM, BN] output tile; program ids
        walk the column blocks of an m-tile first. ATMA (rows not gathered: A's row r is output row r): the
        activation tiles through one TMA descriptor over A's M rows (rows past the tile's expert belong to
        the next one or lie past M, read as zeros: their outputs are masked). stride_sak / stride_wsk: the
        128-block strides of SA and of the predecoded factors (1 in the row-major layouts; a transposed
        layout makes a tile's scales of one block contiguous). SB_TILE (PREDEC 2, BN <= 128): WS holds one
        factor per 128 x 128 weight tile, fp32 [G, N/128, K/128]: the promotion multiplies by one scalar
        per K block, as ``fp8_prefill``'s does. HOST_TMA: the TMA operands (W with PREDEC 2, A with ATMA)
        arrive as host-built descriptors (W's over all experts' rows [G N, K], block [BN, 128]; A's over
        [M, K], block [BM, 128]) instead of being built here per program. PREFETCH (PREDEC 2): the scale
        operands of K block k+1 are loaded while block k runs (loop-carried registers), so that the factor
        product sa * sb, which the compiler may schedule ahead of the block's wgmma, never waits on a global
        load there (sm_90 SASS without it: the load issued after the stage's barrier, its product right
        before the wgmma)."""
        pdl_wait()
        pid = tl.program_id(0)
        num_n = tl.cdiv(N_out, BN)
        t = pid // num_n
        pid_n = pid - t * num_n
        live, r64, mrow, pair, arow, rn64, nmask, e64 = tile(TCUM, OFFS, PERM, M, N_out, t, pid_n,
                                                              n_groups, top_k, BM, BN, LOG2G, GROUPED, GATHER)
        if not live:
            return
        n_rows = stride_we // stride_wn                          # weight rows per expert
        wr0 = (e64 * n_rows + pid_n * BN).to(tl.int32)
        if SB_TILE:
            srow = WS + e64 * stride_wse + ((pid_n * BN) // 128) * stride_wsn
            srow2 = WS + e64 * stride_wse + ((pid_n * BN + n_half) // 128) * stride_wsn
        else:
            srow = WS + e64 * stride_wse + rn64 * stride_wsn
            srow2 = srow + n_half * stride_wsn
        if PREDEC == 2:
            if HOST_TMA:
                WD = W
            else:
                WD = tl.make_tensor_descriptor(W, shape=[n_groups * n_rows, K], strides=[stride_wn, 1],
                                               block_shape=[BN, 128])
            wrow = srow                                           # unused: the tiles come through WD
            wrow2 = srow2
        else:
            WD = W
            wrow = W + e64 * stride_we + rn64 * stride_wn
            wrow2 = wrow + n_half * stride_wn
        if ATMA:
            if HOST_TMA:
                AD = A
            else:
                AD = tl.make_tensor_descriptor(A, shape=[M, K], strides=[stride_am, 1], block_shape=[BM, 128])
            _e, am0, _m_end, _live = tile_rows(TCUM, OFFS, M, t, n_groups, BM, LOG2G, GROUPED)
            arow_p = SA                                           # unused: the tiles come through AD
        else:
            arow_p = A + arow * stride_am
        sarow = SA + arow * stride_sam
        kc = tl.arange(0, 128)
        if SWAP:
            acc = tl.zeros([BN, BM], tl.float32)
            acc2 = tl.zeros([BN, BM], tl.float32)
        else:
            acc = tl.zeros([BM, BN], tl.float32)
            acc2 = tl.zeros([BM, BN], tl.float32)
        if PREFETCH:
            sa_n = tl.load(sarow, mask=mrow, other=0.0)
            sb_n = _wfactor(srow, nmask, 0, stride_wsk, SB_TILE)
            sb2_n = _wfactor(srow2, nmask, 0, stride_wsk, SB_TILE)
            kb_last = K // 128 - 1
            for k0 in range(0, K, 128):
                sa = sa_n
                sb = sb_n
                sb2 = sb2_n
                kn = tl.minimum(k0 // 128 + 1, kb_last)        # the last block reloads itself (unused)
                sa_n = tl.load(sarow + kn * stride_sak, mask=mrow, other=0.0)
                sb_n = _wfactor(srow, nmask, kn, stride_wsk, SB_TILE)
                if SWIGLU:
                    sb2_n = _wfactor(srow2, nmask, kn, stride_wsk, SB_TILE)
                if ATMA:
                    a = AD.load([am0.to(tl.int32), k0])
                else:
                    a = tl.load(arow_p[:, None] + k0 + kc[None, :], mask=mrow[:, None], other=0)
                    a = a.to(tl.float8e4nv, bitcast=True)
                acc += _tile_dot(a, WD.load([wr0, k0]), SWAP) * _promo(sa, sb, SWAP, SB_TILE)
                if SWIGLU:
                    acc2 += _tile_dot(a, WD.load([wr0 + n_half, k0]), SWAP) * _promo(sa, sb2, SWAP, SB_TILE)
        else:
            for k0 in range(0, K, 128):
                sa = tl.load(sarow + (k0 // 128) * stride_sak, mask=mrow, other=0.0)
                if ATMA:
                    a = AD.load([am0.to(tl.int32), k0])
                else:
                    a = tl.load(arow_p[:, None] + k0 + kc[None, :], mask=mrow[:, None], other=0)
                    a = a.to(tl.float8e4nv, bitcast=True)
                blk, sb = _fp8_block(a, wrow, srow, nmask, k0, WD, wr0, stride_wsk, SWAP, USE_ASM, BN, PREDEC,
                                     SB_TILE)
                acc += blk * _promo(sa, sb, SWAP, SB_TILE)         # official per-128 promotion
                if SWIGLU:                                         # w3 rows of the same columns
                    blk2, sb2 = _fp8_block(a, wrow2, srow2, nmask, k0, WD, wr0 + n_half, stride_wsk, SWAP, USE_ASM,
                                           BN, PREDEC, SB_TILE)
                    acc2 += blk2 * _promo(sa, sb2, SWAP, SB_TILE)
        if SWAP:
            acc = tl.trans(acc)
            acc2 = tl.trans(acc2)
        if SWIGLU:
            if HAS_PW:
                pw = tl.load(PW + pair, mask=mrow, other=0.0)
            else:
                pw = tl.zeros([BM], tl.float32)
            h = swiglu_h(acc, acc2, pw, limit, HAS_PW)
            q, eh = quant_rows(h, INTERP)
            tl.store(C + r64[:, None] * stride_cm + rn64[None, :], q.to(tl.uint8, bitcast=True), mask=mrow[:, None])
            tl.store(CS + r64 * stride_csm + pid_n, exp2i(eh), mask=mrow)
        else:
            store_bf16(C + r64[:, None] * stride_cm + rn64[None, :], acc, mrow[:, None] & nmask[None, :], INTERP)


    @triton.jit(do_not_specialize=["N", "KB"])
    def _predecode_kernel(W, WS, W8, SB, SMX, N, KB, stride_we, stride_wn, stride_wse, stride_wsn,
                          stride_8e, stride_8n, stride_sbe, stride_sbn, stride_sbk, stride_xe, stride_xn,
                          BN: tl.constexpr, KU: tl.constexpr, USE_ASM: tl.constexpr, TILE_MAX: tl.constexpr):
        """Grid (experts, row blocks of BN): every 128-block of rows n0 .. n0+BN of one expert, W8 = the
        e4m3 bytes ``_fp8_decode`` forms in registers, SB = their fp32 factors 2^(s_max - 133). KU
        128-blocks per step (KB % KU == 0): one load of 64 KU packed bytes and 4 KU scales per row,
        so each row streams longer contiguous runs. TILE_MAX: s_max is the maximum over the 128 x 128 weight
        tile, read from SMX ([G, N/128, KB] scale bytes), not the row's, and SB holds one factor per tile
        ([G, N/128, KB], written by the tile's first row)."""
        pdl_wait()
        e = tl.program_id(0).to(tl.int64)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = rn < N
        rn64 = rn.to(tl.int64)
        wrow = W + e * stride_we + rn64 * stride_wn
        srow = WS + e * stride_wse + rn64 * stride_wsn
        orow = W8 + e * stride_8e + rn64 * stride_8n
        if TILE_MAX:
            sbrow = SB + e * stride_sbe + (rn64 // 128) * stride_sbn
            sbmask = nmask & (rn % 128 == 0)
        else:
            sbrow = SB + e * stride_sbe + rn64 * stride_sbn
            sbmask = nmask
        jg = tl.arange(0, 4 * KU)
        jb = tl.arange(0, 64 * KU)
        kc = tl.arange(0, 128 * KU)
        ku = tl.arange(0, KU)
        for kb in range(0, KB, KU):
            sg = tl.load(srow[:, None] + kb * 4 + jg[None, :], mask=nmask[:, None], other=0).to(tl.int32)
            if TILE_MAX:
                smax = tl.load(SMX + e * stride_xe + (rn64 // 128)[:, None] * stride_xn + kb + ku[None, :],
                               mask=nmask[:, None], other=0).to(tl.int32)
            else:
                smax = tl.max(tl.reshape(sg, [BN, KU, 4]), axis=2)                  # [BN, KU]
            shift = sg - tl.reshape(tl.broadcast_to(smax[:, :, None], [BN, KU, 4]), [BN, 4 * KU]) + 12
            b = tl.load(wrow[:, None] + kb * 64 + jb[None, :], mask=nmask[:, None], other=0)
            w = _fp8_weight_tile(b, shift, USE_ASM, BN, 4 * KU)
            tl.store(orow[:, None] + kb * 128 + kc[None, :], w.to(tl.uint8, bitcast=True), mask=nmask[:, None])
            sb = ((smax + 6) << 23).to(tl.float32, bitcast=True) * (1.0 / 4096.0)      # 2^(smax - 133)
            tl.store(sbrow[:, None] + (kb + ku[None, :]) * stride_sbk, sb, mask=sbmask[:, None])


# -------------------------------------------------------------------------------------------------
# host side

def tile_max(ws: torch.Tensor) -> torch.Tensor:
    """Largest e8m0 scale byte of every 128 x 128 tile of MXFP4 scales ``ws`` [G, N, K/32] (N % 128 == 0)
    -> uint8 [G, N/128, K/128]."""
    G, N, KG = ws.shape
    return u8(ws).reshape(G, N // QBLOCK, QBLOCK, KG // 4, 4).amax(dim=(2, 4))


def wide_spread(ws: torch.Tensor, tile: bool = False) -> bool:
    """Whether an MXFP4 scale tensor [..., K/32] has a group whose scale lies 2^FLUSH_SPREAD or more below
    its row's 128-block maximum (the groups this kernel flushes; module doc); ``tile``: below the maximum
    of its 128 x 128 weight tile (``predecode(..., tile=True)``'s reference; True where the rows do not
    form whole tiles). Synchronises: call at weight-load time."""
    s = u8(ws)
    if tile:
        if s.dim() < 2 or s.shape[-2] % QBLOCK:
            return True
        s = s.reshape(-1, *s.shape[-2:])
        G, N, KG = s.shape
        tmax = tile_max(s)[:, :, None, :, None]
        return bool(((tmax - s.reshape(G, N // QBLOCK, QBLOCK, KG // 4, 4)) >= FLUSH_SPREAD).any())
    s = s.view(*ws.shape[:-1], ws.shape[-1] // 4, 4)
    return bool(((s.amax(-1, keepdim=True) - s) >= FLUSH_SPREAD).any())


def predecode(w: torch.Tensor, ws: torch.Tensor, use_asm: bool | None = None,
              config: dict | None = None, tile: bool = False,
              tile_smax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 expert weights ``w`` uint8 [G, N, K/2] with e8m0 scales ``ws`` [G, N, K/32] -> (e4m3 bytes
    [G, N, K], fp32 factors [G, N, K/128]): per 128-block and row the bytes and factor this module's
    kernel forms in registers (module doc: exact, groups 2^12 below their block maximum flushed), so
    that ``fp4_fp8_launch(..., predecoded=True)`` on them gives the same bits as on ``w``, ``ws``.
    Costs a pass over the weights (read 0.53 byte, write 1.03 bytes per weight) and 2x their bytes of
    memory: a prefill chunk with enough rows per expert that FP8 tensor cores on plain e4m3 tiles
    repay it. ``config`` overrides ``route.predecode_config`` (BN, KU, num_warps). ``tile`` (N % 128 == 0):
    the fold is relative to
    the largest scale of each 128 x 128 weight tile instead of each row's block, and the factors are one
    per tile, fp32 [G, N/128, K/128] (exact where ``wide_spread(ws, tile=True)`` is False; a GEMM then
    promotes with one scalar per tile and K block, as for a 128 x 128-block-scaled FP8 weight; every
    row's bytes and factor differ from the row fold's by one power of two, so the products are the same).
    ``tile_smax``: ``tile_max(ws)`` computed beforehand (the MoE layer keeps it with the weights)."""
    w, ws = u8(w), u8(ws)
    if w.dim() == 2:
        w, ws = w[None], ws[None]
    G, N, K2 = w.shape
    K = 2 * K2
    if K % QBLOCK or tuple(ws.shape) != (G, N, K // 32):
        raise ValueError(f"predecode: expected w [G, N, K/2] (K % 128 == 0) and ws [G, N, K/32], got "
                         f"{tuple(w.shape)} and {tuple(ws.shape)}")
    if tile and N % QBLOCK:
        raise ValueError(f"predecode: tile factors need whole 128-row tiles, got {N} rows")
    w8 = torch.empty(G, N, K, dtype=torch.uint8, device=w.device)
    smx = None
    if tile:
        smx = tile_max(ws) if tile_smax is None else u8(tile_smax)   # uint8 [G, N/128, K/128]
        if tuple(smx.shape) != (G, N // QBLOCK, K // QBLOCK) or not smx.is_contiguous():
            raise ValueError(f"predecode: tile_smax must be contiguous [{G}, {N // QBLOCK}, {K // QBLOCK}], got "
                             f"{tuple(smx.shape)}")
        sb = torch.empty(G, N // QBLOCK, K // QBLOCK, dtype=torch.float32, device=w.device)
    else:
        sb = torch.empty(G, N, K // QBLOCK, dtype=torch.float32, device=w.device)
    if G and N:
        t = target(w.device)
        cfg = dict(route.predecode_config(t), **(config or {}))
        BN, KU = cfg["BN"], cfg["KU"]
        while (K // QBLOCK) % KU:
            KU //= 2
        kw = {} if interpreting() else {"num_warps": cfg.get("num_warps", 4)}
        _predecode_kernel[(G, triton.cdiv(N, BN))](
            w, ws, w8, sb, smx if tile else ws, N, K // QBLOCK, w.stride(0), w.stride(1), ws.stride(0),
            ws.stride(1), w8.stride(0), w8.stride(1), sb.stride(0), sb.stride(1), sb.stride(2),
            smx.stride(0) if tile else 0, smx.stride(1) if tile else 0, BN=BN, KU=KU,
            USE_ASM=t.use_asm if use_asm is None else use_asm, TILE_MAX=tile, **kw, **PDL_LAUNCH)
    return w8, sb


def fp4_fp8_launch(a, sa, w, ws, ws2, out, out_s, M, N_out, K, n_half, *, fmt, swiglu=False, limit=0.0,
                   perm=None, offs=None, tcum=None, pw=None, top_k=1, n_groups=1, n_tiles=None, config=None,
                   use_asm=None, predecoded=False):
    """``fp4_prefill.fp4_prefill_launch``'s arguments and outputs, MXFP4 only, with ``a`` the e4m3
    activations [rows, K] (bytes or float8_e4m3fn; GEMM 2 takes GEMM 1's h as it is). ``config``: BM, BN
    (128 with ``swiglu``), num_warps, num_stages, SWAP (default ``route.fp4_fp8_config``).
    ``predecoded``: ``w``, ``ws`` are ``predecode``'s e4m3 bytes and fp32 factors (the same products:
    the same bits); ``config['WTMA']`` then loads the weight tiles with TMA (a device-side descriptor
    over all experts' rows) instead of pointer loads. ``config['ATMA']``: the activation tiles by TMA too;
    the rows must be in output order (``perm`` None: GEMM 2's h, or GEMM 1's x gathered beforehand)."""
    if fmt != "mxfp4":
        raise ValueError(f"fp4_fp8: only mxfp4 weights fold exactly into e4m3, got {fmt!r}")
    if predecoded and (u8(w).shape[-1] != K or ws.dtype != torch.float32):
        raise ValueError(f"fp4_fp8: predecoded weights are e4m3 [.., N, {K}] with fp32 factors, got "
                         f"{tuple(w.shape)} {w.dtype} and {ws.dtype}")
    # predecode(tile=True)'s factors: one per 128 x 128 weight tile
    sb_tile = predecoded and ws.shape[-2] != w.shape[-2]
    if sb_tile and (ws.shape[-2] * QBLOCK != w.shape[-2] or ws.shape[-1] != K // QBLOCK):
        raise ValueError(f"fp4_fp8: predecoded factors must be per row [.., N, K/128] or per 128 x 128 tile "
                         f"[.., N/128, K/128], got {tuple(ws.shape)} for weights {tuple(w.shape)}")
    if K % QBLOCK:
        raise ValueError(f"fp4_fp8: K={K} must be a multiple of 128")
    if a.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise ValueError(f"fp4_fp8: the activation operand must be e4m3 bytes, got {a.dtype}")
    dev = a.device
    t = target(dev)
    cfg = route.fp4_fp8_config(M / max(1, n_groups), t, swiglu)
    if config:
        cfg.update(config)
    if swiglu:
        cfg["BN"] = QBLOCK
    BM, BN, swap = cfg.pop("BM"), cfg.pop("BN"), bool(cfg.pop("SWAP", True))
    wtma = bool(cfg.pop("WTMA", False)) and predecoded
    atma = bool(cfg.pop("ATMA", False))
    if atma and perm is not None:
        raise ValueError("fp4_fp8: TMA activation tiles (ATMA) need the rows in output order: gather them first "
                         "(perm=None, pw per sorted row)")
    if wtma and (N_out % BN or n_half % BN):
        raise ValueError(f"fp4_fp8: TMA weight tiles need N_out ({N_out}) and n_half ({n_half}) to be "
                         f"multiples of BN ({BN})")
    if sb_tile and not (wtma and QBLOCK % BN == 0):
        raise ValueError(f"fp4_fp8: per-tile weight factors need TMA weight tiles (WTMA) of at most 128 "
                         f"columns dividing 128, got BN={BN}, WTMA={wtma}")
    kw = {} if interpreting() else {k: v for k, v in cfg.items() if k in ("num_warps", "num_stages")}
    grouped = tcum is not None
    if grouped:
        grid_m = n_tiles if n_tiles is not None else min(M, triton.cdiv(M, BM) + min(n_groups, M))
    else:
        grid_m = triton.cdiv(M, BM)
    grid = (max(grid_m, 1) * triton.cdiv(N_out, BN),)
    if use_asm is None:
        use_asm = t.use_asm
    host_tma = bool(cfg.pop("HOST_TMA", False)) and (wtma or atma)
    prefetch = bool(cfg.pop("PREFETCH", False)) and wtma
    if (wtma or atma) and not host_tma:
        ensure_tma_allocator(dev)
    if wtma:
        w = u8(w).view(torch.float8_e4m3fn)
    a = u8(a).view(torch.float8_e4m3fn) if atma else u8(a)
    args = list(fp4_kernel_args(a, sa, w if wtma else u8(w), ws if predecoded else u8(ws), ws2, out, out_s, perm,
                                offs, tcum, pw, M, N_out, K, n_half, n_groups, top_k, limit))
    if host_tma:      # the same boxes the kernel would build (W: all experts' rows as one [G N, K] matrix)
        from triton.tools.tensor_descriptor import TensorDescriptor
        if atma:
            args[0] = TensorDescriptor.from_tensor(a[:M], [BM, QBLOCK])
        if wtma:
            if not w.is_contiguous():
                raise ValueError("fp4_fp8: host TMA weight tiles need the predecoded weights contiguous")
            args[2] = TensorDescriptor.from_tensor(w.view(-1, K), [BN, QBLOCK])
    _fp4_fp8_kernel[grid](
        *args,
        sa.stride(1), ws.stride(-1) if predecoded else 1,
        GROUPED=grouped, GATHER=perm is not None, SWIGLU=swiglu, HAS_PW=pw is not None, USE_ASM=use_asm,
        SWAP=swap, BM=BM, BN=BN, LOG2G=log2_groups(n_groups), PREDEC=(2 if wtma else 1) if predecoded else 0,
        ATMA=atma, SB_TILE=sb_tile, HOST_TMA=host_tma, PREFETCH=prefetch,
        INTERP=interpreting(), **kw, **PDL_LAUNCH)


__all__ = ["FLUSH_SPREAD", "fp4_fp8_launch", "predecode", "tile_max", "wide_spread"]
