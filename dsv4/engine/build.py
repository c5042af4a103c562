"""The one model builder: the engine (rank 0), every tensor-parallel worker and ``dsv4 validate`` build
the production model here, then check its ops on the device they run on.

``build_model(spec, device, group)``: ``spec`` (a dict, sent as is to the worker processes) names the
weights — ``path`` (a checkpoint directory, streamed in, this rank's slice only), ``synthetic``
(+ ``synthetic_layers``, ``synthetic_experts``, ``synthetic_seed``: random weights at a preset's real
shapes, made on the device) or ``tensors`` (config, expert format, wo_a format and an in-memory
``{name: tensor}`` mapping: validate's, which the reference reads too) — and how to run it:
``kernels`` (None: the op table's choice, True / False forced), ``draft`` (None, or 'mtp' / 'dspark':
the checkpoint's April MTP block or DSpark draft is loaded too, for speculative decoding; a synthetic
model's config then carries that draft) and ``kernel_check`` (``fast`` |
``full`` | ``off``: the start-up self-check, ``ops.check``). After the weights load, every op the
table selected runs its self-test; an op whose kernel fails here falls back to its portable form or
twin, one log line each; every rank of ``group`` takes the same choices (``ops.check.agree``). The
report stays on the model (``model.kernel_report``).
"""
from __future__ import annotations

import torch

KERNEL_CHECKS = ("fast", "full", "off")


def check_kernels(model, mode: str, log=None):
    """The start-up self-check of ``model``'s op table (module doc) -> ``ops.check.Report`` or None (off)."""
    if mode not in KERNEL_CHECKS:
        raise ValueError(f"kernel_check must be one of {', '.join(KERNEL_CHECKS)}, got {mode!r}")
    if mode == "off":
        return None
    from ..ops import check
    report = check.run(model.ops, model.cfg, mode, expert_format=model.expert_format, world=model.group.world,
                       log=log)
    check.agree(report, model.ops, model.group)
    return report


def build_model(spec: dict, device, group=None, reader=None, log=None):
    """The rank's model (module doc). ``reader``: an already opened checkpoint of ``spec['path']``;
    ``log(line)``: where the self-check's lines go (None: nowhere)."""
    from ..model.deepseek_v4 import DeepseekV4
    from ..ops import Ops
    device = torch.device(device)
    ops = Ops(device, spec.get("kernels"))
    draft = spec.get("draft")
    if spec.get("tensors") is not None:
        cfg, efmt, wfmt, tensors = spec["tensors"]
        model = DeepseekV4(cfg, efmt, wfmt, device, ops, group, draft)
        model.load((n, t) for n, t in tensors.items() if draft is not None or not n.startswith("mtp."))
    elif spec.get("synthetic"):
        from ..checkpoint.schema import expert_format_of_config
        from ..checkpoint.synthetic import iter_synthetic_tensors, synthetic_config
        mc = synthetic_config(spec["synthetic"], spec.get("synthetic_layers", 4), spec.get("synthetic_experts"),
                              **({"draft": draft} if draft is not None else {}))
        model = DeepseekV4(mc, expert_format_of_config(mc), "fp8", device, ops, group, draft)
        model.load(iter_synthetic_tensors(mc, spec.get("synthetic_seed", 0), device, draft=draft is not None))
    else:
        model = DeepseekV4.from_checkpoint(reader or spec["path"], device, ops, progress=spec.get("progress", False),
                                           group=group, draft=draft)
    model.kernel_report = check_kernels(model, spec.get("kernel_check", "fast"), log)
    return model


__all__ = ["KERNEL_CHECKS", "build_model", "check_kernels"]
