#!/usr/bin/env python3
"""Experiment: the in-kernel-decode warp-specialized expert GEMM (``dsv4/kernels/gemm/fp4_fp8_ws.py``) against the
pre-decoded path it would replace (``fp4_fp8.predecode`` of the experts + the grouped FP8 GEMM on the e4m3
tiles, the router's defaults) and ``_scaled_mm`` on the equivalent dense problem, at V4-Flash's GEMM 1 (w1|w3
unfused: N 4096, K 4096) and GEMM 2 (w2: N 4096, K 2048) shapes, E experts x T tokens (top-6, uniform routing).
CUDA-graph replays, L2 flushed; the last column is the largest difference from the pre-decoded path's output
in bf16 steps of the larger value (the block sums may differ in the last fp32 bits; values below 2^-9 of the
largest output count as that size: where the sum cancels, fp32 ulps of the partials exceed its own step).

    PYTHONPATH=. python experiments/exp_fp4_fp8_ws.py [--tokens 8192] [--experts 256] [--stages 3,4] [--only rs,default]

The ``register-operand`` rows time the prototype ``experiments/fp4_fp8_rs.py`` (the weights as wgmma's A registers).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import gpu_experiment, graph_time  # noqa: E402
from benchmarks.gemm_moe import rand_mx  # noqa: E402
from dsv4.kernels import moe as Mo  # noqa: E402
from dsv4.kernels.gemm import fp4_fp8 as F  # noqa: E402
from dsv4.kernels.gemm import fp8 as G8  # noqa: E402
from dsv4.kernels.gemm import route as R  # noqa: E402
from dsv4.kernels.lib import target  # noqa: E402
from dsv4.kernels.gemm import fp4_fp8_ws as WS  # noqa: E402

D, I, K_TOP = 4096, 2048, 6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8192")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--stages", default="3,4")
    ap.add_argument("--only", default="", help="comma-separated substrings: run only the variants whose label has one")
    args = ap.parse_args()
    setup = gpu_experiment("exp_fp4_fp8_ws", "an sm_90 GPU")
    if setup is None or not WS.available("cuda"):
        print("exp_fp4_fp8_ws: needs an sm_90 GPU with Gluon")
        return
    dev, gen, _ = setup
    E = args.experts
    t = target(dev)
    one = torch.ones((), device=dev)
    print("| T | GEMM | variant | us | % of _scaled_mm | max diff (bf16 steps) |\n|---|---|---|---|---|---|")
    for T in (int(x) for x in args.tokens.split(",")):
        P = T * K_TOP
        eflat = (torch.randperm(P, device=dev, generator=gen) % E).to(torch.int32)
        rows = P / E
        for name, N, K in (("gemm1", 2 * I, D), ("gemm2", D, I)):
            w, ws = rand_mx(E, N, K, dev, gen)
            smx = F.tile_max(ws)
            x = torch.randn(P, K, device=dev, generator=gen).bfloat16()
            xq, xs = G8.act_quant_fp8(x)                 # rows in sorted order already: any rows
            a8 = torch.randint(-100, 100, (P, K), device=dev).to(torch.float8_e4m3fn)
            b8 = torch.randint(-100, 100, (N, K), device=dev).to(torch.float8_e4m3fn)
            sm = graph_time(lambda: torch._scaled_mm(a8, b8.T, scale_a=one, scale_b=one,
                                                      out_dtype=torch.bfloat16)) * 1e3
            print(f"| {T} | {name} | `_scaled_mm` dense | {sm:.0f} | 100% | |", flush=True)
            cfg = dict(R.fp8_predec_config(rows, t), UNFUSED=False)
            bm = cfg["BM"]
            _, offs, tcum, _ = Mo.sort_pairs(eflat, E, bm)
            g = dict(offs=offs, tcum=tcum, n_groups=E, n_tiles=min(P, -(-P // bm) + min(E, P)))
            ref = torch.empty(P, N, dtype=torch.bfloat16, device=dev)
            u = xq.view(torch.uint8)

            def predec():
                w8, f8 = F.predecode(w, ws, tile=True, tile_smax=smx)
                F.fp4_fp8_launch(u, xs, w8, f8, None, ref, None, P, N, K, 0, fmt="mxfp4", config=dict(cfg),
                                 predecoded=True, **g)
            predec()
            us = graph_time(predec) * 1e3
            print(f"| {T} | {name} | predecode + grouped FP8 GEMM (the default) | {us:.0f} | {100 * sm / us:.0f}% | ref |",
                  flush=True)
            a_split = WS.split_k_order(u)
            two = {"CONSUMERS": 2, "LUT": False}
            variants = [(f"stages {st} (the default)", {"STAGES": st}) for st in (int(x) for x in args.stages.split(","))] + [
                ("2 consumers (128 x 128 tiles), byte-lane decode", two),
                ("2 consumers, table-lookup decode", {"CONSUMERS": 2}),
                ("4 consumers, byte-lane decode", {"LUT": False}),
                ("every activation box loaded", {"LIVE_LOADS": False}),
                ("a scale per byte", {"GROUP_SCALES": False}),
                ("probe: no decode", {"PROBE": 1}), ("probe: no wgmma", {"PROBE": 2}),
                ("probe: loads only", {"PROBE": 3}), ("probe: loads only, every box", {"PROBE": 3, "LIVE_LOADS": False}),
                ("2 consumers, probe: no decode", dict(two, PROBE=1)),
                ("2 consumers, probe: no wgmma", dict(two, PROBE=2))]
            rs = [(f"register-operand weights{lab}", dict(v, RS=True))
                  for lab, v in (("", {}), (", stages 6", {"STAGES": 6}), (", probe: no decode", {"PROBE": 1}),
                                 (", 64-token tiles", {"BT": 64}), (", 64-token tiles, probe: no decode", {"BT": 64, "PROBE": 1}))]
            only = [o for o in args.only.split(",") if o]
            for label, vcfg in variants + rs:
                if only and not any(o in label for o in only):
                    continue
                out = torch.empty(P, N, dtype=torch.bfloat16, device=dev)
                kname = "fp4_fp8_rs" if vcfg.get("RS") else "fp4_fp8_ws"
                if vcfg.get("RS"):
                    import fp4_fp8_rs as RS
                    rcfg = {k: v for k, v in vcfg.items() if k != "RS"}
                    run = lambda: RS.fp4_fp8_rs(a_split, xs, w, ws, smx, offs, out=out, config=rcfg)  # noqa: E731
                else:
                    run = lambda: WS.fp4_fp8_ws(a_split, xs, w, ws, smx, offs, out=out, config=vcfg)  # noqa: E731
                try:
                    run()
                    torch.cuda.synchronize()
                    big = torch.maximum(out.float().abs(), ref.float().abs()).clamp_min(2.0 ** -9 * ref.float().abs().max())
                    diff = ((out.float() - ref.float()).abs() / big * 128).max().item()
                    us = graph_time(run) * 1e3
                    print(f"| {T} | {name} | {kname} {label} | {us:.0f} | {100 * sm / us:.0f}% | {diff:.2f} |",
                          flush=True)
                except Exception as e:          # noqa: BLE001 - reported
                    print(f"| {T} | {name} | {kname} {label} | failed: {type(e).__name__}: {str(e)[:300]} | | |",
                          flush=True)


if __name__ == "__main__":
    main()
