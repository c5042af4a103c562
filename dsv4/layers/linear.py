"""Linear layers that own their weights as the checkpoint stores them (spec §3, §11.1).

* ``Fp8Linear``: e4m3 codes ``weight [N, K]`` + the 128x128 block scales as fp32 ``scale
  [ceil(N/128), K/128]`` (the e8m0 values, widened once at load: the kernels read fp32 scales).
* ``Bf16Linear``: a bf16 ``weight [N, K]``; ``kind`` says how the official code runs it: ``"fp32"``
  (fp32 GEMM of bf16 operands: head, compressor wkv / wgate) or ``"bf16"`` (bf16 linear, bf16 out:
  indexer weights_proj).

A linear may merge several checkpoint linears that read the same input (``members``: names and
output sizes, concatenated along N), loaded part by part into one tensor: one GEMM on a GPU; the
CPU twin still computes each member on its own rows, so its bits are the reference's.

``forward`` goes through the op table (``dsv4.ops``): the FP8 / bf16 GEMM kernels on a GPU, their
torch twins on a CPU. Weight loading is per parameter: ``loaders(prefix_of)`` maps each canonical
checkpoint tensor name to a function that copies that tensor into its slice (a rank that holds a
slice of a linear can register only the names it needs).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..formats.fp8 import e8m0_to_fp32

QBLOCK = 128
Loader = Callable[[torch.Tensor], None]


def _copy(dst: torch.Tensor, what: str) -> Loader:
    def load(t: torch.Tensor) -> None:
        if tuple(t.shape) != tuple(dst.shape):
            raise ValueError(f"{what}: expected shape {tuple(dst.shape)}, got {tuple(t.shape)}")
        if dst.dtype == torch.float32 and t.dtype in (torch.float8_e8m0fnu, torch.uint8):
            t = e8m0_to_fp32(t)
        dst.copy_(t)
    return load


class _Linear(nn.Module):
    kind = ""

    def __init__(self, in_features: int, members: list[tuple[str, int]], ops):
        super().__init__()
        self.in_features = in_features
        self.members = [(n, int(o)) for n, o in members]
        self.out_features = sum(o for _, o in self.members)
        self.ops = ops

    def spans(self):
        """(member name, first output row, last output row + 1)."""
        r = 0
        for n, o in self.members:
            yield n, r, r + o
            r += o

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(self, x)


class Fp8Linear(_Linear):
    kind = "fp8"

    def __init__(self, in_features: int, members: list[tuple[str, int]], ops, device=None):
        super().__init__(in_features, members, ops)
        if in_features % QBLOCK:
            raise ValueError(f"FP8 linear {members[0][0]}: in_features={in_features} is not a multiple of 128")
        for n, o in self.members[:-1]:
            if o % QBLOCK:
                raise ValueError(f"FP8 linear {n}: {o} output rows cannot be merged (not a multiple of 128)")
        N = self.out_features
        self.register_buffer("weight", torch.empty(N, in_features, dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("scale", torch.empty(-(-N // QBLOCK), in_features // QBLOCK, dtype=torch.float32,
                                                  device=device))

    def loaders(self) -> dict[str, Loader]:
        out = {}
        for n, a, b in self.spans():
            out[n + ".weight"] = _copy(self.weight[a:b], n + ".weight")
            out[n + ".scale"] = _copy(self.scale[a // QBLOCK:-(-b // QBLOCK)], n + ".scale")
        return out


class Bf16Linear(_Linear):
    def __init__(self, in_features: int, members: list[tuple[str, int]], ops, kind: str, device=None):
        super().__init__(in_features, members, ops)
        if kind not in ("fp32", "bf16"):
            raise ValueError(f"Bf16Linear kind must be 'fp32' or 'bf16', got {kind!r}")
        self.kind = kind
        self.register_buffer("weight", torch.empty(self.out_features, in_features, dtype=torch.bfloat16,
                                                   device=device))

    def loaders(self) -> dict[str, Loader]:
        return {n + ".weight": _copy(self.weight[a:b], n + ".weight") for n, a, b in self.spans()}


class GroupedFp8(nn.Module):
    """``attn.wo_a``: G grouped projections [G * R, D_g] stored as one FP8 linear (released form)
    or bf16 (convert.py form); ``forward(o [T, G, D_g]) -> [T, G, R]`` bf16, the official bf16
    einsum (``ops.wo_a``)."""

    def __init__(self, name: str, groups: int, rank: int, in_per_group: int, ops, fmt: str, device=None):
        super().__init__()
        self.groups, self.rank, self.ops, self.fmt = groups, rank, ops, fmt
        self.lin = (Fp8Linear(in_per_group, [(name, groups * rank)], ops, device) if fmt == "fp8" else
                    Bf16Linear(in_per_group, [(name, groups * rank)], ops, "bf16", device))

    def loaders(self) -> dict[str, Loader]:
        return self.lin.loaders()

    def forward(self, o: torch.Tensor) -> torch.Tensor:
        return self.ops.wo_a(self, o)


def weight_bytes(module: nn.Module) -> int:
    """Bytes of every tensor a module holds (buffers and parameters)."""
    return sum(t.numel() * t.element_size() for t in list(module.buffers()) + list(module.parameters()))
