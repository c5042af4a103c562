"""Warp-specialized block-scaled FP8 GEMM for Hopper prefill (Gluon, sm_90 only).

Contract and numerics of ``gemm.fp8_gemm`` (plain mode) and ``fp8_prefill.fp8_gemm_prefill``: e4m3
``xq [M, K]`` with fp32 power-of-two scales ``xs [M, K/128]``, e4m3 ``w [N, K]`` with 128 x 128 block
scales ``ws [N/128, K/128]`` (e8m0 bytes or fp32) -> bf16 ``[M, N]``. Per 128-wide K block a fresh
fp32 partial ``P = A_blk . B_blk^T`` (one wgmma chain), then ``acc += P * (sA[row, kb] * sB[kb])`` in
increasing K order, one bf16 rounding: the same operations as the Triton kernel, so the same bits.

Why a hand-written kernel: Triton keeps each K block's wgmma synchronous with its promotion FFMAs
(``fp8_prefill`` module doc), and its automatic warp specialization crashed or hung on the H200
(Triton 3.6). Here the structure is DeepGEMM's, written out (``gl.warp_specialize``):

* a persistent grid (one CTA per SM) walking 128 x BN output tiles in grouped order;
* a 1-warp producer partition: TMA loads of the two 64-row halves of the A tile and the B tile into
  a ``STAGES``-deep ring, each stage guarded by a ``ready`` (TMA bytes) and an ``empty`` (two
  consumer arrivals) mbarrier;
* two 4-warp consumer partitions, one per 64-row half: wait ``ready``, wgmma, wait for it, release
  the stage, promote with the scales (loaded from global memory one K block ahead), and at the end
  of a tile store their half through shared memory with a TMA store. The two consumers are not
  synchronised with each other, so one's promotion FFMAs overlap the other's wgmma, and the
  producer runs ahead across tile boundaries (the next tile's loads during this tile's epilogue).

H200 (session 11, docs/benchmarks-2026-12-01.md): level with the Triton kernel where N >> K (wq_b: 0-3 points of peak
ahead), 2-12 points behind at K >= 7168; Nsight Compute puts 42% of its stalls on the named barriers
Gluon emits around each ``mbarrier.arrive`` / ``mbarrier.wait`` of the K loop. So ``fp8_gemm`` does not
route here, and the kernel lives in ``experiments/`` (formerly ``dsv4/kernels/fp8_ws.py``; its test is
``experiments/test_fp8_ws.py``, outside the default pytest run). ``AHEAD`` (issue block k+1's wgmma before waiting for block
k's) makes ptxas serialise every wgmma (C7514); BN = 256 compiles with register spills.

Limits: N % 128 == 0 is not required (TMA clips the store and zero-fills the loads), but the scales
must be per 128 x 128 block (per-row weight scales go to ``fp8_prefill``); K % 128 == 0; 16-byte
aligned bases and row strides. Gluon has no CPU interpreter: CPU CI compiles the kernel for sm_90;
the GPU tests hold it to the Triton kernel bit for bit.
"""
from __future__ import annotations

import torch

from dsv4.kernels import interpreting, triton_available
from dsv4.kernels.lib import QBLOCK as BK      # the scale block: one K block per stage

BM_HALF = 64        # rows per consumer warpgroup (one wgmma M)

try:
    if not triton_available():
        raise ImportError
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    # Triton 3.6 (the H200 image) names the TMA copies async_copy_*; 3.9 (CI) renamed them async_load / store
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    GLUON = True
except ImportError:     # CPU-only torch without triton, or a triton without Gluon's Hopper ops
    GLUON = False


