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

Kernels (two launches for ``hc_pre`` / ``hc_head``, one for ``hc_post``):

* ``_hc_mix_partial``: split-K GEMM ``[T, 4d] x [4d, 24]`` plus the sum of squares. Grid
  (token blocks, K splits) sized to ~8 programs per SM at any T (the 1.5 MB ``fn`` at V4-Flash is
  the dominant read at decode batch sizes). Default ``mode="bf16x3"``: three bf16 tensor-core dots
  into one fp32 accumulator against ``fn`` split exactly into hi + mid + lo bf16 parts
  (``prepare_bf16x3``, cached per weight tensor): every product is exact, the tensor cores' fp32
  accumulation truncates (post/comb still within 1e-5 of the twin on the H200). ``mode="ieee"``: fp32
  FMA ``tl.dot`` (the reference's fp32 accuracy, 2.5-3x slower on the H200; the CPU interpreter
  always takes this path). Partials go to an fp32 workspace ``[splits, T, NP]`` (deterministic: no
  atomics).
* ``_hc_finish``: grid (T, d blocks). Each program reduces the partials of its token (fixed
  order), computes rsqrt, the sigmoids and the Sinkhorn (4x4, a few hundred flops, recomputed by
  every d block), and the weighted stream sum of its d block; the first d block stores post/comb.
  The second read of ``x`` hits L2 for decode-sized batches.
* ``_hc_post_kernel``: grid (T, d blocks), one pass: reads ``y`` and ``res``, writes ``out``.

