#!/usr/bin/env python3
"""Experiment: ``kernels/gemm/dense_gemv.py`` (fp32-output GEMV of bf16 / fp32 weights) against torch's GEMMs
on the decode-sized fp32 GEMMs of a V4 layer: the compressor / indexer projection (``Bf16Linear`` "fp32":
``torch.mm(x, w.t(), out_dtype=fp32)``, a cuBLAS split-K GEMM + reduce) and the router's gate
(``x.float() @ w.T``: an upcast + a GEMV or SIMT SGEMM) at 1-16 rows, the kernel with its rows per program
(RB) and a sweep of its tile (BN, BK, waves of programs per SM, warps) at each row count. CUDA-graph replays, L2
flushed; % = weight bytes / time / copy bandwidth.

    PYTHONPATH=. python experiments/exp_dense_gemv.py [--rows 1,4,16] [--quick]

H100 (2026-12-06, before the kernel was cut to one row): its tensor-core / FMA ``tl.dot`` form over 16
padded rows lost to torch at 4 and 16 rows (Flash CSA projection 15.1 / 16.0 us vs 12.9 / 13.1, router
18.6 / 18.8 vs 15.3 / 22.2 at the best tiles), so the router keeps torch above one row. The kernel's present
multi-row form is elementwise FMAs instead: each weight tile serves up to 4 rows (RB), each row in its own fp32
register tile (every row the one-row launch's bits); ``route.DENSE_GEMV_MAX_ROWS`` / ``DENSE_GEMV_FP32_MAX_ROWS`` were set from its 2026-12-07 table.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import gpu_experiment, graph_time  # noqa: E402
from dsv4.kernels.gemm import dense_gemv as D, route as R  # noqa: E402
from dsv4.kernels.lib import target  # noqa: E402

# (name, N, K, weight dtype)
SHAPES = [("Flash CSA proj", 2624, 4096, torch.bfloat16), ("Flash HCA proj", 1024, 4096, torch.bfloat16),
          ("Flash router", 256, 4096, torch.float32), ("Pro CSA proj", 2624, 7168, torch.bfloat16),
          ("Pro router", 384, 7168, torch.float32)]


def torch_gemm(x, w):
    if w.dtype == torch.bfloat16:
        return lambda: torch.mm(x, w.t(), out_dtype=torch.float32)
    return lambda: x.float() @ w.T


def variants(elem, quick):
    bks = (128, 256, 512) if elem == 2 else (64, 128, 256)
    for bn, bk, waves, nw in itertools.product((8, 16, 32), bks, (2, 4, 8), (2, 4, 8)):
        if quick and (waves != 4 or nw != 4):
            continue
        yield dict(BN=bn, BK=bk, waves=waves, num_warps=nw, num_stages=3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,16", help="rows (torch and the kernel: up to 4 a program, RB)")
    ap.add_argument("--quick", action="store_true", help="waves 4, 4 warps only")
    ap.add_argument("--only", default=None, help="shape names containing this")
    args = ap.parse_args()
    setup = gpu_experiment("exp_dense_gemv", "compiled kernels")
    if setup is None:
        return
    dev, gen, copy_bw = setup
    t = target(dev)
    rows = [int(r) for r in args.rows.split(",")]
    print("| shape | M | weight MB | torch us (%) | default us (%) | default cfg | best us (%) | best cfg |")
    print("|---|---|---|---|---|---|---|---|")
    for name, N, K, dt in SHAPES:
        if args.only and args.only not in name:
            continue
        w = (torch.randn(N, K, generator=gen, device=dev) * 0.02).to(dt)
        mb = w.numel() * w.element_size() / 1e6
        for M in rows:
            x = torch.randn(M, K, generator=gen, device=dev).bfloat16()
            ref = x.float() @ w.float().T
            pct = lambda us: f"{us:.1f} ({100 * mb * 1e6 / (us * 1e-6) / copy_bw:.0f}%)"  # noqa: E731
            t_torch = graph_time(torch_gemm(x, w)) * 1e3
            dcfg = R.dense_gemv_config(N, K, w.element_size(), t)
            y = D.dense_gemv(x, w)
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-4, (name, M, err)
            t_def = graph_time(lambda: D.dense_gemv(x, w)) * 1e3
            best = (t_def, "default")
            rb_variants = [dict(RB=rb) for rb in (1, 2) if rb < min(4, M)]     # rows a program on the default tile
            for v in rb_variants + list(variants(w.element_size(), args.quick)):
                if "BN" not in v:
                    v = dict(dcfg, waves=None, **v)
                waves = v.pop("waves")
                if waves is not None:
                    blocks = -(-N // v["BN"])
                    v["SPLIT"] = max(1, min(K // v["BK"], -(-waves * t.sm_count // blocks)))
                try:
                    y = D.dense_gemv(x, w, config=v)
                    if ((y - ref).abs().max() / ref.abs().max()).item() > 1e-4:
                        print(f"  WRONG {name} M={M} {v}")
                        continue
                    us = graph_time(lambda: D.dense_gemv(x, w, config=v)) * 1e3
                except Exception as e:       # noqa: BLE001 - a variant that does not compile is reported
                    print(f"  FAILED {name} M={M} {v}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                tag = f"bn{v['BN']}.bk{v['BK']}.s{v['SPLIT']}.w{v['num_warps']}" + (f".rb{v['RB']}" if "RB" in v else "")
                if us < best[0]:
                    best = (us, tag)
            dtag = f"bn{dcfg['BN']}.bk{dcfg['BK']}.s{dcfg['SPLIT']}.w{dcfg['num_warps']}"
            print(f"| {name} | {M} | {mb:.1f} | {pct(t_torch)} | {pct(t_def)} | {dtag} | {pct(best[0])} | {best[1]} |",
                  flush=True)


if __name__ == "__main__":
    main()
