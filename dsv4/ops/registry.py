"""The one op registry: per op its kernel, its twin (same signature), the lowest compute capability
the kernel compiles for, an optional portable kernel form, the self-test that checks kernel against
twin on the GPU it runs on (``ops.selftests``), and what it computes.

``OPS`` is what the model calls through ``Ops`` (``dsv4.ops``); ``tests/test_targets.py`` compiles
every kernel behind an entry offline for sm_80 .. sm_120 and holds ``min_capability`` to what
compiles: kernels that touch e4m3 values need sm_89+ (``FP8``: Triton rejects ``tl.float8e4nv`` on
sm_80 / sm_86 and ptxas the ``cvt ... e4m3x2`` conversions), the others compile from sm_80 (``BASE``).

Entries name their callables as ``"package.module:function"`` under ``dsv4`` and are imported on
first use: building the table imports no kernel code (the twins run without triton installed).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

BASE = (8, 0)     # the oldest target measured; nothing is claimed below it
FP8 = (8, 9)      # e4m3 (tl.float8e4nv, cvt ... e4m3x2): Ada / Hopper / Blackwell


@dataclass(frozen=True)
class OpSpec:
    name: str
    kernel: str                         # "kernels.<module>:<function>"
    twin: str                           # "twins.<module>:<function>", the kernel's signature
    min_capability: tuple[int, int]
    what: str
    portable: str | None = None         # a kernel form without the target-tuned paths, tried before the twin
    takes: str | None = None            # predicate on the call's arguments: False -> the twin runs that call

    def load(self, which: str):
        """The callable ``which`` ('kernel' | 'twin' | 'portable' | 'takes') names (None where none)."""
        ref = getattr(self, which)
        return None if ref is None else resolve(ref)


def resolve(ref: str):
    mod, fn = ref.split(":")
    return getattr(importlib.import_module("dsv4." + mod), fn)


def _op(name, module, min_cap, what, function=None, **kw) -> OpSpec:
    function = function or name
    return OpSpec(name, f"kernels.{module}:{function}", f"twins.{module}:{function}", min_cap, what, **kw)


OPS: dict[str, OpSpec] = {s.name: s for s in (
    _op("hc_pre", "mhc", BASE, "mHC pre: stream RMS, 24-wide mix GEMM, sigmoids, 20-step Sinkhorn, weighted stream sum"),
    _op("hc_post", "mhc", BASE, "mHC post: post * y + comb^T res"),
    _op("hc_head", "mhc", BASE, "mHC head: the final stream collapse"),
    _op("hc_post_pre", "mhc", BASE, "mHC boundary: hc_post, the next hc_pre and its RMSNorm (one launch at decode)"),
    _op("rms_norm", "norm", BASE, "weighted RMSNorm (fp32 math, one bf16 rounding)"),
    _op("rms_norm_pair", "norm", BASE, "two weighted RMSNorms of a row's two column ranges, one launch (q_norm, kv_norm)"),
    _op("kv_insert", "kv_insert", FP8, "q head RMSNorm + RoPE (q optional), kv RoPE + FP8 QDQ, 584-byte paged cache insert"),
    _op("entry_ids", "paging", BASE, "compressed-cache entry ids through the block table"),
    _op("inverse_rope", "inverse_rope", BASE, "inverse RoPE on the attention output -> wo_a input"),
    _op("sparse_decode", "sparse_attention", FP8, "sparse decode attention over the FP8 paged caches, split-K"),
    _op("sparse_prefill", "sparse_attention", FP8, "sparse prefill attention: per-row lists, gather + dequant, q norm + RoPE in, inverse RoPE out"),
    _op("compress_decode", "compressor", FP8, "compressor decode update: ring, pooling, norm, RoPE, QDQ, paged write"),
    _op("compress_prefill", "compressor", FP8, "compressor prefill chunk: pooling, norm, RoPE, QDQ, paged write"),
    _op("index_q_prologue", "indexer", BASE, "indexer q: RoPE + Hadamard + FP4 QDQ"),
    _op("index_scores", "indexer", BASE, "indexer scores over the paged MXFP4 keys, causal mask"),
    _op("index_topk", "indexer", BASE, "top-k of the indexer scores, ties to the lower index"),
    _op("decode_meta", "decode_meta", BASE, "every per-step index vector and RoPE row of a decode step"),
    _op("linear", "layer_ops", FP8, "FP8 block-scaled / bf16 linears (routed by size: gemm.route)",
        portable="kernels.layer_ops:linear_portable"),
    _op("wo_a", "layer_ops", BASE, "wo_a: the bf16 grouped einsum on the FP8 weight",
        portable="kernels.layer_ops:wo_a_portable"),
    _op("moe", "layer_ops", FP8, "MoE layer: route, grouped FP4 expert GEMMs + SwiGLU, shared expert, combine",
        portable="kernels.layer_ops:moe_portable", takes="kernels.layer_ops:takes_moe"),
)}

NAMES = tuple(OPS)


__all__ = ["BASE", "FP8", "NAMES", "OPS", "OpSpec", "resolve"]
