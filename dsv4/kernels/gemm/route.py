"""The size / architecture router of the FP8 linears and the FP4 / FP8 experts.

Pure decisions, no launches: for M rows (or rows per expert) of a call and the ``lib.Target`` it
runs on, which GEMM kernel runs and with which tile. The launchers of this package take their
default configs from here, and ``linear.py`` / ``kernels.moe`` dispatch by it. Every threshold
sits next to the BENCHMARKS.md row (or experiment) that set it; ``choices(t)`` lists every kernel
configuration these functions can pick on a target (the AOT tests compile each one for sm_80 ..
sm_120 and hold its shared memory to that target's per-block limit).

Current choice, FP8 linears (``linear.fp8_linear``, ``linear.fp8_gemm``):
* 1-4 rows on weights of <= 8M elements, sm_89+: ``fp8_mma`` (Gluon tensor-core decode kernel);
* 128+ rows on sm_90 (pre-quantised activations): ``fp8_prefill`` (TMA tiles);
* otherwise the Triton tile kernel ``fp8.fp8_gemm`` (act quant fused in its prologue up to 64 rows),
  tiles by M (``fp8_tiles``), split K at decode sizes.
* ``wo_a`` (bf16 grouped einsum on the FP8 weight): ``fp8_mma`` in bf16 mode up to 128 rows (sm_89+),
  else the weight dequantised to bf16 and one batched GEMM.

Current choice, routed experts (``kernels.moe.moe_forward``), by the average rows per expert:
* up to 16 (sm_89+: the tensor-core decode kernel ``fp4_mma``) or 2 (elsewhere: the CUDA-core GEMV)
  rows: the decode path (``gemv``);
* 17-64 rows, MXFP4 on sm_90 whose scales fold exactly into e4m3: ``fp4_fp8`` (the weights decoded
  to e4m3 in registers, FP8 wgmma); from 128 rows the same weights pre-decoded (``predec``: one
  ``fp4_fp8.predecode`` pass to e4m3 tiles per chunk, then FP8 wgmma on TMA tiles); above 32 rows
  otherwise (larger tiles, other MXFP4 weights) on sm_90: ``fp4_prefill`` (one K=128 f16 MMA chain per
  block);
* otherwise ``fp4``'s kernels: ``dot_scaled`` for MXFP4 on sm_100 (``scaled``), the in-register
  dequant + f16 MMA kernel elsewhere (``dequant``).
The shared expert (FP8): w1|w3 as split-K partials + the SwiGLU pass up to 64 rows, the tile kernel
with the SwiGLU epilogue above; w2 through ``linear.fp8_gemm``.
"""
from __future__ import annotations

from ..lib import QBLOCK, Choice, Target

# ---------------------------------------------------------------------------------------------- FP8 linears
# fp8_mma up to MAX_ROWS rows on weights of up to MAX_WEIGHT elements. BENCHMARKS.md "FP8 linear at
# decode sizes" (session 7): on the 2-8 MB Flash linears 6.8-7.8 us against 8.4-9.0 for the best split-K
# tile at one row, about equal at 8 rows; slower on the 32 MB ones (wq_b 20.6 vs 15.3, wo_b 21.4 vs 18.2)
MMA_MAX_ROWS = 4
MMA_MAX_WEIGHT = 8 * 1024 * 1024
# wo_a on fp8_mma (bf16 activations) up to this many rows, else dequantise + einsum. BENCHMARKS.md
# ``experiments/exp_wo_a_rows.py`` table (2026-12-02): 85.0 vs 305.8 us at 128 rows, 164.5 vs 310.4 at 256
WO_A_MAX_ROWS = 128
# fp8_prefill (TMA tiles, sm_90) from this many rows. BENCHMARKS.md "FP8 block-scaled GEMM at prefill"
# (sessions 9-11): 60.7-70.0% of peak against 34-41% for the pointer-load tile (session 1)
PREFILL_MIN_ROWS = 128
# the activation quantisation fused into the tile kernel's A-tile load up to this many rows
# (re-quantising an A tile per N block costs nothing at decode sizes; docs/benchmarks-2026-11-30.md session 3)
FUSE_QUANT_MAX_ROWS = 64


def fp8_kernel(M: int, N: int, K: int, t: Target, prequantised: bool = False) -> str:
    """'mma' | 'prefill' | 'tiles' for an FP8 linear of M rows on an [N, K] weight (module doc).
    ``prequantised``: the caller holds e4m3 activations (``fp8_gemm``), the only form the prefill
    kernel takes."""
    if 0 < M <= MMA_MAX_ROWS and N * K <= MMA_MAX_WEIGHT and t.gluon_mma:
        return "mma"
    if prequantised and M >= PREFILL_MIN_ROWS and t.compiled and t.capability[0] == 9:
        return "prefill"
    return "tiles"


