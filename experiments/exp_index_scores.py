#!/usr/bin/env python3
"""Experiment: ``indexer.index_scores`` on a prefill chunk's rows (one sequence: one block table for every
row, ascending positions), the one-row kernel against ``_index_scores_rows_kernel`` with QB rows per program
(each key page dequantised once per QB rows), V4 indexer shape (64 heads x 128), T chunk rows starting at
position S (the rows see (S + i + 1) // 4 compressed keys). CUDA-graph replays, L2 flushed; the last column is
the fraction of scores differing from the one-row kernel's (the head sum's fp32 order may move a bf16
rounding).

    PYTHONPATH=. python experiments/exp_index_scores.py [--tokens 8192] [--starts 0,24576,57344] [--rows 1,2,4]

V4-Flash's CSA layers on the H100 (2026-12-06, BENCHMARKS.md prefill profile): the one-row kernel takes 1.65 ms
of an 8192-token chunk from position 0, 2.4% of the chunk's kernel time at 4 layers.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import gpu_experiment, graph_time  # noqa: E402
from dsv4.kernels import indexer as ix  # noqa: E402
from dsv4.twins import indexer as ix_twin  # noqa: E402

H = 64


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--starts", default="0,24576,57344")
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--tpp", default="auto", help="pages per program: auto or a list such as 1,2,4")
    args = ap.parse_args()
    setup = gpu_experiment("exp_index_scores", "compiled kernels")
    if setup is None:
        return
    dev, gen, _ = setup
    T = args.tokens
    print("| T | start | keys seen (last row) | rows / program | pages / program | us | differs from one-row |")
    print("|---|---|---|---|---|---|---|")
    for S in (int(s) for s in args.starts.split(",")):
        n = (S + T) // 4
        nb = -(-n // 64)
        pages = torch.randint(0, 256, (nb, 64 * 68), dtype=torch.uint8, generator=gen, device=dev)
        pages[:, 64 * 64:] = torch.randint(118, 127, (nb, 256), dtype=torch.uint8, generator=gen, device=dev)
        bt = torch.randperm(nb, generator=gen, device=dev).int().expand(T, -1)
        pos = torch.arange(S, S + T, device=dev)
        q = ix_twin.index_q_prologue(torch.randn(T, H, 128, generator=gen, device=dev).bfloat16(),
                                     torch.ones(T, 32, device=dev), torch.zeros(T, 32, device=dev))
        z = torch.randn(T, H, generator=gen, device=dev)
        scale = 128 ** -0.5 * H ** -0.5
        base = ix.index_scores(q, z, pages, bt, pos, n=n, w_scale=scale, rows_per_program=1)
        tpps = [None] if args.tpp == "auto" else [int(x) for x in args.tpp.split(",")]
        for qb in (int(r) for r in args.rows.split(",")):
            for tpp in tpps:
                run = lambda: ix.index_scores(q, z, pages, bt, pos, n=n, w_scale=scale, rows_per_program=qb,  # noqa: E731
                                              pages_per_program=tpp)
                try:
                    got = run()
                    diff = (got.float() != base.float()).float().mean().item()
                    us = graph_time(run) * 1e3
                    print(f"| {T} | {S} | {n} | {qb} | {tpp or 'auto'} | {us:.0f} | {diff:.1e} |", flush=True)
                except Exception as e:   # noqa: BLE001 - reported
                    print(f"| {T} | {S} | {n} | {qb} | {tpp or 'auto'} | failed: {type(e).__name__}: {str(e)[:200]} | |",
                          flush=True)


if __name__ == "__main__":
    main()
