"""Programmatic dependent launch (``DSV4_PDL``, ``kernels.lib.pdl_mode``): the contract that makes it
safe (every launched Triton kernel of the package opens with ``pdl_wait()``, every launch carries
``PDL_LAUNCH``), the switch, the PTX it compiles to for sm_90 / sm_100, and on a GPU the same bits
with it on as off."""
import ast
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from kernel_helpers import run_aot_script

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "dsv4"


def _is_triton_jit(fn: ast.FunctionDef) -> bool:
    """@triton.jit or @gluon.jit (the Gluon kernels keep the same contract)."""
    for d in fn.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        if isinstance(d, ast.Attribute) and d.attr == "jit" and getattr(d.value, "id", "") in ("triton", "gluon"):
            return True
    return False


def _kernels_and_launches():
    """({name: [(file, FunctionDef)]} of the package's @triton.jit / @gluon.jit functions (helpers of
    two modules may share a name; launched kernels may not), [(name, file, Call)] of every
    ``name[grid](...)`` call of one of them)."""
    jit, calls = {}, []
    for f in sorted(PKG.rglob("*.py")):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and _is_triton_jit(node):
                jit.setdefault(node.name, []).append((f, node))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                v = node.func.value
                calls.append((v.id if isinstance(v, ast.Name) else getattr(v, "attr", None), f, node))
    launches = [c for c in calls if c[0] in jit]
    twice = sorted({n for n, _f, _c in launches if len(jit[n]) > 1})
    assert twice == [], f"launched kernels with two definitions of the same name: {twice}"
    return jit, launches


# What a kernel may do before its pdl_wait(): index arithmetic and L2 prefetch hints of static weights
# (``lib.prefetch_l2``: no value, nothing that could be stale); no load, store, atomic or inline asm
PRE_WAIT_CALLS = {"prefetch_l2", "grouped_tile", "program_id", "arange", "cdiv", "to", "minimum", "BlockedLayout"}


def _is_pdl_attr(v) -> bool:
    """``PDL_LAUNCH``, or ``pdl_launch(grid, t)`` (the same attribute up to a grid size, none above)."""
    return getattr(v, "id", "") == "PDL_LAUNCH" or (isinstance(v, ast.Call) and getattr(v.func, "id", "") == "pdl_launch")


def _is_wait(st) -> bool:
    return isinstance(st, ast.Expr) and isinstance(st.value, ast.Call) and getattr(st.value.func, "id", "") == "pdl_wait"


def _calls(st) -> list[str]:
    return [getattr(c.func, "id", None) or getattr(c.func, "attr", "?") for c in ast.walk(st) if isinstance(c, ast.Call)]


def test_every_launched_kernel_waits_first_and_every_launch_carries_the_attribute():
    jit, launches = _kernels_and_launches()
    launched = {name for name, _f, _c in launches}
    assert len(launched) >= 35                      # the hot path's kernels, not an empty scan
    bad_calls = [f"{f.relative_to(ROOT)}:{c.lineno} {n}" for n, f, c in launches
                 if not any(k.arg is None and _is_pdl_attr(k.value) for k in c.keywords)]
    assert bad_calls == [], f"launches without **PDL_LAUNCH / **pdl_launch(grid, t): {bad_calls}"
    bad_kernels, prefetching = [], set()
    for name in sorted(launched):
        f, fn = jit[name][0]
        body = fn.body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]                          # the docstring
        i = next((j for j, st in enumerate(body) if _is_wait(st)), None)
        before = body[:i] if i is not None else body
        bad = [c for st in before for c in _calls(st) if c not in PRE_WAIT_CALLS]
        if i is None or bad:
            bad_kernels.append(f"{f.relative_to(ROOT)}:{fn.lineno} {name} {bad}")
        if any("prefetch_l2" in _calls(st) for st in before):
            prefetching.add(name)
    assert bad_kernels == [], f"launched kernels that do more than index arithmetic / L2 hints before pdl_wait(): " \
                              f"{bad_kernels}"
    # the decode step's weight kernels hint their weights (lib.PREFETCH)
    assert {"_hc_fused", "_fp8_gemm_kernel", "_fp8_mma_kernel", "_dense_gemv_kernel"} <= prefetching
    # a helper that waits would be a second wait inside a kernel: only launched kernels call it
    helpers = [n for n, defs in jit.items() for _f, fn in defs if n not in launched and n != "pdl_wait"
               and any(isinstance(x, ast.Call) and getattr(x.func, "id", "") == "pdl_wait" for x in ast.walk(fn))]
    assert helpers == []


