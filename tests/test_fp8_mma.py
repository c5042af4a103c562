"""The tensor-core FP8 decode GEMM (dsv4/kernels/fp8_mma.py) against the exact block-scaled sum.

Gluon kernels have no CPU interpreter: on a CPU machine these tests check the argument errors (and
the AOT test of test_gemm.py compiles the kernel for sm_90 / sm_100); the ``gpu``-marked
tests run it on V4-Flash decode shapes. Tolerance: ``kernel_helpers.check_gemm`` (one bf16 rounding
+ fp32 summation order) against the fp64 sum of the same exact products; the in-kernel activation
quantisation is held to ``act_quant_fp8``'s bytes bit for bit (same output as the pre-quantised call).
"""
import pytest  # noqa: E402
import torch  # noqa: E402
from kernel_helpers import check_gemm, need_gpu  # noqa: E402

pytest.importorskip("triton")

from dsv4.formats.fp8 import dequant_fp8_weight, quant_fp8_weight  # noqa: E402
from dsv4.kernels.gemm import fp8 as G8, linear as GL  # noqa: E402
from dsv4.kernels import lib as L  # noqa: E402
from dsv4.kernels.lib import target, u8  # noqa: E402
from dsv4.twins import gemm as GT  # noqa: E402
from dsv4.kernels.gemm import fp8_mma as F  # noqa: E402


def _weight(N, K, gen, per_row=False, e8m0=True):
    W = torch.randn(N, K, generator=gen) * 0.05
    W[: N // 3] *= 2.0 ** -9                      # scale blocks far apart
    q, s = quant_fp8_weight(W)
    Wd = dequant_fp8_weight(q, s)
    if per_row:
        s = s.repeat_interleave(128, 0)[:N]
    s = s.view(torch.uint8) if e8m0 else s.float()
    return q, s, Wd


def test_fp8_mma_argument_errors():
    gen = torch.Generator().manual_seed(0)
    q, s, _ = _weight(256, 256, gen)
    x = torch.randn(2, 256).bfloat16()
    xq, xs = GT.act_quant_fp8(x)
    with pytest.raises(ValueError, match="either xq and xs"):
        F.fp8_mma(q, s, xq, xs, x_bf16=x)
    with pytest.raises(ValueError, match="x_bf16 must be bf16"):
        F.fp8_mma(q, s, x_bf16=x.float())
    with pytest.raises(ValueError, match="shapes xq"):
        F.fp8_mma(q, s, xq[:, :128], xs)
    with pytest.raises(ValueError, match="fp8 weight scale"):
        F.fp8_mma(q, s[:1], xq, xs)
    with pytest.raises(ValueError, match="16 rows per warp"):
        F.fp8_mma(q, s, xq, xs, config={"BN": 64, "num_warps": 2})
    with pytest.raises(ValueError, match="unknown config keys"):
        F.fp8_mma(q, s, xq, xs, config={"BM": 8})
    with pytest.raises(ValueError, match="UNROLL must be 1 or 2"):
        F.fp8_mma(q, s, xq, xs, config={"UNROLL": 4})
    with pytest.raises(ValueError, match="act must be"):
        F.fp8_mma(q, s, x_bf16=x, act="fp16")
    with pytest.raises(ValueError, match="one group"):
        F.fp8_mma(q, s, xq, xs, act="bf16")
    with pytest.raises(ValueError, match="do not split into 3 groups"):
        F.fp8_mma(q, s, x_bf16=x, groups=3)
    with pytest.raises(ValueError, match=r"x_bf16 must be bf16 \[M, 512\]"):
        F.fp8_mma(q, s, x_bf16=x, act="bf16", groups=2)
    if not target(q.device).gluon_mma:
        with pytest.raises(RuntimeError, match="sm_89"):
            F.fp8_mma(q, s, xq, xs)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 3, 8, 13])
