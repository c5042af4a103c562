"""The fp32-output GEMV of bf16 / fp32 weights (dsv4/kernels/gemm/dense_gemv.py) against the exact sum.

The contract is the official fp32 GEMM of the operands: bf16 x bf16 products exact, bf16 x fp32 ones
rounded once, fp32 sums in any order. So |y - exact| <= 2^-22 * sum |products| (fp32 accumulation over
K <= 8192 terms, tensor-core accumulation on CUDA). On a CPU machine the kernel runs under the Triton
interpreter; on a GPU machine a plain ``pytest`` runs the same tests compiled, and the ``gpu`` test adds
the V4 shapes against torch's own GEMM.
"""
import pytest
from kernel_helpers import kernel_device, need_gpu
import torch

pytest.importorskip("triton")

from dsv4.kernels.counters import arrival_counters  # noqa: E402
from dsv4.kernels.gemm import dense_gemv as D  # noqa: E402

DEV = kernel_device()


def _check(y, x, w, acc=2.0 ** -20):
    ex = x.double() @ w.double().T
    mag = x.double().abs() @ w.double().abs().T
    y = y.cpu().double()
    assert y.shape == ex.shape and torch.isfinite(y).all()
    excess = (y - ex).abs() - (acc * mag + 1e-30)
    assert (excess <= 0).all(), f"max excess {excess.max().item()}"


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N,K,cfg", [
    (40, 96, None),                                  # N, K off the tiles
    (64, 200, {"SPLIT": 1}),                         # no split: a plain store
    (33, 320, {"SPLIT": 3}),                         # the in-kernel split sum, ragged last split
])
def test_dense_gemv_against_exact(wdtype, N, K, cfg):
    gen = torch.Generator().manual_seed(N + K)
    x = torch.randn(1, K, generator=gen).bfloat16()
    w = (torch.randn(N, K, generator=gen) * 0.05).to(wdtype)
    y = D.dense_gemv(x.to(DEV), w.to(DEV), config=cfg)
    assert y.dtype == torch.float32
    _check(y, x, w)


