#!/usr/bin/env bash
# Issue 32's run: TTFT of prompts sharing an 8k-token prefix, with and without prefix caching, at
# concurrency 1 and 16, on full-depth synthetic V4-Flash (weights generated on the GPU).
# Usage: benchmarks/prefix_cache.sh LOGDIR
# For each mode (caching on, --no-enable-prefix-caching) it starts `dsv4 serve`, runs
# `dsv4 bench serve --dataset-name prefix_repetition` (one prefix of PREFIX_LEN tokens, unique
# suffixes of SUFFIX_LEN tokens; the bench's test request computes the prefix first, so with
# caching every measured request can reuse it), stops the server, and prints a table.
# Environment (defaults = the H200 run): SERVE_ARGS ("--synthetic flash --layers 43 --experts 128";
# empty = the embedded tiny model), PREFIX_LEN 8192, SUFFIX_LEN 256, OUTPUT_LEN 16, CONCURRENCY
# ("1 16"), PROMPTS_PER_CONCURRENCY 4 (num-prompts = this x concurrency), MAX_NUM_SEQS 16,
# MAX_BATCHED 8192, MAX_MODEL_LEN 16384, PORT 8012. Needs fastapi, uvicorn, httpx.
# CPU smoke test (tiny model, small sizes):
#   SERVE_ARGS= PREFIX_LEN=300 SUFFIX_LEN=8 OUTPUT_LEN=2 CONCURRENCY="1 2" PROMPTS_PER_CONCURRENCY=2 \
#     MAX_MODEL_LEN=1024 MAX_BATCHED=512 benchmarks/prefix_cache.sh /tmp/pc
set -u
LOG=${1:?usage: benchmarks/prefix_cache.sh LOGDIR}
SERVE_ARGS=${SERVE_ARGS---synthetic flash --layers 43 --experts 128}
PREFIX_LEN=${PREFIX_LEN:-8192}; SUFFIX_LEN=${SUFFIX_LEN:-256}; OUTPUT_LEN=${OUTPUT_LEN:-16}
CONCURRENCY=${CONCURRENCY:-1 16}; PER=${PROMPTS_PER_CONCURRENCY:-4}
MAX_NUM_SEQS=${MAX_NUM_SEQS:-16}; MAX_BATCHED=${MAX_BATCHED:-8192}; MAX_MODEL_LEN=${MAX_MODEL_LEN:-16384}
PORT=${PORT:-8012}
mkdir -p "$LOG"
t0=$(date +%s)
for mode in on off; do
  flag=""; [ "$mode" = off ] && flag="--no-enable-prefix-caching"
  # shellcheck disable=SC2086
  python3 -m dsv4.cli serve $SERVE_ARGS $flag --port "$PORT" --max-num-seqs "$MAX_NUM_SEQS" \
    --max-num-batched-tokens "$MAX_BATCHED" --max-model-len "$MAX_MODEL_LEN" --disable-access-log \
    --uvicorn-log-level warning > "$LOG/serve_$mode.log" 2>&1 &
  srv=$!
  t1=$(date +%s)
  until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=5)" 2> /dev/null; do
    sleep 2
    if ! kill -0 $srv 2> /dev/null; then echo "server ($mode) exited"; tail -30 "$LOG/serve_$mode.log"; exit 1; fi
    if [ $(( $(date +%s) - t1 )) -gt 900 ]; then echo "server not up in 900 s"; tail -30 "$LOG/serve_$mode.log"; kill $srv; exit 1; fi
  done
  echo "server ($mode) up in $(( $(date +%s) - t1 )) s"; tr "\r" "\n" < "$LOG/serve_$mode.log" | grep "^dsv4:"
  command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader
  for c in $CONCURRENCY; do
    python3 -m dsv4.cli bench serve --port "$PORT" --dataset-name prefix_repetition \
      --prefix-repetition-prefix-len "$PREFIX_LEN" --prefix-repetition-suffix-len "$SUFFIX_LEN" \
      --prefix-repetition-num-prefixes 1 --prefix-repetition-output-len "$OUTPUT_LEN" --num-prompts $(( PER * c )) \
      --max-concurrency "$c" --ignore-eos --disable-tqdm --result-file "$LOG/pc_${mode}_c$c.json" \
      > "$LOG/bench_${mode}_c$c.log" 2>&1 || { echo "bench ($mode, c=$c) failed"; tail -20 "$LOG/bench_${mode}_c$c.log"; }
  done
  kill $srv; wait $srv 2> /dev/null
done
python3 - "$LOG" $CONCURRENCY << 'EOF'
import json, os, sys
log, cs = sys.argv[1], sys.argv[2:]
print(f"{'caching':8} {'conc':>4} {'reqs':>5} {'mean TTFT ms':>13} {'median':>9} {'p99':>9} {'cached/input tok':>18} {'out tok/s':>10}")
for mode in ("on", "off"):
    for c in cs:
        p = os.path.join(log, f"pc_{mode}_c{c}.json")
        if not os.path.exists(p):
            print(f"{mode:8} {c:>4} (no result)")
            continue
        r = json.load(open(p))
        print(f"{mode:8} {c:>4} {r['completed']:>5} {r['mean_ttft_ms']:>13.1f} {r['median_ttft_ms']:>9.1f} "
              f"{r['p99_ttft_ms']:>9.1f} {str(r['total_cached_tokens']) + '/' + str(r['total_input_tokens']):>18} "
              f"{r['output_throughput']:>10.1f}")
EOF
echo "total $(( $(date +%s) - t0 )) s"