def test_gpu_fp8_mma_flash_shapes(M):
    """V4-Flash decode linears (wq_a|wkv, wq_b, wo_b, a short N = 200 edge): pre-quantised and
    in-kernel quantised activations give the same bits; both within the exact-sum bound; split
    partials sum to the result; a second call (counters reset by the last arriver) repeats it."""
    need_gpu()
    gen = torch.Generator().manual_seed(M)
    for N, K in [(1536, 4096), (32768, 1024), (4096, 8192), (200, 1024)]:
        q, s, Wd = _weight(N, K, gen)
        x = (torch.randn(M, K, generator=gen) * 3).bfloat16().cuda()
        xq, xs = G8.act_quant_fp8(x)
        qc, sc = q.cuda(), s.cuda()
        y = F.fp8_mma(qc, sc, xq, xs)
        check_gemm(y, xq, xs, Wd, acc=2.0 ** -16)
        y2 = F.fp8_mma(qc, sc, x_bf16=x)
        assert torch.equal(y, y2), "in-kernel act quant differs from act_quant_fp8"
        assert torch.equal(F.fp8_mma(qc, sc, xq, xs), y), "second call differs (counter reset)"
        for S in (1, 3):
            assert torch.equal(F.fp8_mma(qc, sc, xq, xs, split=S), F.fp8_mma(qc, sc, x_bf16=x, split=S))
            check_gemm(F.fp8_mma(qc, sc, xq, xs, split=S), xq, xs, Wd)
        # two K blocks per step: the same additions in the same order (odd block counts per split at S 3)
        for S in (None, 3):
            u2 = {"UNROLL": 2}
            assert torch.equal(F.fp8_mma(qc, sc, xq, xs, split=S, config=u2), F.fp8_mma(qc, sc, xq, xs, split=S))
            assert torch.equal(F.fp8_mma(qc, sc, x_bf16=x, split=S, config=u2), F.fp8_mma(qc, sc, x_bf16=x, split=S))
        part = F.fp8_mma(qc, sc, xq, xs, partial=True, split=4)
        assert part.shape == (4, M, N)
        check_gemm(part.sum(0).bfloat16(), xq, xs, Wd)


@pytest.mark.gpu
@pytest.mark.parametrize("per_row,e8m0", [(True, True), (False, False)])
def test_gpu_fp8_mma_scale_forms(per_row, e8m0):
    """Per-row weight scales and fp32 (non-e8m0) scale tensors."""
    need_gpu()
    gen = torch.Generator().manual_seed(7)
    q, s, Wd = _weight(4096, 2048, gen, per_row=per_row, e8m0=e8m0)
    x = torch.randn(4, 2048, generator=gen).bfloat16().cuda()
    xq, xs = G8.act_quant_fp8(x)
    check_gemm(F.fp8_mma(q.cuda(), s.cuda(), xq, xs), xq, xs, Wd)


@pytest.mark.gpu
def test_gpu_fp8_mma_cuda_graph_and_linear_route():
    """Captured in a CUDA graph, replays equal the eager call; ``fp8_linear`` at decode rows routes
    here on sm_89+ and gives the same bits."""
    need_gpu()
    gen = torch.Generator().manual_seed(3)
    q, s, _ = _weight(8192, 1024, gen)
    qc, sc = q.cuda(), s.cuda()
    x = torch.randn(2, 1024, generator=gen).bfloat16().cuda()
    ref = F.fp8_mma(qc, sc, x_bf16=x)
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        F.fp8_mma(qc, sc, x_bf16=x)
    torch.cuda.current_stream().wait_stream(st)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = F.fp8_mma(qc, sc, x_bf16=x)
    for _ in range(3):
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)
    assert torch.equal(GL.fp8_linear(x, qc, sc), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 5, 12, 64, 128])       # up to WO_A_MAX_ROWS: the decode buckets
def test_gpu_fp8_mma_grouped_bf16_wo_a(M):
    """V4-Flash wo_a: the grouped einsum "tgd,grd->tgr" (8 groups of 1024 rows, d 4096) with bf16
    activations and the FP8 weight dequantised in the kernel, against the fp64 einsum of the exact
    dequantised weight: one bf16 rounding + fp32 summation order."""
    need_gpu()
    gen = torch.Generator().manual_seed(M)
    G, R, D = 8, 1024, 4096
    q, s, Wd = _weight(G * R, D, gen)
    og = (torch.randn(M, G, D, generator=gen) * 2).bfloat16()
    z = F.fp8_mma(q.cuda(), s.cuda(), x_bf16=og.view(M, G * D).cuda(), act="bf16", groups=G)
    ex = torch.einsum("tgd,grd->tgr", og.double(), Wd.double().view(G, R, D)).reshape(M, G * R)
    mag = torch.einsum("tgd,grd->tgr", og.double().abs(), Wd.double().abs().view(G, R, D)).reshape(M, G * R)
    err = (z.cpu().double() - ex).abs()
    assert (err <= 2.0 ** -8 * ex.abs() + 2.0 ** -20 * mag + 1e-30).all(), (err - 2.0 ** -8 * ex.abs()).max()
    # the bf16 einsum of the dequantised weight (torch's, on the GPU): the same up to summation order
    zt = torch.einsum("tgd,grd->tgr", og.cuda(), Wd.view(G, R, D).bfloat16().cuda()).reshape(M, G * R)
    for S in (None, 3):
        assert torch.equal(F.fp8_mma(q.cuda(), s.cuda(), x_bf16=og.view(M, G * D).cuda(), act="bf16", groups=G,
                                     split=S, config={"UNROLL": 2}),
                           F.fp8_mma(q.cuda(), s.cuda(), x_bf16=og.view(M, G * D).cuda(), act="bf16", groups=G,
                                     split=S))
    assert ((z.float() - zt.float()).abs() <= 2.0 ** -7 * zt.float().abs() + 2.0 ** -19 * mag.float().cuda()).all()
