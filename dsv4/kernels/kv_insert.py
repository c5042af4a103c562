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

from ..formats.contracts import check_kv_insert
from ..formats.kv_entry import KV_DIM
from .lib import PDL_LAUNCH, interpreting, triton_available

HEAD_DIM = KV_DIM  # 512

if triton_available():
    import triton
    import triton.language as tl

    from .lib import e4m3_bits, exp2i, pdl_wait, rne_bf16, rope_rows, ue8m0_exp

    @triton.jit
    def _kv_insert_kernel(Q, KV, COS, SIN, PAGES, SLOTS, QO, KVO,
                          H, stride_qt, stride_qh, stride_qot, stride_qoh, stride_kvt, stride_kvot,
                          page_size, page_nbytes, eps,
                          HPB: tl.constexpr):
        pdl_wait()
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
            sq = rne_bf16(q * q)
            ms = rne_bf16(tl.sum(sq, axis=1) / 512.0)
            ms = rne_bf16(ms + eps)
            r = rne_bf16(tl.math.div_rn(tl.full([HPB], 1.0, tl.float32), tl.sqrt_rn(ms)))
            qn = rne_bf16(q * r[:, None])
            y = rope_rows(qn, cos_ptr, sin_ptr, HPB, False)
            y = rne_bf16(y)
            tl.store(QO + t.to(tl.int64) * stride_qot + h[:, None] * stride_qoh + d[None, :],
                     y.to(QO.dtype.element_ty), mask=hm[:, None])
        else:
            # ---- kv: RoPE, FP8 QDQ of the nope dims in 64-blocks, paged insert
            x = tl.load(KV + t.to(tl.int64) * stride_kvt + d).to(tl.float32)
            x = rne_bf16(rope_rows(tl.reshape(x, [1, 512]), cos_ptr, sin_ptr, 1, False))
            xb = tl.reshape(x, [8, 64])                       # block 7 = the 64 rope dims
            blk = tl.arange(0, 8)
            e = ue8m0_exp(tl.max(tl.abs(xb), axis=1))
            qv = tl.minimum(tl.maximum(xb * exp2i(-e)[:, None], -448.0), 448.0)
            deq = e4m3_bits(qv).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
            deq = deq * exp2i(e)[:, None]                   # the QDQ'd row (exact product)
            # the bytes are those of encode_kv_entries(QDQ'd row): its scale comes from the QDQ'd
            # block max, which rounding can lower below a power of two (then the scale halves and
            # the codes move up one binade: an exact re-encoding, same decoded values)
            e = ue8m0_exp(tl.max(tl.abs(deq), axis=1))
            q8 = e4m3_bits(deq * exp2i(-e)[:, None]).to(tl.uint8)
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


def kv_insert(q: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              pages: torch.Tensor, slot_mapping: torch.Tensor, page_size: int, eps: float = 1e-6,
              q_out: torch.Tensor | None = None, kv_out: torch.Tensor | None = None,
              heads_per_program: int = 8, num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton: q-norm + RoPE on q, RoPE + FP8 QDQ on kv, paged insert; one launch. See module doc. ``q``
    None: kv only (the prefill attention applies q's transform as it loads q); q_out is then None."""
    check_kv_insert(q, kv, cos, sin, pages, slot_mapping, page_size)
    T, H = kv.shape[0], (0 if q is None else q.shape[1])
    if (q is not None and q.stride(2) != 1) or kv.stride(1) != 1:
        raise ValueError("q and kv need a contiguous last dim")
    cos, sin = cos.contiguous(), sin.contiguous()
    if q is None:
        q = q_out = kv.view(T, 1, HEAD_DIM)     # not read: no q head blocks in the grid
    else:
        q_out = torch.empty_like(q) if q_out is None else q_out
    kv_out = torch.empty(T, HEAD_DIM, dtype=torch.bfloat16, device=kv.device) if kv_out is None else kv_out
    if T == 0:
        return (q_out if H else None), kv_out
    hpb = heads_per_program
    n_hb = triton.cdiv(H, hpb)
    kw = {} if interpreting() else {"enable_fp_fusion": False, "num_warps": num_warps}
    _kv_insert_kernel[(T, n_hb + 1)](
        q, kv, cos, sin, pages, slot_mapping, q_out, kv_out,
        H, q.stride(0), q.stride(1), q_out.stride(0), q_out.stride(1), kv.stride(0), kv_out.stride(0),
        page_size, pages.shape[1], eps, HPB=hpb, **kw, **PDL_LAUNCH)
    return (q_out if H else None), kv_out


__all__ = ["kv_insert"]
