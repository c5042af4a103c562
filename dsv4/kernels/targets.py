"""Which GPU generations the kernels compile for, as measured by compiling them (tests/test_targets.py).

tests/test_targets.py compiles a representative launch of each kernel below offline (no GPU) for
``GPUTarget("cuda", cap, 32)`` with cap in 80, 89, 90, 100, 120 and asserts this table: a kernel
compiles for every measured cap at or above its entry in ``MIN_CAPABILITY``, and below it fails with
the FP8 error. Measured with Triton 3.9 (its bundled ptxas):

* Kernels that touch e4m3 values need sm_89+ (``FP8_MIN_CAPABILITY``). On sm_80 / sm_86 Triton rejects
  a ``tl.float8e4nv`` cast ("type fp8e4nv not supported in this architecture"; kv_insert, the
  sparse-attention cache reads, the FP8 GEMM, the MoE route kernel's activation quantisation, the
  compressor's FP8 entries), and ptxas rejects the ``cvt.rn.f16x2.e4m3x2`` inline PTX ("cvt with
  .e4m3x2/.e5m2x2 requires .target sm_89 or higher"; the FP4 expert GEMM's e2m1 decode, which falls
  back to an e4m3 bitcast without the inline PTX, and the Gluon decode kernels fp4_mma / fp8_mma).
* mHC (hc_pre), RMSNorm and the indexer scores (FP4 cache, integer decode) compile for sm_80.
* Everything here compiles for sm_89, sm_90, sm_100 and sm_120.

Names are the ops (the launchers' names); capabilities are (major, minor) as
``torch.cuda.get_device_capability`` gives them. Pure Python: importable without triton or a GPU.
"""
from __future__ import annotations

# the oldest target measured; nothing is claimed below it
BASE_MIN_CAPABILITY = (8, 0)
# e4m3 (tl.float8e4nv, cvt ... e4m3x2): Ada / Hopper and newer
FP8_MIN_CAPABILITY = (8, 9)

# kernel (op) name -> the lowest measured capability it compiles for
MIN_CAPABILITY: dict[str, tuple[int, int]] = {
    "kv_insert": FP8_MIN_CAPABILITY,          # kv_insert._kv_insert_kernel
    "sparse_decode": FP8_MIN_CAPABILITY,      # sparse_attention._sparse_fwd (decode and prefill)
    "hc_pre": BASE_MIN_CAPABILITY,            # mhc._hc_fused
    "rms_norm": BASE_MIN_CAPABILITY,          # norm._rms_norm_kernel
    "fp8_gemm": FP8_MIN_CAPABILITY,           # gemm._fp8_gemm_kernel
    "fp4_gemm": FP8_MIN_CAPABILITY,           # gemm._fp4_gemm_kernel (FP4 expert GEMM)
    "moe_route": FP8_MIN_CAPABILITY,          # moe._route_kernel with the activation quantisation
    "compress_decode": FP8_MIN_CAPABILITY,    # compressor._comp_fused
    "index_scores": BASE_MIN_CAPABILITY,      # indexer._index_scores_kernel
    "fp4_mma": FP8_MIN_CAPABILITY,            # fp4_mma._mma_gemv_kernel (Gluon)
    "fp8_mma": FP8_MIN_CAPABILITY,            # fp8_mma._fp8_mma_kernel (Gluon)
}


def min_capability(kernel: str) -> tuple[int, int]:
    """The lowest measured (major, minor) that ``kernel`` compiles for; KeyError for a name not measured."""
    return MIN_CAPABILITY[kernel]


def needs_fp8(kernel: str) -> bool:
    """Whether ``kernel`` needs e4m3 support (sm_89+)."""
    return min_capability(kernel) >= FP8_MIN_CAPABILITY


def supported(kernel: str, capability: tuple[int, int]) -> bool:
    """Whether ``kernel`` compiles for a GPU of ``capability`` (major, minor), per the measured table."""
    return tuple(capability) >= min_capability(kernel)
