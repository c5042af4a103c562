"""FP4 e2m1 codes, nibble packing, and the two 4-bit weight formats (MXFP4, NVFP4).

Facts: spec dsv4-architecture.md §3 (MXFP4 routed experts, FP4 QDQ) and §11.3,
kernels-and-formats.md §3 (NVFP4 / ModelOpt). Codes are 4 bits, bit 3 = sign, code & 7 indexes
the magnitude grid {0, .5, 1, 1.5, 2, 3, 4, 6}. Packing: element 2k in the LOW nibble.
"""
import torch
from torch import Tensor

from .fp8 import FP8_MAX, exp2i, e8m0_to_fp32, fp32_to_e8m0, pow2_ceil, ue8m0_scale

E2M1_MAX = 6.0
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)

MXFP4_BLOCK = 32  # e8m0 scale per 32 input elements
NVFP4_BLOCK = 16  # e4m3 scale per 16 input elements

# Midpoints between neighbouring magnitudes. A magnitude lands on code = #(bounds < a); on an
# exact midpoint the tie goes to the even code, i.e. one up for the odd-indexed bounds
# (0.75 -> 1.0, 1.75 -> 2.0, 3.5 -> 4.0). Same net rule as ModelOpt's searchsorted + bump.
_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_TIE_UP = torch.tensor([0.75, 1.75, 3.5])
_DEVICE_COPIES: dict = {}


def _on(t: Tensor, device: torch.device) -> Tensor:
    """``t`` on ``device``, copied once: no host-to-device copy in the hot path (CUDA graphs)."""
    if device.type == "cpu":
        return t
    key = (id(t), device)
    if key not in _DEVICE_COPIES:
        _DEVICE_COPIES[key] = t.to(device)
    return _DEVICE_COPIES[key]

# packed-byte dtypes: the official int8, ModelOpt uint8, and convert.py's float4_e2m1fn_x2 view
_PACKED = (torch.uint8, torch.int8) + ((torch.float4_e2m1fn_x2,) if hasattr(torch, "float4_e2m1fn_x2") else ())

# e4m3 represents exactly the powers of two 2^-9 (smallest subnormal) .. 2^8
_E4M3_POW2_MIN, _E4M3_POW2_MAX = -9, 8


def magnitude_codes(x: Tensor) -> Tensor:
    """Round |x| (fp32) to the nearest e2m1 magnitude code 0..7, ties to even, saturating at 6."""
    a = x.abs()
    codes = torch.bucketize(a, _on(_BOUNDS, a.device))  # #(bounds < a); inf -> 7
    return codes + torch.isin(a, _on(_TIE_UP, a.device)).to(codes.dtype)


def e2m1_encode(x: Tensor) -> Tensor:
    """Values -> uint8 codes 0..15 (RNE, ties to even code, |x| > 6 saturates, sign from signbit)."""
    x = x.float()
    if bool(torch.isnan(x).any()):
        raise ValueError("e2m1_encode: input contains NaN")
    sign = torch.signbit(x).to(torch.uint8) << 3
    return magnitude_codes(x).to(torch.uint8) | sign


def e2m1_decode(codes: Tensor) -> Tensor:
    """uint8 codes 0..15 -> fp32 values."""
    return _on(E2M1_VALUES, codes.device)[codes.long()]


def pack_fp4(codes: Tensor) -> Tensor:
    """codes [..., K] -> uint8 [..., K/2]; element 2k in the low nibble, 2k+1 in the high."""
    if codes.dim() == 0 or codes.shape[-1] % 2 != 0:
        raise ValueError(f"pack_fp4: last dim of shape {tuple(codes.shape)} must be even")
    c = codes.to(torch.uint8) & 0x0F
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: Tensor) -> Tensor:
    """uint8 / int8 / float4_e2m1fn_x2 [..., K/2] -> uint8 codes [..., K] (inverse of pack_fp4)."""
    if packed.dtype not in _PACKED:
        raise ValueError(f"unpack_fp4: expected one of {_PACKED}, got {packed.dtype}")
    p = packed.view(torch.uint8)  # int8 checkpoints: reinterpret, a >> would sign-extend
    return torch.stack((p & 0x0F, p >> 4), dim=-1).flatten(-2)


