"""Warp-specialized sparse prefill attention (Gluon, sm_90), ``sparse_attention.sparse_prefill``'s route on sm_90
when ``sparse_attention.WS_PREFILL`` is on (off until timed against the Triton kernel in the product's form).

``sparse_prefill``'s contract (module doc of ``sparse_attention``) for H a multiple of 64 and a window list, one CTA
per (64-head block, query row), three partitions (design: docs/design-sparse-prefill.md):

* producer (4 warps): per block of 64 list entries the row's window / extra indices, then the entries into a
  ``STAGES``-deep ring of bf16 [64 entries, 512] tiles shared by both consumers: with ``kv_bf16`` (the route's
  form) ``cp.async`` copies of bf16 workspace rows (the entries dequantised once per chunk, vLLM's prefill form), no
  data in registers; else each entry's 448 e4m3 bytes times its 64-dim blocks' 2^(scale byte - 127) and its 64 bf16
  rope dims, dequantised in registers (q's rows too in the first form, ``Q_CONSUMERS`` False);
* two consumer warpgroups, one per half of the 512 dims: each loads its half of q, computes q . k over its 256 dims,
  hands its partial S to the other through shared memory and adds the two in one order (half 0's first), so both
  hold the same S, running max, probabilities and denominator; it masks invalid entries, runs the online softmax
  (running max per block, P rounded to bf16, fp32 denominator) and accumulates P V over its 256 dims with P as
  wgmma's register operand; the sink enters the final denominator, an all-masked row writes 0; ``rope``: the
  output's rope dims rotated back in the epilogue.

``q_norm_eps``: q's transform (kv_insert's) runs as kv_insert's q pass before the kernel (``Q_PASS``; in the
consumers it costs ~750 us at H64 / s_q 4096, serial per CTA). Per block 4.2M MACs, FlashMLA's count (its ping-pong
exchanges P and the maxima instead of S). ``SPLIT_QK`` False: each consumer computes the block's full S itself (6.3M
MACs, no exchange). S = S_0 + S_1 sums the 512 products in another order than one 512-long chain: the Triton
kernel's bits are not expected, its tolerance is. Tests: ``tests/test_sparse_prefill_ws.py``; timing:
``experiments/exp_sparse_prefill_ws.py``.
"""
from __future__ import annotations

import torch

from ..formats.contracts import check_sparse_workspaces
from ..formats.kv_entry import page_bytes
from . import triton_available
from .gemm.fp4_fp8_ws import available as _hopper_gluon
from .lib import PDL_LAUNCH

HEAD_DIM = 512
BH = 64             # heads per CTA (the wgmma M)
BN = 64             # list entries per block
LOG2E = 1.4426950408889634

try:
    if not triton_available():
        raise ImportError
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    GLUON = True
except ImportError:
    GLUON = False

