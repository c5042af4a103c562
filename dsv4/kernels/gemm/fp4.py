"""FP8 x FP4 (MXFP4 / NVFP4) expert GEMM, Triton (spec §3, §11.3; kernels-and-formats §5): plain or grouped
(MoE: one launch over all active experts, ``common``'s tile enumeration), optional SwiGLU epilogue.

``fp4_gemm(xq, xs, w_packed, w_scale, fmt, w_scale_2)``: FP8 activations x FP4 e2m1 weights
``[N, K/2]`` (low nibble = even element), MXFP4 (e8m0 scale per 32) or NVFP4 (e4m3 scale per 16,
fp32 global ``w_scale_2``) -> bf16 ``[M, N]``. ``fp4_launch``: the low-level launch (grouped / gather /
SwiGLU modes) that ``kernels.moe`` drives. Twin: ``dsv4.twins.gemm.fp4_gemm`` (the dequantised weight,
fp32 GEMM).

Path ``"dequant"`` (every GPU with e4m3, the default but on sm_100 for MXFP4; ``route.fp4_path``): the
weights are dequantised in registers and fed to fp16 tensor-core MMAs with fp32 accumulation:
  - an e2m1 code becomes an e4m3 byte worth ``value * 2^-6`` exactly, converted to an exact f16
    (``lib.e2m1_f16``);
  - activations: e4m3 values are exact in f16, so the A operand is the f16 copy of the quantised
    activation (``common.f16_operand``); the kernel loads its even and odd elements separately
    (stride 2), so the low and the high nibbles of a weight byte multiply them in two K=16 dots per
    32-group;
  - every product (f16 x f16) is exact in fp32 and the MMA accumulates in fp32;
  - MXFP4, tiles of < 64 rows: per 32-group ``blk += P_32 * (sB[col, g] * 2^6)``, per 128-block
    ``acc += blk * sA[row, kb]``: the official ``fp4_gemm`` structure up to fp32 summation order;
  - MXFP4, tiles of >= 64 rows: the per-32 scale relative to the largest of its 128-block,
    ``2^(s_g - s_max)``, is folded into the f16 weight (one K=128 MMA chain per block): exact while a
    row's four group scales inside one 128-block span <= 2^16; beyond that the smallest groups round
    (relative 2^-17 of the block's largest values). ``mx_fold=False`` keeps the per-group promotion;
  - NVFP4: the e4m3 block scale is folded into the f16 weight (exact), ``acc += P_32 * sA``, and the
    fp32 global scale (times 2^6) multiplies once at the end (one fp32 rounding moved vs the twin).
Path ``"scaled"`` (sm_100, MXFP4): ``tl.dot_scaled(e4m3 x e2m1)`` with the e8m0 activation scale
repeated per 32 (native ``tcgen05.mma ... kind::mxf8f6f4.block_scale.block32`` for 128-row tiles;
compile-tested, not run). NVFP4 stays on the dequant path there: Triton 3.9 requires equal scale
groups for both operands and 3.6 miscompiles an e4m3 x nvfp4 ``dot_scaled``.

The SwiGLU mode computes the w1 and w3 tiles of the same 128 output columns in one program and emits
the routing-weighted, bf16-rounded, FP8-quantised ``h`` (next GEMM's operand) directly. Tiles:
``route.fp4_config``.
"""
from __future__ import annotations

import torch

from ..lib import PDL_LAUNCH, QBLOCK, interpreting, target, triton_available, u8
from . import route
from .common import check_fp4, f16_operand, fp4_kernel_args, log2_groups, nvfp4_row_scales

