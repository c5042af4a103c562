"""Experiment: the tensor-core FP4 decode GEMM (kernels/fp4_mma.py) against the CUDA-core GEMV
(kernels/gemv.py) on V4 expert shapes: same grouped tiles, L2 flushed, CUDA-graph timed.

    PYTHONPATH=. python experiments/exp_fp4_mma.py [--smoke]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import graph_time, roofline  # noqa: E402
from benchmarks.gemm_moe import rand_mx, rand_nv, relerr  # noqa: E402
from dsv4.kernels.gemm import fp8 as G8  # noqa: E402
from dsv4.kernels.gemm.fp4_mma import BM_ROWS, act_f16_split, band_layout, mma_gemv_launch  # noqa: E402
from dsv4.kernels.gemm.gemv import gemv_launch  # noqa: E402
from dsv4.kernels.lib import u8  # noqa: E402

# (name, experts, N, K, rows per expert)
CASES = [("Flash w1|w3 32 exp x1", 32, 4096, 4096, 1), ("Flash w2 32 exp x1", 32, 4096, 2048, 1),
         ("Flash w1|w3 256 exp x2", 256, 4096, 4096, 2), ("Flash w1|w3 6 exp x1", 6, 4096, 4096, 1),
         ("Flash w1|w3 64 exp x8", 64, 4096, 4096, 8), ("Pro w1|w3 32 exp x1", 32, 6144, 7168, 1),
         ("Flash w1|w3 256 exp x2 NVFP4", 256, 4096, 4096, 2),
         # batch 2 / 3 / 4 and MTP K=3's verify at batch 1 (6 distinct experts a row): grids of 12 / 18 / 24 x 64
         # column blocks, one to two waves at ~8 resident programs per SM
         ("Flash w1|w3 12 exp x1", 12, 4096, 4096, 1), ("Flash w1|w3 18 exp x1", 18, 4096, 4096, 1),
         ("Flash w1|w3 24 exp x1", 24, 4096, 4096, 1), ("Flash w2 6 exp x1", 6, 4096, 2048, 1),
         ("Flash w2 12 exp x1", 12, 4096, 2048, 1), ("Flash w2 24 exp x1", 24, 4096, 2048, 1)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--variants", default="bn64.w4,bn64.w4.band")
    ap.add_argument("--cases", default="", help="comma-separated substrings of the case names to run (default: all)")
    args = ap.parse_args()
    if not torch.cuda.is_available():   # Gluon kernels have no CPU interpreter: nothing to run here
        print("exp_fp4_mma: needs a CUDA GPU (the Gluon kernel has no interpreter); CPU CI compiles it instead")
        return
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    copy_bw, _ = roofline(dev, args.smoke)
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    print("| case | kernel | us | GB/s | % copy | relerr vs gemv |")
    print("|---|---|---|---|---|---|")
    for name, E, N, K, m in CASES:
        if args.cases and not any(c in name for c in args.cases.split(",")):
            continue
        fmt = "nvfp4" if "NVFP4" in name else "mxfp4"
        w, s, s2 = rand_nv(E, N, K, dev, gen) if fmt == "nvfp4" else (*rand_mx(E, N, K, dev, gen), None)
        R = E * m
        x = torch.randn(R, K, device=dev, generator=gen).bfloat16()
        xq, xs = G8.act_quant_fp8(x)
        xq = u8(xq)
        offs = (torch.arange(E + 1, device=dev) * m).to(torch.int64)
        wbytes = E * (N * K // 2 + N * s.shape[-1])

        def grouped(bm):
            tiles = -(-m // bm)
            return dict(offs=offs, tcum=(torch.arange(E + 1, device=dev) * tiles).to(torch.int64), n_groups=E,
                        n_tiles=E * tiles, bm=bm)
        bm_g = 1 if m == 1 else (2 if m == 2 else 4)
        mma_tiles = {k: v for k, v in grouped(BM_ROWS).items() if k != "bm"}
        ref = gemv_launch(xq, xs, w, s, s2, R, N, K, wfmt=fmt, **grouped(bm_g))
        t = graph_time(lambda: gemv_launch(xq, xs, w, s, s2, R, N, K, wfmt=fmt, **grouped(bm_g)))
        print(f"| {name} | gemv bm{bm_g} | {t * 1e3:.1f} | {wbytes / t / 1e6:.0f} | {100 * wbytes / t / 1e6 / (copy_bw / 1e9):.0f} | - |",
              flush=True)
        for v in args.variants.split(","):
            cfg, ww, ss, aa = {}, w, s, xq
            for p in v.split("."):
                if p == "band":      # weights and scales in fp4_mma.band_layout
                    ww, ss = band_layout(w, 64), band_layout(s, 4 if fmt == "mxfp4" else 8)
                    continue
                if p == "a16":       # the activation as act_f16_split's f16 operand (no in-kernel decode)
                    aa = act_f16_split(xq)
                    continue
                key, num = p.rstrip("0123456789"), p[len(p.rstrip("0123456789")):]
                cfg[{"bn": "BN", "w": "num_warps", "k": "SPLIT_K", "vec": "VEC_TILES"}[key]] = int(num)
            try:
                y = mma_gemv_launch(aa, xs, ww, ss, R, N, K, fmt=fmt, ws2=s2, config=cfg, **mma_tiles)
                err = relerr(y.float(), ref.float())
                t = graph_time(lambda: mma_gemv_launch(aa, xs, ww, ss, R, N, K, fmt=fmt, ws2=s2, config=cfg,
                                                       **mma_tiles))
                print(f"| {name} | mma {v} | {t * 1e3:.1f} | {wbytes / t / 1e6:.0f} | {100 * wbytes / t / 1e6 / (copy_bw / 1e9):.0f} | {err:.2e} |",
                      flush=True)
            except Exception as ex:    # a variant that fails to compile is reported, the sweep goes on
                print(f"| {name} | mma {v} | failed: {type(ex).__name__}: {str(ex)[:200]} | | | |", flush=True)


if __name__ == "__main__":
    main()