def fp8_tiles(M: int, N: int, K: int, t: Target, swiglu: bool = False) -> dict:
    """Tile of the Triton FP8 kernel (``fp8._fp8_gemm_kernel``): BM, BN, GROUP_M, num_warps, num_stages."""
    if not t.compiled:
        cfg = {"BM": 16, "BN": 32 if N <= 32 else 64, "GROUP_M": 8}
    elif M <= 16:
        # BENCHMARKS.md "FP8 linear at decode sizes" (benchmarks/gemm_moe.py --only fp8dec); above N = 4096,
        # 128 columns where K >= 1536 (V4-Pro's wq_b / wo_b at one row: 29.1 / 40.1 us against 36.4 / 50.7
        # with 64, experiments/exp_fp8_big_decode.py, docs/benchmarks-2026-12-01.md session 13)
        bn = 32 if N <= 1024 else (128 if 2048 < N <= 4096 or (N > 4096 and K >= 1536) else 64)
        cfg = {"BM": 16, "BN": bn, "GROUP_M": 8, "num_warps": 4, "num_stages": 5 if bn == 32 else 3}
    elif M <= 64:
        cfg = {"BM": 64, "BN": 128 if N > 1024 else 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
    else:
        cfg = {"BM": 128, "BN": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 4}
    if swiglu:
        cfg["BN"] = QBLOCK
        if t.compiled and M > 16:          # two accumulators (ptxas: no spills at 64 rows, 8 warps)
            cfg.update(BM=64, num_warps=8, num_stages=3)
    return cfg


def fp8_split_k(M: int, N: int, K: int, BM: int, BN: int, t: Target, swiglu: bool = False) -> int:
    """K splits of the tile kernel for decode-sized calls whose output tiles cannot fill the GPU
    (latency-bound weight streaming): about two programs per SM, at least two 128-K blocks per split."""
    if swiglu or M > 64:
        return 1
    tiles = -(-M // BM) * -(-N // BN)
    return max(1, min(K // QBLOCK // 2, -(-2 * t.sm_count // tiles)))


def fp8_mma_config(act: str) -> dict:
    """``fp8_mma``'s tile: 64 weight rows over 4 warps; two K blocks per step for FP8 activations
    (docs/benchmarks-2026-11-30.md, session 7, ``experiments/exp_fp8_mma.py``: 0.3-3 us lower on every V4-Flash decode
    linear), one for wo_a's bf16 activations (0.5-0.8 us faster with one)."""
    return {"BN": 64, "num_warps": 4, "UNROLL": 1 if act == "bf16" else 2}


def fp8_prefill_config(t: Target) -> dict:
    """``fp8_prefill``'s variant (its ``DEFAULT_CONFIG`` keys; BENCHMARKS.md "FP8 block-scaled GEMM at
    prefill", sessions 5, 8, 9, 11): TMA loads, 64 x 128 tiles of one warpgroup, 3 stages, the TMA store
    epilogue, grouped order over 64 row blocks. Small tiles under the interpreter."""
    if not t.compiled:
        return {"BM": 32, "BN": 64}
    return {"BM": 64, "num_warps": 4, "num_stages": 3, "EPI_TMA": True, "GROUP_M": 64}


def wo_a_kernel(T: int, fmt: str, t: Target) -> str:
    """'mma' (``fp8_mma`` bf16 mode on the FP8 weight) or 'dequant' (bf16 weight + one batched GEMM)."""
    return "mma" if fmt == "fp8" and T <= WO_A_MAX_ROWS and t.gluon_mma else "dequant"


# ---------------------------------------------------------------------------------------------- fp32-output dense GEMV
# ``dense_gemv`` (bf16 / fp32 weights, fp32 output: the compressor / indexer projection and the router's gate) at
# one row, on weights of up to DENSE_GEMV_MAX_WEIGHT elements (the output head, 530M elements, keeps cuBLAS: 96-99%
# of its floor at batch 1, BENCHMARKS.md decode_step). H100, experiments/exp_dense_gemv.py (2026-12-06), GPU time
# at one row, 8 x 256 tiles, ~4 programs per SM, against torch: V4-Flash CSA / HCA projection 11.9 / 7.2 us vs
# 12.8 / 8.4, router 5.5 vs 8.9; V4-Pro CSA projection 18.4 vs 18.2, router 7.8 vs 12.7. At 4 and 16 rows a
# tensor-core / FMA ``tl.dot`` form of the kernel lost (15.1-19.6 vs 12.9-15.3 us), so more rows stay on torch
DENSE_GEMV_MAX_WEIGHT = 32 * 1024 * 1024
# rows up to which ``dense_gemv`` serves: bf16 weights (the compressor / indexer projections) and fp32 weights (the
# router's gate). Its multi-row form takes up to 4 rows a program, each with its own accumulator (every row the
# one-row launch's bits). H100, experiments/exp_dense_gemv.py (2026-12-07, GPU time against torch): Flash CSA / HCA
# projection at 2 rows 13.0 / 8.3 us vs 12.9 / 8.6, at 4 rows 20.4 / 10.6 vs 12.9 / 8.8 (cuBLAS's bf16 GEMM costs one
# row's time up to 16 rows; the kernel's FMAs per weight byte grow with the rows); router gate at 2 / 4 / 8 rows
# 6.2 / 8.5 / 12.3 vs 15.5 / 15.6 / 21.8 (torch upcasts x and runs an fp32 SIMT GEMM from 2 rows). decode_step.py
# with every call on the kernel up to 4 rows (4 layers, ctx 8192): batch 2 1211.0 vs 1254.0 us, batch 4 1502.8 vs
# 1523.8 (the router's gain less the CSA projection's loss)
DENSE_GEMV_MAX_ROWS = 2
DENSE_GEMV_FP32_MAX_ROWS = 8


def dense_gemv(M: int, N: int, K: int, dtype, t: Target) -> bool:
    """Whether ``dense_gemv`` serves an [M, K] x [N, K]^T fp32-output GEMM on ``t`` (sm_80+, up to
    ``DENSE_GEMV_MAX_ROWS`` rows of a bf16 weight, ``DENSE_GEMV_FP32_MAX_ROWS`` of an fp32 one)."""
    import torch
    if dtype not in (torch.bfloat16, torch.float32):
        return False
    rows = DENSE_GEMV_FP32_MAX_ROWS if dtype == torch.float32 else DENSE_GEMV_MAX_ROWS
    return t.at_least((8, 0)) and 1 <= M <= rows and N * K <= DENSE_GEMV_MAX_WEIGHT


# ``dense_mm`` (bf16 x bf16 -> fp32 on tensor cores, promoted every BK columns: the router's gate with a bf16-exact
# weight) from PREFILL_STEP_MIN_ROWS rows; below, torch's fp32 GEMM keeps it. H100, experiments/exp_dense_mm.py
# (2026-12-06), 8192 tokens: V4-Flash gate 39.9 us (BK 128) against 449 us for the upcast + fp32 GEMM, V4-Pro 130
# vs 1080 us; largest error against the exact sums 2.1e-6 / 3.1e-6, the fp32 GEMM's 5.7e-6 / 3.3e-6 (torch's bf16
# GEMM with one accumulator over K: 3.6e-5 / 7.1e-5)
def dense_mm(M: int, t: Target) -> bool:
    """Whether ``dense_mm`` serves an [M, K] x [N, K]^T bf16 GEMM with fp32 output on ``t`` (sm_80+)."""
    return t.at_least((8, 0)) and M >= PREFILL_STEP_MIN_ROWS


def dense_mm_config(t: Target) -> dict:
    """``dense_mm``'s tile: 128 x 128 outputs, 8 warps, 3 stages, 128-column blocks between promotions where
    shared memory holds 3 x 64 KB (sm_90 / sm_100: the sweep's best at 8192 tokens, comment above), else 64
    (sm_80 / sm_120: 96 KB). Small tiles under the interpreter."""
    if not t.compiled:
        return {"BM": 16, "BN": 32, "BK": 32}
    bk = 128 if t.capability[0] in (9, 10) else 64
    return {"BM": 128, "BN": 128, "BK": bk, "num_warps": 8, "num_stages": 3}


def dense_gemv_config(N: int, K: int, elem: int, t: Target) -> dict:
    """``dense_gemv``'s tile: BN weight rows x BK columns per step, SPLIT K splits so that about four
    programs per SM stream the weight (the sweep's best on every V4 shape, comment above). Small tiles
    under the interpreter."""
    if not t.compiled:
        return {"BN": 16, "BK": 32, "SPLIT": 4}
    bk, bn = 256, 8
    blocks = -(-N // bn)
    split = max(1, min(K // bk, -(-4 * t.sm_count // blocks)))
    return {"BN": bn, "BK": bk, "SPLIT": split, "num_warps": 4, "num_stages": 3}


# ---------------------------------------------------------------------------------------------- experts
# the decode path up to these average rows per expert. docs/benchmarks-2026-11-30.md "MoE layer: decode path on the tensor-core kernel" (session 6): the
# tensor-core decode kernel 1250.8 / 1707.7 / 2537.4 us at Flash T 64 / 256 / 512 against 2834.4 / 4158.0 /
# 4786.0 for the MMA kernels; the CUDA-core GEMV (no tensor cores) beats them up to ~2 rows per expert
GEMV_ROWS_PER_EXPERT = 2.0
MMA_GEMV_ROWS_PER_EXPERT = 16.0
# the K=128-dot prefill kernel above this many rows per expert (MXFP4, sm_90): docs/benchmarks-2026-11-30.md
# session 5, V4-Flash 4096 tokens: 8267 us against 31986 for the MMA path
PREFILL_ROWS_PER_EXPERT = 32.0
# MXFP4 on FP8 wgmma (``fp4_fp8``, sm_90) above FP8MMA_ROWS_PER_EXPERT and up to FP8MMA_MAX_ROWS_PER_EXPERT
# rows per expert, where the weights' scales fold exactly. H200, ``benchmarks/gemm_moe.py --only prefill``
# (2026-12-04, GEMM 1 + GEMM 2): 1.1-1.3x faster than fp4_prefill at 24-64 rows (Flash 1024 / 2048 tokens:
# 3625 / 4109 us vs 4584 / 4740; Pro 2048 / 4096: 13406 / 15217 vs 17173 / 17370), 3-8% slower at 96, 128,
# 256 and 384 rows (Flash 4096: 7772 vs 7211 us), 1.3x faster at 192 (Flash 8192: 11070 vs 13973)
FP8MMA_ROWS_PER_EXPERT = 16.0
FP8MMA_MAX_ROWS_PER_EXPERT = 64.0
# the pre-decoded path (``predecode`` to e4m3 tiles, then the FP8 GEMMs on them; MXFP4 whose scales fold exactly,
# sm_90) from this many rows per expert. H100, ``experiments/exp_predec.py`` (2026-12-06, the whole MoE layer, V4-Flash
# shapes, the 2.5 ms decode pass of ``predecode_config``), predec against the ``prefill`` path: 256 experts, 96 rows
# 8.9 vs 8.2 ms (slower), 192 rows 12.5 vs 15.6, 384 rows 20.0 vs 28.2; 128 experts, 192 / 384 / 768 rows 6.1 / 9.7
# / 16.8 vs 7.9 / 13.8 / 26.2
PREDEC_ROWS_PER_EXPERT = 128.0
# the pre-decoded path's two GEMMs on ``fp4_fp8_ws`` (sm_90 with Gluon, tile factors: ``MoEWeights.fp8_tile_max``):
# the weights decoded to e4m3 in shared memory inside the GEMM, no decode pass and no e4m3 copy of the experts;
# the same bits. H100, ``experiments/exp_fp4_fp8_ws.py`` (2026-12-06, 256 experts x 8192 tokens, V4-Flash shapes):
# GEMM 1 4925 -> 3816 us, GEMM 2 2459 -> 1969 us against predecode + the grouped FP8 GEMM
PREDEC_WS = True
# with PREDEC_WS: ``swiglu_quant`` stores h in ``fp4_fp8_ws``'s group split order (a register permutation before its
# usual store; offline PTX, sm_90: the same 16 byte stores per thread as the plain store) instead of a separate torch
# permutation pass over h (~1 ms of a 4-layer 8192-token chunk with x's, H100). Prefill (H100, 2026-12-06, one call,
# 43-layer tok/s at 8192 x 1 / x 8): on 13,239 / 13,173 and 13,333 / 13,329, off 12,995 / 13,213. (A per-element
# permuted store address instead ran the prefill at 123-124k tok/s against the pass's 131-133k, H100.)
SWIGLU_SPLIT_STORE = True
# the shared expert's w1|w3 as split-K MMA partials + the SwiGLU pass up to this many rows; above, the
# tile kernel's SwiGLU epilogue (which cannot split K; docs/benchmarks-2026-12-01.md session 12: 47 us at
# 64 tokens with it, V4-Flash)
SHARED_SPLIT_MAX_ROWS = 64
# from PREFILL_STEP_MIN_ROWS rows, where ``fp8_kernel`` picks the dense TMA kernel (``fp8_prefill``, sm_90): the
# shared expert's w1|w3 there into bf16 outputs + the SwiGLU pass instead of the tile kernel's SwiGLU epilogue
# (the same rounding: the epilogue rounds both outputs to bf16 first). H200, experiments/exp_predec.py
# (2026-12-06, the MoE layer at 8192 tokens): 256 experts 8204 -> 7896 us, 128 experts 6348 -> 6035 us
SHARED_UNFUSED = True
# steps of at least this many rows are prefill chunks for the choices timed at prefill sizes only (``dense_mm``
# for the router's gate, SHARED_UNFUSED): decode and verify steps of up to 1024 rows keep their kernels
PREFILL_STEP_MIN_ROWS = 1025


def fp4_path(fmt: str, t: Target) -> str:
    """'scaled' (``tl.dot_scaled``: native block-scaled tcgen05 MMA) for MXFP4 on sm_100, else 'dequant'.
    sm_120 has no tcgen05: its ``dot_scaled`` would be emulated, so it keeps the dequant kernel."""
    return "scaled" if (fmt == "mxfp4" and t.compiled and t.capability[0] == 10) else "dequant"


def fp4_config(rows_per_group: float, t: Target, swiglu: bool = False) -> dict:
    """Tile of ``fp4``'s kernels from the (average) rows per expert; SwiGLU: 128 columns (w1 and w3
    tiles of the same columns in one program) and 8 warps from 32 rows (two accumulators: 4 warps
    spill, ptxas report)."""
    if not t.compiled:
        return {"BM": 16, "BN": QBLOCK if swiglu else 32}
    bm = 16 if rows_per_group <= 16 else (32 if rows_per_group <= 32 else 64)
    if rows_per_group > 256:
        bm = 128
    cfg = {"BM": bm, "BN": 128, "num_warps": 4, "num_stages": 3}
    if bm >= 128 or (swiglu and bm >= 32):
        cfg.update(num_warps=8, num_stages=3)
    if t.capability[0] == 10:              # tcgen05 tiles: 128 rows
        cfg["BM"] = max(bm, 128)
        cfg["num_warps"] = 8
    return cfg


def fp4_prefill_config(rows_per_group: float, t: Target, swiglu: bool = False) -> dict:
    """Tile / variant of ``fp4_prefill``, from the H200 sweep of ``experiments/exp_fp4_prefill.py``
    (V4-Flash, 4096 tokens, ~96 rows per expert; docs/benchmarks-2026-11-30.md session 5): split K
    order; >= 96 rows per expert BM 128 (SwiGLU 16 warps 2 stages: 5107 us vs 20727 for ``fp4``; w2 8
    warps 3 stages: 2092 vs 10194), else BM 64 (SwiGLU 8 warps, w2 4 warps, 3 stages: 3.1x / 4.6x)."""
    if not t.compiled:
        return {"BM": 16, "BN": 32, "DEC": 0, "KSPLIT": True}
    big = rows_per_group >= 96
    cfg = {"BM": 128 if big else 64, "BN": 128, "num_warps": 8 if big else 4, "num_stages": 3, "DEC": 0,
           "KSPLIT": True}
    if swiglu:
        cfg.update(num_warps=16, num_stages=2) if big else cfg.update(num_warps=8)
    return cfg


def fp4_fp8_config(rows_per_group: float, t: Target, swiglu: bool = False) -> dict:
    """Tile / variant of ``fp4_fp8`` (MXFP4 on FP8 wgmma): the weight tile as the dot's register operand
    (``SWAP``), BM tokens per tile from the rows per expert. Small tiles under the interpreter."""
    if not t.compiled:
        return {"BM": 16, "BN": 32, "SWAP": True}
    # H200 sweep (benchmarks/gemm_moe.py --only prefill, V4-Flash 8192 tokens, 2026-12-04): 64-token tiles
    # with the weight as the shared-memory operand (no spills: 234 registers) beat the register-operand
    # form (255 registers + spills; 128-token tiles spill ~1 KB); 32-token register-operand tiles where
    # an expert has few rows
    small = rows_per_group <= 32
    return {"BM": 32 if small else 64, "BN": 128, "SWAP": small, "num_warps": 8 if swiglu else 4,
            "num_stages": 3}


# the pre-decoded path's transient e4m3 copy of one GEMM's experts is made in passes of at most this many
# bytes (V4-Flash: w1|w3 in 3 passes of 86 experts, w2 in 2 of 128; V4-Pro: 9 of 43, 5 of 77)
PREDEC_SCRATCH_BYTES = 2 << 30


def predec_experts_per_pass(n_experts: int, rows: int, K: int) -> int:
    """Experts per pass of the pre-decoded path: as even as the scratch budget allows (e4m3 rows of K
    bytes + K/128 fp32 factors each), at least one."""
    per = max(1, PREDEC_SCRATCH_BYTES // (rows * (K + 4 * (K // QBLOCK))))
    passes = -(-n_experts // per)
    return -(-n_experts // passes)


def predecode_config(t: Target) -> dict:
    """``fp4_fp8.predecode``'s tile: BN rows per program, KU 128-blocks per step. H100,
    ``experiments/exp_predec.py`` (2026-12-06), V4-Flash w1|w3 of 256 experts: BN 32, KU 4, 8 warps 2,486 us
    (90% of copy) against 4,583 us (49%) for the former BN 64, KU 1, 4 warps; KU 2 71-77%, KU 1 48-60%
    at every BN and warp count. Small tiles under the interpreter."""
    if not t.compiled:
        return {"BN": 16, "KU": 1}
    return {"BN": 32, "KU": 4, "num_warps": 8}


def fp8_predec_config(rows_per_group: float, t: Target, swiglu: bool = False) -> dict:
    """Tile of ``fp4_fp8``'s kernel on pre-decoded e4m3 weights (``moe`` path 'predec'): both operands
    through shared memory (no register decode, so no ``SWAP``), weight and activation tiles by TMA on
    sm_90+ (``WTMA``, ``ATMA``: GEMM 1's rows gathered once), 64-token tiles (two fp32 accumulators of
    64 x 128 with SwiGLU: no spills at 8 warps, as ``fp4_fp8_config``'s). ``UNFUSED`` (with ATMA): GEMM 1
    runs GEMM 2's plain tile into bf16 w1|w3 outputs and one pass forms h (the same bits; H100,
    ``experiments/exp_predec.py`` 2026-12-06: the MoE layer 3.6-3.9% faster at 192-768 rows per expert,
    e.g. 256 experts x 8192 tokens 12.48 -> 12.00 ms). Storing the scale operands block-major (contiguous per
    K block instead of row-strided gathers) was timed and removed: 35-37% of ``_scaled_mm`` either way at 4 warps.
    ``TILE`` (with WTMA): one weight factor per 128 x 128 tile where the experts' scales allow it
    (``MoEWeights.fp8_tile_max``), so the per-128 promotion is one FFMA per element with a [BM] factor
    instead of a product of a [BM] and a [BN] vector (H100, ``experiments/exp_predec_gemm.py`` 2026-12-06,
    the default tile at 256 experts x 8192 tokens: GEMM 1 35% and GEMM 2 38% of ``_scaled_mm`` with per-row
    factors, where the dense ``fp8_prefill`` kernel, scalar factors, reaches 56% / 68%). Small tiles under
    the interpreter. ``HOST_TMA``: the TMA descriptors built on the host once per launch instead of by every
    program (the dense ``fp8_prefill`` kernel, H100, same experiment: device-built descriptors cost it 4-14
    points of ``_scaled_mm``). ``PREFETCH``: the scale operands loaded one K block ahead. The sm_90 SASS
    (Triton 3.9, offline) of the default tile without it issues the weight factor's load after the stage's
    barrier and schedules the factor product sa * sb, which needs it, right before the block's wgmma: every
    K block's wgmma waits for a global load. With it the product reads registers loaded a block earlier (H200,
    ``experiments/exp_predec_gemm.py`` 2026-12-06, 256 experts x 8192 tokens with tile factors and host
    descriptors: GEMM 1 56% -> 57%, GEMM 2 54% -> 56% of ``_scaled_mm``, the same bits)."""
    if not t.compiled:
        return {"BM": 16, "BN": 32, "SWAP": False, "WTMA": False, "ATMA": False}
    # ptxas (Triton 3.9, sm_90a, tests' AOT cases): with SwiGLU only the all-TMA form keeps its 64 x 128
    # accumulator pair out of local memory (255 registers, no spills; pointer loads spill 52-64 bytes);
    # w2 at 64 rows does not spill in any form (182-223 registers); 128-row tiles spill in every form
    tma = t.capability[0] >= 9
    return {"BM": 64, "BN": 128, "SWAP": False, "WTMA": tma, "ATMA": tma, "num_warps": 8 if swiglu else 4,
            "num_stages": 3, "UNFUSED": tma and swiglu, "TILE": tma, "HOST_TMA": tma,
            "PREFETCH": tma}


def decode_kernel(t: Target) -> str:
    """The MoE decode path's expert GEMM: 'mma' (``fp4_mma``, sm_89+) or 'cuda-core' (``gemv``)."""
    return "mma" if t.gluon_mma else "cuda-core"


def expert_path(rows_per_expert: float, fmt: str, t: Target, fold_exact: bool = True) -> str:
    """'gemv' | 'fp8mma' | 'predec' | 'prefill' | 'scaled' | 'dequant' for FP4 routed experts (module doc).
    ``fold_exact``: the MXFP4 weights' scales fold exactly into e4m3 (``fp4_fp8.wide_spread`` is False);
    else the f16 prefill kernel keeps them."""
    gemv_max = MMA_GEMV_ROWS_PER_EXPERT if decode_kernel(t) == "mma" else GEMV_ROWS_PER_EXPERT
    if rows_per_expert <= gemv_max:
        return "gemv"
    hopper_mx = fmt == "mxfp4" and t.compiled and t.capability[0] == 9
    if hopper_mx and fold_exact and FP8MMA_ROWS_PER_EXPERT < rows_per_expert <= FP8MMA_MAX_ROWS_PER_EXPERT:
        return "fp8mma"
    if hopper_mx and fold_exact and rows_per_expert >= PREDEC_ROWS_PER_EXPERT:
        return "predec"
    if hopper_mx and rows_per_expert > PREFILL_ROWS_PER_EXPERT:
        return "prefill"
    return fp4_path(fmt, t)


def gemv_config(N: int, t: Target, fp8: bool) -> dict:
    """The CUDA-core GEMV's column tile. docs/benchmarks-2026-11-30.md (session 4): 64 rows x 8 warps gave
    the fastest MoE layer at batch 1 and 64 (V4-Flash and V4-Pro); next-block prefetch, two K blocks
    per iteration and an fp32 activation operand were slower."""
    if not t.compiled:
        return {"BN": 16}
    return {"BN": 32 if fp8 else 64, "num_warps": 4 if fp8 else 8, "num_stages": 1}


def rows_tile(m: int) -> int:
    """The GEMV's row tile (1, 2 or 4 unrolled row accumulators) for m rows. The MoE decode path keeps 1-row
    tiles: they beat 2 and 4 at 1 and 1.5 rows per expert on the H200 (a padded row costs a full row)."""
    return 1 if m <= 1 else (2 if m == 2 else 4)


# ``gemv.swiglu_quant``'s rows per program: one row x 128 columns at decode and verify sizes (the layout their
# graphs were measured with; DSpark's 6-row verify at 128 sequences has 4,608 pairs), 16 from SWIGLU_TILE_MIN_ROWS
# rows (the pre-decoded path's unfused GEMM 1: 49,152 rows at 8192 tokens, where one-row programs ran at ~18% of
# copy, 947 -> 204 us, H100 2026-12-06, ``experiments/exp_predec.py --profile``)
SWIGLU_TILE_MIN_ROWS = 8192


def swiglu_rows(m: int) -> int:
    """Rows per program of ``gemv.swiglu_quant`` for m rows."""
    return 16 if m >= SWIGLU_TILE_MIN_ROWS else 1


def fp4_mma_config() -> dict:
    """``fp4_mma``'s tile: 64 weight rows over 4 warps (H200 sweep: 64 x 4 or 32 x 2 best; 128-256 slower)."""
    return {"BN": 64, "num_warps": 4}


# ---------------------------------------------------------------------------------------------- enumeration
def _choice(kernel, const: dict, cfg: dict, why: str) -> Choice:
    return Choice.of(kernel, const, cfg, why)


# the V4 FP8 linears (N, K) of Flash and Pro, whole and split over 2 / 4 / 8 tensor-parallel ranks
def _linear_shapes():
    out = set()
    for d, H, ql, G, ol, ih, inter in ((4096, 64, 1024, 8, 1024, 64, 2048), (7168, 128, 1536, 16, 1024, 64, 3072)):
        for tp in (1, 2, 4, 8):
            out |= {(ql + 512, d), (H * 512 // tp, ql), (d, G * ol // tp), (ih * 128, ql), (2 * inter, d),
                    (d, inter)}
    return sorted(out)


ROWS = (1, 2, 4, 8, 16, 17, 32, 64, 65, 128, 256, 4096)
ROWS_PER_EXPERT = (1, 2, 3, 8, 16, 17, 32, 33, 64, 96, 128, 257)


def choices(t: Target) -> list[Choice]:
    """Every GEMM kernel configuration the functions above pick on ``t`` for V4's shapes (deduplicated)."""
    seen: dict[Choice, Choice] = {}

    def add(c: Choice):
        seen.setdefault(c, c)
    for N, K in _linear_shapes():
        for M in ROWS:
            for preq in (False, True):
                kern = fp8_kernel(M, N, K, t, prequantised=preq)
                why = f"fp8 M={M} N={N} K={K}"
                if kern == "mma":
                    add(_choice("fp8_mma", {"ACT": 0 if preq else 1, "UNROLL": fp8_mma_config("fp8")["UNROLL"]},
                                fp8_mma_config("fp8"), why))
                elif kern == "prefill":
                    add(_choice("fp8_prefill", fp8_prefill_config(t), fp8_prefill_config(t), why))
                else:
                    cfg = fp8_tiles(M, N, K, t)
                    split = fp8_split_k(M, N, K, cfg["BM"], cfg["BN"], t) > 1
                    fused = not preq and M <= FUSE_QUANT_MAX_ROWS
                    add(_choice("fp8_gemm", {"BM": cfg["BM"], "BN": cfg["BN"], "GROUP_M": cfg["GROUP_M"],
                                             "A_BF16": fused, "SWIGLU": False, "SPLIT": split, "SUM": split},
                                cfg, why))
    for M in ROWS:                                      # the shared expert's w1|w3 above the split-K range
        if M > SHARED_SPLIT_MAX_ROWS:
            cfg = fp8_tiles(M, 4096, 4096, t, swiglu=True)
            add(_choice("fp8_gemm", {"BM": cfg["BM"], "BN": cfg["BN"], "GROUP_M": cfg["GROUP_M"], "A_BF16": False,
                                     "SWIGLU": True, "SPLIT": False, "SUM": False}, cfg, f"shared w1|w3 M={M}"))
    for T in ROWS:
        if wo_a_kernel(T, "fp8", t) == "mma":
            add(_choice("fp8_mma", {"ACT": 2, "UNROLL": fp8_mma_config("bf16")["UNROLL"]}, fp8_mma_config("bf16"),
                        f"wo_a T={T}"))
    for fmt in ("mxfp4", "nvfp4"):
        for r in ROWS_PER_EXPERT:
            path = expert_path(r, fmt, t)
            why = f"experts {fmt} {r} rows/expert"
            if path == "gemv":
                if decode_kernel(t) == "mma":
                    cfg = fp4_mma_config()
                    add(_choice("fp4_mma", {"NV": fmt == "nvfp4", "BN": cfg["BN"]}, cfg, why))
                else:
                    cfg = gemv_config(4096, t, False)
                    add(_choice("gemv", {"WFMT": 0 if fmt == "mxfp4" else 1, "BN": cfg["BN"], "BM": 1}, cfg, why))
            elif path == "fp8mma":
                for sw in (True, False):
                    cfg = fp4_fp8_config(r, t, swiglu=sw)
                    add(_choice("fp4_fp8", {"BM": cfg["BM"], "BN": QBLOCK if sw else cfg["BN"], "SWIGLU": sw,
                                            "SWAP": cfg["SWAP"]}, cfg, why))
            elif path == "predec":
                for sw in (True, False):
                    cfg = fp8_predec_config(r, t, swiglu=sw)
                    if cfg.get("UNFUSED"):                  # GEMM 1 on the plain tile (sw=False) + the SwiGLU pass
                        continue
                    add(_choice("fp4_fp8_predec", {"BM": cfg["BM"], "BN": QBLOCK if sw else cfg["BN"], "SWIGLU": sw,
                                                   "SWAP": cfg["SWAP"], "PREDEC": 2 if cfg["WTMA"] else 1,
                                                   "ATMA": cfg["ATMA"],
                                                   "SB_TILE": bool(cfg.get("TILE") and cfg["WTMA"]),
                                                   "HOST_TMA": bool(cfg.get("HOST_TMA") and cfg["WTMA"]),
                                                   "PREFETCH": bool(cfg.get("PREFETCH") and cfg["WTMA"])},
                                    cfg, why))
                pc = predecode_config(t)
                tile = bool(cfg.get("TILE") and cfg["WTMA"])     # weights whose scales allow it (moe)
                add(_choice("predecode", {"BN": pc["BN"], "KU": pc["KU"], "TILE_MAX": tile}, pc, why))
            elif path == "prefill":
                for sw in (True, False):
                    cfg = fp4_prefill_config(r, t, swiglu=sw)
                    add(_choice("fp4_prefill", {"BM": cfg["BM"], "BN": QBLOCK if sw else cfg["BN"], "SWIGLU": sw,
                                                "FMT": 2 if fmt == "mxfp4" else 1, "KSPLIT": cfg["KSPLIT"]},
                                cfg, why))
            else:
                bm = fp4_config(r, t)["BM"]
                for sw in (True, False):
                    cfg = fp4_config(r, t, swiglu=sw)
                    cfg["BM"] = bm                     # moe_forward: one BM for both GEMMs (the sort's tiles)
                    kern = "fp4_scaled" if path == "scaled" else "fp4_gemm"
                    const = {"BM": bm, "BN": QBLOCK if sw else cfg["BN"], "SWIGLU": sw}
                    if kern == "fp4_gemm":
                        const["FMT"] = (2 if bm >= 64 else 0) if fmt == "mxfp4" else 1
                    add(_choice(kern, const, cfg, why))
    import torch
    for N, K, dt in ((2624, 4096, torch.bfloat16), (1024, 4096, torch.bfloat16), (256, 4096, torch.float32),
                     (2624, 7168, torch.bfloat16), (384, 7168, torch.float32)):
        for rb in (1, 2, 4):                            # the projections and the router's gate (Flash, Pro)
            if dense_gemv(rb, N, K, dt, t):             # rows per program: min(4, next power of two of the rows)
                cfg = dense_gemv_config(N, K, dt.itemsize, t)
                add(_choice("dense_gemv_f32" if dt == torch.float32 else "dense_gemv",
                            {"BN": cfg["BN"], "BK": cfg["BK"], "SPLIT": cfg["SPLIT"] > 1, "RB": rb}, cfg,
                            f"dense gemv N={N} K={K} {dt} {rb} rows a program"))
    if dense_mm(max(ROWS), t):                           # the router's gate at prefill sizes (bf16-exact weight)
        cfg = dense_mm_config(t)
        add(_choice("dense_mm", {"BM": cfg["BM"], "BN": cfg["BN"], "BK": cfg["BK"]}, cfg, "router gate, prefill rows"))
    # the CUDA-core GEMV's FP8 form: the shared expert where no tensor-core decode kernel runs
    if decode_kernel(t) != "mma":
        cfg = gemv_config(4096, t, True)
        add(_choice("gemv", {"WFMT": 3, "BN": cfg["BN"], "BM": 1}, cfg, "fp8 gemv"))
    return list(seen.values())


__all__ = ["Choice", "FUSE_QUANT_MAX_ROWS", "GEMV_ROWS_PER_EXPERT", "MMA_GEMV_ROWS_PER_EXPERT", "MMA_MAX_ROWS",
           "MMA_MAX_WEIGHT", "DENSE_GEMV_MAX_ROWS", "DENSE_GEMV_FP32_MAX_ROWS", "DENSE_GEMV_MAX_WEIGHT", "PREFILL_MIN_ROWS", "PREFILL_STEP_MIN_ROWS", "PREFILL_ROWS_PER_EXPERT", "SHARED_SPLIT_MAX_ROWS", "SHARED_UNFUSED",
           "WO_A_MAX_ROWS",
           "FP8MMA_MAX_ROWS_PER_EXPERT", "FP8MMA_ROWS_PER_EXPERT", "PREDEC_ROWS_PER_EXPERT", "choices", "decode_kernel", "dense_gemv", "dense_gemv_config", "dense_mm", "dense_mm_config", "expert_path", "fp4_config", "fp4_mma_config", "fp4_path",
           "fp4_fp8_config", "fp4_prefill_config", "fp8_predec_config", "predecode_config", "fp8_kernel", "fp8_mma_config", "fp8_prefill_config", "fp8_split_k", "fp8_tiles",
           "gemv_config", "rows_tile", "wo_a_kernel"]