@pytest.mark.parametrize("value,cuda_sm,expect", [
    (None, (9, 0), True),           # on by default where the GPU has it
    (None, (8, 0), False),
    (None, None, False),
    ("0", (9, 0), False),
    ("off", (10, 0), False),
    ("1", (9, 0), True),
    ("on", (10, 0), True),
    ("1", (8, 9), False),           # griddepcontrol is sm_90+
    ("1", None, False),             # no GPU
    ("force", None, True),          # offline compiles
])
def test_the_switch(monkeypatch, value, cuda_sm, expect):
    from dsv4.kernels import lib
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if value is None:
        monkeypatch.delenv("DSV4_PDL", raising=False)
    else:
        monkeypatch.setenv("DSV4_PDL", value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_sm is not None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_a: cuda_sm)
    assert lib.pdl_mode() is expect
    monkeypatch.setenv("TRITON_INTERPRET", "1")       # the interpreter has no grid dependencies
    assert lib.pdl_mode() is (value == "force")


def test_a_bad_value_is_refused(monkeypatch):
    from dsv4.kernels import lib
    monkeypatch.setenv("DSV4_PDL", "yes please")
    with pytest.raises(ValueError, match="DSV4_PDL='yes please'"):
        lib.pdl_mode()


def test_pdl_launch_keeps_the_attribute_up_to_one_wave_of_programs(monkeypatch):
    """``lib.pdl_launch``: the Gluon decode GEMVs launch with PDL for grids of up to PDL_MAX_PROGRAMS_PER_SM
    programs per SM (batch 1's), plainly above (the batch-64 loss measured on the H100), and never when PDL is
    off; and both launch sites take it from their own grid."""
    from dsv4.kernels import lib
    t = lib.aot_target(90, sm_count=132)
    cap = lib.PDL_MAX_PROGRAMS_PER_SM * 132
    monkeypatch.setattr(lib, "PDL_LAUNCH", {"launch_pdl": True})
    assert lib.pdl_launch((1, 64, 12), t) == {"launch_pdl": True}            # 768: V4-Flash w1|w3, one token
    assert lib.pdl_launch((cap, 1, 1), t) == {"launch_pdl": True}
    assert lib.pdl_launch((cap + 1, 1, 1), t) == {}
    assert lib.pdl_launch((304, 64, 1), t) == {}                             # batch 64's grouped grid
    monkeypatch.setattr(lib, "PDL_LAUNCH", {})
    assert lib.pdl_launch((1, 1, 1), t) == {}
    for f in ("fp4_mma.py", "fp8_mma.py"):
        assert "**pdl_launch(grid, t)" in (PKG / "kernels" / "gemm" / f).read_text(), f


def test_this_process_has_it_exactly_where_the_gpu_has_griddepcontrol():
    from dsv4.kernels import lib
    if os.environ.get("DSV4_PDL"):
        pytest.skip("DSV4_PDL is set for this run")
    want = (not lib.interpreting() and torch.cuda.is_available()
            and torch.cuda.get_device_capability(0) >= (9, 0))
    assert lib.PDL_ON is want and lib.PDL_LAUNCH == ({"launch_pdl": True} if want else {})


