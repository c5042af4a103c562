"""Sparse attention over the FP8 paged KV caches (spec §4 step 5, §10.1), decode and prefill.

Every query row t (a decode token, or a prefill row) attends over its own index lists:
``window_idx[t]`` into the window cache and ``extra_idx[t]`` into the extra (compressed) cache, both
int32 global slot ids (``slot = page * B + offset``), ``-1`` = masked, each cache a ``uint8
[num_pages, page_bytes(B)]`` tensor of 584-byte ``MODEL1_FP8Sparse`` entries with its own page size.
The row's list is the concatenation ``[window | extra]``, as in the official index layout.

Math (the reference's ``sparse_attention``): ``z_j = (q . kv_j) * scale``; running max over blocks
of the list, the sink in the denominator only, probabilities rounded to bf16 before P.V, fp32
denominator, bf16 output, an all-masked row gives exactly 0 (never NaN).

Kernels:
* ``_sparse_fwd``: one program per (head block, split, query row). q ``[HB, 512]`` stays in
  registers/shared as 8 chunks of 64 dims; per block of ``BN`` list entries it gathers the FP8
  nope bytes (16-byte loads), the bf16 rope and the 8 scale bytes (one 8-byte load per entry),
  dequantises to bf16 in registers (``fp8 * 2^(byte-127)``, exact), and runs QK and PV as
  ``tl.dot`` per 64-dim chunk with an fp32 online softmax. No bf16 copy of the cache is made.
* split-K: the list is cut into ``num_splits`` contiguous ranges of blocks; each writes fp32
  partials (acc, max, denominator) and ``_combine`` merges them and adds the sink.
* prefill uses the same kernel without splits (many rows fill the machine).

Block size vs the official 64: the running max advances per ``BN`` entries (``BN = 64`` by
default, the official block; 32 when asked). Probabilities are rounded to bf16 relative to the
running max of their block; with another ``BN`` or with split-K (each split has its own max and
is rescaled in fp32 by the combine) only that bf16 rounding point of P differs from the
reference: the results agree to bf16 tolerance, not bit-for-bit. (At BN = 64, one split and a
window width that is a multiple of 64 the blocks are the reference's; under the CPU interpreter
the output then matches the twin to within 1 bf16 ulp in ~1e-4 of the elements: exp2 vs exp.)

Heads: H in {8, 64, 128} (any H works): 64 heads per program, padded (H = 8 -> a 16-row tile on
mma.sync; H = 128 -> two 64-head programs per row, each gathering the row's entries: the second
mostly from L2).

Performance on the H200: BENCHMARKS.md, docs/kernel-measurements.md.
"""
from __future__ import annotations

import torch

from ..formats.contracts import check_inverse_rope, check_sparse_attention, check_sparse_workspaces
from .lib import PDL_LAUNCH, Choice, Target, interpreting, target, triton_available

HEAD_DIM = 512
LAST_LAUNCH: dict = {}   # diagnostics: the last compiled kernels (n_regs, n_spills on a GPU)
LOG2E = 1.4426950408889634

