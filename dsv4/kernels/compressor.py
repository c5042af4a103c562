"""KV-compressor decode and prefill-chunk updates + pooling + post-processing (spec §5), beside their torch twins.

``compress_decode`` is the decode step's compressor update (the reference's ``Compressor.update``
+ ``Compressor.postprocess``) for a batch of decode tokens (one token per sequence), for the main
compressor (c = 512, 584-byte FP8 entries)
and the indexer's (c = 128, Hadamard + FP4, MXFP4 keys), CSA (ratio 4, overlapping windows) and
HCA (ratio 128):

1. every token writes its row ``[K (coff*c) | score (coff*c)]`` (fp32) into its slot's ring
   ``state[slot, pos % (coff*m)]`` (``score`` already holds ``ape[pos % m]``, or pass ``ape`` and
   the kernel adds it);
2. tokens with ``(pos + 1) % m == 0`` pool the window they complete: CSA: the previous window's
   first channel half (rows ``K[:c]``, scores ``S[:c]``; K = 0 / score = -inf when there is no
   previous window, i.e. the first entry) stacked over the current window's second half (2m rows);
   HCA: the m rows; softmax over the rows per channel in fp32, weighted sum;
3. post-processing of the pooled vector: ``RMSNorm(bf16(pooled))`` with the compressor's norm
   weight (fp32 math, bf16 out), RoPE on the last 64 dims at position ``pos + 1 - m`` (the
   caller's fp32 cos/sin rows ``[B, 32]`` for that position), then main: FP8 e4m3 QDQ of dims
   0..447 in 64-blocks (UE8M0 scales); indexer: Hadamard(128) * 128^-0.5, bf16, FP4 e2m1 QDQ in
   32-blocks (UE8M0 scales);
4. optionally the entry is written into a paged cache at ``page_slots`` (global slot id =
   page * page_size + offset; -1 = skip; only completing tokens write): main: the 584-byte
   ``MODEL1_FP8Sparse`` entry (``encode_kv_entries`` bytes, as ``kv_insert`` writes them); indexer:
   the 68-byte MXFP4 key (``encode_index_keys`` bytes; page = [ps x 64 B codes][ps x 4 B scales]).

Returns ``(entries bf16 [B, c], complete bool [B])`` (+ the fp32 pooled vectors with
``return_pooled``); rows that complete nothing get zero entries and write nothing.

Kernels: main CSA (c = 512, 8 x 512 tile per token): ``_comp_fused``, grid (B,), ring write +
pooling + post-processing + paged write in one launch. Indexer CSA and HCA (and any ``block_c <
c``): ``_comp_pool`` grid (B, c / CB) writes its channels of the ring row and pools a rows x CB tile
(8 x 32 / 128 x 32), then ``_comp_post`` grid (B) post-processes (the pooled fp32 vector goes
through an L2-resident workspace). The choice per variant is the faster one measured on the H200. The current token's own row comes from registers, never read back. Non-completing
tokens only write their ring row (and a zero entry).

Numerics vs the twin (``twins.compressor.compress_decode`` = the reference's pooling +
``Compressor.postprocess`` with official numerics): the pooled fp32 vector agrees to fp32 rounding
(softmax/sum order, exp ulps); with the same pooled vector the post-processing is bit-exact except
where the 512-term square sum or the Hadamard's summation order moves a bf16 rounding (rare), and a
moved bf16 value can move one FP8/FP4 quantisation step. RoPE products and sums are rounded
separately (``enable_fp_fusion=False``), as the reference's complex64 multiply.

Prefill chunk: ``compress_prefill(rows_k, rows_s, base, first, last, ...)`` produces the entries j =
first .. last-1 completed by a chunk (``Compressor.update``'s pooling + post-processing; the caller
keeps the pending rows, as ``CompressorState`` does). Row i of ``rows_k`` / ``rows_s`` (fp32
[R, coff*c], scores with ape) is position ``base + i``; entry j pools positions j*m .. j*m+m-1 (CSA:
stacked under the first channel half of positions (j-1)*m .., K = 0 / score = -inf for j = 0), RoPE
at position j*m (cos/sin rows [last-first, 32]), the same post-processing, QDQ and optional paged
write (``page_slots`` [last-first], -1 = skip) as the decode step. The rows must cover positions
[(first-1)*m (CSA, first > 0) or first*m, last*m) (checked on the host: ValueError). Kernels: CSA (main
and indexer): ``_pref_pool`` with ``POST``, grid (entries,), all c channels of a 2m x c tile and the
post-processing in one program; HCA (m x c = 128 x 512 does not fit one program): ``_pref_pool`` grid
(entries, c / 32) writes the pooled fp32 vectors and the entry's last-arriving program (an arrival
counter, ``counters.py``) post-processes it: one launch either way. Same numerics as the decode step vs
``twins.compressor.compress_prefill`` (the reference's ``pool`` + ``postprocess``, official numerics). The
default path choice is by construction, not measured on the H200.
"""
from __future__ import annotations