if GLUON:
    from .lib import pdl_wait
    # cp.async into shared memory: ``async_load`` from Triton 3.7 on (the old name raises there), the old name in 3.6
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    _BH = gl.constexpr(BH)
    _BN = gl.constexpr(BN)
    _D = gl.constexpr(HEAD_DIM)

    @gluon.jit
    def _rne(x):
        """fp32 -> the fp32 value of its bf16 round-to-nearest-even (``lib.rne_bf16``), on the bits."""
        b = x.to(gl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.to(gl.float32, bitcast=True)

    @gluon.jit
    def _rotate(x, partner, c, s, odd):
        """One element of ``lib.rotate_pairs`` given its pair partner: x c - p s at even dims, x c + p s at odd
        (the same products and sums, rounded separately where the launch disables FMA contraction)."""
        ps = partner * s
        return x * c + gl.where(odd, ps, -ps)

    @gluon.jit
    def _load_idx(wrow, erow, j, KW, KT):
        """Entries j of the row's [window | extra] list (-1 past its end)."""
        iw = gl.load(wrow + j, mask=j < KW, other=-1)
        ie = gl.load(erow + (j - KW), mask=(j >= KW) & (j < KT), other=-1)
        return gl.where(j < KW, iw, ie)

    @gluon.jit
    def _lists(WIDX, EIDX, t64, stride_wt, stride_et, KW, KE):
        """Row t64's window / extra list pointers, its list length and its count of 64-entry blocks."""
        KT = KW + KE
        return WIDX + t64 * stride_wt, EIDX + t64 * stride_et, KT, gl.cdiv(KT, _BN)

    @gluon.jit
    def _entries(wrow, erow, j, KW, KT, WPAGES, EPAGES, w_psz, w_pbytes, e_psz, e_pbytes):
        """List entries j of the row: (valid, each entry's 576-byte row, its 8-byte scale word's pointer)."""
        idx = _load_idx(wrow, erow, j, KW, KT)
        valid = idx >= 0
        slot = gl.maximum(idx, 0)
        in_w = j < KW
        psz = gl.where(in_w, w_psz, e_psz)
        pnb = gl.where(in_w, w_pbytes, e_pbytes)
        page = slot // psz
        off = slot - page * psz
        base = gl.where(in_w, WPAGES, EPAGES) + page.to(gl.int64) * pnb
        return valid, base + off * 576, (base + psz * 576 + off * 8).to(gl.pointer_type(gl.int64))

    @gluon.jit
    def _producer(Q, WIDX, EIDX, WPAGES, EPAGES, COS, SIN, q_smem, k_smem, q_ready, ready, empty, t, h0, KW, KE,
                  stride_qt, stride_qh, stride_wt, stride_et, w_psz, w_pbytes, e_psz, e_pbytes, q_eps,
                  STAGES: gl.constexpr, QNORM: gl.constexpr, Q_CONSUMERS: gl.constexpr):
        l8: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[8, 4], warps_per_cta=[4, 1],
                                            order=[1, 0])
        l16: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                             order=[1, 0])
        t64 = t.to(gl.int64)
        # q rows [64 heads, 512] -> shared memory, once
        hq = h0 + gl.arange(0, 64, layout=gl.SliceLayout(1, l16))
        dq = gl.arange(0, 64, layout=gl.SliceLayout(0, l16))
        qb = Q + t64 * stride_qt + hq.to(gl.int64)[:, None] * stride_qh + dq[None, :]
        if Q_CONSUMERS:
            pass                # the consumers load (and transform) q
        elif QNORM:
            # kv_insert's q transform (sparse_prefill's QNORM): the bf16 op chain of the weightless head RMSNorm,
            # then RoPE on dims 448..511 (each element's pair partner loaded at dim ^ 1)
            ss = gl.zeros([64], gl.float32, gl.SliceLayout(1, l16))
            for c in gl.static_range(8):
                qc = gl.load(qb + 64 * c).to(gl.float32)
                ss += gl.sum(_rne(qc * qc), 1)
            ms = _rne(_rne(ss / 512.0) + q_eps)
            r = _rne(gl.div_rn(gl.full([64], 1.0, gl.float32, gl.SliceLayout(1, l16)), gl.sqrt_rn(ms)))[:, None]
            for c in gl.static_range(7):
                q_smem.slice(64 * c, 64, dim=1).store(_rne(gl.load(qb + 64 * c).to(gl.float32) * r).to(gl.bfloat16))
            qc = _rne(gl.load(qb + 448).to(gl.float32) * r)
            pq = Q + t64 * stride_qt + hq.to(gl.int64)[:, None] * stride_qh + 448 + (dq ^ 1)[None, :]
            partner = _rne(gl.load(pq).to(gl.float32) * r)
            cs = gl.load(COS + t64 * 32 + dq // 2)[None, :]
            sn = gl.load(SIN + t64 * 32 + dq // 2)[None, :]
            qr = _rne(_rotate(qc, partner, cs, sn, ((dq & 1) == 1)[None, :]))
            q_smem.slice(448, 64, dim=1).store(qr.to(gl.bfloat16))
        else:
            for c in gl.static_range(8):
                q_smem.slice(64 * c, 64, dim=1).store(gl.load(qb + 64 * c))
        if not Q_CONSUMERS:
            fence_async_shared()
            mbarrier.arrive(q_ready.index(0), count=1)
        n = gl.arange(0, _BN, layout=gl.SliceLayout(1, l8))
        d = gl.arange(0, 64, layout=gl.SliceLayout(0, l8))
        wrow, erow, KT, nb = _lists(WIDX, EIDX, t64, stride_wt, stride_et, KW, KE)
        for blk in range(nb):
            s = blk % STAGES
            mbarrier.wait(empty.index(s), ((blk // STAGES) & 1) ^ 1)      # fresh barriers: phase 1 done
            kt = k_smem.index(s)
            valid, row, sptr = _entries(wrow, erow, blk * _BN + n, KW, KT, WPAGES, EPAGES, w_psz, w_pbytes, e_psz,
                                        e_pbytes)
            scw = gl.load(sptr, mask=valid, other=0)
            for c in gl.static_range(7):       # the 448 e4m3 dims, 2^(byte - 127) per 64-dim block: exact in bf16
                sc = (((scw >> (8 * c)) & 0xFF).to(gl.int32) << 23).to(gl.float32, bitcast=True)
                x = gl.load(row[:, None] + (64 * c) + d[None, :], mask=valid[:, None], other=0)
                kv = x.to(gl.float8e4nv, bitcast=True).to(gl.float32) * sc[:, None]
                kt.slice(64 * c, 64, dim=1).store(kv.to(gl.bfloat16))
            row16 = gl.convert_layout(row, gl.SliceLayout(1, l16))
            v16 = gl.convert_layout(valid, gl.SliceLayout(1, l16))
            rp = (row16 + 448).to(gl.pointer_type(gl.bfloat16))
            kt.slice(448, 64, dim=1).store(gl.load(rp[:, None] + dq[None, :], mask=v16[:, None], other=0.0))
            fence_async_shared()
            mbarrier.arrive(ready.index(s), count=1)

    @gluon.jit
    def _producer_bf16(WIDX, EIDX, WKV, EKV, k_smem, ready, empty, t, KW, KE, stride_wt, stride_et,
                       STAGES: gl.constexpr):
        """BF16_KV: the entries are rows of dense bf16 [slots, 512] workspaces (the FP8 caches dequantised once
        per chunk, vLLM's and FlashMLA's prefill form): per block, ``cp.async`` copies of its 64 rows straight into
        the ring's tile (invalid entries zero-filled), no data in registers; each thread's copies arrive on
        ready[s] when they land (count: the 128 producer threads), so the producer runs up to STAGES blocks ahead.
        The consumers load q (``Q_CONSUMERS``)."""
        lc: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                            order=[1, 0])
        t64 = t.to(gl.int64)
        wrow, erow, KT, nb = _lists(WIDX, EIDX, t64, stride_wt, stride_et, KW, KE)
        n = gl.arange(0, _BN, layout=gl.SliceLayout(1, lc))
        d = gl.arange(0, 64, layout=gl.SliceLayout(0, lc))
        for blk in range(nb):
            s = blk % STAGES
            mbarrier.wait(empty.index(s), ((blk // STAGES) & 1) ^ 1)      # fresh barriers: phase 1 done
            j = blk * _BN + n
            idx = _load_idx(wrow, erow, j, KW, KT)
            valid = idx >= 0
            row = gl.where(j < KW, WKV, EKV) + gl.maximum(idx, 0).to(gl.int64) * 512
            row = gl.multiple_of(row, 16)     # 1024-byte rows (divisibility in bytes): 16-byte copies
            kt = k_smem.index(s)
            for c in gl.static_range(8):
                _cp_async(kt.slice(64 * c, 64, dim=1), row[:, None] + (64 * c) + d[None, :], mask=valid[:, None])
            async_copy.mbarrier_arrive(ready.index(s), increment_count=False)

    @gluon.jit
    def _q_half(Q, COS, SIN, q_smem, ss_x, q_ready, t64, h0, stride_qt, stride_qh, q_eps, HALF: gl.constexpr,
                QNORM: gl.constexpr):
        """Q_CONSUMERS: this consumer's 256 dims of q into shared memory (QNORM: kv_insert's q transform; half 0
        adds half 1's sum of squares to its own and hands back the rsqrt, through ss_x), then the
        consumer's own arrive / wait orders its stores before its wgmmas read them."""
        lq: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                            order=[1, 0])
        hq = h0 + gl.arange(0, 64, layout=gl.SliceLayout(1, lq))
        dq = gl.arange(0, 64, layout=gl.SliceLayout(0, lq))
        qb = Q + t64 * stride_qt + hq.to(gl.int64)[:, None] * stride_qh + (256 * HALF) + dq[None, :]
        if QNORM:
            ss = gl.zeros([64], gl.float32, gl.SliceLayout(1, lq))
            for c in gl.static_range(4):
                qc = gl.load(qb + 64 * c).to(gl.float32)
                ss += gl.sum(_rne(qc * qc), 1)
            # half 1 hands its partial sum to half 0 (barrier 1), which adds it to its own, computes r and hands
            # r back in the same 256 bytes (barrier 2): one 64-float buffer fits beside SX_PAD's padded rows
            if HALF == 1:
                ss_x.store(ss)
                mbarrier.arrive(q_ready.index(1), count=1)
                mbarrier.wait(q_ready.index(2), 0)
                r = ss_x.load(gl.SliceLayout(1, lq))[:, None]
            else:
                mbarrier.wait(q_ready.index(1), 0)
                ss = ss + ss_x.load(gl.SliceLayout(1, lq))
                ms = _rne(_rne(ss / 512.0) + q_eps)
                r1 = _rne(gl.div_rn(gl.full([64], 1.0, gl.float32, gl.SliceLayout(1, lq)), gl.sqrt_rn(ms)))
                ss_x.store(r1)
                mbarrier.arrive(q_ready.index(2), count=1)
                r = r1[:, None]
            for c in gl.static_range(4):
                qc = _rne(gl.load(qb + 64 * c).to(gl.float32) * r)
                if HALF == 1 and c == 3:        # dims 448..511: RoPE, each element's pair partner at dim ^ 1
                    partner = _rne(gl.load(qb + 192 + (dq ^ 1)[None, :] - dq[None, :]).to(gl.float32) * r)
                    cs = gl.load(COS + t64 * 32 + dq // 2)[None, :]
                    sn = gl.load(SIN + t64 * 32 + dq // 2)[None, :]
                    qc = _rne(_rotate(qc, partner, cs, sn, ((dq & 1) == 1)[None, :]))
                q_smem.slice(256 * HALF + 64 * c, 64, dim=1).store(qc.to(gl.bfloat16))
        else:
            for c in gl.static_range(4):
                q_smem.slice(256 * HALF + 64 * c, 64, dim=1).store(gl.load(qb + 64 * c))
        fence_async_shared()
        mbarrier.arrive(q_ready.index(3 + HALF), count=1)
        mbarrier.wait(q_ready.index(3 + HALF), 0)

    @gluon.jit
    def _consumer(WIDX, EIDX, SINK, O, COS, SIN, Q, q_all, k_smem, s_x, ss_x, q_ready, ready, empty, s_full, s_free,
                  t, h0, H, KW, KE, stride_qt, stride_qh, stride_ot, stride_oh, stride_wt, stride_et, qk_scale, q_eps,
                  STAGES: gl.constexpr, HALF: gl.constexpr, SPLIT_QK: gl.constexpr, ROPE: gl.constexpr,
                  QNORM: gl.constexpr, Q_CONSUMERS: gl.constexpr, BF16_KV: gl.constexpr = False):
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, _BN, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
        t64 = t.to(gl.int64)
        wrow, erow, KT, nb = _lists(WIDX, EIDX, t64, stride_wt, stride_et, KW, KE)
        n = gl.arange(0, _BN, layout=gl.SliceLayout(0, s_l))
        zero_s = gl.zeros([_BH, _BN], gl.float32, s_l)
        m_i = gl.full([_BH], float("-inf"), gl.float32, gl.SliceLayout(1, s_l))
        l_i = gl.zeros([_BH], gl.float32, gl.SliceLayout(1, s_l))
        acc = gl.zeros([_BH, 256], gl.float32, o_l)
        q_smem = q_all.index(0)
        if Q_CONSUMERS:
            _q_half(Q, COS, SIN, q_smem, ss_x, q_ready, t64, h0, stride_qt, stride_qh, q_eps, HALF, QNORM)
            if not SPLIT_QK:        # the full QK reads the other half too
                mbarrier.wait(q_ready.index(4 - HALF), 0)
        else:
            mbarrier.wait(q_ready.index(0), 0)
        for blk in range(nb):
            s = blk % STAGES
            mbarrier.wait(ready.index(s), (blk // STAGES) & 1)
            if BF16_KV:
                fence_async_shared()        # the producer's cp.async writes (generic proxy) before wgmma reads them
            # q and the tile through an index offset by blk // (KW + KE + 1), 0 (blk < nb <= KW + KE) but not for the
            # compiler: their addresses depend on the iteration, so the wgmma descriptors are rebuilt each block
            # instead of hoisted out of the loop (one stage, full QK: ~1.2 KB of spills)
            zero = blk // (KW + KE + 1)
            kt = k_smem.index(s + zero)
            q_smem = q_all.index(zero)
            if SPLIT_QK:
                # this consumer's 256 dims of q . k, the other's through shared memory, summed in one order (half
                # 0's partial first) by both: the same S in both consumers, each block's QK done once
                tok = warpgroup_mma(q_smem.slice(256 * HALF, 256, dim=1),
                                    kt.slice(256 * HALF, 256, dim=1).permute((1, 0)), zero_s, use_acc=False,
                                    is_async=True)
                mine = warpgroup_mma_wait(num_outstanding=0, deps=(tok,))
                mbarrier.wait(s_free.index(HALF), (blk & 1) ^ 1)         # the other read the last one
                s_x.index(HALF).store(mine)
                mbarrier.arrive(s_full.index(HALF), count=1)
                mbarrier.wait(s_full.index(1 - HALF), blk & 1)
                other = s_x.index(1 - HALF).load(s_l)
                mbarrier.arrive(s_free.index(1 - HALF), count=1)
                if HALF == 0:
                    sc = mine + other
                else:
                    sc = other + mine
            else:
                tok = warpgroup_mma(q_smem, kt.permute((1, 0)), zero_s, use_acc=False, is_async=True)
                sc = warpgroup_mma_wait(num_outstanding=0, deps=(tok,))
            # the list entries after the wait (L1 hits: the producer read them): fewer registers live across QK
            idx = _load_idx(wrow, erow, blk * _BN + n, KW, KT)
            sc = gl.where((idx >= 0)[None, :], sc * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(sc, 1))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(sc - m_safe[:, None])
            l_i = l_i * alpha + gl.sum(p, 1)
            pb = gl.convert_layout(p.to(gl.bfloat16), p_l)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
            v = kt.slice(256 * HALF, 256, dim=1)
            tok = warpgroup_mma(pb, v, acc, use_acc=True, is_async=True)
            acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(tok, v))
            mbarrier.arrive(empty.index(s), count=1)
            m_i = m_new
        h = h0 + gl.arange(0, _BH, layout=gl.SliceLayout(1, s_l))
        sink = gl.load(SINK + h) * 1.4426950408889634
        m_safe = gl.where(m_i == float("-inf"), 0.0, m_i)
        den = l_i + gl.exp2(sink - m_safe)
        ok = den > 0
        ho = h0 + gl.arange(0, _BH, layout=gl.SliceLayout(1, o_l))
        do = 256 * HALF + gl.arange(0, 256, layout=gl.SliceLayout(0, o_l))
        den_o = gl.convert_layout(gl.where(ok, den, 1.0), gl.SliceLayout(1, o_l))
        ok_o = gl.convert_layout(ok, gl.SliceLayout(1, o_l))
        o = _rne(gl.where(ok_o[:, None], acc / den_o[:, None], 0.0))
        if ROPE and HALF == 1:
            # sparse_prefill's ROPE: dims 448..511 rotated by -theta, rounded to bf16 again (inverse_rope's values);
            # the accumulator layout holds each pair in one thread: split / join move no data
            e, od = gl.split(gl.reshape(o, [_BH, 128, 2]))
            j = gl.arange(0, 128, layout=gl.SliceLayout(0, e.type.layout)) - 96
            rp = j >= 0
            c = gl.load(COS + t64 * 32 + j, mask=rp, other=1.0)[None, :]
            sn = -gl.load(SIN + t64 * 32 + j, mask=rp, other=0.0)[None, :]
            ye = gl.where(rp[None, :], _rne(e * c - od * sn), e)
            yo = gl.where(rp[None, :], _rne(e * sn + od * c), od)
            o = gl.convert_layout(gl.reshape(gl.join(ye, yo), [_BH, 256]), o_l)
        gl.store(O + t64 * stride_ot + ho.to(gl.int64)[:, None] * stride_oh + do[None, :], o.to(gl.bfloat16))

    @gluon.jit
    def _sparse_prefill_ws_kernel(Q, WIDX, EIDX, WPAGES, EPAGES, SINK, O, COS, SIN, H, KW, KE,
                                  stride_qt, stride_qh, stride_ot, stride_oh, stride_wt, stride_et,
                                  w_psz, w_pbytes, e_psz, e_pbytes, qk_scale, q_eps,
                                  STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                                  SPLIT_QK: gl.constexpr, ROPE: gl.constexpr = False, QNORM: gl.constexpr = False,
                                  SX_PAD: gl.constexpr = False, Q_CONSUMERS: gl.constexpr = False,
                                  BF16_KV: gl.constexpr = False):
        pdl_wait()
        hb = gl.program_id(0)
        t = gl.program_id(1)
        h0 = hb * _BH
        lay: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        q_all = gl.allocate_shared_memory(gl.bfloat16, [1, _BH, _D], lay)
        q_smem = q_all.index(0)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, _BN, _D], lay)
        # q_ready: 0 the producer's q (not Q_CONSUMERS); 1 half 1's sum of squares in ss_x, 2 half 0's r there; 3 + i
        # consumer i's q half
        q_ready = gl.allocate_shared_memory(gl.int64, [5, 1], mbarrier.MBarrierLayout())
        ss_x = gl.allocate_shared_memory(gl.float32, [_BH] if Q_CONSUMERS and QNORM else [2],
                                         gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        # SPLIT_QK: each consumer's partial S [64, 64] fp32 for the other (2 x 16 KB; one slot a consumer: its
        # s_full / s_free pair orders the writes and reads); else a placeholder
        # rows padded by 4 words (8 would not fit 227 KB): a warp's 64-bit accesses of the accumulator layout
        # (8 rows x 8 columns) then conflict 2-way, not 4-way as with 256-byte rows (ncu, H100)
        if SX_PAD and SPLIT_QK:
            s_x = gl.allocate_shared_memory(gl.float32, [2, _BH, _BN] if SPLIT_QK else [2, 1, 16],
                                            gl.PaddedSharedLayout.with_identity_for([[_BN, 4]], [_BH, _BN],
                                                                                     [1, 0]))
        else:
            s_x = gl.allocate_shared_memory(gl.float32, [2, _BH, _BN] if SPLIT_QK else [2, 1, 16],
                                            gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        s_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        s_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(5):
            mbarrier.init(q_ready.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(s_full.index(i), count=1)
            mbarrier.init(s_free.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=128 if BF16_KV else 1)   # BF16_KV: each producer thread's copies
            mbarrier.init(empty.index(i), count=2)      # one arrival per consumer
        if BF16_KV:
            gl.warp_specialize([
                (_consumer, (WIDX, EIDX, SINK, O, COS, SIN, Q, q_all, k_smem, s_x, ss_x, q_ready, ready, empty,
                             s_full, s_free, t, h0, H, KW, KE, stride_qt, stride_qh, stride_ot, stride_oh, stride_wt,
                             stride_et, qk_scale, q_eps, STAGES, 0, SPLIT_QK, ROPE, QNORM, True, True)),
                (_consumer, (WIDX, EIDX, SINK, O, COS, SIN, Q, q_all, k_smem, s_x, ss_x, q_ready, ready, empty,
                             s_full, s_free, t, h0, H, KW, KE, stride_qt, stride_qh, stride_ot, stride_oh, stride_wt,
                             stride_et, qk_scale, q_eps, STAGES, 1, SPLIT_QK, ROPE, QNORM, True, True)),
                (_producer_bf16, (WIDX, EIDX, WPAGES, EPAGES, k_smem, ready, empty, t, KW, KE, stride_wt, stride_et,
                                  STAGES)),
            ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_consumer, (WIDX, EIDX, SINK, O, COS, SIN, Q, q_all, k_smem, s_x, ss_x, q_ready, ready, empty,
                             s_full, s_free, t, h0, H, KW, KE, stride_qt, stride_qh, stride_ot, stride_oh, stride_wt,
                             stride_et, qk_scale, q_eps, STAGES, 0, SPLIT_QK, ROPE, QNORM, Q_CONSUMERS)),
                (_consumer, (WIDX, EIDX, SINK, O, COS, SIN, Q, q_all, k_smem, s_x, ss_x, q_ready, ready, empty,
                             s_full, s_free, t, h0, H, KW, KE, stride_qt, stride_qh, stride_ot, stride_oh, stride_wt,
                             stride_et, qk_scale, q_eps, STAGES, 1, SPLIT_QK, ROPE, QNORM, Q_CONSUMERS)),
                (_producer, (Q, WIDX, EIDX, WPAGES, EPAGES, COS, SIN, q_smem, k_smem, q_ready, ready, empty, t, h0,
                             KW, KE, stride_qt, stride_qh, stride_wt, stride_et, w_psz, w_pbytes, e_psz, e_pbytes,
                             q_eps, STAGES, QNORM, Q_CONSUMERS)),
            ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


# Consumer warpgroups at 224 registers (a 64 x 256 fp32 accumulator, S, P; Triton 3.6 gives the default partition
# 512 - the workers' - 8 = 216) and the producer's at 64; the launch (12 warps) at 65,536 / 384 -> 168. Shared memory:
# q 64 KB + STAGES x 64 KB of bf16 tiles + SPLIT_QK's 2 x 16 KB (2 stages: 224 KB of sm_90's 227). ptxas (sm_90a,
# Triton 3.6): 40 bytes of spills with SPLIT_QK (the consumers' wgmma descriptors rebuilt each block: see the loop).
# Q_PASS: with q_norm_eps, q's transform runs as kv_insert's q pass before the kernel (which then only rotates the
# output back); False: in the consumers (QNORM), measured ~750 us slower at H64 / s_q 4096 (serial per CTA)
DEFAULT_CONFIG = {"STAGES": 2, "CONSUMER_REGS": 224, "PRODUCER_REGS": 64, "maxnreg": 168, "SPLIT_QK": True,
                  "SX_PAD": True, "Q_CONSUMERS": True, "Q_PASS": True}


def available(dev) -> bool:
    """Whether this kernel can run on ``dev``: an sm_90 GPU with Gluon's Hopper and cp.async ops, not the
    interpreter."""
    return GLUON and _hopper_gluon(dev)


def sparse_prefill_ws(q: torch.Tensor, window_idx: torch.Tensor, window_pages: torch.Tensor, window_page_size: int,
                      extra_idx: torch.Tensor | None, extra_pages: torch.Tensor | None, extra_page_size: int,
                      sinks: torch.Tensor | None = None, scale: float = HEAD_DIM ** -0.5, config: dict | None = None,
                      out: torch.Tensor | None = None, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                      q_norm_eps: float | None = None,
                      kv_bf16: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
    """``sparse_prefill``'s arguments and result (H a multiple of 64, a window list), ``rope`` and ``q_norm_eps``
    included. ``kv_bf16`` = (window, extra) dense bf16 [slots, 512] workspaces (``formats.kv_entry.read_entries``)
    read instead of the pages: the lists' ids index their rows (the ``BF16_KV`` producer)."""
    cfg = dict(DEFAULT_CONFIG, **(config or {}))
    T, H, D = q.shape
    if D != HEAD_DIM or H % BH or q.stride(2) != 1:
        raise ValueError(f"sparse_prefill_ws: q [T, H, 512] with H % {BH} == 0 and a contiguous last dim, "
                         f"got {tuple(q.shape)}")
    if not available(q.device):
        raise ValueError("sparse_prefill_ws: needs an sm_90 GPU with Gluon's Hopper ops")
    if q_norm_eps is not None and rope is None:
        raise ValueError("sparse_prefill_ws: q_norm_eps needs rope=(cos, sin)")
    if q_norm_eps is not None and cfg.get("Q_PASS"):
        # kv_insert's q transform (the bits the kernel's QNORM computes, up to the squares' summation order) as its
        # own launch: a zero kv row a token, no slot written
        from .kv_insert import kv_insert
        pool = torch.zeros(1, page_bytes(16), dtype=torch.uint8, device=q.device)
        q, _ = kv_insert(q, torch.zeros(T, HEAD_DIM, dtype=torch.bfloat16, device=q.device), rope[0], rope[1], pool,
                         torch.full((T,), -1, dtype=torch.int64, device=q.device), 16, q_norm_eps)
        q_norm_eps = None
    if sinks is None:
        sinks = torch.full((H,), float("-inf"), dtype=torch.float32, device=q.device)
    cos, sin = (rope[0].contiguous(), rope[1].contiguous()) if rope is not None else (sinks, sinks)
    KW = window_idx.shape[1]
    if extra_idx is None or extra_idx.shape[1] == 0:
        extra_idx, extra_pages, extra_page_size, KE = window_idx, window_pages, window_page_size, 0
    else:
        KE = extra_idx.shape[1]
    window_idx, extra_idx = window_idx.contiguous(), extra_idx.contiguous()
    if kv_bf16 is not None:
        window_pages, extra_pages = check_sparse_workspaces(kv_bf16, window_idx, extra_idx if KE else None)
    out = torch.empty(T, H, HEAD_DIM, dtype=torch.bfloat16, device=q.device) if out is None else out
    if T == 0:
        return out
    _sparse_prefill_ws_kernel[(H // BH, T)](
        q, window_idx, extra_idx, window_pages, extra_pages, sinks.float(), out, cos, sin, H, KW, KE,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), window_idx.stride(0), extra_idx.stride(0),
        window_page_size, window_pages.shape[1], extra_page_size, extra_pages.shape[1], float(scale) * LOG2E,
        float(q_norm_eps or 0.0), STAGES=cfg["STAGES"], CONSUMER_REGS=cfg["CONSUMER_REGS"],
        PRODUCER_REGS=cfg["PRODUCER_REGS"], SPLIT_QK=bool(cfg["SPLIT_QK"]), ROPE=rope is not None,
        QNORM=q_norm_eps is not None, SX_PAD=bool(cfg.get("SX_PAD", False)),
        # the bf16 producer leaves q to the consumers
        Q_CONSUMERS=bool(cfg.get("Q_CONSUMERS", False) or kv_bf16 is not None), BF16_KV=kv_bf16 is not None,
        num_warps=4,
        maxnreg=cfg["maxnreg"],
        **({"enable_fp_fusion": False} if rope is not None and not cfg.get("FP_FUSION") else {}), **PDL_LAUNCH)
    return out


__all__ = ["BH", "DEFAULT_CONFIG", "available", "sparse_prefill_ws"]
