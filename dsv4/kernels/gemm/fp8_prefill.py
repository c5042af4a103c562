"""Prefill-oriented block-scaled FP8 GEMM: variants of ``fp8.fp8_gemm`` (plain mode) to sweep on Hopper.

Contract and numerics are those of ``fp8.fp8_gemm``: e4m3 activations ``xq [M, K]`` with fp32
power-of-two scales ``xs [M, K/128]``, e4m3 weights ``w [N, K]`` with 128x128 block scales
``ws [N/128, K/128]`` (e8m0 or fp32; per-row ``[N, K/128]`` also accepted) -> bf16 ``[M, N]``. For every
128-wide K block a fresh fp32 partial ``P = A_blk . B_blk^T`` (fp8 tensor-core dot), then
``acc += P * (sA[row, kb] * sB[col // 128, kb])`` in increasing K order, one bf16 rounding. Under the
CPU interpreter every variant gives the same bits as ``twins.gemm.fp8_gemm``
(tests/test_kernels_fp8_prefill.py).

Variants, selected through ``config`` (keys of ``DEFAULT_CONFIG``):

* ``LOAD``: ``"ptr"`` (masked pointer loads, as fp8.py; cp.async), ``"tma"`` (host
  ``TensorDescriptor`` objects passed by value; bulk tensor copies, rows past M / N zero-filled by the
  copy engine) or ``"tma_dev"`` (``tl.make_tensor_descriptor`` in the kernel; global scratch from
  ``triton.set_allocator``, set here on first use). TMA needs 16-byte aligned bases and row strides
  (always true for K % 128 == 0 and fresh tensors); otherwise the launcher falls back to ``"ptr"``.
* ``WS``: Triton's automatic warp specialization (``tl.range(..., warp_specialize=True)``). With
  Triton 3.6 on sm_90 it applies only with ``num_warps=4`` and TMA loads; the kernel then runs with
  12 warps: a TMA producer warpgroup (``setmaxnreg`` 40) and two consumer warpgroups (232 registers)
  that each own BM/2 rows of the tile and synchronise on their own named barriers, so one consumer's
  FFMA promotion can overlap the other's wgmma (DeepGEMM's structure). With num_warps=8 the flag
  is silently ignored; with pointer loads the 3.6 compiler asserts (rejected here); with ``EPI_TMA``
  the WS pass fails (rejected here). Triton 3.9 (this CI machine) compiles WS only with ``tma_dev``
  (its data partitioning splits the A tile per consumer and rejects a host descriptor whose block
  is the whole tile); 3.6 compiles both. On sm_100, 3.6 and 3.9 spill / exceed shared memory with WS:
  Blackwell defaults to the non-specialised TMA variant.
* ``BM`` x ``BN`` tile in ``NSUB`` column sub-tiles of ``W = BN/NSUB`` columns: per K block and
  sub-tile j, ``P_j = dot`` then ``acc_j += P_j * f_j`` (for W <= 128 the weight scale is one scalar
  per sub-tile and K block). ``BN=256, NSUB=2`` is the 128x256 tile (half the L2->SM operand traffic
  per FLOP of 128x128) and needs the two partials *not* to be live at once: Triton's scheduler
  hoists dot1 above promote0 (both partials live: 256 registers, spills), ``ORDER=True`` makes
  dot1's zero accumulator depend on acc0 through an opaque ``mov 0`` (64 extra MOVs per K block) so
  that the order dot0, promote0, dot1, promote1 is kept: spill-free with ``WS`` (ptxas, sm_90a).
  The wgmma then accumulates onto +0.0 instead of starting fresh: the same values. (The interpreter
  takes the plain dot: the inline asm only runs compiled.)
* ``PERSISTENT``: about one program per SM looping over output tiles in grouped order; ``FLATTEN``
  flattens the tile and K loops (next tile's loads during this tile's epilogue); ``WS`` then
  applies to the tile loop, else to the K loop.
* ``SA_T``: the activation scales are transposed on the host (``[K/128, M]``: one contiguous vector
  per K block instead of a K/128-strided gather; one small extra copy).
* ``EPI_TMA``: the bf16 tile is written with a TMA store (falls back to masked stores when ``out``'s
  base or row stride is not 16-byte aligned, e.g. N % 8 != 0).
* ``num_warps`` / ``num_stages``, ``GROUP_M`` (grouped-ordering height).

Current choice: ``route.fp8_prefill_config`` (TMA loads, 64 x 128 tiles, 3 stages, the TMA store
epilogue, grouped order over 64 row blocks); ``linear.fp8_gemm`` routes prefill-sized calls
(``route.PREFILL_MIN_ROWS``, sm_90) here. The warp-specialized Gluon version of the same math
(``experiments/fp8_ws.py``) is not routed to. Measurements and static facts:
docs/kernel-measurements.md.
"""
from __future__ import annotations

