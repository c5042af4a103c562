"""Experiment (session 5): how much of hc_pre's time at decode sizes is the 20-iteration Sinkhorn?
hc_pre with iters=20 vs iters=1 and hc_head (no Sinkhorn), CUDA-graph timed, L2 flushed.

    PYTHONPATH=. python experiments/exp_hc_iters.py
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import graph_time  # noqa: E402
from dsv4.kernels.mhc import hc_head, hc_pre  # noqa: E402


def main():
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    for D in (4096, 7168):
        for T in (1, 64, 256):
            x = torch.randn(T, 4, D, device=dev, generator=gen).bfloat16()
            fn = torch.randn(24, 4 * D, device=dev, generator=gen) * 0.01
            base = torch.randn(24, device=dev, generator=gen) * 0.1
            scale = torch.rand(3, device=dev, generator=gen)
            t20 = graph_time(lambda: hc_pre(x, fn, base, scale, 20)) * 1e3
            t1 = graph_time(lambda: hc_pre(x, fn, base, scale, 1)) * 1e3
            fn4, base4, scale1 = fn[:4].contiguous(), base[:4].contiguous(), scale[:1].contiguous()
            th = graph_time(lambda: hc_head(x, fn4, base4, scale1)) * 1e3     # one fn: its bf16x3 split is cached
            print(f"| d{D} | {T} | {t20:.1f} | {t1:.1f} | {th:.1f} |", flush=True)


if __name__ == "__main__":
    print("| dim | T | hc_pre iters=20 us | hc_pre iters=1 us | hc_head us |\n|---|---|---|---|---|")
    main()
