"""Numerics modes of the reference (spec §3, §15).

* ``official``: bf16 activations, FP8 activation quantisation (1x128, UE8M0) before every FP8/FP4
  GEMM, every in-place QDQ step, fp32-accumulated GEMMs and the official index layout. Called
  with the official call pattern (prefill at 0, then 1-token decodes, one sequence per call) it
  reproduces the official code's bits on CPU, which is what the golden test needs: the official
  model amplifies any 1-ulp difference into FP8 steps, MoE-routing and top-k flips.
* ``invariant``: the same quantisation steps, but every GEMM/einsum sums fp32 products in fp64
  and rounds once (the correctly rounded result, whatever order BLAS picks for a shape) and the
  window part of every index list has one width (128); exp, softmax, sigmoid, rsqrt, ... are
  evaluated in fp64 and rounded once. A token's numbers are then the same bits
  alone or in any batch, in a prefill, a prefill chunk or a decode step: the oracle the engine
  and the kernels are held to.
* ``exact``: fp32 activations, no quantisation of activations or caches, fp64-accumulated GEMMs:
  a smooth function of the inputs for tight tests.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Numerics:
    name: str = "official"

    def __post_init__(self):
        if self.name not in MODES:
            raise ValueError(f"numerics must be one of {', '.join(MODES)}, got {self.name!r}")

    @property
    def exact(self) -> bool:
        return self.name == "exact"

    @property
    def fp64_accumulate(self) -> bool:
        return self.name != "official"

    @property
    def act_dtype(self) -> torch.dtype:
        return torch.float32 if self.exact else torch.bfloat16

    def round(self, x: torch.Tensor) -> torch.Tensor:
        """Round to the activation dtype (bf16; a no-op in exact mode)."""
        return x.to(self.act_dtype)

    def mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.fp64_accumulate:
            return (a.double() @ b.double()).float()    # .double() is free on fp64 operands
        return a.float() @ b.float()

    def fn(self, f, *xs: torch.Tensor) -> torch.Tensor:
        """fp32 result of an elementwise/softmax function. Invariant modes evaluate it in fp64 and
        round once: torch's vectorised and scalar (tail) code paths for exp, sigmoid, ... differ
        in the last ulp, so otherwise a row's value depends on where it sits in the tensor."""
        if self.fp64_accumulate:
            return f(*[x.double() for x in xs]).float()
        return f(*[x.float() for x in xs])

    def einsum(self, eq: str, *ops: torch.Tensor) -> torch.Tensor:
        if self.fp64_accumulate:
            return torch.einsum(eq, *[o.double() for o in ops]).float()
        return torch.einsum(eq, *[o.float() for o in ops])


MODES = ("official", "invariant", "exact")
OFFICIAL, INVARIANT, EXACT = Numerics("official"), Numerics("invariant"), Numerics("exact")
