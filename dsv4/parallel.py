"""Tensor / expert parallelism: which slice of a layer a rank holds, and the collectives.

``Split(kind, rank, world)`` describes how one linear is cut over ``world`` ranks, as DeepSeek's
official ``inference/model.py`` cuts them: ``"col"`` (ColumnParallelLinear: output rows split,
each rank computes its rows; merged members are split member by member) or ``"row"``
(RowParallelLinear: input columns split, each rank's output is a partial sum that the layer
all-reduces). FP8 weights carry 128x128 block scales, so every cut must fall on a 128 boundary;
a cut that does not is an error that names the tensor.

``Group`` wraps a ``torch.distributed`` process group (NCCL on GPUs, gloo on CPUs); ``SINGLE`` is
the one-rank group, whose collectives return their input. A one-rank process group skips its
collectives too (their result is their input), unless built with ``always=True``: then they run,
so that one GPU can exercise the collective path (NCCL calls inside CUDA graphs, the layers'
partial-sum forms) that N ranks take. ``set_default_group`` names the group a model gets when it is
given none (``DeepseekV4``): the test suite runs under a one-rank NCCL / gloo group that way
(``DSV4_TEST_PROCESS_GROUP``, tests/conftest.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Split:
    kind: str                  # 'col' | 'row'
    rank: int
    world: int

    def __post_init__(self):
        if self.kind not in ("col", "row"):
            raise ValueError(f"Split kind must be 'col' or 'row', got {self.kind!r}")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"Split rank {self.rank} is not in [0, {self.world})")

    def part(self, n: int, what: str, align: int = 1) -> tuple[int, int]:
        """This rank's [start, stop) of ``n`` items; ``n`` must split into ``world`` equal parts
        that are multiples of ``align``."""
        if n % self.world or (n // self.world) % align:
            raise ValueError(f"{what}: {n} cannot be split into {self.world} equal parts"
                             + (f" of a multiple of {align}" if align > 1 else ""))
        k = n // self.world
        return self.rank * k, (self.rank + 1) * k


class Group:
    """The ranks one model is split over. ``pg`` None: one rank, no collectives."""

    def __init__(self, pg=None, always: bool = False):
        self.pg = pg
        if pg is None:
            self.rank, self.world = 0, 1
        else:
            import torch.distributed as dist
            self.rank, self.world = dist.get_rank(pg), dist.get_world_size(pg)
        # whether the collectives run (module doc): N ranks, or one rank with ``always``
        self.active = pg is not None and (self.world > 1 or always)

    def __repr__(self) -> str:
        return f"Group(rank={self.rank}, world={self.world}, active={self.active})"

    def split(self, kind: str) -> Split | None:
        """The ``Split`` of this rank, or None for one rank (layers then hold whole tensors)."""
        return None if self.world == 1 else Split(kind, self.rank, self.world)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (the official RowParallelLinear's ``dist.all_reduce``)."""
        if self.active:
            import torch.distributed as dist
            dist.all_reduce(x, group=self.pg)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' ``x`` concatenated along ``dim``, in rank order."""
        if not self.active:
            return x
        import torch.distributed as dist
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.pg)
        return torch.cat(parts, dim=dim)


SINGLE = Group()
_default = SINGLE


def set_default_group(group: Group | None) -> None:
    """The group models get when built without one (None: back to ``SINGLE``)."""
    global _default
    _default = group or SINGLE


def default_group() -> Group:
    return _default


def free_port() -> int:
    """A free local TCP port (a rendezvous address for ranks on this machine)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_rank_group(device) -> Group:
    """Initialise this process as the only rank of the default process group (NCCL on a CUDA
    ``device``, gloo on a CPU) and return it with its collectives on (``always``). One collective
    runs now: NCCL builds its communicator at the first call, which must not be inside a capture."""
    import torch.distributed as dist
    device = torch.device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    dist.all_reduce(torch.zeros(1, device=device))
    return Group(dist.group.WORLD, always=True)


__all__ = ["Group", "SINGLE", "Split", "default_group", "free_port", "one_rank_group", "set_default_group"]
