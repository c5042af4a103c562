"""The op table: the one place that decides, per device and per op, which implementation runs.

``Ops(device)`` has one attribute per op the model calls (``registry.OPS``). On a CUDA GPU each op
runs its Triton / Gluon kernel where the GPU's compute capability reaches the op's
``min_capability`` (sm_89+ for the ops that touch e4m3 values, sm_80+ for the others) and its torch
twin (``dsv4.twins``: DeepSeek's official numerics on the same native weights and cache bytes)
elsewhere; on a CPU, or with ``TRITON_INTERPRET`` set, every op is its twin. The choice is then
checked on the device it runs on (``check.run``, the start-up self-check): an op whose kernel does
not match its twin there falls back, for this process, to a portable kernel form or the twin
(``Ops.use``). ``Ops.describe()`` says which side each op took; ``Ops.graph_safe`` whether a decode
step can be captured in a CUDA graph (the twins synchronise with the host).

``DSV4_FAULT=<op>:<mode>`` (``ops.faults``) corrupts named kernels, to see the fallback work.
"""
from __future__ import annotations

import torch

from . import faults
from .registry import NAMES, OPS, OpSpec

PATHS = ("twin", "portable", "kernel")    # in the order a fallback walks them, upward


def kernel_path(device) -> tuple[bool, str]:
    """(whether kernels can run on ``device`` at all, why)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"{device.type}: torch twins"
    from ..kernels.lib import interpreting, target, triton_available
    if not triton_available():
        return False, "triton does not import: torch twins"
    if interpreting():
        return False, "TRITON_INTERPRET is set: torch twins"
    t = target(device)
    return True, f"{t.name} sm_{t.sm}: Triton/Gluon kernels from each op's minimum capability"


def capability_of(device) -> tuple[int, int] | None:
    """The compute capability the kernels compile for on ``device``; None where kernels are forced
    (the CPU interpreter: every op's kernel runs)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    from ..kernels.lib import target
    t = target(device)
    return t.capability if t.compiled else None


class Ops:
    """The op table of one device (module doc). ``kernels`` forces a side: True runs every op's
    kernel (on CPU under ``TRITON_INTERPRET=1``, for tests), False every twin, a collection of op
    names those ops' kernels and the other ops' twins (tests and debugging). ``faults_``: {op: mode}
    to inject (default: ``DSV4_FAULT``)."""

    def __init__(self, device, kernels: bool | None | tuple | list | set = None, faults_: dict | None = None):
        self.device = torch.device(device)
        auto, why = kernel_path(self.device)
        only = None
        if kernels is not None and not isinstance(kernels, bool):
            only = set(kernels)
            bad = sorted(only - set(NAMES))
            if bad:
                raise ValueError(f"kernels: unknown op(s) {', '.join(bad)} (ops: {', '.join(NAMES)})")
        self.kernels = auto if kernels is None else bool(kernels)
        self.forced = kernels is not None
        self.reason = why if kernels is None else (
            "forced: torch twins" if not kernels else
            "forced: Triton kernels" if only is None else f"forced: kernels for {', '.join(sorted(only))}")
        self.faults = faults.from_env(NAMES) if faults_ is None else faults_
        cap = capability_of(self.device) if kernels is None else None
        self.paths: dict[str, str] = {}
        self.eligible: set[str] = set()        # the ops whose kernel may run here (before any check)
        for name, spec in OPS.items():
            if not self.kernels or (only is not None and name not in only) \
                    or (cap is not None and cap < spec.min_capability):
                self.use(name, "twin")
            else:
                self.eligible.add(name)
                self.use(name, "kernel")

    def kernel_fn(self, name: str):
        """The op's kernel as this table would call it (with any injected fault)."""
        fn = OPS[name].load("kernel")
        return faults.wrap(name, fn, self.faults[name]) if name in self.faults else fn

    def use(self, name: str, path: str) -> None:
        """Run op ``name`` on ``path`` ('kernel' | 'portable' | 'twin') from now on."""
        spec: OpSpec = OPS[name]
        if path == "twin":
            fn = spec.load("twin")
        elif path == "portable":
            if spec.portable is None:
                raise ValueError(f"op {name} has no portable kernel form")
            fn = spec.load("portable")
        elif path == "kernel":
            fn = self.kernel_fn(name)
        else:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        if path != "twin" and spec.takes is not None:
            fn = _dispatch(spec.load("takes"), fn, spec.load("twin"))
        self.paths[name] = path
        setattr(self, name, fn)

    @property
    def graph_safe(self) -> bool:
        """A decode step on this table can be captured in a CUDA graph: every op on a kernel form."""
        return self.device.type == "cuda" and all(p != "twin" for p in self.paths.values())

    def counts(self) -> dict[str, int]:
        return {p: sum(1 for v in self.paths.values() if v == p) for p in PATHS}

    def describe(self) -> str:
        n = self.counts()
        if not self.kernels:
            return f"ops: torch twins ({self.reason})"
        side = f"{n['kernel']} on kernels" + (f", {n['portable']} on portable kernels" if n["portable"] else "") + \
            (f", {n['twin']} on twins ({', '.join(k for k, v in self.paths.items() if v == 'twin')})"
             if n["twin"] else "")
        return f"ops: {side} ({self.reason})"


def _dispatch(takes, kernel, twin):
    """The kernel for the calls it takes (``OpSpec.takes``), the twin for the others."""
    def op(*args, **kw):
        return kernel(*args, **kw) if takes(*args, **kw) else twin(*args, **kw)
    op.__name__ = op.__qualname__ = getattr(kernel, "__name__", "op")
    return op


__all__ = ["NAMES", "OPS", "Ops", "PATHS", "kernel_path"]
