"""Mixture-of-experts layer on the GPU hot path (spec §8); twin ``twins.moe`` (the reference MoE's math).

``moe_forward(x, ids, weights)`` = ``MoE.__call__`` (official numerics) with no Python loop over
experts and no host synchronisation (CUDA-graph capturable; every launch size follows from shapes):

1. routing (``route``): the fp32 gate GEMM (torch, the twin's op), then one Triton kernel per token
   (``_route_kernel``): ``sqrt(softplus(.))`` of the logits, top-k of ``score + bias`` (bias for
   selection only; ties -> lower expert id, as ``torch.topk``'s order for distinct values) or the
   ``tid2eid`` row (hash layers), the picked scores normalised ``w / sum(w) * route_scale``, and the
   sort keys with a duplicate mask (a repeated hash id contributes once).
2. sort: pairs (token, slot) stably sorted by expert, every expert's first row, the per-expert m-tile
   prefix sum and the inverse permutation: at decode sizes one Triton launch (``_moe_sort_prep``,
   a counting sort over 64-pair programs), above that ``torch.sort`` + ``_moe_prep``. Duplicate / masked pairs get the
   sentinel expert ``E`` and sort last.
3. act quant of x once per token (FP8 1x128, plus the f16 operand of the FP4 MMA kernel).
4. grouped FP4 GEMM over the active experts (``gemm.fp4``, grouped + gather + SwiGLU
   modes): w1 and w3 tiles of the same 128 columns in one program, then the official clamped SwiGLU
   (bf16-rounded w1/w3 outputs, fp32 math, routing weight applied before w2, one bf16 rounding) and
   the FP8 quantisation of h for w2 (e4m3 bytes + scales), written in sorted pair order; its f16
   copy for the next MMA is a torch cast.
5. grouped FP4 GEMM for w2 -> bf16 per pair row.
6. shared expert (``_shared_expert``): FP8 GEMM with the SwiGLU epilogue (up to 64 tokens: split-K
   partials of the GEMV / the MMA kernel + the SwiGLU pass), FP8 GEMM for w2 (no routing weight).
7. ``_moe_combine``: per token, its pairs in increasing expert id (= increasing sorted position),
   summed in fp32 starting from 0 (the twin's ``y[rows] += out_e`` loop order), plus the bf16 shared
   output, one bf16 rounding. Given equal expert outputs the combine is bit-exact.

Decode path (``path="gemv"``, the default up to ``router.GEMV_ROWS_PER_EXPERT`` average rows per expert, up to
``router.MMA_GEMV_ROWS_PER_EXPERT`` where the tensor-core kernel runs):
steps 3-6 run on decode kernels instead of the MMA kernels: grouped w1|w3 as split-K fp32 partials,
``swiglu_quant`` (the same SwiGLU epilogue + FP8 quantisation as a pass over the partials), grouped
w2 on the e4m3 h. On sm_89+: the tensor-core kernel of ``fp4_mma.py`` (8-row tiles); other GPUs and
the interpreter: the CUDA-core GEMV of ``gemv.py`` (1-row tiles).

FP8 prefill path (``path="fp8mma"``, the default for MXFP4 on sm_90 from ``router.FP8MMA_ROWS_PER_EXPERT`` to
``router.FP8MMA_MAX_ROWS_PER_EXPERT`` rows per expert when the scales fold exactly, ``MoEWeights.fp8_fold_exact``):
the same steps on ``fp4_fp8.py``'s kernel (weights decoded to e4m3 in registers, FP8 wgmma, per-128
promotion), activations and h as plain e4m3 bytes.

Pre-decoded FP8 path (``path="predec"``, MXFP4 whose scales fold exactly, sm_90, from
``router.PREDEC_ROWS_PER_EXPERT`` rows per expert): ``fp4_fp8.predecode`` writes the local experts' w1|w3, then
w2, as e4m3 tiles with fp32 factors into transient buffers (2x the weights' bytes, 4.3 + 2.1 GB for 256
V4-Flash experts: in passes over expert ranges of at most ``router.PREDEC_SCRATCH_BYTES``, one alive at a
time: decoding the next pass on a second stream beside this pass's GEMM was slower,
``experiments/exp_predec.py``), and ``fp4_fp8.py``'s kernel loads those tiles instead of decoding FP4 in
its K loop: the same bits as ``fp8mma``. The factors are one per 128 x 128 weight tile where the experts'
scales allow it (``MoEWeights.fp8_tile_max``; the promotion is then one FFMA per element, as for a
block-scaled FP8 weight), else one per (row, 128-block). GEMM 1 on sm_90 writes bf16 w1|w3 outputs and
``gemv.swiglu_quant`` forms h from them. With tile factors on sm_90 (``router.PREDEC_WS``) both GEMMs run on
``fp4_fp8_ws.py`` instead: the weights are decoded to e4m3 in shared memory inside the GEMM (no decode pass, no
transient copy), x and h in its group split order; the same bits.

Prefill path (``path="prefill"``, MXFP4 on sm_90 above ``router.PREFILL_ROWS_PER_EXPERT`` rows
per expert outside the FP8 path's range or whose scales do not fold into e4m3): the same steps on ``fp4_prefill.py``'s kernel (one K = 128 tensor-core dot per 128-K block,
activations and h as split-K-order f16 operands), same epilogues.

Numerics vs the twin: routing ids equal (barring a near-tie within an ulp of the scores), weights
within ulps (the kernel's softplus, log1p and sum order are not torch's); every expert output
agrees within bf16 rounding (GEMM fp32 summation order differs; a one-ulp flip of a bf16 w1/w3
output can move h by one FP8 step), so the layer output is compared at FP8/bf16 tolerance (H200:
the GPU tests at V4-Flash dims pass on both paths).

Weights: ``MoEWeights`` holds the stacked packed experts ``w13 [E, 2I, d/2]`` (w1 rows then w3 rows
of each expert), ``w2 [E, d, I/2]``, their scales, and the FP8 shared expert. Built once from the
reference object (``MoEWeights.from_reference``: the reference keeps dequantised fp32 weights; they
are re-quantised to MXFP4, which is lossless for MXFP4-born weights and checked) or from packed
checkpoint tensors (``MoEWeights.from_packed``, MXFP4 or NVFP4).

Measurements: BENCHMARKS.md ("MoE layer at decode"), docs/kernel-measurements.md.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from ..streams import Fork
from .gemm import dense_gemv, dense_mm, fp4_mma
from .gemm import route as router
from .gemm.common import f16_operand
from .gemm.fp4 import fp4_launch
from .gemm.fp8 import act_quant_fp8, fp8_gemm_partials, fp8_swiglu, fp8_weight_exact
from .gemm.fp8 import fp8_gemm as fp8_gemm_tiles
from .gemm.gemv import gemv_launch, swiglu_quant
from .gemm.linear import fp8_gemm
from .counters import arrival_counters
from .lib import PDL_LAUNCH, QBLOCK, interpreting, target, triton_available, u8

if triton_available():
    import triton
    import triton.language as tl

    from .counters import arrive
    from .lib import add_splits4, pdl_wait, quant_blocks, rne_bf16

    SORT_CH = tl.constexpr(64)

    @triton.jit
    def _sqrt_softplus(z):
        """sqrt(softplus(z)) in fp32 (``F.softplus``: z above 20 passes through). log1p(exp(-|z|)) via
        log(u) - ((u - 1) - y) / u, u = 1 + y (accurate to about an ulp, no libdevice: the
        interpreter runs it too); the square root correctly rounded, as torch's."""
        y = tl.exp(-tl.abs(z))
        u = 1.0 + y
        l1p = tl.where(u == 1.0, y, tl.log(u) - ((u - 1.0) - y) / u)
        sp = tl.where(z > 20.0, z, tl.maximum(z, 0.0) + l1p)
        return tl.sqrt_rn(sp)

    @triton.jit
    def _route_kernel(LOGIT, BIAS, TID2EID, IDS, IDX, W, EFLAT, X, Q, SQ, E, E0, EL, stride_s, route_scale, nb,
                      stride_x, stride_q, stride_sq, T, CNT, PERM, OFFS, TCUM, INV,
                      KTOP: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
                      HASH: tl.constexpr, QUANT: tl.constexpr, QB: tl.constexpr, INTERP: tl.constexpr,
                      SORT: tl.constexpr = False, BM: tl.constexpr = 1, ES: tl.constexpr = 2,
                      PP: tl.constexpr = 2):
        """One token: scores sqrt(softplus(logits)) of all E experts, the top-k of score + bias (ties ->
        lower id) or the token's tid2eid row, the picked scores normalised (w / sum(w) * route_scale,
        a repeated hash id counted in the sum as the twin's gather does) and the sort keys (a repeated
        id contributes once: later copies get the sentinel). Sort keys are local expert ids: experts
        [E0, E0 + EL) of this rank map to 0..EL-1, every other pick (another rank's expert, a repeat)
        to the sentinel EL (one rank: E0 = 0, EL = E). QUANT: also the token's 1x128 FP8
        quantisation (``gemm.fp8.act_quant_fp8``'s bytes and scales: the expert GEMMs' operand, one
        launch fewer). SORT: the last of the T programs to arrive on the counter CNT (acq_rel; one
        program: no counter) also runs ``sort_pairs``' counting sort of all T * KTOP keys into PERM /
        OFFS / TCUM / INV (``_moe_sort_prep``'s rows, ES = its EP, PP >= the pair count; one launch
        fewer at decode) and resets CNT to 0."""
        pdl_wait()
        t = tl.program_id(0).to(tl.int64)
        jk = tl.arange(0, KP)
        km = jk < KTOP
        ar = tl.arange(0, EP)
        em = ar < E
        sc = _sqrt_softplus(tl.load(LOGIT + t * stride_s + ar, mask=em, other=0.0))
        if HASH:
            tok = tl.load(IDS + t).to(tl.int64)
            idx = tl.load(TID2EID + tok * KTOP + jk, mask=km, other=0).to(tl.int32)
        else:
            b = tl.load(BIAS + ar, mask=em, other=0.0)
            # each pick one max-reduction of a packed int64: the score's order-preserving int32 (its sign bit
            # kept, the other 31 bits flipped where it is set) over EP - 1 - id, so the largest score wins and
            # among equal scores the lowest id (no -0.0 here: sc > 0, and sc + b == 0 rounds to +0.0)
            bits = tl.where(em, sc + b, float("-inf")).to(tl.int32, bitcast=True)
            key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
            v = (key << 32) | (EP - 1 - ar).to(tl.int64)
            idx = tl.zeros([KP], tl.int32)
            for j in tl.static_range(KTOP):
                m = tl.max(v, axis=0)
                i = EP - 1 - m.to(tl.int32)              # the low word: EP - 1 - id
                idx = tl.where(jk == j, i, idx)
                v = tl.where(ar == i, -9223372036854775807, v)     # below every packed score (-inf's too)
        # the picked scores out of registers (one-hot sums: exact, one nonzero term each)
        w = tl.sum(tl.where((ar[None, :] == idx[:, None]) & km[:, None], sc[None, :], 0.0), axis=1)
        w = w / tl.sum(w, axis=0) * route_scale
        dup = tl.sum(((idx[None, :] == idx[:, None]) & (jk[None, :] < jk[:, None])).to(tl.int32), axis=1) > 0
        tl.store(IDX + t * KTOP + jk, idx.to(tl.int64), mask=km)
        tl.store(W + t * KTOP + jk, w, mask=km)
        loc = idx - E0
        keys = tl.where(dup | (idx < 0) | (loc < 0) | (loc >= EL), EL, loc)
        tl.store(EFLAT + t * KTOP + jk, keys, mask=km)
        if QUANT:
            for b0 in range(0, nb, QB):                # [QB, 128] tiles, as _act_quant_kernel's
                quant_blocks(X, Q, SQ, t, b0, nb, stride_x, stride_q, stride_sq, QB, INTERP)
        if SORT:
            if T == 1:                                 # the keys are this program's registers: no round trip
                _sort_keys(keys, jk, km, PERM, OFFS, TCUM, INV, EL, BM, ES)
            elif arrive(CNT) == T - 1:
                _sort_all(EFLAT, PERM, OFFS, TCUM, INV, T * KTOP, EL, BM, ES, PP)
                tl.store(CNT, 0)

    @triton.jit
    def _sort_all(EFLAT, PERM, OFFS, TCUM, INV, P, E, BM: tl.constexpr, EP: tl.constexpr, PP: tl.constexpr):
        """``_moe_sort_prep``'s whole grid in one program: the counts, then the rows chunk by chunk."""
        _sort_counts(EFLAT, OFFS, TCUM, P, E, BM, EP, PP)
        for c0 in range(0, P, SORT_CH):
            _sort_rows(EFLAT, PERM, INV, P, c0, SORT_CH)

    @triton.jit
    def _sort_counts(EFLAT, OFFS, TCUM, P, E, BM: tl.constexpr, EP: tl.constexpr, PP: tl.constexpr):
        """OFFS[e] = first sorted row of expert e (e = 0..E), TCUM = the prefix of ceil(count / BM) m-tiles
        (TCUM[0] = 0), from the P <= PP sort keys (``.cg``: written by other programs of a launch)."""
        i = tl.arange(0, PP)
        _counts_store(tl.load(EFLAT + i, mask=i < P, other=0, cache_modifier=".cg"), i < P, OFFS, TCUM, E, BM, EP)

    @triton.jit
    def _sort_keys(keys, ii, im, PERM, OFFS, TCUM, INV, E, BM: tl.constexpr, EP: tl.constexpr):
        """``_sort_counts`` + ``_sort_rows`` of one token's keys held in registers (``keys`` at pairs ``ii``,
        live where ``im``): the same OFFS / TCUM / PERM / INV."""
        _counts_store(keys, im, OFFS, TCUM, E, BM, EP)
        row = _rank(keys, ii, keys, ii, im)
        tl.store(PERM + row, ii.to(tl.int64), mask=im)
        tl.store(INV + ii, row, mask=im)

    @triton.jit
    def _rank(ki, ii, kj, jj, jm):
        """Per pair i (key ki): how many pairs j (key kj, live where jm) sort before it, by a smaller key or by
        the same key and a lower index (the stable counting sort's row; a [len(ii), len(jj)] compare block)."""
        first = (kj[None, :] < ki[:, None]) | ((kj[None, :] == ki[:, None]) & (jj[None, :] < ii[:, None]))
        return tl.sum((first & jm[None, :]).to(tl.int32), axis=1)

    @triton.jit
    def _counts_store(keys, km, OFFS, TCUM, E, BM: tl.constexpr, EP: tl.constexpr):
        """OFFS / TCUM (``_sort_counts``) from sort keys in registers, live where ``km``."""
        e = tl.arange(0, EP)
        cnt = tl.histogram(keys, EP, mask=km)
        tl.store(OFFS + e, (tl.cumsum(cnt, axis=0) - cnt).to(tl.int64), mask=e <= E)
        tiles = tl.where(e < E, (cnt + BM - 1) // BM, 0)
        tl.store(TCUM + 1 + e, tl.cumsum(tiles, axis=0).to(tl.int64), mask=e < E)
        tl.store(TCUM + e, tl.zeros([EP], tl.int64), mask=e == 0)

    @triton.jit
    def _sort_rows(EFLAT, PERM, INV, P, c0, CH: tl.constexpr):
        """Pairs c0 .. c0+CH-1 of the stable counting sort: a pair's row is the number of pairs of a
        smaller key plus the earlier pairs of its own key (CH x CH compare blocks over all P pairs)."""
        jl = tl.arange(0, CH)
        ii = c0 + jl
        im = ii < P
        ei = tl.load(EFLAT + ii, mask=im, other=0, cache_modifier=".cg")
        row = tl.zeros([CH], tl.int32)
        for d0 in range(0, P, CH):
            jj = d0 + jl
            ej = tl.load(EFLAT + jj, mask=jj < P, other=2147483647, cache_modifier=".cg")
            row += _rank(ei, ii, ej, jj, jj < P)
        tl.store(PERM + row, ii.to(tl.int64), mask=im)
        tl.store(INV + ii, row, mask=im)

    @triton.jit(do_not_specialize=['P'])
    def _moe_sort_prep(EFLAT, PERM, OFFS, TCUM, INV, P, E, BM: tl.constexpr, EP: tl.constexpr,
                       PP: tl.constexpr, CH: tl.constexpr):
        """Grid (chunks of CH pairs), P <= PP: stable counting sort by expert id (sentinel E last) ->
        PERM[row] = pair id, INV[pair] = row; program 0 writes OFFS / TCUM as ``_moe_prep``. A pair's row
        is the number of pairs of a smaller expert id plus the earlier pairs of its own (CH x CH compare
        blocks over all P pairs: O(P^2) work, P / CH programs, for decode sizes)."""
        pdl_wait()
        if tl.program_id(0) == 0:
            _sort_counts(EFLAT, OFFS, TCUM, P, E, BM, EP, PP)
        _sort_rows(EFLAT, PERM, INV, P, tl.program_id(0) * CH, CH)

    @triton.jit(do_not_specialize=['P'])
    def _moe_prep(SORTED_E, PERM, OFFS, TCUM, INV, P, E,
                  BM: tl.constexpr, EP: tl.constexpr, LOG2P: tl.constexpr, CH: tl.constexpr):
        """One program: OFFS[e] = first sorted row of expert e (e = 0..E, OFFS[E] = valid rows),
        TCUM = inclusive prefix of ceil(count / BM) with TCUM[0] = 0, INV[perm[i]] = i."""
        pdl_wait()
        e = tl.arange(0, EP)
        lo = tl.zeros([EP], tl.int32)
        hi = tl.zeros([EP], tl.int32) + P
        for _ in tl.static_range(LOG2P):          # lower_bound(sorted_e, e), vectorised over e
            mid = (lo + hi) // 2
            v = tl.load(SORTED_E + mid, mask=mid < P, other=2147483647)
            go = (v < e) & (mid < hi)
            lo = tl.where(go, mid + 1, lo)
            hi = tl.where(go, hi, mid)
        offs = lo
        tl.store(OFFS + e, offs.to(tl.int64), mask=e <= E)
        lo2 = tl.zeros([EP], tl.int32)               # lower_bound(sorted_e, e + 1)
        hi2 = tl.zeros([EP], tl.int32) + P
        for _ in tl.static_range(LOG2P):
            mid = (lo2 + hi2) // 2
            v = tl.load(SORTED_E + mid, mask=mid < P, other=2147483647)
            go = (v < e + 1) & (mid < hi2)
            lo2 = tl.where(go, mid + 1, lo2)
            hi2 = tl.where(go, hi2, mid)
        cnt = tl.where(e < E, lo2 - offs, 0)
        tiles = (cnt + BM - 1) // BM
        tc = tl.cumsum(tiles, axis=0)
        tl.store(TCUM + 1 + e, tc.to(tl.int64), mask=e < E)
        tl.store(TCUM + e, tl.zeros([EP], tl.int64), mask=e == 0)
        for c0 in range(0, P, CH):
            i = c0 + tl.arange(0, CH)
            pm = i < P
            p = tl.load(PERM + i, mask=pm, other=0)
            tl.store(INV + p, i.to(tl.int32), mask=pm)

    @triton.jit
    def _moe_combine(OUT, INV, OFFS, SH, Y, d, E, S, stride_s, stride_o, stride_sh, stride_y,
                     KTOP: tl.constexpr, KP: tl.constexpr, BD: tl.constexpr, HAS_SHARED: tl.constexpr,
                     SPLIT: tl.constexpr, F32: tl.constexpr, INTERP: tl.constexpr, S4: tl.constexpr = False):
        """Y[t] = sum of token t's expert rows of OUT in increasing sorted position (+ SH[t]), fp32, one
        bf16 rounding. SPLIT: OUT holds the w2 GEMM's fp32 split-K partials [S, pairs, d]; each row is
        their sum in split order rounded to bf16 (``common.sum_splits``' bits, without its launch).
        F32: Y is fp32 and keeps the unrounded sum (expert parallelism: a rank's partial sum). S4: at most
        four partials (S <= 4), summed without the split loop: the program is straight-line code, so the
        loads of all KTOP rows can issue together (one L2 round trip instead of one per row); the same adds
        in the same order, so the same bits."""
        pdl_wait()
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BD + tl.arange(0, BD)
        cm = cols < d
        jk = tl.arange(0, KP)
        big = 2147483647
        nvalid = tl.load(OFFS + E).to(tl.int32)
        pos = tl.load(INV + t * KTOP + jk, mask=jk < KTOP, other=big)
        pos = tl.where(pos < nvalid, pos, big)
        y = tl.zeros([BD], tl.float32)
        for j in tl.static_range(KTOP):            # increasing sorted position = increasing expert id
            p = tl.min(pos, axis=0)
            pos = tl.where(pos == p, big, pos)
            pv = (cols * 0 + p) < nvalid
            orow = OUT + p.to(tl.int64) * stride_o + cols
            if SPLIT:
                o = tl.zeros([BD], tl.float32)
                if S4:
                    o = add_splits4(o, orow, stride_s, cm & pv, 0, S)
                else:
                    for s in range(0, S, 4):    # four partials per L2 round trip, in split order
                        o = add_splits4(o, orow + s * stride_s, stride_s, cm & pv, s, S)
                y += rne_bf16(o)
            else:
                y += tl.load(orow, mask=cm & pv, other=0.0).to(tl.float32)
        if HAS_SHARED:
            y += tl.load(SH + t * stride_sh + cols, mask=cm, other=0.0).to(tl.float32)
        if F32:
            tl.store(Y + t * stride_y + cols, y, mask=cm)
        else:
            if INTERP:
                y = rne_bf16(y)
            tl.store(Y + t * stride_y + cols, y.to(tl.bfloat16), mask=cm)


# -------------------------------------------------------------------------------------------------
# weights

@dataclass
class MoEWeights:
    """Stacked MoE tensors (see module doc). fmt 'mxfp4': w*_s uint8 e8m0 [E, N, K/32];
    'nvfp4': w*_s e4m3 bytes [E, N, K/16] and per-row fp32 global scales w*_s2 [E, N]."""
    gate_w: torch.Tensor                 # fp32 [E, d]
    bias: torch.Tensor | None            # fp32 [E] (score layers) or None (hash layers)
    tid2eid: torch.Tensor | None         # int32 [V, k] (hash layers)
    topk: int
    route_scale: float
    limit: float
    fmt: str
    w13: torch.Tensor                    # uint8 [E, 2I, d/2]
    w13_s: torch.Tensor
    w13_s2: torch.Tensor | None
    w2: torch.Tensor                     # uint8 [E, d, I/2]
    w2_s: torch.Tensor
    w2_s2: torch.Tensor | None
    sh13: torch.Tensor | None            # e4m3 [2I_s, d]
    sh13_s: torch.Tensor | None          # fp32 [2I_s/128, d/128]
    sh2: torch.Tensor | None             # e4m3 [d, I_s]
    sh2_s: torch.Tensor | None
    expert0: int = 0                     # expert parallelism: w13 / w2 hold experts [expert0, expert0 + E)

    def fp8_fold_exact(self) -> bool:
        """Whether the routed experts' scales fold exactly into e4m3 (MXFP4 without groups 2^12 below
        their row's 128-block maximum, ``gemm.fp4_fp8.wide_spread``): the FP8-wgmma prefill path takes
        them. Computed once per object (a device sync); False for NVFP4, and while a CUDA graph is being
        captured before it was computed (the f16 prefill kernel is exact for both)."""
        got = self.__dict__.get("_fold_exact")
        if got is None:
            if self.fmt != "mxfp4" or (self.w13.is_cuda and torch.cuda.is_current_stream_capturing()):
                return False
            from .gemm.fp4_fp8 import wide_spread
            got = not (wide_spread(self.w13_s) or wide_spread(self.w2_s))
            self.__dict__["_fold_exact"] = got
        return got

    def fp8_tile_max(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(w13's, w2's) largest scale byte per 128 x 128 weight tile (``fp4_fp8.tile_max``) when no group
        lies 2^12 or more below its tile's maximum (``fp4_fp8.wide_spread(tile=True)``): the pre-decoded
        path then folds per tile and promotes with one scalar per tile; else None (per-row factors).
        Computed once per object (a device sync); None while a CUDA graph is being captured before."""
        if "_tile_max" not in self.__dict__:
            if not self.fp8_fold_exact() or (self.w13.is_cuda and torch.cuda.is_current_stream_capturing()):
                return None
            from .gemm.fp4_fp8 import tile_max, wide_spread
            ok = not any(wide_spread(s, tile=True) for s in (self.w13_s, self.w2_s))   # whole tiles too
            self.__dict__["_tile_max"] = (tile_max(self.w13_s), tile_max(self.w2_s)) if ok else None
        return self.__dict__["_tile_max"]

    def gate_bf16(self) -> torch.Tensor | None:
        """``gate_w`` as bf16 [E, d] when every value is bf16-exact (the checkpoints store the gate in bf16;
        the official GEMM upcasts it): the router's prefill-sized GEMM then runs on ``dense_mm`` (bf16 tensor
        cores, the same exact products, fp32 sums promoted every K block) instead of an fp32 SIMT GEMM on an
        upcast copy of x. None otherwise. Computed once per object (a
        device sync); None while a CUDA graph is being captured before."""
        if "_gate_bf16" not in self.__dict__:
            if self.gate_w.is_cuda and torch.cuda.is_current_stream_capturing():
                return None
            g = self.gate_w.to(torch.bfloat16)
            self.__dict__["_gate_bf16"] = g.contiguous() if torch.equal(g.float(), self.gate_w) else None
        return self.__dict__["_gate_bf16"]

    @property
    def n_experts(self) -> int:
        """Experts held here (the local ones under expert parallelism)."""
        return self.w13.shape[0]

    @property
    def n_routed(self) -> int:
        """Experts the router picks from (all ranks' together)."""
        return self.gate_w.shape[0]

    @property
    def dim(self) -> int:
        return self.w2.shape[1]

    @property
    def inter(self) -> int:
        return self.w13.shape[1] // 2

    def to(self, device) -> "MoEWeights":
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        for k, v in kw.items():
            if isinstance(v, torch.Tensor):
                kw[k] = v.to(device)
        return replace(self, **kw)

    # --------------------------------------------------------------- constructors
    @staticmethod
    def _shared_fp8(shared):
        if shared is None:
            return None, None, None, None
        q13, s13 = fp8_weight_exact(torch.cat([shared.w1.weight, shared.w3.weight], 0), "shared expert w1|w3")
        q2, s2 = fp8_weight_exact(shared.w2.weight, "shared expert w2")
        return q13, s13, q2, s2

    @classmethod
    def from_reference(cls, moe, fmt: str = "mxfp4", allow_lossy: bool = False) -> "MoEWeights":
        """Pack a ``reference.moe.MoE`` once. The reference keeps exact dequantised weights;
        MXFP4-born weights re-quantise to the same codes/scales (checked unless ``allow_lossy``).
        ``fmt='nvfp4'`` quantises with ModelOpt's recipe (w1/w3 share one global scale): lossy
        unless the weights came from exactly that recipe."""
        from ..formats.fp4 import dequant_mxfp4, dequant_nvfp4, quant_mxfp4, quant_nvfp4
        E = len(moe.experts)
        w13, s13, g13, w2, s2, g2 = [], [], [], [], [], []
        for ex in moe.experts:                          # load time, once
            a, b, c = ex.w1.weight, ex.w3.weight, ex.w2.weight
            if fmt == "mxfp4":
                for w, pl, sl in ((torch.cat([a, b], 0), w13, s13), (c, w2, s2)):
                    q, s = quant_mxfp4(w)
                    if not allow_lossy and not torch.equal(dequant_mxfp4(q, s), w.float()):
                        raise ValueError("expert weights are not MXFP4 representable (pass allow_lossy)")
                    pl.append(q.view(torch.uint8))
                    sl.append(s.view(torch.uint8))
            elif fmt == "nvfp4":
                g = torch.maximum(a.abs().amax(), b.abs().amax()) / (6.0 * 448.0)
                qa, sa, ga = quant_nvfp4(a, g)
                qb, sb, gb = quant_nvfp4(b, g)
                qc, sc, gc = quant_nvfp4(c)
                if not allow_lossy and not all(torch.equal(dequant_nvfp4(q, s_, g_), w.float()) for q, s_, g_, w in
                                               ((qa, sa, ga, a), (qb, sb, gb, b), (qc, sc, gc, c))):
                    raise ValueError("expert weights are not NVFP4 representable with ModelOpt's scales "
                                     "(pass allow_lossy)")
                w13.append(torch.cat([qa, qb], 0))
                s13.append(torch.cat([sa, sb], 0).view(torch.uint8))
                g13.append(torch.cat([ga.expand(a.shape[0]), gb.expand(b.shape[0])]))
                w2.append(qc)
                s2.append(sc.view(torch.uint8))
                g2.append(gc.expand(c.shape[0]))
            else:
                raise ValueError(f"fmt must be 'mxfp4' or 'nvfp4', got {fmt!r}")
        sh = cls._shared_fp8(moe.shared)
        return cls(gate_w=moe.gate_w.float().contiguous(),
                   bias=None if moe.bias is None else moe.bias.float().contiguous(),
                   tid2eid=None if moe.tid2eid is None else moe.tid2eid.to(torch.int32).contiguous(),
                   topk=moe.topk, route_scale=float(moe.route_scale),
                   limit=float(moe.experts[0].limit if E else moe.shared.limit), fmt=fmt,
                   w13=torch.stack(w13), w13_s=torch.stack(s13),
                   w13_s2=torch.stack(g13).float() if g13 else None,
                   w2=torch.stack(w2), w2_s=torch.stack(s2), w2_s2=torch.stack(g2).float() if g2 else None,
                   sh13=sh[0], sh13_s=sh[1], sh2=sh[2], sh2_s=sh[3])

    @classmethod
    def from_reference_exact(cls, moe, layer: int | None = None) -> "MoEWeights":
        """The packed form in which the reference's (exact, dequantised) experts are represented
        bit for bit: MXFP4 (official checkpoints) or else NVFP4 (ModelOpt); neither is an error."""
        errors = []
        for fmt in ("mxfp4", "nvfp4"):
            try:
                return cls.from_reference(moe, fmt)
            except ValueError as e:
                errors.append(f"{fmt}: {e}")
        where = "" if layer is None else f"layer {layer}: "
        raise ValueError(f"{where}routed experts fit neither FP4 kernel format exactly ({'; '.join(errors)})")

    @classmethod
    def from_packed(cls, gate_w, bias, tid2eid, topk, route_scale, limit, fmt, w1, w1_s, w3, w3_s, w2, w2_s,
                    w1_s2=None, w3_s2=None, w2_s2=None, shared=None) -> "MoEWeights":
        """From checkpoint-format tensors stacked over experts: w1/w3 packed [E, I, d/2], w2
        [E, d, I/2]; scales e8m0 [E, N, K/32] (mxfp4) or e4m3 [E, N, K/16] + fp32 [E] global
        (nvfp4); ``shared`` = ((w1, s1), (w3, s3), (w2, s2)) FP8 weights with 128x128 scales."""
        E, I = w1.shape[0], w1.shape[1]
        d = w2.shape[1]
        rows = lambda g, n: g.float().reshape(E, 1).expand(E, n)
        sh13 = sh13_s = sh2 = sh2_s = None
        if shared is not None:
            (a, sa), (b, sb), (c, sc) = shared
            sh13 = torch.cat([a, b], 0)
            sh13_s = torch.cat([_e8m0_f32(sa), _e8m0_f32(sb)], 0) if a.shape[0] % QBLOCK == 0 else None
            sh2, sh2_s = c, _e8m0_f32(sc)
        return cls(gate_w=gate_w.float().contiguous(), bias=None if bias is None else bias.float(),
                   tid2eid=None if tid2eid is None else tid2eid.to(torch.int32).contiguous(),
                   topk=int(topk), route_scale=float(route_scale), limit=float(limit), fmt=fmt,
                   w13=torch.cat([u8(w1), u8(w3)], 1).contiguous(),
                   w13_s=torch.cat([u8(w1_s), u8(w3_s)], 1).contiguous(),
                   w13_s2=None if fmt == "mxfp4" else torch.cat([rows(w1_s2, I), rows(w3_s2, I)], 1).contiguous(),
                   w2=u8(w2).contiguous(), w2_s=u8(w2_s).contiguous(),
                   w2_s2=None if fmt == "mxfp4" else rows(w2_s2, d).contiguous(),
                   sh13=sh13, sh13_s=sh13_s, sh2=sh2, sh2_s=sh2_s)


def _e8m0_f32(s: torch.Tensor) -> torch.Tensor:
    if s.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return s.view(torch.float8_e8m0fnu).float()
    return s.float()


# -------------------------------------------------------------------------------------------------
# forward

def route(x: torch.Tensor, ids: torch.Tensor | None, w: MoEWeights):
    """(expert ids [T, k] int64, routing weights [T, k] fp32): ``MoE.route``'s result (module doc)."""
    return _route(x, ids, w)[:2]


def _route(x: torch.Tensor, ids: torch.Tensor | None, w: MoEWeights, quant: bool = False, portable: bool = False,
           sort_bm: int | None = None):
    """``route`` -> (idx, weights, sort keys int32 [T * k], xq, xs, sort): with ``quant`` also x's
    ``act_quant_fp8`` (e4m3 bytes uint8 [T, d], fp32 scales [T, d/128]) from the same launch, else
    (..., None, None, ...); with ``sort_bm`` (up to ``SORT_FUSED_MAX`` pairs) ``sort_pairs(keys,
    n_experts, sort_bm)``'s result from the same launch (its last program), else None. The gate logits are the twin's fp32 GEMM: ``dense_gemv`` at decode sizes (one
    launch, x upcast in its loads); at prefill sizes with a bf16-exact gate (``MoEWeights.gate_bf16``)
    ``dense_mm`` (bf16 tensor cores, fp32 sums promoted every K block); else torch's fp32 GEMM
    (``portable``: always)."""
    T, d = x.shape
    k, E = w.topk, w.n_routed
    dev = x.device
    if not portable and dense_gemv.takes(x, w.gate_w):
        logits = dense_gemv.dense_gemv(x, w.gate_w)
    elif not portable and dense_mm.takes(x) and w.gate_bf16() is not None:
        logits = dense_mm.dense_mm(x, w.gate_bf16())
    else:
        logits = x.float() @ w.gate_w.T
    idx = torch.empty(T, k, dtype=torch.int64, device=dev)
    weights = torch.empty(T, k, dtype=torch.float32, device=dev)
    eflat = torch.empty(T * k, dtype=torch.int32, device=dev)
    xq = xs = sort = None
    if quant:
        if d % QBLOCK:
            raise ValueError(f"moe route: quantised x needs d % {QBLOCK} == 0, got d={d}")
        x = x.contiguous()
        xq = torch.empty(T, d, dtype=torch.uint8, device=dev)
        xs = torch.empty(T, d // QBLOCK, dtype=torch.float32, device=dev)
    if T:
        hash_layer = w.tid2eid is not None
        if hash_layer and ids is None:
            raise ValueError("hash-routed layer needs the token ids")
        kw = {} if interpreting() else {"num_warps": 4}
        fuse = sort_bm is not None and T * k <= SORT_FUSED_MAX
        EL = w.n_experts
        if fuse:
            sort = (torch.empty(T * k, dtype=torch.int64, device=dev), torch.empty(EL + 1, dtype=torch.int64, device=dev),
                    torch.empty(EL + 1, dtype=torch.int64, device=dev), torch.empty(T * k, dtype=torch.int32, device=dev))
        cnt = arrival_counters(dev, 1) if fuse and T > 1 else eflat
        perm, offs, tcum, inv = sort if fuse else (idx, idx, idx, eflat)
        _route_kernel[(T,)](
            logits, w.bias if w.bias is not None else logits, w.tid2eid if hash_layer else idx,
            ids if hash_layer else idx, idx, weights, eflat, x if quant else logits, xq if quant else idx,
            xs if quant else logits, E, w.expert0, EL, logits.stride(0), float(w.route_scale), d // QBLOCK,
            x.stride(0) if quant else 0, xq.stride(0) if quant else 0, xs.stride(0) if quant else 0,
            T, cnt, perm, offs, tcum, inv,
            KTOP=k, KP=triton.next_power_of_2(k), EP=triton.next_power_of_2(E), HASH=hash_layer, QUANT=quant,
            QB=min(8, triton.next_power_of_2(max(1, d // QBLOCK))), INTERP=interpreting(),
            SORT=fuse, BM=sort_bm if fuse else 1, ES=triton.next_power_of_2(EL + 1),
            PP=max(2, triton.next_power_of_2(T * k)) if fuse else 2, **kw, **PDL_LAUNCH)
        if sort_bm is not None and not fuse:
            sort = sort_pairs(eflat, EL, sort_bm)
    return idx, weights, eflat, xq, xs, sort


SORT_COUNTING_MAX = 1024   # pairs up to which sort_pairs runs the one-launch counting sort
SORT_FUSED_MAX = 128       # pairs up to which the router's launch also sorts (its last program: 2 x 2 compare
                           # blocks of 64 pairs at most, serial; more pairs take sort_pairs' own launch)


def sort_pairs(eflat: torch.Tensor, n_experts: int, bm: int):
    """(perm int64 [P] sorted row -> pair id, offs int64 [E+1], tcum int64 [E+1], inv int32 [P]): the
    pairs stably sorted by expert id (the sentinel ``n_experts`` last). Up to ``SORT_COUNTING_MAX``
    pairs (decode) one Triton launch (``_moe_sort_prep``), else ``torch.sort`` + ``_moe_prep``."""
    P = eflat.numel()
    dev = eflat.device
    offs = torch.empty(n_experts + 1, dtype=torch.int64, device=dev)
    tcum = torch.empty(n_experts + 1, dtype=torch.int64, device=dev)
    inv = torch.empty(P, dtype=torch.int32, device=dev)
    kw = {} if interpreting() else {"num_warps": 4}
    if 0 < P <= SORT_COUNTING_MAX:
        perm = torch.empty(P, dtype=torch.int64, device=dev)
        _moe_sort_prep[(triton.cdiv(P, 64),)](eflat, perm, offs, tcum, inv, P, n_experts, BM=bm,
                                              EP=triton.next_power_of_2(n_experts + 1), PP=triton.next_power_of_2(P),
                                              CH=64, **kw, **PDL_LAUNCH)
        return perm, offs, tcum, inv
    sorted_e, perm = torch.sort(eflat, stable=True)       # perm int64, read as is by the kernels
    _moe_prep[(1,)](sorted_e, perm, offs, tcum, inv, P, n_experts, BM=bm,
                    EP=triton.next_power_of_2(n_experts + 1), LOG2P=max(1, P.bit_length()),
                    CH=min(1024, triton.next_power_of_2(max(P, 1))), **kw, **PDL_LAUNCH)
    return perm, offs, tcum, inv


def moe_forward(x: torch.Tensor, ids: torch.Tensor | None, w: MoEWeights, path: str | None = None,
                config: dict | None = None, routing: tuple | None = None, return_parts: bool = False,
                partial: bool = False, portable: bool = False):
    """bf16 [T, d] = ``MoE.__call__(x, ids)`` (module doc). ``routing=(idx [T, k], weights [T, k])``
    skips the router (ids < 0 = no expert for that slot; global expert ids).

    ``partial`` (expert parallelism: ``w`` holds experts [expert0, expert0 + n_experts) of
    ``n_routed``): returns (fp32 [T, d] sum of this rank's routed-expert outputs, unrounded; bf16
    [T, d] shared-expert output or None). The caller sums the first over the ranks, adds the second
    and rounds once to bf16: the official MoE's order (``y`` all-reduced, then ``+ shared``), and
    at one rank the bits of the fused combine. ``portable``: the kernels without target-tuned paths only
    (the CUDA-core GEMV up to ``router.GEMV_ROWS_PER_EXPERT`` rows per expert, the dequant FP4 kernel
    above)."""
    if x.dim() != 2 or x.shape[1] != w.dim:
        raise ValueError(f"moe_forward: expected x [T, {w.dim}], got {tuple(x.shape)}")
    x = x.to(torch.bfloat16).contiguous()
    T, d = x.shape
    E, I, k = w.n_experts, w.inter, w.topk
    dev = x.device
    if T == 0:
        if partial:
            return torch.zeros(0, d, dtype=torch.float32, device=dev), \
                (None if w.sh13 is None else torch.empty(0, d, dtype=torch.bfloat16, device=dev))
        return torch.empty(T, d, dtype=torch.bfloat16, device=dev)
    if routing is not None:
        k = routing[0].shape[1]
    P = T * k
    # the path needs the pair count only, not the routing: this rank's expected share of the pairs
    P_local = P * E / w.n_routed
    rows_per_expert = P_local / max(1, min(E, P_local))
    t = target(dev)
    if portable:
        path = "gemv" if rows_per_expert <= router.GEMV_ROWS_PER_EXPERT else "dequant"
        config = dict(config or {}, kernel="cuda-core") if path == "gemv" else config
    if path is None:
        path = router.expert_path(rows_per_expert, w.fmt, t)
        if path in ("fp8mma", "predec") and not w.fp8_fold_exact():
            path = router.expert_path(rows_per_expert, w.fmt, t, fold_exact=False)
    if path == "predec" and (w.fmt != "mxfp4" or not w.fp8_fold_exact()):
        raise ValueError("moe predec path: MXFP4 experts whose scales fold exactly into e4m3 only "
                         f"(format {w.fmt}, fold exact: {w.fmt == 'mxfp4' and w.fp8_fold_exact()})")
    xq = xs = None
    early = None
    if path == "gemv" and w.sh13 is not None and SHARED_EARLY:
        fork = Fork(dev, T)
        if fork.s is not None:
            with fork.side():
                sq, ss = act_quant_fp8(x)     # referenced by this frame until _moe_gemv has joined the fork
                early = (fork, _shared_expert(u8(sq), ss, w, portable))
    if routing is None:    # the paths that take x as plain e4m3 + scales get it from the router's launch
        idx, rw, eflat, xq, xs, sort = _route(x, ids, w, quant=path in ("gemv", "prefill", "fp8mma", "predec"),
                                              portable=portable,
                                              sort_bm=_gemv_kernel(config, dev)[1] if path == "gemv" else None)
    else:
        idx, rw = routing
        first = torch.ones_like(idx, dtype=torch.bool)
        for j in range(1, k):                                    # slots, not experts
            first[:, j] = (idx[:, :j] != idx[:, j:j + 1]).all(dim=1)
        loc = idx - w.expert0
        keep = first & (loc >= 0) & (loc < E)
        eflat = torch.where(keep, loc, torch.full_like(idx, E)).to(torch.int32).reshape(-1)
        sort = None
    if path == "gemv":
        return _moe_gemv(x, w, idx, rw, eflat, k, config, return_parts, xq, xs, partial, portable, sort, early)
    if path == "prefill":
        from .gemm.fp4_prefill import f16_operand_split, fp4_prefill_launch
        pcfg = {"13": dict(router.fp4_prefill_config(rows_per_expert, t, swiglu=True), **(config or {})),
                "2": dict(router.fp4_prefill_config(rows_per_expert, t), **(config or {}))}
        if pcfg["13"]["BM"] != pcfg["2"]["BM"] or pcfg["13"]["KSPLIT"] != pcfg["2"]["KSPLIT"]:
            raise ValueError("moe prefill path: both GEMMs need the same BM and K order")
        bm, ksplit = pcfg["13"]["BM"], pcfg["13"]["KSPLIT"]
        operand = f16_operand_split if ksplit else f16_operand
    elif path in ("fp8mma", "predec"):
        from .gemm.fp4_fp8 import fp4_fp8_launch, predecode
        tiles = router.fp4_fp8_config if path == "fp8mma" else router.fp8_predec_config
        pcfg = {"13": dict(tiles(rows_per_expert, t, swiglu=True), **(config or {})),
                "2": dict(tiles(rows_per_expert, t), **(config or {}))}
        if pcfg["13"]["BM"] != pcfg["2"]["BM"]:
            raise ValueError(f"moe {path} path: both GEMMs need the same BM")
        bm = pcfg["13"]["BM"]
    else:
        bm = router.fp4_config(rows_per_expert, t)["BM"]
        if config and "BM" in config:
            bm = config["BM"]
    perm, offs, tcum, inv = sort_pairs(eflat, E, bm)
    n_tiles = min(P, triton.cdiv(P, bm) + min(E, P))
    # activations: one quantisation per token (the shared expert's e4m3 copy and the FP4 operand)
    if path in ("prefill", "fp8mma", "predec"):
        if xq is None:
            xq, xs = act_quant_fp8(x)
        a = operand(xq.view(torch.float8_e4m3fn)) if path == "prefill" else u8(xq)
    else:
        xq, xs, a16 = act_quant_fp8(x, with_f16=True)
        a = u8(xq) if path == "scaled" else a16
    pw = rw.float().contiguous().reshape(-1)
    # routed experts: grouped GEMM 1 (w1|w3 + SwiGLU + FP8 quant of h), grouped GEMM 2 (w2)
    h = torch.empty(P, I, dtype=torch.uint8, device=dev)            # e4m3 bytes of h
    hs = torch.empty(P, I // QBLOCK, dtype=torch.float32, device=dev)
    out = torch.empty(P, d, dtype=torch.bfloat16, device=dev)
    grouped = dict(offs=offs, tcum=tcum, n_groups=E, n_tiles=n_tiles)
    if path == "fp8mma":      # h (e4m3 bytes) is GEMM 2's operand as it is
        fp4_fp8_launch(a, xs, w.w13, w.w13_s, w.w13_s2, h, hs, P, I, d, I, fmt=w.fmt, swiglu=True, limit=w.limit,
                       perm=perm, pw=pw, top_k=k, config=pcfg["13"], **grouped)
        fp4_fp8_launch(h, hs, w.w2, w.w2_s, w.w2_s2, out, None, P, d, I, 0, fmt=w.fmt, config=pcfg["2"], **grouped)
    elif path == "predec":
        # passes over expert ranges whose e4m3 copy fits router.PREDEC_SCRATCH_BYTES, one copy alive at a
        # time; a pass's grid covers every tile its experts can have (the rest exit at once). ATMA (TMA
        # activation tiles) takes GEMM 1's rows in sorted order: x, its scales and the routing weights
        # gathered once here
        g1 = dict(a=a, sa=xs, perm=perm, pw=pw)
        # TILE (TMA weight tiles): one weight factor per 128 x 128 tile where the scales allow it, so the
        # promotion multiplies by a scalar per K block (fp8_prefill's form) instead of a per-column vector
        tmax = w.fp8_tile_max() if pcfg["13"].get("TILE") and pcfg["13"].get("WTMA") else None
        from .gemm import fp4_fp8_ws as ws_gemm
        # UNFUSED (TMA activation tiles only): GEMM 1 writes w1|w3's bf16 outputs, then one pass forms h (the
        # fused epilogue rounds both to bf16 first too: the same bits) and GEMM 1 runs at GEMM 2's tile
        unfused = bool(pcfg["13"].get("UNFUSED")) and bool(pcfg["13"].get("ATMA"))
        # router.PREDEC_WS: both GEMMs decode the experts inside the kernel (fp4_fp8_ws, tile factors only), all
        # experts in one launch each, activations in its group split order (x permuted per token before the
        # gather; h stored so by the SwiGLU pass with router.SWIGLU_SPLIT_STORE, else permuted after it); the same
        # bits as the passes below
        in_kernel = router.PREDEC_WS and unfused and tmax is not None and ws_gemm.available(dev)
        if pcfg["13"].get("ATMA"):
            rows_of = perm // k
            src = ws_gemm.split_k_order(a) if in_kernel else a
            g1 = dict(a=src.index_select(0, rows_of), sa=xs.index_select(0, rows_of), perm=None, pw=pw[perm])
        y13 = torch.empty(P, 2 * I, dtype=torch.bfloat16, device=dev) if unfused else None
        if in_kernel:
            ws_gemm.fp4_fp8_ws(g1["a"], g1["sa"], w.w13, w.w13_s, tmax[0], offs, out=y13)
            swiglu_quant(y13[None], w.limit, pw=g1["pw"], out=(h, hs), split_order=router.SWIGLU_SPLIT_STORE)
            del y13
            ws_gemm.fp4_fp8_ws(h if router.SWIGLU_SPLIT_STORE else ws_gemm.split_k_order(h), hs, w.w2, w.w2_s,
                               tmax[1], offs, out=out)
        else:
            for j, (wq, ws_, swiglu) in enumerate(((w.w13, w.w13_s, True), (w.w2, w.w2_s, False))):
                step = router.predec_experts_per_pass(E, wq.shape[1], 2 * wq.shape[2])
                for e0 in range(0, E, step):
                    e1 = min(E, e0 + step)
                    part = dict(offs=offs[e0:e1 + 1], tcum=tcum[e0:e1 + 1] - tcum[e0], n_groups=e1 - e0,
                                n_tiles=min(P, triton.cdiv(P, bm) + min(e1 - e0, P)))
                    w8, f8 = predecode(wq[e0:e1], ws_[e0:e1], tile=tmax is not None,
                                       tile_smax=None if tmax is None else tmax[j][e0:e1])
                    if swiglu and unfused:
                        fp4_fp8_launch(g1["a"], g1["sa"], w8, f8, None, y13, None, P, 2 * I, d, 0, fmt=w.fmt,
                                       config=pcfg["2"], predecoded=True, **part)
                    elif swiglu:
                        fp4_fp8_launch(g1["a"], g1["sa"], w8, f8, None, h, hs, P, I, d, I, fmt=w.fmt, swiglu=True,
                                       limit=w.limit, perm=g1["perm"], pw=g1["pw"], top_k=k, config=pcfg["13"],
                                       predecoded=True, **part)
                    else:
                        fp4_fp8_launch(h, hs, w8, f8, None, out, None, P, d, I, 0, fmt=w.fmt, config=pcfg["2"],
                                       predecoded=True, **part)
                    del w8, f8
                if swiglu and unfused:
                    swiglu_quant(y13[None], w.limit, pw=g1["pw"], out=(h, hs))
                    del y13
    elif path == "prefill":
        fp4_prefill_launch(a, xs, w.w13, w.w13_s, w.w13_s2, h, hs, P, I, d, I, fmt=w.fmt, swiglu=True,
                           limit=w.limit, perm=perm, pw=pw, top_k=k, config=pcfg["13"], **grouped)
        fp4_prefill_launch(operand(h.view(torch.float8_e4m3fn)), hs, w.w2, w.w2_s, w.w2_s2, out, None, P, d, I, 0,
                           fmt=w.fmt, config=pcfg["2"], **grouped)
    else:
        cfg = dict(config or {}, BM=bm)
        fp4_launch(a, xs, w.w13, w.w13_s, w.w13_s2, h, hs, P, I, d, I, fmt=w.fmt, swiglu=True, limit=w.limit,
                   perm=perm, pw=pw, top_k=k, path=path, config=cfg, **grouped)
        h2 = h if path == "scaled" else f16_operand(h.view(torch.float8_e4m3fn))
        fp4_launch(h2, hs, w.w2, w.w2_s, w.w2_s2, out, None, P, d, I, 0, fmt=w.fmt, path=path, config=cfg,
                   **grouped)
    # shared expert (FP8)
    sh = _shared_expert(xq, xs, w, portable) if w.sh13 is not None else None
    y = _combine(out, inv, offs, sh, k, partial)
    if return_parts:
        return y, dict(idx=idx, weights=rw, perm=perm, offs=offs, tcum=tcum, inv=inv, out=out, shared=sh,
                       path=path)
    return y


# the combine's one-round-trip form (``_moe_combine``'s S4, 256-column programs) where the w2 GEMM left at most
# four split partials (the decode step's): a token's expert rows load side by side instead of one L2 round trip a
# row. Same bits as the split loop (the CPU test; the GPU MoE and engine tests pass with it on, H100); H100 decode
# step at batch 1 -0.9% with the binary-search tile lookup, -0.3% with the vector one, batch 64 within the spread
# (docs/benchmarks-2026-12-07.md). False: the split loop (``decode_step.py --moe-combine``)
COMBINE_ONE_TRIP = True
# decode (the GEMV path) with the side stream (``dsv4.streams``): the shared expert forks before the router, from its
# own ``act_quant_fp8`` of x (the router's launch quantises to the same bytes), so its weights stream while the gate
# and the routing run, not beside the routed w1|w3; False: it forks after the router, on the router's quantised x
# (the A/B of benchmarks/decode_step.py --shared-fork)
SHARED_EARLY = False


def _combine(out, inv, offs, sh, k, partial=False):
    """bf16 y [T, d] = sum over each token's pairs of the expert outputs ``out`` + shared expert
    ``sh``, one rounding; ``out``: bf16 rows [pairs, d], or the w2 GEMM's unsummed fp32 split
    partials [S, pairs, d]. ``partial``: (the fp32 sum without ``sh``, ``sh``) (``moe_forward``)."""
    T, d = inv.numel() // k, out.shape[-1]
    y = torch.empty(T, d, dtype=torch.float32 if partial else torch.bfloat16, device=out.device)
    add = sh if sh is not None and not partial else None
    kw = {} if interpreting() else {"num_warps": 4}
    split = out.dim() == 3
    one_trip = COMBINE_ONE_TRIP and (not split or out.shape[0] <= 4)
    # one trip: 256 columns a program (the loads of a token's rows side by side fit the registers)
    BD = min(256 if one_trip else 1024, triton.next_power_of_2(d))
    _moe_combine[(T, triton.cdiv(d, BD))](
        out, inv, offs, add if add is not None else y, y, d, offs.numel() - 1, out.shape[0] if split else 1,
        out.stride(0) if split else 0, out.stride(-2), add.stride(0) if add is not None else 0, y.stride(0),
        KTOP=k, KP=triton.next_power_of_2(k), BD=BD, HAS_SHARED=add is not None, SPLIT=split, F32=partial,
        INTERP=interpreting(), S4=one_trip and split, **kw, **PDL_LAUNCH)
    return (y, sh) if partial else y


def _shared_expert(xq, xs, w: MoEWeights, portable: bool = False):
    """bf16 [T, d] shared-expert output from the quantised activation. w1|w3 + SwiGLU: up to
    SHARED_SPLIT_MAX_ROWS tokens the split-K MMA kernel's partials (``fp8_gemm_partials``) summed by
    the SwiGLU pass (``swiglu_quant``); above, the MMA kernel with the SwiGLU epilogue, which cannot
    split K (16 programs per 64 tokens at V4-Flash size: 47 us at 64 tokens on the H200,
    docs/benchmarks-2026-12-01.md). At 1-4 tokens the MMA partials are bit-equal to the CUDA-core
    GEMV's and faster (H200, Flash / Pro: 15.2-17.1 vs 18.0-30.9 us, 27.5-28.0 vs 31.9-68.7 us). With
    ``router.SHARED_UNFUSED`` (on), from ``router.PREFILL_STEP_MIN_ROWS`` rows where ``fp8_gemm`` routes the size
    to the dense TMA kernel: its bf16 w1|w3 outputs, then the SwiGLU pass. w2 through ``fp8_gemm`` (its decode-size routing)."""
    T = xq.shape[0]
    if T <= router.SHARED_SPLIT_MAX_ROWS:
        hq, hsc = swiglu_quant(fp8_gemm_partials(xq, xs, w.sh13, w.sh13_s), w.limit)
        hq = hq.view(torch.float8_e4m3fn)
    elif (router.SHARED_UNFUSED and not portable and T >= router.PREFILL_STEP_MIN_ROWS and
          router.fp8_kernel(T, w.sh13.shape[0], w.sh13.shape[1], target(xq.device), prequantised=True) == "prefill"):
        hq, hsc = swiglu_quant(fp8_gemm(xq, xs, w.sh13, w.sh13_s)[None], w.limit)
        hq = hq.view(torch.float8_e4m3fn)
    else:
        hq, hsc = fp8_swiglu(u8(xq).view(torch.float8_e4m3fn), xs, w.sh13, w.sh13_s, w.limit)
    return fp8_gemm_tiles(hq, hsc, w.sh2, w.sh2_s) if portable else fp8_gemm(hq, hsc, w.sh2, w.sh2_s)


def _gemv_kernel(config, dev) -> tuple[str, int]:
    """The decode path's kernel (``config["kernel"]``, else the router's) and m-tile rows: the
    tensor-core kernel's 8, the CUDA-core GEMV's ``config["BM"]``, default 1 (on the H200 1-row tiles
    beat 2- and 4-row tiles at 1 and 1.5 rows per expert, V4-Flash and V4-Pro, batch 1 and 64: a padded
    row costs a full row's math, and a weight slab read twice mostly comes from L2)."""
    cfg = config or {}
    kernel = cfg.get("kernel") or router.decode_kernel(target(dev))
    return kernel, (fp4_mma.BM_ROWS if kernel == "mma" else cfg.get("BM", 1))


def _moe_gemv(x, w: MoEWeights, idx, rw, eflat, k, config, return_parts, xq=None, xs=None, partial=False,
              portable=False, sort=None, early=None):
    """Decode MoE: grouped w1|w3 (split-K fp32 partials), the SwiGLU + FP8 quantisation pass, grouped
    w2; the shared expert (``_shared_expert``); combine. On sm_89+ both expert GEMMs run on the
    tensor-core kernel of ``fp4_mma.py`` (8-row tiles: each expert's weights read once for up to 8
    rows); other GPUs and the interpreter on the CUDA-core GEMV of ``gemv.py``
    (``config={"kernel": "cuda-core"}`` forces it). ``xq``, ``xs``: x's ``act_quant_fp8`` (from the
    router's launch), else computed here; ``sort``: ``sort_pairs(eflat, E, _gemv_kernel(config)[1])`` (from the
    router's launch), else computed here; ``early``: (fork, shared-expert output) of a shared expert already
    forked (``SHARED_EARLY``), joined here."""
    T, d = x.shape
    E, I = w.n_experts, w.inter
    P = T * k
    dev = x.device
    kernel, bm = _gemv_kernel(config, dev)
    cfg = {key: v for key, v in (config or {}).items() if key not in ("kernel", "BM")}
    perm, offs, tcum, inv = sort if sort is not None else sort_pairs(eflat, E, bm)
    n_tiles = min(P, triton.cdiv(P, bm) + min(E, P))
    if xq is None:
        xq, xs = act_quant_fp8(x)
    xq = u8(xq)
    # the shared expert on the side stream (``dsv4.streams``), beside the routed GEMMs; xq / xs live
    # until the join
    if early is not None:
        fork, sh = early
    else:
        fork = Fork(dev, T) if w.sh13 is not None else None
        sh = None
        if fork is not None:
            with fork.side():
                sh = _shared_expert(xq, xs, w, portable)
    pw = rw.float().contiguous().reshape(-1)
    grouped = dict(perm=perm, offs=offs, tcum=tcum, top_k=k, n_groups=E, n_tiles=n_tiles, config=cfg or None)
    if kernel == "mma":
        part = fp4_mma.mma_gemv_launch(xq, xs, w.w13, u8(w.w13_s), P, 2 * I, d, fmt=w.fmt, ws2=w.w13_s2,
                                       partial=True, **grouped)
    else:
        part = gemv_launch(xq, xs, w.w13, w.w13_s, w.w13_s2, P, 2 * I, d, wfmt=w.fmt, partial=True, bm=bm,
                           **grouped)
    h, hs = swiglu_quant(part, w.limit, pw=pw, perm=perm)
    grouped.update(perm=None, top_k=1)
    # w2: split partials left unsummed (the combine sums them: one launch fewer)
    if kernel == "mma":
        out = fp4_mma.mma_gemv_launch(h, hs, w.w2, u8(w.w2_s), P, d, I, fmt=w.fmt, ws2=w.w2_s2, split_sum=False,
                                      **grouped)
    else:
        out = gemv_launch(h, hs, w.w2, w.w2_s, w.w2_s2, P, d, I, wfmt=w.fmt, bm=bm, split_sum=False, **grouped)
    if fork is not None:
        fork.join()
    y = _combine(out, inv, offs, sh, k, partial)
    if return_parts:      # out: w2's rows, or its split partials [S, pairs, d] where K was split
        return y, dict(idx=idx, weights=rw, perm=perm, offs=offs, tcum=tcum, inv=inv, out=out, shared=sh,
                       path="gemv", kernel=kernel)
    return y


__all__ = ["MoEWeights", "moe_forward", "route", "sort_pairs"]
