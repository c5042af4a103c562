"""The MoE shared expert (``moe._shared_expert``: w1|w3 + SwiGLU + w2, FP8) at 1-128 tokens, with the
split-K path up to 4 tokens only (old) and up to ``SHARED_SPLIT_MAX_ROWS`` (new), V4-Flash / V4-Pro
shapes (H200, CUDA-graph replays, L2 flushed).

    PYTHONPATH=. python experiments/exp_shared_expert.py
    PYTHONPATH=. python experiments/exp_shared_expert.py --small   # 1-4 tokens: FP8 GEMV vs MMA partials
                                                                  # (session 13)
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dsv4.kernels.moe as Mo  # noqa: E402
from benchmarks.common import graph_time  # noqa: E402
from benchmarks.decode_step import real_moe  # noqa: E402
from dsv4.config import preset  # noqa: E402
from dsv4.kernels.gemm.fp8 import act_quant_fp8  # noqa: E402
from dsv4.kernels.gemm import route as GR  # noqa: E402
dev = torch.device("cuda")
gen = torch.Generator(device=dev).manual_seed(0)


def gemv_shared(xq, xs, w):
    """The shared expert as it ran at 1-4 tokens before session 13: w1|w3 partials from the FP8 GEMV."""
    from dsv4.kernels.gemm.gemv import gemv_launch, swiglu_quant
    from dsv4.kernels.gemm.linear import fp8_gemm
    from dsv4.kernels.gemm.route import rows_tile
    from dsv4.kernels.lib import u8 as _u8
    T, d = xq.shape
    part = gemv_launch(_u8(xq), xs, w.sh13, w.sh13_s, None, T, w.sh13.shape[0], d, wfmt="fp8", partial=True,
                       bm=rows_tile(T))
    hq, hsc = swiglu_quant(part, w.limit)
    return fp8_gemm(hq.view(torch.float8_e4m3fn), hsc, w.sh2, w.sh2_s)


if "--small" in sys.argv:     # 1-4 tokens: the GEMV partials (old) against the MMA partials (now)
    for model in ("flash", "pro"):
        w = real_moe(preset(model), 5, dev, gen)
        for T in (1, 2, 3, 4):
            xq, xs = act_quant_fp8(torch.randn(T, w.sh13.shape[1], device=dev, generator=gen).bfloat16())
            a, b = gemv_shared(xq, xs, w), Mo._shared_expert(xq, xs, w)
            diff = (a.float() - b.float()).abs().max().item() / a.float().abs().max().item()
            ta = graph_time(lambda: gemv_shared(xq, xs, w)) * 1e3
            tb = graph_time(lambda: Mo._shared_expert(xq, xs, w)) * 1e3
            print(f"{model} shared expert T={T}: gemv {ta:6.1f} us  mma split {tb:6.1f} us  max rel diff {diff:.1e}",
                  flush=True)
    sys.exit(0)
for model in ("flash", "pro"):
    w = real_moe(preset(model), 5, dev, gen)
    d = w.sh13.shape[1]
    for T in (1, 4, 5, 8, 16, 32, 64, 65, 128):
        x = torch.randn(T, d, device=dev, generator=gen).bfloat16()
        xq, xs = act_quant_fp8(x)
        res = []
        outs = []
        for lim in (4, 64):
            GR.SHARED_SPLIT_MAX_ROWS = lim
            outs.append(Mo._shared_expert(xq, xs, w))
            res.append(graph_time(lambda: Mo._shared_expert(xq, xs, w)) * 1e3)
        GR.SHARED_SPLIT_MAX_ROWS = 64
        diff = (outs[0].float() - outs[1].float()).abs().max().item() / outs[0].float().abs().max().item()
        nb = w.sh13.numel() + w.sh2.numel()
        print(f"{model} shared expert T={T:4d}: old {res[0]:7.1f} us  new {res[1]:7.1f} us  "
              f"(weights {nb / 1e6:.1f} MB: floor ~{nb / 4.2e6:.1f} us)  max rel diff {diff:.1e}", flush=True)
