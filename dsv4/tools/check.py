"""``dsv4 check``: the op table's self-check on this machine, as a table or JSON.

On a GPU every op's kernel runs its self-test against its twin at the real shapes of a model config
(``--model DIR``'s, or ``--preset``: V4-Flash by default) and the table says which path each op
takes here (``ok | fallback | unsupported | twin-only | failed``), the worst error against the
op's tolerance and why. On a machine without a GPU the kernels run under the Triton interpreter at
small shapes (the tiny preset by default), so CI and a newcomer can see every kernel checked. Exit
code 0 when every op has a working path (its kernel, a portable form or its twin).
"""
from __future__ import annotations

import os


def add_parser(sub) -> None:
    c = sub.add_parser("check", help="self-check every op's kernel against its twin on this machine")
    c.add_argument("--model", default=None, help="checkpoint directory whose config gives the shapes")
    c.add_argument("--preset", choices=["flash", "pro", "tiny"], default=None,
                   help="shapes of a preset config (default: flash on a GPU, tiny under the interpreter)")
    c.add_argument("--mode", choices=["fast", "full"], default="fast",
                   help="fast: one decode-sized case per op (the start-up check); full: every router branch")
    c.add_argument("--expert-format", choices=["mxfp4", "nvfp4", "fp8"], default=None,
                   help="routed experts' format (default: the model's; mxfp4 for a preset)")
    c.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="check one rank's shapes of this split (local heads)")
    c.add_argument("--op", action="append", default=None, help="check only this op (repeatable)")
    c.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    c.add_argument("--json", action="store_true",
                   help="print a JSON list of {op, path, status, reason, error, tolerance, seconds}")
    c.set_defaults(fn=run)


def _config(a):
    if a.model is not None:
        from ..checkpoint.loader import open_checkpoint
        from ..models import resolve_model
        r = open_checkpoint(resolve_model(a.model))
        return r.config, r.expert_format
    from ..checkpoint.schema import expert_format_of_config
    from ..config import preset
    cfg = preset(a.preset)
    return cfg, expert_format_of_config(cfg)


def run(a) -> int:
    import torch
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type != "cuda":
        # no GPU: the kernels run in Triton's interpreter, chosen before triton is first imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    a.preset = a.preset or ("flash" if dev.type == "cuda" else "tiny")
    from ..kernels.lib import interpreting, triton_available
    from ..ops import NAMES, Ops
    from ..ops import check
    if a.op:
        bad = [o for o in a.op if o not in NAMES]
        if bad:
            raise ValueError(f"unknown op(s) {', '.join(bad)} (ops: {', '.join(NAMES)})")
    cfg, efmt = _config(a)
    forced = None if dev.type == "cuda" else (True if triton_available() and interpreting() else False)
    ops = Ops(dev, forced)
    report = check.run(ops, cfg, a.mode, expert_format=a.expert_format or efmt, world=a.tensor_parallel_size,
                       only=a.op)
    if a.json:
        print(report.to_json())
    else:
        print(report.table())
        print(report.summary())
    return 0 if report.ok else 1


__all__ = ["add_parser", "run"]
