"""Decode-sized block-scaled GEMMs on CUDA cores: FP8 (128x128 scales) and FP4 (MXFP4 / NVFP4) weights.

At decode a routed expert sees 1-4 rows and a linear layer 1-4 tokens: the tensor-core kernels of
``fp8.py`` / ``fp4.py`` then stream weights through 16-row MMA tiles whose dot-operand layout conversion
(registers -> shared memory -> registers, 4 bytes per weight element) and one tile per (expert,
128 columns) leave the H200 mostly idle (docs/benchmarks-2026-11-30.md, session 3: ~440 GB/s on the FP4 expert
weights at batch 1). Here every program streams a ``[BN, 128-K]`` weight slab in the layout it is
loaded in (16 contiguous bytes per thread), decodes it in registers and reduces each scale group
inside the thread (the default 64-row x 8-warp tile compiles without any shared memory: sm_90 SASS).
Split-K over a third grid axis fills the GPU when few (expert, column block) tiles exist (batch 1:
six experts). The MoE uses it at <= 2 rows per expert where the tensor-core kernel of ``fp4_mma.py``
cannot run (before sm_89, the interpreter); ``fp8_linear`` keeps the split-K MMA kernel
(faster at 1-4 rows on the H200), the FP8 GEMV serves the shared expert's w1|w3 + SwiGLU.

Numerics (the official structure up to fp32 summation order, as ``fp8.py`` / ``fp4.py``):
  - FP4: an e2m1 code becomes ``value * 2^-6`` exactly (``lib.e2m1_f16``), the activation is the
    e4m3 value; every product is exact in fp32. Per scale group (32 MXFP4 / 16 NVFP4) the products
    are summed in fp32, then scaled by ``sB * 2^6 * sA`` (powers of two for MXFP4: exact; the e4m3
    NVFP4 block scale: one fp32 rounding) and accumulated; the NVFP4 fp32 global scale multiplies
    the final sum.
  - FP8: e4m3 x e4m3 products (exact in fp32) summed per 16, scaled by ``sA * sB`` per 128-K block.
  - ``A_BF16``: the activation is quantised in the prologue (the official ``act_quant``: UE8M0 scale
    per 1x128 block, RNE), bit-identical to ``fp8.act_quant_fp8``.
Outputs: bf16 (one rounding of the fp32 sum), or with split-K fp32 partials ``[S, M, N]`` summed in
split order by ``common.sum_splits`` or by the SwiGLU epilogue (``swiglu_quant``: w1/w3 halves ->
``swiglu_h`` -> FP8 h + scales, the grouped FP4 kernel's epilogue as a separate pass).

Grouped (MoE) mode: rows are pair rows sorted by expert, m-tiles of ``BM`` rows found by the same
binary search as the FP4 kernel (``lib.find_tile``); ``perm`` maps a sorted row to its pair.
"""
from __future__ import annotations

import torch

from ..lib import PDL_LAUNCH, QBLOCK, interpreting, target, triton_available, u8
from . import route
from .common import check_fp4, check_fp8_weight, launch_plan, log2_groups, nvfp4_row_scales, sum_splits, \
    weight_scales

