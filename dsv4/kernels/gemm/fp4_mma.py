"""Decode-sized FP4 expert GEMM on tensor cores, weights loaded straight into the mma operand (Gluon).

The CUDA-core GEMV of ``gemv.py`` spends ~6 SASS instructions per weight element (decode, f16->f32,
an FMA per row) and reached 28-46% of the H200's copy bandwidth on the V4 expert shapes. Here the
products run on ``mma.sync`` m16n8k16 (f16 in, fp32 accumulate): output features are the M side,
up to BM = 8 activation rows the N side, so one pass over an expert's weights serves every row that
routes to it (the GEMV re-read them per 1-4-row tile).

Operand layouts (``DotOperandLayout(k_width=16)``): per 128-K block, a thread holds 16 contiguous
packed bytes of each of its rows = one MXFP4 scale group (two NVFP4 groups). They are loaded and decoded inside one
inline-asm block (``_w_load_decode``: a 16-byte load, ``lib.e2m1_f16``'s e4m3 placement, e4m3x2 ->
f16x2; a Triton uint8 load would unpack the bytes and repack them for the asm). The dot sums over K,
so only A and B must agree on its order: logical K index j of the weight operand is physical K 2j
(low nibbles, ``wl``) or 2j + 1 (high nibbles, ``wh``), and the activation operand takes the even /
odd e4m3 bytes of the same 32-byte span (``_act_even_odd``), so a 128-K block is two mma chains.

Scales (official structure: exact e2m1 x e4m3 products, group scale 2^(sB-127), block scale sA):
one mma k-step mixes four groups (one per lane quad), so the group scales are applied to the f16
weights first, relative to the block's largest: w = e2m1 * 2^-6 * 2^(15 - d), d = smax - sB, exact
for d <= 32 (a spread of 2^32 between the four group scales of one row's 128-K block; beyond that the
smaller groups' values round at 2^-33 of the largest group's scale). The fp32 block sum is then scaled
by 2^(smax - 136) * sA and accumulated. NVFP4 (16-value groups, e4m3 scales, fp32 per-row global
scale): w = e2m1 * 2^-6 * s_e4m3 is always exact in f16 (at most 6 significant bits, >= 2^-16), the
block sum is scaled by 2^6 * sA, the final sum by the global scale (``gemv.py`` sums each group before
its scale; here the exact scaled products are summed). Products are exact, sums are fp32 in
tensor-core order.

Gluon has no CPU interpreter: CPU CI compiles this kernel for sm_90 and sm_100; the GPU tests run it
against the dequantised reference. Needs sm_89+ (e4m3 -> f16 conversion).

H200 measurements: docs/kernel-measurements.md, BENCHMARKS.md.
"""
from __future__ import annotations

import torch

from ..lib import QBLOCK, asm_text, gluon_available, pdl_launch, target
from . import route
from .common import launch_plan, log2_groups, sum_splits

GLUON = gluon_available()
if GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    from ..lib import pdl_wait, tile_rows

BM_ROWS = 8            # activation rows per tile: the n side of one m16n8k16 mma
# grouped launches find their tile's expert with ``_tile_rows_vec`` (one vector load of the tile counts) instead of
# ``lib.tile_rows``' binary search (LOG2G + 3 dependent loads, ~2 us after the PDL wait): the same tiles, so the
# same bits; H100, decode step at batch 1 -1.3% (every layer 1.2-2.7 us faster), batch 64 within the spread
# (docs/benchmarks-2026-12-07.md, "MoE decode: two latency chains shortened"). False: the search
# (``decode_step.py --moe-tiles``)
VEC_TILES = True
BAND_ROWS = 16         # rows of one band in the band layout: one warp's 16 mma rows


