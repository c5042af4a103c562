"""mHC hyper-connection kernels (spec §7): ``hc_pre``, ``hc_post``, ``hc_head``, beside their torch twins.

Shapes: residual streams ``x`` ``[T, 4, d]`` bf16 (``hc = 4``); mixing weights ``fn`` ``[24, 4d]`` fp32
(``hc_head``: ``[4, 4d]``), ``base`` ``[24]`` (``[4]``), ``scale`` ``[3]`` (``[1]``) fp32.

* ``hc_pre(x, fn, base, scale)`` -> ``(layer_input bf16 [T, d], post fp32 [T, 4], comb fp32 [T, 4, 4])``:
  RMS over all 4d elements (no weight), the 24-wide mix ``(x @ fn.T) * rsqrt(mean(x^2) + eps)`` in
  fp32, ``pre = sigmoid(.) + eps``, ``post = 2 sigmoid(.)``, the 20-iteration Sinkhorn of the
  reference on the 4x4 ``comb`` (row softmax + eps, column norm, 19 row/column pairs) and the
  ``pre``-weighted stream sum, rounded once to bf16.
* ``hc_post(y, res, post, comb)`` -> bf16 ``[T, 4, d]``: ``out[k] = post[k] y + sum_j comb[j, k] res[j]``
  in fp32, one bf16 rounding.
* ``hc_head(x, fn, base, scale)`` -> bf16 ``[T, d]``: sigmoid weights (no Sinkhorn), weighted sum.

Paths of ``hc_pre`` / ``hc_head`` (``config["impl"]``; ``hc_pre`` default: ``"fused"`` up to
``FUSED_MAX_T`` tokens, ``"tiled"`` above; ``hc_head`` default: ``"v1"``, because its tiled path gave
outputs differing by one bf16 ulp between two identical calls on the H200 at 64 and 300 tokens, cause
not found; the hc_pre paths were bit-stable there, eager and in CUDA graphs):

* ``"fused"`` (decode sizes), one launch, ``_hc_fused``: grid (K splits, token blocks of ``block_t``
  = 1 token up to 3, else 2). Each program computes the partial mix of its K range with fp32 FMAs against ``fn``
  read as fp32 (exact products: the ``ieee`` accuracy in either mode; at decode sizes ``fn`` is the
  dominant read and fp32 is half the bytes of the bf16x3 split) and its partial sum of squares,
  stores them, and arrives on the token block's counter (``atomic_add``, acq_rel, gpu scope). The
  last program to arrive sums the partials in split order (deterministic whatever the arrival
  order), computes rsqrt, sigmoids and the Sinkhorn, does the weighted stream sum (``x`` re-read,
  from L2) and resets the counter to 0: the counters (``counters.arrival_counters``, one int32
  buffer per device, zeroed once, shared with ``fp8_mma``) need no memset launch. Calls on one
  device must therefore be stream-ordered (as everything in the engine is); inside a CUDA-graph
  capture with no buffer yet, a zeroed one is captured with the call.
* ``"tiled"`` (prefill sizes), three launches. ``_hc_mix_tile``: the ``[T, 4d] x [4d, NMIX]`` mix
  GEMM over 64 / 128-token blocks (``fn`` re-read from L2 once per token block, not per 16 tokens),
  split-K only as far as needed for ~2 programs per SM (8 splits at T = 4096, 4 at 8192), grid
  split-index fastest; default ``mode="bf16x3"``: three bf16 tensor-core dots (wgmma on sm_90)
  against ``fn`` split exactly into hi + mid + lo bf16 parts (``prepare_bf16x3``, cached per weight
  tensor), into three accumulators summed at the end: every product is exact, the tensor cores'
  fp32 accumulation truncates (post/comb within 1e-5 of the twin on the H200). ``mode="ieee"``:
  fp32 FMA ``tl.dot`` (the CPU interpreter always takes it; triton 3.6 compiles it to TF32 MMAs on
  sm_100, 3.9 to FMAs). Partials ``[S, NP, T]`` fp32 (mix columns, the sum of squares in column
  NP-1, tokens contiguous; no atomics). ``_hc_tokens``: per-token finish over blocks of tokens
  (a token per thread group: the 20-iteration Sinkhorn runs token-parallel, not once per token in
  a whole program): partials reduced in split order, pre -> ``[T, 4]``, post, comb.
  ``_hc_apply``: the streaming weighted sum, one program per (token, d block), tokens in reverse
  order (the mix pass read the last ones last: their x may still be in L2). Reads x twice (mix,
  then sum): its cap is ~55% of the one-read HBM floor.
* ``"v1"``: the previous pair, kept for comparison (experiments/exp_mhc.py): ``_hc_mix_partial``
  (split-K GEMM, grid (token blocks of 16 / 64, splits for ~8 programs per SM), three bf16x3 dots
  into one accumulator; at T = 4096 ``fn`` is re-read from L2 per 16-64 tokens as three bf16 tiles
  and the MMAs are 16x64x32) and ``_hc_finish`` (grid (T, d blocks): every program reduces its
  token's partials; the Sinkhorn of each token runs in a whole program).

The Sinkhorn (v2) keeps each of the 16 comb entries as its own per-token vector: the row / column
sums of the 20 iterations are plain adds, no cross-thread reductions on that serial chain, and each
normalisation is one reciprocal and four products (~1 ulp from the reference's divisions).
``_hc_post_kernel`` (``hc_post``): grid (T, d blocks), one pass: reads ``y`` and ``res``, writes ``out``.

Config keys (all optional): ``impl``, ``fused_max_t``; fused: ``block_t``, ``block_k``, ``splits``,
``num_warps``, ``block_d``; tiled: ``mode``, ``sep`` (bf16x3: three independent MMA chains, the
default, or False: one chain), ``block_t``, ``block_k``, ``splits``, ``num_warps``, ``num_stages``,
``tokens_block``, ``apply_block_d``, ``apply_warps``, ``reverse``; v1: ``mode``, ``block_t``,
``block_k``, ``splits``, ``num_warps``, ``num_stages``, ``block_d``.

Numerics vs the twins (reference ``HyperConnection``/``HyperHead``, official numerics): post and
comb agree to < 1e-5 relative (summation order of the 4d-term GEMM, tensor-core accumulation,
exp/rsqrt ulps); bf16 outputs within 1 bf16 ulp (rare flips) except where the weighted stream sum
cancels: there the difference stays below 1e-5 (bf16x3; ieee and the fused path: 2^-20) of the
summed magnitudes sum_j |x_j| (tests/test_kernels_hotpath.py holds both modes to that). All paths
are deterministic (fixed split partition and reduction order, no float atomics). Throughput on the
H200: BENCHMARKS.md (v1: the split-K mix GEMM latency-bound, 8-14% of the HBM floor at T = 4096;
v2: experiments/exp_mhc.py). bf16 roundings are done on the bits (RNE), so the CPU interpreter (whose
casts truncate) gives the GPU's values.
"""
from __future__ import annotations

import weakref

import torch

from .lib import PDL_LAUNCH, interpreting, prefetch_on, target, triton_available
from .counters import arrival_counters
from .norm import rms_norm

HC = 4
DEFAULT_MODE = "bf16x3"   # GPU default (the interpreter always runs the fp32 FMA path)

