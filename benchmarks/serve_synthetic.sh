#!/usr/bin/env bash
# Serve a real-shaped synthetic V4-Flash checkpoint from disk and benchmark it online
# (`dsv4 bench serve` at concurrency 1, 16, 64). Usage: benchmarks/serve_synthetic.sh DIR LOGDIR [LAYERS]
# Needs fastapi, uvicorn, httpx; writes make.log, serve.log, bench_c<N>.log under LOGDIR.
set -u
DIR=$1; LOG=$2; LAYERS=${3:-8}; PORT=${PORT:-8011}
mkdir -p "$LOG"
t0=$(date +%s)
if [ ! -f "$DIR/config.json" ]; then
  python3 -m dsv4.cli make-synthetic "$DIR" --preset flash --layers "$LAYERS" > "$LOG/make.log" 2>&1 || { tail -20 "$LOG/make.log"; exit 1; }
fi
echo "make-synthetic: $(( $(date +%s) - t0 )) s; $(du -sh "$DIR" | cut -f1) on disk" | tee -a "$LOG/make.log"
python3 -m dsv4.cli serve "$DIR" --port "$PORT" --max-num-seqs 64 --max-num-batched-tokens 4096 \
  --max-model-len "${MAX_MODEL_LEN:-8192}" --disable-access-log --uvicorn-log-level warning > "$LOG/serve.log" 2>&1 &
srv=$!
t1=$(date +%s)
until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=5)" 2> /dev/null; do
  sleep 2
  if ! kill -0 $srv 2> /dev/null; then echo "server exited"; tail -30 "$LOG/serve.log"; exit 1; fi
  if [ $(( $(date +%s) - t1 )) -gt 400 ]; then echo "server not up in 400 s"; tail -30 "$LOG/serve.log"; kill $srv; exit 1; fi
done
echo "server up in $(( $(date +%s) - t1 )) s"; grep "dsv4:" "$LOG/serve.log"
nvidia-smi --query-gpu=memory.used,memory.total --format=csv | tee -a "$LOG/serve.log"
for spec in "1 8" "16 48" "64 128"; do
  set -- $spec
  python3 -m dsv4.cli bench serve --port "$PORT" --max-concurrency "$1" --num-prompts "$2" --random-input-len 512 \
    --random-output-len 64 --ignore-eos --disable-tqdm > "$LOG/bench_c$1.log" 2>&1
  echo "== concurrency $1 ($2 prompts)"; grep -iE "throughput|TTFT|ITL|TPOT|Successful|Benchmark duration" "$LOG/bench_c$1.log" | grep -iE "mean|median|throughput|Successful|duration"
done
kill $srv; wait $srv 2> /dev/null
echo "total $(( $(date +%s) - t0 )) s"
