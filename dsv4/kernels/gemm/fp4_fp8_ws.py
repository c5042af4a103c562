"""Warp-specialized grouped MXFP4 expert GEMM on FP8 wgmma, the weights decoded inside the kernel (Gluon, sm_90).

The pre-decoded path's expert GEMMs on sm_90 (``moe_forward``, ``router.PREDEC_WS``), replacing its decode
pass (22% of an 8192-token prefill chunk on the H100, BENCHMARKS.md prefill section) and its transient e4m3
copy of the experts: the e4m3 weight tiles are formed in shared memory by a decoder partition while the
consumer warpgroups run the wgmma of earlier stages. Tests: ``tests/test_fp4_fp8_ws.py``; timing:
``experiments/exp_fp4_fp8_ws.py``.

Contract (GEMM 2's form and GEMM 1's unfused form of ``moe_forward``'s ``predec`` path): ``a`` e4m3 [P, K],
the rows sorted by expert (``offs`` [E+1] the expert row offsets), each 32-element group's 16 even elements
first and its 16 odd ones after them (``split_k_order``), ``sa`` fp32 [P, K/128]; the experts' MXFP4 weights
``w`` uint8 [E, N, K/2] (two e2m1 codes per byte, the low nibble the even element), e8m0 scales ``ws`` uint8
[E, N, K/32], and ``tile_smax`` uint8 [E, N/128, K/128] (``fp4_fp8.tile_max``) -> bf16 [P, N]:

    out[r] = sum over 128-blocks kb of (sum_k a8[r, k] * byte[n, k]) * sa[r, kb] * 2^(smax[kb] - 133)

with byte = e4m3(e2m1(code) * 2^(s_g - smax + 6)) (``fp4_fp8``'s per-tile fold, exact where
``wide_spread(ws, tile=True)`` is False; groups 2^12 or more below their tile's maximum are flushed) and
one fresh fp32 partial per 128-block: the products of the pre-decoded path.

Why the group split order: Hopper's FP8 wgmma adds the products of one K = 32 instruction at a precision
relative to their largest (DeepSeek-V3 report: ~14 bits kept), so an instruction's 32 products must come from
one scale group, as they do in the pre-decoded kernel's natural order. An even / odd split of each 128-block (two
K = 64 chains) mixes two groups per instruction, whose folded bytes can differ by 2^k, and the smaller group's
products lose bits (H100: 64 of 156,672 outputs off by up to 3% of their value, while the pre-decoded kernel
matched the exact sums).

Structure (one CTA per SM, persistent over (expert m-tile of NC x 64 rows, n-tile of BN columns), m-tiles
enumerated per expert through ``tcum`` [E+1], the prefix sum of each expert's m-tile count; NC 4 / BN 64 by
default, NC 2 / BN 128 as the other form, comment at ``DEFAULT_CONFIG``):

* loader (1 warp): TMA of the tile's [64, 128] activation boxes (one per 64-row slice that holds rows of the
  expert) and the [BN, 64] packed weight box of each K block into a ``STAGES``-deep ring (``loaded``: TMA bytes);
* decoder (4 warps): per stage, the packed bytes from shared memory, the group shifts s_g - smax + 12 from
  the scales (one per row and group a thread holds), ``fp4_fp8``'s decode (inline PTX: byte lanes, or the
  table lookup ``DEC_LUT_ASM``), the e4m3 tile stored to shared memory in group split order, ``decoded`` arrived;
* NC consumers (4 warps each, one per 64-row slice): wait ``loaded`` and ``decoded``, one K = 128 wgmma
  chain into a fresh partial, release the stage (``empty``, NC arrivals), promote with sa * 2^(smax - 133),
  and a masked bf16 store of the slice at the tile's end (rows past the expert's end belong to the next
  expert). A slice with no rows of the expert skips its wgmma and promotion.

Where it is not exact: as ``fp4_fp8`` (module doc there). NVFP4 is not taken.
"""
from __future__ import annotations