Numerics vs the twins (reference ``HyperConnection``/``HyperHead``, official numerics): post and
comb agree to < 1e-5 relative (summation order of the 4d-term GEMM, tensor-core accumulation,
exp/rsqrt ulps); bf16 outputs within 1 bf16 ulp (rare flips) except where the weighted stream sum
cancels: there the difference stays below 1e-5 (bf16x3; ieee: 2^-20) of the summed magnitudes
sum_j |x_j| (tests/test_kernels_hotpath.py holds both modes to that). Throughput on the H200:
BENCHMARKS.md (the mix GEMM is latency-bound: far from the HBM floor except hc_post). bf16 roundings are done on the bits (RNE), so the CPU
interpreter (whose casts truncate) gives the GPU's values.
"""
from __future__ import annotations

import weakref

import torch

from . import interpreting, triton_available

HC = 4
DEFAULT_MODE = "bf16x3"   # GPU default (the interpreter always runs the fp32 FMA path)

if triton_available():
    import triton
    import triton.language as tl

    from .kv_insert import _rne_bf16

    @triton.jit
    def _hc_mix_partial(X, FN, PART, SQ, T, K, stride_xt, k_per_split,
                        NMIX: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                        MODE: tl.constexpr):
        """MODE 0: fp32 FMA dot (IEEE, FN = fp32 [NMIX, K]); MODE 1: three bf16 tensor-core dots into one
        fp32 accumulator against the prepared weight FN = bf16 [K, 3*NP] (hi | mid | lo column groups,
        an exact split of fn)."""
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
            kx = k0 + kk + tl.arange(0, BK)
            km = kx < K
            xv = tl.load(xrow + kx[None, :], mask=tm[:, None] & km[None, :], other=0.0)
            xf = xv.to(tl.float32)
            sq += xf * xf
            if MODE == 0:
                f = tl.load(FN + n[:, None] * K + kx[None, :], mask=nm[:, None] & km[None, :], other=0.0)
                acc += tl.dot(xf, tl.trans(f), input_precision="ieee")
            else:
                wp = FN + kx.to(tl.int64)[:, None] * (3 * NP) + n[None, :]       # [BK, NP] K-major tiles
                acc = tl.dot(xv, tl.load(wp, mask=km[:, None], other=0.0), acc)            # hi
                acc = tl.dot(xv, tl.load(wp + NP, mask=km[:, None], other=0.0), acc)       # mid
                acc = tl.dot(xv, tl.load(wp + 2 * NP, mask=km[:, None], other=0.0), acc)   # lo
        base = PART + (pid_s * T + t.to(tl.int64))[:, None] * NP + n[None, :]
        tl.store(base, acc, mask=tm[:, None])
        tl.store(SQ + pid_s * T + t, tl.sum(sq, axis=1), mask=tm)

    @triton.jit
    def _hc_finish(X, PART, SQ, BASE, SCALE, Y, POST, COMB, T, D, S, stride_xt, stride_yt,
                   inv_k, rms_eps, hc_eps, iters,
                   NP: tl.constexpr, SP: tl.constexpr, BD: tl.constexpr, HEAD: tl.constexpr):
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
        tl.store(Y + t64 * stride_yt + d, _rne_bf16(y).to(tl.bfloat16), mask=dm)

    @triton.jit
    def _hc_post_kernel(Yin, RES, POST, COMB, OUT, D, stride_yt, stride_rt, stride_ot, BD: tl.constexpr):
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
        tl.store(OUT + t64 * stride_ot + k4[:, None] * D + d[None, :], _rne_bf16(out).to(tl.bfloat16),
                 mask=dm[None, :])


def _num_sms(device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


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
    mode = 0 if interp or cfg.get("mode", DEFAULT_MODE) == "ieee" else 1
    BK = cfg.get("block_k", 64)
    BT = cfg.get("block_t", 16 if T <= 256 else 64)
    n_tb = triton.cdiv(T, BT)
    n_chunks = triton.cdiv(K, BK)
    S = cfg.get("splits")
    if S is None:   # ~8 programs per SM, >= 2 K blocks each
        S = 2 if interp else max(1, min(max(1, n_chunks // 2), triton.cdiv(8 * _num_sms(x.device), n_tb)))
    k_per_split = triton.cdiv(n_chunks, S) * BK
    S = triton.cdiv(K, k_per_split)
    part = torch.empty(S, T, np_, dtype=torch.float32, device=x.device)
    sq = torch.empty(S, T, dtype=torch.float32, device=x.device)
    w = fn if mode == 0 else prepare_bf16x3(fn, np_)
    # sm_90 / triton 3.6 (ptxas): BT 16 at 4 warps: 128 (ieee) / 168 (bf16x3) registers; BT 64 needs 8 warps
    kw = {} if interp else {"num_warps": cfg.get("num_warps", 4 if BT <= 16 else 8),
                            "num_stages": cfg.get("num_stages", 3)}
    _hc_mix_partial[(n_tb, S)](x, w, part, sq, T, K, x.stride(0), k_per_split,
                               NMIX=nmix, NP=np_, BT=BT, BK=BK, MODE=mode, **kw)
    return part, sq, S


def hc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int = 20,
           hc_eps: float = 1e-6, rms_eps: float = 1e-6, config: dict | None = None):
    """Triton hc_pre: x bf16 [T, 4, d] -> (layer_input bf16 [T, d], post fp32 [T, 4], comb fp32 [T, 4, 4])."""
    _check_x(x, fn, 6 * HC)
    x = x.contiguous()
    T, _, D = x.shape
    y = torch.empty(T, D, dtype=torch.bfloat16, device=x.device)
    post = torch.empty(T, HC, dtype=torch.float32, device=x.device)
    comb = torch.empty(T, HC, HC, dtype=torch.float32, device=x.device)
    if T == 0:
        return y, post, comb
    part, sq, S = _mix_launch(x, fn, 6 * HC, 32, config)
    BD = (config or {}).get("block_d", 512)
    kw = {} if interpreting() else {"num_warps": 4}
    _hc_finish[(T, triton.cdiv(D, BD))](x, part, sq, base.float().contiguous(), scale.float().contiguous(),
                                        y, post, comb, T, D, S, x.stride(0), y.stride(0),
                                        1.0 / (HC * D), rms_eps, hc_eps, iters,
                                        NP=32, SP=triton.next_power_of_2(S), BD=BD, HEAD=False, **kw)
    return y, post, comb


def hc_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            hc_eps: float = 1e-6, rms_eps: float = 1e-6, config: dict | None = None) -> torch.Tensor:
    """Triton hc_head: x bf16 [T, 4, d] -> bf16 [T, d] (sigmoid stream weights, no Sinkhorn)."""
    _check_x(x, fn, HC)
    x = x.contiguous()
    T, _, D = x.shape
    y = torch.empty(T, D, dtype=torch.bfloat16, device=x.device)
    if T == 0:
        return y
    part, sq, S = _mix_launch(x, fn, HC, 16, config)
    BD = (config or {}).get("block_d", 512)
    kw = {} if interpreting() else {"num_warps": 4}
    _hc_finish[(T, triton.cdiv(D, BD))](x, part, sq, base.float().contiguous(), scale.float().reshape(-1).contiguous(),
                                        y, y, y, T, D, S, x.stride(0), y.stride(0),
                                        1.0 / (HC * D), rms_eps, hc_eps, 1,
                                        NP=16, SP=triton.next_power_of_2(S), BD=BD, HEAD=True, **kw)
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
                                                  out.stride(0), BD=block_d, **kw)
    return out


# ------------------------------------------------------------------------------ torch twins
def hc_pre_torch(x, fn, base, scale, iters: int = 20, hc_eps: float = 1e-6, rms_eps: float = 1e-6, **_):
    from ..reference.mhc import HyperConnection
    from ..reference.numerics import OFFICIAL
    return HyperConnection(fn, base, scale, HC, iters, hc_eps, rms_eps, OFFICIAL).pre(x)


def hc_post_torch(y, res, post, comb, **_):
    from ..reference.mhc import HyperConnection
    from ..reference.numerics import OFFICIAL
    hc = HyperConnection(torch.zeros(1), torch.zeros(1), torch.zeros(1), HC, 1, 0.0, 0.0, OFFICIAL)
    return hc.post(y, res, post, comb)


def hc_head_torch(x, fn, base, scale, hc_eps: float = 1e-6, rms_eps: float = 1e-6, **_):
    from ..reference.mhc import HyperHead
    from ..reference.numerics import OFFICIAL
    return HyperHead(fn, base, scale, hc_eps, rms_eps, OFFICIAL)(x)


__all__ = ["hc_pre", "hc_post", "hc_head", "hc_pre_torch", "hc_post_torch", "hc_head_torch"]
