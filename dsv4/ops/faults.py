"""Fault injection into named kernels: ``DSV4_FAULT=<op>:<mode>[,<op>:<mode>]``.

For tests, and for users who want to see the per-op fallback work: the kernel of each named op (not
its portable form, not its twin) is wrapped so that its returned outputs are

* ``garbage``: random values of the right shape and dtype (integers: random ids in the outputs' range);
* ``nan``: NaN (integer outputs: the dtype's most negative value, an id nothing can hold);
* ``raise``: not produced; the call raises ``RuntimeError``.

Tensors the kernel writes in place (caches, rings) are left as the kernel wrote them. With the
start-up self-check on (``--kernel-check fast|full``) such an op falls back to its portable form
or its twin; with it off the fault goes live.
"""
from __future__ import annotations

import dataclasses
import os

import torch

MODES = ("garbage", "nan", "raise")
ENV = "DSV4_FAULT"


def parse(spec: str | None, ops=None) -> dict[str, str]:
    """{op: mode} of a ``DSV4_FAULT`` value (ValueError naming a bad entry); ``ops``: the known names."""
    out: dict[str, str] = {}
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        op, sep, mode = item.partition(":")
        op, mode = op.strip(), mode.strip()
        if not sep or not op or not mode:
            raise ValueError(f"{ENV}: expected <op>:<mode>[,<op>:<mode>], got {item!r}")
        if mode not in MODES:
            raise ValueError(f"{ENV}: mode of {op!r} must be one of {', '.join(MODES)}, got {mode!r}")
        if ops is not None and op not in ops:
            raise ValueError(f"{ENV}: unknown op {op!r} (ops: {', '.join(ops)})")
        out[op] = mode
    return out


def from_env(ops=None) -> dict[str, str]:
    return parse(os.environ.get(ENV), ops)


def _corrupt(x, mode: str, gen: torch.Generator):
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bool:
            return torch.rand(x.shape, generator=gen).to(x.device) < 0.5
        if x.is_floating_point():
            if mode == "nan":
                return torch.full_like(x, float("nan"))
            scale = float(x.detach().float().abs().max()) if x.numel() else 1.0
            return (torch.randn(x.shape, generator=gen) * (scale or 1.0)).to(device=x.device, dtype=x.dtype)
        if mode == "nan":
            return torch.full_like(x, torch.iinfo(x.dtype).min)
        hi = int(x.max()) + 2 if x.numel() else 2
        return torch.randint(-1, max(hi, 1), x.shape, generator=gen).to(device=x.device, dtype=x.dtype)
    if isinstance(x, tuple):
        return tuple(_corrupt(v, mode, gen) for v in x)
    if isinstance(x, list):
        return [_corrupt(v, mode, gen) for v in x]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: _corrupt(getattr(x, f.name), mode, gen)
                                        for f in dataclasses.fields(x)})
    return x


def wrap(name: str, fn, mode: str):
    """``fn`` with the fault ``mode`` injected (module doc)."""
    if mode not in MODES:
        raise ValueError(f"{ENV}: mode must be one of {', '.join(MODES)}, got {mode!r}")
    gen = torch.Generator().manual_seed(0)

    def faulty(*args, **kw):
        if mode == "raise":
            raise RuntimeError(f"{ENV}: injected failure in the {name} kernel")
        return _corrupt(fn(*args, **kw), mode, gen)
    faulty.__name__ = faulty.__qualname__ = f"{name}_with_{mode}"
    faulty.__doc__ = f"the {name} kernel with {ENV} fault {mode!r}"
    return faulty


__all__ = ["ENV", "MODES", "from_env", "parse", "wrap"]
