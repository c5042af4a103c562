"""Prefill (large-tile) FP8 x FP4 expert GEMM for Hopper: one K=128 tensor-core MMA chain per 128-K block.

Same host interface and numerics contract as ``fp4.fp4_launch(..., path="dequant")`` at tiles of
>= 64 rows (plain bf16 output, or the grouped SwiGLU epilogue emitting e4m3 ``h`` bytes + scales
through ``common.fp4_epilogue``), MXFP4 and NVFP4; only the inner loop differs:

* per 128-K block the [BN, 64] packed weight bytes become ONE [BN, 128] f16 tile (exact e2m1 values
  times a power of two) that feeds ONE ``tl.dot`` with K=128 (a chain of 8 k16 wgmmas) against the
  [BM, 128] activation tile, loaded contiguously (cp.async, multi-buffered by Triton's pipeliner).
  The old kernel issues eight K=16 dots per block on stride-2 activation loads, each with its own
  register -> shared-memory operand conversion, barrier and wgmma wait.
* K order of the block (``KSPLIT``):
  - ``False``: natural order (``tl.join(lo, hi)``: element 2j = low nibble of byte j); the A operand
    is ``common.f16_operand`` unchanged (drop-in), at the cost of byte-pair interleaving in registers
    (~one PRMT per f16x2).
  - ``True``: per 32-group the 16 even elements then the 16 odd ones (the order in which the old
    kernel's dots consume a group), so the nibble halves need no interleaving; the A operand must
    then be ``f16_operand_split(q)`` (the same f16 values, permuted once per row on the host).
* e2m1 decode (``DEC``): 0 = ``lib.e2m1_f16`` (e2m1 -> e4m3 byte -> ``cvt.rn.f16x2.e4m3x2``,
  value * 2^-6); 1 = integer-only (``_e2m1_f16_alu``: the code's 3 magnitude bits placed at f16 bits
  9-11 and its sign at bit 15 give value * 2^-14 exactly, subnormal 0.5 included: byte permutes,
  shifts and logic ops, no conversion instruction; more instructions, but conversions issue at a
  fraction of the integer rate on sm_90 per the CUDA guide's throughput table; which one wins is
  for the H200 to say).
* MXFP4: each 32-group's e8m0 scale relative to the row's largest in the block, ``2^(s_g - s_max)``,
  is folded into the f16 weight times a constant ``2^RB`` (exact: power-of-two products), then
  ``acc += blk * (sa[row] * 2^(s_max - 127) * 2^(decode shift - RB))``, the official per-128 fp32
  promotion. The fold is exact while a row's four group scales inside one 128-block span <= 2^28
  (``fp4``'s FMT=2 fold: 2^16); beyond that the smallest groups flush to zero (relative 2^-28 of the
  block's largest values). Every product is exact in fp32 and the MMA accumulates in fp32, so the
  result differs from ``fp4_launch`` only in fp32 summation order (with ``KSPLIT`` the block's
  products enter the MMA chain in the old kernel's order).
* NVFP4: the e4m3 per-16 scales are folded into the f16 weight as in ``fp4`` (exact), the fp32
  global scale (times the decode shift) multiplies once at the end.
* program order: the 1-D grid walks all column blocks of one m-tile before the next m-tile, so the
  (gathered) activation rows of an expert come from HBM about once and then from L2 (``fp4``'s 2-D
  grid walks all m-tiles of one column block first: the activation is re-read once per column
  block).

The grouped tile enumeration (``tcum``) must be built for this kernel's ``BM``
(``moe.sort_pairs(eflat, E, bm)``), as for ``fp4_launch``.

Measurements and static facts: docs/kernel-measurements.md.
"""
from __future__ import annotations

import torch

from ..lib import PDL_LAUNCH, QBLOCK, interpreting, target, triton_available
from . import route
from .common import fp4_kernel_args, log2_groups

REL_BIAS = 14       # MXFP4 fold: f16 weight = e2m1 * 2^-DS * 2^(s_g - s_max + RB), DS = 6 (DEC 0) / 14 (DEC 1)

