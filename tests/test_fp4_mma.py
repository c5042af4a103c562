"""The tensor-core FP4 decode GEMM (dsv4/kernels/fp4_mma.py, Gluon) against the exact block-scaled sum.

Gluon kernels have no CPU interpreter: on a CPU machine nothing here runs (the AOT test of test_gemm.py
compiles the kernel for sm_90 / sm_100, test_targets.py for every GPU generation); the ``gpu``-marked
test runs it at V4-Flash expert shapes. Tolerance: ``kernel_helpers.check_gemm`` (one bf16 rounding +
fp32 summation order) against the fp64 sum of the same exact products.
"""
import pytest
from kernel_helpers import check_gemm, need_gpu
import torch

pytest.importorskip("triton")

from dsv4.formats.fp4 import dequant_mxfp4, dequant_nvfp4, quant_mxfp4, quant_nvfp4  # noqa: E402
from dsv4.kernels.gemm import fp8 as G8  # noqa: E402
from dsv4.kernels import lib as L  # noqa: E402
from dsv4.kernels.lib import target, u8  # noqa: E402
from dsv4.twins import gemm as GT  # noqa: E402


# ------------------------------------------------------------------------------------------------
# GPU: V4-Flash expert shapes (skipped without CUDA by the conftest)

_need_gpu = need_gpu


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 5, 8, 13])
@pytest.mark.parametrize("fmt,spread", [("mxfp4", "none"), ("mxfp4", "2^16"), ("mxfp4", "2^40"), ("nvfp4", "2^16")])
def test_gpu_mma_gemv_flash_shapes(M, fmt, spread):
    """The tensor-core FP4 decode kernel (fp4_mma.py) at V4-Flash expert shapes against the exact sum:
    1-13 rows (one or two 8-row tiles), MXFP4 group scales spread inside a 128-K block up to the
    folded f16 weights' exact limit (2^16 here; 2^32 in general) and past it (2^40: small groups
    round), NVFP4 with its e4m3 group and fp32 global scales."""
    _need_gpu()
    from dsv4.kernels.gemm import fp4_mma as F
    gen = torch.Generator().manual_seed(M)
    for N, K in [(4096, 4096), (4096, 2048), (200, 1024)]:      # w1|w3, w2, N not a multiple of 64
        x = (torch.randn(M, K, generator=gen) * 2).bfloat16()
        W = torch.randn(N, K, generator=gen) * 0.05
        if spread != "none":
            e = 16 if spread == "2^16" else 40
            W[:, 32:64] *= 2.0 ** -12
            W[:, 64:96] *= 2.0 ** -e
        if fmt == "mxfp4":
            wp, sc = quant_mxfp4(W)
            s2, Wd = None, dequant_mxfp4(wp, sc)
        else:
            wp, sc, s2 = quant_nvfp4(W)
            Wd = dequant_nvfp4(wp, sc, s2)
            s2 = s2.float().reshape(-1).expand(N).contiguous()[None].cuda()
        xq, xs = G8.act_quant_fp8(x.cuda())
        args = (u8(xq), xs, u8(wp).cuda()[None], sc.view(torch.uint8).cuda()[None], M, N, K)
        y = F.mma_gemv_launch(*args, fmt=fmt, ws2=s2)
        check_gemm(y, xq, xs, Wd)
        part = F.mma_gemv_launch(*args, fmt=fmt, ws2=s2, partial=True, split=4)
        check_gemm(part.sum(0).bfloat16(), xq, xs, Wd)
        # the f16 activation operand: the same values, products and order, so the same bits
        assert torch.equal(F.mma_gemv_launch(F.act_f16_split(args[0]), *args[1:], fmt=fmt, ws2=s2), y)
        if N % F.BAND_ROWS == 0:   # the band layout: same products in the same order, so the same bits
            sb = 4 if fmt == "mxfp4" else 8
            band = (args[0], args[1], F.band_layout(args[2], 64), F.band_layout(args[3], sb), M, N, K)
            assert torch.equal(F.mma_gemv_launch(*band, fmt=fmt, ws2=s2), y)
            assert torch.equal(F.mma_gemv_launch(*band, fmt=fmt, ws2=s2, partial=True, split=4), part)
