"""Lightning-indexer kernels (spec §6), beside their torch twins: q prologue, scores, top-k.

* ``index_q_prologue(q, cos, sin)``: q ``[T, H, 128]`` bf16 (the ``wq_b`` output) -> RoPE on dims
  64..127 (interleaved pairs, the caller's fp32 cos/sin ``[T, 32]`` at the token positions), bf16;
  Hadamard ``(x @ H) * 128^-0.5`` (natural-order Sylvester matrix, fp32 sums), bf16; FP4 e2m1 QDQ
  with UE8M0 scales per 32 values, bf16. Twin: ``Indexer.queries`` without the wq_b GEMM and
  weights_proj. One program per (token, 16 heads below 128 tokens, 64 from 128 up); the Hadamard is a
  ``tl.dot`` with the +-1 matrix read from a cached bf16 tensor (or built from index bits in the
  kernel; bf16 operands are exact: products exact, fp32 accumulation).
* ``index_scores(q, w, pages, block_table, pos)``: ``I[b, t] = sum_h relu(q[b,h] . K[t]) * w[b,h]``
  over the sequence's keys read from the MXFP4 paged key cache (page = ``[64 x 64 B codes][64 x 4 B
  e8m0 scales]``, entry t in block ``block_table[b, t // 64]`` at offset ``t % 64``), with the
  reference's bf16 rounding points (dot -> bf16, relu * w -> bf16, fp32 head sum -> bf16) and the
  causal rule ``t < (pos + 1) // 4`` (-inf otherwise, also for blocks that are -1). Output
  ``[B, n]`` bf16 (default ``n = 64 * block_table.shape[1]``). One program per (row, group of
  64-entry pages): the page is dequantised in registers (exact: e2m1 x 2^k in bf16) and scored with
  one ``[H, 128] x [128, 64]`` ``tl.dot`` (``direct=True``: gathers straight in the [64, 128] tile
  layout instead of unpacking [64, 64] bytes; measured 2x slower on the H200, kept as an option).
* ``index_topk(scores, k, n_valid)``: indices ``[B, k]`` (int32) of the k largest scores of each
  row among entries ``t < n_valid[b]``, in descending score order, ties broken by the lower index
  (what the reference's stable descending sort gives), -1 past ``min(k, n_valid)``. bf16 scores
  (the indexer's), any N (256K candidates for a 1M context), k <= 2048. Radix select on the 16-bit
  order-preserving key, each row split into chunks so that batch 1 fills the GPU, three launches
  (one zeroed workspace): 1. per-chunk histograms of the key's high byte, added into the row's with
  integer atomics; 2. per-chunk histograms of the low byte of the entries in the threshold byte's
  bin; 3. each chunk writes its picks ``(0xFFFF - key) << 32 | index`` at precomputed slots of a
  ``[B, k]`` buffer (all entries above the threshold key, the lowest-index ties up to k). The per-row
  steps between the passes (threshold byte; exact threshold key, picks above it, ties to take and
  each chunk's slot offsets; the final sort of the k distinct picks with ``tl.sort``) run in the
  row's last-arriving chunk program (an acq_rel arrival counter), not in extra launches. Integer
  sums and fixed slots: the output is deterministic whatever order the programs run in.
  Rows up to ``SINGLE_MAX`` entries take one program each instead (keys in registers, one launch).
  -0.0 counts as +0.0 (torch's sort treats them equal); NaN scores are not supported. H200
  (docs/benchmarks-2026-11-30.md, session 5): 29.8 / 30.2 / 30.5 us for k = 512 / 1024 / 2048 over 256K at batch 1,
  10.7 us for a 2048-entry row (one-program path).

Numerics vs the twins: the prologue's and the scores' fp32 sums run in another order than the
reference's einsum/matmul: a bf16 rounding point can move by one ulp where the fp32 value lands
next to a tie (rare). The top-k is exact (a deterministic function of the bf16 scores).
"""
from __future__ import annotations

import torch

from ..formats.paging import INDEX_PAGE      # keys per page
from .lib import PDL_LAUNCH, interpreting, target, triton_available
from .counters import arrival_counters

HEAD_DIM = 128
INDEX_ENTRY_BYTES = 68          # 64 B codes + 4 B scales (formats.index_key.index_entry_bytes(128))
MAX_K = 2048
SINGLE_MAX = 4096          # rows up to this long: one program each, one launch
SORT_IN_KERNEL_MAX = 512  # the chunked path sorts up to this many picks in its last pass
# the one-program rows sort the whole row and take its first k (``_topk_single`` FULL) instead of selecting by two
# histograms and sorting the picks (the same output; sm_90 PTX at 2048 entries, 8 warps: the two ballot histograms
# and prefix sums are ~2,300 of the selection form's ~2,900 instructions, its pick sort ~600); the A/B of
# benchmarks/decode_step.py --topk-single
SINGLE_FULL_SORT = False
_TOPK_WS = 8 + 256   # per row: 3 arrival counters, hb, above1, thr, n_gt, need_eq | H1[256]

