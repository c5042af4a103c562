"""wo_a (the grouped bf16 einsum on an FP8-stored weight) per row count: ``fp8_mma`` reading the FP8
weight vs dequantising it to bf16 per call and one batched GEMM (the model keeps only the FP8 form).
Decides ``kernels.gemm.route.WO_A_MAX_ROWS``. Flash shapes: 8 groups, rank 1024, 4096 inputs per group."""
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.common import graph_time  # noqa: E402
from dsv4.kernels.gemm import fp8_mma  # noqa: E402
from dsv4.layers.linear import GroupedFp8  # noqa: E402
from dsv4.ops import Ops  # noqa: E402
from dsv4.kernels.layer_ops import dequant_bf16  # noqa: E402

dev = torch.device("cuda")
G, R, K = 8, 1024, 4096
g = GroupedFp8("wo_a", G, R, K, Ops(dev), "fp8", dev)
g.lin.weight.copy_((torch.randn(G * R, K, device=dev) * 0.5).to(torch.float8_e4m3fn))
g.lin.scale.copy_(torch.rand_like(g.lin.scale) + 0.5)
print("| rows | fp8_mma us | dequant + einsum us |\n|---|---|---|")
for T in (1, 16, 64, 128, 256, 512):
    o = torch.randn(T, G * K, device=dev).bfloat16()
    a = graph_time(lambda: fp8_mma.fp8_mma(g.lin.weight, g.lin.scale, x_bf16=o, act="bf16", groups=G)) * 1e3
    b = graph_time(lambda: torch.einsum("tgd,grd->tgr", o.view(T, G, K), dequant_bf16(g.lin).view(G, R, K))) * 1e3
    print(f"| {T} | {a:.1f} | {b:.1f} |")
