"""The warp-specialized Gluon FP8 GEMM for Hopper prefill (experiments/fp8_ws.py; not in the default
``pytest`` run: ``python3 -m pytest experiments/test_fp8_ws.py``).

Gluon has no CPU interpreter: on a CPU machine these tests check the argument errors and compile the
kernel for sm_90 (producer / consumer partitions, register reallocation, fp8 wgmma, TMA); the
``gpu``-marked tests run it on an sm_90 GPU, where it must give the same bits as the Triton prefill
kernel (same per-128-K wgmma partials, same promotion FFMAs in the same order, one bf16 rounding)
and stay within the block-scaled GEMM tolerance of the exact sum.
"""
import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from kernel_helpers import check_gemm, need_gpu, run_aot_script  # noqa: E402

pytest.importorskip("triton")

from dsv4.formats.fp8 import act_quant_fp8 as act_quant_ref  # noqa: E402
from dsv4.formats.fp8 import dequant_fp8_weight, e8m0_to_fp32, quant_fp8_weight  # noqa: E402
from dsv4.kernels.gemm import fp8_prefill as P  # noqa: E402
from experiments import fp8_ws as WS  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _inputs(M, N, K, seed):
    """Rows of very different magnitudes (and a zero row), a K block far smaller than the others,
    weight blocks with scales spread over 2^20."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen) * torch.exp2(torch.randint(-6, 7, (M, 1), generator=gen).float())
    x[M // 2] = 0
    x[:, 128:256] *= 2.0 ** -9
    W = torch.randn(N, K, generator=gen) * 0.05
    f = torch.exp2(torch.randint(-10, 11, (-(-N // 128), K // 128), generator=gen).float())
    W = W * f.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)
    wq, ws = quant_fp8_weight(W)
    xq, xs = act_quant_ref(x.bfloat16())
    return xq, xs, wq, ws, dequant_fp8_weight(wq, ws)


def test_fp8_ws_argument_errors():
    xq, xs, wq, ws, _ = _inputs(64, 256, 256, seed=0)
    with pytest.raises(ValueError, match="unknown config keys"):
        WS.resolve_config({"BM": 64})
    with pytest.raises(ValueError, match="BN must be"):
        WS.resolve_config({"BN": 96})
    with pytest.raises(ValueError, match="STAGES must be"):
        WS.resolve_config({"STAGES": 1})
    with pytest.raises(ValueError, match="shapes xq"):
        WS.fp8_gemm_ws(xq[:, :128], xs, wq, ws)
    with pytest.raises(ValueError, match="expected e4m3 activations"):
        WS.fp8_gemm_ws(xq.float(), xs, wq, ws)
    if not WS.available(xq.device):     # this machine: no sm_90 GPU -> a clear error, not a crash
        with pytest.raises(ValueError, match="needs an sm_90 GPU"):
            WS.fp8_gemm_ws(xq, xs, wq, ws)
        assert not WS.supports(xq, wq, ws, torch.empty(64, 256, dtype=torch.bfloat16))


_AOT_SCRIPT = textwrap.dedent("""
    import os, re, sys
    sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], "tests")]
    import triton
    from kernel_helpers import aot_compile
    from experiments import fp8_ws as WS
    if not WS.GLUON:
        print("no Gluon Hopper ops in this triton"); sys.exit(0)
    from triton.experimental.gluon import language as gl
    from triton.runtime.jit import mangle_type
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    import torch

    def desc(dtype, gdt, block):   # the JIT's signature string of a host descriptor of this block
        t = torch.empty(256, 256, dtype=dtype)
        return mangle_type(TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gdt)))

    cfg = WS.DEFAULT_CONFIG
    for e8, ahead in ((True, True), (False, True), (True, False)):
        types = dict(a_desc=desc(torch.float8_e4m3fn, gl.float8e4nv, [64, 128]),
                     b_desc=desc(torch.float8_e4m3fn, gl.float8e4nv, [128, 128]),
                     c_desc=desc(torch.bfloat16, gl.bfloat16, [64, 128]), SA="*fp32", SB="*u8" if e8 else "*fp32")
        const = dict(GROUP_M=cfg["GROUP_M"], STAGES=cfg["STAGES"], SB_E8M0=e8, AHEAD=ahead, CONSUMER_REGS=cfg["CONSUMER_REGS"],
                     PRODUCER_REGS=cfg["PRODUCER_REGS"])
        ptx, mma = aot_compile(WS._fp8_ws_kernel, types, const, 90, 4, div=("M", "N", "K", "stride_sbn"))
        assert mma == ["wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"], mma
        assert re.search(r"cp\\.async\\.bulk\\.tensor\\.2d\\.shared::(cluster|cta)\\.global", ptx), "expected TMA loads"
        assert "cp.async.bulk.tensor.2d.global.shared::cta" in ptx, "expected TMA stores"
        assert re.search(r"setmaxnreg\\.dec\\.sync\\.aligned\\.u32\\s+40", ptx), "expected a 40-register producer"
        assert re.search(r"setmaxnreg\\.(inc|dec)\\.sync\\.aligned\\.u32\\s+232", ptx), "expected 232-register consumers"
        # one thread per consumer partition releases a stage (the empty barriers count two arrivals);
        # AHEAD has a second release site (the tile's last block)
        assert len(re.findall(r"@%p\\d+ mbarrier\\.arrive\\.shared::cta\\.b64", ptx)) == (4 if ahead else 2)
