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
    KernelInfo("rms_norm", "norm", "rms_norm", "rms_norm_torch",
               "weighted RMSNorm (fp32 math, one bf16 rounding) in one launch"),
    KernelInfo("entry_ids", "paging", "entry_ids", "entry_ids_torch",
               "compressed-cache entry ids through the block table (top-k picks -> attention indices)"),
    KernelInfo("inverse_rope", "inverse_rope", "inverse_rope", "inverse_rope_torch",
               "inverse RoPE on o -> wo_a input (bf16), optional FP8 1x128 act quant"),
    KernelInfo("hc_pre", "mhc", "hc_pre", "hc_pre_torch",
               "mHC pre: stream RMS, 24-wide mix GEMM, sigmoids, 20-step Sinkhorn, weighted stream sum"),
    KernelInfo("hc_post", "mhc", "hc_post", "hc_post_torch", "mHC post: post * y + comb^T res"),
    KernelInfo("hc_head", "mhc", "hc_head", "hc_head_torch", "mHC head: final stream collapse"),
    KernelInfo("compress_decode", "compressor", "compress_decode", "compress_decode_torch",
               "compressor decode update: ring write, window pooling, norm, RoPE, QDQ, paged insert"),
    KernelInfo("compress_prefill", "compressor", "compress_prefill", "compress_prefill_torch",
               "compressor prefill chunk: window pooling of the chunk's entries, norm, RoPE, QDQ, paged insert"),
    KernelInfo("index_q_prologue", "indexer", "index_q_prologue", "index_q_prologue_torch",
               "indexer q: RoPE + Hadamard + FP4 QDQ"),
    KernelInfo("index_scores", "indexer", "index_scores", "index_scores_torch",
               "indexer scores over the paged MXFP4 key cache, causal mask"),
    KernelInfo("index_topk", "indexer", "index_topk", "index_topk_torch",
               "top-k over up to 256K candidates, descending, ties to the lower index"),
    KernelInfo("act_quant_fp8", "gemm", "act_quant_fp8", "act_quant_fp8_torch", "FP8 1x128 UE8M0 act quant"),
    KernelInfo("fp8_gemm", "gemm", "fp8_gemm", "fp8_gemm_torch", "block-scaled FP8 GEMM (official accumulation)"),
    KernelInfo("fp4_gemm", "gemm", "fp4_gemm", "fp4_gemm_torch", "FP8 x FP4 (MXFP4 / NVFP4) expert GEMM"),
    KernelInfo("moe_forward", "moe", "moe_forward", "moe_forward_torch",
               "MoE layer: route, sort, grouped FP4 GEMMs + SwiGLU, combine, shared expert"),
)}


def available_kernels() -> list[str]:
    """Names of the kernels that can run here (all of them when triton imports)."""
    return list(KERNELS) if triton_available() else []


__all__ = ["KERNELS", "KernelInfo", "available_kernels", "cuda_ok", "interpreting", "triton_available"]
