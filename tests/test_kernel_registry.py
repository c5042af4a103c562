"""The kernel registry (dsv4/kernels/__init__.py: KERNELS, available_kernels, the interpreter switch)."""
import pytest

pytest.importorskip("triton")

from dsv4.kernels import KERNELS, available_kernels, cuda_ok, interpreting, triton_available  # noqa: E402


def test_registry():
    assert triton_available()
    assert set(available_kernels()) == set(KERNELS)
    for info in KERNELS.values():
        fn, twin = info.load()
        assert callable(fn) and callable(twin)
    if interpreting():
        assert not cuda_ok()
