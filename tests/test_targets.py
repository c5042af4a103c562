"""Other GPU generations, offline: every kernel behind the op registry compiled (no GPU) for
GPUTarget("cuda", cap, 32), cap in 80, 86, 89, 90, 100, 120, at the configurations its launcher or
router picks there (tests/aot_cases.py), and held to two facts:

* the registry's minimum capability is what compiles: every kernel of an op compiles for each cap at
  or above the op's ``min_capability``; below it (sm_80 / sm_86 for the ops that touch e4m3 values)
  the op's kernels fail with the FP8 error (Triton's "fp8e4nv not supported" or ptxas's "requires
  .target sm_89"), not another one: those ops run their twins there (``ops.check``: unsupported);
* every compiled configuration fits the target's shared memory per block (``kernels.lib.SMEM_PER_BLOCK``:
  99 KB on sm_86 / sm_89 / sm_120, 227 KB on sm_90 / sm_100, 163 KB on sm_80): a tile tuned for
  Hopper that cannot launch on an RTX PRO 6000 / 5090 fails here.

Subprocesses per cap (TRITON_INTERPRET=0), side by side. CI compiles, for sm_80, sm_89 and sm_120, one
configuration per kernel, the one with the largest tiles (``aot_cases.cases(full=False)``);
``DSV4_AOT_FULL=1`` compiles every configuration the routers can pick for all six targets
(benchmarks/registry_gpu_check.sh runs it on the GPU host's CPUs).
"""
import json
import os
import re
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("triton")

from dsv4.kernels.lib import SMEM_PER_BLOCK  # noqa: E402
from dsv4.ops.registry import FP8, OPS  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FULL = os.environ.get("DSV4_AOT_FULL") == "1"
# CI: sm_80 (Ampere, also sm_86's lowering: its shared memory is held to sm_86's 99 KB too), sm_89 (the
# FP8 boundary) and sm_120; the full sweep adds sm_86, sm_90 and sm_100 (the tests of each kernel file
# compile their kernels for sm_90 / sm_100 in CI)
CAPS = (80, 86, 89, 90, 100, 120) if FULL else (80, 89, 120)
FP8_ERROR = re.compile(r"fp8e4nv not supported in this architecture|e4m3x2.*requires \.target sm_89 or higher"
                       r"|type fp8e4nv not supported|fp8e4nv.*not supported")

_SCRIPT = textwrap.dedent(r"""
    import json, os, sys, time
    os.environ["TRITON_INTERPRET"] = "0"
    sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], "tests")]
    cap, full, part, parts = int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4]), int(sys.argv[5])
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import aot_cases as A
    from kernel_helpers import aot_compile

    out = {}
    for i, (cid, kernel, const, warps, stages) in enumerate(A.cases(cap, full)):
        if i % parts != part:
            continue
        t0 = time.time()
        try:
            if kernel == "fp8_prefill":
                from dsv4.kernels.gemm import fp8_prefill
                fn, sig, c2, attrs, opts = fp8_prefill.aot_spec(const)
                k = triton.compile(ASTSource(fn, sig, c2, attrs), target=GPUTarget("cuda", cap, 32), options=opts)
                assert "trap;" not in k.asm["ptx"], "compiled to a trap"
                shared = k.metadata.shared
            else:
                if kernel == "sparse_fwd":
                    const = dict(const, DT=tl.bfloat16)
                _ptx, _mma, shared = aot_compile(A.function(kernel), A.types_of(kernel, const), const, cap, warps,
                                                 stages, div=A.DIV, shared=True)
            res = ["ok", shared]
        except Exception as e:                      # noqa: BLE001 - the message is the measurement
            msgs = []
            while e is not None and len(msgs) < 8:  # a call inside the kernel nests the cause
                msgs.append(f"{type(e).__name__}: {e}")
                e = e.__cause__ or e.__context__
            res = ["\n".join(reversed(msgs))[:8000], None]
        out[cid] = [kernel, res[0], res[1], round(time.time() - t0, 1)]
    print("RESULTS " + json.dumps(out))
""")


def _compile_for(cap: int, part: int, parts: int) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    r = subprocess.run([sys.executable, "-c", _SCRIPT, str(REPO), str(cap), "1" if FULL else "0", str(part),
                        str(parts)], capture_output=True, text=True, env=env, timeout=3000)
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULTS ")]
    assert r.returncode == 0 and line, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(line[0][len("RESULTS "):])


