"""The register-operand prototype (``experiments/fp4_fp8_rs.py``): an sm_90 compile on any machine, and on an sm_90
GPU its outputs against ``fp4_fp8_ws`` (the product kernel: the same products in the same K = 32 instructions) and
the exact sums. Outside the default test run: ``PYTHONPATH=. python3 -m pytest -q experiments/test_fp4_fp8_rs.py``."""
import os
import re
import sys

import pytest
import torch

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")]
pytest.importorskip("triton")

import fp4_fp8_rs as RS  # noqa: E402
from kernel_helpers import check_expert_sums, mx_expert_problem, need_gpu  # noqa: E402
from dsv4.kernels.gemm import fp4_fp8_ws as WS  # noqa: E402


def test_aot_compile_sm90():
    """The kernel compiles for sm_90a: m64nBTk32 wgmma with the A operand in registers (four 32-bit registers per
    instruction), TMA loads, the LUT decode, no shared-memory round trip of the decoded tile (shared-memory loads
    only the packed tiles' ldmatrix and the epilogue's transpose), register counts that fit the file."""
    if not RS.GLUON or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("needs Gluon's Hopper ops, compiled (TRITON_INTERPRET=0)")
    from kernel_helpers import aot_compile
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    def desc(dtype, gdt, block):
        t = torch.empty(256, 256, dtype=dtype)
        return mangle_type(TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gdt)))
    cfg = RS.DEFAULT_CONFIG
    bt = cfg["BT"]
    types = dict(a_desc=desc(torch.float8_e4m3fn, gl.float8e4nv, [bt, 128]),
                 w_desc=desc(torch.uint8, gl.uint8, [2 * RS.BW, 64]),
                 OUT="*bf16", SA="*fp32", WS="*u8", SMAX="*u8", TCUM="*i64", OFFS="*i64")
    const = dict(STAGES=cfg["STAGES"], LOG2G=9, CONSUMER_REGS=cfg["CONSUMER_REGS"], LOADER_REGS=cfg["LOADER_REGS"],
                 PROBE=0)
    ptx, mma, smem = aot_compile(RS._fp4_fp8_rs_kernel, types, const, 90, 4, div=("P", "N", "K"),
                                 maxnreg=cfg["maxnreg"], shared=True)
    assert mma == [f"wgmma.mma_async.sync.aligned.m64n{bt}k32.f32.e4m3.e4m3"], mma
    assert re.search(r"wgmma\.mma_async\S+ \{[^}]+\}, \{%r\d+,%r\d+,%r\d+,%r\d+\}, %rd\d+", ptx), "A not in registers"
    assert "prmt.b32 lo, tl, th, sl" in ptx and re.search(r"cp\.async\.bulk\.tensor\.2d", ptx)
    assert ptx.count("ldmatrix") == 4                   # two x4 per consumer per K block: its 64 x 64 packed bytes
    assert ptx.count("ld.shared") == 17                 # the epilogues' transposed reads (8 each) + one barrier byte
    assert cfg["STAGES"] * (bt * 128 + 2 * RS.BW * 64) <= smem <= 232448, smem
    assert 128 * (2 * cfg["CONSUMER_REGS"] + cfg["LOADER_REGS"]) <= 65536 and 384 * cfg["maxnreg"] <= 65536
    from kernel_helpers import ptxas_report
    print(ptxas_report(ptx))


@pytest.mark.gpu
@pytest.mark.parametrize("E,N,K,rows", [(4, 256, 512, [0, 64, 130, 200]), (8, 4096, 2048, [192] * 8),
                                        (16, 128, 4096, [1, 300, 0, 5] * 4)])
@pytest.mark.parametrize("cfg", [None, {"STAGES": 2, "GRID": 3}])
def test_gpu_fp4_fp8_rs_matches_ws(E, N, K, rows, cfg):
    need_gpu()
    if not RS.available("cuda"):
        pytest.skip("needs an sm_90 GPU with Gluon")
    args, extra = mx_expert_problem(E, N, K, rows)
    y = RS.fp4_fp8_rs(*args, config=cfg)
    ref = WS.fp4_fp8_ws(*args)
    check_expert_sums(y, args, extra)
    diff = (y.float() - ref.float()).abs()
    print("outputs off the product kernel's bits:", int((diff > 0).sum()), "of", diff.numel())
    yf, rf = y.float(), ref.float()
    bad = diff > 2.0 ** -7 * torch.maximum(yf.abs(), rf.abs()) + 2.0 ** -16 * rf.abs().max()
    assert not bad.any(), f"{int(bad.sum())} outputs more than one bf16 step off fp4_fp8_ws's, first {bad.nonzero()[0]}"
