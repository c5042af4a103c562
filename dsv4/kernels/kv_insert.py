"""Fused q/kv attention prologue + paged FP8 KV-cache insert (spec §4 steps 1-2, §4.1, §10.1).

One launch over all tokens of a mixed batch (prefill chunks and decode tokens alike):

* q ``[T, H, 512]`` bf16 (the wq_b output): per-head weightless RMSNorm with the official bf16
  numerics (square, mean, +eps, rsqrt and product each rounded to bf16), then RoPE on dims 448..511;
* kv ``[T, 512]`` bf16 (already kv_norm'ed): RoPE on dims 448..511, FP8 e4m3 QDQ of dims 0..447 in
  64-blocks with UE8M0 scales, and the 584-byte ``MODEL1_FP8Sparse`` entry written into the paged
  cache ``uint8 [num_pages, page_bytes(B)]`` at ``slot_mapping`` (int64, ``-1`` = do not write).

Returns ``(q_out, kv_out)``: q normalised and rotated (bf16), and the kv row exactly as written
(QDQ'd nope ‖ rotated rope, bf16) for callers that attend over it in the same step.

Numerics (what the tests hold the kernel to):
* RoPE is ``y0 = x0*cos - x1*sin, y1 = x0*sin + x1*cos`` in fp32 with every product and sum rounded
  separately (launched with ``enable_fp_fusion=False``), which is bit-for-bit what the reference's
  complex64 multiply gives on the CPU; cos/sin are the caller's fp32 tables ``[T, 32]``.
* FP8: amax floor 1e-4, ``scale = 2^ceil(log2(amax * fp32(1/448)))`` read off the fp32 exponent
  bits (exact), values ``x * 2^-e`` clamped to ±448 and rounded to e4m3 nearest-even in integer
  arithmetic (exact on GPU and under the interpreter): ``kv_out`` is ``fp8_qdq`` of the rotated
  row bit-for-bit. The bytes written are ``encode_kv_entries(kv_out)`` bit-for-bit: the scale byte
  is re-derived from the QDQ'd block (rounding can lower a block max below a power of two, e.g.
  7.0625 -> 7.0; a single-pass quantiser would then store twice the scale and codes one binade
  lower; both decode to the same values).
* head RMSNorm: every bf16 rounding of the official bf16 op chain is done explicitly
  (round-to-nearest-even on the fp32 bits) and rsqrt is ``1 / sqrt`` with IEEE sqrt and division.
  The only difference left is the summation order of the 512 squares (a tree here, torch's own
  order in the reference), which can move the bf16 mean by one ulp: q then differs from the
  reference by at most 1 bf16 ulp (in practice: a handful of heads in thousands).
"""
from __future__ import annotations

import torch

from ..formats.kv_entry import (ENTRY_BYTES, KV_DIM, NOPE_DIM, ROPE_DIM, TOKEN_DATA_BYTES,
                                page_bytes, write_kv_entries)
from . import triton_available, interpreting

HEAD_DIM = KV_DIM  # 512