if triton_available():
    import triton
    import triton.language as tl

    from ..lib import e2m1_f16, pdl_wait
    from .common import fp4_epilogue, tile

    @triton.jit
    def _e2m1_f16_alu(b, USE_ASM: tl.constexpr):
        """packed e2m1 bytes [R, C] -> (low nibbles, high nibbles) as f16 [R, C], value * 2^-14,
        exact, without conversion instructions: f16 bits = (c & 7) << 9 | (c & 8) << 12 (the
        magnitude bits land on the exponent's low two bits and the mantissa's top bit; code 1 = 0.5
        becomes the f16 subnormal 2^-15)."""
        if USE_ASM:
            # per 4 bytes w = [b0 b1 b2 b3]: x = [0 b0 0 b1] (then [0 b2 0 b3]); high nibble:
            # sign (bit 7) already at bits 15 / 31, magnitude bits 12-14 -> 9-11 (>> 3); low nibble:
            # the same after << 4
            lo, hi = tl.inline_asm_elementwise(
                "{ .reg .b32 x, y, t, u;\n"
                "prmt.b32 x, $4, 0, 0x1404; prmt.b32 y, $4, 0, 0x3424;\n"
                "shl.b32 t, x, 1; and.b32 t, t, 0x0E000E00;\n"
                "shl.b32 u, x, 4; and.b32 u, u, 0x80008000; or.b32 $0, t, u;\n"
                "shl.b32 t, y, 1; and.b32 t, t, 0x0E000E00;\n"
                "shl.b32 u, y, 4; and.b32 u, u, 0x80008000; or.b32 $1, t, u;\n"
                "shr.b32 t, x, 3; and.b32 t, t, 0x0E000E00; and.b32 u, x, 0x80008000; or.b32 $2, t, u;\n"
                "shr.b32 t, y, 3; and.b32 t, t, 0x0E000E00; and.b32 u, y, 0x80008000; or.b32 $3, t, u; }",
                "=r,=r,=r,=r,r", [b], dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        else:
            c = b.to(tl.int16)
            lo = (((c & 7) << 9) | ((c & 8) << 12)).to(tl.float16, bitcast=True)
            hi = ((((c >> 4) & 7) << 9) | ((c & 0x80) << 8)).to(tl.float16, bitcast=True)
        return lo, hi

    @triton.jit
    def _weight_tile(wrow, srow, nmask, k0, smax, FMT: tl.constexpr, DEC: tl.constexpr, KSPLIT: tl.constexpr,
                     USE_ASM: tl.constexpr, BN: tl.constexpr, KB: tl.constexpr, RB: tl.constexpr):
        """f16 [BN, KB] weight tile of K elements k0 .. k0 + KB (inside one 128-block whose per-row
        largest MXFP4 scale byte is ``smax``), fine scales folded in, in the K order of ``KSPLIT``."""
        jb = tl.arange(0, KB // 2)
        b = tl.load(wrow[:, None] + k0 // 2 + jb[None, :], mask=nmask[:, None], other=0)
        if DEC == 0:
            lo, hi = e2m1_f16(b, USE_ASM)                 # value * 2^-6
        else:
            lo, hi = _e2m1_f16_alu(b, USE_ASM)             # value * 2^-14
        NG: tl.constexpr = KB // 32
        if FMT == 2:
            jg = tl.arange(0, NG)
            sg = tl.load(srow[:, None] + k0 // 32 + jg[None, :], mask=nmask[:, None], other=0).to(tl.int32)
            # f16 2^(s_g - s_max + RB): normal while >= 2^-14, else 0 (RB = 14: exact spread <= 2^28)
            rel = (tl.maximum(sg - smax[:, None] + RB + 15, 0) << 10).to(tl.int16).to(tl.float16, bitcast=True)
            lo = tl.reshape(tl.reshape(lo, [BN, NG, 16]) * rel[:, :, None], [BN, KB // 2])
            hi = tl.reshape(tl.reshape(hi, [BN, NG, 16]) * rel[:, :, None], [BN, KB // 2])
        else:
            j16 = tl.arange(0, KB // 16)
            bs = tl.load(srow[:, None] + k0 // 16 + j16[None, :], mask=nmask[:, None], other=0)
            bs = bs.to(tl.float8e4nv, bitcast=True).to(tl.float16)            # [BN, KB/16], exact
            lo = tl.reshape(tl.reshape(lo, [BN, KB // 16, 8]) * bs[:, :, None], [BN, KB // 2])
            hi = tl.reshape(tl.reshape(hi, [BN, KB // 16, 8]) * bs[:, :, None], [BN, KB // 2])
        if KSPLIT:   # per 32-group: its 16 even elements (low nibbles), then its 16 odd ones
            w = tl.reshape(tl.permute(tl.join(tl.reshape(lo, [BN, NG, 16]), tl.reshape(hi, [BN, NG, 16])),
                                      (0, 1, 3, 2)), [BN, KB])
        else:        # natural order: element 2j = low nibble of byte j
            w = tl.reshape(tl.join(lo, hi), [BN, KB])
        return w

    @triton.jit
    def _block_scale(srow, nmask, k0, FMT: tl.constexpr, BN: tl.constexpr, SB_SCALE: tl.constexpr):
        """(per-row largest MXFP4 scale byte of the 128-block at k0 (int32 [BN]), fp32 [BN] column
        factor of the block: MXFP4 2^(s_max - 127 + DS - RB), NVFP4 1)."""
        if FMT == 2:
            j4 = tl.arange(0, 4)
            smax = tl.max(tl.load(srow[:, None] + k0 // 32 + j4[None, :], mask=nmask[:, None], other=0).to(tl.int32),
                          axis=1)
            # 2^(s_max - 127 + 6) (exact for every byte <= 248), times the constant 2^(DS - 6 - RB)
            sb = ((smax + 6) << 23).to(tl.float32, bitcast=True) * SB_SCALE
        else:
            smax = tl.zeros([BN], tl.int32)
            sb = tl.full([BN], 1.0, tl.float32)
        return smax, sb

    @triton.jit
    def _block_dot(arow_p, mrow, wrow, srow, nmask, k0, FMT: tl.constexpr, DEC: tl.constexpr,
                   KSPLIT: tl.constexpr, USE_ASM: tl.constexpr, BN: tl.constexpr, RB: tl.constexpr,
                   SB_SCALE: tl.constexpr):
        """(fresh fp32 [BM, BN] partial of the 128-block at k0 (one K=128 dot), fp32 [BN] column
        factor of the block)."""
        smax, sb = _block_scale(srow, nmask, k0, FMT, BN, SB_SCALE)
        kc = tl.arange(0, 128)
        a = tl.load(arow_p[:, None] + k0 + kc[None, :], mask=mrow[:, None], other=0.0)
        w = _weight_tile(wrow, srow, nmask, k0, smax, FMT, DEC, KSPLIT, USE_ASM, BN, 128, RB)
        return tl.dot(a, tl.trans(w)), sb

    @triton.jit(do_not_specialize=['M'])
    def _fp4_prefill_kernel(A16, SA, W, WS, WS2, C, CS, PERM, OFFS, TCUM, PW,
                            M, N_out, K, n_half, n_groups, top_k,
                            stride_am, stride_sam, stride_we, stride_wn, stride_wse, stride_wsn,
                            stride_w2e, stride_cm, stride_csm, limit,
                            FMT: tl.constexpr, GROUPED: tl.constexpr, GATHER: tl.constexpr,
                            SWIGLU: tl.constexpr, HAS_PW: tl.constexpr, USE_ASM: tl.constexpr,
                            DEC: tl.constexpr, KSPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                            LOG2G: tl.constexpr, RB: tl.constexpr, SB_SCALE: tl.constexpr,
                            INTERP: tl.constexpr):
        """FMT 2 = MXFP4 (scales relative to the block max), 1 = NVFP4. One program = one [BM, BN]
        output tile; program ids walk the column blocks of an m-tile first."""
        pdl_wait()
        pid = tl.program_id(0)
        num_n = tl.cdiv(N_out, BN)
        t = pid // num_n
        pid_n = pid - t * num_n
        live, r64, mrow, pair, arow, rn64, nmask, e64 = tile(TCUM, OFFS, PERM, M, N_out, t, pid_n,
                                                              n_groups, top_k, BM, BN, LOG2G, GROUPED, GATHER)
        if not live:
            return
        wrow = W + e64 * stride_we + rn64 * stride_wn
        srow = WS + e64 * stride_wse + rn64 * stride_wsn
        wrow2 = wrow + n_half * stride_wn
        srow2 = srow + n_half * stride_wsn
        arow_p = A16 + arow * stride_am
        sarow = SA + arow * stride_sam
        acc = tl.zeros([BM, BN], tl.float32)
        acc2 = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, 128):
            sa = tl.load(sarow + k0 // 128, mask=mrow, other=0.0)
            blk, sb = _block_dot(arow_p, mrow, wrow, srow, nmask, k0, FMT, DEC, KSPLIT, USE_ASM, BN, RB, SB_SCALE)
            acc += blk * (sa[:, None] * sb[None, :])           # official per-128 promotion
            if SWIGLU:                                         # w3 rows of the same columns
                blk2, sb2 = _block_dot(arow_p, mrow, wrow2, srow2, nmask, k0, FMT, DEC, KSPLIT, USE_ASM, BN, RB,
                                       SB_SCALE)
                acc2 += blk2 * (sa[:, None] * sb2[None, :])
        if FMT == 1:
            DSN: tl.constexpr = 64.0 if DEC == 0 else 16384.0
            s2 = tl.load(WS2 + e64 * stride_w2e + rn64, mask=nmask, other=0.0) * DSN
            acc = acc * s2[None, :]
            if SWIGLU:
                s2b = tl.load(WS2 + e64 * stride_w2e + n_half + rn64, mask=nmask, other=0.0) * DSN
                acc2 = acc2 * s2b[None, :]
        fp4_epilogue(C, CS, PW, acc, acc2, pair, r64, mrow, rn64, nmask, pid_n, stride_cm, stride_csm, limit,
                      SWIGLU, HAS_PW, BM, INTERP)


# -------------------------------------------------------------------------------------------------
# host side

def f16_operand_split(q: torch.Tensor) -> torch.Tensor:
    """e4m3 [M, K] -> the A operand of the ``KSPLIT`` kernel: the same f16 values (exact), each
    32-group reordered as its 16 even elements then its 16 odd ones (one torch copy)."""
    M, K = q.shape
    out = torch.empty(M, K // 32, 2, 16, dtype=torch.float16, device=q.device)
    out.copy_(q.view(M, K // 32, 16, 2).transpose(-1, -2))
    return out.view(M, K)


def fp4_prefill_launch(a, sa, w, ws, ws2, out, out_s, M, N_out, K, n_half, *, fmt, swiglu=False, limit=0.0,
                       perm=None, offs=None, tcum=None, pw=None, top_k=1, n_groups=1, n_tiles=None,
                       config=None, use_asm=None):
    """Drop-in for ``fp4.fp4_launch(..., path="dequant")`` (same arguments; module doc).

    a: f16 [rows, K] activation operand: ``common.f16_operand(q)`` (``KSPLIT`` False, the default) or
    ``f16_operand_split(q)`` (``config['KSPLIT'] = True``). w uint8 [G, N, K/2]; ws uint8
    [G, N, K/32] (mxfp4) or e4m3 bytes [G, N, K/16] (nvfp4); ws2 fp32 [G, N] (nvfp4). Grouped when
    ``tcum`` is given (built for ``config['BM']``); ``perm``: pair id per sorted row (activation row
    = pair // top_k); ``pw``: fp32 routing weight per pair. Output bf16 [rows, N_out], or with
    ``swiglu`` the e4m3 bytes of h [rows, N_out] and its fp32 scales ``out_s`` [rows, N_out/128].
    ``config``: BM, BN (128 with ``swiglu``), num_warps, num_stages, DEC (0 / 1), KSPLIT."""
    if fmt not in ("mxfp4", "nvfp4"):
        raise ValueError(f"fmt must be 'mxfp4' or 'nvfp4', got {fmt!r}")
    if K % QBLOCK:
        raise ValueError(f"fp4_prefill: K={K} must be a multiple of 128")
    if a.dtype != torch.float16:
        raise ValueError(f"fp4_prefill: the activation operand must be f16, got {a.dtype}")
    dev = a.device
    t = target(dev)
    cfg = route.fp4_prefill_config(M / max(1, n_groups), t, swiglu)
    if config:
        cfg.update(config)
    if swiglu:
        cfg["BN"] = QBLOCK
    BM, BN, dec, ksplit = cfg.pop("BM"), cfg.pop("BN"), int(cfg.pop("DEC")), bool(cfg.pop("KSPLIT"))
    kw = {} if interpreting() else {k: v for k, v in cfg.items() if k in ("num_warps", "num_stages")}
    grouped = tcum is not None
    if grouped:
        grid_m = n_tiles if n_tiles is not None else min(M, triton.cdiv(M, BM) + min(n_groups, M))
    else:
        grid_m = triton.cdiv(M, BM)
    grid = (max(grid_m, 1) * triton.cdiv(N_out, BN),)
    if use_asm is None:
        use_asm = t.use_asm
    _fp4_prefill_kernel[grid](
        *fp4_kernel_args(a, sa, w, ws, ws2, out, out_s, perm, offs, tcum, pw, M, N_out, K, n_half, n_groups,
                         top_k, limit),
        FMT=2 if fmt == "mxfp4" else 1, GROUPED=grouped, GATHER=perm is not None, SWIGLU=swiglu,
        HAS_PW=pw is not None, USE_ASM=use_asm, DEC=dec, KSPLIT=ksplit, BM=BM, BN=BN,
        LOG2G=log2_groups(n_groups), RB=REL_BIAS if fmt == "mxfp4" else 0,
        SB_SCALE=2.0 ** ((6 if dec == 0 else 14) - 6 - REL_BIAS), INTERP=interpreting(), **kw, **PDL_LAUNCH)


__all__ = ["fp4_prefill_launch", "f16_operand_split", "REL_BIAS"]
