"""Experiment: the tensor-core FP8 decode kernel (kernels/fp8_mma.py) variants against the split-K Triton
MMA tile (gemm._fp8_gemm_kernel + its sum) on the V4-Flash decode linears and wo_a, at 1 and 4 rows:
K blocks per step (UNROLL 1 / 2), K splits, 64-row / 32-row tiles. CUDA-graph replays, L2 flushed.

    PYTHONPATH=. python experiments/exp_fp8_mma.py [--only SUBSTRING]
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import gpu_experiment, graph_time  # noqa: E402

# (name, N, K, groups); groups > 1: wo_a's grouped einsum with bf16 activations
SHAPES = [("wq_b", 32768, 1024, 1), ("wo_b", 4096, 8192, 1), ("shared w1|w3", 4096, 4096, 1),
          ("wq_a|wkv", 1536, 4096, 1), ("indexer wq_b", 8192, 1024, 1), ("shared w2", 4096, 2048, 1),
          ("wo_a (8 groups, bf16 act)", 8192, 4096, 8)]
VARIANTS = {"u1": {}, "u2": {"UNROLL": 2}, "u1.k1": dict(split=1), "u2.k1": dict(split=1, UNROLL=2),
            "u2.k2": dict(split=2, UNROLL=2), "u2.k4": dict(split=4, UNROLL=2),
            "u2.bn32": dict(UNROLL=2, BN=32, num_warps=2), "u1.bn32": dict(BN=32, num_warps=2)}


def main():
    setup = gpu_experiment("exp_fp8_mma", "Gluon kernel")
    if setup is None:
        return
    dev, gen, copy_bw = setup
    from dsv4.formats.fp8 import dequant_fp8_weight, quant_fp8_weight
    from dsv4.kernels.gemm import fp8_mma as F8
    from dsv4.kernels.gemm import route as GR
    from benchmarks.common import fp8_linear
    from dsv4.kernels.lib import target
    print("| linear | M | floor us | Triton tile (+ sum) us | " + " | ".join(VARIANTS) + " |")
    print("|---|---|---|---|" + "---|" * len(VARIANTS))
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else ""
    for name, N, K, g in SHAPES:
        if only not in name:
            continue
        q, s = quant_fp8_weight(torch.randn(N, K, device=dev, generator=gen) * 0.02)
        for M in (1, 4):
            x = torch.randn(M, g * K, device=dev, generator=gen).bfloat16()
            act = "bf16" if g > 1 else "fp8"
            if g == 1:
                tri = graph_time(lambda: fp8_linear(x, q, s, config=GR.fp8_tiles(M, N, K, target(x.device))))
                tri_s = f"{tri * 1e3:.1f}"
            else:
                Wb = dequant_fp8_weight(q, s).bfloat16().view(g, N // g, K)
                tri = graph_time(lambda: torch.einsum("tgd,grd->tgr", x.view(M, g, K), Wb))
                tri_s = f"{tri * 1e3:.1f} (einsum)"
            ref = F8.fp8_mma(q, s, x_bf16=x, act=act, groups=g)
            cells = []
            for v, kw in VARIANTS.items():
                kw = dict(kw)
                split = kw.pop("split", None)
                try:
                    y = F8.fp8_mma(q, s, x_bf16=x, act=act, groups=g, split=split, config=kw or None)
                    same = "" if torch.equal(y, ref) or split is not None else " (bits differ)"
                    t = graph_time(lambda: F8.fp8_mma(q, s, x_bf16=x, act=act, groups=g, split=split,
                                                      config=kw or None))
                    cells.append(f"{t * 1e3:.1f}{same}")
                except Exception as e:   # a variant that fails is reported, the sweep goes on
                    cells.append(f"failed: {type(e).__name__}")
            fl = q.numel() / copy_bw * 1e6
            print(f"| {name} | {M} | {fl:.1f} | {tri_s} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
