#!/usr/bin/env python3
"""Experiment: the decode step's kernels as the CUDA graph runs them (programmatic dependent launch and the
side stream included), from a profiler trace of graph replays: each kernel's start and end inside the step, its
stream, the time in which it is the only kernel running ("sole" time), and how far its end lies past the latest
end before it ("incr": under PDL a kernel starts early and waits, so its length says little; along a serial chain
its increment is its share of the critical path). ``exp_decode_trace.py`` times eager calls one kernel at a time;
this is the view that says which kernels hold the step's critical path.

    PYTHONPATH=. python experiments/exp_graph_timeline.py --layers 4 --batch 1,4 --out /tmp/tl
    PYTHONPATH=. python experiments/exp_graph_timeline.py --parse /tmp/tl/b1.json     # again, offline

Writes ``<out>/b<B>.json`` (the Chrome trace) and prints, per batch: the step's span and busy time under the
profiler beside the graph time without it, the kernels of the median replay in start order (offset, length,
stream, sole time), the time no kernel runs, and the sole time summed by kernel name. A replay is found by the L2
flush that precedes it (a 256 MB fill kernel).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _kernels(path):
    with open(path) as f:
        tr = json.load(f)
    ev = [e for e in tr["traceEvents"] if e.get("cat") == "kernel" and e.get("ph") == "X"]
    return sorted(({"name": e["name"], "t0": float(e["ts"]), "t1": float(e["ts"]) + float(e["dur"]),
                    "stream": e.get("args", {}).get("stream", e.get("tid"))} for e in ev), key=lambda k: k["t0"])


def _is_flush(k):
    return ("fill" in k["name"].lower() or "memset" in k["name"].lower()) and k["t1"] - k["t0"] > 20


def _short(name, n=70):
    for cut in ("void ", "(anonymous namespace)::"):
        name = name.replace(cut, "")
    return name.split("<")[0].split("(")[0][:n]


def analyse(path, show=True):
    """Per replay (the kernels between two flushes): span, union busy time, and each kernel's sole time."""
    ks = _kernels(path)
    flushes = [i for i, k in enumerate(ks) if _is_flush(k)]
    reps = []
    for a, b in zip(flushes, flushes[1:] + [len(ks)]):
        body = [k for k in ks[a + 1:b] if not _is_flush(k)]
        if body:
            reps.append(body)
    if not reps:
        raise SystemExit(f"{path}: no replay found")
    spans = sorted((max(k["t1"] for k in r) - r[0]["t0"], i) for i, r in enumerate(reps))
    _, mid = spans[len(spans) // 2]
    body = reps[mid]
    t0 = body[0]["t0"]
    # sweep: sole time per kernel, idle time
    pts = sorted({k["t0"] for k in body} | {k["t1"] for k in body})
    sole = [0.0] * len(body)
    idle = busy = 0.0
    for lo, hi in zip(pts, pts[1:]):
        live = [j for j, k in enumerate(body) if k["t0"] <= lo and k["t1"] >= hi]
        if not live:
            idle += hi - lo
            continue
        busy += hi - lo
        if len(live) == 1:
            sole[live[0]] += hi - lo
    span = max(k["t1"] for k in body) - t0
    by = {}
    for k, s in zip(body, sole):
        n = _short(k["name"], 60)
        c, d, so = by.get(n, (0, 0.0, 0.0))
        by[n] = (c + 1, d + k["t1"] - k["t0"], so + s)
    if show:
        print(f"{path}: {len(reps)} replays, median span {span:.1f} us, {len(body)} kernels, busy {busy:.1f} us, "
              f"no kernel running {idle:.1f} us, sum of kernel lengths {sum(k['t1'] - k['t0'] for k in body):.1f} us")
        print(f"\n{'#':>3} {'start':>7} {'end':>7} {'len':>6} {'sole':>6} {'incr':>6} str  kernel   (incr: its end past the "
              f"latest end before it, its share of the critical path where the chain is serial)")
        prev_end = t0
        for j, (k, s) in enumerate(zip(body, sole)):
            incr = k["t1"] - prev_end
            prev_end = max(prev_end, k["t1"])
            print(f"{j:3d} {k['t0'] - t0:7.1f} {k['t1'] - t0:7.1f} {k['t1'] - k['t0']:6.1f} {s:6.1f} {incr:6.1f} "
                  f"{str(k['stream']):>4} {_short(k['name'])}")
        print(f"\n{'kernel':60s} {'calls':>5} {'sum len':>8} {'sum sole':>8}")
        for n, (c, d, so) in sorted(by.items(), key=lambda kv: -kv[1][2]):
            print(f"{n:60s} {c:5d} {d:8.1f} {so:8.1f}")
    return {"span": span, "busy": busy, "idle": idle, "by": by}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="flash")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--batch", default="1")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--replays", type=int, default=7)
    ap.add_argument("--out", default="/tmp/graph_timeline")
    ap.add_argument("--parse", default=None, help="analyse a trace written before (no GPU)")
    args = ap.parse_args()
    if args.parse:
        analyse(args.parse)
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.common import graph_time
    from benchmarks.decode_step import Slice
    if not torch.cuda.is_available():
        raise SystemExit("exp_graph_timeline: needs a CUDA GPU (or --parse a trace)")
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    batches = [int(b) for b in args.batch.split(",")]
    sl_ = Slice(args.model, args.layers, args.experts, dev, max(batches), args.ctx)
    model = sl_.model
    flush_buf = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    for B in batches:
        tokens, pos, sl, bt = sl_.inputs(B)
        with torch.no_grad():
            step = lambda: model(model.decode_context(tokens, pos, sl, bt))     # noqa: E731
            ms = graph_time(step)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    step()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step()
            for _ in range(3):
                flush_buf.fill_(1)
                g.replay()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.replays):
                    flush_buf.fill_(1)
                    g.replay()
                    torch.cuda.synchronize()
            path = os.path.join(args.out, f"b{B}.json")
            prof.export_chrome_trace(path)
            del g
        print(f"\n## batch {B}: graph time {ms * 1e3:.1f} us (L2 flushed, no profiler)")
        analyse(path)


if __name__ == "__main__":
    main()