if triton_available():
    import triton
    import triton.language as tl

    from .counters import arrive
    from .lib import pdl_wait, prefetch_l2, rne_bf16
    from .norm import norm_store, norm_store_w

    @triton.jit
    def _mix_dot(xv, W, kx, km, K, n, nm, acc, acc2, acc3, NP: tl.constexpr, MODE: tl.constexpr,
                 SEP: tl.constexpr):
        """The mix GEMM's step for the loaded x tile xv [BT, BK] (columns kx of the flattened 4d).
        MODE 0: fp32 FMA dot into ``acc`` (IEEE, W = fn fp32 [NMIX, K]); MODE 1: bf16x3 against the
        prepared W = bf16 [K, 3*NP] (hi | mid | lo column groups, an exact split of fn), xv bf16: the
        three dots chained into ``acc``, or with SEP into acc / acc2 / acc3 (independent MMA chains)."""
        if MODE == 0:
            f = tl.load(W + n[:, None] * K + kx[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            acc += tl.dot(xv.to(tl.float32), tl.trans(f), input_precision="ieee")
        else:
            wp = W + kx.to(tl.int64)[:, None] * (3 * NP) + n[None, :]       # [BK, NP] K-major tiles
            acc = tl.dot(xv, tl.load(wp, mask=km[:, None], other=0.0), acc)                 # hi
            if SEP:
                acc2 = tl.dot(xv, tl.load(wp + NP, mask=km[:, None], other=0.0), acc2)      # mid
                acc3 = tl.dot(xv, tl.load(wp + 2 * NP, mask=km[:, None], other=0.0), acc3)  # lo
            else:
                acc = tl.dot(xv, tl.load(wp + NP, mask=km[:, None], other=0.0), acc)
                acc = tl.dot(xv, tl.load(wp + 2 * NP, mask=km[:, None], other=0.0), acc)
        return acc, acc2, acc3

    @triton.jit
    def _mix_step(xrow, W, k0, K, tm, n, nm, acc, acc2, acc3, sq, NP: tl.constexpr, BK: tl.constexpr,
                  MODE: tl.constexpr, SEP: tl.constexpr):
        """One BK-wide K step of the mix GEMM for a token block (rows xrow): the sum of squares ``sq``
        and ``_mix_dot``."""
        kx = k0 + tl.arange(0, BK)
        km = kx < K
        xm = tm[:, None] & km[None, :]
        xv = tl.load(xrow + kx[None, :], mask=xm, other=0.0)
        if MODE == 0:
            xf = xv.to(tl.float32)
        else:
            # The sum of squares reads the tile by a load of its own (L2 only). When one load fed both
            # the async wgmma (from shared memory) and this register math, triton 3.6's pipeliner gave
            # the tile one shared buffer fewer than its prefetch distance, and the copy for step k + 2
            # overwrote the tile that step k's MMAs were still reading: partials differed from run to
            # run (experiments/exp_mhc_determinism.py). A tile that only feeds the dot gets its full
            # ring and waits, as fn's does.
            xf = tl.load(xrow + kx[None, :], mask=xm, other=0.0, cache_modifier=".cg").to(tl.float32)
        sq += xf * xf
        acc, acc2, acc3 = _mix_dot(xv, W, kx, km, K, n, nm, acc, acc2, acc3, NP, MODE, SEP)
        return acc, acc2, acc3, sq

    @triton.jit
    def _hc_mix_partial(X, FN, PART, SQ, T, K, stride_xt, k_per_split,
                        NMIX: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                        MODE: tl.constexpr):
        """MODE 0: fp32 FMA dot (IEEE, FN = fp32 [NMIX, K]); MODE 1: three bf16 tensor-core dots into one
        fp32 accumulator against the prepared weight FN = bf16 [K, 3*NP] (hi | mid | lo column groups,
        an exact split of fn)."""
        pdl_wait()
        pid_t = tl.program_id(0)
        pid_s = tl.program_id(1)
        t = pid_t * BT + tl.arange(0, BT)
        tm = t < T
        n = tl.arange(0, NP)
        nm = n < NMIX
        acc = tl.zeros([BT, NP], tl.float32)
        sq = tl.zeros([BT, BK], tl.float32)
        k0 = pid_s * k_per_split
        xrow = X + t.to(tl.int64)[:, None] * stride_xt
        for kk in range(0, k_per_split, BK):
            acc, _, _, sq = _mix_step(xrow, FN, k0 + kk, K, tm, n, nm, acc, acc, acc, sq, NP, BK, MODE, False)
        base = PART + (pid_s * T + t.to(tl.int64))[:, None] * NP + n[None, :]
        tl.store(base, acc, mask=tm[:, None])
        tl.store(SQ + pid_s * T + t, tl.sum(sq, axis=1), mask=tm)

    @triton.jit
    def _hc_finish(X, PART, SQ, BASE, SCALE, Y, POST, COMB, T, D, S, stride_xt, stride_yt,
                   inv_k, rms_eps, hc_eps, iters,
                   NP: tl.constexpr, SP: tl.constexpr, BD: tl.constexpr, HEAD: tl.constexpr):
        pdl_wait()
        t = tl.program_id(0)
        db = tl.program_id(1)
        t64 = t.to(tl.int64)
        s = tl.arange(0, SP)
        sm = s < S
        j4 = tl.arange(0, 4)
        sq = tl.sum(tl.load(SQ + s * T + t, mask=sm, other=0.0), axis=0)
        r = tl.math.div_rn(1.0, tl.sqrt_rn(sq * inv_k + rms_eps))
        prow = PART + (s.to(tl.int64) * T + t64) * NP
        m_pre = tl.sum(tl.load(prow[:, None] + j4[None, :], mask=sm[:, None], other=0.0), axis=0) * r
        if HEAD:
            sc0 = tl.load(SCALE)
        else:
            sc0 = tl.load(SCALE + 0)
        pre = tl.sigmoid(m_pre * sc0 + tl.load(BASE + j4)) + hc_eps
        if not HEAD:
            if db == 0:
                m_post = tl.sum(tl.load(prow[:, None] + 4 + j4[None, :], mask=sm[:, None], other=0.0), axis=0) * r
                post = 2.0 * tl.sigmoid(m_post * tl.load(SCALE + 1) + tl.load(BASE + 4 + j4))
                tl.store(POST + t64 * 4 + j4, post)
                jk = j4[:, None] * 4 + j4[None, :]                       # [4, 4] row-major (j, k)
                cp = tl.load(prow[:, None, None] + 8 + jk[None, :, :], mask=sm[:, None, None], other=0.0)
                c = tl.sum(cp, axis=0) * r * tl.load(SCALE + 2) + tl.load(BASE + 8 + jk)
                # Sinkhorn: row softmax + eps, column normalise, then iters-1 (row, column) pairs
                c = tl.exp(c - tl.max(c, axis=1)[:, None])
                c = c / tl.sum(c, axis=1)[:, None] + hc_eps
                c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
                for _ in range(iters - 1):
                    c = c / (tl.sum(c, axis=1)[:, None] + hc_eps)
                    c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
                tl.store(COMB + t64 * 16 + jk, c)
        d = db * BD + tl.arange(0, BD)
        dm = d < D
        xv = tl.load(X + t64 * stride_xt + j4[:, None] * D + d[None, :], mask=dm[None, :], other=0.0)
        y = tl.sum(pre[:, None] * xv.to(tl.float32), axis=0)
        tl.store(Y + t64 * stride_yt + d, rne_bf16(y).to(tl.bfloat16), mask=dm)

    @triton.jit
    def _hc_post_kernel(Yin, RES, POST, COMB, OUT, D, stride_yt, stride_rt, stride_ot, BD: tl.constexpr):
        pdl_wait()
        t = tl.program_id(0)
        db = tl.program_id(1)
        t64 = t.to(tl.int64)
        k4 = tl.arange(0, 4)
        d = db * BD + tl.arange(0, BD)
        dm = d < D
        y = tl.load(Yin + t64 * stride_yt + d, mask=dm, other=0.0).to(tl.float32)
        post = tl.load(POST + t64 * 4 + k4)                                            # [4(k)]
        rrow = RES + t64 * stride_rt + d
        mixed = tl.zeros([4, BD], tl.float32)
        for j in tl.static_range(4):                                                   # sum over j in order
            res_j = tl.load(rrow + j * D, mask=dm, other=0.0).to(tl.float32)          # [BD]
            comb_j = tl.load(COMB + t64 * 16 + j * 4 + k4)                              # comb[j, :]
            mixed += comb_j[:, None] * res_j[None, :]
        out = post[:, None] * y[None, :] + mixed
        tl.store(OUT + t64 * stride_ot + k4[:, None] * D + d[None, :], rne_bf16(out).to(tl.bfloat16),
                 mask=dm[None, :])


    # ---------------------------------------------------------------- v2: per-token pieces
    # Partials: PART [S, NP, T] fp32, split s: mix columns 0..NMIX-1 (NMIX < NP) and the sum of squares
    # in column NP-1 (one workspace, one load for both), tokens contiguous (the finish kernel's
    # tokens then sit one per thread group: its Sinkhorn runs token-parallel).
    @triton.jit
    def _split_sum(PART, t, tm, S, T, NMIX: tl.constexpr, SP: tl.constexpr, NP: tl.constexpr):
        """[BT, NP]: sums over the S split partials (a fixed reduction tree: deterministic) of tokens t,
        from one load of the [SP, BT, NP] tile (no load waits behind another; the columns are then
        picked in registers by ``_col``)."""
        s = tl.arange(0, SP)
        c = tl.arange(0, NP)
        off = ((s.to(tl.int64) * NP)[:, None, None] + c[None, None, :]) * T + t.to(tl.int64)[None, :, None]
        msk = (s < S)[:, None, None] & tm[None, :, None] & ((c < NMIX) | (c == NP - 1))[None, None, :]
        return tl.sum(tl.load(PART + off, mask=msk, other=0.0, cache_modifier=".cg"), axis=0)

    @triton.jit
    def _col(m, j, NC: tl.constexpr):
        """Column j of m [BT, NC] -> [BT] (exact: the other terms are 0)."""
        return tl.sum(tl.where(tl.arange(0, NC)[None, :] == j, m, 0.0), axis=1)

    @triton.jit
    def _coefs(BASE, SCALE, NMIX: tl.constexpr, NP: tl.constexpr):
        """Per-column scale and base of the mix columns (pre 0..3 -> scale[0], post 4..7 -> scale[1],
        comb -> scale[2]; hc_head: scale[0]); 0 for the other columns."""
        c = tl.arange(0, NP)
        cm = c < NMIX
        if NMIX == 4:
            grp = c * 0
        else:
            grp = tl.where(c < 4, 0, tl.where(c < 8, 1, 2))
        return tl.load(SCALE + grp, mask=cm, other=0.0), tl.load(BASE + c, mask=cm, other=0.0)

    @triton.jit
    def _logits(m, sv, bv, inv_k, rms_eps, NP: tl.constexpr):
        """Split sums m [BT, NP] (sum of squares in column NP-1) -> ``(mix * rsqrt(mean(x^2) + eps)) *
        scale + base`` per column (the reference's order)."""
        sq = _col(m, NP - 1, NP)
        r = tl.math.div_rn(1.0, tl.sqrt_rn(sq * inv_k + rms_eps))
        return m * r[:, None] * sv[None, :] + bv[None, :]

    @triton.jit
    def _pre_weights(z, hc_eps, NC: tl.constexpr):
        """pre[j] = sigmoid(z[j]) + eps, j = 0..3, as four [BT] vectors."""
        p0 = tl.sigmoid(_col(z, 0, NC)) + hc_eps
        p1 = tl.sigmoid(_col(z, 1, NC)) + hc_eps
        p2 = tl.sigmoid(_col(z, 2, NC)) + hc_eps
        p3 = tl.sigmoid(_col(z, 3, NC)) + hc_eps
        return p0, p1, p2, p3

    @triton.jit
    def _softmax_row(a, b, c, d, eps):
        m = tl.maximum(tl.maximum(a, b), tl.maximum(c, d))
        a = tl.exp(a - m)
        b = tl.exp(b - m)
        c = tl.exp(c - m)
        d = tl.exp(d - m)
        inv = 1.0 / (a + b + c + d)
        return a * inv + eps, b * inv + eps, c * inv + eps, d * inv + eps

    @triton.jit
    def _norm4(a, b, c, d, eps, FAST: tl.constexpr = False):
        """(a, b, c, d) / (a + b + c + d + eps): one reciprocal, four products (the serial chain of the
        Sinkhorn: ~1 ulp from four divisions, a quarter of the latency). FAST (compiled GPU code only): the sum
        as a tree and the hardware's approximate reciprocal (``rcp.approx.ftz.f32``, at most 1 ulp off; the
        operands are >= eps, never subnormal): the chain's FSETP / range-scaling steps of the IEEE-range
        ``1.0 / x`` gone, one add shorter (SASS, Triton 3.6, sm_90)."""
        if FAST:
            inv = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [((a + b) + (c + d)) + eps],
                                            dtype=tl.float32, is_pure=True, pack=1)
        else:
            inv = 1.0 / (a + b + c + d + eps)
        return a * inv, b * inv, c * inv, d * inv

    @triton.jit
    def _post_comb(z, POST, COMB, t, tm, hc_eps, iters, NC: tl.constexpr, FAST: tl.constexpr = False):
        """post = 2 sigmoid(z[4..7]) and the Sinkhorn-normalised comb (4x4, logits z[8..23]) of tokens t,
        stored fp32. Each comb entry is its own [BT] vector: the row / column sums of the 20
        iterations are plain adds (no cross-thread reduction on that serial chain)."""
        t64 = t.to(tl.int64)
        for j in tl.static_range(4):
            tl.store(POST + t64 * 4 + j, 2.0 * tl.sigmoid(_col(z, 4 + j, NC)), mask=tm)
        c00 = _col(z, 8, NC)
        c01 = _col(z, 9, NC)
        c02 = _col(z, 10, NC)
        c03 = _col(z, 11, NC)
        c10 = _col(z, 12, NC)
        c11 = _col(z, 13, NC)
        c12 = _col(z, 14, NC)
        c13 = _col(z, 15, NC)
        c20 = _col(z, 16, NC)
        c21 = _col(z, 17, NC)
        c22 = _col(z, 18, NC)
        c23 = _col(z, 19, NC)
        c30 = _col(z, 20, NC)
        c31 = _col(z, 21, NC)
        c32 = _col(z, 22, NC)
        c33 = _col(z, 23, NC)
        # row softmax + eps, column normalise, then iters-1 (row, column) pairs
        c00, c01, c02, c03 = _softmax_row(c00, c01, c02, c03, hc_eps)
        c10, c11, c12, c13 = _softmax_row(c10, c11, c12, c13, hc_eps)
        c20, c21, c22, c23 = _softmax_row(c20, c21, c22, c23, hc_eps)
        c30, c31, c32, c33 = _softmax_row(c30, c31, c32, c33, hc_eps)
        c00, c10, c20, c30 = _norm4(c00, c10, c20, c30, hc_eps, FAST)
        c01, c11, c21, c31 = _norm4(c01, c11, c21, c31, hc_eps, FAST)
        c02, c12, c22, c32 = _norm4(c02, c12, c22, c32, hc_eps, FAST)
        c03, c13, c23, c33 = _norm4(c03, c13, c23, c33, hc_eps, FAST)
        for _ in range(iters - 1):
            c00, c01, c02, c03 = _norm4(c00, c01, c02, c03, hc_eps, FAST)
            c10, c11, c12, c13 = _norm4(c10, c11, c12, c13, hc_eps, FAST)
            c20, c21, c22, c23 = _norm4(c20, c21, c22, c23, hc_eps, FAST)
            c30, c31, c32, c33 = _norm4(c30, c31, c32, c33, hc_eps, FAST)
            c00, c10, c20, c30 = _norm4(c00, c10, c20, c30, hc_eps, FAST)
            c01, c11, c21, c31 = _norm4(c01, c11, c21, c31, hc_eps, FAST)
            c02, c12, c22, c32 = _norm4(c02, c12, c22, c32, hc_eps, FAST)
            c03, c13, c23, c33 = _norm4(c03, c13, c23, c33, hc_eps, FAST)
        cp = COMB + t64 * 16
        tl.store(cp + 0, c00, mask=tm)
        tl.store(cp + 1, c01, mask=tm)
        tl.store(cp + 2, c02, mask=tm)
        tl.store(cp + 3, c03, mask=tm)
        tl.store(cp + 4, c10, mask=tm)
        tl.store(cp + 5, c11, mask=tm)
        tl.store(cp + 6, c12, mask=tm)
        tl.store(cp + 7, c13, mask=tm)
        tl.store(cp + 8, c20, mask=tm)
        tl.store(cp + 9, c21, mask=tm)
        tl.store(cp + 10, c22, mask=tm)
        tl.store(cp + 11, c23, mask=tm)
        tl.store(cp + 12, c30, mask=tm)
        tl.store(cp + 13, c31, mask=tm)
        tl.store(cp + 14, c32, mask=tm)
        tl.store(cp + 15, c33, mask=tm)

    @triton.jit
    def _pick(v, i, BT: tl.constexpr):
        """Element i of the [BT] vector v as a scalar (exact)."""
        return tl.sum(tl.where(tl.arange(0, BT) == i, v, 0.0), axis=0)

    @triton.jit
    def _stream_sum(X, ti, d, dm, D, stride_xt, p0, p1, p2, p3, CM: tl.constexpr):
        """sum_j pre_j x[ti, j, d] in fp32 (scalar pre_j, j in order); CM: the loads' cache modifier
        (".cg": from L2, x written by other programs of this launch)."""
        x0, x1, x2, x3 = _stream_rows(X, ti, d, dm, D, stride_xt, CM)
        return _weigh4(x0, x1, x2, x3, p0, p1, p2, p3)

    @triton.jit
    def _stream_rows(X, ti, d, dm, D, stride_xt, CM: tl.constexpr):
        """The four streams' elements d of token ti, as loaded (bf16)."""
        xp = X + ti.to(tl.int64) * stride_xt + d
        return (tl.load(xp, mask=dm, other=0.0, cache_modifier=CM),
                tl.load(xp + D, mask=dm, other=0.0, cache_modifier=CM),
                tl.load(xp + 2 * D, mask=dm, other=0.0, cache_modifier=CM),
                tl.load(xp + 3 * D, mask=dm, other=0.0, cache_modifier=CM))

    @triton.jit
    def _weigh4(x0, x1, x2, x3, p0, p1, p2, p3):
        """sum_j p_j x_j in fp32, j in order (``_stream_sum``'s expression)."""
        y = p0 * x0.to(tl.float32)
        y += p1 * x1.to(tl.float32)
        y += p2 * x2.to(tl.float32)
        y += p3 * x3.to(tl.float32)
        return y

    @triton.jit
    def _weighted_row(X, Y, ti, D, stride_xt, stride_yt, p0, p1, p2, p3, d0, BD: tl.constexpr,
                      CM: tl.constexpr):
        """y[ti, d0:d0+BD] = sum_j pre_j x[ti, j, d] (scalar pre_j; fp32, j in order), one bf16 rounding.
        Scalar weights: a [BT]-vector weight would drag the row tile into its (replicated) layout."""
        d = d0 + tl.arange(0, BD)
        dm = d < D
        y = _stream_sum(X, ti, d, dm, D, stride_xt, p0, p1, p2, p3, CM)
        tl.store(Y + ti.to(tl.int64) * stride_yt + d, rne_bf16(y).to(tl.bfloat16), mask=dm)

    @triton.jit
    def _weighted_norm_row(X, Y, NW, ti, D, stride_xt, stride_yt, p0, p1, p2, p3, eps, BD: tl.constexpr,
                           INTERP: tl.constexpr):
        """Y[ti] = the weighted RMSNorm (``norm.norm_store``) of the bf16-rounded stream sum of token ti:
        the whole row in one tile (BD >= D); x read from L2 (the PRE_POST case wrote it)."""
        d = tl.arange(0, BD)
        dm = d < D
        y = rne_bf16(_stream_sum(X, ti, d, dm, D, stride_xt, p0, p1, p2, p3, ".cg"))
        norm_store(y, NW, Y + ti.to(tl.int64) * stride_yt, d, dm, D, eps, INTERP)

    @triton.jit
    def _post_tile(YP, RES, PPOST, PCOMB, X, t, tm, kx, km, D, stride_xt):
        """hc_post for the flattened elements kx (stream kx // D, column kx % D) of tokens t: out =
        post[j] y + sum_i comb[i, j] res[i] in fp32 (i in order; ``_hc_post_kernel``'s expression),
        stored bf16 into X; returns the stored values as fp32 [BT, BK]."""
        t64 = t.to(tl.int64)[:, None]
        msk = tm[:, None] & km[None, :]
        j = kx // D
        dd = (kx - j * D)[None, :]
        yv = tl.load(YP + t64 * D + dd, mask=msk, other=0.0).to(tl.float32)
        pj = tl.load(PPOST + t64 * 4 + j[None, :], mask=msk, other=0.0)
        rrow = RES + t64 * stride_xt + dd
        mixed = tl.zeros(yv.shape, tl.float32)
        for i in tl.static_range(4):
            res_i = tl.load(rrow + i * D, mask=msk, other=0.0).to(tl.float32)
            comb_ij = tl.load(PCOMB + t64 * 16 + i * 4 + j[None, :], mask=msk, other=0.0)
            mixed += comb_ij * res_i
        out = rne_bf16(pj * yv + mixed)
        tl.store(X + t64 * stride_xt + kx[None, :], out.to(tl.bfloat16), mask=msk)
        return out

    # ---------------------------------------------------------------- v2 decode: one launch
    @triton.jit
    def _hc_fused(X, FN, PART, CNT, BASE, SCALE, Y, POST, COMB, T, K, D, S, stride_xt, stride_yt,
                  k_per_split, inv_k, rms_eps, hc_eps, iters, YP, RES, PPOST, PCOMB, NW, norm_eps,
                  NMIX: tl.constexpr, NP: tl.constexpr, SP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                  BD: tl.constexpr, HEAD: tl.constexpr, PRE_POST: tl.constexpr = False, NORM: tl.constexpr = False,
                  INTERP: tl.constexpr = False, PF: tl.constexpr = False, PFL: tl.constexpr = 1,
                  LOADS_FIRST: tl.constexpr = False, FAST_RCP: tl.constexpr = False):
        """Decode-sized hc_pre / hc_head in one launch, grid (S, token blocks of BT). Each program: the
        partial mix of its K range in fp32 FMAs (exact products, fn read as fp32: ``ieee`` accuracy in
        either mode) and the partial sum of squares -> PART; then an acq_rel arrival on the token
        block's counter. The last of the S programs to arrive sums the partials in split order
        (deterministic whatever the arrival order), computes rsqrt, sigmoids, the Sinkhorn and the
        weighted stream sum (x re-read, from L2), and resets the counter to 0 for the next call.

        PRE_POST (``hc_post_pre``): x is first made by the previous site's hc_post from YP [T, D] bf16,
        RES [T, 4, D] bf16 (stride_xt, as X), PPOST [T, 4], PCOMB [T, 4, 4] fp32: each program computes
        the x elements of its own K range (``_hc_post_kernel``'s expression: the same bits), stores
        them into X (the new residual streams) and mixes them; the last arriver reads X back after its
        acquire (``.cg``: from L2). NORM: Y gets the weighted RMSNorm (weight NW fp32 [D], norm_eps) of
        the bf16-rounded stream sum instead of the sum itself (one row per program: BD >= D). PF: the
        program's first fn tile (NMIX rows x PFL 128-byte lines) hinted into L2 before the wait.
        LOADS_FIRST (BT 1, NORM, not HEAD): the last arriver issues its token's stream loads and the norm
        weight's before the Sinkhorn and consumes them after it, so their round trips run under the
        Sinkhorn's serial chain (the same expressions: the same bits)."""
        if PF:
            prefetch_l2(FN + tl.arange(0, NP)[:, None] * K + tl.program_id(0) * k_per_split
                        + tl.arange(0, PFL)[None, :] * 32,
                        (tl.arange(0, NP) < NMIX)[:, None]
                        & (tl.program_id(0) * k_per_split + tl.arange(0, PFL)[None, :] * 32 < K))
        pdl_wait()
        pid_s = tl.program_id(0)
        tb = tl.program_id(1)
        t = tb * BT + tl.arange(0, BT)
        tm = t < T
        n = tl.arange(0, NP)
        nm = n < NMIX
        kk = tl.arange(0, BK)
        # the sum of squares rides in the mix's spare last column (x times itself): mix and squares leave the
        # loop through one reduction whose layout, hence summation order, is the same with and without PRE_POST,
        # so hc_post_pre's post / comb are hc_pre's bits (a separate [BT, BK] reduction's layout may differ
        # between the two: Triton 3.6 on sm_90 does)
        sqn = n == NP - 1
        sqc = sqn[None, :, None]
        acc = tl.zeros([BT, NP, BK], tl.float32)
        k0 = pid_s * k_per_split
        xrow = X + t.to(tl.int64)[:, None] * stride_xt
        for k in range(k0, tl.minimum(k0 + k_per_split, K), BK):
            kx = k + kk
            km = kx < K
            if PRE_POST:
                xf = _post_tile(YP, RES, PPOST, PCOMB, X, t, tm, kx, km, D, stride_xt)
            else:
                xf = tl.load(xrow + kx[None, :], mask=tm[:, None] & km[None, :], other=0.0).to(tl.float32)
            f = tl.load(FN + n[:, None] * K + kx[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            acc += xf[:, None, :] * tl.where(sqc, xf[:, None, :], f[None, :, :])
        col = PART + pid_s * NP * T + t.to(tl.int64)
        tl.store(col[:, None] + (n * T)[None, :], tl.sum(acc, axis=2),
                 mask=tm[:, None] & (nm | sqn)[None, :])
        if arrive(CNT + tb) == S - 1:
            sv, bv = _coefs(BASE, SCALE, NMIX, NP)
            z = _logits(_split_sum(PART, t, tm, S, T, NMIX, SP, NP), sv, bv, inv_k, rms_eps, NP)
            p0, p1, p2, p3 = _pre_weights(z, hc_eps, NP)
            if LOADS_FIRST:
                tl.static_assert(BT == 1 and NORM and not HEAD)
                d = tl.arange(0, BD)
                dm = d < D
                x0, x1, x2, x3 = _stream_rows(X, tb, d, dm, D, stride_xt, ".cg")
                nw = tl.load(NW + d, mask=dm, other=0.0)
                _post_comb(z, POST, COMB, t, tm, hc_eps, iters, NP, FAST_RCP)
                y = _weigh4(x0, x1, x2, x3, _pick(p0, 0, BT), _pick(p1, 0, BT), _pick(p2, 0, BT), _pick(p3, 0, BT))
                norm_store_w(rne_bf16(y), nw, Y + tb.to(tl.int64) * stride_yt, d, dm, D, norm_eps, INTERP)
            else:
                if not HEAD:
                    _post_comb(z, POST, COMB, t, tm, hc_eps, iters, NP, FAST_RCP)
                for i in tl.static_range(BT):
                    ti = tb * BT + i
                    if ti < T:
                        q0 = _pick(p0, i, BT)
                        q1 = _pick(p1, i, BT)
                        q2 = _pick(p2, i, BT)
                        q3 = _pick(p3, i, BT)
                        if NORM:
                            _weighted_norm_row(X, Y, NW, ti, D, stride_xt, stride_yt, q0, q1, q2, q3, norm_eps, BD,
                                               INTERP)
                        else:
                            for d0 in range(0, D, BD):
                                _weighted_row(X, Y, ti, D, stride_xt, stride_yt, q0, q1, q2, q3, d0, BD,
                                              ".cg" if PRE_POST else "")
            tl.store(CNT + tb, 0)

    # ---------------------------------------------------------------- v2 large T: mix GEMM, finish, apply
    @triton.jit(do_not_specialize=['T'])
    def _hc_mix_tile(X, W, PART, T, K, stride_xt, k_per_split,
                     NMIX: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                     MODE: tl.constexpr, SEP: tl.constexpr):
        """Token-block tile of the mix GEMM, grid (S, token blocks): the split index runs fastest, so
        that the programs in flight share few token blocks and the token blocks finish in order.
        MODE 0: fp32 FMA dot (``ieee``, W = fn fp32 [NMIX, K]); MODE 1: bf16x3 (W = the prepared bf16
        [K, 3*NP]): three tensor-core dots into three accumulators (independent MMA chains), summed
        at the end."""
        pdl_wait()
        pid_s = tl.program_id(0)
        pid_t = tl.program_id(1)
        t = pid_t * BT + tl.arange(0, BT)
        tm = t < T
        n = tl.arange(0, NP)
        nm = n < NMIX
        acc = tl.zeros([BT, NP], tl.float32)
        acc2 = tl.zeros([BT, NP], tl.float32)
        acc3 = tl.zeros([BT, NP], tl.float32)
        sq = tl.zeros([BT, BK], tl.float32)
        k0 = pid_s * k_per_split
        xrow = X + t.to(tl.int64)[:, None] * stride_xt
        for kk in range(0, k_per_split, BK):
            acc, acc2, acc3, sq = _mix_step(xrow, W, k0 + kk, K, tm, n, nm, acc, acc2, acc3, sq, NP, BK, MODE, SEP)
        if MODE != 0 and SEP:
            acc = acc + (acc2 + acc3)
        col = PART + pid_s * NP * T + t.to(tl.int64)
        tl.store(col[:, None] + (n * T)[None, :], acc, mask=tm[:, None] & nm[None, :])
        tl.store(col + (NP - 1) * T, tl.sum(sq, axis=1), mask=tm)

    @triton.jit(do_not_specialize=['T', 'S', 'iters'])
    def _hc_tokens(PART, BASE, SCALE, PRE, POST, COMB, T, S, inv_k, rms_eps, hc_eps, iters,
                   NMIX: tl.constexpr, NP: tl.constexpr, SP: tl.constexpr, BT: tl.constexpr, HEAD: tl.constexpr,
                   FAST_RCP: tl.constexpr = False):
        """Per-token finish, grid (token blocks of BT): the split partials reduced (split order), rsqrt,
        pre -> PRE [T, 4] fp32; hc_pre: post and the Sinkhorn comb. Token-parallel (a token per
        thread group): the 20-iteration Sinkhorn costs its serial latency once per block, not once
        per token."""
        pdl_wait()
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        tm = t < T
        sv, bv = _coefs(BASE, SCALE, NMIX, NP)
        z = _logits(_split_sum(PART, t, tm, S, T, NMIX, SP, NP), sv, bv, inv_k, rms_eps, NP)
        p0, p1, p2, p3 = _pre_weights(z, hc_eps, NP)
        t64 = t.to(tl.int64)
        tl.store(PRE + t64 * 4, p0, mask=tm)
        tl.store(PRE + t64 * 4 + 1, p1, mask=tm)
        tl.store(PRE + t64 * 4 + 2, p2, mask=tm)
        tl.store(PRE + t64 * 4 + 3, p3, mask=tm)
        if not HEAD:
            _post_comb(z, POST, COMB, t, tm, hc_eps, iters, NP, FAST_RCP)

    @triton.jit
    def _hc_apply(X, PRE, Y, T, D, NDB, stride_xt, stride_yt, BD: tl.constexpr, REVERSE: tl.constexpr):
        """Streaming weighted stream sum, grid (tokens x NDB d blocks, d block fastest): y[t, d] =
        sum_j pre[t, j] x[t, j, d] (fp32, j in order, one bf16 rounding). REVERSE: last token first
        (the mix pass read those last: their x may still be in L2)."""
        pdl_wait()
        pid = tl.program_id(0)
        db = pid % NDB
        ti = pid // NDB
        if REVERSE:
            ti = T - 1 - ti
        _weighted_row(X, Y, ti, D, stride_xt, stride_yt, tl.load(PRE + ti * 4), tl.load(PRE + ti * 4 + 1),
                      tl.load(PRE + ti * 4 + 2), tl.load(PRE + ti * 4 + 3), db * BD, BD, "")


def _check_x(x, fn, nmix):
    if x.dim() != 3 or x.shape[1] != HC or x.dtype != torch.bfloat16:
        raise ValueError(f"x: expected bf16 [T, {HC}, d], got {x.dtype} {tuple(x.shape)}")
    if fn.shape != (nmix, HC * x.shape[2]) or fn.dtype != torch.float32:
        raise ValueError(f"fn: expected fp32 [{nmix}, {HC * x.shape[2]}], got {fn.dtype} {tuple(fn.shape)}")


_PREPARED: dict = {}


def prepare_bf16x3(fn: torch.Tensor, np_: int) -> torch.Tensor:
    """fn fp32 [N, K] -> bf16 [K, 3*np_]: columns [0, np_) = hi, [np_, 2np_) = mid, [2np_, 3np_) = lo with
    hi + mid + lo == fn (each the RNE bf16 of the remainder: exact to 2^-24 relative). Cached per live
    tensor object and version (a weak reference: a freed ``fn`` whose memory is reused by another
    tensor must not hit the cache)."""
    key = (id(fn), np_)
    hit = _PREPARED.get(key)
    w = hit[2] if hit is not None and hit[0]() is fn and hit[1] == fn._version else None
    if w is None:
        f = fn.float()
        hi = f.bfloat16()
        r = f - hi.float()
        mid = r.bfloat16()
        lo = (r - mid.float()).bfloat16()
        w = torch.zeros(f.shape[1], 3 * np_, dtype=torch.bfloat16, device=fn.device)
        for i, part in enumerate((hi, mid, lo)):
            w[:, i * np_:i * np_ + f.shape[0]] = part.T
        if len(_PREPARED) > 256:
            for k in [k for k, v in _PREPARED.items() if v[0]() is None]:
                del _PREPARED[k]
        _PREPARED[key] = (weakref.ref(fn), fn._version, w)
    return w


def _mix_launch(x, fn, nmix, np_, config):
    """Split-K partials of x.flatten(1) @ fn.T and of sum(x^2): (part [S, T, NP], sq [S, T], S).

    ``config``: block_t, block_k, splits, num_warps, num_stages, mode ("ieee": fp32 FMA dot, the
    reference's fp32 accuracy; "bf16x3": tensor cores on an exact 3-way bf16 split of fn, faster, but
    the tensor cores' fp32 accumulation truncates: ~1e-6 of the summed magnitudes)."""
    T, _, D = x.shape
    K = HC * D
    interp = interpreting()
    cfg = dict(config or {})
    mode = _mode(cfg)
    BK = cfg.get("block_k", 64)
    BT = cfg.get("block_t", 16 if T <= 256 else 64)
    n_tb = triton.cdiv(T, BT)
    n_chunks = triton.cdiv(K, BK)
    S = cfg.get("splits")
    if S is None:   # ~8 programs per SM, >= 2 K blocks each
        S = 2 if interp else max(1, min(max(1, n_chunks // 2), triton.cdiv(8 * target(x.device).sm_count, n_tb)))
    k_per_split = triton.cdiv(n_chunks, S) * BK
    S = triton.cdiv(K, k_per_split)
    part = torch.empty(S, T, np_, dtype=torch.float32, device=x.device)
    sq = torch.empty(S, T, dtype=torch.float32, device=x.device)
    w = fn if mode == 0 else prepare_bf16x3(fn, np_)
    # sm_90 / triton 3.6 (ptxas): BT 16 at 4 warps: 128 (ieee) / 168 (bf16x3) registers; BT 64 needs 8 warps
    kw = {} if interp else {"num_warps": cfg.get("num_warps", 4 if BT <= 16 else 8),
                            "num_stages": cfg.get("num_stages", 3)}
    _hc_mix_partial[(n_tb, S)](x, w, part, sq, T, K, x.stride(0), k_per_split,
                               NMIX=nmix, NP=np_, BT=BT, BK=BK, MODE=mode, **kw, **PDL_LAUNCH)
    return part, sq, S


FUSED_MAX_T = 3       # hc_pre / hc_post_pre: the one-launch fused path up to this many tokens, the tiled path above.
                      # The whole decode site (hc_post_pre: hc_post, hc_pre, rms_norm), H100, d 4096, us: T 2 / 3 / 4
                      # fused (blocks of 1 token) 12.4 / 12.7 / 16.6 against 14.0 / 15.5 / 15.3 for the tiled path's
                      # five launches (experiments/exp_hc_site.py --tokens); the decode step at batch 2 / 3 1.2% / 1.3%
                      # faster than with the fused path at 1 token only (docs/benchmarks-2026-12-07.md)
# the fused decode site (one token a block, NORM): the last arriver's stream loads issued before its Sinkhorn
# (``_hc_fused`` LOADS_FIRST; False: after it, the A/B of benchmarks/decode_step.py --hc-loads)
LOADS_FIRST = True
# the Sinkhorn's row / column normalisations on the approximate reciprocal and a summation tree (``_norm4`` FAST;
# compiled GPU code only, the interpreter keeps ``1.0 / x``); False: the IEEE-range division, the A/B of
# benchmarks/decode_step.py --sinkhorn-rcp. H100, 4-layer step, two alternations in one process: batch 1
# 1035.5 / 1031.9 us on against 1048.0 / 1040.5 off, batch 2 1214.1 / 1209.0 against 1225.8 / 1227.2 (~1%)
SINKHORN_RCP = True
_counters = arrival_counters   # one zeroed buffer per device, reset by each last arriver (counters.py)


def _impl(cfg: dict, T: int) -> str:
    impl = cfg.get("impl")
    if impl is None:
        impl = "fused" if T <= cfg.get("fused_max_t", FUSED_MAX_T) else "tiled"
    if impl not in ("v1", "fused", "tiled"):
        raise ValueError(f"mhc config impl: expected 'v1', 'fused' or 'tiled', got {impl!r}")
    return impl


def _splits(n_units: int, n_tb: int, min_units: int, device, cfg: dict, per_sm: int = 2) -> int:
    """Split count: about ``per_sm`` programs per SM in all (floor: no partial last wave), each split
    at least ``min_units`` K blocks."""
    S = cfg.get("splits")
    if S is None:
        S = max(1, min(max(1, n_units // min_units), (per_sm * target(device).sm_count) // n_tb))
    return max(1, min(S, n_units))


def _fused_launch(x, fn, nmix, head, base, scale, y, post, comb, iters, hc_eps, rms_eps, cfg, prev=None, norm=None):
    """One launch (decode sizes): ``_hc_fused``. config: block_t, block_k, splits, num_warps, block_d
    (the tail's row chunk). ``prev`` (y, res, post, comb): x is the output buffer of the previous
    site's hc_post, computed in the same launch (PRE_POST); ``norm`` (weight, eps): y gets the
    weighted RMSNorm of the stream sum (NORM)."""
    T, _, D = x.shape
    K = HC * D
    np_ = triton.next_power_of_2(nmix + 1)
    # tokens per block: the last arriver re-reads its tokens' x serially (~0.5 us a token from L2), every
    # block re-reads fn (from L2): one token up to 3 (blocks of 2 were 2-6 us slower there), 2 above
    BT = cfg.get("block_t") or (1 if T <= 3 else 2)
    # 8 warps where the norm's one-tile row is above 4096 wide (V4-Pro's 7168: 32 fp32 a thread)
    nw = cfg.get("num_warps", 4 if BT <= 2 and (norm is None or D <= 4096) else 8)
    # the [BT, NP, BK] fp32 FMA accumulator: <= 64 registers per thread
    BK = cfg.get("block_k") or max(16, min(128, 1 << ((2048 * nw) // (BT * np_)).bit_length() - 1))
    n_tb = triton.cdiv(T, BT)
    n_chunks = triton.cdiv(K, BK)
    # many short programs (this loop is not software-pipelined: 1-2 loads each), >= 128 K each, <= 128
    # splits (the tail's [splits, BT, NP] tile)
    S = min(_splits(n_chunks, n_tb, max(1, 128 // BK), x.device, cfg, per_sm=4), cfg.get("splits", 128))
    if interpreting() and "splits" not in cfg:
        S = min(S, 3)
    k_per_split = triton.cdiv(n_chunks, S) * BK
    S = triton.cdiv(K, k_per_split)
    part = torch.empty(S, np_, T, dtype=torch.float32, device=x.device)
    cnt = _counters(x.device, n_tb)
    # d 4096: a token row in one go; the norm needs the whole row in one tile
    BD = triton.next_power_of_2(D) if norm is not None else cfg.get("block_d") or min(triton.next_power_of_2(D), 4096)
    kw = {} if interpreting() else {"num_warps": nw}
    yp, res, ppost, pcomb = prev if prev is not None else (x, x, post, comb)
    nw_, neps = norm if norm is not None else (fn, 0.0)
    _hc_fused[(S, n_tb)](x, fn.contiguous(), part, cnt, base, scale, y, post, comb, T, K, D, S, x.stride(0),
                         y.stride(0), k_per_split, 1.0 / K, rms_eps, hc_eps, iters, yp, res, ppost, pcomb, nw_,
                         float(neps), NMIX=nmix, NP=np_, SP=max(2, triton.next_power_of_2(S)), BT=BT, BK=BK, BD=BD,
                         HEAD=head, PRE_POST=prev is not None, NORM=norm is not None, INTERP=interpreting(),
                         PF=prefetch_on(), PFL=max(1, BK // 32),
                         LOADS_FIRST=LOADS_FIRST and BT == 1 and norm is not None and not head,
                         FAST_RCP=SINKHORN_RCP and not interpreting() and not head, **kw, **PDL_LAUNCH)


def _mode(cfg: dict) -> int:
    """0: fp32 FMA dot (``ieee``; the interpreter always), 1: bf16x3 tensor-core dots."""
    return 0 if interpreting() or cfg.get("mode", DEFAULT_MODE) == "ieee" else 1


def _np(nmix: int) -> int:
    """Partial columns of the tiled paths: the mix columns, then the sum of squares in the last one."""
    return max(16, triton.next_power_of_2(nmix + 1))


def _tiled_mix(x, fn, nmix, np_, cfg):
    """``_hc_mix_tile``: the split partials [S, np_, T] of the mix and the sum of squares, and S."""
    T, _, D = x.shape
    K = HC * D
    interp = interpreting()
    mode = _mode(cfg)
    BT = cfg.get("block_t") or (16 if interp else 128 if T >= 1024 else 64)
    BK = cfg.get("block_k") or 64
    n_tb = triton.cdiv(T, BT)
    n_chunks = triton.cdiv(K, BK)
    # splits from the power-of-two bucket of the token blocks, rounded up to a power of two (at most
    # one per K block): the finish kernel's split tile (``_hc_tokens``' SP / BT) then takes one value
    # per bucket, which a power-of-two token count (+ 1) reaches (engine.warmup); rounded up, not
    # down: no split sums more K blocks than the per-SM rule gives
    S = _splits(n_chunks, triton.next_power_of_2(n_tb), 2, x.device, cfg)
    if "splits" not in cfg:
        S = min(S, 2) if interp else min(n_chunks, triton.next_power_of_2(S))
    k_per_split = triton.cdiv(n_chunks, S) * BK
    S = triton.cdiv(K, k_per_split)
    part = torch.empty(S, np_, T, dtype=torch.float32, device=x.device)
    w = fn.contiguous() if mode == 0 else prepare_bf16x3(fn, np_)
    kw = {} if interp else {"num_warps": cfg.get("num_warps", 4 if BT <= 64 else 8),
                            "num_stages": cfg.get("num_stages", 3)}
    _hc_mix_tile[(S, n_tb)](x, w, part, T, K, x.stride(0), k_per_split,
                            NMIX=nmix, NP=np_, BT=BT, BK=BK, MODE=mode, SEP=bool(cfg.get("sep", True)), **kw,
                            **PDL_LAUNCH)
    return part, S


def _tiled_launch(x, fn, nmix, head, base, scale, y, post, comb, iters, hc_eps, rms_eps, cfg, part=None):
    """Three launches (prefill sizes): the token-block mix GEMM ``_hc_mix_tile``, the per-token finish
    ``_hc_tokens``, the streaming ``_hc_apply``. ``part``: split partials [S, NP, T] computed elsewhere
    (``experiments/exp_hc_post_mix.py``): no mix GEMM. config: mode, block_t, block_k, splits,
    num_warps, num_stages (mix); tokens_block (finish); apply_block_d, apply_warps, reverse (apply)."""
    T, _, D = x.shape
    K = HC * D
    interp = interpreting()
    np_ = _np(nmix)
    if part is None:
        part, S = _tiled_mix(x, fn, nmix, np_, cfg)
    else:
        S = part.shape[0]
    pre = torch.empty(T, HC, dtype=torch.float32, device=x.device)
    SP = max(2, triton.next_power_of_2(S))
    BTF = cfg.get("tokens_block") or max(1, min(64, 4096 // (SP * np_)))   # [SP, BTF, NP] tile <= 32 regs
    kw = {} if interp else {"num_warps": 4}
    _hc_tokens[(triton.cdiv(T, BTF),)](part, base, scale, pre, post, comb, T, S, 1.0 / K, rms_eps, hc_eps, iters,
                                       NMIX=nmix, NP=np_, SP=SP, BT=BTF, HEAD=head,
                                       FAST_RCP=SINKHORN_RCP and not interp and not head, **kw, **PDL_LAUNCH)
    pow2_div = D & -D                     # d 7168: 1024 (no ragged last block), d 4096: 2048
    BD = cfg.get("apply_block_d") or min(2048, pow2_div if pow2_div >= 512 else triton.next_power_of_2(D))
    kw = {} if interp else {"num_warps": cfg.get("apply_warps", 4)}
    ndb = triton.cdiv(D, BD)
    _hc_apply[(T * ndb,)](x, pre, y, T, D, ndb, x.stride(0), y.stride(0), BD=BD,
                          REVERSE=bool(cfg.get("reverse", True)), **kw, **PDL_LAUNCH)


def hc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int = 20,
           hc_eps: float = 1e-6, rms_eps: float = 1e-6, config: dict | None = None):
    """Triton hc_pre: x bf16 [T, 4, d] -> (layer_input bf16 [T, d], post fp32 [T, 4], comb fp32 [T, 4, 4]).

    ``config``: ``impl`` ("fused": one launch; "tiled": mix GEMM, per-token finish, streaming apply;
    "v1": the previous split-K + finish pair; default: fused up to ``fused_max_t`` tokens, tiled
    above) and that path's keys (module docstring)."""
    _check_x(x, fn, 6 * HC)
    x = x.contiguous()
    T, _, D = x.shape
    y = torch.empty(T, D, dtype=torch.bfloat16, device=x.device)
    post = torch.empty(T, HC, dtype=torch.float32, device=x.device)
    comb = torch.empty(T, HC, HC, dtype=torch.float32, device=x.device)
    if T == 0:
        return y, post, comb
    cfg = dict(config or {})
    impl = _impl(cfg, T)
    base = base.float().contiguous()
    scale = scale.float().contiguous()
    if impl != "v1":
        launch = _fused_launch if impl == "fused" else _tiled_launch
        launch(x, fn, 6 * HC, False, base, scale, y, post, comb, iters, hc_eps, rms_eps, cfg)
        return y, post, comb
    part, sq, S = _mix_launch(x, fn, 6 * HC, 32, cfg)
    BD = cfg.get("block_d", 512)
    kw = {} if interpreting() else {"num_warps": 4}
    _hc_finish[(T, triton.cdiv(D, BD))](x, part, sq, base, scale,
                                        y, post, comb, T, D, S, x.stride(0), y.stride(0),
                                        1.0 / (HC * D), rms_eps, hc_eps, iters,
                                        NP=32, SP=triton.next_power_of_2(S), BD=BD, HEAD=False, **kw, **PDL_LAUNCH)
    return y, post, comb


def hc_post_pre(y: torch.Tensor | None, res: torch.Tensor, post: torch.Tensor | None, comb: torch.Tensor | None,
                fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_w: torch.Tensor, iters: int = 20,
                hc_eps: float = 1e-6, rms_eps: float = 1e-6, norm_eps: float = 1e-6, config: dict | None = None):
    """One mHC boundary: the previous site's ``hc_post`` (skipped when ``y`` is None: ``res`` is then the
    streams as they are), this site's ``hc_pre`` and the weighted RMSNorm of its output ->
    ``(h bf16 [T, 4, d] (the new residual streams; ``res`` itself when y is None), normed layer
    input bf16 [T, d], post fp32 [T, 4], comb fp32 [T, 4, 4])``, as ``rms_norm(hc_pre(hc_post(...)))``
    computes them. Up to ``fused_max_t`` tokens (the ``"fused"`` path) one launch of ``_hc_fused``
    (PRE_POST, NORM): two to three launches fewer per site at decode; above it the three kernels. The
    streams are hc_post's bits; post and comb hc_pre's where both run the same warps (d <= 4096; above,
    the one launch takes 8 warps for its norm tile and the mix partials sum in another order: ~1e-7).
    ``config``: as for ``hc_pre``."""
    _check_x(res, fn, 6 * HC)
    T, _, D = res.shape
    if norm_w.numel() != D:
        raise ValueError(f"hc_post_pre: norm weight has {norm_w.numel()} elements, the streams' width is {D}")
    cfg = dict(config or {})
    if T == 0 or _impl(cfg, T) != "fused":
        h = res if y is None else hc_post(y, res, post, comb)
        a, p2, c2 = hc_pre(h, fn, base, scale, iters, hc_eps, rms_eps, config)
        return h, rms_norm(a, norm_w, norm_eps), p2, c2
    res = res.contiguous()
    prev = None
    if y is not None:
        if y.shape != (T, D) or post.shape != (T, HC) or comb.shape != (T, HC, HC):
            raise ValueError(f"hc_post_pre: shapes y {tuple(y.shape)}, res {tuple(res.shape)}, post "
                             f"{tuple(post.shape)}, comb {tuple(comb.shape)}")
        prev = (y.contiguous(), res, post.float().contiguous(), comb.float().contiguous())
    h = res if y is None else torch.empty_like(res)
    a = torch.empty(T, D, dtype=torch.bfloat16, device=res.device)
    post2 = torch.empty(T, HC, dtype=torch.float32, device=res.device)
    comb2 = torch.empty(T, HC, HC, dtype=torch.float32, device=res.device)
    _fused_launch(h, fn, 6 * HC, False, base.float().contiguous(), scale.float().contiguous(), a, post2, comb2,
                  iters, hc_eps, rms_eps, cfg, prev=prev, norm=(norm_w.float().contiguous(), norm_eps))
    return h, a, post2, comb2


def hc_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            hc_eps: float = 1e-6, rms_eps: float = 1e-6, config: dict | None = None) -> torch.Tensor:
    """Triton hc_head: x bf16 [T, 4, d] -> bf16 [T, d] (sigmoid stream weights, no Sinkhorn); ``config``
    as for ``hc_pre``."""
    _check_x(x, fn, HC)
    x = x.contiguous()
    T, _, D = x.shape
    y = torch.empty(T, D, dtype=torch.bfloat16, device=x.device)
    if T == 0:
        return y
    cfg = dict(config or {})
    impl = _impl(dict(cfg, impl=cfg.get("impl", "v1")), T)      # v1 by default (module doc)
    base = base.float().contiguous()
    scale = scale.float().reshape(-1).contiguous()
    if impl != "v1":
        launch = _fused_launch if impl == "fused" else _tiled_launch
        launch(x, fn, HC, True, base, scale, y, y, y, 1, hc_eps, rms_eps, cfg)
        return y
    part, sq, S = _mix_launch(x, fn, HC, 16, cfg)
    BD = cfg.get("block_d", 512)
    kw = {} if interpreting() else {"num_warps": 4}
    _hc_finish[(T, triton.cdiv(D, BD))](x, part, sq, base, scale,
                                        y, y, y, T, D, S, x.stride(0), y.stride(0),
                                        1.0 / (HC * D), rms_eps, hc_eps, 1,
                                        NP=16, SP=triton.next_power_of_2(S), BD=BD, HEAD=True, **kw, **PDL_LAUNCH)
    return y


def hc_post(y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
            out: torch.Tensor | None = None, block_d: int = 1024, num_warps: int = 4) -> torch.Tensor:
    """Triton hc_post: out[t, k] = post[t, k] * y[t] + sum_j comb[t, j, k] * res[t, j] -> bf16 [T, 4, d]."""
    T, _, D = res.shape
    if y.shape != (T, D) or res.shape[1] != HC or post.shape != (T, HC) or comb.shape != (T, HC, HC):
        raise ValueError(f"hc_post: shapes y {tuple(y.shape)}, res {tuple(res.shape)}, post {tuple(post.shape)}, "
                         f"comb {tuple(comb.shape)}")
    res = res.contiguous()
    y = y.contiguous()
    post = post.float().contiguous()
    comb = comb.float().contiguous()
    out = torch.empty(T, HC, D, dtype=torch.bfloat16, device=res.device) if out is None else out
    if T == 0:
        return out
    kw = {} if interpreting() else {"num_warps": num_warps}
    _hc_post_kernel[(T, triton.cdiv(D, block_d))](y, res, post, comb, out, D, y.stride(0), res.stride(0),
                                                  out.stride(0), BD=block_d, **kw, **PDL_LAUNCH)
    return out


__all__ = ["hc_head", "hc_post", "hc_post_pre", "hc_pre"]
