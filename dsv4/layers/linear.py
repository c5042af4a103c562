"""Linear layers that own their weights as the checkpoint stores them (spec §3, §11.1).

* ``Fp8Linear``: e4m3 codes ``weight [N, K]`` + the 128x128 block scales as fp32 ``scale
  [ceil(N/128), K/128]`` (the e8m0 values, widened once at load: the kernels read fp32 scales).
* ``Bf16Linear``: a bf16 ``weight [N, K]``; ``kind`` says how the official code runs it: ``"fp32"``
  (fp32 GEMM of bf16 operands: head, compressor wkv / wgate) or ``"bf16"`` (bf16 linear, bf16 out:
  indexer weights_proj).

A linear may merge several checkpoint linears that read the same input (``members``: names and
output sizes, concatenated along N), loaded part by part into one tensor: one GEMM on a GPU; the
CPU twin still computes each member on its own rows, so its bits are the reference's.

``split`` (``dsv4.parallel.Split``, None for one rank): the rank holds only its slice, cut as the
official ColumnParallel / RowParallel linears cut: ``"col"`` keeps 1/world of every member's output
rows (``members`` and ``spans`` are then the local ones), ``"row"`` 1/world of the input columns
(the output is a partial sum; the layer that owns the linear all-reduces it). The loaders take the
checkpoint's whole tensor, check its full shape and copy the rank's slice; a reader that reads only
the slice from disk passes it to the loader's ``presliced`` form (``copy_part``).

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


def copy_into(dst: torch.Tensor, what: str) -> Loader:
    def load(t: torch.Tensor) -> None:
        if tuple(t.shape) != tuple(dst.shape):
            raise ValueError(f"{what}: expected shape {tuple(dst.shape)}, got {tuple(t.shape)}")
        if dst.dtype == torch.float32 and t.dtype in (torch.float8_e8m0fnu, torch.uint8):
            t = e8m0_to_fp32(t)
        dst.copy_(t)
    return load


def copy_part(dst: torch.Tensor, what: str, full: tuple, rows=None, cols=None) -> Loader:
    """Loader of a slice: the checkpoint tensor must have the ``full`` shape; its ``rows`` / ``cols``
    ([start, stop) or None = all) go into ``dst``. The loader carries its ``part`` (rows, cols) and
    a ``presliced`` loader that takes that part alone, so that a reader can read only the part from
    disk (``checkpoint.loader.CheckpointReader.tensors(parts=...)``, which checked the full shape
    against the schema when the checkpoint was opened)."""
    def load(t: torch.Tensor) -> None:
        if tuple(t.shape) != tuple(full):
            raise ValueError(f"{what}: expected shape {tuple(full)}, got {tuple(t.shape)}")
        if rows is not None:
            t = t[rows[0]:rows[1]]
        if cols is not None:
            t = t[:, cols[0]:cols[1]]
        copy_into(dst, what)(t)
    load.part = (rows, cols)
    load.presliced = copy_into(dst, what)
    return load


class _Linear(nn.Module):
    kind = ""
    align = 1                  # a split must fall on multiples of this (FP8: the 128x128 scale blocks)

    def __init__(self, in_features: int, members: list[tuple[str, int]], ops, split=None):
        super().__init__()
        self.full_in = in_features
        self.full_members = [(n, int(o)) for n, o in members]
        self.cols = None
        if split is not None and split.kind == "row":
            self.cols = split.part(in_features, f"{members[0][0]} input columns", self.align)
            in_features = self.cols[1] - self.cols[0]
        self.row_parts = None
        if split is not None and split.kind == "col":
            self.row_parts = [split.part(o, f"{n} output rows", self.align) for n, o in self.full_members]
            members = [(n, b - a) for (n, _), (a, b) in zip(self.full_members, self.row_parts)]
        self.in_features = in_features
        self.members = [(n, int(o)) for n, o in members]
        self.out_features = sum(o for _, o in self.members)
        self.ops = ops

    def _loads(self, dst_of):
        """{name: loader} per member; ``dst_of(local first row, local last row)`` -> (weight rows,
        scale rows or None) of this rank's storage; each loader reads its part of the checkpoint
        tensor."""
        out = {}
        for i, (n, a, b) in enumerate(self.spans()):
            o_full = self.full_members[i][1]
            rows = None if self.row_parts is None else self.row_parts[i]
            w, sc = dst_of(a, b)
            out[n + ".weight"] = copy_part(w, n + ".weight", (o_full, self.full_in), rows, self.cols)
            if sc is not None:
                blk = lambda r: None if r is None else (r[0] // QBLOCK, -(-r[1] // QBLOCK))
                out[n + ".scale"] = copy_part(sc, n + ".scale", (-(-o_full // QBLOCK), self.full_in // QBLOCK),
                                               blk(rows), blk(self.cols))
        return out

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
    align = QBLOCK

    def __init__(self, in_features: int, members: list[tuple[str, int]], ops, device=None, split=None):
        super().__init__(in_features, members, ops, split)
        in_features = self.in_features
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
        return self._loads(lambda a, b: (self.weight[a:b], self.scale[a // QBLOCK:-(-b // QBLOCK)]))


class Bf16Linear(_Linear):
    def __init__(self, in_features: int, members: list[tuple[str, int]], ops, kind: str, device=None, split=None):
        super().__init__(in_features, members, ops, split)
        in_features = self.in_features
        if kind not in ("fp32", "bf16"):
            raise ValueError(f"Bf16Linear kind must be 'fp32' or 'bf16', got {kind!r}")
        self.kind = kind
        self.register_buffer("weight", torch.empty(self.out_features, in_features, dtype=torch.bfloat16,
                                                   device=device))

    def loaders(self) -> dict[str, Loader]:
        return self._loads(lambda a, b: (self.weight[a:b], None))


class GroupedFp8(nn.Module):
    """``attn.wo_a``: G grouped projections [G * R, D_g] stored as one FP8 linear (released form)
    or bf16 (convert.py form); ``forward(o [T, G, D_g]) -> [T, G, R]`` bf16, the official bf16
    einsum (``ops.wo_a``)."""

    def __init__(self, name: str, groups: int, rank: int, in_per_group: int, ops, fmt: str, device=None,
                 split=None):
        """``split`` ('col'): this rank keeps groups [r*G/world, (r+1)*G/world), the groups of its heads."""
        super().__init__()
        if split is not None and groups % split.world:
            raise ValueError(f"{name}: {groups} groups cannot be split over {split.world} ranks")
        self.groups = groups // (split.world if split is not None else 1)
        self.rank, self.ops, self.fmt = rank, ops, fmt
        self.lin = (Fp8Linear(in_per_group, [(name, groups * rank)], ops, device, split) if fmt == "fp8" else
                    Bf16Linear(in_per_group, [(name, groups * rank)], ops, "bf16", device, split))

    def loaders(self) -> dict[str, Loader]:
        return self.lin.loaders()

    def forward(self, o: torch.Tensor) -> torch.Tensor:
        return self.ops.wo_a(self, o)


def weight_bytes(module: nn.Module) -> int:
    """Bytes of every tensor a module holds (buffers and parameters)."""
    return sum(t.numel() * t.element_size() for t in list(module.buffers()) + list(module.parameters()))
