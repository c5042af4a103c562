"""Prototype: the grouped MXFP4 expert GEMM with the decoded weights as wgmma's register operand (Gluon, sm_90).

``dsv4/kernels/gemm/fp4_fp8_ws.py`` (the product kernel) decodes each weight tile into shared memory, where NC
consumer warpgroups read it as wgmma's B operand next to their activation slices: per K block of a 256 x 64 tile
~112 KB of shared-memory traffic for 2.1M MACs, ~875 cycles at 128 B/clk, against ~490 cycles of MACs (H100,
docs/benchmarks-2026-12-06.md, "The two prepared variants"). Here the roles swap: out^T = W a^T, the weights the
M side (64 weight rows a consumer warpgroup) decoded by the consumer itself straight into the registers wgmma's A
operand reads, and the activations the shared-memory B operand (N = BT tokens). Per K block of a 128-weight-row x BT-token
tile (NC 2, BT 128, 2.1M MACs): the activation box (16 KB) and the packed weights (8 KB) by TMA, the box read by
both consumers' wgmma (32 KB), the packed bytes by the consumers (8 KB): ~64 KB. The activations in L2 are read
once per 128 weight rows instead of once per 64.

Why no data exchange is needed: in group split order (``fp4_fp8_ws.split_k_order``) element j < 16 of a 32-element
group is the low nibble of the group's packed byte j and element 16 + j its high nibble; wgmma's register A
fragment gives lane l of a warp the K elements 4 (l % 4) + {0..3} and 16 + 4 (l % 4) + {0..3} of each 32-element
step for rows l / 4 and l / 4 + 8, i.e. the low and high nibbles of the packed word 4 (l % 4) / 4 of the group: the
decode's two output words (``DEC_LUT_ASM``) are that lane's fragment registers. The packed tile is loaded in that
distribution (``_packed_layout``); Triton 3.6 lowers the conversion to the dot-operand layout without shared memory
(offline PTX: no ld.shared beyond the packed loads, no shuffles).

Contract: ``fp4_fp8_ws``'s (same arguments, same products in the same K = 32 instructions and the same per-block
promotion; H100: the same bits on every GPU test case). Timing: ``experiments/exp_fp4_fp8_ws.py --only register``.
Not routed to by the product: on an H100 it ran 2.5x slower than ``fp4_fp8_ws`` (GEMM 1 at 8192 tokens x 256
experts 7,738 vs 3,063 us; 64-token tiles 5,817; without the decode 6,485: the consumers' wgmma chain, not the
decode; docs/benchmarks-2026-12-06.md, "The weights as wgmma's register operand").
"""
from __future__ import annotations

import torch

from dsv4.kernels import triton_available
from dsv4.kernels.gemm.fp4_fp8_ws import DEC_LUT_ASM, available, tile_counts
from dsv4.kernels.lib import PDL_LAUNCH, QBLOCK

BW = 64             # weight rows per consumer warpgroup (the wgmma M)

try:
    if not triton_available():
        raise ImportError
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    GLUON = True
except ImportError:
    GLUON = False

