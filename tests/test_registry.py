"""The op registry's self-check (dsv4/ops: registry, selftests, check), ``dsv4 check``, ``DSV4_FAULT``
fault injection and the engine's start-up check with per-op fallback.

On a CPU machine ``dsv4 check`` runs every op's kernel under the Triton interpreter against its twin
at the tiny preset's shapes; the engine test runs one exact op (decode_meta) on its kernel so that the
model stays cheap, and shows that a corrupted kernel falls back to its twin with the same tokens.
"""
import json
import math

import pytest
import torch

pytest.importorskip("triton")

from dsv4.config import preset  # noqa: E402
from dsv4.ops import NAMES, Ops, check, faults  # noqa: E402
from dsv4.ops.registry import OPS  # noqa: E402
from dsv4.ops.selftests import Tol, compare  # noqa: E402


def _check_json(capsys, *args) -> tuple[int, list]:
    from dsv4.cli import main
    rc = main(["check", "--json", *args])
    return rc, json.loads(capsys.readouterr().out)


def test_dsv4_check_json_every_op_passes_on_its_kernel(capsys):
    """``dsv4 check --json`` (here: the interpreter, tiny shapes): every op of the registry self-tested,
    kernel against twin, each on its kernel with status ok, exit code 0."""
    rc, rows = _check_json(capsys)
    assert rc == 0
    assert [r["op"] for r in rows] == list(NAMES)
    for r in rows:
        assert {"op", "path", "status", "reason", "error", "tolerance"} <= set(r)
        assert (r["path"], r["status"]) == ("kernel", "ok"), r
        assert r["error"] is not None and r["error"] >= 0


@pytest.mark.parametrize("mode,want", [("garbage", r"max error|values differ"), ("nan", r"non-finite|values differ"),
                                       ("raise", r"raised RuntimeError: DSV4_FAULT")])
def test_fault_injection_falls_back_naming_the_failure(monkeypatch, capsys, mode, want):
    """``DSV4_FAULT=<op>:<mode>``: ``dsv4 check`` reports those ops as fallback (the twin, or linear's
    portable kernel) naming the mismatch; the ops left alone stay on their kernels."""
    import re
    monkeypatch.setenv("DSV4_FAULT", f"sparse_decode:{mode},entry_ids:{mode}")
    rc, rows = _check_json(capsys, "--op", "sparse_decode", "--op", "entry_ids", "--op", "rms_norm")
    assert rc == 0
    by = {r["op"]: r for r in rows}
    for op in ("sparse_decode", "entry_ids"):
        assert (by[op]["status"], by[op]["path"]) == ("fallback", "twin"), by[op]
        assert re.search(want, by[op]["reason"]), by[op]["reason"]
    assert (by["rms_norm"]["status"], by["rms_norm"]["path"]) == ("ok", "kernel")


def test_fault_on_an_op_with_a_portable_form_takes_it():
    """A failing kernel of an op with a portable form (linear: the Triton tile kernel alone) falls back
    to that form, which passes; ``Ops`` then runs it."""
    ops = Ops("cpu", kernels=("linear",), faults_={"linear": "raise"})
    rep = check.run(ops, preset("tiny"), "fast", only=["linear"])
    (r,) = rep.results
    assert (r.path, r.status) == ("portable", "fallback") and "injected failure" in r.reason
    assert ops.paths["linear"] == "portable" and ops.linear is OPS["linear"].load("portable")
    assert rep.ok and not ops.graph_safe


def test_fault_spec_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown op 'nope'"):
        faults.parse("nope:garbage", NAMES)
    with pytest.raises(ValueError, match="mode of 'linear' must be one of garbage, nan, raise"):
        faults.parse("linear:zero", NAMES)
    with pytest.raises(ValueError, match="expected <op>:<mode>"):
        faults.parse("linear", NAMES)
    assert faults.parse(" linear:nan , moe:raise ", NAMES) == {"linear": "nan", "moe": "raise"}


def test_fault_wrapper_corrupts_only_the_outputs():
    x = torch.arange(6.0).view(2, 3)
    ids = torch.tensor([[1, 2], [3, -1]])
    g = faults.wrap("op", lambda a, b: (a * 1, b.clone()), "garbage")(x, ids)
    assert g[0].shape == x.shape and not torch.equal(g[0], x) and g[1].dtype == ids.dtype
    n = faults.wrap("op", lambda a: a * 1, "nan")(x)
    assert torch.isnan(n).all()
    assert (faults.wrap("op", lambda a: a.long(), "nan")(x) == torch.iinfo(torch.int64).min).all()