""")


def test_aot_compile_sm90():
    run_aot_script(_AOT_SCRIPT, REPO, timeout=600)


# ------------------------------------------------------------------------------------------------
# GPU (sm_90)

def _need_sm90():
    need_gpu()
    if not WS.available("cuda"):
        pytest.skip("needs an sm_90 GPU with Gluon")


def _bits(t):
    return t.cpu().view(torch.int16)


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(37, 200, 384), (130, 136, 256), (300, 448, 1024), (1000, 1024, 2048)])
@pytest.mark.parametrize("cfg", [None, {"STAGES": 2, "GRID": 3, "GROUP_M": 1}, {"BN": 64, "AHEAD": True},
                                 {"AHEAD": True, "GRID": 5, "STAGES": 3}])
def test_gpu_fp8_ws_matches_triton_kernel(M, N, K, cfg):
    """Row / column tails (zero-filled TMA loads, clipped stores), a grid smaller than the tile count
    (several tiles per CTA, the ring wrapping across tiles), 2 stages, e8m0 and fp32 scales: the
    bits of the Triton prefill kernel, within the block-scaled GEMM bound of the exact sum."""
    _need_sm90()
    xq, xs, wq, ws, Wd = _inputs(M, N, K, seed=M + N + K)
    d = lambda t: t.cuda()   # noqa: E731
    ref = P.fp8_gemm_prefill(d(xq), d(xs), d(wq), d(ws))
    for s in (ws, e8m0_to_fp32(ws)):
        y = WS.fp8_gemm_ws(d(xq), d(xs), d(wq), d(s), config=cfg)
        assert torch.equal(_bits(y), _bits(ref)), (y.float() - ref.float()).abs().max().item()
    check_gemm(y, xq, xs, Wd, acc=2.0 ** -12)
    out = torch.full((M, N), 7.0, dtype=torch.bfloat16, device="cuda")
    assert WS.fp8_gemm_ws(d(xq), d(xs), d(wq), d(ws), out=out, config=cfg) is out
    assert torch.equal(_bits(out), _bits(ref))


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(4096, 4096), (32768, 1024), (7168, 16384)])
def test_gpu_fp8_ws_prefill_shapes(N, K):
    """V4 prefill shapes at 4096 tokens: the Triton kernel's bits."""
    _need_sm90()
    from dsv4.kernels.gemm import fp8 as G8
    gen = torch.Generator().manual_seed(N + K)
    x = (torch.randn(4096, K, generator=gen) * 2).bfloat16().cuda()
    wq, ws = quant_fp8_weight(torch.randn(N, K, generator=gen) * 0.02)
    xq, xs = G8.act_quant_fp8(x)
    wq, ws = wq.cuda(), ws.cuda()
    y = WS.fp8_gemm_ws(xq, xs, wq, ws)
    ref = P.fp8_gemm_prefill(xq, xs, wq, ws)
    assert torch.equal(_bits(y), _bits(ref))
