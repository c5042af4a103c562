"""The op table: the one place that decides, per device, which implementation runs each op.

``Ops(device)`` has one attribute per op the model calls. On a CUDA GPU with FP8 tensor support
(compute capability >= 8.9: Ada, Hopper, Blackwell) every op is a Triton / Gluon kernel of
``dsv4.kernels`` (the kernels route by size inside, e.g. decode vs prefill GEMM tiles); elsewhere
(CPU; GPUs before sm_89, where the kernels' e4m3 types do not compile) every op is its torch twin
(``dsv4.ops.twins`` and the ``*_torch`` functions beside the kernels), which computes DeepSeek's
official rounding on the same native weights and cache bytes. ``Ops.describe()`` says which side
the table took; ``Ops.graph_safe`` says whether a decode step can be captured in a CUDA graph (the
twins synchronise with the host).

Numerics: GPU = the kernels' (official quantisation steps, fp32 accumulation in kernel order);
CPU = the twins' (official numerics as ``dsv4.reference`` computes them, ``Numerics('official')``).
"""
from __future__ import annotations

import torch

# op name -> (kernel module, entry, twin module, entry); modules under dsv4.
_TABLE = {
    "hc_pre": ("kernels.mhc", "hc_pre", "ops.twins", "hc_pre"),
    "hc_post": ("kernels.mhc", "hc_post", "kernels.mhc", "hc_post_torch"),
    "hc_head": ("kernels.mhc", "hc_head", "ops.twins", "hc_head"),
    "rms_norm": ("kernels.norm", "rms_norm", "kernels.norm", "rms_norm_torch"),
    "kv_insert": ("kernels.kv_insert", "kv_insert", "kernels.kv_insert", "kv_insert_torch"),
    "entry_ids": ("kernels.paging", "entry_ids", "kernels.paging", "entry_ids_torch"),
    "inverse_rope": ("kernels.inverse_rope", "inverse_rope", "kernels.inverse_rope", "inverse_rope_torch"),
    "sparse_decode": ("kernels.sparse_attention", "sparse_decode", "kernels.sparse_attention", "sparse_attention_torch"),
    "sparse_prefill": ("kernels.sparse_attention", "sparse_prefill", "kernels.sparse_attention", "sparse_attention_torch"),
    "compress_decode": ("kernels.compressor", "compress_decode", "kernels.compressor", "compress_decode_torch"),
    "compress_prefill": ("kernels.compressor", "compress_prefill", "kernels.compressor", "compress_prefill_torch"),
    "index_q_prologue": ("kernels.indexer", "index_q_prologue", "kernels.indexer", "index_q_prologue_torch"),
    "index_scores": ("kernels.indexer", "index_scores", "kernels.indexer", "index_scores_torch"),
    "index_topk": ("kernels.indexer", "index_topk", "kernels.indexer", "index_topk_torch"),
    "decode_meta": ("kernels.decode_meta", "decode_meta", "kernels.decode_meta", "decode_meta_torch"),
    "linear": ("ops.gpu", "linear", "ops.twins", "linear"),
    "wo_a": ("ops.gpu", "wo_a", "ops.twins", "wo_a"),
    "moe": ("ops.gpu", "moe", "ops.twins", "moe"),
}
OPS = tuple(_TABLE)
from ..kernels.targets import FP8_MIN_CAPABILITY  # noqa: E402  (e4m3 kernels compile from sm_89: measured table)


def _import(mod: str, name: str):
    import importlib
    return getattr(importlib.import_module("dsv4." + mod), name)


def kernel_path(device) -> tuple[bool, str]:
    """(kernels?, why) for a device: the routing rule of the module doc."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"{device.type}: torch twins"
    from ..kernels import interpreting, triton_available
    if not triton_available():
        return False, "triton does not import: torch twins"
    if interpreting():
        return False, "TRITON_INTERPRET is set: torch twins"
    cap = torch.cuda.get_device_capability(device)
    if cap < FP8_MIN_CAPABILITY:
        return False, (f"sm_{cap[0]}{cap[1]} has no FP8 (e4m3) support in the kernels (needs sm_89+): "
                       f"torch twins")
    return True, f"sm_{cap[0]}{cap[1]}: Triton/Gluon kernels"


class Ops:
    """The op table of one device (module doc). ``kernels`` forces a side: True runs the Triton
    kernels (on CPU under ``TRITON_INTERPRET=1``, for tests), False the twins."""

    def __init__(self, device, kernels: bool | None = None):
        self.device = torch.device(device)
        auto, why = kernel_path(self.device)
        self.kernels = auto if kernels is None else kernels
        self.reason = why if kernels is None else ("forced: Triton kernels" if kernels else "forced: torch twins")
        for name, (kmod, kfn, tmod, tfn) in _TABLE.items():
            setattr(self, name, _import(kmod, kfn) if self.kernels else _import(tmod, tfn))
        self.graph_safe = self.kernels and self.device.type == "cuda"

    def describe(self) -> str:
        return f"ops: {'kernels' if self.kernels else 'torch twins'} ({self.reason})"


__all__ = ["FP8_MIN_CAPABILITY", "OPS", "Ops", "kernel_path"]
