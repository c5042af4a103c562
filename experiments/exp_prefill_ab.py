#!/usr/bin/env python3
"""Experiment: ``benchmarks/prefill.py`` with a session's prefill-only routing choices on ("after", the
defaults) or off ("before"), to run both in one device call and compare there. The choices of the fifth
session of 2026-12-06: the pre-decoded path's GEMMs decoding inside the kernel (``route.PREDEC_WS``) and the
indexer's scores over 4 rows per program sharing a prefill chunk's block table (``indexer.SHARED_TABLE_ROWS``).
(The fourth session's pair, the gate on ``dense_mm`` + the shared expert unfused + ``PREFETCH``, is in git.)

    PYTHONPATH=. python experiments/exp_prefill_ab.py before|after [prefill.py's arguments]
"""
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from dsv4.kernels import indexer as IX  # noqa: E402
from dsv4.kernels.gemm import route as R  # noqa: E402

if len(sys.argv) < 2 or sys.argv[1] not in ("before", "after"):
    sys.exit("usage: exp_prefill_ab.py before|after [prefill.py's arguments]")
mode = sys.argv.pop(1)
if mode == "before":
    R.PREDEC_WS = False
    IX.SHARED_TABLE_ROWS = 1
if os.environ.get("SPLIT_STORE"):       # route.SWIGLU_SPLIT_STORE: SPLIT_STORE=1 on (the default), 0 off
    R.SWIGLU_SPLIT_STORE = os.environ["SPLIT_STORE"] == "1"
if os.environ.get("WS_NC2"):            # fp4_fp8_ws's former default: 2 consumers, byte-lane decode
    from dsv4.kernels.gemm import fp4_fp8_ws as WS
    WS.DEFAULT_CONFIG.update(CONSUMERS=2, LUT=False)
if os.environ.get("FUSE_QO"):           # Attention.FUSE_PREFILL_QO: FUSE_QO=1 on (the default), 0 off
    from dsv4.layers.attention import Attention
    Attention.FUSE_PREFILL_QO = os.environ["FUSE_QO"] == "1"
if os.environ.get("BF16_KV"):           # Attention.PREFILL_BF16_KV: BF16_KV=1 on, 0 off (the default)
    from dsv4.layers.attention import Attention
    Attention.PREFILL_BF16_KV = os.environ["BF16_KV"] == "1"
if os.environ.get("WS_PREFILL"):        # sparse_attention.WS_PREFILL: WS_PREFILL=1 on (with BF16_KV=1), 0 off (default)
    from dsv4.kernels import sparse_attention as SA
    SA.WS_PREFILL = os.environ["WS_PREFILL"] == "1"
print(f"exp_prefill_ab: {mode}")
sys.argv[0] = os.path.join(ROOT, "benchmarks", "prefill.py")
runpy.run_path(sys.argv[0], run_name="__main__")
