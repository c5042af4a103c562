#!/usr/bin/env python3
"""Experiment: tiles of the split-K Triton FP8 GEMM (``gemm._fp8_gemm_kernel``) for the 32-128 MB decode
linears (wq_b, wo_b), which ``fp8_linear`` keeps on that kernel (``fp8_mma`` lost there, session 7).

    PYTHONPATH=. python experiments/exp_fp8_big_decode.py          # H200, < 5 min
    PYTHONPATH=. python experiments/exp_fp8_big_decode.py --rule   # the default tile against BN 64 on
                                                                  # every V4-Pro linear it changed

For each linear and row count: the default tile and a sweep over BN, warps, stages and the split count
(the default split and twice it), each checked against the fp64 product of the quantised operands
(rel err < 5e-3) and timed with ``benchmarks.common.graph_time`` (CUDA graph, L2 flushed). % copy =
(weight + scale + activation + output bytes) / time / copy bandwidth.

H200 (session 13, docs/benchmarks-2026-12-01.md): the Flash defaults were already the fastest tiles (wq_b 14.7 us, wo_b
14.0 at one row); on Pro 128 columns won at one row (wq_b 36.4 -> 29.1 us, wo_b 50.7 -> 40.1), hence
``gemm._fp8_config``'s rule (N > 4096 and K >= 1536 -> 128 columns at <= 16 rows); ``--rule`` then timed
every Pro linear it changes: better or equal except the indexer's wq_b (8192 x 1536: 9.0 -> 9.2 us).
"""
from __future__ import annotations

import itertools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import graph_time, roofline  # noqa: E402
from benchmarks.gemm_moe import fp8_case, fp8_check  # noqa: E402
from dsv4.kernels.gemm import fp8 as G8, route as GR  # noqa: E402
from benchmarks.common import fp8_linear  # noqa: E402
from dsv4.kernels.lib import target  # noqa: E402

SHAPES = [("Flash wq_b", 32768, 1024), ("Flash wo_b", 4096, 8192), ("Pro wq_b", 65536, 1536),
          ("Pro wo_b", 7168, 16384)]
BUDGET_S = 270.0


OLD_TILE = dict(BM=16, BN=64, GROUP_M=8, num_warps=4, num_stages=3)   # before session 13 (N > 4096, M <= 16)
RULE_SHAPES = [("Pro wq_b", 65536, 1536), ("Pro wo_b", 7168, 16384), ("Pro indexer wq_b", 8192, 1536),
               ("Pro shared w2", 7168, 3072), ("Pro shared w1|w3 (partials)", 6144, 7168)]


def rule():
    """Every V4-Pro decode linear whose default tile went from 64 to 128 columns, old vs new (M <= 16)."""
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(1)
    print("| linear | M | BN 64 (old) us | default (BN 128) us | rel err |\n|---|---|---|---|---|")
    for (name, N, K), M in itertools.product(RULE_SHAPES, (1, 4, 16)):
        x, xq, xs, wq, ws = fp8_case(M, N, K, dev, gen)
        if "partials" in name:          # timed alone; checked summed
            def run(cfg=None):
                return G8.fp8_gemm_partials(xq, xs, wq, ws, config=cfg)

            def value(cfg=None):
                return run(cfg).sum(0)
        else:
            def run(cfg=None):
                return fp8_linear(x, wq, ws, config=cfg)
            value = run
        err = max(fp8_check(value(), xq, xs, wq, ws), fp8_check(value(OLD_TILE), xq, xs, wq, ws))
        t_old = graph_time(lambda: run(OLD_TILE)) * 1e3
        t_new = graph_time(run) * 1e3
        print(f"| {name} {N}x{K} | {M} | {t_old:.1f} | {t_new:.1f} | {err:.1e} |", flush=True)


def main():
    if "--rule" in sys.argv:
        rule()
        return
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    copy_bw, _ = roofline(dev, False)
    t0 = time.time()
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    print("| linear | M | default us (% copy) | best (sweep) | us (% copy) | 2nd | 3rd |")
    print("|---|---|---|---|---|---|---|")
    for (name, N, K), M in itertools.product(SHAPES, (1, 64)):
        if time.time() - t0 > BUDGET_S:
            print(f"(time budget reached: {name} M{M} and later not run)")
            break
        x, xq, xs, wq, ws = fp8_case(M, N, K, dev, gen)
        nbytes = wq.numel() + ws.numel() * 4 + x.numel() * 2 + M * N * 2
        bm = 16 if M <= 16 else 64
        tiles = {}
        for bn, w, st in itertools.product((32, 64, 128, 256), (4, 8), (3, 4, 6)):
            if bm == 64 and bn == 256:
                continue
            base = GR.fp8_split_k(M, N, K, bm, bn, target(dev))
            for s in sorted({base, 2 * base}):
                tiles[f"bn{bn}.w{w}.s{st}.k{s}"] = dict(BM=bm, BN=bn, GROUP_M=8, num_warps=w, num_stages=st, SPLIT_K=s)
        res = {}
        for cname, fn in [("default", lambda: fp8_linear(x, wq, ws))] + [
                (c, lambda cfg=cfg: fp8_linear(x, wq, ws, config=cfg)) for c, cfg in tiles.items()]:
            try:
                err = fp8_check(fn(), xq, xs, wq, ws)
                if err < 5e-3:
                    res[cname] = graph_time(fn) * 1e3
                else:
                    print(f"  {name} M{M} {cname}: WRONG (rel err {err:.1e})", flush=True)
            except Exception as e:                      # e.g. out of shared memory for a tile
                print(f"  {name} M{M} {cname}: failed {type(e).__name__}: {str(e)[:120]}", flush=True)
        order = sorted((k for k in res if k != "default"), key=res.get)

        def pct(us):
            return 100 * nbytes / copy_bw / (us * 1e-6)
        print(f"| {name} {N}x{K} | {M} | {res['default']:.1f} ({pct(res['default']):.0f}) | {order[0]} | "
              f"{res[order[0]]:.1f} ({pct(res[order[0]]):.0f}) | {order[1]} {res[order[1]]:.1f} | "
              f"{order[2]} {res[order[2]]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