if triton_available():
    import triton
    import triton.language as tl

    from ..lib import e2m1_f16, e4m3_bits, exp2i, pdl_wait, quant_rows, split_live, store_bf16, swiglu_h, tile_rows, ue8m0_exp

    @triton.jit
    def _row_dot(w, A, SA, row, k0, kb, stride_am, stride_sam, NG: tl.constexpr, KG: tl.constexpr,
                 A_BF16: tl.constexpr, INTERP: tl.constexpr):
        """One activation row against the decoded weight slab w f32 [BN, NG, KG] (the 128-K block at
        k0): (per-group fp32 sums [BN, NG] of exact products, the row's block scale sA)."""
        c = tl.arange(0, NG)[:, None] * KG + tl.arange(0, KG)[None, :]
        ptr = A + row * stride_am + k0 + c         # row: always a real row (the tile's padding repeats one)
        if A_BF16:   # the official act_quant of this 1x128 block, in the prologue
            x = tl.load(ptr).to(tl.float32)
            e = ue8m0_exp(tl.max(tl.max(tl.abs(x), axis=1), axis=0))
            v = tl.minimum(tl.maximum(x * exp2i(-e), -448.0), 448.0)
            if INTERP:
                q = e4m3_bits(v).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
            else:
                q = v.to(tl.float8e4nv)
            a = q.to(tl.float32)
            sa = exp2i(e)
        else:
            a = tl.load(ptr).to(tl.float8e4nv, bitcast=True).to(tl.float32)
            sa = tl.load(SA + row * stride_sam + kb)
        return tl.sum(w * a[None, :, :], axis=2), sa

    @triton.jit
    def _slab_load(wbase, WS, e64, rn64, nmask, g, kb, stride_wse, stride_wsn, WFMT: tl.constexpr,
                   SB_SHIFT: tl.constexpr, SB_E8M0: tl.constexpr, NG: tl.constexpr):
        """raw weight bytes [BN, NG, GB] and scales of K block kb."""
        if WFMT == 3:
            b = tl.load(wbase + kb * 128, mask=nmask[:, None, None], other=0)
            if SB_SHIFT == 7:
                sptr = WS + (rn64 >> 7) * stride_wsn + kb
            else:
                sptr = WS + rn64 * stride_wsn + kb
            if SB_E8M0:
                s = tl.load(sptr, mask=nmask, other=127)
            else:
                s = tl.load(sptr, mask=nmask, other=0.0)
        else:
            b = tl.load(wbase + kb * 64, mask=nmask[:, None, None], other=0)
            s = tl.load(WS + e64 * stride_wse + rn64[:, None] * stride_wsn + kb * NG + g[None, :], mask=nmask[:, None],
                        other=0)
        return b, s

    @triton.jit
    def _gemv_kernel(A, SA, W, WS, WS2, C, PERM, OFFS, TCUM,
                     M, N, K, n_groups, top_k, k_per_split,
                     stride_am, stride_sam, stride_we, stride_wn, stride_wse, stride_wsn, stride_w2e,
                     stride_cm,
                     WFMT: tl.constexpr, SB_SHIFT: tl.constexpr, SB_E8M0: tl.constexpr,
                     A_BF16: tl.constexpr, GROUPED: tl.constexpr, GATHER: tl.constexpr,
                     USE_ASM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NG: tl.constexpr,
                     GB: tl.constexpr, LOG2G: tl.constexpr, SPLIT: tl.constexpr, INTERP: tl.constexpr):
        """WFMT 0 MXFP4, 1 NVFP4, 3 FP8. One K step = one 128-wide activation block; the weight slab
        is [BN, NG, GB] bytes (FP4: NG scale groups of GB bytes, decoded and interleaved to [BN, NG,
        2 GB] values; FP8: [BN, 8, 16]), in the layout it is loaded in (every product and group sum
        inside one thread). BM in (1, 2, 4) rows, one accumulator each (a 4-D broadcast would make Triton
        pick a layout that moves the weights through shared memory)."""
        pdl_wait()
        t = tl.program_id(0)
        pid_n = tl.program_id(1)
        ks = tl.program_id(2)
        e, m0, m_end, live = tile_rows(TCUM, OFFS, M, t, n_groups, BM, LOG2G, GROUPED)
        if not live:
            return
        # activation rows of the tile (scalars: up to 4)
        v0 = m0 < m_end
        v1 = m0 + 1 < m_end
        v2 = m0 + 2 < m_end
        v3 = m0 + 3 < m_end
        if GATHER:
            a0 = tl.load(PERM + m0, mask=v0, other=0).to(tl.int64) // top_k
            a1 = a0
            a2 = a0
            a3 = a0
            if BM > 1:
                a1 = tl.load(PERM + m0 + 1, mask=v1, other=0).to(tl.int64) // top_k
            if BM > 2:
                a2 = tl.load(PERM + m0 + 2, mask=v2, other=0).to(tl.int64) // top_k
                a3 = tl.load(PERM + m0 + 3, mask=v3, other=0).to(tl.int64) // top_k
        else:     # rows past the end repeat the last row (results dropped at the store)
            a0 = m0.to(tl.int64)
            a1 = tl.minimum(a0 + 1, M - 1)
            a2 = tl.minimum(a0 + 2, M - 1)
            a3 = tl.minimum(a0 + 3, M - 1)
        rn = pid_n * BN + tl.arange(0, BN)
        nmask = rn < N
        rn64 = rn.to(tl.int64)
        e64 = e.to(tl.int64)
        g = tl.arange(0, NG)
        j = tl.arange(0, GB)
        wbase = W + e64 * stride_we + rn64[:, None, None] * stride_wn + (g[:, None] * GB + j[None, :])[None, :, :]
        acc0 = tl.zeros([BN, NG], tl.float32)
        acc1 = tl.zeros([BN, NG], tl.float32)
        acc2 = tl.zeros([BN, NG], tl.float32)
        acc3 = tl.zeros([BN, NG], tl.float32)
        KG: tl.constexpr = GB if WFMT == 3 else 2 * GB       # K values per scale group in the slab
        kb_lo = (ks * k_per_split) // 128
        kb_hi = tl.minimum(K, ks * k_per_split + k_per_split) // 128
        for kb in range(kb_lo, kb_hi):
            k0 = kb * 128
            b, sraw = _slab_load(wbase, WS, e64, rn64, nmask, g, kb, stride_wse, stride_wsn,
                                 WFMT, SB_SHIFT, SB_E8M0, NG)
            if WFMT == 3:
                w = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                if SB_E8M0:
                    sbb = sraw.to(tl.int32)
                    sb = tl.where(sbb == 0, 5.877471754111438e-39, (sbb << 23).to(tl.float32, bitcast=True))
                else:
                    sb = sraw
                sb = sb[:, None]
            else:
                wl, wh = e2m1_f16(b, USE_ASM)            # even / odd K elements, value * 2^-6
                w = tl.reshape(tl.join(wl, wh), [BN, NG, 2 * GB]).to(tl.float32)
                if WFMT == 0:
                    sb = ((sraw.to(tl.int32) + 6) << 23).to(tl.float32, bitcast=True)   # 2^(byte-127) * 2^6
                else:
                    sb = sraw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 64.0
            p, sa = _row_dot(w, A, SA, a0, k0, kb, stride_am, stride_sam, NG, KG, A_BF16, INTERP)
            acc0 += p * (sb * sa)
            if BM > 1:
                p, sa = _row_dot(w, A, SA, a1, k0, kb, stride_am, stride_sam, NG, KG, A_BF16, INTERP)
                acc1 += p * (sb * sa)
            if BM > 2:
                p, sa = _row_dot(w, A, SA, a2, k0, kb, stride_am, stride_sam, NG, KG, A_BF16, INTERP)
                acc2 += p * (sb * sa)
                p, sa = _row_dot(w, A, SA, a3, k0, kb, stride_am, stride_sam, NG, KG, A_BF16, INTERP)
                acc3 += p * (sb * sa)
        if WFMT == 1:
            s2 = tl.load(WS2 + e64 * stride_w2e + rn64, mask=nmask, other=0.0)
        else:
            s2 = tl.full([BN], 1.0, tl.float32)
        _gemv_store(C, tl.sum(acc0, axis=1) * s2, m0, m_end, rn64, nmask, ks, M, N, stride_cm, SPLIT, INTERP)
        if BM > 1:
            _gemv_store(C, tl.sum(acc1, axis=1) * s2, m0 + 1, m_end, rn64, nmask, ks, M, N, stride_cm, SPLIT, INTERP)
        if BM > 2:
            _gemv_store(C, tl.sum(acc2, axis=1) * s2, m0 + 2, m_end, rn64, nmask, ks, M, N, stride_cm, SPLIT, INTERP)
            _gemv_store(C, tl.sum(acc3, axis=1) * s2, m0 + 3, m_end, rn64, nmask, ks, M, N, stride_cm, SPLIT, INTERP)

    @triton.jit
    def _gemv_store(C, y, r, m_end, rn64, nmask, ks, M, N, stride_cm, SPLIT: tl.constexpr, INTERP: tl.constexpr):
        r64 = r.to(tl.int64)
        mask = nmask & ((rn64 * 0 + r64) < m_end)
        if SPLIT:
            tl.store(C + ks.to(tl.int64) * M * N + r64 * N + rn64, y, mask=mask)
        else:
            store_bf16(C + r64 * stride_cm + rn64, y, mask, INTERP)

    @triton.jit
    def _swiglu_quant_kernel(WSP, H, HS, PW, PERM, M, N2, n_half, S, limit, stride_hm, stride_hsm, stride_hsc,
                             GATHER: tl.constexpr, HAS_PW: tl.constexpr, BR: tl.constexpr, INTERP: tl.constexpr,
                             SPLIT: tl.constexpr):
        """h[r, 128 c ..] = FP8(swiglu_h(sum_s WSP[s, r, cols], sum_s WSP[s, r, n_half + cols])); WSP fp32
        partials or (S = 1) bf16 values. One program: BR rows x one 128-column block. SPLIT: the block's
        columns stored in ``fp4_fp8_ws``'s group split order (each 32-column group's 16 even columns, then its 16
        odd ones), permuted in registers before a contiguous store (a per-element scattered byte store was
        slower than a separate permutation pass)."""
        pdl_wait()
        r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
        rm = r < M
        c = tl.program_id(1)
        i = c * 128 + tl.arange(0, 128)
        base = WSP + r[:, None] * N2 + i[None, :]
        gs = tl.zeros([BR, 128], tl.float32)
        us = tl.zeros([BR, 128], tl.float32)
        plane = M * N2
        # the routing weights first: their loads (and the pair gather's) overlap the partials' round trip
        if HAS_PW:
            if GATHER:
                pair = tl.load(PERM + r, mask=rm, other=0).to(tl.int64)
            else:
                pair = r
            pw = tl.load(PW + pair, mask=rm, other=0.0)
        else:
            pw = tl.zeros([BR], tl.float32)
        for s in range(0, S, 2):            # two splits (four loads) per round trip, added in split order
            m1 = split_live(rm[:, None], s + 1, S)
            g0 = tl.load(base + s * plane, mask=rm[:, None], other=0.0).to(tl.float32)
            u0 = tl.load(base + s * plane + n_half, mask=rm[:, None], other=0.0).to(tl.float32)
            g1 = tl.load(base + (s + 1) * plane, mask=m1, other=0.0).to(tl.float32)
            u1 = tl.load(base + (s + 1) * plane + n_half, mask=m1, other=0.0).to(tl.float32)
            gs += g0
            us += u0
            gs += g1
            us += u1
        h = swiglu_h(gs, us, pw, limit, HAS_PW)
        q, eh = quant_rows(h, INTERP)
        qb = q.to(tl.uint8, bitcast=True)
        if SPLIT:
            qb = tl.reshape(tl.permute(tl.reshape(qb, [BR, 4, 16, 2]), (0, 1, 3, 2)), [BR, 128])
        tl.store(H + r[:, None] * stride_hm + i[None, :], qb, mask=rm[:, None])
        tl.store(HS + r * stride_hsm + c * stride_hsc, exp2i(eh), mask=rm)


