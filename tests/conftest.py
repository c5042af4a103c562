import os

import pytest
import torch

# Deterministic CPU numerics and a bounded thread count on the 2-core CI machines.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# Without a GPU, Triton kernels run in the interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def skip_or_fail_without_shared(what: str) -> None:
    """``../shared`` (spec, golden file, official-layout tool) sits beside every checkout in CI:
    there a missing file is a failure, elsewhere a skip."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} is missing; CI expects ../shared beside the checkout")
    pytest.skip(f"{what} is missing")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