if triton_available():
    import triton
    import triton.language as tl

    from .lib import e2m1_value, fp4_qdq_blocks, pdl_wait
    from .counters import arrive
    from .lib import rne_bf16

    WS_P2 = tl.constexpr(512)     # _TOPK_WS rounded up to a power of two (the workspace reset's arange)

    # -------------------------------------------------------------------------- q prologue
    @triton.jit
    def _index_q_kernel(Q, COS, SIN, OUT, HMAT, H, stride_qt, stride_qh, stride_ot, stride_oh,
                        HB: tl.constexpr, INTERP: tl.constexpr, LOAD_H: tl.constexpr):
        """Program (t, hb): heads hb*HB .. of token t. LOAD_H: the +-1 Hadamard operand is read from HMAT
        (bf16 [128, 128]; fp32 under the interpreter, L2-resident) instead of built from index bits
        (~650 fewer instructions a program at HB = 64)."""
        pdl_wait()
        hb = tl.program_id(1)
        h = hb * HB + tl.arange(0, HB)
        hm = h < H
        d = tl.arange(0, 128)
        # Hadamard operand: H[i, j] = (-1)^popcount(i & j)
        if LOAD_H:
            hmat = tl.load(HMAT + tl.arange(0, 128)[:, None] * 128 + d[None, :])
        else:
            v = tl.arange(0, 128)[:, None] & tl.arange(0, 128)[None, :]
            v ^= v >> 4
            v ^= v >> 2
            v ^= v >> 1
            hmat = (1 - 2 * (v & 1)).to(tl.float32)
            if not INTERP:
                hmat = hmat.to(tl.bfloat16)
        t64 = tl.program_id(0).to(tl.int64)
        x = tl.load(Q + t64 * stride_qt + h[:, None] * stride_qh + d[None, :], mask=hm[:, None],
                    other=0.0).to(tl.float32)
        # RoPE on dims 64..127 (pairs 32..63)
        x0, x1 = tl.split(tl.reshape(x, [HB, 64, 2]))
        j = tl.arange(0, 64)
        is_rope = j >= 32
        c = tl.load(COS + t64 * 32 + (j - 32), mask=is_rope, other=1.0)
        s = tl.load(SIN + t64 * 32 + (j - 32), mask=is_rope, other=0.0)
        y0 = x0 * c[None, :] - x1 * s[None, :]
        y1 = x0 * s[None, :] + x1 * c[None, :]
        y0 = tl.where(is_rope[None, :], y0, x0)
        y1 = tl.where(is_rope[None, :], y1, x1)
        x = rne_bf16(tl.reshape(tl.join(y0, y1), [HB, 128]))
        if INTERP:
            y = tl.dot(x, hmat.to(tl.float32), input_precision="ieee")
        else:
            y = tl.dot(x.to(tl.bfloat16), hmat)
        y = rne_bf16(y * 0.08838834764831845)
        q, _code, _e = fp4_qdq_blocks(tl.reshape(y, [HB * 4, 32]))
        tl.store(OUT + t64 * stride_ot + h[:, None] * stride_oh + d[None, :],
                 tl.reshape(q, [HB, 128]).to(tl.bfloat16), mask=hm[:, None])

    # -------------------------------------------------------------------------- scores
    @triton.jit
    def _page_keys(page):
        """fp32 [64, 128] keys of one MXFP4 index page (``[64 x 64 B codes][64 x 4 B e8m0 scales]``): e2m1 x 2^k,
        exact in bf16."""
        e = tl.arange(0, 64)
        codes = tl.load(page + e[:, None] * 64 + e[None, :]).to(tl.int32)                   # [64, 64]
        sc = tl.load(page + 64 * 64 + e[:, None] * 4 + tl.arange(0, 4)[None, :]).to(tl.int32)  # [64, 4]
        cd = tl.reshape(tl.join(codes & 15, codes >> 4), [64, 128])
        val = e2m1_value(cd & 7)
        val = tl.where((cd & 8) != 0, -val, val)
        scale = (sc << 23).to(tl.float32, bitcast=True)                                       # 2^(byte-127)
        return tl.reshape(tl.reshape(val, [64, 4, 32]) * scale[:, :, None], [64, 128])

    @triton.jit
    def _head_scores(q, kv, w, INTERP: tl.constexpr):
        """bf16(relu(bf16(q . kv)) * w) per query row (rows x 64 keys, fp32 values): the reference's rounding
        points before the head sum."""
        if INTERP:
            s = tl.dot(q, tl.trans(kv), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(kv.to(tl.bfloat16)))
        s = tl.maximum(rne_bf16(s), 0.0)
        return rne_bf16(s * w[:, None])

    @triton.jit(do_not_specialize=['POS', 'N', 'n_bt'])
    def _index_scores_kernel(Q, W, PAGES, BT, POS, OUT, H, N, n_bt, stride_qb, stride_qh, stride_wb,
                             stride_btb, stride_ob, page_nbytes, w_scale,
                             TPP: tl.constexpr, HP: tl.constexpr, INTERP: tl.constexpr, W_SCALE: tl.constexpr,
                             DIRECT: tl.constexpr = False):
        """W_SCALE: W is the fp32 weights_proj output; the head weights are bf16(bf16(W) * w_scale)."""
        pdl_wait()
        b = tl.program_id(0)
        g = tl.program_id(1)
        b64 = b.to(tl.int64)
        hh = tl.arange(0, HP)
        hm = hh < H
        d = tl.arange(0, 128)
        q = tl.load(Q + b64 * stride_qb + hh[:, None] * stride_qh + d[None, :], mask=hm[:, None], other=0.0)
        if INTERP:
            q = q.to(tl.float32)
        w = tl.load(W + b64 * stride_wb + hh, mask=hm, other=0.0).to(tl.float32)
        if W_SCALE:
            w = rne_bf16(rne_bf16(w) * w_scale)
        vis = (tl.load(POS + b) + 1) // 4
        e = tl.arange(0, 64)
        col = tl.arange(0, 128)
        for i in range(TPP):
            tile = g * TPP + i
            t = tile * 64 + e
            out_ptr = OUT + b64 * stride_ob + t
            has = (tile * 64 < vis) & (tile < n_bt)
            blk = tl.load(BT + b64 * stride_btb + tile, mask=has, other=-1)
            if blk >= 0:
                page = PAGES + blk.to(tl.int64) * page_nbytes
                if DIRECT:   # [64, 128] gathers straight in the tile layout (each byte loaded twice, L1)
                    byte = tl.load(page + e[:, None] * 64 + (col // 2)[None, :]).to(tl.int32)
                    cdd = (byte >> ((col % 2) * 4)[None, :]) & 15
                    scd = tl.load(page + 64 * 64 + e[:, None] * 4 + (col // 32)[None, :]).to(tl.int32)
                    vald = e2m1_value(cdd & 7)
                    vald = tl.where((cdd & 8) != 0, -vald, vald)
                    kv = vald * (scd << 23).to(tl.float32, bitcast=True)                     # 2^(byte-127)
                else:
                    kv = _page_keys(page)
                s = _head_scores(q, kv, w, INTERP)                                           # [HP, 64]
                tot = rne_bf16(tl.sum(s, axis=0))
                tot = tl.where(t < vis, tot, float("-inf"))
                tl.store(out_ptr, tot.to(OUT.dtype.element_ty), mask=t < N)
            else:
                tl.store(out_ptr, tl.full([64], float("-inf"), tl.float32).to(OUT.dtype.element_ty), mask=t < N)

    @triton.jit(do_not_specialize=['N', 'n_bt', 'B'])
    def _index_scores_rows_kernel(Q, W, PAGES, BT, POS, OUT, B, H, N, n_bt, stride_qb, stride_qh, stride_wb,
                                  stride_ob, page_nbytes, w_scale, QB: tl.constexpr, TPP: tl.constexpr,
                                  HP: tl.constexpr, INTERP: tl.constexpr, W_SCALE: tl.constexpr):
        """``_index_scores_kernel`` for QB rows of one sequence per program (one block table ``BT`` [n_bt] for
        all rows, each row its own position): each page is dequantised once for the QB rows and scored with
        one ``[QB HP, 128] x [128, 64]`` dot. The same rounding points; the fp32 head sum runs over a
        [QB, HP, 64] tile."""
        pdl_wait()
        b0 = tl.program_id(0) * QB
        g = tl.program_id(1)
        rq = b0 + tl.arange(0, QB)
        rmask = rq < B
        r64 = rq.to(tl.int64)
        hh = tl.arange(0, HP)
        hm = hh < H
        d = tl.arange(0, 128)
        qm = rmask[:, None, None] & hm[None, :, None]
        q = tl.load(Q + r64[:, None, None] * stride_qb + hh[None, :, None] * stride_qh + d[None, None, :], mask=qm,
                    other=0.0)
        q = tl.reshape(q, [QB * HP, 128])
        if INTERP:
            q = q.to(tl.float32)
        w = tl.load(W + r64[:, None] * stride_wb + hh[None, :], mask=rmask[:, None] & hm[None, :], other=0.0)
        w = tl.reshape(w.to(tl.float32), [QB * HP])
        if W_SCALE:
            w = rne_bf16(rne_bf16(w) * w_scale)
        vis = (tl.load(POS + rq, mask=rmask, other=-1) + 1) // 4                       # [QB]
        vis_max = tl.max(vis, axis=0)
        e = tl.arange(0, 64)
        out_rows = OUT + r64[:, None] * stride_ob
        for i in range(TPP):
            tile = g * TPP + i
            t = tile * 64 + e
            smask = rmask[:, None] & (t < N)[None, :]
            has = (tile * 64 < vis_max) & (tile < n_bt)
            blk = tl.load(BT + tile, mask=has, other=-1)
            if blk >= 0:
                s = _head_scores(q, _page_keys(PAGES + blk.to(tl.int64) * page_nbytes), w, INTERP)  # [QB HP, 64]
                tot = rne_bf16(tl.sum(tl.reshape(s, [QB, HP, 64]), axis=1))               # [QB, 64]
                tot = tl.where(t[None, :] < vis[:, None], tot, float("-inf"))
                tl.store(out_rows + t[None, :], tot.to(OUT.dtype.element_ty), mask=smask)
            else:
                tl.store(out_rows + t[None, :], tl.full([QB, 64], float("-inf"), tl.float32).to(OUT.dtype.element_ty),
                         mask=smask)

    # -------------------------------------------------------------------------- top-k
    @triton.jit
    def _key16(raw):
        """bf16 bits (int32 of an int16 load) -> order-preserving 16-bit key (larger = larger)."""
        u = raw & 0xFFFF
        u = tl.where(u == 0x8000, 0, u)                      # -0.0 ranks as +0.0
        return tl.where((u & 0x8000) != 0, (~u) & 0xFFFF, u | 0x8000)

    @triton.jit
    def _threshold(tot, need):
        """Largest bin b with #(entries in bins >= b) >= need, and #(entries in bins > b)."""
        bins = tl.arange(0, 256)
        cge = tl.cumsum(tot, 0, reverse=True)
        thr = tl.max(tl.where(cge >= need, bins, -1), axis=0)
        above = tl.sum(tl.where(bins > thr, tot, 0), axis=0)
        return thr, above

    @triton.jit
    def _topk_keys(SC, b, nv, stride_sb, t0, TILE: tl.constexpr):
        i = t0 + tl.arange(0, TILE)
        m = i < nv
        return i, m, _key16(tl.load(SC + b.to(tl.int64) * stride_sb + i, mask=m, other=0).to(tl.int32))

    @triton.jit
    def _row_len(NV, b, N, HAS_NV: tl.constexpr):
        """Entries of row b that take part: min(n_valid[b], N), or N without n_valid."""
        if HAS_NV:
            return tl.minimum(tl.load(NV + b), N)
        return N

    @triton.jit(do_not_specialize=['N', 'K', 'CH', 'NC'])
    def _topk_pass1(SC, NV, WS, N, K, stride_sb, CH, NC, WSTRIDE: tl.constexpr, TILE: tl.constexpr,
                    HAS_NV: tl.constexpr):
        """High-byte histogram of the chunk, added into the row's; the row's last chunk program
        derives the threshold byte hb and #entries in higher bins -> WS[b, 3:5] (hb = -1: k == 0)."""
        pdl_wait()
        b = tl.program_id(0)
        c = tl.program_id(1)
        nv = _row_len(NV, b, N, HAS_NV)
        ws = WS + b * WSTRIDE
        bins = tl.arange(0, 256)
        hist = tl.zeros([256], tl.int32)
        for t0 in range(c * CH, tl.minimum((c + 1) * CH, nv), TILE):
            i, m, key = _topk_keys(SC, b, nv, stride_sb, t0, TILE)
            hist += tl.histogram(key >> 8, 256, mask=m)
        tl.atomic_add(ws + 8 + bins, hist, mask=hist != 0, sem="relaxed", scope="gpu")
        if arrive(ws) == NC - 1:
            kk = tl.minimum(K, nv)
            hb, above = _threshold(tl.load(ws + 8 + bins, cache_modifier=".cg"), kk)
            tl.store(ws + 3, tl.where(kk > 0, hb, -1))
            tl.store(ws + 4, above)

    @triton.jit(do_not_specialize=['N', 'K', 'CH', 'NC'])
    def _topk_pass2(SC, NV, WS, H2, BASE, N, K, stride_sb, CH, NC, WSTRIDE: tl.constexpr, G: tl.constexpr,
                    TILE: tl.constexpr, HAS_NV: tl.constexpr):
        """Low-byte histogram of the chunk's entries in bin hb (-> H2[b, c]) and its count above hb;
        the row's last chunk program derives the exact threshold key, #entries above it, #ties to
        take (WS[b, 5:8]) and per chunk the picks above / ties in the chunks before it (BASE[b, c])."""
        pdl_wait()
        b = tl.program_id(0)
        c = tl.program_id(1)
        nv = _row_len(NV, b, N, HAS_NV)
        ws = WS + b * WSTRIDE
        hb = tl.load(ws + 3)
        if hb >= 0:
            bins = tl.arange(0, 256)
            hist = tl.zeros([256], tl.int32)
            gt = tl.zeros([TILE], tl.int32)
            for t0 in range(c * CH, tl.minimum((c + 1) * CH, nv), TILE):
                i, m, key = _topk_keys(SC, b, nv, stride_sb, t0, TILE)
                hist += tl.histogram(key & 255, 256, mask=m & ((key >> 8) == hb))
                gt += (m & ((key >> 8) > hb)).to(tl.int32)
            hp = H2 + (b * NC + c).to(tl.int64) * 256
            tl.store(hp + bins, hist)
            tl.store(BASE + (b * NC + c).to(tl.int64) * 2, tl.sum(gt, axis=0))
            if arrive(ws + 1) == NC - 1:
                kk = tl.minimum(K, nv)
                above1 = tl.load(ws + 4)
                tot = tl.zeros([256], tl.int32)
                for c0 in range(0, NC, G):
                    cc = c0 + tl.arange(0, G)
                    h = tl.load(H2 + ((b * NC + cc).to(tl.int64) * 256)[:, None] + bins[None, :],
                                mask=(cc < NC)[:, None], other=0, cache_modifier=".cg")
                    tot += tl.sum(h, axis=0)
                lb, above2 = _threshold(tot, kk - above1)
                n_gt = above1 + above2
                tl.store(ws + 5, hb * 256 + lb)
                tl.store(ws + 6, n_gt)
                tl.store(ws + 7, kk - n_gt)
                carry_gt = tl.full([], 0, tl.int32)
                carry_eq = tl.full([], 0, tl.int32)
                for c0 in range(0, NC, G):
                    cc = c0 + tl.arange(0, G)
                    cm = cc < NC
                    h = tl.load(H2 + ((b * NC + cc).to(tl.int64) * 256)[:, None] + bins[None, :],
                                mask=cm[:, None], other=0, cache_modifier=".cg")
                    bp = BASE + (b * NC + cc).to(tl.int64) * 2
                    g = tl.load(bp, mask=cm, other=0, cache_modifier=".cg") + \
                        tl.sum(tl.where(bins[None, :] > lb, h, 0), axis=1)
                    eq = tl.sum(tl.where(bins[None, :] == lb, h, 0), axis=1)
                    tl.store(bp, carry_gt + tl.cumsum(g, 0) - g, mask=cm)
                    tl.store(bp + 1, carry_eq + tl.cumsum(eq, 0) - eq, mask=cm)
                    carry_gt += tl.sum(g, axis=0)
                    carry_eq += tl.sum(eq, axis=0)

    @triton.jit(do_not_specialize=['N', 'K', 'CH', 'NC'])
    def _topk_pass3(SC, NV, WS, BASE, BUF, OUT, N, K, stride_sb, stride_ob, CH, NC, WSTRIDE: tl.constexpr,
                    KP: tl.constexpr, TILE: tl.constexpr, SORT: tl.constexpr, HAS_NV: tl.constexpr):
        """The chunk's picks as (0xFFFF - key) << 32 | index at their BUF slots (every entry above
        the threshold, the lowest-index ties up to k); with SORT the row's last chunk program sorts
        the k picks into OUT (else ``_topk_rank`` does, spread over programs). The row's last program
        zeroes its workspace row (counters, fields, H1): every program read its fields before arriving,
        and the next call starts from zeros without a memset launch."""
        pdl_wait()
        b = tl.program_id(0)
        c = tl.program_id(1)
        nv = _row_len(NV, b, N, HAS_NV)
        ws = WS + b * WSTRIDE
        hb = tl.load(ws + 3)
        buf = BUF + b.to(tl.int64) * KP
        if hb >= 0:
            thr = tl.load(ws + 5)
            n_gt = tl.load(ws + 6)
            need_eq = tl.load(ws + 7)
            base_gt = tl.load(BASE + (b * NC + c).to(tl.int64) * 2)
            base_eq = tl.load(BASE + (b * NC + c).to(tl.int64) * 2 + 1)
            for t0 in range(c * CH, tl.minimum((c + 1) * CH, nv), TILE):
                i, m, key = _topk_keys(SC, b, nv, stride_sb, t0, TILE)
                gti = (m & (key > thr)).to(tl.int32)
                eqi = (m & (key == thr)).to(tl.int32)
                r_gt = base_gt + tl.cumsum(gti, 0) - 1
                r_eq = base_eq + tl.cumsum(eqi, 0) - 1
                comp = ((0xFFFF - key).to(tl.int64) << 32) | i.to(tl.int64)
                tl.store(buf + r_gt, comp, mask=gti != 0)
                tl.store(buf + n_gt + r_eq, comp, mask=(eqi != 0) & (r_eq < need_eq))
                base_gt += tl.sum(gti, axis=0)
                base_eq += tl.sum(eqi, axis=0)
        if arrive(ws + 2) == NC - 1:
            if SORT:
                _emit_sorted(buf, OUT + b.to(tl.int64) * stride_ob, tl.minimum(K, nv), K, KP)
            wi = tl.arange(0, WS_P2)
            tl.store(ws + wi, tl.zeros([WS_P2], tl.int32), mask=wi < WSTRIDE)

    @triton.jit
    def _pick_code(v, j):
        """BUF value -> uint32 sort code (0xFFFF - key) << 16 | slot: BUF keeps each key's picks in
        index order, so ascending codes = descending key, lower index first."""
        return (((v >> 32) << 16) | j).to(tl.uint32)

    @triton.jit
    def _emit_sorted(buf, orow, kk, K, KP: tl.constexpr):
        """Sort the kk picks in buf (one program) and write their indices, -1 past kk."""
        j = tl.arange(0, KP)
        v = tl.load(buf + j, mask=j < kk, other=0, cache_modifier=".cg")
        c = tl.sort(tl.where(j < kk, _pick_code(v, j), 0xFFFFFFFF))
        pos = (c & 0xFFFF).to(tl.int32)
        idx = tl.load(buf + pos, mask=j < kk, other=0, cache_modifier=".cg") & 0xFFFFFFFF
        tl.store(orow + j, tl.where(j < kk, idx, -1).to(orow.dtype.element_ty), mask=j < K)

    @triton.jit
    def _topk_rank(BUF, NV, OUT, N, K, stride_ob, KP: tl.constexpr, RB: tl.constexpr, HAS_NV: tl.constexpr):
        """Large k: the picks' final positions spread over k / RB programs; each counts, for RB picks,
        the picks with a smaller code (KP compares each) and writes its index at that rank."""
        pdl_wait()
        b = tl.program_id(0)
        i = tl.program_id(1) * RB + tl.arange(0, RB)
        kk = tl.minimum(K, _row_len(NV, b, N, HAS_NV))
        buf = BUF + b.to(tl.int64) * KP
        orow = OUT + b.to(tl.int64) * stride_ob
        vi = tl.load(buf + i, mask=i < kk, other=0)
        ci = _pick_code(vi, i)
        j = tl.arange(0, KP)
        cj = tl.where(j < kk, _pick_code(tl.load(buf + j, mask=j < kk, other=0), j), 0xFFFFFFFF)
        rank = tl.sum((cj[None, :] < ci[:, None]).to(tl.int32), axis=1)
        tl.store(orow + rank, (vi & 0xFFFFFFFF).to(OUT.dtype.element_ty), mask=i < kk)
        tl.store(orow + i, tl.full([RB], -1, tl.int32).to(OUT.dtype.element_ty), mask=(i >= kk) & (i < K))

    @triton.jit(do_not_specialize=['N', 'K'])
    def _topk_single(SC, NV, BUF, OUT, N, K, stride_sb, stride_ob, KP: tl.constexpr, TILE: tl.constexpr,
                     HAS_NV: tl.constexpr, FULL: tl.constexpr = False):
        """Whole row in one program (N <= TILE): both histograms, the selection and the sort with
        the keys held in registers; one launch, no workspace to zero. FULL: the whole row sorted instead (codes
        (0xFFFF - key) << 16 | index, N <= 65536; entries past n_valid last), its first k taken: no histograms,
        prefix sums or round trip through BUF; the same output."""
        pdl_wait()
        b = tl.program_id(0)
        nv = _row_len(NV, b, N, HAS_NV)
        kk = tl.minimum(K, nv)
        i, m, key = _topk_keys(SC, b, nv, stride_sb, 0, TILE)
        if FULL:
            code = ((0xFFFF - key).to(tl.uint32) << 16) | i.to(tl.uint32)
            c = tl.sort(tl.where(m, code, tl.full([TILE], 0xFFFFFFFF, tl.uint32)))
            orow = OUT + b.to(tl.int64) * stride_ob
            j = tl.arange(0, TILE)
            tl.store(orow + j, tl.where(j < kk, (c & 0xFFFF).to(tl.int32), -1).to(OUT.dtype.element_ty), mask=j < K)
            if K > TILE:
                jk = tl.arange(0, KP)
                tl.store(orow + jk, tl.full([KP], -1, tl.int32).to(OUT.dtype.element_ty), mask=(jk >= TILE) & (jk < K))
            return
        m = m & (kk > 0)
        hb, above1 = _threshold(tl.histogram(key >> 8, 256, mask=m), kk)
        lb, above2 = _threshold(tl.histogram(key & 255, 256, mask=m & ((key >> 8) == hb)), kk - above1)
        thr = hb * 256 + lb
        n_gt = above1 + above2
        gti = (m & (key > thr)).to(tl.int32)
        eqi = (m & (key == thr)).to(tl.int32)
        r_gt = tl.cumsum(gti, 0) - 1
        r_eq = tl.cumsum(eqi, 0) - 1
        comp = ((0xFFFF - key).to(tl.int64) << 32) | i.to(tl.int64)
        buf = BUF + b.to(tl.int64) * KP
        tl.store(buf + r_gt, comp, mask=gti != 0)
        tl.store(buf + n_gt + r_eq, comp, mask=(eqi != 0) & (r_eq < kk - n_gt))
        tl.debug_barrier()
        _emit_sorted(buf, OUT + b.to(tl.int64) * stride_ob, kk, K, KP)


def _kw(num_warps=4, **extra):
    return {} if interpreting() else {"num_warps": num_warps, **extra}


# ------------------------------------------------------------------------------ q prologue
_HMAT: dict = {}


def _hadamard_operand(device, dtype) -> torch.Tensor | None:
    """The +-1 Sylvester matrix [128, 128] for the q prologue's ``LOAD_H`` path, one per device; None
    inside a CUDA-graph capture before it exists (its host-to-device copy cannot be captured)."""
    key = (str(device), dtype)
    if key not in _HMAT:
        if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        from ..formats.hadamard import hadamard_matrix
        _HMAT[key] = hadamard_matrix(HEAD_DIM).to(device=device, dtype=dtype).contiguous()
    return _HMAT[key]


def index_q_prologue(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads_per_program: int | None = None,
                     out: torch.Tensor | None = None, load_h: bool = True) -> torch.Tensor:
    """RoPE (dims 64..127) + Hadamard + FP4 QDQ of the indexer queries q bf16 [T, H, 128] -> bf16.
    ``heads_per_program`` default (H200, 64 heads, docs/benchmarks-2026-11-30.md, session 9): 16 below 128 tokens
    (T = 1: 4.5 us vs 6.8 with 64), 64 from 128 tokens up (T = 4096: 149 us vs 207 with 16).
    ``load_h``: read the +-1 Hadamard operand from a cached per-device tensor (1.18x at T >= 512 on
    the H200) instead of building it in every program from index bits (same bits either way; a CUDA
    graph captured before the tensor exists builds it in-kernel)."""
    T, H, D = q.shape
    if D != HEAD_DIM or q.dtype != torch.bfloat16 or q.stride(2) != 1:
        raise ValueError(f"q: expected bf16 [T, H, 128] (contiguous last dim), got {q.dtype} {tuple(q.shape)}")
    if cos.shape != (T, 32) or sin.shape != (T, 32) or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"cos/sin: expected fp32 [{T}, 32], got {tuple(cos.shape)} / {tuple(sin.shape)}")
    out = torch.empty_like(q) if out is None else out
    if T == 0:
        return out
    HB = heads_per_program or (64 if T >= 128 else 16)
    interp = interpreting()
    hmat = _hadamard_operand(q.device, torch.float32 if interp else torch.bfloat16) if load_h else None
    _index_q_kernel[(T, triton.cdiv(H, HB))](q, cos.contiguous(), sin.contiguous(), out,
                                             q if hmat is None else hmat, H, q.stride(0), q.stride(1), out.stride(0),
                                             out.stride(1), HB=HB, INTERP=interp, LOAD_H=hmat is not None,
                                             **_kw(8 if HB >= 64 else 4, enable_fp_fusion=False), **PDL_LAUNCH)
    return out


def _pad16(n: int) -> int:
    return (n + 15) // 16 * 16


# ------------------------------------------------------------------------------ scores
# rows per program of ``index_scores`` where every row reads one block table (a prefill chunk's rows: the table
# passed with row stride 0): each key page is then dequantised once per QB rows instead of once per row.
# ``experiments/exp_index_scores.py`` (H100, 8192 rows, 2k-16k keys): 4 rows 19-21% faster than 1, 2 rows 14-16%;
# 8 spills registers on sm_90
SHARED_TABLE_ROWS = 4


def index_scores(q: torch.Tensor, w: torch.Tensor, pages: torch.Tensor, block_table: torch.Tensor,
                 pos: torch.Tensor, n: int | None = None, out_dtype: torch.dtype = torch.bfloat16,
                 pages_per_program: int | None = None, num_warps: int = 4, direct: bool = False,
                 w_scale: float | None = None, rows_per_program: int | None = None) -> torch.Tensor:
    """Indexer scores over the MXFP4 paged keys: q bf16 [B, H, 128], w [B, H] (bf16 head weights),
    pages uint8 [num_blocks, 64*68], block_table int [B, W] (-1 pad), pos int [B] -> [B, n] (-inf
    where not causal). ``w_scale``: w is the fp32 ``weights_proj`` output (rows may be strided views),
    the head weights are bf16(bf16(w) * w_scale), formed in the kernel (the twin's order).
    ``rows_per_program`` (a power of two; default ``SHARED_TABLE_ROWS``): where ``block_table`` has row
    stride 0 (one sequence's rows), that many rows per program share each page's dequantisation
    (``_index_scores_rows_kernel``; ``direct`` does not apply there)."""
    B, H, D = q.shape
    if D != HEAD_DIM or q.dtype != torch.bfloat16 or q.stride(2) != 1:
        raise ValueError(f"q: expected bf16 [B, H, 128], got {q.dtype} {tuple(q.shape)}")
    if w.shape != (B, H) or w.stride(1) != 1:
        raise ValueError(f"w: expected [{B}, {H}] with unit column stride, got {tuple(w.shape)} {w.stride()}")
    if w_scale is not None and w.dtype != torch.float32:
        raise ValueError(f"w: with w_scale the weights are the fp32 weights_proj output, got {w.dtype}")
    if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.shape[1] != INDEX_PAGE * INDEX_ENTRY_BYTES:
        raise ValueError(f"pages: expected uint8 [num_blocks, {INDEX_PAGE * INDEX_ENTRY_BYTES}], got "
                         f"{pages.dtype} {tuple(pages.shape)}")
    n_bt = block_table.shape[1]
    n = INDEX_PAGE * n_bt if n is None else n
    # rows padded to 16 entries: the row stride is a multiple of 16 whatever n is (one compiled
    # variant of this kernel and of the top-k kernels that read the scores; aligned row starts)
    out = torch.empty(B, _pad16(n), dtype=out_dtype, device=q.device)[:, :n]
    if B == 0 or n == 0:
        return out
    n_tiles = triton.cdiv(n, INDEX_PAGE)
    qb = SHARED_TABLE_ROWS if rows_per_program is None else rows_per_program
    if qb < 1 or qb & (qb - 1):
        raise ValueError(f"rows_per_program must be a power of two, got {qb}")
    qb = qb if block_table.stride(0) == 0 and B > 1 else 1
    # pages per program: 1, 2, 4 or 8 (powers of two: few compiled variants)
    tpp = pages_per_program or (1 if interpreting() else
                                1 << (max(1, min(8, n_tiles * triton.cdiv(B, qb) // (8 * target(q.device).sm_count)))
                                      .bit_length() - 1))
    HP = max(16, triton.next_power_of_2(H))
    if qb > 1:
        _index_scores_rows_kernel[(triton.cdiv(B, qb), triton.cdiv(n_tiles, tpp))](
            q, w, pages, block_table, pos, out, B, H, n, n_bt, q.stride(0), q.stride(1), w.stride(0), out.stride(0),
            pages.shape[1], float(w_scale if w_scale is not None else 1.0), QB=qb, TPP=tpp, HP=HP,
            INTERP=interpreting(), W_SCALE=w_scale is not None, **_kw(num_warps if qb * HP <= 128 else 8), **PDL_LAUNCH)
        return out
    grid = (B, triton.cdiv(n_tiles, tpp))
    _index_scores_kernel[grid](q, w, pages, block_table, pos, out, H, n, n_bt, q.stride(0), q.stride(1),
                               w.stride(0), block_table.stride(0), out.stride(0), pages.shape[1],
                               float(w_scale if w_scale is not None else 1.0),
                               TPP=tpp, HP=HP, INTERP=interpreting(),
                               W_SCALE=w_scale is not None, DIRECT=direct, **_kw(num_warps), **PDL_LAUNCH)
    return out


# ------------------------------------------------------------------------------ top-k
def index_topk(scores: torch.Tensor, k: int, n_valid: torch.Tensor | None = None,
               out_dtype: torch.dtype = torch.int32, chunks: int | None = None,
               single_max: int | None = None, sort_max: int = SORT_IN_KERNEL_MAX,
               full_sort: bool | None = None) -> torch.Tensor:
    """Top-k indices [B, k] of bf16 scores [B, N] among entries < n_valid[b] (default N): descending
    score, ties -> lower index, -1 past min(k, n_valid[b]). ``single_max``: rows up to this long
    take the one-launch kernel (default ``SINGLE_MAX``; 0 forces the chunked passes, as ``chunks``
    does); ``sort_max``: the chunked path sorts up to this many picks in its last pass (any number
    from 32 rows up), more in an extra rank launch; ``full_sort``: the one-launch kernel sorts the whole row
    instead of selecting first (default ``SINGLE_FULL_SORT``)."""
    if scores.dim() != 2 or scores.dtype != torch.bfloat16 or scores.stride(1) != 1:
        raise ValueError(f"scores: expected bf16 [B, N] with a contiguous last dim, got {scores.dtype} "
                         f"{tuple(scores.shape)}")
    if not 1 <= k <= MAX_K:
        raise ValueError(f"k must be in [1, {MAX_K}], got {k}")
    B, N = scores.shape
    dev = scores.device
    out = torch.empty(B, _pad16(k), dtype=out_dtype, device=dev)[:, :k]     # row stride: see index_scores
    if B == 0:
        return out
    has_nv = n_valid is not None
    if has_nv:
        if n_valid.shape != (B,):
            raise ValueError(f"n_valid: expected [{B}], got {tuple(n_valid.shape)}")
        n_valid = n_valid.to(torch.int32).contiguous()
    else:           # every row is N long: the kernels use N (no fill launch)
        n_valid = out
    interp = interpreting()
    KP = max(16, triton.next_power_of_2(k))
    buf = torch.empty(B, KP, dtype=torch.int64, device=dev)
    sc = scores.view(torch.int16)
    kw = _kw(8)
    single_max = SINGLE_MAX if single_max is None else single_max
    if chunks is None and N <= single_max:
        _topk_single[(B,)](sc, n_valid, buf, out, N, k, sc.stride(0), out.stride(0), KP=KP,
                           TILE=max(16, triton.next_power_of_2(N)), HAS_NV=has_nv,
                           FULL=SINGLE_FULL_SORT if full_sort is None else full_sort, **kw, **PDL_LAUNCH)
        return out
    TILE = min(2048 if not interp else 256, triton.next_power_of_2(max(N, 16)))
    n_tiles = triton.cdiv(max(N, 1), TILE)
    NC = chunks or max(1, min(n_tiles, 128 if B == 1 else triton.cdiv(4 * target(dev).sm_count, B)))
    CH = triton.cdiv(triton.cdiv(max(N, 1), NC), TILE) * TILE
    NC = triton.cdiv(max(N, 1), CH)
    G = 32          # chunks pass 2's last program reduces at a time (masked past NC): one compiled variant
    # counters, row fields, H1: zeros at entry, zeroed again by pass 3 (the shared arrival counters)
    ws = arrival_counters(dev, B * _TOPK_WS)
    h2 = torch.empty(B, NC, 256, dtype=torch.int32, device=dev)
    base = torch.empty(B, NC, 2, dtype=torch.int32, device=dev)
    grid = (B, NC)
    _topk_pass1[grid](sc, n_valid, ws, N, k, sc.stride(0), CH, NC, WSTRIDE=_TOPK_WS, TILE=TILE, HAS_NV=has_nv,
                      **kw, **PDL_LAUNCH)
    _topk_pass2[grid](sc, n_valid, ws, h2, base, N, k, sc.stride(0), CH, NC, WSTRIDE=_TOPK_WS, G=G, TILE=TILE,
                      HAS_NV=has_nv, **kw, **PDL_LAUNCH)
    # many rows (prefill): one in-kernel sort per row runs in parallel over the rows (B = 128, k = 1024
    # over 64K on the H200: 174 us with it, int64 codes then, vs 206 us with the rank launch); few rows: the rank launch
    # spreads a row's sort over k / 16 programs (B = 1, k = 2048 over 256K: 30.7 vs 41.1 us)
    sort = KP <= sort_max or B >= 32
    _topk_pass3[grid](sc, n_valid, ws, base, buf, out, N, k, sc.stride(0), out.stride(0), CH, NC,
                      WSTRIDE=_TOPK_WS, KP=KP, TILE=TILE, SORT=sort, HAS_NV=has_nv, **kw, **PDL_LAUNCH)
    if not sort:
        RB = 16
        _topk_rank[(B, triton.cdiv(k, RB))](buf, n_valid, out, N, k, out.stride(0), KP=KP, RB=RB, HAS_NV=has_nv,
                                            **kw, **PDL_LAUNCH)
    return out


__all__ = ["index_q_prologue", "index_scores", "index_topk"]
