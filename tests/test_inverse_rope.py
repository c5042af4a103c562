"""Inverse RoPE (+ FP8 act quant) of the attention output (dsv4/kernels/inverse_rope.py) against its
torch twin, bit for bit.

On a CPU machine the kernels run under the Triton interpreter (the conftest sets TRITON_INTERPRET=1
when no CUDA device is present) at tiny shapes. On a GPU machine a plain ``pytest`` runs the same tests
compiled on CUDA, and the ``gpu``-marked tests add real shapes.
"""
import pytest
from kernel_helpers import kernel_device, need_gpu, random_position_rope as _rope_tables
import torch

pytest.importorskip("triton")

from dsv4.kernels.inverse_rope import inverse_rope  # noqa: E402
from dsv4.twins.inverse_rope import inverse_rope as inverse_rope_twin  # noqa: E402

DEV = kernel_device()


@pytest.mark.parametrize("H", [8, 64])
def test_inverse_rope(H):
    gen = torch.Generator().manual_seed(H)
    T = 3 if H == 8 else 1
    o = (torch.randn(T, H, 512, generator=gen) * torch.rand(T, H, 1, generator=gen) * 3).bfloat16()
    o[0, 0, :128] *= 1e-6
    cos, sin = _rope_tables(T, gen, "cpu")
    y = inverse_rope(o.to(DEV), cos.to(DEV), sin.to(DEV)).cpu()
    assert torch.equal(y.view(torch.int16), inverse_rope_twin(o, cos, sin).view(torch.int16))
    yq, ys = inverse_rope(o.to(DEV), cos.to(DEV), sin.to(DEV), fp8=True)
    rq, rs = inverse_rope_twin(o, cos, sin, fp8=True)
    assert torch.equal(yq.cpu().view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(ys.cpu(), rs)


# ------------------------------------------------------------------------------------------------
# GPU: real shapes (skipped without CUDA by the conftest)

_need_gpu = need_gpu


@pytest.mark.gpu
def test_gpu_inverse_rope_real_shapes():
    _need_gpu()
    gen = torch.Generator().manual_seed(1)
    T, H = 256, 128
    o = (torch.randn(T, H, 512, generator=gen) * 2).bfloat16()
    cos, sin = _rope_tables(T, gen, "cpu")
    y = inverse_rope(o.cuda(), cos.cuda(), sin.cuda()).cpu()
    assert torch.equal(y.view(torch.int16), inverse_rope_twin(o, cos, sin).view(torch.int16))
    yq, ys = inverse_rope(o.cuda(), cos.cuda(), sin.cuda(), fp8=True)
    rq, rs = inverse_rope_twin(o, cos, sin, fp8=True)
    assert torch.equal(yq.cpu().view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(ys.cpu(), rs)
