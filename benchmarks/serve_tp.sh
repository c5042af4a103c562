#!/usr/bin/env bash
# Issue 23's run on a multi-GPU machine: full-depth synthetic V4-Flash (weights generated on the
# GPUs, no disk) served with tensor / expert parallelism, checked through the OpenAI client, then
# `dsv4 bench serve` at concurrency 1, 8, 32, 64 for 1024/256 and 8192/1024, then the decode step
# under torchrun with its NCCL share. Usage: benchmarks/serve_tp.sh TP LOGDIR [LAYERS]
# (LAYERS default 43, the full depth). Needs fastapi, uvicorn, httpx, openai; logs under LOGDIR.
set -u
TP=$1; LOG=$2; LAYERS=${3:-43}; PORT=${PORT:-8011}
mkdir -p "$LOG"
t0=$(date +%s)
python3 -m dsv4.cli serve --synthetic flash --layers "$LAYERS" --tensor-parallel-size "$TP" --port "$PORT" \
  --max-num-seqs 64 --max-num-batched-tokens 8192 --max-model-len "${MAX_MODEL_LEN:-10240}" \
  --disable-access-log --uvicorn-log-level warning > "$LOG/serve.log" 2>&1 &
srv=$!
until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=5)" 2> /dev/null; do
  sleep 2
  if ! kill -0 $srv 2> /dev/null; then echo "server exited"; tail -30 "$LOG/serve.log"; exit 1; fi
  if [ $(( $(date +%s) - t0 )) -gt 500 ]; then echo "server not up in 500 s"; tail -30 "$LOG/serve.log"; kill $srv; exit 1; fi
done
echo "server up in $(( $(date +%s) - t0 )) s"; grep "dsv4:" "$LOG/serve.log"
nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv | tee -a "$LOG/serve.log"
python3 - "$PORT" <<'PY' | tee "$LOG/openai.log"
import math, sys
from openai import OpenAI
c = OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="EMPTY")
m = c.models.list().data[0].id
r = c.completions.create(model=m, prompt="The capital of France is", max_tokens=16, temperature=0, logprobs=1)
lp = r.choices[0].logprobs.token_logprobs
print("openai:", repr(r.choices[0].text), "tokens", len(lp), "finite", all(math.isfinite(x) for x in lp))
assert r.choices[0].text and all(math.isfinite(x) for x in lp), "empty or non-finite output"
PY
for io in "1024 256" "8192 1024"; do
  set -- $io
  for c in 1 8 32 64; do
    n=$(( c < 8 ? 8 : 2 * c ))
    python3 -m dsv4.cli bench serve --port "$PORT" --max-concurrency "$c" --num-prompts "$n" --random-input-len "$1" \
      --random-output-len "$2" --ignore-eos --disable-tqdm --save-result --result-dir "$LOG" \
      --result-file "bench_${1}_${2}_c$c.json" > "$LOG/bench_${1}_${2}_c$c.log" 2>&1
    echo "== in $1 out $2 concurrency $c ($n prompts)"
    grep -iE "Output token throughput|Median TTFT|P99 TTFT|Median ITL|P99 ITL" "$LOG/bench_${1}_${2}_c$c.log"
  done
done
kill $srv; wait $srv 2> /dev/null
PYTHONPATH=${PYTHONPATH:-}:. torchrun --nproc-per-node "$TP" benchmarks/decode_step.py --model flash --layers 4 \
  --batch 1,64 --ctx 8192 --profile-step > "$LOG/decode_step.log" 2>&1
grep -E "full step|NCCL" "$LOG/decode_step.log"
echo "total $(( $(date +%s) - t0 )) s"
