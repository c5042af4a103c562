"""The fp32-output bf16 GEMM with per-block promotion (dsv4/kernels/gemm/dense_mm.py) against the exact sums.

The contract is the official fp32 GEMM of bf16 operands (the router's gate): products exact, fp32 sums in
any order, so |y - exact| <= 2^-20 * sum |products| at these sizes. On a CPU machine the kernel runs under
the Triton interpreter; the ``gpu`` test adds V4-Flash's gate at prefill size, where the promotion has to
keep the tensor cores' truncating accumulation at the fp32 GEMM's accuracy.
"""
import pytest
from kernel_helpers import kernel_device, need_gpu
import torch

pytest.importorskip("triton")

from dsv4.kernels.gemm import dense_mm as D  # noqa: E402
from dsv4.kernels.gemm import route  # noqa: E402
from dsv4.kernels import lib  # noqa: E402

DEV = kernel_device()


def _err(y, x, w):
    ex = x.double() @ w.double().T
    mag = x.double().abs() @ w.double().abs().T
    return (y.cpu().double() - ex).abs(), mag


@pytest.mark.parametrize("M,N,K", [(37, 40, 200), (16, 64, 64), (70, 33, 96)])
def test_dense_mm_against_exact(M, N, K):
    """Rows, columns and K off the tiles (masked loads and stores); a K of one block."""
    gen = torch.Generator().manual_seed(M + N + K)
    x = torch.randn(M, K, generator=gen).bfloat16()
    w = (torch.randn(N, K, generator=gen) * 0.05).bfloat16()
    y = D.dense_mm(x.to(DEV), w.to(DEV))
    assert y.dtype == torch.float32 and y.shape == (M, N)
    err, mag = _err(y, x, w)
    assert (err <= 2.0 ** -20 * mag + 1e-30).all(), (err / mag).max().item()


def test_dense_mm_strided_rows_and_empty():
    """x and w may be row-strided views (K contiguous); zero rows give an empty result."""
    gen = torch.Generator().manual_seed(4)
    xb = torch.randn(20, 2 * 96, generator=gen).bfloat16()
    wb = torch.randn(24, 3 * 96, generator=gen).bfloat16()
    x, w = xb[:, :96], wb[:, 96:192]
    err, mag = _err(D.dense_mm(x.to(DEV), w.to(DEV)), x, w)
    assert (err <= 2.0 ** -20 * mag + 1e-30).all()
    assert D.dense_mm(torch.zeros(0, 96, dtype=torch.bfloat16, device=DEV), w.to(DEV)).shape == (0, 24)


@pytest.mark.parametrize("x,w,match", [
    (torch.zeros(4, 64), torch.zeros(8, 64).bfloat16(), "x must be bf16"),
    (torch.zeros(4, 64).bfloat16(), torch.zeros(8, 64), "w must be bf16"),
    (torch.zeros(4, 64).bfloat16(), torch.zeros(8, 32).bfloat16(), r"expected x \[M, K\] and w \[N, K\]"),
])
def test_dense_mm_rejects(x, w, match):
    with pytest.raises(ValueError, match=match):
        D.dense_mm(x.to(DEV), w.to(DEV))


def test_dense_mm_route_prefill_rows_only():
    """The router's gate takes the kernel from PREFILL_STEP_MIN_ROWS rows on sm_80+; decode and verify sizes
    (up to 1024 rows) keep the fp32 GEMM."""
    t = lib.aot_target(90)
    assert route.dense_mm(8192, t) and route.dense_mm(route.PREFILL_STEP_MIN_ROWS, t)
    assert not route.dense_mm(1024, t) and not route.dense_mm(1, t)
    assert not route.dense_mm(8192, lib.Target("cuda", (7, 5), 40))
    assert any(c.kernel == "dense_mm" for c in route.choices(t))


@pytest.mark.gpu
def test_dense_mm_flash_gate_gpu():
    """V4-Flash's gate (256 x 4096, bf16-exact) at 4096 tokens: no larger error against the exact sums than
    torch's fp32 GEMM (doubled: another summation order), where one unpromoted tensor-core accumulator over
    K is several times worse (module doc)."""
    need_gpu()
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(4096, 4096, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(256, 4096, generator=gen, device="cuda") * 0.02).bfloat16()
    ex = x.double() @ w.double().T
    y = D.dense_mm(x, w)
    sgemm = (x.float() @ w.float().T).double()
    e_k, e_f = (y.double() - ex).abs().max().item(), (sgemm - ex).abs().max().item()
    assert e_k <= 2 * e_f, (e_k, e_f)
