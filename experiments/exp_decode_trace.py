#!/usr/bin/env python3
"""Experiment: the GPU kernels of one decode-step layer in launch order, with each one's duration
(torch.profiler, eager calls of ``model.layers[i]``), next to the layer's CUDA-graph time (L2 flushed):
the per-kernel view behind ``benchmarks/decode_step.py --profile-layer`` (which sums by name), so that
every launch can be tied to its op and its bytes.

    PYTHONPATH=. python experiments/exp_decode_trace.py --layers 4 --trace 0,2,3 --batch 1 [--experts 256]
    ncu --profile-from-start off --clock-control none --section ... python experiments/exp_decode_trace.py ... --ncu
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import graph_time  # noqa: E402
from benchmarks.decode_step import Slice, layer_bytes  # noqa: E402
from benchmarks.common import roofline  # noqa: E402


def trace(fn, reps=5):
    """[(kernel name, us)] of one call of fn in launch order (median over reps calls)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
            torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    n = len(ev) // reps
    calls = [ev[i * n:(i + 1) * n] for i in range(reps)]
    out = []
    for j in range(n):
        ts = sorted(c[j].time_range.elapsed_us() for c in calls)
        out.append((calls[0][j].name, ts[reps // 2]))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="flash")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--batch", default="1")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--trace", default="0,2,3")
    ap.add_argument("--ncu", action="store_true",
                    help="instead of the timing and the trace: one eager call of each traced layer inside "
                         "cudaProfilerStart / Stop, for `ncu --profile-from-start off` (hardware counters per kernel)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    batches = [int(b) for b in args.batch.split(",")]
    sl_ = Slice(args.model, args.layers, args.experts, dev, max(batches), args.ctx)
    cfg, model = sl_.cfg, sl_.model
    copy_bw, _ = roofline(dev, False)
    for B in batches:
        tokens, pos, sl, bt = sl_.inputs(B)
        with torch.no_grad():
            h0 = torch.nn.functional.embedding(tokens, model.embed).unsqueeze(1).repeat(1, cfg.hc_mult, 1)
            ctx = model.decode_context(tokens, pos, sl, bt)
            ctx.meta = model._meta(ctx)
            for i in [int(x) for x in args.trace.split(",")]:
                if args.ncu:    # no CUDA-graph timing or torch.profiler here: ncu holds the profiling interface
                    for _ in range(2):
                        model.layers[i](h0, ctx)
                    torch.cuda.synchronize()
                    torch.cuda.cudart().cudaProfilerStart()
                    model.layers[i](h0, ctx)
                    torch.cuda.synchronize()
                    torch.cuda.cudart().cudaProfilerStop()
                    print(f"batch {B} layer {i}: profiled one eager call")
                    continue
                g = graph_time(lambda i=i: model.layers[i](h0, ctx)) * 1e3
                fl = layer_bytes(model, cfg, i, B, args.ctx, cfg.compress_ratios[i]) / copy_bw * 1e6
                tr = trace(lambda i=i: model.layers[i](h0, ctx))
                tot = sum(t for _, t in tr)
                print(f"\n## batch {B} layer {i} (ratio {cfg.compress_ratios[i]}): graph {g:.1f} us, floor {fl:.1f} us, "
                      f"{len(tr)} kernels summing to {tot:.1f} us (eager)")
                for k, (name, t) in enumerate(tr):
                    print(f"{k:3d} {t:7.1f}  {name[:110]}")


if __name__ == "__main__":
    main()
