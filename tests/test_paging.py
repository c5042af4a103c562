"""Compressed-cache entry ids through the block table (dsv4/kernels/paging.py) against the torch twin.

On a CPU machine the kernels run under the Triton interpreter (the conftest sets TRITON_INTERPRET=1
when no CUDA device is present) at tiny shapes. On a GPU machine a plain ``pytest`` runs the same tests
compiled on CUDA, and the ``gpu``-marked tests add the real V4 shapes.
"""
import pytest
from kernel_helpers import kernel_device, need_gpu
import torch

pytest.importorskip("triton")

DEV = kernel_device()


def _check_entry_ids(device=DEV):
    from dsv4.formats.paging import BLOCK_TOKENS
    from dsv4.kernels import paging
    from dsv4.twins.paging import entry_ids as entry_ids_twin
    gen = torch.Generator().manual_seed(5)
    bt = torch.randint(-1, 50, (3, 9), generator=gen)
    bt[:, 7:] = -1                                        # unallocated tail blocks
    for ratio, per_block, dtype in ((4, 64, torch.int32), (128, 2, torch.int64)):
        e = torch.randint(-3, 9 * BLOCK_TOKENS // ratio + 5, (3, 1100), generator=gen)   # past the table too
        got = paging.entry_ids(bt.to(device), e.to(dtype).to(device), per_block, ratio)
        want = entry_ids_twin(bt, e, per_block, ratio)
        assert got.dtype == torch.int32 and torch.equal(got.cpu().long(), want)
        assert (want >= 0).any() and (want < 0).any()


def test_entry_ids():
    _check_entry_ids()


def test_entry_ids_rejects_mismatched_rows():
    from dsv4.kernels.paging import entry_ids
    with pytest.raises(ValueError, match="expected e"):
        entry_ids(torch.zeros(2, 4, dtype=torch.long, device=DEV), torch.zeros(3, 5, dtype=torch.long, device=DEV), 64, 4)


# ------------------------------------------------------------------------------------------------
# GPU: real shapes (skipped without CUDA by the conftest)

_need_gpu = need_gpu


@pytest.mark.gpu
def test_gpu_entry_ids():
    _need_gpu()
    _check_entry_ids(device="cuda")