import torch

from .. import interpreting, triton_available
from ..lib import PDL_LAUNCH, QBLOCK

BMH = 64            # rows per consumer warpgroup (one wgmma M)
BKH = QBLOCK // 2   # K elements per half block (even / odd)

try:
    if not triton_available():
        raise ImportError
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    GLUON = True
except ImportError:     # CPU-only torch without triton, or a triton without Gluon's Hopper ops
    GLUON = False



# The same decode as ``fp4_fp8.DEC_ASM`` (the same bytes for every code and shift) by table lookup, 28
# instructions per 4 packed bytes instead of 36, for a $3 whose four byte lanes hold one shift byte (this kernel's
# decoder: a thread's 16 bytes of a row are one scale group). The group's eight magnitude bytes e4m3(e2m1(m) *
# 2^(kk - 6)), m = 0..7, are two table words built from the shift (zero where flushed: kb = 0); a prmt compacts the
# four 3-bit codes of a word's low (high) nibbles into a selector and a second prmt looks them up; the sign bit
# is kept where the looked-up byte is non-zero (+0 for zero codes and flushed groups, as the byte-lane form).
# Checked instruction by instruction against the reference decode on a CPU (``tests/ptx_emu.py``).
DEC_LUT_ASM = (
    "{ .reg .b32 rk, tl, th, m, t, sl, sv, nz, lo, hi;\n"
    "add.u32 rk, $3, 0x78787878; and.b32 rk, rk, 0x80808080; prmt.b32 rk, rk, 0, 0xBA98;\n"
    "and.b32 tl, $3, 0xFFFFFF00; add.u32 tl, tl, 0x0C080000; and.b32 tl, tl, rk;\n"
    "add.u32 th, $3, 0x1C181410; and.b32 th, th, rk;\n"
    "and.b32 m, $2, 0x07070707; shr.b32 t, m, 4; or.b32 t, t, m; prmt.b32 sl, t, 0, 0x4420;"
    " prmt.b32 lo, tl, th, sl;\n"
    "shl.b32 sv, $2, 4; and.b32 sv, sv, 0x80808080; add.u32 nz, lo, 0x7F7F7F7F; and.b32 sv, sv, nz;"
    " or.b32 $0, lo, sv;\n"
    "shr.b32 m, $2, 4; and.b32 m, m, 0x07070707; shr.b32 t, m, 4; or.b32 t, t, m; prmt.b32 sl, t, 0, 0x4420;"
    " prmt.b32 hi, tl, th, sl;\n"
    "and.b32 sv, $2, 0x80808080; add.u32 nz, hi, 0x7F7F7F7F; and.b32 sv, sv, nz; or.b32 $1, hi, sv; }")