if GLUON:
    @gluon.jit
    def _ws_tile(tile, num_m, num_n, GROUP_M: gl.constexpr):
        """(pid_m, pid_n) of output tile ``tile`` in grouped order (``gemm._grouped_tile``)."""
        width = GROUP_M * num_n
        first_m = (tile // width) * GROUP_M
        gsize = gl.minimum(num_m - first_m, GROUP_M)
        return first_m + (tile % width) % gsize, (tile % width) // gsize

    @gluon.jit
    def _ws_producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K,
                     GROUP_M: gl.constexpr, STAGES: gl.constexpr):
        BMH: gl.constexpr = a_desc.block_type.shape[0]
        BN: gl.constexpr = b_desc.block_type.shape[0]
        KB: gl.constexpr = a_desc.block_type.shape[1]
        num_m = gl.cdiv(M, 2 * BMH)
        num_n = gl.cdiv(N, BN)
        nbytes: gl.constexpr = 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes
        it = 0
        for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
            pid_m, pid_n = _ws_tile(tile, num_m, num_n, GROUP_M)
            m0 = pid_m * (2 * BMH)
            n0 = pid_n * BN
            for kb in range(K // KB):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)   # fresh barriers: phase 1 done
                bar = ready.index(s)
                mbarrier.expect(bar, nbytes)
                _tma_load(a_desc, [m0, kb * KB], bar, a_bufs.index(2 * s))
                _tma_load(a_desc, [m0 + BMH, kb * KB], bar, a_bufs.index(2 * s + 1))
                _tma_load(b_desc, [n0, kb * KB], bar, b_bufs.index(s))
                it += 1

    @gluon.jit
    def _ws_scales(SA, sb_row, kb, M, r, rmask, SB_E8M0: gl.constexpr):
        """sA of rows r and the scalar sB of K block kb (fp32; e8m0 byte b -> 2^(b-127), b = 0 -> 2^-127)."""
        sa = gl.load(SA + kb * M + r, mask=rmask, other=0.0)
        if SB_E8M0:
            sbb = gl.load(sb_row + kb).to(gl.int32)
            sb = gl.where(sbb == 0, 5.877471754111438e-39, (sbb << 23).to(gl.float32, bitcast=True))
        else:
            sb = gl.load(sb_row + kb)
        return sa, sb

    @gluon.jit
    def _ws_consumer(a_bufs, b_bufs, c_bufs, ready, empty, c_desc, SA, SB, M, N, K, stride_sbn,
                     GROUP_M: gl.constexpr, STAGES: gl.constexpr, SB_E8M0: gl.constexpr, AHEAD: gl.constexpr,
                     H: gl.constexpr):
        """Rows [64 H, 64 H + 64) of every tile: wgmma per K block, promotion, TMA-store epilogue. The scales
        of block k + 1 are loaded while block k is processed (a global load's latency is about one
        block's MMA time). AHEAD: block k + 1's wgmma is issued before block k's is waited for, so
        the tensor cores have this warpgroup's next block queued during its promotion."""
        BMH: gl.constexpr = c_desc.block_type.shape[0]
        BN: gl.constexpr = c_desc.block_type.shape[1]
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 32])
        rows_l: gl.constexpr = gl.SliceLayout(1, layout)
        zero = gl.zeros([BMH, BN], gl.float32, layout)
        c_smem = c_bufs.index(H)
        num_m = gl.cdiv(M, 2 * BMH)
        num_n = gl.cdiv(N, BN)
        nkb = K // a_bufs.type.shape[2]
        it = 0
        for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
            pid_m, pid_n = _ws_tile(tile, num_m, num_n, GROUP_M)
            m0 = pid_m * (2 * BMH) + H * BMH
            n0 = pid_n * BN
            r = m0 + gl.arange(0, BMH, layout=rows_l)
            rmask = r < M
            sb_row = SB + (n0 // 128) * stride_sbn
            acc = gl.zeros([BMH, BN], gl.float32, layout)
            sa, sb = _ws_scales(SA, sb_row, 0, M, r, rmask, SB_E8M0)
            if AHEAD:
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                tok = warpgroup_mma(a_bufs.index(2 * s + H), b_bufs.index(s).permute((1, 0)), zero,
                                    use_acc=False, is_async=True)
                for kb in range(1, nkb):
                    sa_n, sb_n = _ws_scales(SA, sb_row, kb, M, r, rmask, SB_E8M0)
                    s_n = (it + 1) % STAGES
                    mbarrier.wait(ready.index(s_n), ((it + 1) // STAGES) & 1)
                    tok_n = warpgroup_mma(a_bufs.index(2 * s_n + H), b_bufs.index(s_n).permute((1, 0)), zero,
                                          use_acc=False, is_async=True)
                    p = warpgroup_mma_wait(num_outstanding=1, deps=(tok,))
                    mbarrier.arrive(empty.index(s), count=1)
                    acc += p * (sa * sb)[:, None]
                    tok = tok_n
                    sa = sa_n
                    sb = sb_n
                    s = s_n
                    it += 1
                p = warpgroup_mma_wait(num_outstanding=0, deps=(tok,))
                mbarrier.arrive(empty.index(s), count=1)
                acc += p * (sa * sb)[:, None]
                it += 1
            else:
                for kb in range(nkb):
                    kn = gl.minimum(kb + 1, nkb - 1)          # next block's scales (the last: reloaded)
                    sa_n, sb_n = _ws_scales(SA, sb_row, kn, M, r, rmask, SB_E8M0)
                    s = it % STAGES
                    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                    a_s = a_bufs.index(2 * s + H)
                    b_s = b_bufs.index(s)
                    tok = warpgroup_mma(a_s, b_s.permute((1, 0)), zero, use_acc=False, is_async=True)
                    p, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(tok, a_s, b_s))
                    mbarrier.arrive(empty.index(s), count=1)
                    acc += p * (sa * sb)[:, None]
                    sa = sa_n
                    sb = sb_n
                    it += 1
            tma.store_wait(pendings=0)       # the previous tile's store has read c_smem
            c_smem.store(acc.to(gl.bfloat16))
            fence_async_shared()
            _tma_store(c_desc, [m0, n0], c_smem)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _fp8_ws_kernel(a_desc, b_desc, c_desc, SA, SB, M, N, K, stride_sbn,
                       GROUP_M: gl.constexpr, STAGES: gl.constexpr, SB_E8M0: gl.constexpr, AHEAD: gl.constexpr,
                       CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
        """a_desc: e4m3 [M, K] in [64, 128] boxes; b_desc: e4m3 [N, K] in [BN, 128]; c_desc: bf16 [M, N]
        in [64, BN]; SA: fp32 activation scales transposed, [K/128, M]; SB: weight scales [N/128, K/128]
        (e8m0 bytes or fp32, row stride stride_sbn)."""
        BMH: gl.constexpr = a_desc.block_type.shape[0]
        BN: gl.constexpr = b_desc.block_type.shape[0]
        KB: gl.constexpr = a_desc.block_type.shape[1]
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, BMH, KB], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, KB], b_desc.layout)
        c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2, BMH, BN], c_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)      # one arrival per consumer partition
        gl.warp_specialize([
            (_ws_consumer, (a_bufs, b_bufs, c_bufs, ready, empty, c_desc, SA, SB, M, N, K, stride_sbn,
                            GROUP_M, STAGES, SB_E8M0, AHEAD, 0)),
            (_ws_consumer, (a_bufs, b_bufs, c_bufs, ready, empty, c_desc, SA, SB, M, N, K, stride_sbn,
                            GROUP_M, STAGES, SB_E8M0, AHEAD, 1)),
            (_ws_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# 5 stages of 32 KB, groups of 12 row blocks (~square with 132 tiles in flight): the best or level in
# the H200 runs of session 11 (docs/benchmarks-2026-12-01.md). GRID 0: one CTA per SM.
DEFAULT_CONFIG = {"BN": 128, "STAGES": 5, "GROUP_M": 12, "AHEAD": False, "CONSUMER_REGS": 232,
                  "PRODUCER_REGS": 40, "maxnreg": 168, "GRID": 0}


def available(dev) -> bool:
    """Whether this kernel can run on ``dev``: an sm_90 GPU with Gluon's Hopper ops, not the interpreter."""
    if not GLUON or interpreting() or torch.device(dev).type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(dev) == (9, 0)


def resolve_config(config: dict | None) -> dict:
    cfg = dict(DEFAULT_CONFIG)
    if config:
        unknown = set(config) - set(DEFAULT_CONFIG)
        if unknown:
            raise ValueError(f"fp8_gemm_ws: unknown config keys {sorted(unknown)}")
        cfg.update(config)
    if cfg["BN"] not in (64, 128, 256):
        raise ValueError(f"fp8_gemm_ws: BN must be 64, 128 or 256, got {cfg['BN']}")
    if cfg["STAGES"] < 2:
        raise ValueError(f"fp8_gemm_ws: STAGES must be >= 2, got {cfg['STAGES']}")
    return cfg


def supports(xq: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether a call fits this kernel (``fp8_prefill`` takes every call that does not): an sm_90 GPU,
    128 x 128 block weight scales, K % 128 == 0 and TMA-legal operands (16-byte aligned bases and row
    strides)."""
    from dsv4.kernels.gemm.fp8_prefill import tma_ok as _tma_ok
    K = xq.shape[1]
    if K % BK or ws.dim() != 2 or ws.shape[0] != -(-w.shape[0] // 128) or not available(xq.device):
        return False
    return _tma_ok(xq, w, out)


def fp8_gemm_ws(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
                out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """bf16 [M, N] = the block-scaled FP8 GEMM (``gemm.fp8_gemm`` contract, plain mode) on sm_90: xq e4m3
    [M, K], xs fp32 [M, K/128], w e4m3 [N, K], ws e8m0 / fp32 [N/128, K/128]; ``out`` an optional bf16
    [M, N] destination. Raises ValueError for what ``supports`` rejects."""
    from dsv4.kernels.gemm.fp8_prefill import check_args
    from dsv4.kernels.lib import target
    from dsv4.kernels.lib import u8 as _u8
    M, N, K, out = check_args("fp8_gemm_ws", xq, xs, w, ws, out)
    a = _u8(xq).view(torch.float8_e4m3fn)
    b = _u8(w).view(torch.float8_e4m3fn)
    if not supports(a, b, ws, out):
        raise ValueError("fp8_gemm_ws: needs an sm_90 GPU, 128x128 block weight scales, K % 128 == 0 and "
                         "16-byte aligned operands with unit column stride")
    if M == 0:
        return out
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    cfg = resolve_config(config)
    BN = cfg["BN"]
    sb_e8m0 = ws.dtype in (torch.float8_e8m0fnu, torch.uint8)
    wsv = (_u8(ws) if sb_e8m0 else ws.float()).contiguous()
    sa = xs.float().t().contiguous()                     # [K/128, M]: one contiguous vector per K block
    f8 = gl.float8e4nv
    a_desc = TensorDescriptor.from_tensor(a, [BM_HALF, BK], gl.NVMMASharedLayout.get_default_for([BM_HALF, BK], f8))
    b_desc = TensorDescriptor.from_tensor(b, [BN, BK], gl.NVMMASharedLayout.get_default_for([BN, BK], f8))
    c_desc = TensorDescriptor.from_tensor(out, [BM_HALF, BN],
                                          gl.NVMMASharedLayout.get_default_for([BM_HALF, BN], gl.bfloat16))
    tiles = triton.cdiv(M, 2 * BM_HALF) * triton.cdiv(N, BN)
    grid = (min(tiles, cfg["GRID"] or target(xq.device).sm_count),)
    _fp8_ws_kernel[grid](a_desc, b_desc, c_desc, sa, wsv, M, N, K, wsv.stride(0),
                         GROUP_M=cfg["GROUP_M"], STAGES=cfg["STAGES"], SB_E8M0=sb_e8m0, AHEAD=bool(cfg["AHEAD"]),
                         CONSUMER_REGS=cfg["CONSUMER_REGS"], PRODUCER_REGS=cfg["PRODUCER_REGS"],
                         num_warps=4, maxnreg=cfg["maxnreg"])
    return out


__all__ = ["DEFAULT_CONFIG", "GLUON", "available", "fp8_gemm_ws", "resolve_config", "supports"]
