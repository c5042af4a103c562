"""The self-check: every op the table selected runs its self-test (``selftests``) on this device, kernel
against twin, and an op whose kernel fails to compile, raises, returns non-finite values or
disagrees with its twin beyond the op's tolerance is switched, for this process, to its portable
kernel form (where one exists and passes) or to its twin.

``run(ops, cfg, mode)`` -> ``Report`` (one ``OpResult`` per op: the chosen path, a status ``ok |
fallback | unsupported | twin-only | failed``, the worst error against its tolerance, the reason,
the time) and applies the choices to ``ops``. ``agree(report, ops, group)`` makes every tensor-
parallel rank take the lowest path any rank found (``twin`` < ``portable`` < ``kernel``), so all
ranks run the same implementation of every op. Where no kernel can run (a CPU without the
interpreter) every op is ``twin-only`` at once: the check costs nothing there.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field

import torch

from . import PATHS, Ops
from .registry import OPS, OpSpec
from .selftests import Context, Tol, cases, compare

STATUSES = ("ok", "fallback", "unsupported", "twin-only", "failed")


@dataclass
class OpResult:
    op: str
    path: str                 # 'kernel' | 'portable' | 'twin'
    status: str
    reason: str = ""
    error: float | None = None      # worst error of the tested path (kernel, or the one that failed)
    tolerance: str | None = None
    seconds: float = 0.0


@dataclass
class Report:
    device: str
    mode: str
    results: list[OpResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Every op has a working path."""
        return all(r.status != "failed" for r in self.results)

    def counts(self) -> dict[str, int]:
        return {p: sum(1 for r in self.results if r.path == p) for p in PATHS}

    def summary(self) -> str:
        n = self.counts()
        fell = [r.op for r in self.results if r.status == "fallback"]
        failed = [r.op for r in self.results if r.status == "failed"]
        s = (f"kernel check ({self.mode}) on {self.device}: {len(self.results)} ops in {self.seconds:.1f} s: "
             f"{n['kernel']} on kernels, {n['portable']} on portable kernels, {n['twin']} on twins; "
             f"{len(fell)} fell back" + (f" ({', '.join(fell)})" if fell else ""))
        return s + (f"; no working path for {', '.join(failed)}" if failed else "")

    def as_list(self) -> list[dict]:
        """One dict per op; a non-finite error (a raise, NaN) is None."""
        rows = [asdict(r) for r in self.results]
        for r in rows:
            if r["error"] is not None and not math.isfinite(r["error"]):
                r["error"] = None
        return rows

    def to_json(self) -> str:
        return json.dumps(self.as_list(), indent=1, allow_nan=False)

    def table(self) -> str:
        rows = [("op", "path", "status", "error", "tolerance", "s", "reason")]
        for r in self.results:
            err = "-" if r.error is None else ("inf" if math.isinf(r.error) else f"{r.error:.2e}")
            rows.append((r.op, r.path, r.status, err, r.tolerance or "-", f"{r.seconds:.2f}", r.reason))
        w = [max(len(row[i]) for row in rows) for i in range(6)]
        return "\n".join("  ".join(c.ljust(w[i]) for i, c in enumerate(row[:6])) + "  " + row[6] for row in rows)


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _first_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:200] if msg else ''}"


def _test(fn, case, refs, device) -> tuple[float, float, str, str]:
    """One case on ``fn``: (worst error / bound ratio, that error, its tolerance, failure or '')."""
    args, kw = case.make()
    try:
        res = fn(*args, **kw)
        _sync(device)
    except Exception as e:                        # noqa: BLE001 - the failure is the result
        return math.inf, math.inf, "", f"{case.label}: raised {_first_line(e)}"
    outs = case.outputs(res, args, kw)
    worst = (-1.0, 0.0, "")
    for name, ref in refs.items():
        tol: Tol = case.tol(name)
        err, bound, fail = compare(outs[name], ref, tol)
        ratio = err / bound if bound else (0.0 if err == 0 else math.inf)
        if fail:
            return math.inf, err, tol.describe(), f"{case.label}: {name}: {fail}"
        if ratio > worst[0]:
            worst = (ratio, err, tol.describe())
    return (*worst, "")


def _test_path(fn, todo, refs, device) -> tuple[float, str, str]:
    """(worst error, its tolerance, failure or '') of ``fn`` over every case (stops at a failure)."""
    worst = (-1.0, 0.0, "")
    for case, ref in zip(todo, refs):
        ratio, err, tol, why = _test(fn, case, ref, device)
        if why:
            return err, tol, why
        if ratio > worst[0]:
            worst = (ratio, err, tol)
    return worst[1], worst[2], ""


