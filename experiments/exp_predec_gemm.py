#!/usr/bin/env python3
"""Experiment: the pre-decoded path's two FP8 GEMMs alone (``fp4_fp8_launch(..., predecoded=True)`` on
``predecode``'s e4m3 tiles), tile by tile, against ``torch._scaled_mm`` on the dense FP8 problem of the same
size and against dsv4's dense ``fp8_prefill`` kernel (128 x 128 weight-scale blocks) on it.

GEMM 1 as ``moe_forward`` runs it by default on sm_90 (UNFUSED: x's rows gathered in sorted order, TMA tiles,
bf16 w1|w3 outputs [P, 2I]) and GEMM 2 ([P, I] e4m3 h -> bf16 [P, d]). Variants: tile (BM, BN), warps, stages,
block-major activation scales (``.scale_t``), per-row weight factors or one per 128 x 128 tile (``.tile``:
``predecode(tile=True)``, a scalar promotion factor per K block), and the "one group" row: the same kernel over the same rows with a
single expert's weight (no per-expert tiling), which separates the grouping's cost from the tile body's.
CUDA-graph replays, L2 flushed.

    PYTHONPATH=. python experiments/exp_predec_gemm.py [--tokens 8192] [--experts 256] [--quick]

H100 (2026-12-06), 256 experts x 8192 tokens (192 rows per expert), 64 x 128 tiles, 4 warps, 3 stages, us
(% of ``_scaled_mm``; GEMM 1 1,202 us, GEMM 2 595 us):

| GEMM | per-row factors | + host descriptors | per-tile factors | + host descriptors | one group, tile + host | dense ``fp8_prefill`` |
|---|---|---|---|---|---|---|
| 1 | 3,297 (36%) | 3,192 (38%) | 2,506 (48%) | 2,464 (49%) | 2,325 (52%) | 2,024 (59%) |
| 2 | 1,601 (37%) | 1,499 (40%) | 1,280 (47%) | 1,217 (49%) | 1,082 (55%) | 888 (67%) |

The dense kernel's own variants locate the rest: device-built descriptors cost it 4-12 points (GEMM 2 67% ->
55%), per-row weight scales 10-13 (59% -> 49%, 67% -> 54%); no TMA store ~1. 8 warps, 128-row tiles, 256-column
tiles and 4 stages were slower in every form (128-row tiles 20-36%); block-major scale operands (x's, h's and
the per-row factors: the ``SCALE_T`` option, since removed) helped only per-row factors at
8 warps. All variants gave the same bits.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import gpu_experiment, graph_time  # noqa: E402
from benchmarks.gemm_moe import rand_mx  # noqa: E402
from dsv4.kernels import moe as Mo  # noqa: E402
from dsv4.kernels.gemm import fp4_fp8 as F  # noqa: E402
from dsv4.kernels.gemm import fp8 as G8  # noqa: E402

D, I, K_TOP = 4096, 2048, 6
# (BM, BN, num_warps, num_stages)
TILES = [(64, 128, 4, 3), (64, 128, 4, 4), (64, 128, 8, 3), (128, 128, 8, 3), (128, 128, 8, 4), (64, 256, 8, 3)]
QUICK_TILES = [(64, 128, 4, 3)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8192")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    setup = gpu_experiment("exp_predec_gemm", "compiled kernels")
    if setup is None:
        return
    dev, gen, _ = setup
    from dsv4.kernels.gemm.fp8_prefill import fp8_gemm_prefill
    E = args.experts
    w13, s13 = rand_mx(E, 2 * I, D, dev, gen)
    w2, s2 = rand_mx(E, D, I, dev, gen)
    # weight factors per row or one per 128 x 128 tile (``predecode(tile=True)``); the activation scales
    # row-major or block-major (".scale_t": the kernel's K-block stride argument)
    dec = {mode: (F.predecode(w13, s13, tile=mode == "tile"), F.predecode(w2, s2, tile=mode == "tile"))
           for mode in ("row", "tile")}
    modes = [("row", False), ("row", True), ("tile", False), ("tile", True)]
    hosts = (False, True)
    # (mode, block-major x scales, host descriptors, scale operands a K block ahead): the sweep's rows, then
    # the default with PREFETCH
    extra = [("tile", False, True, True), ("row", False, True, True)]
    one = torch.ones((), device=dev)
    print("| T | GEMM | variant | us | TFLOP/s | % of _scaled_mm | same bits |\n|---|---|---|---|---|---|---|")
    for T in (int(x) for x in args.tokens.split(",")):
        P = T * K_TOP
        eflat = (torch.randperm(P, device=dev, generator=gen) % E).to(torch.int32)
        x = torch.randn(P, D, device=dev, generator=gen).bfloat16()
        xq, xs = G8.act_quant_fp8(x)                       # the gathered rows (sorted order: any rows)
        hb = torch.randn(P, I, device=dev, generator=gen).bfloat16()
        hq, hsc = G8.act_quant_fp8(hb)
        y13 = torch.empty(P, 2 * I, dtype=torch.bfloat16, device=dev)
        out = torch.empty(P, D, dtype=torch.bfloat16, device=dev)
        gemms = {"gemm1": (xq, xs, 0, y13, 2 * I, D), "gemm2": (hq, hsc, 1, out, D, I)}
        for name, (aq, asc, wi, dst, N, K) in gemms.items():
            flops = 2.0 * P * N * K
            a8 = torch.randint(-100, 100, (P, K), device=dev).to(torch.float8_e4m3fn)
            b8 = torch.randint(-100, 100, (N, K), device=dev).to(torch.float8_e4m3fn)
            sm = graph_time(lambda: torch._scaled_mm(a8, b8.T, scale_a=one, scale_b=one,
                                                      out_dtype=torch.bfloat16)) * 1e3
            print(f"| {T} | {name} | `_scaled_mm` dense | {sm:.0f} | {flops / sm / 1e6:.0f} | 100% | |", flush=True)
            wd = torch.randint(-100, 100, (N, K), device=dev).to(torch.float8_e4m3fn)
            wds = torch.rand(N // 128, K // 128, device=dev) + 0.5
            wdr = torch.rand(N, K // 128, device=dev) + 0.5
            # its default, then: device-side descriptors, no TMA store, per-row weight scales
            for tag, scales, cfg in (("", wds, None), (" LOAD tma_dev", wds, {"LOAD": "tma_dev"}),
                                     (" EPI_TMA off", wds, {"EPI_TMA": False}),
                                     (" LOAD tma_dev, EPI_TMA off", wds, {"LOAD": "tma_dev", "EPI_TMA": False}),
                                     (" per-row weight scales", wdr, None)):
                try:
                    us = graph_time(lambda: fp8_gemm_prefill(aq, asc, wd, scales, config=cfg)) * 1e3
                    print(f"| {T} | {name} | dense `fp8_prefill`{tag} | {us:.0f} | "
                          f"{flops / us / 1e6:.0f} | {100 * sm / us:.0f}% | |", flush=True)
                except Exception as e:          # noqa: BLE001 - reported
                    print(f"| {T} | {name} | dense `fp8_prefill`{tag} | failed: {type(e).__name__}: {str(e)[:200]} "
                          "| | | |", flush=True)
            ref = None
            for bm, bn, nw, ns in (QUICK_TILES if args.quick else TILES):
                perm, offs, tcum, _ = Mo.sort_pairs(eflat, E, bm)
                g = dict(offs=offs, tcum=tcum, n_groups=E, n_tiles=min(P, -(-P // bm) + min(E, P)))
                for mode, st, host, pf in [(m, s_, h, False) for (m, s_), h in itertools.product(modes, hosts)] + extra:
                    if mode == "tile" and bn > 128:
                        continue
                    (w8, f8) = dec[mode][wi]
                    sa = asc.t().contiguous().t() if st else asc
                    cfg = dict(BM=bm, BN=bn, num_warps=nw, num_stages=ns, SWAP=False, WTMA=True, ATMA=True,
                               HOST_TMA=host, PREFETCH=pf)
                    tag = f"bm{bm}.bn{bn}.w{nw}.s{ns}" + (".tile" if mode == "tile" else "") + \
                        (".scale_t" if st else "") + (".host" if host else "") + (".pf" if pf else "")
                    try:
                        run = lambda: F.fp4_fp8_launch(aq, sa, w8, f8, None, dst, None, P, N, K, 0, fmt="mxfp4",
                                                       config=dict(cfg), predecoded=True, **g)
                        run()
                        same = ""
                        if bm == 64 and bn == 128:          # tiles of one BM share the sort: compare within
                            got = dst.clone()
                            same = "ref" if ref is None else str(torch.equal(got, ref))
                            ref = got if ref is None else ref
                        us = graph_time(run) * 1e3
                        print(f"| {T} | {name} | {tag} | {us:.0f} | {flops / us / 1e6:.0f} | {100 * sm / us:.0f}% | "
                              f"{same} |", flush=True)
                    except Exception as e:      # noqa: BLE001 - reported
                        print(f"| {T} | {name} | {tag} | failed: {type(e).__name__}: {str(e)[:200]} | | | |",
                              flush=True)
            # one group: every row against expert 0's weight (no per-expert tiles), the default-ish tile
            for (mode, st), host in itertools.product(modes, hosts):
                (w8, f8) = dec[mode][wi]
                sa = asc.t().contiguous().t() if st else asc
                cfg = dict(BM=64, BN=128, num_warps=4, num_stages=3, SWAP=False, WTMA=True, ATMA=True, HOST_TMA=host)
                try:
                    run = lambda: F.fp4_fp8_launch(aq, sa, w8[:1], f8[:1], None, dst, None, P, N, K, 0,
                                                   fmt="mxfp4", config=dict(cfg), predecoded=True)
                    run()
                    us = graph_time(run) * 1e3
                    print(f"| {T} | {name} | one group bm64.bn128.w4.s3.{mode}{'.scale_t' if st else ''}"
                          f"{'.host' if host else ''} | {us:.0f} | "
                          f"{flops / us / 1e6:.0f} | {100 * sm / us:.0f}% | |", flush=True)
                except Exception as e:          # noqa: BLE001 - reported
                    print(f"| {T} | {name} | one group | failed: {type(e).__name__}: {str(e)[:200]} | | | |")


if __name__ == "__main__":
    main()