if GLUON:
    from dsv4.kernels.gemm.fp4_fp8_ws import _find_tile     # (expert, first row, end row) of m-tile t of NC x 64 rows
    from dsv4.kernels.lib import pdl_wait
    _DEC_L = gl.constexpr(DEC_LUT_ASM)
    _BW = gl.constexpr(BW)

    @gluon.constexpr_function
    def _packed_layout():
        """[64 weight rows, 64 packed bytes of a K block]: warp w rows 16 w + l / 4 (+ 8), lane l's word of each
        16-byte group (bytes 16 g + 4 (l % 4) + 0..3); registers: the word's 4 bytes, the 4 groups, the row + 8."""
        return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 16], [0, 32], [8, 0]],
                                          lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                          warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 64])

    @gluon.constexpr_function
    def _group_layout():
        """``_packed_layout`` with the 64 bytes split (group, byte in group): [64, 4, 16]."""
        return gl.DistributedLinearLayout(reg_bases=[[0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 2, 0], [8, 0, 0]],
                                          lane_bases=[[0, 0, 4], [0, 0, 8], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
                                          warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[64, 4, 16])

    @gluon.jit
    def _loader(a_desc, w_desc, a_bufs, w_bufs, loaded, empty, TCUM, OFFS, n_groups, N, K,
                STAGES: gl.constexpr, LOG2G: gl.constexpr):
        """Per K block of a tile: the [BT, 128] activation box and the [NC x 64, 64] packed weight box."""
        BT: gl.constexpr = a_desc.block_type.shape[0]
        BNW: gl.constexpr = w_desc.block_type.shape[0]
        num_n = N // BNW
        total = gl.load(TCUM + n_groups).to(gl.int32) * num_n
        nbytes: gl.constexpr = a_desc.block_type.nbytes + w_desc.block_type.nbytes
        it = 0
        for tile in range(gl.program_id(0), total, gl.num_programs(0)):
            e, m0, m_end = _find_tile(TCUM, OFFS, tile // num_n, n_groups, LOG2G, BT // 64)
            wrow = e * N + (tile % num_n) * BNW
            for kb in range(K // 128):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)   # fresh barriers: phase 1 done
                bar = loaded.index(s)
                mbarrier.expect(bar, nbytes)
                _tma_load(a_desc, [m0, kb * 128], bar, a_bufs.index(s))
                _tma_load(w_desc, [wrow, kb * 64], bar, w_bufs.index(s))
                it += 1

    @gluon.jit
    def _decode_block(w_buf, srow, smax_row, kb, H: gl.constexpr, lp: gl.constexpr, l3: gl.constexpr,
                      dot_l: gl.constexpr, PROBE: gl.constexpr):
        """Weight rows [64 H, 64 H + 64) of a stage's packed tile, K block kb: the group shifts s_g - smax + 12
        from the scales, the LUT decode, the e4m3 [64, 128] tile in group split order as wgmma's A registers."""
        smax = gl.load(smax_row + kb).to(gl.int32)
        sc = gl.load(srow + kb * 4)                                             # [64, 4] e8m0
        kk = sc.to(gl.int32) - smax + 12
        k4 = gl.where(kk >= 1, kk << 3, 0).to(gl.uint8)
        k16 = gl.broadcast(gl.expand_dims(k4, 2), gl.full([_BW, 4, 16], 0, gl.uint8, l3))[0]
        kb8 = gl.convert_layout(gl.reshape(k16, [_BW, 64]), lp)
        packed = w_buf.slice(H * _BW, _BW).load(lp)
        if PROBE == 1:
            lo = packed
            hi = packed ^ kb8
        else:
            lo, hi = gl.inline_asm_elementwise(_DEC_L, "=r,=r,r,r", [packed, kb8],
                                               dtype=(gl.uint8, gl.uint8), is_pure=True, pack=4)
        lh = gl.join(gl.reshape(lo, [_BW, 4, 16]), gl.reshape(hi, [_BW, 4, 16]))     # [64, 4, 16, 2]
        t = gl.reshape(gl.permute(lh, (0, 1, 3, 2)), [_BW, 128])
        return gl.convert_layout(t.to(gl.float8e4nv, bitcast=True), dot_l)

    @gluon.jit
    def _consumer(a_bufs, w_bufs, loaded, empty, OUT, SA, WS, SMAX, TCUM, OFFS, n_groups, P, N, K,
                  STAGES: gl.constexpr, LOG2G: gl.constexpr, BT: gl.constexpr, H: gl.constexpr, NC: gl.constexpr,
                  PROBE: gl.constexpr):
        """Weight rows [64 H, 64 H + 64) of every tile: per K block the group shifts from the scales, the packed
        bytes from shared memory, the decode into wgmma's A registers, one K = 128 wgmma chain into a fresh
        partial against the activation box, the stage released, the partial promoted with sa * 2^(smax - 133);
        at the tile's end the [64, BT] result stored transposed (token rows past the expert's end belong to the
        next expert: masked). The two consumers' decodes and wgmma interleave; within one, block kb + 1's decode
        issued before block kb's wgmma wait does not overlap it (ptxas, 3.6: it waits for the wgmma before the decode
        however the loop is arranged, unrolled by two included, under the register pressure of two 64 x BT fp32
        accumulators). PROBE 1 (timing only, wrong outputs): no decode (the packed bytes as A)."""
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BT, 32])
        dot_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=4)
        lp: gl.constexpr = _packed_layout()
        l3: gl.constexpr = _group_layout()
        g_l: gl.constexpr = gl.SliceLayout(2, l3)
        cols_l: gl.constexpr = gl.SliceLayout(0, acc_l)
        out_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[8, 1], threads_per_warp=[8, 4],
                                               warps_per_cta=[1, 4], order=[0, 1])
        BNW: gl.constexpr = NC * _BW
        num_n = N // BNW
        nkb = K // 128
        total = gl.load(TCUM + n_groups).to(gl.int32) * num_n
        rg = gl.arange(0, _BW, layout=gl.SliceLayout(1, g_l))
        g = gl.arange(0, 4, layout=gl.SliceLayout(0, g_l))
        zero = gl.zeros([_BW, BT], gl.float32, acc_l)
        it = 0
        for tile in range(gl.program_id(0), total, gl.num_programs(0)):
            e, m0, m_end = _find_tile(TCUM, OFFS, tile // num_n, n_groups, LOG2G, BT // 64)
            n0 = (tile % num_n) * BNW + H * _BW
            srow = WS + ((e * N + n0 + rg).to(gl.int64) * (K // 32))[:, None] + g[None, :]
            smax_row = SMAX + (e * (N // 128) + n0 // 128).to(gl.int64) * nkb
            tk = m0 + gl.arange(0, BT, layout=cols_l)
            tmask = tk < m_end
            acc = gl.zeros([_BW, BT], gl.float32, acc_l)
            for kb in range(nkb):
                sa = gl.load(SA + kb * P + tk, mask=tmask, other=0.0)
                smax = gl.load(smax_row + kb).to(gl.int32)
                sb = ((smax + 6) << 23).to(gl.float32, bitcast=True) * (1.0 / 4096.0)   # 2^(smax - 133)
                s = it % STAGES
                mbarrier.wait(loaded.index(s), (it // STAGES) & 1)
                a = _decode_block(w_bufs.index(s), srow, smax_row, kb, H, lp, l3, dot_l, PROBE)
                b = a_bufs.index(s)
                tok = warpgroup_mma(a, b.permute((1, 0)), zero, use_acc=False, is_async=True)
                p, _ = warpgroup_mma_wait(num_outstanding=0, deps=(tok, b))
                mbarrier.arrive(empty.index(s), count=1)
                acc += p * (sa * sb)[None, :]
                it += 1
            o = gl.convert_layout(acc.to(gl.bfloat16), out_l)
            rn = n0 + gl.arange(0, _BW, layout=gl.SliceLayout(1, out_l))
            rt = m0 + gl.arange(0, BT, layout=gl.SliceLayout(0, out_l))
            gl.store(OUT + rt.to(gl.int64)[None, :] * N + rn[:, None], o, mask=(rt < m_end)[None, :])

    @gluon.jit
    def _fp4_fp8_rs_kernel(a_desc, w_desc, OUT, SA, WS, SMAX, TCUM, OFFS, n_groups, P, N, K,
                           STAGES: gl.constexpr, LOG2G: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                           LOADER_REGS: gl.constexpr, PROBE: gl.constexpr):
        """a_desc: e4m3 [P, K] (group split order) in [BT, 128] boxes; w_desc: uint8 [E N, K/2] in [128, 64] boxes;
        OUT bf16 [P, N]; SA fp32 [K/128, P]; WS uint8 [E N, K/32]; SMAX uint8 [E, N/128, K/128]; TCUM, OFFS int64
        [E+1] (token m-tiles of BT rows). Two consumer warpgroups (64 weight rows each) and a loader warp."""
        pdl_wait()
        BT: gl.constexpr = a_desc.block_type.shape[0]
        BNW: gl.constexpr = w_desc.block_type.shape[0]
        NC: gl.constexpr = BNW // 64
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BT, 128], a_desc.layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BNW, 64], w_desc.layout)
        loaded = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(loaded.index(i), count=1)
            mbarrier.init(empty.index(i), count=NC)
        gl.warp_specialize([
            (_consumer, (a_bufs, w_bufs, loaded, empty, OUT, SA, WS, SMAX, TCUM, OFFS, n_groups, P, N, K,
                         STAGES, LOG2G, BT, 0, NC, PROBE)),
            (_consumer, (a_bufs, w_bufs, loaded, empty, OUT, SA, WS, SMAX, TCUM, OFFS, n_groups, P, N, K,
                         STAGES, LOG2G, BT, 1, NC, PROBE)),
            (_loader, (a_desc, w_desc, a_bufs, w_bufs, loaded, empty, TCUM, OFFS, n_groups, N, K, STAGES, LOG2G)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


# 2 consumer warpgroups at 232 registers and the loader's warp(group) at 40: 128 x (2 x 232 + 40) <= 65,536; the launch
# (12 warps with the loader's padded to a warpgroup) at 65,536 / 384 -> 168.
DEFAULT_CONFIG = {"STAGES": 4, "BT": 128, "CONSUMER_REGS": 232, "LOADER_REGS": 40, "maxnreg": 168, "GRID": 0,
                  "PROBE": 0}


def fp4_fp8_rs(a_split: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, tile_smax: torch.Tensor,
               offs: torch.Tensor, out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """``fp4_fp8_ws.fp4_fp8_ws``'s contract (module doc)."""
    from dsv4.kernels.lib import target
    from dsv4.kernels.lib import u8 as _u8
    cfg = dict(DEFAULT_CONFIG, **(config or {}))
    a, w, ws, smx = _u8(a_split), _u8(w), _u8(ws), _u8(tile_smax)
    P, K = a.shape
    E, N, K2 = w.shape
    bnw = 2 * BW
    if 2 * K2 != K or K % QBLOCK or N % bnw or tuple(ws.shape) != (E, N, K // 32) or \
            tuple(smx.shape) != (E, N // QBLOCK, K // QBLOCK) or tuple(sa.shape) != (P, K // QBLOCK) or \
            offs.numel() != E + 1:
        raise ValueError("fp4_fp8_rs: shapes do not fit")
    if not available(a.device):
        raise ValueError("fp4_fp8_rs: needs an sm_90 GPU with Gluon's Hopper ops")
    out = torch.empty(P, N, dtype=torch.bfloat16, device=a.device) if out is None else out
    if P == 0:
        return out
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    bt = cfg["BT"]
    f8 = gl.float8e4nv
    a8 = a.contiguous().view(torch.float8_e4m3fn)
    a_desc = TensorDescriptor.from_tensor(a8, [bt, QBLOCK], gl.NVMMASharedLayout.get_default_for([bt, QBLOCK], f8))
    w_desc = TensorDescriptor.from_tensor(w.reshape(E * N, K2).contiguous(), [bnw, 64],
                                          gl.NVMMASharedLayout.get_default_for([bnw, 64], gl.uint8))
    offs = offs.to(torch.int64).contiguous()
    tcum = tile_counts(offs, bt // 64)
    tiles = (-(-P // bt) + min(E, P)) * (N // bnw)
    grid = (max(1, min(tiles, cfg["GRID"] or target(a.device).sm_count)),)
    _fp4_fp8_rs_kernel[grid](a_desc, w_desc, out, sa.float().t().contiguous(), ws.reshape(E * N, K // 32).contiguous(),
                             smx.contiguous(), tcum, offs, E, P, N, K, STAGES=cfg["STAGES"],
                             LOG2G=max(1, E.bit_length()), CONSUMER_REGS=cfg["CONSUMER_REGS"],
                             LOADER_REGS=cfg["LOADER_REGS"], PROBE=int(cfg["PROBE"]), num_warps=4,
                             maxnreg=cfg["maxnreg"], **PDL_LAUNCH)
    return out