import torch

from ..lib import PDL_LAUNCH, QBLOCK, interpreting, target, triton_available, u8
from . import route
from .common import check_fp8_weight, ensure_tma_allocator, weight_scales

LOADS = {"ptr": 0, "tma": 1, "tma_dev": 2}

DEFAULT_CONFIG = {"BM": 128, "BN": 128, "NSUB": 1, "ORDER": False, "GROUP_M": 8, "LOAD": "tma",
                  "PERSISTENT": False, "FLATTEN": False, "WS": False, "SA_T": True, "EPI_TMA": False,
                  "num_warps": 8, "num_stages": 4}

if triton_available():
    import triton
    import triton.language as tl

    from ..lib import grouped_tile, pdl_wait, rne_bf16

    @triton.jit
    def _pf_sb(SB, n0, kb, N, stride_sbn, W: tl.constexpr, SB_E8M0: tl.constexpr, SB_ROW: tl.constexpr):
        """Weight scales of columns n0 .. n0+W for K block kb: a scalar when the scales are per
        128x128 block and the W columns lie in one block (W <= 128, n0 % W == 0), else a [W] vector."""
        if SB_ROW or W > 128:
            rn = n0 + tl.arange(0, W)
            if SB_ROW:
                ptr = SB + rn.to(tl.int64) * stride_sbn + kb
            else:
                ptr = SB + (rn >> 7).to(tl.int64) * stride_sbn + kb
            if SB_E8M0:
                sbb = tl.load(ptr, mask=rn < N, other=127).to(tl.int32)
            else:
                sb = tl.load(ptr, mask=rn < N, other=0.0)
        else:
            ptr = SB + (n0 >> 7).to(tl.int64) * stride_sbn + kb
            if SB_E8M0:
                sbb = tl.load(ptr).to(tl.int32)
            else:
                sb = tl.load(ptr)
        if SB_E8M0:   # 2^(byte-127); byte 0 is the subnormal 2^-127
            sb = tl.where(sbb == 0, 5.877471754111438e-39, (sbb << 23).to(tl.float32, bitcast=True))
        return sb

    @triton.jit
    def _pf_factor(sa, sb, SCALAR_SB: tl.constexpr):
        """[BM, 1] or [BM, W] promotion factor sA * sB (exact: powers of two)."""
        if SCALAR_SB:
            f = (sa * sb)[:, None]
        else:
            f = sa[:, None] * sb[None, :]
        return f

    @triton.jit
    def _pf_load(D, r0, k0, R, stride_r, ROWS: tl.constexpr, LOAD: tl.constexpr):
        """[ROWS, 128] e4m3 tile of a row-major [R, K] operand at (r0, k0): pointer load (rows >= R
        read as 0) or TMA (the copy engine zero-fills rows >= R)."""
        if LOAD == 0:
            r = r0 + tl.arange(0, ROWS)
            k = k0 + tl.arange(0, 128)
            t = tl.load(D + r.to(tl.int64)[:, None] * stride_r + k[None, :], mask=(r < R)[:, None], other=0)
            t = t.to(tl.float8e4nv, bitcast=True)
        else:
            t = D.load([r0, k0])
        return t

    @triton.jit
    def _pf_store(C, acc, m0, n0, M, N, stride_cm, BM: tl.constexpr, W: tl.constexpr,
                  EPI_TMA: tl.constexpr, INTERP: tl.constexpr):
        if INTERP:   # the interpreter's bf16 cast truncates: round to nearest even on the bits first
            acc = rne_bf16(acc)
        if EPI_TMA:
            C.store([m0, n0], acc.to(tl.bfloat16))
        else:
            rm = m0 + tl.arange(0, BM)
            rn = n0 + tl.arange(0, W)
            tl.store(C + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :], acc.to(tl.bfloat16),
                     mask=(rm < M)[:, None] & (rn < N)[None, :])

    @triton.jit
    def _pf_tile(A, SA, B, SB, C, pid_m, pid_n, M, N, K, stride_am, stride_bn, stride_cm, stride_sam, stride_sak,
                 stride_sbn, BM: tl.constexpr, BN: tl.constexpr, NSUB: tl.constexpr, LOAD: tl.constexpr,
                 SB_E8M0: tl.constexpr, SB_ROW: tl.constexpr, EPI_TMA: tl.constexpr, KWS: tl.constexpr,
                 ORDER: tl.constexpr, INTERP: tl.constexpr):
        """One BM x BN output tile: the K loop and the bf16 store. Per K block and sub-tile j (source
        order dot0, promote0, dot1, promote1): P_j = A_blk . B_j^T (fresh fp32), acc_j += P_j * f_j.
        KWS: warp-specialize the K loop. ORDER: keep dot1 after promote0 (module doc)."""
        W: tl.constexpr = BN // NSUB
        SCALAR_SB: tl.constexpr = (not SB_ROW) and W <= 128
        m0 = pid_m * BM
        n0 = pid_n * BN
        rm = m0 + tl.arange(0, BM)
        sa_ptr = SA + rm.to(tl.int64) * stride_sam
        mm = rm < M
        acc0 = tl.zeros([BM, W], tl.float32)
        acc1 = tl.zeros([BM, W], tl.float32)
        for kb in tl.range(0, K // 128, warp_specialize=KWS):
            k0 = kb * 128
            a = _pf_load(A, m0, k0, M, stride_am, BM, LOAD)
            sa = tl.load(sa_ptr + kb * stride_sak, mask=mm, other=0.0)
            b0 = _pf_load(B, n0, k0, N, stride_bn, W, LOAD)
            p0 = tl.dot(a, tl.trans(b0))
            acc0 += p0 * _pf_factor(sa, _pf_sb(SB, n0, kb, N, stride_sbn, W, SB_E8M0, SB_ROW), SCALAR_SB)
            if NSUB == 2:
                b1 = _pf_load(B, n0 + W, k0, N, stride_bn, W, LOAD)
                if ORDER and not INTERP:   # zeros that depend on acc0: dot1 cannot move above promote0
                    z1 = tl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [acc0], dtype=tl.float32,
                                                   is_pure=True, pack=1)
                    p1 = tl.dot(a, tl.trans(b1), z1)
                else:
                    p1 = tl.dot(a, tl.trans(b1))
                acc1 += p1 * _pf_factor(sa, _pf_sb(SB, n0 + W, kb, N, stride_sbn, W, SB_E8M0, SB_ROW), SCALAR_SB)
        _pf_store(C, acc0, m0, n0, M, N, stride_cm, BM, W, EPI_TMA, INTERP)
        if NSUB == 2:
            _pf_store(C, acc1, m0, n0 + W, M, N, stride_cm, BM, W, EPI_TMA, INTERP)

    @triton.jit(do_not_specialize=['M', 'stride_sak'])
    def _fp8_prefill_kernel(A, SA, B, SB, C, M, N, K, stride_am, stride_bn, stride_cm, stride_sam, stride_sak,
                            stride_sbn,
                            BM: tl.constexpr, BN: tl.constexpr, NSUB: tl.constexpr, GROUP_M: tl.constexpr,
                            LOAD: tl.constexpr, PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr,
                            WS: tl.constexpr, SB_E8M0: tl.constexpr, SB_ROW: tl.constexpr,
                            EPI_TMA: tl.constexpr, ORDER: tl.constexpr, INTERP: tl.constexpr):
        """A / B: e4m3 [M, K] / [N, K] (uint8 for LOAD 0, host descriptors for 1, fp8 pointers for 2);
        SA fp32 activation scales (row stride stride_sam, K-block stride stride_sak); SB weight scales
        (e8m0 bytes or fp32); C bf16 [M, N] (a descriptor for EPI_TMA with LOAD 1)."""
        pdl_wait()
        W: tl.constexpr = BN // NSUB
        if LOAD == 2:   # device-side descriptors (global scratch from triton.set_allocator)
            A = tl.make_tensor_descriptor(A, shape=[M, K], strides=[stride_am, 1], block_shape=[BM, 128])
            B = tl.make_tensor_descriptor(B, shape=[N, K], strides=[stride_bn, 1], block_shape=[W, 128])
            if EPI_TMA:
                C = tl.make_tensor_descriptor(C, shape=[M, N], strides=[stride_cm, 1], block_shape=[BM, W])
        num_m = tl.cdiv(M, BM)
        num_n = tl.cdiv(N, BN)
        if PERSISTENT:   # WS applies to the tile loop (the producer runs ahead across tiles)
            num_tiles = num_m * num_n
            for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=FLATTEN,
                                 warp_specialize=WS):
                pid_m, pid_n = grouped_tile(tile, num_m, num_n, GROUP_M)
                _pf_tile(A, SA, B, SB, C, pid_m, pid_n, M, N, K, stride_am, stride_bn, stride_cm, stride_sam,
                         stride_sak, stride_sbn, BM, BN, NSUB, LOAD, SB_E8M0, SB_ROW, EPI_TMA, False, ORDER,
                         INTERP)
        else:            # WS applies to the K loop
            pid_m, pid_n = grouped_tile(tl.program_id(0), num_m, num_n, GROUP_M)
            _pf_tile(A, SA, B, SB, C, pid_m, pid_n, M, N, K, stride_am, stride_bn, stride_cm, stride_sam,
                     stride_sak, stride_sbn, BM, BN, NSUB, LOAD, SB_E8M0, SB_ROW, EPI_TMA, WS, ORDER, INTERP)


