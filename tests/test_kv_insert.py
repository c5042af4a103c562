"""The fused q/kv prologue + paged FP8 cache insert (dsv4/kernels/kv_insert.py) against its torch twin.

On a CPU machine the kernels run under the Triton interpreter (the conftest sets TRITON_INTERPRET=1
when no CUDA device is present) at tiny shapes. On a GPU machine a plain ``pytest`` runs the same tests
compiled on CUDA, and the ``gpu``-marked tests add real shapes.
"""
import pytest
from kernel_helpers import kernel_device, need_gpu, random_position_rope as _rope_tables
import torch

pytest.importorskip("triton")

from dsv4.formats.kv_entry import encode_kv_entries, page_bytes  # noqa: E402
from dsv4.formats.kv_entry import page_views  # noqa: E402
from dsv4.kernels.kv_insert import kv_insert  # noqa: E402
from dsv4.twins.kv_insert import kv_insert as kv_insert_twin  # noqa: E402

DEV = kernel_device()


def _ordered(x):
    b = x.view(torch.int16).int()
    return torch.where(b < 0, -(b & 0x7FFF), b)


def _ulps(a, b):
    """bf16 ulp distance (sign-aware, +0 == -0)."""
    return (_ordered(a) - _ordered(b)).abs()


def _check_insert(T, H, B, n_pages, slots, gen, device=DEV):
    q = (torch.randn(T, H, 512, generator=gen) * torch.rand(T, H, 1, generator=gen) * 4).bfloat16()
    kv = (torch.randn(T, 512, generator=gen) * 2).bfloat16()
    kv[0, :64] = 0                                    # all-zero block: amax floor
    kv[-1, 64:128] *= 1e-5                            # tiny block: small scale, subnormal fp8
    kv[-1, 128] = 300.0                               # outlier
    kv[-1, 192:256] *= 0.01                           # block max 7.0625 QDQs to 7.0: the stored
    kv[-1, 200] = 7.0625                              # scale is that of the QDQ'd row (2^-6)
    cos, sin = _rope_tables(T, gen, "cpu")
    pages0 = torch.randint(0, 256, (n_pages, page_bytes(B)), dtype=torch.uint8, generator=gen)
    slots = torch.tensor(slots, dtype=torch.int64)

    pages_ref = pages0.clone()
    q_ref, kv_ref = kv_insert_twin(q, kv, cos, sin, pages_ref, slots, B)

    pages = pages0.to(device)
    q_out, kv_out = kv_insert(q.to(device), kv.to(device), cos.to(device), sin.to(device), pages,
                              slots.to(device), B)
    q_out, kv_out, pages = q_out.cpu(), kv_out.cpu(), pages.cpu()

    # kv: exactly the twin's row, and the bytes are encode_kv_entries of it; nothing else touched
    assert torch.equal(kv_out.view(torch.int16), kv_ref.view(torch.int16))
    assert torch.equal(pages, pages_ref)
    # q None (the prefill form): the same kv row and bytes, no q output, from the kernel and the twin
    pages_kv = pages0.to(device)
    none_q, kv_only = kv_insert(None, kv.to(device), cos.to(device), sin.to(device), pages_kv, slots.to(device), B)
    assert none_q is None and torch.equal(kv_only.cpu().view(torch.int16), kv_ref.view(torch.int16))
    assert torch.equal(pages_kv.cpu(), pages_ref)
    pages_tw = pages0.clone()
    none_q, kv_tw = kv_insert_twin(None, kv, cos, sin, pages_tw, slots, B)
    assert none_q is None and torch.equal(kv_tw, kv_ref) and torch.equal(pages_tw, pages_ref)
    data_v, scale_v = page_views(pages, B)
    data, scales = encode_kv_entries(kv_ref)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(data_v[s // B, s % B], data[t])
            assert torch.equal(scale_v[s // B, s % B], scales[t])

    # q: the bf16 op chain with a correctly rounded rsqrt, bit-exact except where the order of the
    # 512-term sum moves the bf16 mean (rare); vs the reference (whose CPU bf16 rsqrt is sometimes
    # one ulp off) within 2 ulps (one ulp in the factor) in those heads alone
    ms = q.square().mean(-1, keepdim=True) + 1e-6
    r_cr = (1.0 / ms.float().sqrt()).bfloat16()
    from dsv4.reference.rope import apply_rope
    q_cr = apply_rope(q * r_cr, torch.complex(cos, sin))
    off_cr = (q_out.view(torch.int16) != q_cr.view(torch.int16)).any(-1)
    assert off_cr.sum() <= max(1, 0.005 * off_cr.numel()), f"{int(off_cr.sum())} heads differ"
    assert _ulps(q_out[..., :448], q_ref[..., :448]).max() <= 2
    d = (q_out.float() - q_ref.float()).abs()
    assert (d[..., 448:] <= q_ref.float().abs().amax(-1, keepdim=True) * 2 ** -6).all()
    r_ref = torch.rsqrt(ms)
    assert ((d > 0).any(-1) <= ((r_ref != r_cr).squeeze(-1) | off_cr)).all()


@pytest.mark.parametrize("H", [8, 64, 128])
def test_kv_insert(H):
    gen = torch.Generator().manual_seed(H)
    T = 5 if H == 8 else 2
    slots = [5, -1, 0, 13, 7][:T] if T == 5 else [9, -1]
    _check_insert(T, H, 4, 4, slots, gen)


# ------------------------------------------------------------------------------------------------
# GPU: real shapes (skipped without CUDA by the conftest)

_need_gpu = need_gpu


@pytest.mark.gpu
@pytest.mark.parametrize("H", [64, 128])
def test_gpu_kv_insert_real_shapes(H):
    _need_gpu()
    gen = torch.Generator().manual_seed(H)
    T, B = 512, 64
    slots = torch.randperm(20 * B, generator=gen)[:T]
    slots[::7] = -1
    _check_insert(T, H, B, 20, slots.tolist(), gen, device="cuda")