def check_op(spec: OpSpec, ops: Ops, ctx: Context) -> OpResult:
    """Self-test one op on ``ops``' device and choose its path (module doc); ``ops`` is not changed."""
    from . import capability_of
    t0 = time.perf_counter()
    cap = None if ops.forced else capability_of(ops.device)
    if cap is not None and cap < spec.min_capability:
        need = "sm_%d%d" % spec.min_capability
        return OpResult(spec.name, "twin", "unsupported", f"sm_{cap[0]}{cap[1]} is below the kernel's minimum {need}")
    if spec.name not in ops.eligible:
        return OpResult(spec.name, "twin", "twin-only", ops.reason)
    if spec.name == "moe" and ctx.expert_format == "fp8":
        return OpResult(spec.name, "twin", "twin-only", "FP8 routed experts have no kernel")
    try:
        todo = cases(spec.name, ctx)
        twin = spec.load("twin")
        refs = []
        for case in todo:
            args, kw = case.make()
            res = twin(*args, **kw)
            refs.append({k: v.detach().clone() for k, v in case.outputs(res, args, kw).items()})
    except Exception as e:                        # noqa: BLE001
        return OpResult(spec.name, "twin", "failed", f"the twin raised {_first_line(e)}",
                        seconds=time.perf_counter() - t0)
    tried = [("kernel", ops.kernel_fn(spec.name))]
    if spec.portable is not None:
        tried.append(("portable", spec.load("portable")))
    first, failures = None, []
    for path, fn in tried:
        err, tol, why = _test_path(fn, todo, refs, ctx.device)
        first = first or (err, tol)
        if not why:
            status = "ok" if path == "kernel" else "fallback"
            return OpResult(spec.name, path, status, "; ".join(failures), first[0], first[1],
                            time.perf_counter() - t0)
        failures.append(f"{path}: {why}")
    return OpResult(spec.name, "twin", "fallback", "; ".join(failures), first[0], first[1], time.perf_counter() - t0)


def run(ops: Ops, cfg, mode: str = "fast", expert_format: str = "mxfp4", world: int = 1,
        only: list[str] | None = None, log=None) -> Report:
    """Self-check every op (or ``only`` these) on ``ops``' device, apply the choices to ``ops`` and
    return the report; ``log(line)`` gets a line per fallback and the summary."""
    t0 = time.perf_counter()
    dev = ops.device
    report = Report(_device_name(ops), mode)
    ctx = Context(cfg, dev, mode, expert_format, world)
    for name, spec in OPS.items():
        if only is not None and name not in only:
            continue
        report.results.append(check_op(spec, ops, ctx))
    _apply(report, ops)
    report.seconds = time.perf_counter() - t0
    if dev.type == "cuda":
        torch.cuda.empty_cache()          # the self-tests' buffers: back to the device before the KV cache is sized
    if log is not None:
        for r in report.results:
            if r.status in ("fallback", "failed"):
                log(f"kernel check: {r.op} on {report.device}: {r.status} -> {r.path}: {r.reason}")
        log(report.summary())
    return report


def _device_name(ops: Ops) -> str:
    if ops.device.type == "cuda" and ops.kernels:
        from ..kernels.lib import target
        return target(ops.device).describe()
    if ops.kernels:
        return "the Triton interpreter (CPU)"
    return f"{ops.device.type} (torch twins)"


def _apply(report: Report, ops: Ops) -> None:
    for r in report.results:
        if ops.paths.get(r.op) != r.path:
            ops.use(r.op, r.path)


def agree(report: Report, ops: Ops, group) -> None:
    """All ranks of ``group`` (``parallel.Group``) take, per op, the lowest path any rank chose."""
    if group is None or group.pg is None or group.world == 1:
        return
    import torch.distributed as dist
    dev = ops.device if dist.get_backend(group.pg) == "nccl" else torch.device("cpu")
    code = torch.tensor([PATHS.index(r.path) for r in report.results], dtype=torch.int32, device=dev)
    dist.all_reduce(code, op=dist.ReduceOp.MIN, group=group.pg)
    for r, c in zip(report.results, code.tolist()):
        if PATHS[c] != r.path:
            r.path = PATHS[c]
            r.status = "fallback"
            r.reason = (r.reason + "; " if r.reason else "") + "another tensor-parallel rank's check failed"
    _apply(report, ops)


__all__ = ["OpResult", "Report", "STATUSES", "agree", "check_op", "run"]