# -------------------------------------------------------------------------------------------------
# host side



def resolve_config(M: int, N: int, K: int, dev, config: dict | None) -> dict:
    """The full config of a launch (defaults + ``config``), validated; raises ValueError on bad keys /
    values and on combinations that do not compile with Triton 3.6 (module doc)."""
    cfg = dict(DEFAULT_CONFIG, **route.fp8_prefill_config(target(dev)))
    if config:
        unknown = set(config) - set(DEFAULT_CONFIG)
        if unknown:
            raise ValueError(f"fp8_gemm_prefill: unknown config keys {sorted(unknown)}")
        cfg.update(config)
        # the default TMA-store epilogue goes with the variants it compiles with, unless asked for;
        # the warp-specialized variants keep the 4 stages they were validated with
        if "EPI_TMA" not in config and (cfg["WS"] or cfg["LOAD"] == "ptr"):
            cfg["EPI_TMA"] = False
        if cfg["WS"] and "num_stages" not in config:
            cfg["num_stages"] = DEFAULT_CONFIG["num_stages"]
    if cfg["LOAD"] not in LOADS:
        raise ValueError(f"fp8_gemm_prefill: LOAD must be one of {sorted(LOADS)}, got {cfg['LOAD']!r}")
    BM, BN, NSUB = cfg["BM"], cfg["BN"], cfg["NSUB"]
    if NSUB not in (1, 2) or BN % NSUB:
        raise ValueError(f"fp8_gemm_prefill: NSUB must be 1 or 2 and divide BN, got NSUB={NSUB} BN={BN}")
    W = BN // NSUB
    for name, v in (("BM", BM), ("BN/NSUB", W)):
        if v < 16 or v > 256 or v & (v - 1):
            raise ValueError(f"fp8_gemm_prefill: {name}={v} must be a power of two in [16, 256]")
    if cfg["LOAD"] == "ptr" and (cfg["WS"] or cfg["EPI_TMA"]):
        raise ValueError("fp8_gemm_prefill: WS and EPI_TMA need LOAD='tma' or 'tma_dev'")
    if cfg["WS"] and cfg["EPI_TMA"]:
        raise ValueError("fp8_gemm_prefill: WS with EPI_TMA fails in Triton 3.6's warp-specialization pass")
    if cfg["FLATTEN"] and not cfg["PERSISTENT"]:
        raise ValueError("fp8_gemm_prefill: FLATTEN needs PERSISTENT")
    return cfg


