#!/usr/bin/env python3
"""Experiment: the indexer top-k's one-program rows (``indexer._topk_single``, the decode step's CSA layers): the
selection (two histograms, prefix sums, the picks sorted) against the whole row sorted (``FULL``), at 8 and 16 warps,
CUDA-graph replays with the L2 flushed (``benchmarks.common.graph_time``), us per call; every variant's output checked
against the selection's at 8 warps.

    PYTHONPATH=. python experiments/exp_topk_single.py
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import graph_time  # noqa: E402


def main():
    if not torch.cuda.is_available():
        raise SystemExit("exp_topk_single: needs a CUDA GPU")
    import triton

    from dsv4.kernels import indexer as ix
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    variants = [(False, 8), (True, 8), (False, 16), (True, 16)]
    print("| B | N | k | " + " | ".join(f"{'full sort' if f else 'select'} w{w} us" for f, w in variants) + " |")
    print("|---|---|---|---|---|---|---|")
    for B, N, k in ((1, 2048, 512), (1, 4096, 512), (4, 2048, 512)):
        sc = torch.randn(B, N, device=dev, generator=gen).bfloat16()
        nv = torch.full((B,), N, dtype=torch.int32, device=dev)
        KP = max(16, triton.next_power_of_2(k))
        out = torch.empty(B, k, dtype=torch.int32, device=dev)
        buf = torch.empty(B, KP, dtype=torch.int64, device=dev)
        s16 = sc.view(torch.int16)

        def run(full, warps):
            ix._topk_single[(B,)](s16, nv, buf, out, N, k, s16.stride(0), out.stride(0), KP=KP,
                                  TILE=max(16, triton.next_power_of_2(N)), HAS_NV=True, FULL=full, num_warps=warps)
        run(False, 8)
        ref = out.clone()
        row = []
        for full, warps in variants:
            out.zero_()
            run(full, warps)
            assert torch.equal(out, ref), f"full {full} w{warps} differs at B {B} N {N}"
            row.append(graph_time(lambda f=full, w=warps: run(f, w)) * 1e3)
        print(f"| {B} | {N} | {k} | " + " | ".join(f"{t:.1f}" for t in row) + " |")


if __name__ == "__main__":
    main()