@pytest.fixture(scope="module")
def matrix():
    """{cap: {case id: (kernel, outcome, shared bytes, seconds)}}, the caps compiled side by side."""
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:  # pragma: no cover
        pytest.skip(f"this triton cannot compile ahead of time: {e}")
    workers = max(1, os.cpu_count() or 1)
    parts = max(1, workers // len(CAPS))
    jobs = [(cap, p, parts) for cap in CAPS for p in range(parts)]
    with ThreadPoolExecutor(max_workers=min(len(jobs), workers)) as ex:
        done = list(ex.map(lambda j: (j[0], _compile_for(*j)), jobs))
    res = {cap: {} for cap in CAPS}
    for cap, per in done:
        res[cap].update(per)
    for per in res.values():
        for _kernel, outcome, _s, _t in per.values():
            if "ptxas" in outcome and ("not found" in outcome or "No such file" in outcome):  # pragma: no cover
                pytest.skip(f"no ptxas for offline compilation: {outcome[-300:]}")
    return res


def _ops_of(kernel: str):
    import aot_cases
    return aot_cases.KERNELS[kernel][3]


def _supported(op: str, cap: int) -> bool:
    return (cap // 10, cap % 10) >= OPS[op].min_capability


def test_every_registry_op_has_kernels_in_the_matrix(matrix):
    kernels = {k for per in matrix.values() for k, *_ in per.values()}
    served = {op for k in kernels for op in _ops_of(k)}
    assert served == set(OPS), f"ops without a compiled kernel: {sorted(set(OPS) - served)}"


@pytest.mark.parametrize("cap", CAPS)
def test_compiles_where_the_registry_says(matrix, cap):
    """Supported ops: every configuration compiles. Unsupported ops (FP8 below sm_89): the kernels
    that only they run fail with the FP8 error, and each such op has at least one."""
    wrong, fp8_fail = [], set()
    for cid, (kernel, outcome, _shared, _s) in sorted(matrix[cap].items()):
        ops = _ops_of(kernel)
        if any(_supported(op, cap) for op in ops):
            if outcome != "ok":
                wrong.append(f"{cid}: expected to compile for sm_{cap}, got {outcome[-600:]}")
        elif outcome == "ok":
            continue                  # compiles but the op needs another of its kernels that does not
        elif FP8_ERROR.search(outcome):
            fp8_fail.update(ops)
        else:
            wrong.append(f"{cid}: expected the FP8 failure on sm_{cap}, got {outcome[-600:]}")
    unsupported = {op for op in OPS if not _supported(op, cap)}
    assert not wrong, "\n".join(wrong)
    # an unsupported op that runs FP8-free configurations too (wo_a's fp8_mma is its only kernel)
    # must still fail somewhere: otherwise its minimum capability is too high
    missing = {op for op in unsupported if op not in fp8_fail and OPS[op].min_capability == FP8}
    assert not missing, f"ops whose kernels all compile for sm_{cap} below their minimum: {sorted(missing)}"


@pytest.mark.parametrize("cap", CAPS)
def test_shared_memory_fits_the_target(matrix, cap):
    limit = SMEM_PER_BLOCK[cap] if FULL or cap != 80 else SMEM_PER_BLOCK[86]
    over = [f"{cid}: {shared} bytes > {limit} (sm_{cap})" for cid, (kernel, outcome, shared, _s) in matrix[cap].items()
            if outcome == "ok" and shared is not None and shared > limit]
    assert not over, "\n".join(over)


def test_jit_helpers_take_no_string_constexpr_defaults():
    """A @triton.jit function called from another one gets its defaulted constexprs from the caller's
    code generator; Triton 3.6 (the GPU image's) hands a str default over as a bare Python str, and the
    kernel fails to compile (``'str' object has no attribute 'type'``) where 3.9 accepts it. Launched
    kernels are not affected (the launcher wraps defaults), so the rule is on every jit function: a str
    constexpr is passed by its caller, never defaulted."""
    import ast
    bad = []
    for f in sorted((REPO / "dsv4").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, ast.FunctionDef) or not any(
                    getattr(d.func if isinstance(d, ast.Call) else d, "attr", "") == "jit" for d in node.decorator_list):
                continue
            args = node.args.args[len(node.args.args) - len(node.args.defaults):]
            bad += [f"{f.relative_to(REPO)}:{node.lineno} {node.name}({a.arg})"
                    for a, d in zip(args, node.args.defaults)
                    if isinstance(d, ast.Constant) and isinstance(d.value, str)]
    assert bad == [], f"str constexpr defaults: {bad}"
