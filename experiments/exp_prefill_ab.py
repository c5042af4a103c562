#!/usr/bin/env python3
"""Experiment: ``benchmarks/prefill.py`` with the prefill-only routing choices of 2026-12-06 on ("after", the
defaults) or off ("before": the router's gate on torch's fp32 GEMM and the shared expert's fused SwiGLU tile,
via ``route.PREFILL_STEP_MIN_ROWS`` out of reach, and the pre-decoded GEMMs without ``PREFETCH``). Run both in
one device call and compare there.

    PYTHONPATH=. python experiments/exp_prefill_ab.py before|after [prefill.py's arguments]
"""
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from dsv4.kernels.gemm import route as R  # noqa: E402

if len(sys.argv) < 2 or sys.argv[1] not in ("before", "after"):
    sys.exit("usage: exp_prefill_ab.py before|after [prefill.py's arguments]")
mode = sys.argv.pop(1)
if mode == "before":
    R.PREFILL_STEP_MIN_ROWS = 10 ** 9
    _tiles = R.fp8_predec_config
    R.fp8_predec_config = lambda *a, **k: dict(_tiles(*a, **k), PREFETCH=False)
print(f"exp_prefill_ab: {mode}")
sys.argv[0] = os.path.join(ROOT, "benchmarks", "prefill.py")
runpy.run_path(sys.argv[0], run_name="__main__")
