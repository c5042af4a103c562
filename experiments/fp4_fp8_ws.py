"""Warp-specialized grouped MXFP4 expert GEMM on FP8 wgmma, the weights decoded inside the kernel (Gluon, sm_90).

Status: an experiment, compiled offline for sm_90a (``experiments/test_fp4_fp8_ws.py``) but not yet run on a
GPU. It is the candidate for removing the pre-decoded path's decode pass (22% of an 8192-token prefill chunk
on the H100, BENCHMARKS.md prefill section): the e4m3 weight tiles are formed in shared memory by a decoder
partition while the consumer warpgroups run the wgmma of earlier stages, so no e4m3 copy of the experts is
written to or read from memory.

Contract (GEMM 2's form and GEMM 1's unfused form of ``moe_forward``'s ``predec`` path): ``a`` e4m3 [P, K],
the rows sorted by expert (``offs`` [E+1] the expert row offsets) with the 64 even K elements of each 128-block
first and the 64 odd ones after them (``split_k_order``), ``sa`` fp32 [P, K/128]; the experts' MXFP4 weights
``w`` uint8 [E, N, K/2] (two e2m1 codes per byte, the low nibble the even element), e8m0 scales ``ws`` uint8
[E, N, K/32], and ``tile_smax`` uint8 [E, N/128, K/128] (``fp4_fp8.tile_max``) -> bf16 [P, N]:

    out[r] = sum over 128-blocks kb of (sum_k a8[r, k] * byte[n, k]) * sa[r, kb] * 2^(smax[kb] - 133)

with byte = e4m3(e2m1(code) * 2^(s_g - smax + 6)) (``fp4_fp8``'s per-tile fold, exact where
``wide_spread(ws, tile=True)`` is False; groups 2^12 or more below their tile's maximum are flushed) and
one fresh fp32 partial per 128-block: the products of the pre-decoded path; the sum inside a block is
formed as two K = 64 wgmma chains (the even then the odd elements), so it can differ from the pre-decoded
kernel's in the last fp32 bits.

Structure (one CTA per SM, persistent over (expert m-tile of 128 rows, n-tile of 128 columns), m-tiles
enumerated per expert through ``tcum`` [E+1], the prefix sum of each expert's 128-row tile count):

* loader (1 warp): TMA of the four [64, 64] activation boxes (two 64-row halves x even / odd K) and the
  [128, 64] packed weight box of each K block into a ``STAGES``-deep ring (``loaded``: TMA bytes);
* decoder (4 warps): per stage, the packed bytes from shared memory, the group shifts s_g - smax + 12 from
  the scales, ``fp4_fp8``'s byte-lane decode (inline PTX, ~4 instructions per value), the even and odd
  e4m3 halves stored to shared memory, ``decoded`` arrived;
* two consumers (4 warps each, one per 64-row half): wait ``decoded``, two wgmma chains into a fresh
  partial, release the stage (``empty``, two arrivals), promote with sa * 2^(smax - 133), and a masked
  bf16 store of the half at the tile's end (rows past the expert's end belong to the next expert). A
  half with no rows of the expert skips its wgmma and promotion.

Where it is not exact: as ``fp4_fp8`` (module doc there). NVFP4 is not taken.
"""
from __future__ import annotations

import torch

from dsv4.kernels import interpreting, triton_available
from dsv4.kernels.lib import QBLOCK

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



