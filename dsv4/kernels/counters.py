"""Arrival counters for one-launch split reductions (the last program to arrive finishes the job).

Kernels that split a reduction over programs and let the last arriving program finish it (``mhc``'s
fused hc_pre / hc_head, ``fp8_mma``'s in-kernel split-K sum) count arrivals in an int32 counter per
output tile (``atomic_add``, acq_rel, gpu scope); the last arriver resets its counter to 0. So one
zeroed buffer serves every such launch with no memset launch, as long as the launches that share it
are stream-ordered. There is one buffer per device and stream role: the side stream of
``dsv4.streams`` (whose branches run concurrently with the current stream's work) has its own, every
other stream shares the main one (the engine's launches outside a branch are ordered on one stream).
``arrive`` is the Triton side: count a program in. ``indexer.index_topk`` keeps its per-row workspace
(counters, fields, histogram) in the same buffer across its launches; its last pass zeroes it.
"""
from __future__ import annotations

import torch

from .. import streams
from .lib import triton_available

_CNT_MIN = 1024       # counters kept per device (grown on demand)
_COUNTERS: dict = {}
_RETIRED: list = []   # outgrown buffers: captured CUDA graphs may still use them, never freed


def arrival_counters(device, n: int) -> torch.Tensor:
    """Zeroed int32 arrival counters, >= n of them, reused across calls and kernels (module doc).
    Inside a CUDA-graph capture with no large enough buffer yet, a fresh zeroed one is used (its
    memset is captured: correct at every replay)."""
    device = torch.device(device)
    key = str(device)
    if device.type == "cuda" and streams.on_side_stream(device):
        key += ":side"
    buf = _COUNTERS.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    fresh = torch.zeros(max(n, _CNT_MIN), dtype=torch.int32, device=device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return fresh
    if buf is not None:
        _RETIRED.append(buf)
    _COUNTERS[key] = fresh
    return fresh


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def arrive(CNT):
        """Count this program in on the counter CNT -> the count before it (the last of n programs sees
        n - 1). Its acquire sees the other programs' writes: every thread's writes precede the barrier,
        and thread 0's release covers them."""
        tl.debug_barrier()
        return tl.atomic_add(CNT, 1, sem="acq_rel", scope="gpu")


__all__ = ["arrival_counters"]