if GLUON:
    # e2m1 nibbles -> e4m3 bytes (value * 2^-6, exact), 4 at a time: ``lib.e2m1_f16``'s placement
    _E2M1_LO = "and.b32 t, {w}, 0x08080808; shl.b32 t, t, 4; and.b32 u, {w}, 0x07070707; shl.b32 u, u, 2; or.b32 t, t, u;"
    _E2M1_HI = "and.b32 t, {w}, 0x80808080; shr.b32 u, {w}, 2; and.b32 u, u, 0x1C1C1C1C; or.b32 t, t, u;"
    # one 16-byte weight load: 4 raw words $0-$3 from 16 pointers $4-$19 (only $4 is used)
    _W_LOAD_ASM = gl.constexpr("ld.global.nc.L2::128B.v4.b32 {$0, $1, $2, $3}, [$4];")
    _W_LOAD_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 4 + ["l"] * 16))
    # outputs $0-$7 (low nibbles / even K) and $8-$15 (high nibbles / odd K), the 4 raw words $16-$19,
    # the 8 f16x2 multiplier registers $20-$27
    _W_DECODE_ASM = gl.constexpr(asm_text(
        [".reg .b32 t, u; .reg .b16 l, h;"]
        + [line for j in range(4) for o, place in ((0, _E2M1_LO), (8, _E2M1_HI)) for line in (
            place.format(w=f"${16 + j}"),
            f"mov.b32 {{l, h}}, t; cvt.rn.f16x2.e4m3x2 ${o + 2 * j}, l; cvt.rn.f16x2.e4m3x2 ${o + 2 * j + 1}, h;",
            f"mul.rn.f16x2 ${o + 2 * j}, ${o + 2 * j}, ${20 + 2 * j}; "
            f"mul.rn.f16x2 ${o + 2 * j + 1}, ${o + 2 * j + 1}, ${21 + 2 * j};")]))
    _W_DECODE_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 16 + ["r"] * 4 + ["r"] * 8))
    _BAND = gl.constexpr(BAND_ROWS)
    # 32 activation bytes -> even bytes (e) and odd bytes (o) of each word pair -> f16x2
    _ACT_ASM = gl.constexpr(asm_text(
        [".reg .b32 w0, w1, w2, w3, w4, w5, w6, w7, e, o; .reg .b16 l, h;",
         "ld.global.v4.b32 {w0, w1, w2, w3}, [$16];",
         "ld.global.v4.b32 {w4, w5, w6, w7}, [$16+16];"]
        + [line for j in range(4) for line in (
            f"prmt.b32 e, w{2 * j}, w{2 * j + 1}, 0x6420; prmt.b32 o, w{2 * j}, w{2 * j + 1}, 0x7531;",
            f"mov.b32 {{l, h}}, e; cvt.rn.f16x2.e4m3x2 ${2 * j}, l; cvt.rn.f16x2.e4m3x2 ${2 * j + 1}, h;",
            f"mov.b32 {{l, h}}, o; cvt.rn.f16x2.e4m3x2 ${8 + 2 * j}, l; cvt.rn.f16x2.e4m3x2 ${9 + 2 * j}, h;")]))
    _ACT_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 16 + ["l"] * 16))

    @gluon.jit
    def _act_even_odd(p):
        """16 consecutive logical K of one activation row (p: their pointers; p[0] addresses 32
        contiguous e4m3 bytes) -> (even-K values, odd-K values) as f16, exact: two 16-byte loads,
        byte shuffles, e4m3x2 -> f16x2 conversions."""
        return gl.inline_asm_elementwise(_ACT_ASM, _ACT_CONSTRAINTS, [p], dtype=(gl.float16, gl.float16),
                                         is_pure=True, pack=16)

    @gluon.jit
    def _w_load(p):
        """16 consecutive weight bytes of one row (p: their pointers; p[0] is 16-byte aligned), raw: one
        16-byte load in asm, which keeps the bytes packed in 4 registers (a Triton uint8 load unpacks
        and repacks them). ``.nc.L2::128B`` (read-only path; L2 fetches the whole 128-byte line, i.e.
        the row's next K block too) took the H200 from 49-59% to 56-71% of copy bandwidth."""
        return gl.inline_asm_elementwise(_W_LOAD_ASM, _W_LOAD_CONSTRAINTS, [p], dtype=gl.uint8, is_pure=True,
                                         pack=16)

    @gluon.jit
    def _w_decode(raw, mul):
        """16 raw weight bytes -> (low nibbles, high nibbles) as f16 = e2m1 * 2^-6 * mul (exact while
        representable): ``lib.e2m1_f16``'s e4m3 placement, e4m3x2 -> f16x2, f16x2 multiplies."""
        return gl.inline_asm_elementwise(_W_DECODE_ASM, _W_DECODE_CONSTRAINTS, [raw, mul],
                                         dtype=(gl.float16, gl.float16), is_pure=True, pack=16)

    @gluon.jit
    def _kload(kb, wptr, srow, amask, NV: gl.constexpr, KBW: gl.constexpr, KBS: gl.constexpr):
        """The global loads of the 128-K block kb's weights: (raw weight bytes, group-scale words a, b);
        b is NVFP4's second word (MXFP4's four scales fit in a)."""
        raw = _w_load((wptr + kb * KBW).to(gl.int64))
        swa = gl.load((srow + kb * KBS).to(gl.pointer_type(gl.int32)), mask=amask, other=0)
        swb = swa
        if NV:
            swb = gl.load((srow + kb * KBS + 4).to(gl.pointer_type(gl.int32)), mask=amask, other=0)
        return raw, swa, swb

    @gluon.jit
    def _kblock(kb, acc, zero, raw, swa, swb, jb, aptr, saptr, mma: gl.constexpr, NV: gl.constexpr,
                A16: gl.constexpr):
        """acc + the 128-K block kb from its loaded weights (``_kload``): group scales, weight decode,
        activation, two mma chains (even / odd K), the block factor (MXFP4: 2^(smax - 136) * sA;
        NVFP4: 2^6 * sA)."""
        if NV:   # 8 e4m3 group scales (16 values each) per row and block: exact in the f16 weights
            grp = jb // 8
            sel = gl.where(grp[None, :] < 4, swa[:, None], swb[:, None])
            sg = (sel >> ((grp[None, :] % 4) * 8)) & 0xFF
            mul = sg.to(gl.uint8).to(gl.float8e4nv, bitcast=True).to(gl.float16)
            smax = swa
        else:    # 4 e8m0 group scales (32 values each) per row and block
            s0 = swa & 0xFF
            s1 = (swa >> 8) & 0xFF
            s2 = (swa >> 16) & 0xFF
            s3 = (swa >> 24) & 0xFF
            smax = gl.maximum(gl.maximum(s0, s1), gl.maximum(s2, s3))
            grp = jb // 16
            sg = gl.where(grp[None, :] == 0, s0[:, None],
                          gl.where(grp[None, :] == 1, s1[:, None],
                                   gl.where(grp[None, :] == 2, s2[:, None], s3[:, None])))
            # 2^(15 - (smax - s_g)) as f16 (an fp32 power of two, one exact conversion, subnormal included)
            mul = (gl.maximum(sg - smax[:, None] + 142, 1) << 23).to(gl.float32, bitcast=True).to(gl.float16)
        wl, wh = _w_decode(raw, mul)
        if A16:   # f16 activation, even / odd K of each 32-K span stored apart (``act_f16_split``)
            ae = gl.load(aptr + kb * 128)
            ao = gl.load(aptr + kb * 128 + 16)
        else:
            ae, ao = _act_even_odd(aptr + kb * 128)
        part = mma_v2(wl, ae, zero)
        part = mma_v2(wh, ao, part)
        sa = gl.load(saptr + kb)
        if NV:   # value * 2^-6 (decode) * s_e4m3 (mul); the global scale multiplies the final sum
            return acc + part * (sa[None, :] * 64.0)
        else:
            # value * 2^-6 (decode) * 2^(15 - d) (mul) -> * 2^(smax - 136) = 2^(smax - 63) * 2^-73
            # (two normal powers of two: exact for every scale byte)
            rs = ((smax + 64) << 23).to(gl.float32, bitcast=True)
            rs = gl.convert_layout(rs, gl.SliceLayout(1, mma))
            return acc + part * ((rs[:, None] * sa[None, :]) * 1.0587911840678754e-22)

    @gluon.jit
    def _act_rows(PERM, r, m_end, top_k, GATHER: gl.constexpr):
        """Sorted rows r of a tile -> (activation rows int64: the pair's token with GATHER, row 0 past
        the tile's end; valid mask)."""
        v = r < m_end
        if GATHER:
            return gl.load(PERM + r, mask=v, other=0).to(gl.int64) // top_k, v
        return gl.where(v, r, 0).to(gl.int64), v

    @gluon.constexpr_function
    def _vec_layout(ep, num_warps):
        return gl.BlockedLayout([max(ep // (32 * num_warps), 1)], [32], [num_warps], [0])

    @gluon.jit
    def _tile_rows_vec(TCUM, OFFS, t, n_groups, BM: gl.constexpr, LOG2G: gl.constexpr, NUM_WARPS: gl.constexpr):
        """``lib.tile_rows``'s grouped result (expert, first row, end row, live) in two round trips instead of
        the binary search's LOG2G + 3 dependent ones: all of TCUM[1..n] in one vector load, the expert as the
        count of tile ends <= t (TCUM is non-decreasing), then its three scalars side by side."""
        EP: gl.constexpr = 1 << LOG2G                  # >= n_groups + 1
        j = gl.arange(0, EP, layout=_vec_layout(EP, NUM_WARPS))
        jm = j < n_groups
        tc = gl.load(TCUM + 1 + j, mask=jm, other=0)
        e_raw = gl.sum(((tc <= t) & jm).to(gl.int32), axis=0)
        live = e_raw < n_groups                        # t < TCUM[n]: some expert's tile range holds t
        e = gl.minimum(e_raw, n_groups - 1)
        m0 = gl.load(OFFS + e) + (t - gl.load(TCUM + e)) * BM
        m_end = gl.load(OFFS + e + 1)
        return e, m0, m_end, live

    @gluon.jit
    def _mma_gemv_kernel(A, SA, W, WS, WS2, C, PERM, OFFS, TCUM,
                     M, N, K, n_groups, top_k, k_per_split,
                     stride_am, stride_sam, stride_we, stride_wn, stride_wse, stride_wsn, stride_w2e, stride_cm,
                     NV: gl.constexpr, GROUPED: gl.constexpr, GATHER: gl.constexpr, BM: gl.constexpr,
                     BN: gl.constexpr, LOG2G: gl.constexpr, SPLIT: gl.constexpr, NUM_WARPS: gl.constexpr,
                     BAND: gl.constexpr, A16: gl.constexpr, VEC_TILES: gl.constexpr = False):
        """Grouped (MoE) or plain FP4 x FP8 GEMM of BM-row tiles: program (m-tile t, BN columns,
        K split ks). Output fp32 split partials [S, M, N] (SPLIT) or bf16 [M, N]."""
        pdl_wait()
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, 8])
        la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=16)
        lb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=16)
        t = gl.program_id(0)
        pid_n = gl.program_id(1)
        ks = gl.program_id(2)
        if GROUPED and VEC_TILES:
            e, m0, m_end, live = _tile_rows_vec(TCUM, OFFS, t, n_groups, BM, LOG2G, NUM_WARPS)
        else:
            e, m0, m_end, live = tile_rows(TCUM, OFFS, M, t, n_groups, BM, LOG2G, GROUPED)
        if live:
            e64 = e.to(gl.int64)
            rn_a = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, la))
            rn_a64 = rn_a.to(gl.int64)
            amask = rn_a < N
            jb = gl.arange(0, 64, layout=gl.SliceLayout(0, la))
            rw = gl.minimum(rn_a, N - 1).to(gl.int64)
            SB: gl.constexpr = 8 if NV else 4            # scale bytes per row and K block
            KBW: gl.constexpr = _BAND * 64 if BAND else 64
            KBS: gl.constexpr = _BAND * SB if BAND else SB
            if BAND:   # band layout (``band_layout``): [N / 16, K / 128, 16 rows, one block's bytes]
                wptr = W + e64 * stride_we + ((rw // _BAND) * (8 * K) + (rw % _BAND) * 64)[:, None] + jb[None, :]
                srow = WS + e64 * stride_wse + (rn_a64 // _BAND) * (_BAND * SB * (K // 128)) \
                    + (rn_a64 % _BAND) * SB
            else:
                wptr = W + e64 * stride_we + rw[:, None] * stride_wn + jb[None, :]
                srow = WS + e64 * stride_wse + rn_a64 * stride_wsn
            ja = gl.arange(0, 64, layout=gl.SliceLayout(1, lb))
            cb = gl.arange(0, BM, layout=gl.SliceLayout(0, lb))
            arow_b, vb = _act_rows(PERM, m0 + cb, m_end, top_k, GATHER)
            if A16:
                aptr = A + arow_b[None, :] * stride_am + (ja + 16 * (ja // 16))[:, None]
            else:
                aptr = A + arow_b[None, :] * stride_am + 2 * ja[:, None]
            cc = gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
            rc = m0 + cc
            arow_c, vc = _act_rows(PERM, rc, m_end, top_k, GATHER)
            saptr = SA + arow_c * stride_sam
            acc = gl.zeros([BN, BM], gl.float32, layout=mma)
            zero = gl.zeros([BN, BM], gl.float32, layout=mma)
            kb_lo = (ks * k_per_split) // 128
            kb_hi = gl.minimum(K, ks * k_per_split + k_per_split) // 128
            for kb in range(kb_lo, kb_hi):
                raw, swa, swb = _kload(kb, wptr, srow, amask, NV, KBW, KBS)
                acc = _kblock(kb, acc, zero, raw, swa, swb, jb, aptr, saptr, mma, NV, A16)
            rn_c = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
            out_mask = (rn_c < N)[:, None] & vc[None, :]
            if NV:   # the per-row fp32 global scale of NVFP4
                acc = acc * gl.load(WS2 + e64 * stride_w2e + rn_c, mask=rn_c < N, other=0.0)[:, None]
            rn64 = rn_c.to(gl.int64)
            rc64 = rc.to(gl.int64)
            if SPLIT:
                gl.store(C + ks.to(gl.int64) * M * N + rc64[None, :] * N + rn64[:, None], acc, mask=out_mask)
            else:
                gl.store(C + rc64[None, :] * stride_cm + rn64[:, None], acc.to(gl.bfloat16), mask=out_mask)


def band_layout(t: torch.Tensor, per_block: int) -> torch.Tensor:
    """Rows [G, N, K/128 * per_block] (packed FP4 weights: per_block 64; MXFP4 / NVFP4 scale bytes: 4 / 8)
    -> the band layout [G, N/16, K/128, 16, per_block]: each K block of 16 consecutive rows is one
    contiguous run, so a warp's weight load reads 512 contiguous bytes instead of 8 rows x 64 bytes."""
    G, N, C = t.shape
    if N % BAND_ROWS or C % per_block:
        raise ValueError(f"band_layout: rows {N} must be a multiple of {BAND_ROWS} and {C} bytes per row "
                         f"a multiple of {per_block}")
    return t.view(G, N // BAND_ROWS, BAND_ROWS, C // per_block, per_block).permute(0, 1, 3, 2, 4).contiguous()


def act_f16_split(q: torch.Tensor) -> torch.Tensor:
    """e4m3 activation [rows, K] -> the kernel's f16 operand form: each 32-K span's 16 even-K values,
    then its 16 odd-K values (exact: every e4m3 value is an f16). The kernel then loads its operands
    without decoding them (the e4m3 decode costs ~30 ALU instructions per K block and warp)."""
    R, K = q.shape
    if K % 32:
        raise ValueError(f"act_f16_split: K={K} must be a multiple of 32")
    f = q.view(torch.float8_e4m3fn).to(torch.float16).view(R, K // 32, 16, 2)
    return f.transpose(2, 3).reshape(R, K).contiguous()


def mma_gemv_launch(a, sa, w, ws, M, N, K, *, fmt: str = "mxfp4", ws2=None, out=None, partial: bool = False,
                    perm=None, offs=None, tcum=None, top_k: int = 1, n_groups: int = 1, n_tiles: int | None = None,
                    split: int | None = None, config: dict | None = None, split_sum: bool = True):
    """``gemv.gemv_launch`` for FP4 weights on the tensor cores: a e4m3 bytes [rows, K], sa fp32
    [rows, K/128] (power-of-two scales, as ``act_quant_fp8`` writes); w uint8 [G, N, K/2]; ws e8m0
    bytes [G, N, K/32] (mxfp4) or e4m3 bytes [G, N, K/16] with fp32 ws2 [G, N] (nvfp4); or w and ws
    both in ``band_layout``. Grouped tiles
    (``tcum``/``offs`` from ``moe.sort_pairs``) must use ``BM_ROWS``-row tiles. Returns bf16 ``out``
    [M, N] or, with ``partial``, the fp32 split partials [S, M, N]; ``split_sum=False``: the partials
    unsummed where K is split, bf16 [M, N] where it is not (for a consumer that sums them itself)."""
    t = target(w.device)
    if not t.gluon_mma:
        raise RuntimeError("mma_gemv: needs a CUDA GPU of sm_89+ and triton with Gluon")
    if fmt not in ("mxfp4", "nvfp4"):
        raise ValueError(f"mma_gemv: fmt must be 'mxfp4' or 'nvfp4', got {fmt!r}")
    group = 32 if fmt == "mxfp4" else 16
    band = w.dim() == 5
    if band:   # ``band_layout`` weights and scales
        sb = QBLOCK // group
        G = w.shape[0]
        if (K % QBLOCK or N % BAND_ROWS or tuple(w.shape) != (G, N // BAND_ROWS, K // QBLOCK, BAND_ROWS, 64)
                or tuple(ws.shape) != (G, N // BAND_ROWS, K // QBLOCK, BAND_ROWS, sb)
                or not w.is_contiguous() or not ws.is_contiguous()):
            raise ValueError(f"mma_gemv: band-layout w {tuple(w.shape)} / {fmt} scales {tuple(ws.shape)} do not "
                             f"match N={N}, K={K} (want contiguous [G, N/16, K/128, 16, 64] / [.., {sb}])")
    elif K % QBLOCK or w.shape[-1] * 2 != K or ws.shape[-1] * group != K:
        raise ValueError(f"mma_gemv: K={K} must be a multiple of 128 matching w {tuple(w.shape)} and "
                         f"{fmt} scales {tuple(ws.shape)}")
    if fmt == "nvfp4" and (ws2 is None or ws2.dtype != torch.float32 or tuple(ws2.shape) != (w.shape[0], N)):
        raise ValueError(f"mma_gemv: nvfp4 needs fp32 global scales ws2 [{w.shape[0]}, {N}]")
    if a.dtype not in (torch.uint8, torch.float16) or a.shape[-1] != K:
        raise ValueError(f"mma_gemv: a must be e4m3 bytes or act_f16_split f16 [rows, {K}], got {a.dtype} "
                         f"{tuple(a.shape)}")
    # the asm loads 16 bytes (weights, activation) and the scales 4 bytes at a time
    for name, x, al in (("a", a, 16), ("w", w, 16), ("ws", ws, 4)):
        if x.stride(-1) != 1 or x.data_ptr() % al or any(st % al for st in x.stride()[:-1]):
            raise ValueError(f"mma_gemv: {name} must be row-contiguous with {al}-byte aligned rows")
    dev = w.device
    cfg = route.fp4_mma_config()
    if config:
        cfg.update(config)
    BN, nw = cfg["BN"], cfg["num_warps"]
    if BN != 16 * nw:
        raise ValueError(f"mma_gemv: BN must be 16 rows per warp, got BN={BN}, num_warps={nw}")
    grouped = tcum is not None
    # the GEMV's grid and split rule (~4 programs per SM)
    grid, kps, dst = launch_plan(M, N, K, BM_ROWS, BN, grouped=grouped, n_tiles=n_tiles, n_groups=n_groups,
                                 split=split or cfg.get("SPLIT_K"), partial=partial, out=out, dev=dev, t=t)
    nv = fmt == "nvfp4"
    _mma_gemv_kernel[grid](
        a, sa, w, ws, ws2 if nv else sa, dst, perm if perm is not None else sa, offs if offs is not None else sa,
        tcum if tcum is not None else sa, M, N, K, n_groups, top_k, kps,
        a.stride(0), sa.stride(0), w.stride(0), w.stride(1), ws.stride(0), ws.stride(1),
        ws2.stride(0) if nv else 0, dst.stride(-2),
        NV=nv, GROUPED=grouped, GATHER=perm is not None, BM=BM_ROWS, BN=BN,
        LOG2G=log2_groups(n_groups), SPLIT=dst.dtype == torch.float32, NUM_WARPS=nw,
        BAND=band, A16=a.dtype == torch.float16, VEC_TILES=bool(cfg.get("VEC_TILES", VEC_TILES)), num_warps=nw,
        **pdl_launch(grid, t))
    if partial or not split_sum:
        return dst
    return sum_splits(dst, out)


__all__ = ["BAND_ROWS", "BM_ROWS", "GLUON", "act_f16_split", "band_layout", "mma_gemv_launch"]
