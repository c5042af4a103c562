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


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 3, 64])
def test_gpu_mma_gemv_grouped_tile_lookup(T):
    """Grouped launches over 256 experts (T tokens x top-6, some experts sharing rows, dead tiles past the
    host's bound): the vector tile lookup (``VEC_TILES``) finds every tile's expert and rows as the binary
    search does, so the outputs are the same bits, split partials included; each live pair's row equals
    its expert's plain (one-expert) launch."""
    _need_gpu()
    from dsv4.kernels.gemm import fp4_mma as F
    from dsv4.kernels.moe import sort_pairs
    gen = torch.Generator().manual_seed(T)
    E, N, K, k = 256, 128, 512, 6
    wp, sc = quant_mxfp4(torch.randn(E * N, K, generator=gen) * 0.05)
    w, ws = u8(wp).view(E, N, K // 2).cuda(), sc.view(torch.uint8).view(E, N, K // 32).cuda()
    ids = torch.stack([torch.randperm(E // 4, generator=gen)[:k] * 4 for _ in range(T)])   # 64 experts in use
    eflat = ids.reshape(-1).to(torch.int32).cuda()
    perm, offs, tcum, inv = sort_pairs(eflat, E, F.BM_ROWS)
    P = T * k
    xq, xs = G8.act_quant_fp8((torch.randn(T, K, generator=gen) * 2).bfloat16().cuda())
    grouped = dict(perm=perm, offs=offs, tcum=tcum, top_k=k, n_groups=E, n_tiles=min(P, -(-P // F.BM_ROWS) + E))
    for split in (None, 2):
        outs = [F.mma_gemv_launch(u8(xq), xs, w, ws, P, N, K, partial=split is not None, split=split,
                                  config={"VEC_TILES": vec}, **grouped) for vec in (False, True)]
        assert torch.equal(outs[0], outs[1])
    y = outs[0].sum(0)                                   # [P sorted rows, N] from the split partials
    for r in (0, P // 2, P - 1):                         # sorted row r: pair perm[r], token perm[r] // k
        pair = int(perm[r])
        e, tok = int(eflat[pair]), pair // k
        one = F.mma_gemv_launch(u8(xq)[tok:tok + 1], xs[tok:tok + 1], w[e:e + 1], ws[e:e + 1], 1, N, K,
                                partial=True, split=2)
        torch.testing.assert_close(y[r], one.sum(0)[0], rtol=1e-5, atol=1e-6)