def fp4_qdq(x: Tensor, block: int = 32) -> Tensor:
    """Official fp4_act_quant simulation: dtype(fp32(e2m1(clamp(x/s, +-6))) * s), ue8m0 s per block."""
    if block <= 0 or x.dim() == 0 or x.shape[-1] % block != 0:
        raise ValueError(f"last dim of shape {tuple(x.shape)} must be a multiple of block={block}")
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)
    # floor 6*2^-126 keeps the scale a normal fp32 for all-zero blocks
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp(min=E2M1_MAX * 2.0 ** -126)
    s = ue8m0_scale(amax, E2M1_MAX)
    v = (xb / s).clamp(-E2M1_MAX, E2M1_MAX)
    # no NaN check here (hot path): a NaN block stays NaN through amax -> s
    q = _on(E2M1_VALUES, x.device)[magnitude_codes(v)].copysign(v)
    return (q * s).reshape(x.shape).to(x.dtype)


def _check_2d(name: str, t: Tensor, dtypes: tuple, shape: tuple | None = None) -> None:
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype in {dtypes}, got {t.dtype}")
    if t.dim() != 2 or (shape is not None and tuple(t.shape) != shape):
        want = shape if shape is not None else "2-D"
        raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")


# ------------------------------------------------------------------------ MXFP4 (official experts)
def quant_mxfp4(w: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 [out, in] -> (packed int8 [out, in/2], e8m0 [out, in/32]); s = pow2_ceil(amax/6)."""
    if w.dim() != 2 or w.shape[1] % MXFP4_BLOCK != 0:
        raise ValueError(f"quant_mxfp4: expected [out, in] with in % 32 == 0, got {tuple(w.shape)}")
    out_f, in_f = w.shape
    wb = w.float().view(out_f, in_f // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = wb.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    s = pow2_ceil(amax / E2M1_MAX)  # plain division, as the checkpoint tooling does
    codes = e2m1_encode(wb / s).view(out_f, in_f)
    return pack_fp4(codes).view(torch.int8), fp32_to_e8m0(s.squeeze(-1))


def dequant_mxfp4(packed: Tensor, scale: Tensor) -> Tensor:
    """(packed int8|uint8 [out, in/2], e8m0 [out, in/32]) -> fp32 [out, in]."""
    _check_2d("dequant_mxfp4 packed", packed, _PACKED)
    out_f, in_f = packed.shape[0], packed.shape[1] * 2
    if in_f % MXFP4_BLOCK != 0:
        raise ValueError(f"dequant_mxfp4: input dim {in_f} is not a multiple of {MXFP4_BLOCK}")
    _check_2d("dequant_mxfp4 scale", scale, (torch.float8_e8m0fnu, torch.uint8),
              (out_f, in_f // MXFP4_BLOCK))
    v = e2m1_decode(unpack_fp4(packed)).view(out_f, -1, MXFP4_BLOCK)
    return (v * e8m0_to_fp32(scale).unsqueeze(-1)).view(out_f, in_f)


# ------------------------------------------------------------------------ NVFP4 (ModelOpt)
def quant_nvfp4(w: Tensor, weight_scale_2: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 [out, in] -> (packed uint8 [out, in/2], e4m3 [out, in/16], fp32 0-d weight_scale_2).

    ModelOpt formulas: weight_scale_2 = amax(W) / (6*448); block scale =
    e4m3(block_amax / (6 * weight_scale_2)), 1.0 for all-zero blocks; codes =
    e2m1(w / (fp32(block_scale) * weight_scale_2)). Pass `weight_scale_2` to share one global
    scale between tensors (ModelOpt does so for w1/w3).
    """
    if w.dim() != 2 or w.shape[1] % NVFP4_BLOCK != 0:
        raise ValueError(f"quant_nvfp4: expected [out, in] with in % 16 == 0, got {tuple(w.shape)}")
    out_f, in_f = w.shape
    wb = w.float().view(out_f, in_f // NVFP4_BLOCK, NVFP4_BLOCK)
    if weight_scale_2 is None:
        weight_scale_2 = wb.abs().amax() / (E2M1_MAX * FP8_MAX)
    ws2 = torch.as_tensor(weight_scale_2, dtype=torch.float32, device=w.device).reshape(())
    block_amax = wb.abs().amax(dim=-1)
    bs = block_amax / (E2M1_MAX * ws2)
    # all-zero blocks get 1.0; the clamp only matters for a shared weight_scale_2 that is too small
    bs = torch.where(block_amax == 0, torch.ones_like(bs), bs).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    denom = (bs.float() * ws2).unsqueeze(-1)
    # a block scale that underflows e4m3 (or an all-zero tensor) gives denom 0; its values are
    # negligible next to the tensor's amax and encode as 0 (ModelOpt would divide by zero)
    scaled = torch.where(denom > 0, wb / denom, torch.zeros_like(wb))
    codes = e2m1_encode(scaled).view(out_f, in_f)
    return pack_fp4(codes), bs, ws2


def dequant_nvfp4(packed: Tensor, weight_scale: Tensor, weight_scale_2: Tensor) -> Tensor:
    """e2m1 * fp32(weight_scale) * weight_scale_2 -> fp32 [out, in] (products in that order)."""
    _check_2d("dequant_nvfp4 packed", packed, _PACKED)
    out_f, in_f = packed.shape[0], packed.shape[1] * 2
    if in_f % NVFP4_BLOCK != 0:
        raise ValueError(f"dequant_nvfp4: input dim {in_f} is not a multiple of {NVFP4_BLOCK}")
    _check_2d("dequant_nvfp4 weight_scale", weight_scale, (torch.float8_e4m3fn,),
              (out_f, in_f // NVFP4_BLOCK))
    if weight_scale_2.numel() != 1:
        raise ValueError(f"dequant_nvfp4: weight_scale_2 must be a scalar, got {tuple(weight_scale_2.shape)}")
    v = e2m1_decode(unpack_fp4(packed)).view(out_f, -1, NVFP4_BLOCK)
    # e2m1 * e4m3 is exact (<= 6 significant bits), so the only rounding is the global multiply
    v = v * weight_scale.float().unsqueeze(-1)
    return (v * weight_scale_2.float().reshape(()).to(v.device)).view(out_f, in_f)


def mxfp4_to_nvfp4(packed: Tensor, scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Lossless MXFP4 -> NVFP4: same codes, e4m3 block scales = e8m0 scale / weight_scale_2.

    weight_scale_2 = 2^k with k = (largest scale exponent) - 8, so the largest block scale is
    2^8 (top of e4m3's power-of-two range) and everything down to 2^-9 is exact. Groups whose
    codes are all zero dequantise to 0 under any scale, so they do not constrain the range
    (their block scale is clamped into it); the remaining scales must span at most 2^17.
    """
    _check_2d("mxfp4_to_nvfp4 packed", packed, _PACKED)
    out_f, in_f = packed.shape[0], packed.shape[1] * 2
    _check_2d("mxfp4_to_nvfp4 scale", scale, (torch.float8_e8m0fnu, torch.uint8),
              (out_f, in_f // MXFP4_BLOCK))
    e = scale.view(torch.uint8).int() - 127  # scale = 2^e
    if bool((e == 128).any()):  # byte 255: NaN would dequantise to NaN even times code 0
        raise ValueError("mxfp4_to_nvfp4: scale contains NaN (e8m0 byte 255)")
    nonzero = (unpack_fp4(packed) & 0x7).view(out_f, -1, MXFP4_BLOCK).amax(dim=-1) > 0
    if bool(nonzero.any()):
        e_min, e_max = int(e[nonzero].min()), int(e[nonzero].max())
    else:
        e_min = e_max = _E4M3_POW2_MAX  # all zero: weight_scale_2 = 1
    if e_max - e_min > _E4M3_POW2_MAX - _E4M3_POW2_MIN:
        raise ValueError(
            f"mxfp4_to_nvfp4: scales of non-zero groups span 2^{e_min}..2^{e_max} "
            f"({e_max - e_min} octaves); e4m3 block scales hold only powers of two "
            f"2^{_E4M3_POW2_MIN}..2^{_E4M3_POW2_MAX} (17 octaves), so no exact conversion exists")
    k = e_max - _E4M3_POW2_MAX
    # 2^k >= 2^-135 is an exact (possibly subnormal) fp32, and code * 2^(e-k) is exact, so
    # dequant's (code * bs) * 2^k rounds the same real number code * 2^e as MXFP4 dequant does
    ws2 = exp2i(torch.tensor(k, device=e.device))
    bs = exp2i((e - k).clamp(_E4M3_POW2_MIN, _E4M3_POW2_MAX)).to(torch.float8_e4m3fn)
    return packed.view(torch.uint8), bs.repeat_interleave(2, dim=-1), ws2
