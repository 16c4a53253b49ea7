#!/usr/bin/env bash
# The test suite's cost, test by test: README's test command with `--durations=0`, its table written to
# results/suite_durations.txt under a line saying when, at which commit, on how many CPUs and in what wall time.
# The quick subset (`-m "not slow"`) is read from that table: tests/conftest.py marks `slow` what took over 1 s.
#
#   bash benchmarks/suite_durations.sh        # from the repository root, with .venv active, alone on the machine
set -euo pipefail
cd "$(dirname "$0")/.."
out=results/suite_durations.txt
log=$(mktemp)
start=$SECONDS
if ! python -m pytest -q -n auto --durations=0 -p no:cacheprovider > "$log" 2>&1; then
  tail -30 "$log"
  echo "suite_durations: the suite failed; $out left as it was" >&2
  exit 1
fi
wall=$((SECONDS - start))
summary=$(tail -1 "$log" | tr -d '=' | xargs)
{
  echo "# python -m pytest -q -n auto --durations=0 at $(git rev-parse --short HEAD), $(date -u +%Y-%m-%dT%H:%MZ)," \
       "$(nproc) CPUs: $summary; $wall s wall"
  grep -E '^[0-9]+\.[0-9]+s (setup|call|teardown) ' "$log"
} > "$out"
echo "wrote $out ($(($(wc -l < "$out") - 1)) timings): $summary; $wall s wall"