import torch

from ..formats.contracts import check_compress_decode, check_compress_prefill, check_compressor_pages
from .lib import PDL_LAUNCH, interpreting, triton_available
from .counters import arrival_counters


if triton_available():
    import triton
    import triton.language as tl

    from .counters import arrive
    from .lib import e4m3_bits, exp2i, fp4_qdq_blocks, pdl_wait, rne_bf16, ue8m0_exp, ue8m0_exp6

    @triton.jit
    def _pool_part(STATE, SLOTS, POS, KIN, SIN_, APE, b, cb, stride_ss, stride_sr, stride_kb, stride_sb,
                   M: tl.constexpr, C: tl.constexpr, OVERLAP: tl.constexpr, HAS_APE: tl.constexpr,
                   CB: tl.constexpr, FAST: tl.constexpr):
        """Write channels [cb*CB, cb*CB + CB) (and C + those for CSA) of the token's ring row; return
        (pooled fp32 [CB] of those channels (zeros if the token completes no window), done, pos)."""
        COFF: tl.constexpr = 2 if OVERLAP else 1
        R: tl.constexpr = COFF * M
        W: tl.constexpr = COFF * C
        NR: tl.constexpr = COFF * M                       # pooled rows: 2m (CSA) or m (HCA)
        slot = tl.load(SLOTS + b).to(tl.int64)
        p = tl.load(POS + b).to(tl.int64)
        ring = STATE + slot * stride_ss
        row = p % R
        ch = cb * CB + tl.arange(0, CB)
        # ---- 1. this token's row: channels ch (and C + ch for CSA) of K and score
        kin = KIN + b.to(tl.int64) * stride_kb
        sin = SIN_ + b.to(tl.int64) * stride_sb
        k_lo = tl.load(kin + ch).to(tl.float32)           # bf16 or fp32 rows
        s_lo = tl.load(sin + ch).to(tl.float32)
        if HAS_APE:
            s_lo = s_lo + tl.load(APE + (p % M) * W + ch)
        tl.store(ring + row * stride_sr + ch, k_lo)
        tl.store(ring + row * stride_sr + W + ch, s_lo)
        if OVERLAP:
            k_hi = tl.load(kin + C + ch).to(tl.float32)
            s_hi = tl.load(sin + C + ch).to(tl.float32)
            if HAS_APE:
                s_hi = s_hi + tl.load(APE + (p % M) * W + C + ch)
            tl.store(ring + row * stride_sr + C + ch, k_hi)
            tl.store(ring + row * stride_sr + W + C + ch, s_hi)
        else:
            k_hi = k_lo
            s_hi = s_lo
        # ---- 2. pool the completed window
        done = (p + 1) % M == 0
        pooled = tl.zeros([CB], tl.float32)
        if done:
            start = p + 1 - M
            r = tl.arange(0, NR)
            if OVERLAP:
                is_prev = r < M
                rpos = start - M + r                        # prev rows: start-m .. start-1; cur: start ..
                cmask = (rpos >= 0) | (~is_prev)
                coff_ch = tl.where(is_prev, 0, C)           # prev rows read channels [0, c), cur [c, 2c)
            else:
                rpos = start + r
                cmask = r >= 0
                coff_ch = r * 0
            rrow = (tl.maximum(rpos, 0) % R)
            is_cur = rpos == p                              # the token's own row: from registers
            ld = (cmask & (~is_cur))[:, None]
            off = rrow[:, None] * stride_sr + coff_ch[:, None] + ch[None, :]
            kt = tl.load(ring + off, mask=ld, other=0.0)
            st = tl.load(ring + W + off, mask=ld, other=float("-inf"))
            kt = tl.where(is_cur[:, None], k_hi[None, :], kt)
            st = tl.where(is_cur[:, None], s_hi[None, :], st)
            pooled = _softmax_pool(kt, st, FAST)
        return pooled, done, p

    @triton.jit
    def _softmax_pool(kt, st, FAST: tl.constexpr):
        """Softmax of the scores st [rows, CB] over the rows (per channel), weighted sum of kt -> [CB].
        Normalised once per channel (sum(kt * e) / sum(e)): a division per element is ~7 SASS
        instructions (IEEE div.rn). FAST (compiled, not the interpreter): exp as one FFMA + a
        flush-to-zero ex2 (weights below 2^-126 of the largest become 0; the non-ftz ex2 costs 3
        more instructions per element). Both move the result by fp32 ulps only."""
        mx = tl.max(st, axis=0)
        if FAST:
            t = tl.fma(st, 1.4426950408889634, -(mx * 1.4426950408889634)[None, :])
            e = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [t], dtype=tl.float32,
                                          is_pure=True, pack=1)
        else:
            e = tl.exp(st - mx[None, :])
        return tl.math.div_rn(tl.sum(kt * e, axis=0), tl.sum(e, axis=0))

    @triton.jit
    def _bf16r(x, FAST: tl.constexpr):
        """fp32 -> the fp32 value of its bf16 round-to-nearest-even: a cvt.rn when compiled, the
        bit arithmetic of ``rne_bf16`` under the interpreter (whose bf16 cast truncates)."""
        if FAST:
            return x.to(tl.bfloat16).to(tl.float32)
        else:
            return rne_bf16(x)

    @triton.jit
    def _pool_rows(RK, RS, j, base, cb, stride_rk, stride_rs,
                   M: tl.constexpr, C: tl.constexpr, OVERLAP: tl.constexpr, CB: tl.constexpr, FAST: tl.constexpr):
        """Pooled fp32 [CB] (channels cb*CB ..) of entry j from the prefill rows (row i = position base + i)."""
        NR: tl.constexpr = 2 * M if OVERLAP else M
        ch = cb * CB + tl.arange(0, CB)
        r = tl.arange(0, NR)
        if OVERLAP:
            is_prev = r < M
            rpos = (j - 1) * M + r                          # prev rows (j-1)m ..; cur rows jm ..
            cmask = (rpos >= 0) | (~is_prev)                # entry 0: no previous window
            coff_ch = tl.where(is_prev, 0, C)               # prev rows read channels [0, c), cur [c, 2c)
        else:
            rpos = j * M + r
            cmask = r >= 0
            coff_ch = r * 0
        row = tl.maximum(rpos - base, 0)
        ld = cmask[:, None]
        kt = tl.load(RK + row[:, None] * stride_rk + coff_ch[:, None] + ch[None, :], mask=ld, other=0.0)
        st = tl.load(RS + row[:, None] * stride_rs + coff_ch[:, None] + ch[None, :], mask=ld,
                     other=float("-inf"))
        return _softmax_pool(kt, st, FAST)

    @triton.jit
    def _comp_pool(STATE, SLOTS, POS, KIN, SIN_, APE, POOLED,
                   stride_ss, stride_sr, stride_kb, stride_sb, stride_pb,
                   M: tl.constexpr, C: tl.constexpr, OVERLAP: tl.constexpr, HAS_APE: tl.constexpr,
                   CB: tl.constexpr, FAST: tl.constexpr):
        pdl_wait()
        b = tl.program_id(0)
        cb = tl.program_id(1)
        pooled, done, p = _pool_part(STATE, SLOTS, POS, KIN, SIN_, APE, b, cb, stride_ss, stride_sr,
                                     stride_kb, stride_sb, M, C, OVERLAP, HAS_APE, CB, FAST)
        tl.store(POOLED + b.to(tl.int64) * stride_pb + cb * CB + tl.arange(0, CB), pooled)

    @triton.jit
    def _rope_vec(x, COS, SIN, C: tl.constexpr):
        """Rotate the interleaved pairs of the last 64 of C dims of x [C] (fp32)."""
        x0, x1 = tl.split(tl.reshape(x, [C // 2, 2]))
        j = tl.arange(0, C // 2)
        R0: tl.constexpr = (C - 64) // 2
        is_rope = j >= R0
        c = tl.load(COS + (j - R0), mask=is_rope, other=1.0)
        s = tl.load(SIN + (j - R0), mask=is_rope, other=0.0)
        y0 = x0 * c - x1 * s
        y1 = x0 * s + x1 * c
        y0 = tl.where(is_rope, y0, x0)
        y1 = tl.where(is_rope, y1, x1)
        return tl.reshape(tl.join(y0, y1), [C])

    @triton.jit
    def _fwht_stage(x, N: tl.constexpr, H: tl.constexpr):
        x3 = tl.permute(tl.reshape(x, [N // (2 * H), 2, H]), (0, 2, 1))     # [A, H, 2]
        a, b = tl.split(x3)
        y = tl.permute(tl.join(a + b, a - b), (0, 2, 1))
        return tl.reshape(y, [N])

    @triton.jit
    def _fwht128(x):
        """Unnormalised natural-order Walsh-Hadamard transform of x [128] (= x @ H, H[i,j] = (-1)^popc(i&j))."""
        x = _fwht_stage(x, 128, 1)
        x = _fwht_stage(x, 128, 2)
        x = _fwht_stage(x, 128, 4)
        x = _fwht_stage(x, 128, 8)
        x = _fwht_stage(x, 128, 16)
        x = _fwht_stage(x, 128, 32)
        x = _fwht_stage(x, 128, 64)
        return x

    @triton.jit
    def _entry(x, b64, NORMW, COS, SIN_, OUT, PAGES, PSLOTS, stride_ob, page_size, page_nbytes, eps,
               C: tl.constexpr, INDEXER: tl.constexpr, WRITE: tl.constexpr, FAST: tl.constexpr):
        """Post-process the pooled vector x [C] fp32 of token b, store the bf16 entry (and its cache bytes).

        The cache bytes encode the QDQ'd entry with its scale re-derived from it (``encode_kv_entries``
        / ``encode_index_keys`` of the entry): that scale is the QDQ scale 2^e or, when rounding put the
        block's QDQ'd maximum at or below half the format's range, 2^(e-1) (never another:
        tests/test_formats.py checks every fp32 block maximum of three binades). The codes then
        follow from the first encoding: unchanged, or each value doubled exactly (e4m3: magnitude
        code m -> 2m if m < 8 else m + 8; e2m1: c -> 2c if c <= 2 else c + 2); no second quantisation."""
        d = tl.arange(0, C)
        x = _bf16r(x, FAST)
        ms = tl.sum(x * x, axis=0) / C
        r = tl.math.div_rn(1.0, tl.sqrt_rn(ms + eps))
        w = tl.load(NORMW + d).to(tl.float32)            # bf16 or fp32 weights
        x = _bf16r(w * (x * r), FAST)
        x = _bf16r(_rope_vec(x, COS + b64 * 32, SIN_ + b64 * 32, C), FAST)
        if INDEXER:
            x = _bf16r(_fwht128(x) * 0.08838834764831845, FAST)
            q, code, e = fp4_qdq_blocks(tl.reshape(x, [C // 32, 32]))
            out = tl.reshape(q, [C])
            tl.store(OUT + b64 * stride_ob + d, out.to(tl.bfloat16))
            if WRITE:
                slot = tl.load(PSLOTS + b64)
                if slot >= 0:
                    e2 = ue8m0_exp6(tl.max(tl.abs(q), axis=1))
                    mag = code & 7
                    mag = tl.where((e2 < e)[:, None], tl.where(mag <= 2, 2 * mag, mag + 2), mag)
                    code = (code & 8) | mag
                    e = e2
                    lo, hi = tl.split(tl.reshape(code, [C // 2, 2]))
                    packed = (lo | (hi << 4)).to(tl.uint8)
                    page = slot // page_size
                    offs = slot - page * page_size
                    base = PAGES + page * page_nbytes
                    tl.store(base + offs * (C // 2) + tl.arange(0, C // 2), packed)
                    tl.store(base + page_size * (C // 2) + offs * (C // 32) + tl.arange(0, C // 32),
                             (127 + e).to(tl.uint8))
        else:
            xb = tl.reshape(x, [8, 64])                       # block 7 = the 64 rope dims
            blk = tl.arange(0, 8)
            e = ue8m0_exp(tl.max(tl.abs(xb), axis=1))
            qv = tl.minimum(tl.maximum(xb * exp2i(-e)[:, None], -448.0), 448.0)
            code = e4m3_bits(qv)
            deq = code.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
            deq = deq * exp2i(e)[:, None]
            is_nope = (blk < 7)[:, None]
            out = tl.where(is_nope, deq, xb)
            tl.store(OUT + b64 * stride_ob + d, tl.reshape(out, [C]).to(tl.bfloat16))
            if WRITE:
                slot = tl.load(PSLOTS + b64)
                if slot >= 0:
                    e2 = ue8m0_exp(tl.max(tl.abs(deq), axis=1))
                    mag = code & 0x7F
                    mag = tl.where((e2 < e)[:, None], tl.where(mag < 8, 2 * mag, mag + 8), mag)
                    q8 = ((code & 0x80) | mag).to(tl.uint8)
                    page = slot // page_size
                    offs = slot - page * page_size
                    base = PAGES + page * page_nbytes
                    rowp = base + offs * 576
                    o = blk[:, None] * 64 + tl.arange(0, 64)[None, :]
                    tl.store(rowp + o, q8, mask=is_nope & (o < 448))
                    rope_ptr = (rowp + 448).to(tl.pointer_type(tl.bfloat16))
                    tl.store(rope_ptr + (o - 448), out.to(tl.bfloat16), mask=(o >= 448))
                    tl.store(base + page_size * 576 + offs * 8 + blk, tl.where(blk < 7, 127 + e2, 0).to(tl.uint8))

    @triton.jit
    def _comp_post(POOLED, NORMW, COS, SIN_, POS, OUT, COMPLETE, PAGES, PSLOTS,
                   stride_pb, stride_ob, page_size, page_nbytes, eps,
                   M: tl.constexpr, C: tl.constexpr, INDEXER: tl.constexpr, WRITE: tl.constexpr,
                   FAST: tl.constexpr):
        pdl_wait()
        b = tl.program_id(0)
        b64 = b.to(tl.int64)
        p = tl.load(POS + b)
        done = (p + 1) % M == 0
        tl.store(COMPLETE + b, done.to(tl.int8))
        d = tl.arange(0, C)
        if done:
            x = tl.load(POOLED + b64 * stride_pb + d)
            _entry(x, b64, NORMW, COS, SIN_, OUT, PAGES, PSLOTS, stride_ob, page_size, page_nbytes, eps,
                   C, INDEXER, WRITE, FAST)
        else:
            tl.store(OUT + b64 * stride_ob + d, tl.zeros([C], tl.float32).to(tl.bfloat16))

    @triton.jit
    def _comp_fused(STATE, SLOTS, POS, KIN, SIN_, APE, POOLED, NORMW, COS, COSIN_, OUT, COMPLETE, PAGES, PSLOTS,
                    stride_ss, stride_sr, stride_kb, stride_sb, stride_pb, stride_ob, page_size, page_nbytes, eps,
                    M: tl.constexpr, C: tl.constexpr, OVERLAP: tl.constexpr, HAS_APE: tl.constexpr,
                    INDEXER: tl.constexpr, WRITE: tl.constexpr, STORE_POOLED: tl.constexpr, FAST: tl.constexpr):
        """One program per token, all c channels: ring write + pooling + post-processing in one launch."""
        pdl_wait()
        b = tl.program_id(0)
        b64 = b.to(tl.int64)
        pooled, done, p = _pool_part(STATE, SLOTS, POS, KIN, SIN_, APE, b, 0, stride_ss, stride_sr,
                                     stride_kb, stride_sb, M, C, OVERLAP, HAS_APE, C, FAST)
        d = tl.arange(0, C)
        if STORE_POOLED:
            tl.store(POOLED + b64 * stride_pb + d, pooled)
        tl.store(COMPLETE + b, done.to(tl.int8))
        if done:
            _entry(pooled, b64, NORMW, COS, COSIN_, OUT, PAGES, PSLOTS, stride_ob, page_size, page_nbytes, eps,
                   C, INDEXER, WRITE, FAST)
        else:
            tl.store(OUT + b64 * stride_ob + d, tl.zeros([C], tl.float32).to(tl.bfloat16))

    @triton.jit(do_not_specialize=['base', 'first'])
    def _pref_pool(RK, RS, POOLED, NORMW, COS, SIN_, OUT, PAGES, PSLOTS, CNT, base, first,
                   stride_rk, stride_rs, stride_pb, stride_ob, page_size, page_nbytes, eps,
                   M: tl.constexpr, C: tl.constexpr, OVERLAP: tl.constexpr, CB: tl.constexpr,
                   POST: tl.constexpr, INDEXER: tl.constexpr, WRITE: tl.constexpr, STORE_POOLED: tl.constexpr,
                   FAST: tl.constexpr):
        """Prefill chunk: program (i, cb) pools channels [cb*CB, cb*CB + CB) of entry j = first + i and
        post-processes the entry (and writes its cache bytes): in the same program when CB == C, else
        in the entry's last-arriving channel-block program (CNT: per-entry arrival counters, zero at
        entry and reset by that program), from the pooled fp32 vector the others stored."""
        pdl_wait()
        i64 = tl.program_id(0).to(tl.int64)
        cb = tl.program_id(1)
        j = i64 + first
        pooled = _pool_rows(RK, RS, j, base, cb, stride_rk, stride_rs, M, C, OVERLAP, CB, FAST)
        if STORE_POOLED:
            tl.store(POOLED + i64 * stride_pb + cb * CB + tl.arange(0, CB), pooled)
        if POST:
            if CB == C:
                _entry(pooled, i64, NORMW, COS, SIN_, OUT, PAGES, PSLOTS, stride_ob, page_size, page_nbytes, eps,
                       C, INDEXER, WRITE, FAST)
            else:
                if arrive(CNT + i64) == C // CB - 1:
                    x = tl.load(POOLED + i64 * stride_pb + tl.arange(0, C), cache_modifier=".cg")
                    _entry(x, i64, NORMW, COS, SIN_, OUT, PAGES, PSLOTS, stride_ob, page_size, page_nbytes,
                           eps, C, INDEXER, WRITE, FAST)
                    tl.store(CNT + i64, 0)


def _norm_weight(w: torch.Tensor) -> torch.Tensor:
    """The norm weight as the kernels read it: bf16 or fp32 as given (converted in the kernel: a host-side
    ``.float()`` is one more launch per call), other dtypes as fp32."""
    w = w if w.dtype in (torch.bfloat16, torch.float32) else w.float()
    return w.contiguous()


def compress_decode(state: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, k: torch.Tensor,
                    s: torch.Tensor, norm_w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                    ratio: int, indexer: bool = False, ape: torch.Tensor | None = None, eps: float = 1e-6,
                    pages: torch.Tensor | None = None, page_slots: torch.Tensor | None = None,
                    page_size: int = 64, return_pooled: bool = False, block_c: int | None = None,
                    fused: bool | None = None, fused_warps: int = 8):
    """Triton decode update of one compressor for a batch of tokens (see the module doc).

    state fp32 [slots, coff*m, 2*coff*c] (updated in place); slots, pos int [B]; k, s fp32 or bf16
    [B, coff*c] (read as fp32 in the kernel); norm_w bf16 / fp32 [c]; cos/sin fp32 [B, 32] at
    position pos + 1 - m; ape fp32 [m, coff*c] (optional: added to s in the kernel).
    -> (entries bf16 [B, c], complete bool [B][, pooled fp32 [B, c]]).
    """
    c, coff = check_compress_decode(state, slots, pos, k, s, cos, sin, ratio, indexer)
    B = pos.shape[0]
    dev = state.device
    out = torch.empty(B, c, dtype=torch.bfloat16, device=dev)
    complete = torch.empty(B, dtype=torch.bool, device=dev)     # the kernels store 0 / 1 bytes
    pooled = torch.empty(B, c, dtype=torch.float32, device=dev)
    if B == 0:
        return (out, complete, pooled) if return_pooled else (out, complete)
    if state.stride(2) != 1:
        raise ValueError("state needs a contiguous last dim")
    k, s = (t if t.stride(1) == 1 else t.contiguous() for t in (k, s))     # rows may be strided views
    cos, sin = cos.contiguous(), sin.contiguous()
    nrows = coff * ratio
    # measured on the H200 (BENCHMARKS.md): main CSA fused (one program per token), indexer CSA and
    # HCA two kernels over channel blocks (32 channels: more programs in flight)
    CB = block_c or (c if (ratio == 4 and c >= 512) else max(16, min(c // 4, 4096 // nrows)))
    interp = interpreting()
    ape_t = ape.float().contiguous() if ape is not None else k
    if ape is not None and ape.shape != (ratio, coff * c):
        raise ValueError(f"ape: expected [{ratio}, {coff * c}], got {tuple(ape.shape)}")
    write = pages is not None
    if write:
        check_compressor_pages(pages, page_slots, page_size, indexer, B)
    pg, ps_t, pnb = (pages, page_slots, pages.shape[1]) if write else (out, pos, 0)
    nw = fused_warps if CB == c else 4
    kw = {} if interp else {"num_warps": nw, "enable_fp_fusion": False}
    if fused if fused is not None else CB == c:
        if CB != c:
            raise ValueError("the fused kernel pools all c channels in one program (block_c == c)")
        _comp_fused[(B,)](state, slots, pos, k, s, ape_t, pooled, _norm_weight(norm_w), cos, sin, out,
                          complete.view(torch.int8), pg, ps_t, state.stride(0), state.stride(1), k.stride(0),
                          s.stride(0), pooled.stride(0), out.stride(0), page_size, pnb, eps, M=ratio, C=c,
                          OVERLAP=ratio == 4, HAS_APE=ape is not None, INDEXER=indexer, WRITE=write,
                          STORE_POOLED=return_pooled, FAST=not interp, **kw, **PDL_LAUNCH)
    else:
        _comp_pool[(B, c // CB)](state, slots, pos, k, s, ape_t, pooled,
                                 state.stride(0), state.stride(1), k.stride(0), s.stride(0), pooled.stride(0),
                                 M=ratio, C=c, OVERLAP=ratio == 4, HAS_APE=ape is not None, CB=CB, FAST=not interp,
                                 **kw, **PDL_LAUNCH)
        _comp_post[(B,)](pooled, _norm_weight(norm_w), cos, sin, pos, out, complete.view(torch.int8), pg,
                         ps_t, pooled.stride(0), out.stride(0), page_size, pnb, eps,
                         M=ratio, C=c, INDEXER=indexer, WRITE=write, FAST=not interp, **kw, **PDL_LAUNCH)
    res = (out, complete)
    return res + (pooled,) if return_pooled else res


def compress_prefill(rows_k: torch.Tensor, rows_s: torch.Tensor, base: int, first: int, last: int,
                     norm_w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, ratio: int,
                     indexer: bool = False, eps: float = 1e-6, pages: torch.Tensor | None = None,
                     page_slots: torch.Tensor | None = None, page_size: int = 64, return_pooled: bool = False,
                     block_c: int | None = None, fused: bool | None = None, num_warps: int | None = None):
    """Triton prefill-chunk update of one compressor: entries j = first .. last-1 (see the module doc).

    rows_k, rows_s fp32 [R, coff*c]: row i = position base + i (scores include ape); norm_w [c];
    cos/sin fp32 [last-first, 32] at positions j*ratio; pages / page_slots [last-first] (-1 = skip)
    as in ``compress_decode``. -> entries bf16 [last-first, c] (, pooled fp32 [last-first, c]).
    ``fused`` (default: CSA) pools all c channels and post-processes in one program per entry;
    otherwise ``_pref_pool`` over channel blocks of ``block_c``, the entry's last block program
    post-processing it. ``num_warps``: warps per program (a tuning knob; default 2 for the fused
    c = 512 kernel, 1 for the fused indexer, else 4).
    """
    c, coff, n = check_compress_prefill(rows_k, rows_s, base, first, last, norm_w, cos, sin, ratio, indexer)
    dev = rows_k.device
    out = torch.empty(n, c, dtype=torch.bfloat16, device=dev)
    pooled = torch.empty(n, c, dtype=torch.float32, device=dev)
    write = pages is not None
    if write:
        check_compressor_pages(pages, page_slots, page_size, indexer, n)
    if n == 0:
        return (out, pooled) if return_pooled else out
    cos, sin = cos.contiguous(), sin.contiguous()
    nrows = coff * ratio
    use_fused = fused if fused is not None else (ratio == 4 and block_c in (None, c))
    CB = c if use_fused else (block_c or max(16, min(c // 4, 4096 // nrows)))
    if use_fused and CB != c:
        raise ValueError("the fused kernel pools all c channels in one program (block_c == c)")
    if c % CB != 0 or CB & (CB - 1):
        raise ValueError(f"block_c must be a power of two dividing {c}, got {CB}")
    pg, ps_t, pnb = (pages, page_slots.to(torch.int64).contiguous(), pages.shape[1]) if write else (out, out, 0)
    # H200 (experiments/exp_compress_prefill.py, T = 4096 / 16384): the fused kernel is latency-bound in
    # its per-entry post-processing (cross-warp reductions and layout shuffles through shared memory),
    # so fewer warps per entry win: c = 512 at 2 warps 17.7 / 47.8 us (8 warps: 21.7 / 59.7), the
    # indexer's c = 128 at 1 warp 8.5 / 19.2 us (4 warps: 14.3 / 41.2)
    nw = num_warps or ((2 if c >= 512 else 1) if use_fused else 4)
    interp = interpreting()
    kw = {} if interp else {"num_warps": nw, "enable_fp_fusion": False}
    if not interp and use_fused and c == 128 and nw == 1:
        # 64 registers (72 uncapped): 32 one-warp programs per SM, 4096 entries (T = 16384) in one wave;
        # H200: 14.5 -> 13.6 us at T = 16384, 6.4 / 6.5 us at 4096
        kw["maxnreg"] = 64
    w = _norm_weight(norm_w)
    cnt = arrival_counters(dev, n) if CB != c else out        # per-entry arrivals of the channel blocks
    _pref_pool[(n, c // CB)](rows_k, rows_s, pooled, w, cos, sin, out, pg, ps_t, cnt, int(base), int(first),
                             rows_k.stride(0), rows_s.stride(0), pooled.stride(0), out.stride(0), page_size, pnb,
                             eps, M=ratio, C=c, OVERLAP=ratio == 4, CB=CB, POST=True, INDEXER=indexer,
                             WRITE=write, STORE_POOLED=return_pooled or CB != c, FAST=not interp, **kw, **PDL_LAUNCH)
    return (out, pooled) if return_pooled else out


__all__ = ["compress_decode", "compress_prefill"]
