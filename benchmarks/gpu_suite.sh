#!/usr/bin/env bash
# The GPU tests (`python -m pytest -m gpu`) in K of N shards, for device calls shorter than the whole suite (on one
# H100 the first 139 of 184 tests took ~530 s with a cold Triton cache). Each test's outcome prints as it finishes
# (-v), so a call cut at its time limit still says which tests passed and which failed.
#   bash benchmarks/gpu_suite.sh 1 3; bash benchmarks/gpu_suite.sh 2 3; bash benchmarks/gpu_suite.sh 3 3
set -euo pipefail
cd "$(dirname "$0")/.."
k=${1:?shard number (1-based)} n=${2:?number of shards}
mapfile -t ids < <(python3 -m pytest -m gpu --collect-only -q -p no:cacheprovider tests/ 2>/dev/null | grep "::")
total=${#ids[@]}
lo=$(( (k - 1) * total / n )) hi=$(( k * total / n ))
echo "gpu tests $((lo + 1))-$hi of $total"
exec python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short -rfE "${ids[@]:lo:hi-lo}"
