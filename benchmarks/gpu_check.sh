#!/usr/bin/env bash
# Every GPU benchmark of the repo, one after another, in under 8 minutes in all (each has its own
# time limit), on a machine with one CUDA device. CSVs and a log per benchmark land in results/.
# Exit status: 0 when every benchmark finished, 1 otherwise (the others still run).
#
#     bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p results
if ! python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  echo "gpu_check: no CUDA device"
  exit 1
fi

failed=0
# run LIMIT_S NAME COMMAND...: one benchmark under a time limit, its output also in results/NAME.log
run() {
  local limit=$1 name=$2
  shift 2
  echo "== $name (at most ${limit}s): $*"
  if timeout "$limit" "$@" 2>&1 | tee "results/$name.log"; then
    echo "== $name: ok"
  else
    echo "== $name: FAILED or timed out (see results/$name.log)"
    failed=1
  fi
}

run 150 kernels python benchmarks/kernels.py --out results/kernels.csv
run 300 step_time python benchmarks/step_time.py --device cuda
exit "$failed"