_AOT = textwrap.dedent("""
    import os, sys
    sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], "tests")]
    from kernel_helpers import aot_caps, aot_compile
    from dsv4.kernels import lib, norm, mhc
    from dsv4.kernels.gemm import gemv
    want = os.environ["DSV4_PDL"] == "force"
    assert lib.PDL_ON is want and lib.PDL_LAUNCH == ({"launch_pdl": True} if want else {})
    P = lambda t: "*" + t
    F = P("fp32")
    cases = [
        (norm._rms_norm_kernel, dict(X=P("bf16"), W=P("bf16"), Y=P("bf16"), eps="fp32"), dict(BD=4096, INTERP=False), 4),
        (mhc._hc_post_kernel, dict(Yin=P("bf16"), RES=P("bf16"), POST=F, COMB=F, OUT=P("bf16")), dict(BD=1024), 4),
    ]
    import importlib
    import aot_cases as A
    for cap in aot_caps():
        gl_cases = []
        for name in ("fp8_mma", "fp4_mma"):          # the Gluon decode GEMMs, at one router configuration
            cid, kernel, const, warps, stages = next(c for c in A.cases(cap, False) if c[1] == name)
            mod, fname, types, _ops = A.KERNELS[name]
            gl_cases.append((getattr(importlib.import_module("dsv4.kernels." + mod), fname), types, const, warps))
        pf_cases = []                                 # the weight kernels with their L2 hints on (lib.PREFETCH)
        for name in ("hc_fused", "fp8_mma", "fp8_gemm", "dense_gemv"):
            cid, kernel, const, warps, stages = next(c for c in A.cases(cap, False) if c[1] == name)
            mod, fname, types, _ops = A.KERNELS[name]
            pf = dict(const, PF=True)
            if name in ("hc_fused", "dense_gemv"):      # lines of fp32 per row hinted: one K tile
                pf["PFL"] = max(1, const["BK"] // 32)
            pf_cases.append((getattr(importlib.import_module("dsv4.kernels." + mod), fname), types, pf, warps))
        for fn, types, const, warps in cases + gl_cases + (pf_cases if want else []):
            ptx, _ = aot_compile(fn, types, const, cap, warps)
            for ins in ("griddepcontrol.wait", "griddepcontrol.launch_dependents"):
                assert (ins in ptx) is want, (fn.__name__, cap, ins, want)
            if want:       # the wait comes before the kernel's first global load
                assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global"), fn.__name__
            if const.get("PF"):   # and after the weights' L2 hints, which are there
                assert ptx.index("prefetch.global.L2::evict_last") < ptx.index("griddepcontrol.wait"), fn.__name__
    print("ok", want)
""")


@pytest.mark.parametrize("mode", ["force", "0"])
def test_aot_ptx_has_the_grid_dependency_instructions_only_when_on(mode):
    run_aot_script(_AOT, ROOT, timeout=300, DSV4_PDL=mode)


_SAME = textwrap.dedent("""
    import json, sys
    import torch
    from dsv4.engine.llm import LLM
    from dsv4.engine.sampling_params import SamplingParams
    from dsv4.kernels import lib
    llm = LLM(synthetic="flash", synthetic_layers=4, synthetic_experts=16, max_num_batched_tokens=1024,
              max_num_seqs=8, max_model_len=4096, log=False)
    g = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(3, 100000, (n,), generator=g).tolist()} for n in (5, 300, 1500, 17)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3))
    res = [[list(o.outputs[0].token_ids), [[(k, v.logprob) for k, v in sorted(d.items())] for d in o.outputs[0].logprobs]]
           for o in outs]
    print(json.dumps({"pdl": lib.PDL_ON, "graphs": llm.engine.runner.graphs is not None, "res": res}))
""")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_same_tokens_and_logprobs_with_pdl_on_and_off():
    """The engine (CUDA-graph decode, chunked prefill) in two fresh processes, DSV4_PDL=1 and 0:
    PDL only moves launches earlier, every kernel waits first, so the bits are the same."""
    runs = {}
    for mode in ("1", "0"):
        env = dict(os.environ, DSV4_PDL=mode, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        r = subprocess.run([sys.executable, "-c", _SAME], capture_output=True, text=True, env=env, cwd=ROOT,
                           timeout=900)
        assert r.returncode == 0, r.stderr[-4000:]
        runs[mode] = json.loads(r.stdout.strip().splitlines()[-1])
    cap = torch.cuda.get_device_capability()
    assert runs["1"]["pdl"] is (cap >= (9, 0)) and runs["0"]["pdl"] is False
    assert runs["1"]["graphs"] and runs["0"]["graphs"]
    assert runs["1"]["res"] == runs["0"]["res"]
