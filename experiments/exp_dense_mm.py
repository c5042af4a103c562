#!/usr/bin/env python3
"""Experiment: the fp32-output GEMMs of bf16 operands at prefill sizes, the router's gate (bf16-exact weight)
and the compressor / indexer projections (``Bf16Linear`` "fp32"): torch's fp32 GEMM on the upcast x (the gate's
former path: an upcast copy + a SIMT SGEMM), torch's bf16 GEMM with fp32 output (one tensor-core accumulator over
K: the projections' path), and ``kernels/gemm/dense_mm.py`` (bf16 tensor cores promoted to fp32 every BK
columns) at its default and a tile sweep. Per row: GPU us (CUDA-graph replays, L2 flushed) and the largest error
against the exact (float64) sums, beside the fp32 GEMM's.

    PYTHONPATH=. python experiments/exp_dense_mm.py [--tokens 2048,8192,16384] [--quick] [--only proj]

H100 (2026-12-06), 8192 tokens, the gate: Flash 449.4 us (fp32 GEMM, error 5.7e-6) / 28.4 us (bf16 GEMM, 3.6e-5)
/ 39.9 us (``dense_mm`` BK 128, 2.1e-6); Pro 1079.7 / 60.2 / 129.9 us (3.3e-6 / 7.1e-5 / 3.1e-6). The table:
docs/benchmarks-2026-12-06.md (fourth session).
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import gpu_experiment, graph_time  # noqa: E402
from dsv4.kernels.gemm import dense_mm as D, route as R  # noqa: E402
from dsv4.kernels.lib import target  # noqa: E402

SHAPES = [("Flash gate", 256, 4096), ("Pro gate", 384, 7168), ("Flash CSA proj", 2624, 4096),
          ("Flash HCA proj", 1024, 4096), ("Pro CSA proj", 2624, 7168)]


def variants(quick):
    for bm, bn, bk, nw, ns in itertools.product((64, 128), (64, 128), (32, 64, 128), (4, 8), (3, 4)):
        if quick and (nw != 8 or ns != 3 or bn != 128):
            continue
        yield dict(BM=bm, BN=bn, BK=bk, num_warps=nw, num_stages=ns)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="2048,8192,16384")
    ap.add_argument("--quick", action="store_true", help="8 warps, 3 stages, BN 128 only")
    ap.add_argument("--only", default=None, help="shape names containing this")
    args = ap.parse_args()
    setup = gpu_experiment("exp_dense_mm", "compiled kernels")
    if setup is None:
        return
    dev, gen, _ = setup
    print(f"default tile: {R.dense_mm_config(target(dev))}")
    print("| shape | T | variant | us | max error | fp32 GEMM's max error |")
    print("|---|---|---|---|---|---|")
    for name, N, K in SHAPES:
        if args.only and args.only not in name:
            continue
        w = (torch.randn(N, K, generator=gen, device=dev) * 0.02).bfloat16()
        wf = w.float()
        for T in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(T, K, generator=gen, device=dev).bfloat16()
            ex = x.double() @ w.double().T
            err = lambda y: (y.double() - ex).abs().max().item()  # noqa: E731
            e32 = err(x.float() @ wf.T)
            rows = [("torch fp32 GEMM (x upcast)", lambda: x.float() @ wf.T),
                    ("torch bf16 GEMM, fp32 out", lambda: torch.mm(x, w.t(), out_dtype=torch.float32)),
                    ("dense_mm default", lambda: D.dense_mm(x, w))]
            for v in variants(args.quick):
                rows.append((f"bm{v['BM']}.bn{v['BN']}.bk{v['BK']}.w{v['num_warps']}.s{v['num_stages']}",
                             (lambda v=v: D.dense_mm(x, w, config=v))))
            for tag, fn in rows:
                try:
                    e = err(fn())
                    us = graph_time(fn) * 1e3
                except Exception as ex_:   # noqa: BLE001 - a variant that does not compile is reported
                    print(f"| {name} | {T} | {tag} | FAILED {type(ex_).__name__}: {str(ex_)[:120]} | | |")
                    continue
                print(f"| {name} | {T} | {tag} | {us:.1f} | {e:.2e} | {e32:.2e} |", flush=True)


if __name__ == "__main__":
    main()
