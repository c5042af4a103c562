"""Portable Triton kernels of the hot path, each beside its torch twin.

Registry (``KERNELS``): name -> (module, Triton entry point, torch twin). Everything here is plain
Triton (no SM90-only intrinsics); code that would need Hopper features must check
:func:`cuda_ok` with ``min_capability=(9, 0)`` first.

* ``triton_available()``: triton imports (GPU or ``TRITON_INTERPRET=1`` CPU interpreter).
* ``interpreting()``: the CPU interpreter is active (kernels then take an fp32 path for their dots:
  the interpreter mishandles bf16 arithmetic and bf16 ``tl.dot``).
* ``cuda_ok(min_capability)``: a CUDA device of at least that compute capability is present and
  triton can compile for it.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from functools import lru_cache


@lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # pragma: no cover - depends on the install
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cuda_ok(min_capability: tuple[int, int] = (8, 0)) -> bool:
    """A CUDA GPU of compute capability >= ``min_capability`` runs compiled Triton kernels."""
    if not triton_available() or interpreting():
        return False
    try:
        import torch
        if not torch.cuda.is_available():
            return False
        return torch.cuda.get_device_capability() >= tuple(min_capability)
    except Exception:  # pragma: no cover
        return False


@dataclass(frozen=True)
class KernelInfo:
    name: str
    module: str
    entry: str
    twin: str
    what: str

    def load(self):
        """(triton entry point, torch twin) callables."""
        mod = importlib.import_module(f"{__name__}.{self.module}")
        return getattr(mod, self.entry), getattr(mod, self.twin)


KERNELS: dict[str, KernelInfo] = {k.name: k for k in (
    KernelInfo("kv_insert", "kv_insert", "kv_insert", "kv_insert_torch",
               "q head RMSNorm + RoPE, kv RoPE + FP8/UE8M0 QDQ, 584-B paged cache insert (one launch)"),
    KernelInfo("sparse_decode", "sparse_attention", "sparse_decode", "sparse_attention_torch",
               "sparse decode attention over window + extra FP8 paged caches, sinks, split-K + combine"),
    KernelInfo("sparse_prefill", "sparse_attention", "sparse_prefill", "sparse_attention_torch",
               "sparse prefill attention: per-row index lists over the same caches, gather+dequant fused"),
    KernelInfo("inverse_rope", "inverse_rope", "inverse_rope", "inverse_rope_torch",
               "inverse RoPE on o -> wo_a input (bf16), optional FP8 1x128 act quant"),
)}


def available_kernels() -> list[str]:
    """Names of the kernels that can run here (all of them when triton imports)."""
    return list(KERNELS) if triton_available() else []


__all__ = ["KERNELS", "KernelInfo", "available_kernels", "cuda_ok", "interpreting", "triton_available"]
