#!/usr/bin/env python3
"""Experiment: the pre-decoded expert path (``moe_forward(path="predec")``) against the routed defaults at
prefill sizes, and the tile of its decode pass (``fp4_fp8.predecode``).

1. ``predecode`` of V4-Flash's w1|w3 (256 experts x 4096 x 4096 MXFP4) over BN rows per program, KU
   128-blocks per step and warps: us and % of the copy rate on its bytes (read 0.53 + write 1.03 bytes
   per weight).
2. The whole MoE layer (router, sort, routed GEMMs, shared expert, combine) at T tokens: the router's
   path, and the ``prefill`` and ``predec`` paths forced, the latter with GEMM 1's SwiGLU fused or not
   (``UNFUSED``), with per-row or per-tile weight factors (``TILE``), host-built descriptors (``HOST_TMA``) and
   the scale operands loaded a K block ahead (``PREFETCH``),
   and the router's path with the shared expert's SwiGLU fused into its tile kernel (``route.SHARED_UNFUSED``
   off). do_bench medians (L2 flushed).

    PYTHONPATH=. python experiments/exp_predec.py [--tokens 4096,5460,8192,16384] [--experts 256,128] [--quick]
    PYTHONPATH=. python experiments/exp_predec.py --no-tiles --profile 256x8192     # kernels of one layer call

H100 (2026-12-06), V4-Flash w1|w3 of 256 experts: BN 32 / KU 4 / 8 warps 2,486 us (90% of copy), the former
BN 64 / KU 1 / 4 warps 4,583 us (49%); KU 2 70-77%, KU 1 48-60%. With the former decode pass, predec with
the next pass decoded on a second stream beside this pass's GEMM (two copies alive) was slower than one
stream (256 experts, 8192 tokens: 17.3 vs 15.1 ms; 16384: 24.3 vs 22.3; 128 experts, 8192: 11.8 vs 11.0):
the GEMM slows down beside the decode, so ``moe_forward`` runs the passes in turn. The layer with the new
decode pass (us; the router's path was ``prefill`` at 96 rows, ``predec`` from 128):

| experts | T | rows / expert | prefill path | predec |
|---|---|---|---|---|
| 256 | 4096 | 96 | 8,229 | 8,909 |
| 256 | 8192 | 192 | 15,600 | 12,452 |
| 256 | 16384 | 384 | 28,155 | 20,041 |
| 128 | 4096 | 192 | 7,905 | 6,136 |
| 128 | 8192 | 384 | 13,818 | 9,719 |
| 128 | 16384 | 768 | 26,240 | 16,839 |

GEMM 1 unfused (``UNFUSED``: plain tiles into bf16 w1|w3 outputs, then ``swiglu_quant``; the same bits) took
the layer 3.6-3.9% lower again (256 experts x 8192 tokens 12.48 -> 12.00 ms; 128 x 8192 9.74 -> 9.37).

H100 (2026-12-06), one weight factor per 128 x 128 tile (``TILE``), host-built TMA descriptors
(``HOST_TMA``) and ``swiglu_quant`` over 16-row programs (it took 947 us at 49,152 rows with one-row programs,
204 us after): the router's path (all three) against the unfused per-row form, us:

| experts | T | unfused, per-row factors | router's path now |
|---|---|---|---|
| 256 | 8192 | 10,818 | 10,042 |
| 256 | 16384 | 17,409 | 15,620 |
| 128 | 8192 | 8,262 | 7,605 |
| 128 | 16384 | 14,591 | 12,957 |

Kernels of one layer call at 256 experts x 8192 tokens (``--profile``, 10.07 ms): the FP8 GEMMs 4.37 ms (5
launches: w1|w3 and w2 over the scratch passes), the decode passes 3.73 ms, the shared expert's GEMMs 0.76 ms,
the router's fp32 gate GEMM 0.35 ms, ``swiglu_quant`` 0.20 ms, the combine 0.19 ms, the row gathers 0.15 ms.

H200 (2026-12-06, one run, before ``PREFETCH`` and ``SHARED_UNFUSED`` became the defaults), us:

| experts | T | router's path then | + PREFETCH | router's path, shared expert unfused |
|---|---|---|---|---|
| 256 | 8192 | 8,204 | 8,182 | 7,896 |
| 128 | 8192 | 6,348 | 6,316 | 6,035 |

H100 (2026-12-06, later, both on and the gate GEMM on ``dense_mm``), ``--profile 256x8192``: 9.38 ms of kernels
(10.07 before): the FP8 GEMMs 4.33 ms, the decode passes 3.74, the shared expert on the dense kernel 0.47 (w1|w3 +
w2) plus its SwiGLU pass, the gate 0.05 ms (0.35 + 0.10 for the x upcast before).
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
from dsv4.formats.fp8 import quant_fp8_weight  # noqa: E402
from dsv4.kernels import moe as Mo  # noqa: E402
from dsv4.kernels.gemm import fp4_fp8 as F, route as R  # noqa: E402
from dsv4.kernels.lib import target  # noqa: E402

D, I, K_TOP = 4096, 2048, 6


def weights(E, dev, gen):
    w13, s13 = rand_mx(E, 2 * I, D, dev, gen)
    w2, s2 = rand_mx(E, D, I, dev, gen)
    sh13, sh13s = quant_fp8_weight(torch.randn(2 * I, D, device=dev, generator=gen) * 0.02)
    sh2, sh2s = quant_fp8_weight(torch.randn(D, I, device=dev, generator=gen) * 0.02)
    return Mo.MoEWeights(gate_w=(torch.randn(E, D, device=dev, generator=gen) * 0.02).bfloat16().float(),
                         bias=torch.randn(E, device=dev, generator=gen) * 0.01, tid2eid=None, topk=K_TOP,
                         route_scale=1.5, limit=10.0, fmt="mxfp4", w13=w13, w13_s=s13, w13_s2=None,
                         w2=w2, w2_s=s2, w2_s2=None, sh13=sh13, sh13_s=sh13s.float(), sh2=sh2, sh2_s=sh2s.float())


def profile_layer(w, T, dev, gen):
    """Kernels of one ``moe_forward`` call (the router's path) at T tokens: launches and GPU us, largest first."""
    from torch.profiler import ProfilerActivity, profile
    from benchmarks.common import kernel_totals
    x = torch.randn(T, D, device=dev, generator=gen).bfloat16()
    for _ in range(3):
        Mo.moe_forward(x, None, w)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        Mo.moe_forward(x, None, w)
        torch.cuda.synchronize()
    rows = sorted(kernel_totals(prof).items(), key=lambda kv: -kv[1][1])
    total = sum(t for _, (_, t) in rows)
    print(f"\nOne layer call, {w.n_experts} experts x {T} tokens: {total:.0f} us of kernels\n\n"
          "| kernel | launches | GPU us | share |\n|---|---|---|---|")
    for k, (n, us) in rows[:30]:
        print(f"| `{k[:90]}` | {n} | {us:.0f} | {100 * us / total:.1f}% |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="4096,5460,8192,16384")
    ap.add_argument("--experts", default="256,128")
    ap.add_argument("--quick", action="store_true", help="fewer decode tiles")
    ap.add_argument("--no-tiles", action="store_true", help="skip the decode pass's tile sweep")
    ap.add_argument("--profile", default=None, metavar="ExT",
                    help="GPU time per kernel of one router's-path layer call at E experts x T tokens, then exit")
    args = ap.parse_args()
    setup = gpu_experiment("exp_predec", "compiled kernels")
    if setup is None:
        return
    dev, gen, copy_bw = setup
    import triton.testing
    t = target(dev)
    E0 = max(int(e) for e in args.experts.split(","))
    w = weights(E0, dev, gen)
    print(f"fold exact: {w.fp8_fold_exact()}; default predecode config {R.predecode_config(t)}")
    if args.profile:
        profile_layer(w if int(args.profile.split("x")[0]) == E0 else weights(int(args.profile.split("x")[0]), dev, gen),
                      int(args.profile.split("x")[1]), dev, gen)
        return
    # 1. the decode pass's tile
    nbytes = w.w13.numel() + w.w13_s.numel() + 2 * w.w13.numel() + 4 * w.w13.numel() // 64
    print("\n| predecode BN | KU | warps | us | % of copy |\n|---|---|---|---|---|")
    ref = F.predecode(w.w13[:8], w.w13_s[:8])
    grid = itertools.product((32, 64), (4, 8), (4, 8)) if args.quick else \
        itertools.product((16, 32, 64, 128), (1, 2, 4, 8), (4, 8))
    for bn, ku, nw in ([] if args.no_tiles else grid):
        cfg = dict(BN=bn, KU=ku, num_warps=nw)
        try:
            got = F.predecode(w.w13[:8], w.w13_s[:8], config=cfg)
            same = torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
            us = graph_time(lambda: F.predecode(w.w13, w.w13_s, config=cfg)) * 1e3
        except Exception as e:            # noqa: BLE001 - reported
            print(f"| {bn} | {ku} | {nw} | failed: {type(e).__name__}: {str(e)[:150]} | |")
            continue
        print(f"| {bn} | {ku} | {nw} | {us:.0f}{'' if same else ' WRONG BITS'} | "
              f"{100 * nbytes / (us * 1e-6) / copy_bw:.0f}% |", flush=True)
    # 2. the layer
    print("\n| experts | T | rows / expert | router's path | its us | prefill us | predec us | predec, GEMM 1 unfused us |"
          " unfused, tile factors us | unfused, tile factors, host descriptors us | the same + PREFETCH us |"
          " router's path, shared expert fused us | bits = fp8mma | variants' bits = predec |"
          "\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for E in (int(e) for e in args.experts.split(",")):
        wE = w if E == E0 else weights(E, dev, gen)
        for T in (int(x) for x in args.tokens.split(",")):
            x = torch.randn(T, D, device=dev, generator=gen).bfloat16()
            rows = T * K_TOP / E
            path = R.expert_path(rows, "mxfp4", t)
            pd = lambda **c: dict(path="predec", config=dict({"UNFUSED": False, "TILE": False, "HOST_TMA": False,
                                                              "PREFETCH": False}, **c))
            runs = {"router": dict(path=None), "prefill": dict(path="prefill"), "predec": pd(),
                    "unfused": pd(UNFUSED=True), "tile": pd(UNFUSED=True, TILE=True),
                    "host": pd(UNFUSED=True, TILE=True, HOST_TMA=True),
                    "pf": pd(UNFUSED=True, TILE=True, HOST_TMA=True, PREFETCH=True)}
            us = {k: triton.testing.do_bench(lambda kw=kw: Mo.moe_forward(x, None, wE, **kw), warmup=50, rep=300)
                  * 1e3 for k, kw in runs.items()}
            R.SHARED_UNFUSED = False             # the router's path, the shared expert's SwiGLU in its tile kernel
            us["shared"] = triton.testing.do_bench(lambda: Mo.moe_forward(x, None, wE), warmup=50, rep=300) * 1e3
            R.SHARED_UNFUSED = True
            fused = Mo.moe_forward(x, None, wE, **runs["predec"])
            same = torch.equal(fused, Mo.moe_forward(x, None, wE, path="fp8mma"))
            same_v = all(torch.equal(fused, Mo.moe_forward(x, None, wE, **runs[k]))
                         for k in ("unfused", "tile", "host", "pf"))
            print(f"| {E} | {T} | {rows:.0f} | {path} | {us['router']:.0f} | {us['prefill']:.0f} | {us['predec']:.0f} | "
                  f"{us['unfused']:.0f} | {us['tile']:.0f} | {us['host']:.0f} | {us['pf']:.0f} | "
                  f"{us['shared']:.0f} | {same} | "
                  f"{same_v} |", flush=True)


if __name__ == "__main__":
    main()
