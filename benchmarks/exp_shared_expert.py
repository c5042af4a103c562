"""The MoE shared expert (``moe._shared_expert``: w1|w3 + SwiGLU + w2, FP8) at 1-128 tokens, with the
split-K path up to 4 tokens only (old) and up to ``SHARED_SPLIT_MAX_ROWS`` (new), V4-Flash / V4-Pro
shapes (H200, CUDA-graph replays, L2 flushed).

    PYTHONPATH=. python benchmarks/exp_shared_expert.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dsv4.kernels.moe as Mo  # noqa: E402
from benchmarks.common import graph_time  # noqa: E402
from benchmarks.decode_step import real_moe  # noqa: E402
from dsv4.config import preset  # noqa: E402
from dsv4.kernels.gemm import act_quant_fp8  # noqa: E402
dev = torch.device("cuda")
gen = torch.Generator(device=dev).manual_seed(0)
for model in ("flash", "pro"):
    w = real_moe(preset(model), 5, dev, gen)
    d = w.sh13.shape[1]
    for T in (1, 4, 5, 8, 16, 32, 64, 65, 128):
        x = torch.randn(T, d, device=dev, generator=gen).bfloat16()
        xq, xs = act_quant_fp8(x)
        res = []
        outs = []
        for lim in (4, 64):
            Mo.SHARED_SPLIT_MAX_ROWS = lim
            outs.append(Mo._shared_expert(xq, xs, w))
            res.append(graph_time(lambda: Mo._shared_expert(xq, xs, w)) * 1e3)
        Mo.SHARED_SPLIT_MAX_ROWS = 64
        diff = (outs[0].float() - outs[1].float()).abs().max().item() / outs[0].float().abs().max().item()
        nb = w.sh13.numel() + w.sh2.numel()
        print(f"{model} shared expert T={T:4d}: old {res[0]:7.1f} us  new {res[1]:7.1f} us  "
              f"(weights {nb / 1e6:.1f} MB: floor ~{nb / 4.2e6:.1f} us)  max rel diff {diff:.1e}", flush=True)