if GLUON:
    _BMH = gl.constexpr(BMH)
    _BKH = gl.constexpr(BKH)
    from ..lib import pdl_wait
    from .fp4_fp8 import DEC_ASM
    # fp4_fp8's byte-lane decode: per byte lane the e4m3 bytes of the low ($0) and high ($1) nibbles of $2,
    # with the group shift byte $3 = (s_g - smax + 12) << 3 (0: flushed)
    _DEC = gl.constexpr(DEC_ASM.value)
    _DEC_L = gl.constexpr(DEC_LUT_ASM)

    @gluon.jit
    def _find_tile(TCUM, OFFS, t, n_groups, LOG2G: gl.constexpr, NC: gl.constexpr):
        """(expert, first row, end row) of m-tile t of NC x 64 rows (``lib.find_tile``)."""
        lo = 0
        hi = n_groups
        for _ in gl.static_range(LOG2G):
            mid = (lo + hi) // 2
            right = gl.load(TCUM + mid + 1) <= t
            lo = gl.where(right, mid + 1, lo)
            hi = gl.where(right, hi, mid)
        e = gl.minimum(lo, n_groups - 1)
        m0 = gl.load(OFFS + e) + (t - gl.load(TCUM + e)) * (NC * _BMH)
        return e, m0.to(gl.int32), gl.load(OFFS + e + 1).to(gl.int32)

    @gluon.jit
    def _loader(a_desc, w_desc, a_bufs, w_bufs, loaded, empty, TCUM, OFFS, n_groups, N, K,
                STAGES: gl.constexpr, LOG2G: gl.constexpr, NC: gl.constexpr, LIVE_LOADS: gl.constexpr):
        """LIVE_LOADS: only the 64-row slices that hold rows of the tile's expert are loaded (their consumers
        skip the others' wgmma): a 192-row expert in a 256-row tile reads 3 activation boxes per K block, not 4.
        A tile has at least one row (``tcum`` counts ceil(rows / (NC x 64)) tiles an expert), so n_live >= 1."""
        BN: gl.constexpr = w_desc.block_type.shape[0]
        num_n = N // BN
        total = gl.load(TCUM + n_groups).to(gl.int32) * num_n
        abytes: gl.constexpr = a_desc.block_type.nbytes
        wbytes: gl.constexpr = w_desc.block_type.nbytes
        it = 0
        for tile in range(gl.program_id(0), total, gl.num_programs(0)):
            e, m0, m_end = _find_tile(TCUM, OFFS, tile // num_n, n_groups, LOG2G, NC)
            wrow = e * N + (tile % num_n) * BN
            if LIVE_LOADS:
                n_live = gl.minimum((m_end - m0 + _BMH - 1) // _BMH, NC)
            else:
                n_live = NC
            for kb in range(K // 128):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)   # fresh barriers: phase 1 done
                bar = loaded.index(s)
                if LIVE_LOADS:      # the byte count is an immediate: one predicated expect per possible count
                    for nl in gl.static_range(1, NC + 1):
                        mbarrier.expect(bar, nl * abytes + wbytes, pred=n_live == nl)
                else:
                    mbarrier.expect(bar, NC * abytes + wbytes)
                for h in gl.static_range(NC):                # the tile's 64-row slices, one per consumer
                    if h < n_live:
                        _tma_load(a_desc, [m0 + h * _BMH, kb * 128], bar, a_bufs.index(NC * s + h))
                _tma_load(w_desc, [wrow, kb * 64], bar, w_bufs.index(s))
                it += 1

    @gluon.jit
    def _decoder(w_bufs, b_bufs, loaded, decoded, WS, SMAX, TCUM, OFFS, n_groups, N, K,
                 STAGES: gl.constexpr, LOG2G: gl.constexpr, BN: gl.constexpr, GROUP_SCALES: gl.constexpr,
                 PROBE: gl.constexpr, NC: gl.constexpr, LUT: gl.constexpr):
        """GROUP_SCALES: each thread loads the one e8m0 scale of the 16 packed bytes it holds per row (its
        group) and forms that group's shift once, then broadcasts it in registers; else a scale per byte.
        The e4m3 tile is stored in group split order: per 32-element group its 16 even elements (the low
        nibbles of its 16 bytes), then its 16 odd ones; a thread's 16 bytes of a row are one group, so this
        is a register-level join, no data exchange."""
        layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[8, 4],
                                                warps_per_cta=[4, 1], order=[1, 0])
        # the same distribution with the 64 bytes split (group, byte in group): a thread's 16 bytes are one group
        l3: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 16], threads_per_warp=[8, 4, 1],
                                            warps_per_cta=[4, 1, 1], order=[2, 1, 0])
        g_l: gl.constexpr = gl.SliceLayout(2, l3)
        rows_l: gl.constexpr = gl.SliceLayout(1, layout)
        cols_l: gl.constexpr = gl.SliceLayout(0, layout)
        num_n = N // BN
        nkb = K // 128
        total = gl.load(TCUM + n_groups).to(gl.int32) * num_n
        r = gl.arange(0, BN, layout=rows_l)
        j = gl.arange(0, 64, layout=cols_l)
        rg = gl.arange(0, BN, layout=gl.SliceLayout(1, g_l))
        g = gl.arange(0, 4, layout=gl.SliceLayout(0, g_l))
        it = 0
        for tile in range(gl.program_id(0), total, gl.num_programs(0)):
            e, m0, m_end = _find_tile(TCUM, OFFS, tile // num_n, n_groups, LOG2G, NC)
            n0 = (tile % num_n) * BN
            if GROUP_SCALES:
                srow = WS + ((e * N + n0 + rg).to(gl.int64) * (K // 32))[:, None] + g[None, :]
            else:
                srow = WS + ((e * N + n0 + r).to(gl.int64) * (K // 32))[:, None] + (j // 16)[None, :]
            smax_row = SMAX + (e * (N // 128) + n0 // 128).to(gl.int64) * nkb
            for kb in range(nkb):
                smax = gl.load(smax_row + kb).to(gl.int32)
                sc = gl.load(srow + kb * 4)
                if GROUP_SCALES:
                    kk = sc.to(gl.int32) - smax + 12                                # [BN, 4]: the group's shift
                    k4 = gl.where(kk >= 1, kk << 3, 0).to(gl.uint8)
                    k16 = gl.broadcast(gl.expand_dims(k4, 2), gl.full([BN, 4, 16], 0, gl.uint8, l3))[0]
                    kb8 = gl.convert_layout(gl.reshape(k16, [BN, 64]), layout)
                else:
                    kk = sc.to(gl.int32) - smax + 12                                # [BN, 64]: byte j's group
                    kb8 = gl.where(kk >= 1, kk << 3, 0).to(gl.uint8)
                s = it % STAGES
                mbarrier.wait(loaded.index(s), (it // STAGES) & 1)
                if PROBE % 2 == 0:
                    packed = w_bufs.index(s).load(layout)
                    if LUT:
                        lo, hi = gl.inline_asm_elementwise(_DEC_L, "=r,=r,r,r", [packed, kb8],
                                                           dtype=(gl.uint8, gl.uint8), is_pure=True, pack=4)
                    else:
                        lo, hi = gl.inline_asm_elementwise(_DEC, "=r,=r,r,r", [packed, kb8],
                                                           dtype=(gl.uint8, gl.uint8), is_pure=True, pack=4)
                    lh = gl.join(gl.reshape(lo, [BN, 4, 16]), gl.reshape(hi, [BN, 4, 16]))    # [BN, 4, 16, 2]
                    t = gl.reshape(gl.permute(lh, (0, 1, 3, 2)), [BN, 128])
                    b_bufs.index(s).store(t.to(gl.float8e4nv, bitcast=True))
                    fence_async_shared()
                mbarrier.arrive(decoded.index(s), count=1)
                it += 1

    @gluon.jit
    def _consumer(a_bufs, b_bufs, loaded, decoded, empty, OUT, SA, SMAX, TCUM, OFFS, n_groups, P, N, K,
                  STAGES: gl.constexpr, LOG2G: gl.constexpr, BN: gl.constexpr, H: gl.constexpr,
                  PROBE: gl.constexpr, NC: gl.constexpr):
        """Rows [64 H, 64 H + 64) of every tile (module doc). It waits on the stage's TMA barrier as well as the
        decoder's: the activation boxes' visibility to wgmma does not rest on the decoder's generic-proxy
        arrival."""
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 32])
        rows_l: gl.constexpr = gl.SliceLayout(1, layout)
        cols_l: gl.constexpr = gl.SliceLayout(0, layout)
        zero = gl.zeros([_BMH, BN], gl.float32, layout)
        num_n = N // BN
        nkb = K // 128
        total = gl.load(TCUM + n_groups).to(gl.int32) * num_n
        it = 0
        for tile in range(gl.program_id(0), total, gl.num_programs(0)):
            e, m0, m_end = _find_tile(TCUM, OFFS, tile // num_n, n_groups, LOG2G, NC)
            n0 = (tile % num_n) * BN
            h0 = m0 + H * _BMH
            live = h0 < m_end
            r = h0 + gl.arange(0, _BMH, layout=rows_l)
            rmask = r < m_end
            smax_row = SMAX + (e * (N // 128) + n0 // 128).to(gl.int64) * nkb
            acc = gl.zeros([_BMH, BN], gl.float32, layout)
            for kb in range(nkb):
                sa = gl.load(SA + kb * P + r, mask=rmask, other=0.0)
                smax = gl.load(smax_row + kb).to(gl.int32)
                sb = ((smax + 6) << 23).to(gl.float32, bitcast=True) * (1.0 / 4096.0)   # 2^(smax - 133)
                s = it % STAGES
                mbarrier.wait(loaded.index(s), (it // STAGES) & 1)
                mbarrier.wait(decoded.index(s), (it // STAGES) & 1)
                if live and PROBE < 2:
                    a = a_bufs.index(NC * s + H)
                    b = b_bufs.index(s)
                    tok = warpgroup_mma(a, b.permute((1, 0)), zero, use_acc=False, is_async=True)
                    p, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(tok, a, b))
                    mbarrier.arrive(empty.index(s), count=1)
                    acc += p * (sa * sb)[:, None]
                else:
                    mbarrier.arrive(empty.index(s), count=1)
                it += 1
            if live:
                c = n0 + gl.arange(0, BN, layout=cols_l)
                ptr = OUT + r.to(gl.int64)[:, None] * N + c[None, :]
                gl.store(ptr, acc.to(gl.bfloat16), mask=rmask[:, None] & (c < N)[None, :])

    @gluon.jit
    def _fp4_fp8_ws_kernel(a_desc, w_desc, OUT, SA, WS, SMAX, TCUM, OFFS, n_groups, P, N, K,
                           STAGES: gl.constexpr, LOG2G: gl.constexpr,
                           CONSUMER_REGS: gl.constexpr, DECODER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
                           GROUP_SCALES: gl.constexpr, PROBE: gl.constexpr, NC: gl.constexpr,
                           LUT: gl.constexpr, LIVE_LOADS: gl.constexpr):
        """a_desc: e4m3 [P, K] (group split order) in [64, 128] boxes; w_desc: uint8 [E N, K/2] in [BN, 64]
        boxes; OUT bf16 [P, N]; SA fp32 [K/128, P]; WS uint8 [E N, K/32]; SMAX uint8 [E, N/128, K/128]; TCUM,
        OFFS int64 [E+1] (m-tiles of NC x 64 rows). NC consumer warpgroups: 2 (BN 128) or 4 (BN 64)."""
        pdl_wait()
        BN: gl.constexpr = w_desc.block_type.shape[0]
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NC * STAGES, _BMH, 128], a_desc.layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, _BKH], w_desc.layout)
        # the decoded tile's layout is built here, not passed: the constexpr arguments must stay JSON-serialisable
        # (Triton serialises them for a jit_post_compile_hook, which the engine's warm-up log installs)
        b_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        b_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, 128], b_layout)
        loaded = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        decoded = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(loaded.index(i), count=1)
            mbarrier.init(decoded.index(i), count=1)
            mbarrier.init(empty.index(i), count=NC)     # one arrival per consumer partition
        if NC == 4:
            gl.warp_specialize([
                (_consumer, (a_bufs, b_bufs, loaded, decoded, empty, OUT, SA, SMAX, TCUM, OFFS, n_groups, P, N, K,
                             STAGES, LOG2G, BN, 0, PROBE, NC)),
                (_consumer, (a_bufs, b_bufs, loaded, decoded, empty, OUT, SA, SMAX, TCUM, OFFS, n_groups, P, N, K,
                             STAGES, LOG2G, BN, 1, PROBE, NC)),
                (_consumer, (a_bufs, b_bufs, loaded, decoded, empty, OUT, SA, SMAX, TCUM, OFFS, n_groups, P, N, K,
                             STAGES, LOG2G, BN, 2, PROBE, NC)),
                (_consumer, (a_bufs, b_bufs, loaded, decoded, empty, OUT, SA, SMAX, TCUM, OFFS, n_groups, P, N, K,
                             STAGES, LOG2G, BN, 3, PROBE, NC)),
                (_decoder, (w_bufs, b_bufs, loaded, decoded, WS, SMAX, TCUM, OFFS, n_groups, N, K, STAGES, LOG2G,
                            BN, GROUP_SCALES, PROBE, NC, LUT)),
                (_loader, (a_desc, w_desc, a_bufs, w_bufs, loaded, empty, TCUM, OFFS, n_groups, N, K, STAGES,
                           LOG2G, NC, LIVE_LOADS)),
            ], [4, 4, 4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS, DECODER_REGS, LOADER_REGS])
        else:
            gl.warp_specialize([
                (_consumer, (a_bufs, b_bufs, loaded, decoded, empty, OUT, SA, SMAX, TCUM, OFFS, n_groups, P, N, K,
                             STAGES, LOG2G, BN, 0, PROBE, NC)),
                (_consumer, (a_bufs, b_bufs, loaded, decoded, empty, OUT, SA, SMAX, TCUM, OFFS, n_groups, P, N, K,
                             STAGES, LOG2G, BN, 1, PROBE, NC)),
                (_decoder, (w_bufs, b_bufs, loaded, decoded, WS, SMAX, TCUM, OFFS, n_groups, N, K, STAGES, LOG2G,
                            BN, GROUP_SCALES, PROBE, NC, LUT)),
                (_loader, (a_desc, w_desc, a_bufs, w_bufs, loaded, empty, TCUM, OFFS, n_groups, N, K, STAGES,
                           LOG2G, NC, LIVE_LOADS)),
            ], [4, 4, 1], [CONSUMER_REGS, DECODER_REGS, LOADER_REGS])


# NC 4 (the default): m-tiles of 256 rows, n-tiles of 64 columns: each decoded weight element feeds 256 rows
# instead of 128 (half the decode work per MMA; a V4-Flash expert at 8192 tokens, ~192 rows, is one m-tile instead
# of a full and a half-empty one); 4 x 4 consumer warps at 88 + 4 decoder warps at 104 + the loader's 24 (24 warps
# launched: maxnreg 65,536 / 768 -> 80; ptxas, sm_90a: no spills there, where consumers at 96 with the decoder at 88
# spilled 112 bytes); 4 stages of 44 KB.
# NC 2: m-tiles of 128 rows, n-tiles of 128 columns; 4 stages of 40 KB (2 activation boxes of 8 KB, 8 KB packed
# weights, 16 KB decoded weights). Registers per SM (64K): 8 consumer warps at 168 + 4 decoder warps at 96 + the
# loader's warp(group) at 40 <= 65,536. The launch's ``maxnreg`` is what every thread starts with before the
# partitions' setmaxnreg: the 16 warps the kernel launches with (the loader's warp pads to a warpgroup) must fit 64K
# at it, so 65,536 / 512 = 128; a larger value makes the driver refuse the launch (its per-block thread limit drops
# below 512).
# LUT (the default): the decoder on ``DEC_LUT_ASM`` (22% fewer instructions than the byte-lane decode, the same
# bytes).
# H100, ``experiments/exp_fp4_fp8_ws.py --tokens 8192 --stages 4`` (2026-12-06, 256 experts, V4-Flash shapes),
# GEMM 1 / GEMM 2 in us: NC 2 3768 / 1979, NC 4 3364 / 1811, NC 2 + LUT 3365 / 1753, NC 4 + LUT 3119 / 1672
# (``_scaled_mm`` on the dense problem 1198 / 659).
# LIVE_LOADS (the default): the loader skips the activation boxes of 64-row slices past the expert's rows
# (``_loader``): at 8192 tokens x 256 experts (~192 rows an expert) a quarter of NC 4's activation reads, which are
# 32 of the 36 KB a K block loads from L2 (every n-tile re-reads the m-tile's activations). H100, same experiment:
# the loads alone (PROBE 3) 2331 -> 1771 us (GEMM 1), the kernel 3157 -> 3116 / GEMM 2 1658 -> 1656: the loads are
# not the kernel's bound.
# The scales loaded one K block ahead in the decoder and the consumers (H100, 2026-12-06, at 50610af): GEMM 1 3068 vs
# 3101 us, GEMM 2 1653 vs 1636, prefill within its run-to-run spread: not kept. Per K block a tile spends ~1,300
# cycles for ~490 of MACs; its ~112 KB of shared-memory traffic (wgmma's A and B reads, TMA, the decoder) is ~875
# cycles (docs/benchmarks-2026-12-06.md, "The two prepared variants").
# PROBE (timing only, wrong outputs): 1 = the decoder stores nothing, 2 = the consumers skip the wgmma, 3 = both
# (the loads and the barrier ring alone).
DEFAULT_CONFIG = {"STAGES": 4, "CONSUMERS": 4, "CONSUMER_REGS": None, "DECODER_REGS": None, "LOADER_REGS": None,
                  "maxnreg": None, "GRID": 0, "GROUP_SCALES": True, "PROBE": 0, "LUT": True,
                  "LIVE_LOADS": True}
_PER_CONSUMERS = {2: {"BN": 128, "CONSUMER_REGS": 168, "DECODER_REGS": 96, "LOADER_REGS": 40, "maxnreg": 128},
                  4: {"BN": 64, "CONSUMER_REGS": 88, "DECODER_REGS": 104, "LOADER_REGS": 24, "maxnreg": 80}}
BN = 128    # N must be a multiple of 128 whatever the n-tile (the weight factors' tiles)


def available(dev) -> bool:
    """Whether this kernel can run on ``dev``: an sm_90 GPU with Gluon's Hopper ops, not the interpreter."""
    if not GLUON or interpreting() or torch.device(dev).type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(dev) == (9, 0)


def split_k_order(a: torch.Tensor) -> torch.Tensor:
    """e4m3 / uint8 [P, K] -> the same rows in group split order: each 32-element group's 16 even elements
    first, then its 16 odd ones (the order of the kernel's decoded weight tiles)."""
    P, K = a.shape
    return a.view(P, K // 32, 16, 2).transpose(-1, -2).reshape(P, K).contiguous()


def tile_counts(offs: torch.Tensor, consumers: int) -> torch.Tensor:
    """int64 [E+1]: the prefix sum of each expert's m-tile count (``consumers`` x 64 rows a tile; ``tcum``)."""
    tm = consumers * BMH
    n = (offs[1:] - offs[:-1] + tm - 1) // tm
    return torch.cat([n.new_zeros(1), n.cumsum(0)])


def resolve_config(config: dict | None) -> dict:
    cfg = dict(DEFAULT_CONFIG)
    if config:
        unknown = set(config) - set(DEFAULT_CONFIG)
        if unknown:
            raise ValueError(f"fp4_fp8_ws: unknown config keys {sorted(unknown)}")
        cfg.update(config)
    if cfg["STAGES"] < 2:
        raise ValueError(f"fp4_fp8_ws: STAGES must be >= 2, got {cfg['STAGES']}")
    if cfg["CONSUMERS"] not in _PER_CONSUMERS:
        raise ValueError(f"fp4_fp8_ws: CONSUMERS must be 2 or 4, got {cfg['CONSUMERS']}")
    per = _PER_CONSUMERS[cfg["CONSUMERS"]]
    for key in ("CONSUMER_REGS", "DECODER_REGS", "LOADER_REGS", "maxnreg"):
        if cfg[key] is None:
            cfg[key] = per[key]
    cfg["BN"] = per["BN"]
    return cfg


def fp4_fp8_ws(a_split: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, tile_smax: torch.Tensor,
               offs: torch.Tensor, out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """bf16 [P, N] (module doc): ``a_split`` e4m3 / uint8 [P, K] in ``split_k_order``, ``sa`` fp32 [P, K/128],
    ``w`` uint8 [E, N, K/2], ``ws`` uint8 e8m0 [E, N, K/32], ``tile_smax`` uint8 [E, N/128, K/128], ``offs``
    int64 [E+1] (rows of expert e: [offs[e], offs[e+1]))."""
    from ..lib import target
    from ..lib import u8 as _u8
    a, w, ws, smx = _u8(a_split), _u8(w), _u8(ws), _u8(tile_smax)
    P, K = a.shape
    E, N, K2 = w.shape
    if 2 * K2 != K or K % QBLOCK or N % BN or tuple(ws.shape) != (E, N, K // 32) or \
            tuple(smx.shape) != (E, N // QBLOCK, K // QBLOCK) or tuple(sa.shape) != (P, K // QBLOCK) or \
            offs.numel() != E + 1:
        raise ValueError(f"fp4_fp8_ws: shapes a {tuple(a.shape)}, sa {tuple(sa.shape)}, w {tuple(w.shape)}, ws "
                         f"{tuple(ws.shape)}, tile_smax {tuple(smx.shape)}, offs {tuple(offs.shape)} do not fit "
                         f"(K % 128 == 0, N % {BN} == 0)")
    if not available(a.device):
        raise ValueError("fp4_fp8_ws: needs an sm_90 GPU with Gluon's Hopper ops")
    cfg = resolve_config(config)
    out = torch.empty(P, N, dtype=torch.bfloat16, device=a.device) if out is None else out
    if P == 0:
        return out
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    nc, bn = cfg["CONSUMERS"], cfg["BN"]
    f8 = gl.float8e4nv
    a8 = a.contiguous().view(torch.float8_e4m3fn)
    w2 = w.reshape(E * N, K2).contiguous()
    a_desc = TensorDescriptor.from_tensor(a8, [BMH, QBLOCK], gl.NVMMASharedLayout.get_default_for([BMH, QBLOCK], f8))
    w_desc = TensorDescriptor.from_tensor(w2, [bn, BKH], gl.NVMMASharedLayout.get_default_for([bn, BKH], gl.uint8))
    offs = offs.to(torch.int64).contiguous()
    tcum = tile_counts(offs, nc)
    # the kernel reads the tile count from tcum; the grid takes a host bound (no device sync: graph-capturable):
    # each expert's m-tiles are at most one more than its rows / (nc x 64)
    tiles = (-(-P // (nc * BMH)) + min(E, P)) * (N // bn)
    grid = (max(1, min(tiles, cfg["GRID"] or target(a.device).sm_count)),)
    _fp4_fp8_ws_kernel[grid](a_desc, w_desc, out, sa.float().t().contiguous(), ws.reshape(E * N, K // 32).contiguous(),
                             smx.contiguous(), tcum, offs, E, P, N, K, STAGES=cfg["STAGES"],
                             LOG2G=max(1, E.bit_length()),
                             CONSUMER_REGS=cfg["CONSUMER_REGS"], DECODER_REGS=cfg["DECODER_REGS"],
                             LOADER_REGS=cfg["LOADER_REGS"], GROUP_SCALES=bool(cfg["GROUP_SCALES"]),
                             PROBE=int(cfg["PROBE"]), NC=nc, LUT=bool(cfg["LUT"]),
                             LIVE_LOADS=bool(cfg["LIVE_LOADS"]), num_warps=4,
                             maxnreg=cfg["maxnreg"], **PDL_LAUNCH)
    return out


__all__ = ["DEFAULT_CONFIG", "GLUON", "available", "fp4_fp8_ws", "resolve_config", "split_k_order", "tile_counts"]
