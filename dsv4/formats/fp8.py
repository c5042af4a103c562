"""FP8 (e4m3) activation / weight quantisation with power-of-two (ue8m0) scales.

Facts: spec dsv4-architecture.md §3. Everything here is exact integer-like arithmetic on fp32
values (scales are powers of two), so results are bit-identical on every device.
"""
import functools

import torch
from torch import Tensor

FP8_MAX = 448.0  # largest finite float8_e4m3fn magnitude

# e8m0 holds 2^-127 .. 2^127 (byte 0 .. 254); byte 255 is NaN.
_E8M0_MIN_EXP, _E8M0_MAX_EXP = -127, 127


def exp2i(e: Tensor) -> Tensor:
    """Exact fp32 2^e for integer e, built from fp64 exponent bits (no pow/ldexp rounding).

    Exact down to fp32 subnormals (2^-149); overflows to inf past 2^127.
    """
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64).float()


def pow2_ceil(x: Tensor) -> Tensor:
    """fp32 2^ceil(log2(x)) for x > 0, exact.

    Read off the fp32 exponent/mantissa (as the official kernel does) instead of calling log2,
    whose rounding could push an exact power of two up by one step.
    """
    x = x.float()
    m, e = torch.frexp(x)  # x = m * 2^e, m in [0.5, 1)
    e = torch.where(m == 0.5, e - 1, e)  # exact powers of two stay themselves
    p = exp2i(e)
    # 0 -> 0, inf -> inf, negative / NaN -> NaN (what 2^log2(x) gives) instead of frexp garbage
    ok = (x > 0) & torch.isfinite(x)
    return torch.where(ok, p, x.log2().exp2())


def ue8m0_scale(amax: Tensor, qmax: float) -> Tensor:
    """Power-of-two scale covering `amax`: pow2_ceil(amax * fp32(1/qmax)).

    The official act_quant multiplies by the fp32 reciprocal rather than dividing; the two can
    differ by one ulp, which can move the result across a power of two.
    """
    # a Python float that is exactly fp32(1/qmax): tensor * scalar then runs in fp32 with no
    # host-to-device copy (CUDA-graph safe)
    return pow2_ceil(amax.float() * _fp32_reciprocal(qmax))


@functools.lru_cache(maxsize=None)
def _fp32_reciprocal(q: float) -> float:
    return float(torch.tensor(1.0 / q, dtype=torch.float32))


def _blocks(x: Tensor, block: int) -> Tensor:
    """fp32 view [..., n, block] of `x`, split along the last dim."""
    if block <= 0 or x.dim() == 0 or x.shape[-1] % block != 0:
        raise ValueError(f"last dim of shape {tuple(x.shape)} must be a multiple of block={block}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def act_quant_fp8(x: Tensor, block: int = 128) -> tuple[Tensor, Tensor]:
    """Official act_quant: per (row, block) ue8m0 scale, e4m3 values (RNE).

    Returns (q float8_e4m3fn, same shape as x; s fp32 [..., last/block]).
    """
    xb = _blocks(x, block)
    amax = xb.abs().amax(dim=-1).clamp(min=1e-4)  # floor keeps all-zero blocks finite
    s = ue8m0_scale(amax, FP8_MAX)
    # x/s is exact (power-of-two s); the clamp is a guard, the e4m3 cast rounds to nearest even
    q = (xb / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(x.shape), s


def fp8_qdq(x: Tensor, block: int) -> Tensor:
    """FP8 quant-dequant simulation: dtype(fp32(q) * s), same shape and dtype as x."""
    q, s = act_quant_fp8(x, block)
    y = q.float().reshape(*x.shape[:-1], -1, block) * s.unsqueeze(-1)
    return y.reshape(x.shape).to(x.dtype)


def e8m0_to_fp32(t: Tensor) -> Tensor:
    """float8_e8m0fnu (or its raw uint8 bytes) -> fp32 2^(byte-127); byte 255 -> NaN."""
    if t.dtype == torch.uint8:
        t = t.view(torch.float8_e8m0fnu)
    if t.dtype != torch.float8_e8m0fnu:
        raise ValueError(f"expected float8_e8m0fnu or uint8, got {t.dtype}")
    return t.float()


def fp32_to_e8m0(t: Tensor) -> Tensor:
    """Exact fp32 -> float8_e8m0fnu; every value must be a power of two in 2^-127..2^127.

    (torch's own cast rounds non-powers of two up silently, hence the check.)
    """
    t = t.float()
    m, e = torch.frexp(t)
    exact = (m == 0.5) & (e - 1 >= _E8M0_MIN_EXP) & (e - 1 <= _E8M0_MAX_EXP)
    if not bool(exact.all()):
        bad = t[~exact].flatten()[:4].tolist()
        raise ValueError(f"not exact e8m0 powers of two in [2^-127, 2^127]: {bad} ...")
    return t.to(torch.float8_e8m0fnu)


def quant_fp8_weight(w: Tensor, block: int = 128) -> tuple[Tensor, Tensor]:
    """fp32 [out, in] -> (e4m3 [out, in], e8m0 [ceil(out/b), ceil(in/b)]), ue8m0 per b x b block."""
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight [out, in], got shape {tuple(w.shape)}")
    out_f, in_f = w.shape
    bo, bi = -(-out_f // block), -(-in_f // block)
    # zero padding of ragged edges never raises a block's amax
    wp = w.new_zeros(bo * block, bi * block, dtype=torch.float32)
    wp[:out_f, :in_f] = w.float()
    blocks = wp.view(bo, block, bi, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    s = pow2_ceil(amax / FP8_MAX)  # weights: plain division, as the checkpoint tooling does
    q = (blocks / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.view(bo * block, bi * block)[:out_f, :in_f].contiguous()
    return q, s.to(torch.float8_e8m0fnu)


def dequant_fp8_weight(w: Tensor, scale: Tensor, block: int = 128) -> Tensor:
    """W[i, j] = fp32(w[i, j]) * scale[i // b, j // b] (scale e8m0 or fp32) -> fp32 [out, in]."""
    if w.dim() != 2 or w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"expected float8_e4m3fn [out, in], got {w.dtype} {tuple(w.shape)}")
    out_f, in_f = w.shape
    want = (-(-out_f // block), -(-in_f // block))
    if tuple(scale.shape) != want:
        raise ValueError(f"scale shape: expected {want} for weight {tuple(w.shape)}, got {tuple(scale.shape)}")
    s = e8m0_to_fp32(scale) if scale.dtype in (torch.float8_e8m0fnu, torch.uint8) else scale.float()
    s = s.repeat_interleave(block, 0).repeat_interleave(block, 1)[:out_f, :in_f]
    return w.float() * s
