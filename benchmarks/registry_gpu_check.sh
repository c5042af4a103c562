#!/usr/bin/env bash
# Issue 29's GPU acceptance in one run (one H200, ~10 minutes): the op registry's self-check table,
# the start-up check's time at V4-Flash shapes, a corrupted kernel falling back (serve and validate),
# the decode-step no-regression check and the GPU tests; the full AOT sweep on the host's CPUs beside.
# Usage: benchmarks/registry_gpu_check.sh  (logs under $OUT, or a fresh temporary directory)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
PY=${PYTHON:-python3}
S="$OUT/summary.txt"
say() { echo "== $*" | tee -a "$S"; }
step() {   # step NAME TIMEOUT_S CMD...: run, log to $OUT/NAME.log, record exit code and seconds
  local name=$1 lim=$2; shift 2
  local t0=$(date +%s)
  timeout "$lim" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  say "$name: exit $rc in $(( $(date +%s) - t0 )) s: $*"
  return $rc
}

say "registry GPU check $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null); logs in $OUT"
nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv,noheader | tee -a "$S"

# the full AOT sweep (every router configuration, sm_80 .. sm_120) needs no GPU: on the CPUs, beside
DSV4_AOT_FULL=1 TRITON_INTERPRET=0 nice -n 10 timeout 1500 $PY -m pytest -q -p no:cacheprovider tests/test_targets.py \
  > "$OUT/aot_full.log" 2>&1 &
aot=$!

# 1. dsv4 check: the table and the JSON (V4-Flash shapes, fast mode)
step check 300 $PY -m dsv4.cli check
tail -25 "$OUT/check.log" | tee -a "$S"
step check_json 200 $PY -m dsv4.cli check --json
cp "$OUT/check_json.log" "$OUT/check.json"

# 2. the start-up self-check at V4-Flash shapes (fast, the default): its time in the start-up log;
#    generate builds the same engine as serve and exits
step generate_fast 400 $PY -m dsv4.cli generate --synthetic flash --layers 4 --max-tokens 4 "The capital of France is"
grep -E "kernel check|loaded" "$OUT/generate_fast.log" | tee -a "$S"

# 3. dsv4 serve with a corrupted sparse_decode kernel: the start-up log names the fallback
PORT=${PORT:-8017}
DSV4_FAULT=sparse_decode:garbage $PY -m dsv4.cli serve --synthetic flash --layers 4 --port "$PORT" \
  --disable-access-log --uvicorn-log-level warning > "$OUT/serve_fault.log" 2>&1 &
srv=$!
t1=$(date +%s)
until $PY -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=5)" 2> /dev/null; do
  sleep 3
  if ! kill -0 $srv 2> /dev/null || [ $(( $(date +%s) - t1 )) -gt 400 ]; then break; fi
done
kill $srv 2> /dev/null; wait $srv 2> /dev/null
say "serve with DSV4_FAULT=sparse_decode:garbage, up after $(( $(date +%s) - t1 )) s:"
grep -E "kernel check|loaded|serving" "$OUT/serve_fault.log" | tee -a "$S"

# 4. validate with the fault: the production model (sparse_decode on its twin) against the reference
DSV4_FAULT=sparse_decode:garbage step validate_fault 600 $PY -m dsv4.cli validate --synthetic flash --layers 4
grep -E "kernel check|RESULT" "$OUT/validate_fault.log" | tee -a "$S"

# 5. no regression of the decode step (BENCHMARKS.md 2026-12-03: 1,070.6 / 5,181.1 us at batch 1 / 64)
step decode_step 600 $PY benchmarks/decode_step.py --model flash --layers 4 --batch 1,64 --ctx 8192
grep -E "full step|^\| (1|64) " "$OUT/decode_step.log" | tee -a "$S"

# 6. the GPU tests (the whole gpu-marked suite)
step gpu_tests 900 $PY -m pytest -q -p no:cacheprovider -m gpu tests
tail -5 "$OUT/gpu_tests.log" | tee -a "$S"

# 7. dsv4 check --mode full: every router branch of every op (prefill sizes, batched decode)
step check_full 400 $PY -m dsv4.cli check --mode full
tail -3 "$OUT/check_full.log" | tee -a "$S"

wait $aot
say "AOT full sweep (DSV4_AOT_FULL=1 tests/test_targets.py): $(tail -1 "$OUT/aot_full.log")"
echo "summary: $S"