def test_compare_tolerances():
    t = torch.tensor([1.0, -2.0, 4.0, float("-inf")])
    assert compare(t.clone(), t, Tol(max_rel=1e-6))[2] == ""
    err, bound, why = compare(t + torch.tensor([0, 0, 0.1, 0]), t, Tol(max_rel=2.0 ** -6))
    assert math.isclose(err, 0.1 / 4, rel_tol=1e-5) and "max error" in why
    assert "non-finite" in compare(torch.tensor([1.0, -2.0, 4.0, 0.0]), t, Tol(max_rel=1.0))[2]
    assert "NaN" in compare(torch.full((4,), float("nan")), t, Tol(max_rel=1.0))[2]
    assert compare(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4]), Tol(exact=True))[2] == "1 of 3 values differ"
    # flips: a step of one element in 100 is allowed by 2%, three in 100 are not
    base = torch.ones(100)
    one = base.clone()
    one[5] = 1.25
    assert compare(one, base, Tol(max_rel=0.5, flips=0.02))[2] == ""
    three = base.clone()
    three[:3] = 1.25
    assert "differ beyond one rounding step" in compare(three, base, Tol(max_rel=0.5, flips=0.02))[2]
    # per row: each row against its own largest value (a small row's error is not hidden by a large one)
    rows = torch.tensor([[100.0, 1.0], [1.0, 2.0]])
    moved = rows + torch.tensor([[0.0, 0.0], [0.0, 0.2]])
    assert compare(moved, rows, Tol(max_rel=0.05))[2] == ""
    assert "max error 0.1" in compare(moved, rows, Tol(max_rel=0.05, per_row=True))[2]


def test_twins_only_device_checks_nothing():
    """Where no kernel runs (a CPU without the interpreter's forcing) every op is twin-only at once."""
    ops = Ops("cpu")
    rep = check.run(ops, preset("flash"), "fast")
    assert {r.status for r in rep.results} == {"twin-only"} and rep.ok
    assert all(r.error is None for r in rep.results)          # nothing was built or run


def test_capability_below_the_minimum_is_unsupported(monkeypatch):
    """An op whose kernel does not compile for the GPU (FP8 ops on sm_80) is 'unsupported' and runs its
    twin; the others keep their kernels (the probe is replaced: no GPU here)."""
    import dsv4.ops as ops_mod
    monkeypatch.setattr(ops_mod, "kernel_path", lambda device: (True, "an sm_80 GPU"))
    monkeypatch.setattr(ops_mod, "capability_of", lambda device: (8, 0))
    ops = Ops("cpu")
    assert ops.paths["linear"] == "twin" and ops.paths["entry_ids"] == "kernel"
    rep = check.run(ops, preset("tiny"), "fast", only=["linear", "entry_ids"])
    by = {r.op: r for r in rep.results}
    lin, ids = by["linear"], by["entry_ids"]
    assert (lin.path, lin.status) == ("twin", "unsupported") and "sm_80 is below the kernel's minimum sm_89" in lin.reason
    assert (ids.path, ids.status) == ("kernel", "ok")


def test_engine_start_up_check_falls_back_with_the_same_tokens(monkeypatch, capsys):
    """The engine checks its ops after loading the weights; a corrupted kernel (decode_meta, garbage)
    is switched to its twin with one log line naming the op, and the greedy tokens equal the run
    without the fault (decode_meta is exact: kernel and twin give the same bits)."""
    from dsv4 import LLM, SamplingParams
    kw = dict(kernels=("decode_meta",), max_model_len=64, max_num_seqs=2, kv_cache_memory="64MiB")
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompt = {"prompt_token_ids": [0, 3476, 477, 1009]}
    clean = LLM(**kw)
    assert clean.engine.model.ops.paths["decode_meta"] == "kernel"
    want = clean.generate([prompt], sp)[0].outputs[0].token_ids
    capsys.readouterr()
    monkeypatch.setenv("DSV4_FAULT", "decode_meta:garbage")
    faulty = LLM(**kw)
    err = capsys.readouterr().err
    assert "kernel check: decode_meta" in err and "fallback -> twin" in err and "1 fell back (decode_meta)" in err
    report = faulty.engine.model.kernel_report
    assert [r.op for r in report.results if r.status == "fallback"] == ["decode_meta"]
    assert faulty.engine.model.ops.paths["decode_meta"] == "twin"
    assert faulty.generate([prompt], sp)[0].outputs[0].token_ids == want


def test_kernel_check_flag_is_validated():
    from dsv4.engine.llm_engine import EngineConfig, LLMEngine
    with pytest.raises(ValueError, match="kernel_check must be one of fast, full, off"):
        LLMEngine(EngineConfig(kernel_check="quick", log=False))
    with pytest.raises(ValueError, match="kernels: unknown op"):
        Ops("cpu", kernels=("nope",))


# ------------------------------------------------------------------------------------------------
# GPU (skipped without CUDA by the conftest)

@pytest.mark.gpu
def test_gpu_check_with_a_garbage_kernel(monkeypatch, capsys):
    """On the GPU at V4-Flash shapes: every op ok but the corrupted sparse_decode, which falls back to
    its twin naming the mismatch."""
    monkeypatch.setenv("DSV4_FAULT", "sparse_decode:garbage")
    rc, rows = _check_json(capsys)
    assert rc == 0
    by = {r["op"]: r for r in rows}
    assert (by["sparse_decode"]["status"], by["sparse_decode"]["path"]) == ("fallback", "twin")
    assert "max error" in by["sparse_decode"]["reason"]
    assert all(r["status"] == "ok" for op, r in by.items() if op != "sparse_decode"), rows