def tma_ok(*ts: torch.Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 and t.stride(-1) == 1
               for t in ts)


def check_args(fn: str, xq, xs, w, ws, out):
    """The arguments of the ``fp8.fp8_gemm`` contract (ValueError naming ``fn`` and the problem);
    -> (M, N, K, out), ``out`` a new bf16 [M, N] when None."""
    check_fp8_weight(w, ws)
    if xq.dim() != 2 or xq.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(f"{fn}: expected e4m3 activations [M, K], got {xq.dtype} {tuple(xq.shape)}")
    M, K = xq.shape
    N = w.shape[0]
    if w.shape[1] != K or tuple(xs.shape) != (M, K // QBLOCK):
        raise ValueError(f"{fn}: shapes xq {tuple(xq.shape)} xs {tuple(xs.shape)} w {tuple(w.shape)}")
    if xq.device != w.device or xs.device != xq.device or ws.device != xq.device:
        raise ValueError(f"{fn}: xq, xs, w, ws must be on one device")
    if out is None:
        out = torch.empty(M, N, dtype=torch.bfloat16, device=xq.device)
    elif tuple(out.shape) != (M, N) or out.dtype != torch.bfloat16 or out.stride(-1) != 1:
        raise ValueError(f"{fn}: out must be bf16 [M, N] with unit column stride, got {out.dtype} "
                         f"{tuple(out.shape)} strides {out.stride()}")
    return M, N, K, out


def fp8_gemm_prefill(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
                     out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """bf16 [M, N] = official block-scaled FP8 GEMM (the ``fp8.fp8_gemm`` contract, plain mode): xq
    e4m3 [M, K], xs fp32 [M, K/128] (power-of-two scales), w e4m3 [N, K], ws e8m0/fp32 [N/128, K/128]
    (or per-row [N, K/128]); ``out`` an optional bf16 [M, N] (row-contiguous) destination; ``config``
    selects the variant (module doc, ``DEFAULT_CONFIG``)."""
    M, N, K, out = check_args("fp8_gemm_prefill", xq, xs, w, ws, out)
    if M == 0:
        return out
    cfg = resolve_config(M, N, K, xq.device, config)
    BM, BN, NSUB = cfg["BM"], cfg["BN"], cfg["NSUB"]
    W = BN // NSUB
    a = u8(xq.contiguous()).view(torch.float8_e4m3fn)
    b = u8(w.contiguous()).view(torch.float8_e4m3fn)
    load = LOADS[cfg["LOAD"]]
    epi_tma = bool(cfg["EPI_TMA"])
    if load and not tma_ok(a, b):
        load, epi_tma = 0, False
    if epi_tma and not tma_ok(out):
        epi_tma = False
    ws_flag = bool(cfg["WS"]) and load != 0
    if load == 0:
        a, b = u8(a), u8(b)
    wsv, sb_e8m0, sb_row = weight_scales(w, ws)
    wsv = wsv.contiguous()
    xs = xs.float()
    if cfg["SA_T"]:
        sa = xs.t().contiguous()                       # [K/128, M]: one contiguous vector per K block
        s_m, s_k = 1, sa.stride(0)
    else:
        sa = xs.contiguous()
        s_m, s_k = sa.stride(0), 1
    A, B, C = a, b, out
    if load == 1:
        from triton.tools.tensor_descriptor import TensorDescriptor
        A = TensorDescriptor.from_tensor(a, [BM, QBLOCK])
        B = TensorDescriptor.from_tensor(b, [W, QBLOCK])
        if epi_tma:
            C = TensorDescriptor.from_tensor(out, [BM, W])
    elif load == 2:
        ensure_tma_allocator(xq.device)
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    grid = (min(tiles, target(xq.device).sm_count) if cfg["PERSISTENT"] else tiles,)
    kw = {} if interpreting() else {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    _fp8_prefill_kernel[grid](
        A, sa, B, wsv, C, M, N, K, a.stride(0), b.stride(0), out.stride(0), s_m, s_k, wsv.stride(0),
        BM=BM, BN=BN, NSUB=NSUB, GROUP_M=cfg["GROUP_M"], LOAD=load, PERSISTENT=bool(cfg["PERSISTENT"]),
        FLATTEN=bool(cfg["FLATTEN"]), WS=ws_flag, SB_E8M0=sb_e8m0, SB_ROW=sb_row, EPI_TMA=epi_tma,
        ORDER=bool(cfg["ORDER"]), INTERP=interpreting(), **kw, **PDL_LAUNCH)
    return out


def aot_spec(config: dict | None = None, sb_e8m0: bool = True):
    """(kernel, signature, constexprs, attrs, options) to compile a variant ahead of time with
    ``triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=..., options=options)``
    (the AOT test and ``experiments/exp_fp8_prefill.py --static``): the arguments the launcher passes
    for a row-major problem whose sizes and strides are multiples of 16, activation scales as SA_T says."""
    cfg = dict(DEFAULT_CONFIG)
    cfg.update(config or {})
    cfg = resolve_config(4096, 4096, 4096, "cpu", cfg)
    BM, BN, NSUB = cfg["BM"], cfg["BN"], cfg["NSUB"]
    W = BN // NSUB
    load = LOADS[cfg["LOAD"]]
    if load == 1:
        A, B = f"tensordesc<fp8e4nv[{BM}, 128]>", f"tensordesc<fp8e4nv[{W}, 128]>"
    elif load == 2:
        A = B = "*fp8e4nv"
    else:
        A = B = "*u8"
    C = f"tensordesc<bf16[{BM}, {W}]>" if (cfg["EPI_TMA"] and load == 1) else "*bf16"
    const = dict(BM=BM, BN=BN, NSUB=NSUB, GROUP_M=cfg["GROUP_M"], LOAD=load, PERSISTENT=bool(cfg["PERSISTENT"]),
                 FLATTEN=bool(cfg["FLATTEN"]), WS=bool(cfg["WS"]), SB_E8M0=sb_e8m0, SB_ROW=False,
                 EPI_TMA=bool(cfg["EPI_TMA"]), ORDER=bool(cfg["ORDER"]), INTERP=False)
    const["stride_sam" if cfg["SA_T"] else "stride_sak"] = 1
    fn = _fp8_prefill_kernel
    types = dict(A=A, SA="*fp32", B=B, SB="*u8" if sb_e8m0 else "*fp32", C=C)
    sig = {n: ("constexpr" if n in const else types.get(n, "i32")) for n in fn.arg_names}
    div16 = ("M", "N", "K", "stride_am", "stride_bn", "stride_cm", "stride_sam", "stride_sak", "stride_sbn")
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in const and (types.get(n, "").startswith("*") or n in div16)}
    opts = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    return fn, sig, const, attrs, opts


__all__ = ["fp8_gemm_prefill", "resolve_config", "aot_spec", "DEFAULT_CONFIG", "LOADS"]
