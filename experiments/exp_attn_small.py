"""Sparse decode attention at batch 1-16 (H200): heads per program, entries per block, warps.

    PYTHONPATH=. python experiments/exp_attn_small.py

Per case (V4-Flash 64 / V4-Pro 128 heads; window only, CSA window + 512 picks, HCA window + 64
entries at ctx 8192): us per call (CUDA-graph replays, L2 flushed), the max difference to the
default's output (d), the relative error against the torch twin (e) and the split count (s).
Session 12: ~15 us whatever the config at 1-16 rows (docs/benchmarks-2026-12-01.md)."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))  # attention.py's `common`
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dsv4.kernels.sparse_attention as sa  # noqa: E402
from benchmarks.attention import decode_case, relerr, run_torch, run_triton  # noqa: E402
from benchmarks.common import graph_time  # noqa: E402
dev = torch.device("cuda")
gen = torch.Generator(device=dev).manual_seed(0)
cfgs = [("default", {}),
        ("h32.w4", dict(block_h=32, num_warps=4)), ("h16.w4", dict(block_h=16, num_warps=4)),
        ("h16.w2", dict(block_h=16, num_warps=2)),
        ("h64.bn32", dict(block_n=32)), ("h32.bn32.w4", dict(block_h=32, block_n=32, num_warps=4)),
        ("h16.bn32.w4", dict(block_h=16, block_n=32, num_warps=4))]
for H in (64, 128):
    for kind, topk in (("window", 0), ("csa", 512), ("hca", 0)):
        for b in (1, 2, 4, 8, 16):
            c = decode_case("csa" if kind == "csa" else "hca", H, topk, b, 8192, 1, dev, gen)
            if kind == "window":
                c["eidx"] = None
            ref = run_torch(c) if kind != "window" else None
            base = run_triton(c, {})
            row = []
            for name, cfg in cfgs:
                try:
                    o = run_triton(c, cfg)
                    d = (o.float() - base.float()).abs().max().item()
                    err = relerr(o, ref) if ref is not None else float("nan")
                    us = graph_time(lambda: run_triton(c, cfg)) * 1e3
                    row.append(f"{name} {us:6.1f} (d{d:.0e} e{err:.0e} s{sa.LAST_LAUNCH['num_splits']})")
                except Exception as e:
                    row.append(f"{name} FAIL {type(e).__name__}")
            print(f"H{H} {kind:6s} B{b:3d} | " + " | ".join(row), flush=True)
