"""A second CUDA stream for independent branches of a decode step (``DSV4_STREAMS``).

At decode sizes most kernels of a layer are latency-bound and occupy a fraction of the GPU, so two
chains that do not depend on each other (a CSA layer's compressor and indexer beside its q path, the
shared expert beside the routed ones) finish sooner side by side. ``Fork`` runs a branch on the
device's side stream: forked from the current stream (the side stream first waits for everything
enqueued so far), optionally synchronised again later (``sync``: the side stream waits for the main
stream's work since the fork), and joined before anything reads the branch's outputs (``join``: the
current stream waits for the side stream). Inside a CUDA-graph capture these waits become the
graph's edges, so a captured step runs the branches concurrently on every replay.

Contract for callers (the caching allocator frees by stream): a tensor written on one stream and read
on the other stays referenced until after ``join``; the values never depend on the order of the two
branches (each op reads only what its own branch, or the work before the fork / ``sync``, wrote), so
results are bit-identical with the side stream on or off.

Only steps of at most ``MAX_ROWS`` rows fork. There the branches' kernels are short and leave most
SMs idle; at 64 rows the shared expert beside the routed GEMMs slowed the step (measured on an H100,
docs/benchmarks-2026-12-06.md).

``DSV4_STREAMS``: unset / '1' / 'on' (the default): on for CUDA devices; '0' / 'off': every branch
runs on the current stream. ``STREAMS_ON`` and ``MAX_ROWS`` are read at each fork, so a benchmark can
compare settings in one process (graphs capture whichever was in force). CPU devices never fork.
"""
from __future__ import annotations

import contextlib
import os

import torch


def streams_mode() -> bool:
    mode = os.environ.get("DSV4_STREAMS", "").strip().lower()
    if mode in ("", "1", "on", "true"):
        return True
    if mode in ("0", "off", "false"):
        return False
    raise ValueError(f"DSV4_STREAMS={mode!r}: expected 1 / on (the default) or 0 / off")


STREAMS_ON = streams_mode()
MAX_ROWS = 16
_SIDE: dict[int, torch.cuda.Stream] = {}


def side_stream(dev: torch.device, rows: int) -> "torch.cuda.Stream | None":
    """The device's side stream, or None where branches run inline (CPU, ``STREAMS_ON`` false, a step
    of more than ``MAX_ROWS`` rows)."""
    if not STREAMS_ON or dev.type != "cuda" or rows > MAX_ROWS:
        return None
    i = dev.index if dev.index is not None else torch.cuda.current_device()
    s = _SIDE.get(i)
    if s is None:
        s = _SIDE[i] = torch.cuda.Stream(device=i)
    return s


def on_side_stream(dev: torch.device) -> bool:
    """Whether work launched now on CUDA device ``dev`` goes to its side stream (inside a ``Fork.side()``)."""
    s = _SIDE.get(dev.index if dev.index is not None else torch.cuda.current_device())
    return s is not None and torch.cuda.current_stream(s.device) == s


class Fork:
    """One branch on the side stream (module doc) of a step of ``rows`` rows: ``f = Fork(dev, rows)``,
    ``with f.side(): ...`` (any number of times, each continuing the branch), ``f.sync()``,
    ``f.join()``. Inline (no stream work at all) where ``side_stream`` is None."""

    def __init__(self, dev: torch.device, rows: int):
        self.s = side_stream(dev, rows)
        self.main = None
        if self.s is not None:
            self.main = torch.cuda.current_stream(self.s.device)
            self.s.wait_stream(self.main)

    def side(self):
        return torch.cuda.stream(self.s) if self.s is not None else contextlib.nullcontext()

    def sync(self) -> None:
        """The branch's next work waits for what the main stream enqueued since the fork."""
        if self.s is not None:
            self.s.wait_stream(self.main)

    def join(self) -> None:
        if self.s is not None:
            self.main.wait_stream(self.s)
            self.s = None


__all__ = ["Fork", "MAX_ROWS", "STREAMS_ON", "on_side_stream", "side_stream", "streams_mode"]
