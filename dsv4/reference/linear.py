"""Linear layers in the formats of the official checkpoint (spec §3).

Weights are dequantised once to fp32 (exact: e4m3/e2m1 values times power-of-two or e4m3 scales).
A quantised GEMM then is ``bf16(QDQ_fp8(x, 1x128) @ W^T)`` in fp32: the official per-128-block
accumulation ``acc += (A_blk @ B_blk^T) * sA * sB`` computes the same products (scales are powers
of two, so scaling is exact) and differs only in fp32 summation order.
"""
from __future__ import annotations

import torch

from ..formats.fp4 import dequant_mxfp4, dequant_nvfp4
from ..formats.fp8 import act_quant_fp8, dequant_fp8_weight
from .numerics import Numerics

# kinds: "fp8" / "fp4" (act-quantised GEMM, bf16 out), "bf16" (bf16 F.linear), "fp32" (fp32 GEMM)
QUANTISED = ("fp8", "fp4")


def dequant_activation_fp8(x: torch.Tensor) -> torch.Tensor:
    """fp32 values the FP8 GEMM sees for a bf16 activation: e4m3(x/s)*s per 1x128 block."""
    q, s = act_quant_fp8(x, 128)
    return (q.float().unflatten(-1, (-1, 128)) * s.unsqueeze(-1)).flatten(-2)


def linear(x: torch.Tensor, wt: torch.Tensor, kind: str, num: Numerics) -> torch.Tensor:
    """The GEMM of a linear layer of ``kind`` with the transposed fp32 (or fp64) weight ``wt`` [in, out]."""
    if num.exact:
        return num.mm(x.float(), wt)
    if kind in QUANTISED:
        xq = dequant_activation_fp8(x.to(torch.bfloat16))
        return num.mm(xq, wt).to(torch.bfloat16)
    if kind == "bf16":
        return num.mm(x.to(torch.bfloat16).float(), wt).to(torch.bfloat16)
    return num.mm(x.float(), wt)


class Linear:
    def __init__(self, weight: torch.Tensor, kind: str, num: Numerics):
        assert kind in ("fp8", "fp4", "bf16", "fp32"), kind
        self.weight = weight.float().contiguous()  # [out, in] fp32, exact dequantised values
        self.kind = kind
        self.num = num
        # fp64-accumulating modes keep an fp64 copy (exact) instead of converting on every call
        self._wt = (self.weight.double() if num.fp64_accumulate else self.weight).T

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self._wt, self.kind, self.num)


def load_weight(tensors: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, str]:
    """Dequantised fp32 weight of linear ``name`` (without ``.weight``) and its GEMM kind."""
    w = tensors[name + ".weight"]
    if w.dtype == torch.float8_e4m3fn:
        return dequant_fp8_weight(w, tensors[name + ".scale"]), "fp8"
    if name + ".weight_scale_2" in tensors:  # ModelOpt NVFP4 expert, run weight-only (W4A8 path)
        return dequant_nvfp4(w, tensors[name + ".weight_scale"], tensors[name + ".weight_scale_2"]), "fp4"
    if w.dtype in (torch.int8, torch.uint8):
        return dequant_mxfp4(w, tensors[name + ".scale"]), "fp4"
    if w.dtype == torch.bfloat16:
        return w.float(), "bf16"
    return w.float(), "fp32"


def make_linear(tensors, name: str, num: Numerics, kind: str | None = None) -> Linear:
    """``kind`` overrides the GEMM kind for bf16-stored weights the official code runs in fp32
    (compressor wkv/wgate) or as a bf16 einsum (wo_a, dequantised from FP8 by convert.py)."""
    w, k = load_weight(tensors, name)
    return Linear(w, kind or k, num)