if GLUON:
    _BMH = gl.constexpr(BMH)
    _BKH = gl.constexpr(BKH)
    from dsv4.kernels.gemm.fp4_fp8 import _DEC_ASM
    # fp4_fp8's byte-lane decode: per byte lane the e4m3 bytes of the low ($0) and high ($1) nibbles of $2,
    # with the group shift byte $3 = (s_g - smax + 12) << 3 (0: flushed)
    _DEC = gl.constexpr(_DEC_ASM.value)

    @gluon.jit
    def _find_tile(TCUM, OFFS, t, n_groups, LOG2G: gl.constexpr):
        """(expert, first row, end row) of 128-row m-tile t (``lib.find_tile``)."""
        lo = 0
        hi = n_groups
        for _ in gl.static_range(LOG2G):
            mid = (lo + hi) // 2
            right = gl.load(TCUM + mid + 1) <= t
            lo = gl.where(right, mid + 1, lo)
            hi = gl.where(right, hi, mid)
        e = gl.minimum(lo, n_groups - 1)
        m0 = gl.load(OFFS + e) + (t - gl.load(TCUM + e)) * (2 * _BMH)
        return e, m0.to(gl.int32), gl.load(OFFS + e + 1).to(gl.int32)

    @gluon.jit
    def _loader(a_desc, w_desc, a_bufs, w_bufs, loaded, empty, TCUM, OFFS, n_groups, N, K,
                STAGES: gl.constexpr, LOG2G: gl.constexpr):
        BN: gl.constexpr = w_desc.block_type.shape[0]
        num_n = N // BN
        total = gl.load(TCUM + n_groups).to(gl.int32) * num_n
        nbytes: gl.constexpr = 4 * a_desc.block_type.nbytes + w_desc.block_type.nbytes
        it = 0
        for tile in range(gl.program_id(0), total, gl.num_programs(0)):
            e, m0, m_end = _find_tile(TCUM, OFFS, tile // num_n, n_groups, LOG2G)
            wrow = e * N + (tile % num_n) * BN
            for kb in range(K // 128):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)   # fresh barriers: phase 1 done
                bar = loaded.index(s)
                mbarrier.expect(bar, nbytes)
                for i in gl.static_range(4):                 # (half h, K half j) -> box 4 s + 2 h + j
                    _tma_load(a_desc, [m0 + (i // 2) * _BMH, kb * 128 + (i % 2) * 64], bar, a_bufs.index(4 * s + i))
                _tma_load(w_desc, [wrow, kb * 64], bar, w_bufs.index(s))
                it += 1

    @gluon.jit
    def _decoder(w_bufs, blo_bufs, bhi_bufs, loaded, decoded, WS, SMAX, TCUM, OFFS, n_groups, N, K,
                 STAGES: gl.constexpr, LOG2G: gl.constexpr, BN: gl.constexpr):
        layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[8, 4],
                                                warps_per_cta=[4, 1], order=[1, 0])
        rows_l: gl.constexpr = gl.SliceLayout(1, layout)
        cols_l: gl.constexpr = gl.SliceLayout(0, layout)
        num_n = N // BN
        nkb = K // 128
        total = gl.load(TCUM + n_groups).to(gl.int32) * num_n
        r = gl.arange(0, BN, layout=rows_l)
        j = gl.arange(0, 64, layout=cols_l)
        it = 0
        for tile in range(gl.program_id(0), total, gl.num_programs(0)):
            e, m0, m_end = _find_tile(TCUM, OFFS, tile // num_n, n_groups, LOG2G)
            n0 = (tile % num_n) * BN
            srow = WS + ((e * N + n0 + r).to(gl.int64) * (K // 32))[:, None] + (j // 16)[None, :]
            smax_row = SMAX + (e * (N // 128) + n0 // 128).to(gl.int64) * nkb
            for kb in range(nkb):
                sg = gl.load(srow + kb * 4).to(gl.int32)                       # [BN, 64]: byte j's group
                smax = gl.load(smax_row + kb).to(gl.int32)
                kk = sg - smax + 12
                kb8 = gl.where(kk >= 1, kk << 3, 0).to(gl.uint8)
                s = it % STAGES
                mbarrier.wait(loaded.index(s), (it // STAGES) & 1)
                packed = w_bufs.index(s).load(layout)
                lo, hi = gl.inline_asm_elementwise(_DEC, "=r,=r,r,r", [packed, kb8],
                                                   dtype=(gl.uint8, gl.uint8), is_pure=True, pack=4)
                blo_bufs.index(s).store(lo.to(gl.float8e4nv, bitcast=True))
                bhi_bufs.index(s).store(hi.to(gl.float8e4nv, bitcast=True))
                fence_async_shared()
                mbarrier.arrive(decoded.index(s), count=1)
                it += 1

    @gluon.jit
    def _consumer(a_bufs, blo_bufs, bhi_bufs, decoded, empty, OUT, SA, SMAX, TCUM, OFFS, n_groups, P, N, K,
                  STAGES: gl.constexpr, LOG2G: gl.constexpr, BN: gl.constexpr, H: gl.constexpr):
        """Rows [64 H, 64 H + 64) of every tile (module doc)."""
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
            e, m0, m_end = _find_tile(TCUM, OFFS, tile // num_n, n_groups, LOG2G)
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
                mbarrier.wait(decoded.index(s), (it // STAGES) & 1)
                if live:
                    a_lo = a_bufs.index(4 * s + 2 * H)
                    a_hi = a_bufs.index(4 * s + 2 * H + 1)
                    b_lo = blo_bufs.index(s)
                    b_hi = bhi_bufs.index(s)
                    tok = warpgroup_mma(a_lo, b_lo.permute((1, 0)), zero, use_acc=False, is_async=True)
                    tok = warpgroup_mma(a_hi, b_hi.permute((1, 0)), tok, is_async=True)
                    p, _, _, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(tok, a_lo, a_hi, b_lo, b_hi))
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
                           STAGES: gl.constexpr, LOG2G: gl.constexpr, B_LAYOUT: gl.constexpr,
                           CONSUMER_REGS: gl.constexpr, DECODER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
        """a_desc: e4m3 [P, K] (split K order) in [64, 64] boxes; w_desc: uint8 [E N, K/2] in [BN, 64] boxes;
        OUT bf16 [P, N]; SA fp32 [K/128, P]; WS uint8 [E N, K/32]; SMAX uint8 [E, N/128, K/128]; TCUM, OFFS
        int64 [E+1] (128-row tiles)."""
        BN: gl.constexpr = w_desc.block_type.shape[0]
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [4 * STAGES, _BMH, _BKH], a_desc.layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, _BKH], w_desc.layout)
        blo_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, _BKH], B_LAYOUT)
        bhi_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, _BKH], B_LAYOUT)
        loaded = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        decoded = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(loaded.index(i), count=1)
            mbarrier.init(decoded.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)      # one arrival per consumer partition
        gl.warp_specialize([
            (_consumer, (a_bufs, blo_bufs, bhi_bufs, decoded, empty, OUT, SA, SMAX, TCUM, OFFS, n_groups, P, N, K,
                         STAGES, LOG2G, BN, 0)),
            (_consumer, (a_bufs, blo_bufs, bhi_bufs, decoded, empty, OUT, SA, SMAX, TCUM, OFFS, n_groups, P, N, K,
                         STAGES, LOG2G, BN, 1)),
            (_decoder, (w_bufs, blo_bufs, bhi_bufs, loaded, decoded, WS, SMAX, TCUM, OFFS, n_groups, N, K,
                        STAGES, LOG2G, BN)),
            (_loader, (a_desc, w_desc, a_bufs, w_bufs, loaded, empty, TCUM, OFFS, n_groups, N, K, STAGES, LOG2G)),
        ], [4, 4, 1], [CONSUMER_REGS, DECODER_REGS, LOADER_REGS])


# 4 stages of 40 KB (4 activation boxes of 4 KB, 8 KB packed weights, 16 KB decoded weights). Registers per SM
# (64K): 8 consumer warps at 168 + 4 decoder warps at 96 + the loader's warp(group) at 40 <= 65,536
DEFAULT_CONFIG = {"STAGES": 4, "CONSUMER_REGS": 168, "DECODER_REGS": 96, "LOADER_REGS": 40, "maxnreg": 168,
                  "GRID": 0}
BN = 128


def available(dev) -> bool:
    """Whether this kernel can run on ``dev``: an sm_90 GPU with Gluon's Hopper ops, not the interpreter."""
    if not GLUON or interpreting() or torch.device(dev).type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(dev) == (9, 0)


def split_k_order(a: torch.Tensor) -> torch.Tensor:
    """e4m3 / uint8 [P, K] -> the same rows with each 128-block's 64 even elements first, then the 64 odd."""
    P, K = a.shape
    return a.view(P, K // QBLOCK, BKH, 2).transpose(-1, -2).reshape(P, K).contiguous()


def tile_counts(offs: torch.Tensor) -> torch.Tensor:
    """int64 [E+1]: the prefix sum of each expert's 128-row tile count (``tcum`` of this kernel's tiles)."""
    n = (offs[1:] - offs[:-1] + 2 * BMH - 1) // (2 * BMH)
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
    return cfg


def fp4_fp8_ws(a_split: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, tile_smax: torch.Tensor,
               offs: torch.Tensor, out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """bf16 [P, N] (module doc): ``a_split`` e4m3 / uint8 [P, K] in ``split_k_order``, ``sa`` fp32 [P, K/128],
    ``w`` uint8 [E, N, K/2], ``ws`` uint8 e8m0 [E, N, K/32], ``tile_smax`` uint8 [E, N/128, K/128], ``offs``
    int64 [E+1] (rows of expert e: [offs[e], offs[e+1]))."""
    from dsv4.kernels.lib import target
    from dsv4.kernels.lib import u8 as _u8
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
    out = torch.empty(P, N, dtype=torch.bfloat16, device=a.device) if out is None else out
    if P == 0:
        return out
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    cfg = resolve_config(config)
    f8 = gl.float8e4nv
    a8 = a.contiguous().view(torch.float8_e4m3fn)
    w2 = w.reshape(E * N, K2).contiguous()
    a_desc = TensorDescriptor.from_tensor(a8, [BMH, BKH], gl.NVMMASharedLayout.get_default_for([BMH, BKH], f8))
    w_desc = TensorDescriptor.from_tensor(w2, [BN, BKH], gl.NVMMASharedLayout.get_default_for([BN, BKH], gl.uint8))
    b_layout = gl.NVMMASharedLayout.get_default_for([BN, BKH], f8)
    offs = offs.to(torch.int64).contiguous()
    tcum = tile_counts(offs)
    tiles = int(tcum[-1]) * (N // BN)
    grid = (max(1, min(tiles, cfg["GRID"] or target(a.device).sm_count)),)
    _fp4_fp8_ws_kernel[grid](a_desc, w_desc, out, sa.float().t().contiguous(), ws.reshape(E * N, K // 32).contiguous(),
                             smx.contiguous(), tcum, offs, E, P, N, K, STAGES=cfg["STAGES"],
                             LOG2G=max(1, E.bit_length()), B_LAYOUT=b_layout,
                             CONSUMER_REGS=cfg["CONSUMER_REGS"], DECODER_REGS=cfg["DECODER_REGS"],
                             LOADER_REGS=cfg["LOADER_REGS"], num_warps=4, maxnreg=cfg["maxnreg"])
    return out


__all__ = ["DEFAULT_CONFIG", "GLUON", "available", "fp4_fp8_ws", "resolve_config", "split_k_order", "tile_counts"]
