"""Shared pieces of the kernel test files: the offline (AOT) compile runner and the GPU guard."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_aot_script(script: str, repo, timeout: int = 900, **env_extra: str) -> None:
    """Run a kernel file's AOT script (it compiles for GPUTarget('cuda', 90|100, 32)) in a fresh
    interpreter with TRITON_INTERPRET=0; skip when this triton or machine cannot compile offline."""
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:  # pragma: no cover
        pytest.skip(f"this triton cannot compile ahead of time: {e}")
    env = dict(os.environ, TRITON_INTERPRET="0", **env_extra)
    r = subprocess.run([sys.executable, "-c", script, str(repo)], capture_output=True, text=True,
                       env=env, timeout=timeout)
    if r.returncode != 0 and ("ptxas" in r.stderr and "not found" in r.stderr):  # pragma: no cover
        pytest.skip(f"no ptxas for offline compilation: {r.stderr[-400:]}")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]


def need_gpu() -> None:
    from dsv4.kernels import cuda_ok
    if not cuda_ok():
        pytest.skip("needs a CUDA GPU with TRITON_INTERPRET=0")
