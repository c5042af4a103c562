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


# ------------------------------------------------------------------------------------------------
# GPU: real shapes (skipped without CUDA by the conftest)

_need_gpu = need_gpu


@pytest.mark.gpu
@pytest.mark.parametrize("T,D", [(1, 1024), (64, 512), (2048, 4096), (64, 7168)])
def test_gpu_rms_norm_real_shapes(T, D):
    _need_gpu()
    _check_rms_norm(T, D, torch.bfloat16, torch.Generator().manual_seed(T + D), device="cuda")