def test_dense_gemv_split_sum_deterministic_and_counters_reset():
    """The split partials are summed in split order by whichever program arrives last: two calls give the
    same bits, and the counters are back at zero for the next launch."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, 512, generator=gen).bfloat16().to(DEV)
    w = torch.randn(70, 512, generator=gen).bfloat16().to(DEV)
    a = D.dense_gemv(x, w, config={"SPLIT": 4})
    b = D.dense_gemv(x, w, config={"SPLIT": 4})
    assert torch.equal(a.cpu(), b.cpu())
    assert int(arrival_counters(DEV, 8)[:8].abs().sum()) == 0
    _check(a, x.cpu(), w.cpu())


def test_dense_gemv_strided_weight_rows():
    """w may be a row-strided view (its K axis contiguous)."""
    gen = torch.Generator().manual_seed(3)
    big = torch.randn(24, 2 * 160, generator=gen).bfloat16()
    w = big[:, :160]
    x = torch.randn(1, 160, generator=gen).bfloat16()
    _check(D.dense_gemv(x.to(DEV), w.to(DEV)), x, w)


@pytest.mark.parametrize("M,cfg,wdtype", [(3, {"SPLIT": 3, "RB": 2}, torch.bfloat16), (6, {"SPLIT": 1}, torch.float32),
                                          (5, {"SPLIT": 2}, torch.bfloat16)])
def test_dense_gemv_rows_are_the_one_row_launchs_bits(M, cfg, wdtype):
    """M rows (RB of them a program, each with its own accumulator; rows past M in the last program masked): a row
    is the one-row launch's result on it, bit for bit (the same tiles and summation order), with and without the
    split sum (rows checked: every slot of a 4-row program, the first and the last); every counter back at zero."""
    gen = torch.Generator().manual_seed(M)
    K, N = 320, 40
    x = (torch.randn(M, K, generator=gen) * torch.logspace(-2, 2, M)[:, None]).bfloat16()
    w = (torch.randn(N, K, generator=gen) * 0.05).to(wdtype)
    y = D.dense_gemv(x.to(DEV), w.to(DEV), config=cfg)
    assert y.shape == (M, N)
    _check(y, x, w)
    for r in sorted({0, 1, M // 2, M - 1, 3 % M}):      # each slot of a 4-row program, the first and last
        one = D.dense_gemv(x[r:r + 1].to(DEV), w.to(DEV), config=dict(cfg, RB=1))
        assert torch.equal(y[r:r + 1].cpu(), one.cpu()), r
    assert int(arrival_counters(DEV, 64)[:64].abs().sum()) == 0


@pytest.mark.parametrize("x,w,cfg,match", [
    (torch.zeros(0, 64), torch.zeros(8, 64), None, "at least one row, got 0"),
    (torch.zeros(2, 64), torch.zeros(8, 64), {"RB": 3}, "RB .rows per program. must be 1, 2 or 4, got 3"),
    (torch.zeros(1, 64), torch.zeros(8, 32), None, r"expected x \[M, K\] and w \[N, K\]"),
    (torch.zeros(1, 64, dtype=torch.float16), torch.zeros(8, 64), None, "x must be bf16 or fp32"),
    (torch.zeros(1, 64), torch.zeros(8, 64, dtype=torch.int8), None, "w must be bf16 or fp32"),
])
def test_dense_gemv_rejects(x, w, cfg, match):
    with pytest.raises(ValueError, match=match):
        D.dense_gemv(x.to(DEV), w.to(DEV), config=cfg)


def test_dense_gemv_route_rows_by_weight_dtype(monkeypatch):
    """The router sends calls of up to ``DENSE_GEMV_MAX_ROWS`` rows of a bf16 weight (2) and
    ``DENSE_GEMV_FP32_MAX_ROWS`` of an fp32 one (8) on modest weights of sm_80+ GPUs here, nothing else."""
    from dsv4.kernels.gemm import route
    from dsv4.kernels import lib
    from dsv4.kernels.lib import aot_target
    t = aot_target(90)
    bf, f32 = torch.bfloat16, torch.float32
    assert route.dense_gemv(1, 2624, 4096, bf, t) and route.dense_gemv(2, 2624, 4096, bf, t)
    assert not route.dense_gemv(3, 2624, 4096, bf, t)                     # cuBLAS's bf16 GEMM from 3 rows
    assert route.dense_gemv(1, 256, 4096, f32, t) and route.dense_gemv(8, 256, 4096, f32, t)
    assert not route.dense_gemv(9, 256, 4096, f32, t)
    assert not route.dense_gemv(0, 2624, 4096, bf, t)
    monkeypatch.setattr(route, "DENSE_GEMV_MAX_ROWS", 4)
    assert route.dense_gemv(4, 2624, 4096, bf, t) and not route.dense_gemv(5, 2624, 4096, bf, t)
    assert not route.dense_gemv(1, 129280, 4096, bf, t)                   # the output head keeps cuBLAS
    assert not route.dense_gemv(1, 256, 4096, torch.float16, t)
    assert not route.dense_gemv(1, 256, 4096, f32, lib.Target("cuda", (7, 5), 40))


@pytest.mark.gpu
def test_dense_gemv_v4_shapes_gpu():
    """V4-Flash's CSA / HCA projection (bf16) and router gate (fp32 weight) against torch's GEMMs at 1, 2, 4 and 7
    rows (the routed 2-row program of the projections, the gate's 4-row programs and a tail), each row the one-row
    launch's bits."""
    need_gpu()
    gen = torch.Generator(device="cuda").manual_seed(1)
    for N, wdtype in ((2624, torch.bfloat16), (1024, torch.bfloat16), (256, torch.float32)):
        for M in (1, 2, 4, 7):                               # one row; the multi-row form (2 or 4 a program, a tail)
            x = torch.randn(M, 4096, generator=gen, device="cuda").bfloat16()
            w = (torch.randn(N, 4096, generator=gen, device="cuda") * 0.02).to(wdtype)
            y = D.dense_gemv(x, w)
            _check(y, x.cpu(), w.cpu())
            ref = x.float() @ w.float().T
            assert (y - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
            assert torch.equal(y[M - 1:], D.dense_gemv(x[M - 1:], w)) and torch.equal(y[:1], D.dense_gemv(x[:1], w))