if triton_available():
    import triton
    import triton.language as tl

    from ..lib import e2m1_f16, pdl_wait
    from .common import fp4_epilogue, tile

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
            wl, wh = e2m1_f16(b, USE_ASM)
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
        pdl_wait()
        pid_n = tl.program_id(1)
        live, r64, mrow, pair, arow, rn64, nmask, e64 = tile(TCUM, OFFS, PERM, M, N_out, tl.program_id(0), pid_n,
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
        fp4_epilogue(C, CS, PW, acc, acc2, pair, r64, mrow, rn64, nmask, pid_n, stride_cm, stride_csm, limit,
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
        pdl_wait()
        pid_n = tl.program_id(1)
        live, r64, mrow, pair, arow, rn64, nmask, e64 = tile(TCUM, OFFS, PERM, M, N_out, tl.program_id(0), pid_n,
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
        fp4_epilogue(C, CS, PW, acc, acc2, pair, r64, mrow, rn64, nmask, pid_n, stride_cm, stride_csm, limit,
                      SWIGLU, HAS_PW, BM, INTERP)




def fp4_launch(a, sa, w, ws, ws2, out, out_s, M, N_out, K, n_half, *, fmt, swiglu=False, limit=0.0,
               perm=None, offs=None, tcum=None, pw=None, top_k=1, n_groups=1, n_tiles=None,
               path=None, config=None, use_asm=None, mx_fold=True):
    """Low-level launch of the FP4 GEMM (plain or grouped, optional SwiGLU epilogue).

    a: for path 'dequant' the f16 operand (``common.f16_operand``), for 'scaled' e4m3 bytes; [rows, K].
    w: packed uint8 [G, N, K/2]; ws: uint8 scales [G, N, K/32] (mx) or e4m3 bytes [G, N, K/16] (nv);
    ws2: fp32 [G, N] per-row global scales (nv). Grouped when ``tcum`` is given: rows are sorted
    pair rows, ``offs`` [G+1] their per-expert starts, ``tcum`` [G+1] the tile prefix sum, ``perm``
    (optional) the pair id of each sorted row (activation row = pair // top_k), ``pw`` the fp32
    routing weight per pair id. Output: bf16 [rows, N_out], or with ``swiglu`` the f16-layout
    e4m3 bytes of h [rows, N_out] and its scales ``out_s`` [rows, N_out/128]."""
    dev = a.device
    t = target(dev)
    path = path or route.fp4_path(fmt, t)
    cfg = route.fp4_config(M / max(1, n_groups), t, swiglu)
    if config:
        cfg.update(config)
        if swiglu and "num_warps" not in config:
            cfg.update({k: v for k, v in route.fp4_config(0, t, True).items() if k == "num_warps"})
            if cfg["BM"] >= 32 and t.compiled:
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
    common = dict(GROUPED=grouped, GATHER=perm is not None, SWIGLU=swiglu, HAS_PW=pw is not None,
                  BM=BM, BN=BN, LOG2G=log2_groups(n_groups), INTERP=interpreting())
    if path == "scaled":
        if fmt != "mxfp4":
            raise ValueError("the dot_scaled path takes MXFP4 weights only")
        _fp4_scaled_kernel[grid](
            a, sa, w, ws, out, out_s if out_s is not None else dummy,
            perm if perm is not None else sa, offs if offs is not None else sa,
            tcum if tcum is not None else sa, pw if pw is not None else sa,
            M, N_out, K, n_half, n_groups, top_k, a.stride(0), sa.stride(0), w.stride(0), w.stride(1),
            ws.stride(0), ws.stride(1), out.stride(0), out_s.stride(0) if out_s is not None else 0,
            float(limit), **common, **kw, **PDL_LAUNCH)
        return
    if use_asm is None:
        use_asm = t.use_asm
    _fp4_gemm_kernel[grid](
        *fp4_kernel_args(a, sa, w, ws, ws2, out, out_s, perm, offs, tcum, pw, M, N_out, K, n_half, n_groups,
                         top_k, limit),
        FMT=(2 if (BM >= 64 and mx_fold) else 0) if fmt == "mxfp4" else 1, USE_ASM=use_asm, **common, **kw,
        **PDL_LAUNCH)


def fp4_gemm(xq: torch.Tensor, xs: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor,
             fmt: str = "mxfp4", w_scale_2: torch.Tensor | None = None, path: str | None = None,
             config: dict | None = None, a16: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 [M, N] = FP8 activations (xq e4m3 [M, K], xs fp32 [M, K/128]) x FP4 weights (module
    doc). ``a16`` (the f16 operand from ``act_quant_fp8(x, with_f16=True)``) saves a conversion."""
    N, K = check_fp4(w_packed, w_scale, fmt, w_scale_2)
    M = xq.shape[0] if xq is not None else a16.shape[0]
    dev = w_packed.device
    path = path or route.fp4_path(fmt, target(dev))
    out = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
    if M == 0:
        return out
    w = u8(w_packed).contiguous().unsqueeze(0)
    ws = u8(w_scale).contiguous().unsqueeze(0)
    ws2 = nvfp4_row_scales(w_scale_2, N, dev) if fmt == "nvfp4" else None
    if path == "scaled":
        a = u8(xq.contiguous())
    else:
        a = a16 if a16 is not None else f16_operand(xq)
    fp4_launch(a, xs.float().contiguous(), w, ws, ws2, out, None, M, N, K, 0, fmt=fmt, path=path,
               config=config)
    return out


__all__ = ["fp4_gemm", "fp4_launch"]