# -------------------------------------------------------------------------------------------------
# host side

def gemv_launch(a, sa, w, ws, ws2, M, N, K, *, wfmt: str, out=None, partial: bool = False,
                a_bf16: bool = False, perm=None, offs=None, tcum=None, top_k: int = 1, n_groups: int = 1,
                n_tiles: int | None = None, bm: int = 1, split: int | None = None, config: dict | None = None,
                use_asm: bool | None = None, split_sum: bool = True):
    """Launch the decode GEMV. a: e4m3 bytes (or bf16 with ``a_bf16``) [rows, K]; sa fp32 [rows, K/128]
    (unused with ``a_bf16``). w: FP4 packed uint8 [G, N, K/2] with scales uint8 [G, N, K/32] (mxfp4) /
    e4m3 bytes [G, N, K/16] + fp32 ws2 [G, N] (nvfp4), or FP8 e4m3 [N, K] with ws [N/128, K/128] or
    per-row [N, K/128] (e8m0 bytes or fp32). Returns bf16 ``out`` [M, N], or with ``partial`` the fp32
    split partials [S, M, N]; ``split_sum=False``: the partials unsummed where K is split, bf16 [M, N]
    where it is not."""
    if bm not in (1, 2, 4):
        raise ValueError(f"gemv: tile rows bm must be 1, 2 or 4, got {bm}")
    dev = w.device
    t = target(dev)
    fp8 = wfmt == "fp8"
    cfg = dict(route.gemv_config(N, t, fp8))
    if config:
        cfg.update(config)
    BN = cfg.pop("BN")
    grouped = tcum is not None
    grid, kps, dst = launch_plan(M, N, K, bm, BN, grouped=grouped, n_tiles=n_tiles, n_groups=n_groups,
                                 split=split or cfg.pop("SPLIT_K", None), partial=partial, out=out, dev=dev, t=t)
    if fp8:
        wsv, sb_e8m0, per_row = weight_scales(w, ws)
        wv = u8(w)
        strides = (0, wv.stride(0), 0, wsv.stride(0), 0)
        ng, gb, wfmt_i = 8, 16, 3
    else:
        sb_e8m0, per_row, wsv, wv = False, False, ws, w
        strides = (w.stride(0), w.stride(1), ws.stride(0), ws.stride(1), ws2.stride(0) if ws2 is not None else 0)
        ng, gb, wfmt_i = (4, 16, 0) if wfmt == "mxfp4" else (8, 8, 1)
    if use_asm is None:
        use_asm = t.use_asm
    kw = {} if interpreting() else {k: v for k, v in cfg.items() if k in ("num_warps", "num_stages")}
    _gemv_kernel[grid](
        a, sa if sa is not None else wsv, wv, wsv, ws2 if ws2 is not None else wsv, dst,
        perm if perm is not None else wsv, offs if offs is not None else wsv,
        tcum if tcum is not None else wsv, M, N, K, n_groups, top_k, kps,
        a.stride(0), sa.stride(0) if sa is not None else 0, *strides, dst.stride(-2),
        WFMT=wfmt_i, SB_SHIFT=0 if per_row else 7, SB_E8M0=sb_e8m0, A_BF16=a_bf16, GROUPED=grouped,
        GATHER=perm is not None, USE_ASM=use_asm, BM=bm, BN=BN, NG=ng, GB=gb,
        LOG2G=log2_groups(n_groups), SPLIT=dst.dtype == torch.float32, INTERP=interpreting(), **kw, **PDL_LAUNCH)
    if partial or not split_sum:
        return dst
    return sum_splits(dst, out)


