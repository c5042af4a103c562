"""Experiment: the decode step's bf16 GEMMs on cuBLAS, both operand orders, and wo_a on the FP8 kernel (H200).

The fused decode step runs the compressors' wkv / wgate + the indexer's weights_proj as one bf16 GEMM
with fp32 output (``torch.mm(x, W.t(), out_dtype=float32)``) and wo_a as a batched bf16 einsum. At
decode sizes cuBLAS picks its kernel from the operand shapes; this times each call both ways (x . W^T
and (W . x^T)^T, the same products) on V4-Flash shapes, and wo_a also as ``fp8_mma`` (act="bf16",
8 groups: the FP8 weight dequantised in the kernel, half the bytes). CUDA-graph replays, L2 flushed
before every call.

    PYTHONPATH=. python experiments/exp_bf16_decode.py
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import gpu_experiment, graph_time  # noqa: E402


def main():
    setup = gpu_experiment("exp_bf16_decode")
    if setup is None:
        return
    dev, gen, copy_bw = setup
    print("| GEMM | B | x . W^T us | (W . x^T)^T us | floor us |")
    print("|---|---|---|---|---|")
    # CSA layer: main compressor wkv|wgate (2 x 1024) + indexer compressor (2 x 256) + weights_proj (64);
    # HCA layer: main compressor (2 x 512)
    for name, N in (("CSA layer compressors + weights_proj", 2624), ("HCA layer compressor", 1024)):
        W = torch.randn(N, 4096, device=dev, generator=gen).bfloat16()
        for B in (1, 4, 64):
            x = torch.randn(B, 4096, device=dev, generator=gen).bfloat16()
            a = graph_time(lambda: torch.mm(x, W.t(), out_dtype=torch.float32))
            b = graph_time(lambda: torch.mm(W, x.t(), out_dtype=torch.float32).t())
            d = (torch.mm(x, W.t(), out_dtype=torch.float32) - torch.mm(W, x.t(), out_dtype=torch.float32).t()).abs().max()
            fl = W.numel() * 2 / copy_bw * 1e6
            print(f"| {name} | {B} | {a * 1e3:.1f} | {b * 1e3:.1f} | {fl:.1f} |  (max diff {d.item():.1e})", flush=True)
    from dsv4.formats.fp8 import dequant_fp8_weight, quant_fp8_weight
    from dsv4.kernels.gemm import fp8_mma as F8
    G, R, D = 8, 1024, 4096
    q, s = quant_fp8_weight(torch.randn(G * R, D, device=dev, generator=gen) * 0.02)
    Wa = dequant_fp8_weight(q, s).bfloat16().view(G, R, D)      # the official bf16 form of the FP8 weight
    print("| wo_a (8 x 1024 x 4096) | B | einsum us | (W . og^T)^T us | FP8 kernel us (act bf16) | bf16 floor us | "
          "FP8 floor us |")
    for B in (1, 2, 4, 8, 16, 64):
        og = torch.randn(B, G, D, device=dev, generator=gen).bfloat16()
        a = graph_time(lambda: torch.einsum("tgd,grd->tgr", og, Wa))
        b = graph_time(lambda: torch.bmm(Wa, og.permute(1, 2, 0)).permute(2, 0, 1))
        c = graph_time(lambda: F8.fp8_mma(q, s, x_bf16=og.view(B, -1), act="bf16", groups=G))
        z = F8.fp8_mma(q, s, x_bf16=og.view(B, -1), act="bf16", groups=G).float()
        ref = torch.einsum("tgd,grd->tgr", og, Wa).reshape(B, -1).float()
        err = ((z - ref).norm() / ref.norm()).item()
        print(f"| wo_a | {B} | {a * 1e3:.1f} | {b * 1e3:.1f} | {c * 1e3:.1f} (rel diff {err:.1e}) | "
              f"{Wa.numel() * 2 / copy_bw * 1e6:.1f} | {q.numel() / copy_bw * 1e6:.1f} |", flush=True)


if __name__ == "__main__":
    main()
