"""AOT compile matrix: representative kernels compiled offline (no GPU) for every GPU generation the
engine targets, GPUTarget("cuda", cap, 32) with cap in 80, 89, 90, 100, 120, held to the fact table of
dsv4/kernels/targets.py: a kernel compiles where the table says it is supported, and below its
minimum capability (sm_89 for the kernels that handle e4m3 values) it fails with the FP8 error
(Triton's "fp8e4nv not supported" or ptxas's "requires .target sm_89"), not another one.

One subprocess per cap (TRITON_INTERPRET=0), run side by side; minimal launch shapes keep the file
inside the 2-core CI budget.
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

from dsv4.kernels import targets

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[1]
CAPS = (80, 89, 90, 100, 120)
FP8_ERROR = re.compile(r"fp8e4nv not supported in this architecture|e4m3x2.*requires \.target sm_89 or higher")

_SCRIPT = textwrap.dedent(r"""
    import json, os, re, sys, time
    os.environ["TRITON_INTERPRET"] = "0"
    sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], "tests")]
    cap = int(sys.argv[2])
    import triton.language as tl
    from kernel_helpers import aot_compile
    from dsv4.kernels import compressor as cp, fp4_mma as F4, fp8_mma as F8, gemm as G, indexer as ix
    from dsv4.kernels import kv_insert as ki, mhc, moe as Mo, norm as nm, sparse_attention as sa

    P = lambda t: "*" + t
    F = P("fp32")
    DIV = ("K", "N_out", "stride_am", "stride_sam", "stride_we", "stride_wn", "stride_wse", "stride_wsn",
           "stride_cm", "stride_csm", "stride_bn", "stride_sbn", "stride_x", "stride_q", "stride_s", "stride_a",
           "d", "stride_o", "stride_y", "N", "k_per_split")
    sac = sa.default_config(16, (cap // 10, cap % 10))
    mmt = dict(A=P("u8"), SA=F, W=P("u8"), WS=P("u8"), WS2=F, C=P("bf16"), PERM=P("i64"), OFFS=P("i64"),
               TCUM=P("i64"))
    # name -> (kernel, argument types, constexprs, warps, stages)
    cases = {
        "kv_insert": (ki._kv_insert_kernel, dict(Q=P("bf16"), KV=P("bf16"), COS=F, SIN=F, PAGES=P("u8"),
                      SLOTS=P("i64"), QO=P("bf16"), KVO=P("bf16"), eps="fp32"), dict(HPB=1), 4, None),
        "sparse_decode": (sa._sparse_fwd, dict(Q=P("bf16"), WIDX=P("i32"), EIDX=P("i32"), WPAGES=P("u8"),
                          EPAGES=P("u8"), SINK=F, O=P("bf16"), OP=F, MLP=F, qk_scale="fp32"),
                          dict(HB=sac["block_h"], BN=32, SPLIT=True, DT=tl.bfloat16, INTERP=False,
                               DP=sac["d_parts"], DHALF=sac["d_parts"] - 1, PREFETCH=False), 4, None),
        "hc_pre": (mhc._hc_fused, dict(X=P("bf16"), FN=F, PART=F, CNT=P("i32"), BASE=F, SCALE=F, Y=P("bf16"),
                   POST=F, COMB=F, inv_k="fp32", rms_eps="fp32", hc_eps="fp32"),
                   dict(NMIX=24, NP=32, SP=128, BT=1, BK=32, BD=256, HEAD=False), 4, None),
        "rms_norm": (nm._rms_norm_kernel, dict(X=P("bf16"), W=F, Y=P("bf16"), eps="fp32"),
                     dict(BD=1024, INTERP=False), 4, None),
        "fp8_gemm": (G._fp8_gemm_kernel, dict(A=P("u8"), SA=F, B=P("u8"), SB=F, C=P("bf16"), CS=F, limit="fp32"),
                     dict(SB_SHIFT=7, A_BF16=False, SB_E8M0=False, SWIGLU=False, BM=16, BN=32, GROUP_M=8,
                          SPLIT=False, SUM=False, INTERP=False), 4, 2),
        "fp4_gemm": (G._fp4_gemm_kernel, dict(A16=P("fp16"), SA=F, W=P("u8"), WS=P("u8"), WS2=F, C=P("bf16"),
                     CS=F, PERM=P("i64"), OFFS=P("i64"), TCUM=P("i64"), PW=F, limit="fp32"),
                     dict(FMT=0, GROUPED=True, GATHER=False, SWIGLU=False, HAS_PW=False, USE_ASM=True, BM=16,
                          BN=32, LOG2G=9, INTERP=False), 4, 2),
        "moe_route": (Mo._route_kernel, dict(LOGIT=F, BIAS=F, TID2EID=P("i32"), IDS=P("i64"), IDX=P("i64"), W=F,
                      EFLAT=P("i32"), X=P("bf16"), Q=P("u8"), SQ=F, route_scale="fp32"),
                      dict(KTOP=6, KP=8, EP=256, HASH=False, QUANT=True, QB=8, INTERP=False), 4, None),
        "compress_decode": (cp._comp_fused, dict(STATE=F, SLOTS=P("i64"), POS=P("i64"), KIN=F, SIN_=F, APE=F,
                            POOLED=F, NORMW=F, COS=F, COSIN_=F, OUT=P("bf16"), COMPLETE=P("i8"), PAGES=P("u8"),
                            PSLOTS=P("i64"), eps="fp32"),
                            dict(M=4, C=512, OVERLAP=True, HAS_APE=False, INDEXER=False, WRITE=True,
                                 STORE_POOLED=False, FAST=True), 4, None),
        "index_scores": (ix._index_scores_kernel, dict(Q=P("bf16"), W=P("bf16"), PAGES=P("u8"), BT=P("i32"),
                         POS=P("i64"), OUT=P("bf16")), dict(TPP=1, HP=64, INTERP=False), 4, None),
        "fp4_mma": (F4._mma_gemv_kernel, mmt, dict(NV=False, GROUPED=False, GATHER=False, BM=F4.BM_ROWS, BN=64,
                    LOG2G=9, SPLIT=False, NUM_WARPS=4, BAND=False, A16=False), 4, None),
        "fp8_mma": (F8._fp8_mma_kernel, dict(A=P("u8"), SA=F, W=P("u8"), WS=P("u8"), C=P("bf16"), PART=F,
                    CNT=P("i32")), dict(ACT=0, SB_E8M0=True, SB_ROW=False, BM=F8.BM_ROWS, BN=64, SPLIT=False,
                    REDUCE=False, NUM_WARPS=4, UNROLL=1), 4, None),
    }
    out = {}
    for name, (fn, types, const, warps, stages) in cases.items():
        t0 = time.time()
        try:
            aot_compile(fn, types, const, cap, warps, stages, div=DIV)
            res = "ok"
        except Exception as e:                      # noqa: BLE001 - the message is the measurement
            msgs = []
            while e is not None and len(msgs) < 8:  # a call inside the kernel nests the cause
                msgs.append(f"{type(e).__name__}: {e}")
                e = e.__cause__ or e.__context__
            res = "\n".join(reversed(msgs))
        out[name] = [res, round(time.time() - t0, 1)]
    print("RESULTS " + json.dumps(out))
""")


def _compile_for(cap: int) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    r = subprocess.run([sys.executable, "-c", _SCRIPT, str(REPO), str(cap)], capture_output=True, text=True,
                       env=env, timeout=600)
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULTS ")]
    assert r.returncode == 0 and line, r.stdout[-2000:] + r.stderr[-3000:]
    return {k: (v[0], v[1]) for k, v in json.loads(line[0][len("RESULTS "):]).items()}


@pytest.fixture(scope="module")
def matrix():
    """{cap: {kernel: (outcome, seconds)}}, the caps compiled side by side (a subprocess each)."""
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:  # pragma: no cover
        pytest.skip(f"this triton cannot compile ahead of time: {e}")
    with ThreadPoolExecutor(max_workers=max(1, min(len(CAPS), os.cpu_count() or 1))) as ex:
        res = dict(zip(CAPS, ex.map(_compile_for, CAPS)))
    for cap, per in res.items():
        for name, (outcome, _s) in per.items():
            if "ptxas" in outcome and ("not found" in outcome or "No such file" in outcome):  # pragma: no cover
                pytest.skip(f"no ptxas for offline compilation: {outcome[-300:]}")
    return res


def test_table_names_the_measured_kernels(matrix):
    assert set(matrix[CAPS[0]]) == set(targets.MIN_CAPABILITY)
    for name, cap in targets.MIN_CAPABILITY.items():
        assert targets.needs_fp8(name) == (cap >= targets.FP8_MIN_CAPABILITY)
        assert cap in (targets.BASE_MIN_CAPABILITY, targets.FP8_MIN_CAPABILITY)


@pytest.mark.parametrize("cap", CAPS)
def test_compile_matrix(matrix, cap):
    """Each kernel compiles for sm_{cap} where the table supports it; elsewhere the failure is FP8's."""
    wrong = []
    for name, (outcome, secs) in sorted(matrix[cap].items()):
        want_ok = targets.supported(name, (cap // 10, cap % 10))
        if want_ok and outcome != "ok":
            wrong.append(f"{name}: expected to compile for sm_{cap}, got {outcome[-600:]}")
        elif not want_ok and not (outcome != "ok" and FP8_ERROR.search(outcome)):
            wrong.append(f"{name}: expected the FP8 failure on sm_{cap}, got {outcome[-600:]}")
    assert not wrong, "\n".join(wrong)