def swiglu_quant(partials: torch.Tensor, limit: float, pw=None, perm=None, out=None, split_order: bool = False):
    """fp32 partials [S, M, 2I] of the w1|w3 GEMM, or its bf16 output [1, M, 2I] -> (h e4m3 bytes [M, I],
    hs fp32 [M, I/128]):
    the official expert middle (``lib.swiglu_h``: bf16 rounding, clamps, silu, routing weight ``pw``
    per pair id, one bf16 rounding) and its FP8 1x128 quantisation. ``out``: the caller's (h, hs) to
    write (h row-major, hs in any layout: a block-major [I/128, M] buffer's [M, I/128] view too).
    ``split_order``: h's columns in ``fp4_fp8_ws``'s group split order (``fp4_fp8_ws.split_k_order`` of h)."""
    S, M, N2 = partials.shape
    I = N2 // 2
    if I % QBLOCK:
        raise ValueError(f"swiglu_quant: intermediate size {I} must be a multiple of 128")
    dev = partials.device
    if out is None:
        out = (torch.empty(M, I, dtype=torch.uint8, device=dev),
               torch.empty(M, I // QBLOCK, dtype=torch.float32, device=dev))
    h, hs = out
    if tuple(h.shape) != (M, I) or h.stride(1) != 1 or tuple(hs.shape) != (M, I // QBLOCK):
        raise ValueError(f"swiglu_quant: out must be h [{M}, {I}] (row-major) and hs [{M}, {I // QBLOCK}], got "
                         f"{tuple(h.shape)} strides {h.stride()} and {tuple(hs.shape)}")
    if M:
        br = route.swiglu_rows(M)
        kw = {} if interpreting() else {"num_warps": 4}
        _swiglu_quant_kernel[(triton.cdiv(M, br), I // QBLOCK)](
            partials, h, hs, pw if pw is not None else partials, perm if perm is not None else partials,
            M, N2, I, S, float(limit), h.stride(0), hs.stride(0), hs.stride(1), GATHER=perm is not None,
            HAS_PW=pw is not None, BR=br, INTERP=interpreting(), SPLIT=split_order, **kw, **PDL_LAUNCH)
    return h, hs


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, xs: torch.Tensor | None = None,
             config: dict | None = None) -> torch.Tensor:
    """bf16 [M, N] = the official FP8 linear of a few rows: x bf16 [M, K] (quantised in the
    prologue), or e4m3 x with its scales ``xs``. Same products as ``fp8.fp8_gemm``."""
    check_fp8_weight(w, ws)
    M, K = x.shape
    N = w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"fp8_gemv: x {tuple(x.shape)} vs w {tuple(w.shape)}")
    out = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    if M == 0:
        return out
    a_bf16 = xs is None
    a = x.to(torch.bfloat16).contiguous() if a_bf16 else u8(x.contiguous())
    bm = route.rows_tile(M)
    return gemv_launch(a, None if a_bf16 else xs.float().contiguous(), w.contiguous(), ws.contiguous(), None,
                       M, N, K, wfmt="fp8", out=out, a_bf16=a_bf16, bm=bm, config=config)


def fp4_gemv(xq, xs, w_packed, w_scale, fmt: str = "mxfp4", w_scale_2=None, config: dict | None = None):
    """bf16 [M, N] = FP8 activations x FP4 weights (the ``fp4.fp4_gemm`` contract) on the GEMV kernel."""
    N, K = check_fp4(w_packed, w_scale, fmt, w_scale_2)
    M = xq.shape[0]
    dev = w_packed.device
    out = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
    if M == 0:
        return out
    ws2 = nvfp4_row_scales(w_scale_2, N, dev) if fmt == "nvfp4" else None
    bm = route.rows_tile(M)
    return gemv_launch(u8(xq.contiguous()), xs.float().contiguous(), u8(w_packed).contiguous()[None],
                       u8(w_scale).contiguous()[None], ws2, M, N, K, wfmt=fmt, out=out, bm=bm, config=config)


__all__ = ["fp4_gemv", "fp8_gemv", "gemv_launch", "swiglu_quant"]