if triton_available():
    import triton
    import triton.language as tl

    from .lib import pdl_wait, rne_bf16, rotate_pairs

    @triton.jit
    def _chunk(row, scw, valid, d, C: tl.constexpr, DT: tl.constexpr):
        """Dequantised dims [64C, 64C+64) of the gathered entries -> [BN, 64] of dtype DT."""
        if C < 7:
            sb = ((scw >> (8 * C)) & 0xFF).to(tl.int32)
            sc = (sb << 23).to(tl.float32, bitcast=True)        # 2^(byte-127), exact
            x = tl.load(row[:, None] + (C * 64) + d[None, :], mask=valid[:, None], other=0)
            k = x.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc[:, None]
        else:
            rp = (row + 448).to(tl.pointer_type(tl.bfloat16))
            k = tl.load(rp[:, None] + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        return k.to(DT)

    @triton.jit
    def _chunk_bf16(kr, valid, d, C: tl.constexpr, DT: tl.constexpr):
        """Dims [64C, 64C+64) of the listed workspace rows (BF16_KV) -> [BN, 64] of dtype DT (0 where invalid)."""
        return tl.load(kr[:, None] + (C * 64) + d[None, :], mask=valid[:, None], other=0.0).to(DT)

    @triton.jit
    def _load_idx(wrow, erow, j, KW, KT):
        """entries j of the row's [window | extra] list (-1 past its end)."""
        iw = tl.load(wrow + j, mask=j < KW, other=-1)
        ie = tl.load(erow + (j - KW), mask=(j >= KW) & (j < KT), other=-1)
        return tl.where(j < KW, iw, ie)

    @triton.jit
    def _rope_chunk(x, cos_ptr, sin_ptr, HB: tl.constexpr, INVERSE: tl.constexpr):
        """x fp32 [HB, 64] (dims 448..511 of each head: 32 interleaved pairs) rotated by theta (``INVERSE``:
        -theta, ``inverse_rope``'s): ``lib.rotate_pairs``' products and sums, rounded separately as the launch
        disables FMA contraction (``enable_fp_fusion=False``, as ``sparse_prefill`` launches with ``rope``)."""
        x0, x1 = tl.split(tl.reshape(x, [HB, 32, 2]))
        j = tl.arange(0, 32)
        sn = tl.load(sin_ptr + j)[None, :]
        if INVERSE:
            sn = -sn
        y0, y1 = rotate_pairs(x0, x1, tl.load(cos_ptr + j)[None, :], sn)
        return tl.reshape(tl.join(y0, y1), [HB, 64])

    @triton.jit
    def _q_norm_chunk(qb, c: tl.constexpr, hm, r, cos_ptr, sin_ptr, HB: tl.constexpr, DT: tl.constexpr):
        """Dims [64c, 64c + 64) of q after ``kv_insert``'s q transform, given r = the bf16 rsqrt of each head's
        mean square: the product rounded to bf16, then (c = 7, the rope dims) rotated by theta and rounded
        again."""
        x = rne_bf16(tl.load(qb + 64 * c, mask=hm[:, None], other=0.0).to(tl.float32) * r[:, None])
        if c == 7:
            x = rne_bf16(_rope_chunk(x, cos_ptr, sin_ptr, HB, False))
        return x.to(DT)

    @triton.jit(do_not_specialize=['KW', 'KE', 'stride_wt', 'stride_et', 'blocks_per_split'])
    def _sparse_fwd(Q, WIDX, EIDX, WPAGES, EPAGES, SINK, O, OP, MLP, COS, SIN,
                    H, KW, KE, stride_qt, stride_qh, stride_ot, stride_oh, stride_wt, stride_et,
                    w_psz, w_pbytes, e_psz, e_pbytes, blocks_per_split, qk_scale,
                    HB: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr,
                    DT: tl.constexpr, INTERP: tl.constexpr, DP: tl.constexpr = 1,
                    DHALF: tl.constexpr = 0, PREFETCH: tl.constexpr = False, ROPE: tl.constexpr = False,
                    QNORM: tl.constexpr = False, q_eps=1e-6, BF16_KV: tl.constexpr = False):
        # BF16_KV: WPAGES / EPAGES are dense bf16 [slots, 512] workspaces (the caches' entries dequantised once,
        # ``formats.kv_entry.read_entries``), a list's id its row: plain 16-byte gathers, no dequantisation per row.
        # DP = 2: this launch accumulates only output dims [256*DHALF, 256*DHALF + 256) (S is
        # computed in full by both halves): half the accumulator (registers on sm_90, tensor memory
        # on sm_100, whose 512 columns cannot hold a 64 x 512 fp32 accumulator plus S).
        # ROPE (no split): the bf16 output's last 64 dims rotated by -theta of the row's position (COS / SIN
        # fp32 [T, 32]) and rounded to bf16 again: ``inverse_rope``'s values, without its pass over o.
        # QNORM: Q is wq_b's raw output; the kernel applies ``kv_insert``'s q transform as it loads it (the
        # weightless head RMSNorm's bf16 op chain with q_eps, then RoPE by COS / SIN), without its pass over q.
        pdl_wait()
        hb = tl.program_id(0)
        sp = tl.program_id(1)
        t = tl.program_id(2)
        ns = tl.num_programs(1)
        h = hb * HB + tl.arange(0, HB)
        hm = h < H
        d = tl.arange(0, 64)
        t64 = t.to(tl.int64)
        qb = Q + t64 * stride_qt + h[:, None] * stride_qh + d[None, :]
        if QNORM:
            # pass 1: each head's sum of the bf16-rounded squares (chunk by chunk: few registers live); pass 2
            # re-reads q (L1 / L2) and normalises and rotates it: kv_insert's chain (mean, + eps, 1 / sqrt and
            # product each rounded to bf16; the squares' summation order is this kernel's)
            ss = tl.zeros([HB], tl.float32)
            for c in tl.static_range(8):
                x = tl.load(qb + 64 * c, mask=hm[:, None], other=0.0).to(tl.float32)
                ss += tl.sum(rne_bf16(x * x), 1)
            ms = rne_bf16(rne_bf16(ss / 512.0) + q_eps)
            r = rne_bf16(tl.math.div_rn(tl.full([HB], 1.0, tl.float32), tl.sqrt_rn(ms)))
            cq = COS + t64 * 32
            sq_ = SIN + t64 * 32
            q0 = _q_norm_chunk(qb, 0, hm, r, cq, sq_, HB, DT)
            q1 = _q_norm_chunk(qb, 1, hm, r, cq, sq_, HB, DT)
            q2 = _q_norm_chunk(qb, 2, hm, r, cq, sq_, HB, DT)
            q3 = _q_norm_chunk(qb, 3, hm, r, cq, sq_, HB, DT)
            q4 = _q_norm_chunk(qb, 4, hm, r, cq, sq_, HB, DT)
            q5 = _q_norm_chunk(qb, 5, hm, r, cq, sq_, HB, DT)
            q6 = _q_norm_chunk(qb, 6, hm, r, cq, sq_, HB, DT)
            q7 = _q_norm_chunk(qb, 7, hm, r, cq, sq_, HB, DT)
        else:
            q0 = tl.load(qb + 0, mask=hm[:, None], other=0.0).to(DT)
            q1 = tl.load(qb + 64, mask=hm[:, None], other=0.0).to(DT)
            q2 = tl.load(qb + 128, mask=hm[:, None], other=0.0).to(DT)
            q3 = tl.load(qb + 192, mask=hm[:, None], other=0.0).to(DT)
            q4 = tl.load(qb + 256, mask=hm[:, None], other=0.0).to(DT)
            q5 = tl.load(qb + 320, mask=hm[:, None], other=0.0).to(DT)
            q6 = tl.load(qb + 384, mask=hm[:, None], other=0.0).to(DT)
            q7 = tl.load(qb + 448, mask=hm[:, None], other=0.0).to(DT)
        KT = KW + KE
        nb = tl.cdiv(KT, BN)
        b0 = sp * blocks_per_split
        b1 = tl.minimum(b0 + blocks_per_split, nb)
        m_i = tl.full([HB], float("-inf"), tl.float32)
        l_i = tl.zeros([HB], tl.float32)
        acc0 = tl.zeros([HB, 64], tl.float32)
        acc1 = tl.zeros([HB, 64], tl.float32)
        acc2 = tl.zeros([HB, 64], tl.float32)
        acc3 = tl.zeros([HB, 64], tl.float32)
        acc4 = tl.zeros([HB, 64], tl.float32)
        acc5 = tl.zeros([HB, 64], tl.float32)
        acc6 = tl.zeros([HB, 64], tl.float32)
        acc7 = tl.zeros([HB, 64], tl.float32)
        n = tl.arange(0, BN)
        wrow = WIDX + t64 * stride_wt
        erow = EIDX + t64 * stride_et
        if PREFETCH:
            idx_nx = _load_idx(wrow, erow, b0 * BN + n, KW, KT)
        for blk in range(b0, b1):
            j = blk * BN + n
            in_w = j < KW
            if PREFETCH:   # this block's list was loaded one iteration ahead
                idx = idx_nx
                idx_nx = _load_idx(wrow, erow, j + BN, KW, KT)
            else:
                idx = _load_idx(wrow, erow, j, KW, KT)
            valid = idx >= 0
            slot = tl.maximum(idx, 0)
            if BF16_KV:
                kr = tl.where(in_w, WPAGES, EPAGES) + slot.to(tl.int64) * 512
                k0 = _chunk_bf16(kr, valid, d, 0, DT)
                k1 = _chunk_bf16(kr, valid, d, 1, DT)
                k2 = _chunk_bf16(kr, valid, d, 2, DT)
                k3 = _chunk_bf16(kr, valid, d, 3, DT)
                k4 = _chunk_bf16(kr, valid, d, 4, DT)
                k5 = _chunk_bf16(kr, valid, d, 5, DT)
                k6 = _chunk_bf16(kr, valid, d, 6, DT)
                k7 = _chunk_bf16(kr, valid, d, 7, DT)
            else:
                psz = tl.where(in_w, w_psz, e_psz)
                pnb = tl.where(in_w, w_pbytes, e_pbytes)
                page = slot // psz
                off = slot - page * psz
                base = tl.where(in_w, WPAGES, EPAGES) + page.to(tl.int64) * pnb
                row = base + off * 576
                sptr = (base + psz * 576 + off * 8).to(tl.pointer_type(tl.int64))
                scw = tl.load(sptr, mask=valid, other=0)
                k0 = _chunk(row, scw, valid, d, 0, DT)
                k1 = _chunk(row, scw, valid, d, 1, DT)
                k2 = _chunk(row, scw, valid, d, 2, DT)
                k3 = _chunk(row, scw, valid, d, 3, DT)
                k4 = _chunk(row, scw, valid, d, 4, DT)
                k5 = _chunk(row, scw, valid, d, 5, DT)
                k6 = _chunk(row, scw, valid, d, 6, DT)
                k7 = _chunk(row, scw, valid, d, 7, DT)
            s = tl.dot(q0, tl.trans(k0))
            s = tl.dot(q1, tl.trans(k1), s)
            s = tl.dot(q2, tl.trans(k2), s)
            s = tl.dot(q3, tl.trans(k3), s)
            s = tl.dot(q4, tl.trans(k4), s)
            s = tl.dot(q5, tl.trans(k5), s)
            s = tl.dot(q6, tl.trans(k6), s)
            s = tl.dot(q7, tl.trans(k7), s)
            s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if INTERP:
                pb = rne_bf16(p)
            else:
                pb = p.to(DT)
            a2 = alpha[:, None]
            if DP == 1:
                acc0 = tl.dot(pb, k0, acc0 * a2)
                acc1 = tl.dot(pb, k1, acc1 * a2)
                acc2 = tl.dot(pb, k2, acc2 * a2)
                acc3 = tl.dot(pb, k3, acc3 * a2)
                acc4 = tl.dot(pb, k4, acc4 * a2)
                acc5 = tl.dot(pb, k5, acc5 * a2)
                acc6 = tl.dot(pb, k6, acc6 * a2)
                acc7 = tl.dot(pb, k7, acc7 * a2)
            elif DHALF == 0:
                acc0 = tl.dot(pb, k0, acc0 * a2)
                acc1 = tl.dot(pb, k1, acc1 * a2)
                acc2 = tl.dot(pb, k2, acc2 * a2)
                acc3 = tl.dot(pb, k3, acc3 * a2)
            else:
                acc0 = tl.dot(pb, k4, acc0 * a2)
                acc1 = tl.dot(pb, k5, acc1 * a2)
                acc2 = tl.dot(pb, k6, acc2 * a2)
                acc3 = tl.dot(pb, k7, acc3 * a2)
            m_i = m_new
        if SPLIT:
            # partials: OP [T, NS, H, 512] fp32, MLP [T, NS, 2, H] fp32
            pbase = (t64 * ns + sp) * H
            ob = OP + (pbase + h[:, None]) * 512 + (DHALF * 256) + d[None, :]
            om = hm[:, None]
            tl.store(ob + 0, acc0, mask=om)
            tl.store(ob + 64, acc1, mask=om)
            tl.store(ob + 128, acc2, mask=om)
            tl.store(ob + 192, acc3, mask=om)
            if DP == 1:
                tl.store(ob + 256, acc4, mask=om)
                tl.store(ob + 320, acc5, mask=om)
                tl.store(ob + 384, acc6, mask=om)
                tl.store(ob + 448, acc7, mask=om)
            if DHALF == 0:
                tl.store(MLP + pbase * 2 + h, m_i, mask=hm)
                tl.store(MLP + pbase * 2 + H + h, l_i, mask=hm)
        else:
            sink = tl.load(SINK + h, mask=hm, other=0.0) * 1.4426950408889634
            m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
            den = l_i + tl.exp2(sink - m_safe)
            ok = den > 0
            den = tl.where(ok, den, 1.0)[:, None]
            okc = ok[:, None]
            ob = O + t64 * stride_ot + h[:, None] * stride_oh + (DHALF * 256) + d[None, :]
            om = hm[:, None]
            ty = O.dtype.element_ty
            tl.store(ob + 0, rne_bf16(tl.where(okc, acc0 / den, 0.0)).to(ty), mask=om)
            tl.store(ob + 64, rne_bf16(tl.where(okc, acc1 / den, 0.0)).to(ty), mask=om)
            tl.store(ob + 128, rne_bf16(tl.where(okc, acc2 / den, 0.0)).to(ty), mask=om)
            if DP == 1:
                tl.store(ob + 192, rne_bf16(tl.where(okc, acc3 / den, 0.0)).to(ty), mask=om)
                tl.store(ob + 256, rne_bf16(tl.where(okc, acc4 / den, 0.0)).to(ty), mask=om)
                tl.store(ob + 320, rne_bf16(tl.where(okc, acc5 / den, 0.0)).to(ty), mask=om)
                tl.store(ob + 384, rne_bf16(tl.where(okc, acc6 / den, 0.0)).to(ty), mask=om)
                last = rne_bf16(tl.where(okc, acc7 / den, 0.0))
            else:
                last = rne_bf16(tl.where(okc, acc3 / den, 0.0))
            if ROPE and (DP == 1 or DHALF == 1):
                last = rne_bf16(_rope_chunk(last, COS + t64 * 32, SIN + t64 * 32, HB, True))
            if DP == 1:
                tl.store(ob + 448, last.to(ty), mask=om)
            else:
                tl.store(ob + 192, last.to(ty), mask=om)

    @triton.jit
    def _combine(OP, MLP, SINK, O, COS, SIN, H, NS, stride_ot, stride_oh, HB: tl.constexpr,
                 ROPE: tl.constexpr = False):
        """The splits' partials -> o (``_sparse_fwd``'s unsplit epilogue: sink in the denominator, an all-masked row
        0, bf16). ROPE: dims 448..511 of each head accumulated apart (the same weights, the same order: the same
        sums) and rotated back after their bf16 rounding (``inverse_rope``'s values; the launch disables FMA
        contraction)."""
        pdl_wait()
        hb = tl.program_id(0)
        t = tl.program_id(1)
        t64 = t.to(tl.int64)
        h = hb * HB + tl.arange(0, HB)
        hm = h < H
        d = tl.arange(0, 512)
        dr = 448 + tl.arange(0, 64)
        M = tl.full([HB], float("-inf"), tl.float32)
        for s in range(NS):
            m_s = tl.load(MLP + (t64 * NS + s) * 2 * H + h, mask=hm, other=float("-inf"))
            M = tl.maximum(M, m_s)
        M_safe = tl.where(M == float("-inf"), 0.0, M)
        L = tl.zeros([HB], tl.float32)
        acc = tl.zeros([HB, 512], tl.float32)
        accr = tl.zeros([HB, 64], tl.float32)
        for s in range(NS):
            pb = (t64 * NS + s) * H
            m_s = tl.load(MLP + pb * 2 + h, mask=hm, other=float("-inf"))
            l_s = tl.load(MLP + pb * 2 + H + h, mask=hm, other=0.0)
            w = tl.exp2(m_s - M_safe)
            L += w * l_s
            a = tl.load(OP + (pb + h[:, None]) * 512 + d[None, :], mask=hm[:, None], other=0.0)
            acc += w[:, None] * a
            if ROPE:
                ar = tl.load(OP + (pb + h[:, None]) * 512 + dr[None, :], mask=hm[:, None], other=0.0)
                accr += w[:, None] * ar
        sink = tl.load(SINK + h, mask=hm, other=0.0) * 1.4426950408889634
        den = L + tl.exp2(sink - M_safe)
        ok = den > 0
        den = tl.where(ok, den, 1.0)[:, None]
        o = tl.where(ok[:, None], acc / den, 0.0)
        ob = O + t64 * stride_ot + h[:, None] * stride_oh
        if ROPE:
            tl.store(ob + d[None, :], rne_bf16(o).to(O.dtype.element_ty), mask=hm[:, None] & (d < 448)[None, :])
            last = rne_bf16(tl.where(ok[:, None], accr / den, 0.0))
            last = rne_bf16(_rope_chunk(last, COS + t64 * 32, SIN + t64 * 32, HB, True))
            tl.store(ob + dr[None, :], last.to(O.dtype.element_ty), mask=hm[:, None])
        else:
            tl.store(ob + d[None, :], rne_bf16(o).to(O.dtype.element_ty), mask=hm[:, None])


def default_config(H: int, capability: tuple[int, int] = (9, 0)) -> dict:
    """The attention router: launch parameters by local heads and target. Heads per program 16 / 32 /
    64 (padded), 64 list entries per block (the official block), 8 warps for 64 heads, 1 stage, no
    index prefetch: the in-run sweep of ``benchmarks/attention.py`` on the H200 (BENCHMARKS.md
    "Sparse decode, FP8 cache": num_stages=2 and prefetch measured slower). Output-dim parts: 2 from
    sm_100 on (tensor memory holds 512 fp32 columns, too few for a 64 x 512 accumulator plus S:
    Triton then emits a kernel that only traps). The split count (``_run``) fills the SMs."""
    hb = 16 if H <= 16 else (32 if H <= 32 else 64)
    cfg = {"block_h": hb, "block_n": 64, "num_warps": 8 if hb == 64 else 4, "num_stages": 1,
           "d_parts": 1, "prefetch": False}
    if tuple(capability) >= (10, 0) and hb >= 64:
        cfg["d_parts"] = 2
    return cfg


def choices(t: Target) -> list[Choice]:
    """Every attention kernel configuration ``default_config`` picks on ``t`` for V4's local head counts
    (Flash 64 and Pro 128 heads over 1-8 tensor-parallel ranks), decode (split) and prefill."""
    out = []
    for H in (8, 16, 32, 64, 128):
        cfg = default_config(H, t.capability)
        for split in (True, False):
            out.append(Choice.of("sparse_fwd", dict(HB=cfg["block_h"], BN=cfg["block_n"], SPLIT=split,
                                                    DP=cfg["d_parts"], PREFETCH=cfg["prefetch"]), cfg, f"H={H}"))
    out.append(Choice("sparse_combine", (("HB", 8),), 4, None, "split-K combine"))
    return list(dict.fromkeys(out))


def _check_args(q, window_idx, window_pages, window_page_size, extra_idx, extra_pages, extra_page_size, sinks,
                rope, q_norm_eps, kv_bf16):
    """The contract checks of every launch (this module's kernel and the Gluon route) -> the (window, extra)
    tensors the kernel reads: the pages, or the workspaces in their places (same lists: an id is a row)."""
    check_sparse_attention(q, window_idx, extra_idx, window_pages, extra_pages, sinks, window_page_size,
                           extra_page_size)
    if rope is not None:
        check_inverse_rope(q, *rope)
    if q_norm_eps is not None and rope is None:
        raise ValueError("sparse attention: q_norm_eps (q's RMSNorm + RoPE in the kernel) needs rope=(cos, sin)")
    if kv_bf16 is None:
        return window_pages, extra_pages
    return check_sparse_workspaces(kv_bf16, window_idx, extra_idx)


def _run(q, window_idx, window_pages, window_page_size, extra_idx, extra_pages, extra_page_size,
         sinks, scale, num_splits, config, out, rope=None, q_norm_eps=None, kv_bf16=None):
    window_pages, extra_pages = _check_args(q, window_idx, window_pages, window_page_size, extra_idx, extra_pages,
                                            extra_page_size, sinks, rope, q_norm_eps, kv_bf16)
    T, H, _ = q.shape
    dev = q.device
    if q.stride(2) != 1:
        raise ValueError("q needs a contiguous last dim")
    if window_idx is None and extra_idx is None:
        raise ValueError("need at least one of window_idx / extra_idx")
    if window_idx is None:
        window_idx = torch.full((T, 1), -1, dtype=torch.int32, device=dev)
        window_pages, window_page_size = extra_pages, extra_page_size
        KW = 0
    else:
        KW = window_idx.shape[1]
    if extra_idx is None or extra_idx.shape[1] == 0:
        extra_idx, extra_pages, extra_page_size = window_idx, window_pages, window_page_size
        KE = 0
    else:
        KE = extra_idx.shape[1]
    window_idx = window_idx if window_idx.stride(1) == 1 else window_idx.contiguous()
    extra_idx = extra_idx if extra_idx.stride(1) == 1 else extra_idx.contiguous()
    out = torch.empty(T, H, HEAD_DIM, dtype=torch.bfloat16, device=dev) if out is None else out
    if T == 0:
        return out
    t = target(dev)
    sm_count, cap = t.sm_count, t.capability
    cfg = dict(default_config(H, cap))
    cfg.update(config or {})
    HB, BN = cfg["block_h"], cfg["block_n"]
    n_hb = triton.cdiv(H, HB)
    nb = max(1, triton.cdiv(KW + KE, BN))
    if num_splits is None:
        progs = T * n_hb * cfg.get("d_parts", 1)
        # fill the machine (one 64-head program per SM: registers and shared memory), at least
        # one block per split; partials are small next to the gathered entries at small batch
        num_splits = max(1, min(triton.cdiv(sm_count, progs), nb))
    num_splits = max(1, min(num_splits, nb))
    bps = triton.cdiv(nb, num_splits)
    num_splits = triton.cdiv(nb, bps)
    interp = interpreting()
    dt = tl.float32 if interp else tl.bfloat16
    kw = {} if interp else {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    split = num_splits > 1
    LAST_LAUNCH["num_splits"] = num_splits
    if split:
        op = torch.empty(T, num_splits, H, HEAD_DIM, dtype=torch.float32, device=dev)
        mlp = torch.empty(T, num_splits, 2, H, dtype=torch.float32, device=dev)
    else:
        op = mlp = sinks  # unused
    dp = cfg.get("d_parts", 1)
    if cfg.get("ptx_options") and not interp:
        kw["ptx_options"] = cfg["ptx_options"]
    # ``rope``: the rotation in the unsplit kernel's epilogue, else in the combine's; that launch's products and sums
    # rounded separately (inverse_rope's)
    no_fma = {} if interp else {"enable_fp_fusion": False}
    if rope is not None and not split:
        kw.update(no_fma)
    cos, sin = (rope[0].contiguous(), rope[1].contiguous()) if rope is not None else (sinks, sinks)
    for dhalf in range(dp):
        LAST_LAUNCH["fwd"] = _sparse_fwd[(n_hb, num_splits, T)](
            q, window_idx, extra_idx, window_pages, extra_pages, sinks, out, op, mlp, cos, sin,
            H, KW, KE, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            window_idx.stride(0), extra_idx.stride(0),
            window_page_size, window_pages.shape[1], extra_page_size, extra_pages.shape[1],
            bps, float(scale) * LOG2E,
            HB=HB, BN=BN, SPLIT=split, DT=dt, INTERP=interp, DP=dp, DHALF=dhalf,
            PREFETCH=bool(cfg.get("prefetch", False)), ROPE=rope is not None and not split,
            QNORM=q_norm_eps is not None, q_eps=float(q_norm_eps or 0.0), BF16_KV=kv_bf16 is not None, **kw,
            **PDL_LAUNCH)
    if split:
        hbc = 8 if H >= 8 else 4
        LAST_LAUNCH["combine"] = _combine[(triton.cdiv(H, hbc), T)](
            op, mlp, sinks, out, cos, sin, H, num_splits, out.stride(0), out.stride(1), HB=hbc, ROPE=rope is not None,
            **({} if interp else {"num_warps": 4}), **(no_fma if rope is not None else {}), **PDL_LAUNCH)
    return out


def sparse_decode(q: torch.Tensor, window_idx: torch.Tensor | None, window_pages: torch.Tensor | None,
                  window_page_size: int, extra_idx: torch.Tensor | None = None,
                  extra_pages: torch.Tensor | None = None, extra_page_size: int = 64,
                  sinks: torch.Tensor | None = None, scale: float = HEAD_DIM ** -0.5,
                  num_splits: int | None = None, config: dict | None = None,
                  out: torch.Tensor | None = None,
                  rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Sparse decode attention (split-K + combine). q bf16 [T, H, 512] (T = query tokens, 1 or 2
    per sequence); window_idx / extra_idx int32 [T, K] global slot ids (-1 masked) into
    window_pages / extra_pages (uint8 [num_pages, page_bytes(B)]); sinks fp32 [H]. -> bf16 [T, H, 512].
    ``num_splits=None`` picks a split count that fills the GPU. ``rope=(cos, sin)`` (fp32 [T, 32]): the
    output's last 64 dims of every head come out rotated by -theta, ``inverse_rope``'s values (in the
    combine's epilogue, or the kernel's with one split)."""
    if sinks is None:
        sinks = torch.full((q.shape[1],), float("-inf"), dtype=torch.float32, device=q.device)
    return _run(q, window_idx, window_pages, window_page_size, extra_idx, extra_pages, extra_page_size,
                sinks, scale, num_splits, config, out, rope)


def sparse_prefill(q: torch.Tensor, window_idx: torch.Tensor | None, window_pages: torch.Tensor | None,
                   window_page_size: int, extra_idx: torch.Tensor | None = None,
                   extra_pages: torch.Tensor | None = None, extra_page_size: int = 64,
                   sinks: torch.Tensor | None = None, scale: float = HEAD_DIM ** -0.5,
                   config: dict | None = None, out: torch.Tensor | None = None,
                   rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                   q_norm_eps: float | None = None,
                   kv_bf16: tuple[torch.Tensor | None, torch.Tensor | None] | None = None) -> torch.Tensor:
    """Sparse prefill attention: many query rows, each with its own index lists over the same two
    caches; gather + FP8 dequant fused in the kernel, no split-K. Same arguments as sparse_decode;
    ``kv_bf16=(window, extra)``: dense bf16 [rows, 512] workspaces of dequantised entries
    (``formats.kv_entry.read_entries``), a list's id a row, read instead of the pages (then only checked);
    ``rope=(cos, sin)`` (fp32 [T, 32] of each row's position): the output's last 64 dims of every head
    come out rotated by -theta, ``inverse_rope``'s values in o's shape (the layer skips that pass).
    ``q_norm_eps`` (needs ``rope``): q is wq_b's raw output and the kernel applies ``kv_insert``'s q
    transform to it (head RMSNorm with that eps, RoPE by theta) as it loads it (the layer then inserts
    only kv)."""
    if sinks is None:
        sinks = torch.full((q.shape[1],), float("-inf"), dtype=torch.float32, device=q.device)
    if _ws_route(q, window_idx, kv_bf16, config):
        _check_args(q, window_idx, window_pages, window_page_size, extra_idx, extra_pages, extra_page_size, sinks,
                    rope, q_norm_eps, kv_bf16)
        from .sparse_prefill_ws import sparse_prefill_ws
        return sparse_prefill_ws(q, window_idx, window_pages, window_page_size, extra_idx, extra_pages,
                                 extra_page_size, sinks, scale, out=out, rope=rope, q_norm_eps=q_norm_eps,
                                 kv_bf16=kv_bf16)
    return _run(q, window_idx, window_pages, window_page_size, extra_idx, extra_pages, extra_page_size,
                sinks, scale, 1, config, out, rope, q_norm_eps, kv_bf16)


# sparse_prefill's route to the warp-specialized Gluon kernel (``sparse_prefill_ws``) on sm_90: off until it is
# timed against this module's kernel in the product's form (docs/design-sparse-prefill.md, "Routing plan")
WS_PREFILL = False


def _ws_route(q, window_idx, kv_bf16, config) -> bool:
    """The Gluon route: on, an sm_90 GPU with Gluon, workspaces given (its producer copies bf16 rows), a window list,
    a multiple of 64 heads, no explicit Triton config (a caller that passes one asks for this module's kernel)."""
    if not WS_PREFILL or kv_bf16 is None or config is not None or window_idx is None or interpreting():
        return False
    if q.device.type != "cuda" or q.shape[1] % 64 or q.stride(2) != 1:
        return False
    from .sparse_prefill_ws import available
    return available(q.device)


__all__ = ["choices", "default_config", "sparse_decode", "sparse_prefill"]