if triton_available():
    import triton
    import triton.language as tl

    NOPE_DIM_C = tl.constexpr(NOPE_DIM)

    @triton.jit
    def _rne_bf16(x):
        """fp32 -> the fp32 value of its bf16 round-to-nearest-even (finite inputs). Written on the
        bits so that the GPU and the CPU interpreter (whose bf16 cast truncates) agree."""
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True)

    @triton.jit
    def _e4m3_bits(v):
        """fp32 v (|v| <= 448, finite) -> e4m3fn byte (int32) with round-to-nearest-even, in integer
        arithmetic: the same bytes as ``torch.float8_e4m3fn`` casts and the GPU's cvt.rn.satfinite,
        and also right under the CPU interpreter (whose fp8 cast mis-rounds exponent carries)."""
        b = v.to(tl.uint32, bitcast=True)
        sign = ((b >> 31) << 7).to(tl.int32)
        a = tl.abs(v)
        ab = a.to(tl.int32, bitcast=True)
        # normal range (|v| >= 2^-6): round the fp32 mantissa to 3 bits; carries move the exponent
        r = ab + 0x7FFFF + ((ab >> 20) & 1)
        normal = (r >> 20) - ((127 - 7) << 3)
        # subnormal range: an integer multiple of 2^-9 (exact product; + 2^23 rounds to even)
        sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
        mag = tl.where(a < 0.015625, sub, normal)
        return sign | mag

    @triton.jit
    def _ue8m0_exp(amax):
        """e with 2^e = 2^ceil(log2(max(amax, 1e-4) * fp32(1/448))), read off the fp32 bits (exact)."""
        v = tl.maximum(amax, 1e-4) * (1.0 / 448.0)          # fp32 product, as the official code
        bits = v.to(tl.int32, bitcast=True)
        return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)

    @triton.jit
    def _exp2i(e):
        """exact fp32 2^e for integer e in [-126, 127]."""
        return ((127 + e) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _rope_rows(x, cos_ptr, sin_ptr, ROWS: tl.constexpr, NEG_SIN: tl.constexpr):
        """Rotate the interleaved pairs of the last 64 of 512 dims of x [ROWS, 512] fp32; returns
        fp32 [ROWS, 512] (dims 0..447 untouched, also the sign of zeros)."""
        x2 = tl.reshape(x, [ROWS, 256, 2])
        x0, x1 = tl.split(x2)                               # [ROWS, 256] even / odd dims
        j = tl.arange(0, 256)
        is_rope = j >= (NOPE_DIM_C // 2)
        c = tl.load(cos_ptr + (j - NOPE_DIM_C // 2), mask=is_rope, other=1.0)
        s = tl.load(sin_ptr + (j - NOPE_DIM_C // 2), mask=is_rope, other=0.0)
        if NEG_SIN:
            s = -s
        y0 = x0 * c[None, :] - x1 * s[None, :]
        y1 = x0 * s[None, :] + x1 * c[None, :]
        y0 = tl.where(is_rope[None, :], y0, x0)
        y1 = tl.where(is_rope[None, :], y1, x1)
        return tl.reshape(tl.join(y0, y1), [ROWS, 512])

    @triton.jit
    def _kv_insert_kernel(Q, KV, COS, SIN, PAGES, SLOTS, QO, KVO,
                          H, stride_qt, stride_qh, stride_qot, stride_qoh, stride_kvt, stride_kvot,
                          page_size, page_nbytes, eps,
                          HPB: tl.constexpr):
        t = tl.program_id(0)
        hb = tl.program_id(1)
        n_hb = tl.num_programs(1) - 1
        d = tl.arange(0, 512)
        cos_ptr = COS + t * 32
        sin_ptr = SIN + t * 32
        if hb < n_hb:
            # ---- q: per-head weightless RMSNorm (bf16 op chain) + RoPE
            h = hb * HPB + tl.arange(0, HPB)
            hm = h < H
            q = tl.load(Q + t.to(tl.int64) * stride_qt + h[:, None] * stride_qh + d[None, :],
                        mask=hm[:, None], other=0.0).to(tl.float32)
            sq = _rne_bf16(q * q)
            ms = _rne_bf16(tl.sum(sq, axis=1) / 512.0)
            ms = _rne_bf16(ms + eps)
            r = _rne_bf16(tl.math.div_rn(tl.full([HPB], 1.0, tl.float32), tl.sqrt_rn(ms)))
            qn = _rne_bf16(q * r[:, None])
            y = _rope_rows(qn, cos_ptr, sin_ptr, HPB, False)
            y = _rne_bf16(y)
            tl.store(QO + t.to(tl.int64) * stride_qot + h[:, None] * stride_qoh + d[None, :],
                     y.to(QO.dtype.element_ty), mask=hm[:, None])
        else:
            # ---- kv: RoPE, FP8 QDQ of the nope dims in 64-blocks, paged insert
            x = tl.load(KV + t.to(tl.int64) * stride_kvt + d).to(tl.float32)
            x = _rne_bf16(_rope_rows(tl.reshape(x, [1, 512]), cos_ptr, sin_ptr, 1, False))
            xb = tl.reshape(x, [8, 64])                       # block 7 = the 64 rope dims
            blk = tl.arange(0, 8)
            e = _ue8m0_exp(tl.max(tl.abs(xb), axis=1))
            qv = tl.minimum(tl.maximum(xb * _exp2i(-e)[:, None], -448.0), 448.0)
            deq = _e4m3_bits(qv).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
            deq = deq * _exp2i(e)[:, None]                   # the QDQ'd row (exact product)
            # the bytes are those of encode_kv_entries(QDQ'd row): its scale comes from the QDQ'd
            # block max, which rounding can lower below a power of two (then the scale halves and
            # the codes move up one binade: an exact re-encoding, same decoded values)
            e = _ue8m0_exp(tl.max(tl.abs(deq), axis=1))
            q8 = _e4m3_bits(deq * _exp2i(-e)[:, None]).to(tl.uint8)
            is_nope = (blk < 7)[:, None]
            out = tl.where(is_nope, deq, xb)
            tl.store(KVO + t.to(tl.int64) * stride_kvot + d, tl.reshape(out, [512]).to(KVO.dtype.element_ty))
            slot = tl.load(SLOTS + t)
            if slot >= 0:
                page = slot // page_size
                off = slot - page * page_size
                base = PAGES + page * page_nbytes
                row = base + off * 576
                offs = blk[:, None] * 64 + tl.arange(0, 64)[None, :]
                tl.store(row + offs, q8, mask=is_nope & (offs < 448))
                rope_ptr = (row + 448).to(tl.pointer_type(tl.bfloat16))
                tl.store(rope_ptr + (offs - 448), out.to(tl.bfloat16), mask=(offs >= 448))
                sb = tl.where(blk < 7, 127 + e, 0).to(tl.uint8)
                tl.store(base + page_size * 576 + off * 8 + blk, sb)


def _check(q, kv, cos, sin, pages, slot_mapping, page_size):
    T = kv.shape[0]
    if q.dim() != 3 or q.shape[0] != T or q.shape[2] != HEAD_DIM or q.dtype != torch.bfloat16:
        raise ValueError(f"q: expected bf16 [T={T}, H, 512], got {q.dtype} {tuple(q.shape)}")
    if kv.dim() != 2 or kv.shape[1] != HEAD_DIM or kv.dtype != torch.bfloat16:
        raise ValueError(f"kv: expected bf16 [T, 512], got {kv.dtype} {tuple(kv.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (T, ROPE_DIM // 2) or t.dtype != torch.float32:
            raise ValueError(f"{name}: expected fp32 [{T}, 32], got {t.dtype} {tuple(t.shape)}")
    if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.shape[1] != page_bytes(page_size):
        raise ValueError(f"pages: expected uint8 [num_pages, {page_bytes(page_size)}], got "
                         f"{pages.dtype} {tuple(pages.shape)}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (T,):
        raise ValueError(f"slot_mapping: expected int64 [{T}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")


def kv_insert(q: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              pages: torch.Tensor, slot_mapping: torch.Tensor, page_size: int, eps: float = 1e-6,
              q_out: torch.Tensor | None = None, kv_out: torch.Tensor | None = None,
              heads_per_program: int = 8, num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton: q-norm + RoPE on q, RoPE + FP8 QDQ on kv, paged insert; one launch. See module doc."""
    _check(q, kv, cos, sin, pages, slot_mapping, page_size)
    T, H, _ = q.shape
    if q.stride(2) != 1 or kv.stride(1) != 1:
        raise ValueError("q and kv need a contiguous last dim")
    cos, sin = cos.contiguous(), sin.contiguous()
    q_out = torch.empty_like(q) if q_out is None else q_out
    kv_out = torch.empty(T, HEAD_DIM, dtype=torch.bfloat16, device=kv.device) if kv_out is None else kv_out
    if T == 0:
        return q_out, kv_out
    hpb = heads_per_program
    n_hb = triton.cdiv(H, hpb)
    kw = {} if interpreting() else {"enable_fp_fusion": False, "num_warps": num_warps}
    _kv_insert_kernel[(T, n_hb + 1)](
        q, kv, cos, sin, pages, slot_mapping, q_out, kv_out,
        H, q.stride(0), q.stride(1), q_out.stride(0), q_out.stride(1), kv.stride(0), kv_out.stride(0),
        page_size, pages.shape[1], eps, HPB=hpb, **kw)
    return q_out, kv_out


def kv_insert_torch(q: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    pages: torch.Tensor, slot_mapping: torch.Tensor, page_size: int, eps: float = 1e-6
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of :func:`kv_insert`, built from dsv4.reference and dsv4.formats."""
    from ..formats.fp8 import fp8_qdq
    from ..reference.norm import head_rms_norm
    from ..reference.numerics import OFFICIAL
    from ..reference.rope import apply_rope
    _check(q, kv, cos, sin, pages, slot_mapping, page_size)
    freqs = torch.complex(cos.float(), sin.float())
    q_out = apply_rope(head_rms_norm(q, eps, OFFICIAL), freqs)
    kvr = apply_rope(kv, freqs)
    kv_out = torch.cat([fp8_qdq(kvr[:, :NOPE_DIM], 64), kvr[:, NOPE_DIM:]], dim=-1)
    write_kv_entries(pages, slot_mapping, kv_out, page_size)
    return q_out, kv_out


__all__ = ["kv_insert", "kv_insert_torch", "ENTRY_BYTES", "TOKEN_DATA_BYTES"]
