#!/usr/bin/env python3
"""Experiment: read bandwidth out of L2 against out of HBM, on the GPU at hand.

The question it settles (docs/benchmarks-2026-12-07.md, "The prefill expert GEMM's load bound"): whether
``fp4_fp8_ws``'s loads-alone probe, ~15 GB in 1.77 ms (~8.5 TB/s) with the activation tiles re-read once per
64-column n-tile, runs at the H100's L2 read bound.

A Triton kernel, one program per SM times ``--waves``, each program summing ``--passes`` sweeps of 16-byte loads
over its own slice of a buffer of ``--sizes`` MB (every program's slice covers the buffer once per pass together
with the others'). Buffers well under L2's capacity (50 MB on H100 / H200) stay resident after the first pass;
1024 MB reads from HBM. Times: CUDA events over one launch after a warm-up launch (no flush: the point is the
resident case), median of ``--reps``.

    PYTHONPATH=. python experiments/exp_l2_read.py [--sizes 4,8,16,24,32,48,1024] [--passes 16]
"""
from __future__ import annotations

import argparse
import statistics

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:
    @triton.jit
    def _sweep(X, OUT, n_per_prog, passes, BLOCK: tl.constexpr):
        """Sum of ``passes`` sweeps over this program's ``n_per_prog`` int32 words (BLOCK a step, 4 per thread:
        16-byte loads), stored so the loads are not dead code."""
        pid = tl.program_id(0)
        base = X + pid.to(tl.int64) * n_per_prog
        acc = tl.zeros([BLOCK], tl.int32)
        for _ in range(passes):
            for i in range(0, n_per_prog, BLOCK):
                acc += tl.load(base + i + tl.arange(0, BLOCK))
        tl.store(OUT + pid, tl.sum(acc, axis=0))


def _time(fn, reps: int) -> float:
    """Median ms of ``fn()`` over ``reps`` launches (CUDA events), after one warm-up launch."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4,8,16,24,32,48,1024", help="buffer sizes in MB")
    ap.add_argument("--passes", type=int, default=16, help="sweeps over the buffer per launch")
    ap.add_argument("--waves", type=int, default=4, help="programs per SM")
    ap.add_argument("--warps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    if triton is None or not torch.cuda.is_available():
        raise SystemExit("exp_l2_read: needs a CUDA GPU and triton")
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    block = 4 * 32 * args.warps                 # int32 words: 16 bytes a thread a step
    progs = sms * args.waves
    print(f"{torch.cuda.get_device_name()}: {sms} SMs, {progs} programs of {args.warps} warps, "
          f"{args.passes} passes a launch")
    print("| buffer MB | passes | bytes read GB | ms | TB/s |")
    print("|---|---|---|---|---|")
    for mb in (int(s) for s in args.sizes.split(",")):
        per = max(block, (mb * 2 ** 20 // 4 // progs) // block * block)
        x = torch.ones(progs * per, dtype=torch.int32, device=dev)
        out = torch.empty(progs, dtype=torch.int32, device=dev)
        passes = args.passes if mb < 256 else 1
        ms = _time(lambda: _sweep[(progs,)](x, out, per, passes, BLOCK=block, num_warps=args.warps), args.reps)
        assert int(out[0]) == per * passes, "the sweep's sum is off"
        gb = x.numel() * 4 * passes / 1e9
        print(f"| {x.numel() * 4 / 2 ** 20:.0f} | {passes} | {gb:.2f} | {ms:.3f} | {gb / ms:.2f} |")


if __name__ == "__main__":
    main()
