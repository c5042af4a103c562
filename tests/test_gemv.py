"""The decode GEMV on CUDA cores (dsv4/kernels/gemm/gemv.py: FP8 and FP4 weights) against the exact sum:
the same products as the GEMMs, another fp32 summation order.

On a CPU machine the kernels run under the Triton interpreter (the conftest sets TRITON_INTERPRET=1
when no CUDA device is present) at tiny shapes. On a GPU machine a plain ``pytest`` runs the same tests
compiled on CUDA and the ``gpu``-marked tests add V4-Flash shapes.

Tolerance: ``kernel_helpers.check_gemm`` (one bf16 rounding + fp32 summation order).
"""
import pytest
from kernel_helpers import check_gemm, fp4_weight as _fp4_weight, kernel_device, need_gpu
import torch

pytest.importorskip("triton")

from dsv4.formats.fp8 import act_quant_fp8 as act_quant_ref  # noqa: E402
from dsv4.formats.fp8 import dequant_fp8_weight, quant_fp8_weight  # noqa: E402
from dsv4.kernels.gemm import fp8 as G8  # noqa: E402
from dsv4.twins import gemm as GT  # noqa: E402

DEV = kernel_device()


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8"])
@pytest.mark.parametrize("M,split", [(1, None), (3, 2), (5, 1)])
def test_gemv_against_exact(fmt, M, split):
    """Plain (non-grouped) GEMV: 1-, 2- and 4-row tiles (M=3 pads a 4-row tile, M=5 takes two),
    split-K partials summed in split order; FP8 with the activation quantised in the prologue is
    bit-identical to the pre-quantised input."""
    from dsv4.kernels.gemm import gemv as V
    gen = torch.Generator().manual_seed(M * 7 + len(fmt))
    K, N = 512, 80
    x = (torch.randn(M, K, generator=gen) * 2).bfloat16()
    xq, xs = act_quant_ref(x)
    cfg = {"SPLIT_K": split} if split else None
    if fmt == "fp8":
        W = torch.randn(N, K, generator=gen) * 0.05
        q, s = quant_fp8_weight(W)
        Wd = dequant_fp8_weight(q, s)
        y = V.fp8_gemv(x.to(DEV), q.to(DEV), s.to(DEV), config=cfg)
        y2 = V.fp8_gemv(xq.to(DEV), q.to(DEV), s.to(DEV), xs=xs.to(DEV), config=cfg)
        assert torch.equal(y.cpu().view(torch.int16), y2.cpu().view(torch.int16))
        twin = GT.fp8_gemm(xq, xs, q, s)
        check_gemm(y, xq, xs, Wd, twin, acc=2.0 ** -16)
    else:
        wp, s, s2, Wd = _fp4_weight(fmt, N, K, gen)
        y = V.fp4_gemv(xq.to(DEV), xs.to(DEV), wp.to(DEV), s.to(DEV), fmt, None if s2 is None else s2.to(DEV),
                       config=cfg)
        check_gemm(y, xq, xs, Wd, GT.fp4_gemm(xq, xs, wp, s, fmt, s2))


def test_gemv_rejects_bad_tile_rows():
    from dsv4.kernels.gemm import gemv as V
    q, s = quant_fp8_weight(torch.randn(128, 128))
    a = torch.zeros(3, 128, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bm must be 1, 2 or 4"):
        V.gemv_launch(a, torch.ones(3, 1), q, s, None, 3, 128, 128, wfmt="fp8", bm=3)


# ------------------------------------------------------------------------------------------------
# GPU: V4-Flash shapes (skipped without CUDA by the conftest)

_need_gpu = need_gpu


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("M", [1, 2, 4])
def test_gpu_gemv_flash_shapes(fmt, M):
    """The decode GEMV at V4-Flash decode shapes (split-K chosen by the launcher) against the exact sum."""
    _need_gpu()
    from dsv4.kernels.gemm import gemv as V
    gen = torch.Generator().manual_seed(M + len(fmt))
    shapes = [(1024, 4096), (32768, 1024), (4096, 8192)] if fmt == "fp8" else [(4096, 4096), (4096, 2048)]
    for N, K in shapes:
        x = (torch.randn(M, K, generator=gen) * 2).bfloat16()
        xq, xs = G8.act_quant_fp8(x.cuda())
        if fmt == "fp8":
            wq, ws = quant_fp8_weight(torch.randn(N, K, generator=gen) * 0.02)
            y = V.fp8_gemv(x.cuda(), wq.cuda(), ws.cuda())
            check_gemm(y, xq, xs, dequant_fp8_weight(wq, ws))
        else:
            wp, s, s2, Wd = _fp4_weight(fmt, N, K, gen)
            y = V.fp4_gemv(xq, xs, wp.cuda(), s.cuda(), fmt, None if s2 is None else s2.cuda())
            check_gemm(y, xq, xs, Wd)
