"""RMSNorm kernel (dsv4/kernels/norm.py) against the reference RMSNorm.

On a CPU machine the kernels run under the Triton interpreter (the conftest sets TRITON_INTERPRET=1
when no CUDA device is present) at tiny shapes. On a GPU machine a plain ``pytest`` runs the same tests
compiled on CUDA, and the ``gpu``-marked tests add the real V4 shapes.
"""
import pytest
from kernel_helpers import kernel_device, need_gpu
import torch

pytest.importorskip("triton")

DEV = kernel_device()


def _check_rms_norm(T, D, dtype, gen, device=DEV):
    """Against the reference RMSNorm (official numerics): at most one bf16 rounding step apart
    (the fp32 sum of squares is ordered differently), equal in almost every element."""
    from dsv4.kernels.norm import rms_norm
    from dsv4.twins.norm import rms_norm as rms_norm_twin
    x = (torch.randn(T, D, generator=gen) * torch.rand(T, 1, generator=gen) * 8).to(dtype)
    x[0] = 0                                           # an all-zero row: rsqrt(eps), finite zeros
    w = torch.rand(D, generator=gen) + 0.5
    y = rms_norm(x.to(device), w.to(device), 1e-6).cpu().float()
    r = rms_norm_twin(x, w, 1e-6).float()
    assert torch.isfinite(y).all() and torch.equal(y[0], torch.zeros(D))
    assert ((y - r).abs() <= r.abs() * 2.0 ** -7 + 1e-30).all()        # one bf16 ulp (8 significant bits)
    assert (y != r).float().mean().item() < 0.01


@pytest.mark.parametrize("T,D,dtype", [(3, 512, torch.bfloat16), (2, 1024, torch.float32), (1, 7168, torch.bfloat16)])
def test_rms_norm(T, D, dtype):
    _check_rms_norm(T, D, dtype, torch.Generator().manual_seed(T * D))


def test_rms_norm_rejects_wrong_weight():
    from dsv4.kernels.norm import rms_norm
    with pytest.raises(ValueError, match="weight has 64 elements"):
        rms_norm(torch.zeros(2, 128, dtype=torch.bfloat16, device=DEV), torch.ones(64, device=DEV), 1e-6)


def _check_pair(T, DA, DB, gen, device=DEV):
    """rms_norm_pair: the same bits as rms_norm of each column range (one launch instead of two), and
    the twin's values within a bf16 step."""
    from dsv4.kernels.norm import rms_norm, rms_norm_pair
    from dsv4.twins.norm import rms_norm_pair as pair_twin
    x = (torch.randn(T, DA + DB, generator=gen) * torch.rand(T, 1, generator=gen) * 8).bfloat16().to(device)
    wa, wb = (torch.rand(DA, generator=gen) + 0.5).to(device), (torch.rand(DB, generator=gen) + 0.5).to(device)
    ya, yb = rms_norm_pair(x, wa, wb, 1e-6)
    assert torch.equal(ya, rms_norm(x[:, :DA], wa, 1e-6)) and torch.equal(yb, rms_norm(x[:, DA:], wb, 1e-6))
    for y, r in zip((ya, yb), pair_twin(x, wa, wb, 1e-6)):
        y, r = y.float().cpu(), r.float().cpu()
        assert ((y - r).abs() <= r.abs() * 2.0 ** -7 + 1e-30).all()


def test_rms_norm_pair():
    gen = torch.Generator().manual_seed(5)
    _check_pair(3, 192, 64, gen)
    _check_pair(1, 96, 320, gen)                 # the second range wider, neither a power of two
    from dsv4.kernels.norm import rms_norm_pair
    with pytest.raises(ValueError, match=r"rms_norm_pair: x must be \[T, 64 \+ 32\]"):
        rms_norm_pair(torch.zeros(2, 100, dtype=torch.bfloat16, device=DEV), torch.ones(64, device=DEV),
                      torch.ones(32, device=DEV), 1e-6)


# ------------------------------------------------------------------------------------------------
# GPU: real shapes (skipped without CUDA by the conftest)

_need_gpu = need_gpu


@pytest.mark.gpu
@pytest.mark.parametrize("T,D", [(1, 1024), (64, 512), (2048, 4096), (64, 7168)])
def test_gpu_rms_norm_real_shapes(T, D):
    _need_gpu()
    _check_rms_norm(T, D, torch.bfloat16, torch.Generator().manual_seed(T + D), device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("T,DA", [(1, 1024), (1, 1536), (64, 1024)])
def test_gpu_rms_norm_pair_real_shapes(T, DA):
    _need_gpu()
    _check_pair(T, DA, 512, torch.Generator().manual_seed(T + DA), device="cuda")
