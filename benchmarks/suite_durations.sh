#!/usr/bin/env bash
# The test suite's cost, test by test: README's test command with `--durations=0`, its table written to
# results/suite_durations.txt under a line saying when, at which commit, on how many CPUs and in what wall time;
# then the quick subset (`-m "not slow"`: tests/conftest.py marks `slow` what took over QUICK_S in that table),
# timed, on a second line. README's table of both (`maskbench.results.doctables`, "suite-time") reads the lines.
#
#   bash benchmarks/suite_durations.sh        # from the repository root, with .venv active, alone on the machine
set -euo pipefail
cd "$(dirname "$0")/.."
out=results/suite_durations.txt
log=$(mktemp)
header() {  # COMMAND SUMMARY WALL: one '#' line
  echo "# $1 at $(git rev-parse --short HEAD), $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs: $2; $3 s wall"
}
start=$SECONDS
if ! python -m pytest -q -n auto --durations=0 -p no:cacheprovider > "$log" 2>&1; then
  tail -30 "$log"
  echo "suite_durations: the suite failed; $out left as it was" >&2
  exit 1
fi
wall=$((SECONDS - start))
summary=$(tail -1 "$log" | tr -d '=' | xargs)
table=$(mktemp)
{
  header "python -m pytest -q -n auto --durations=0" "$summary" "$wall"
  grep -E '^[0-9]+\.[0-9]+s (setup|call|teardown) ' "$log"
} > "$table"
mv "$table" "$out"
echo "wrote $out ($(($(wc -l < "$out") - 1)) timings): $summary; $wall s wall"
start=$SECONDS
python -m pytest -q -n auto -m "not slow" -p no:cacheprovider > "$log" 2>&1 || { tail -30 "$log"; exit 1; }
wall=$((SECONDS - start))
summary=$(tail -1 "$log" | tr -d '=' | xargs)
sed -i "1a $(header 'python -m pytest -q -n auto -m "not slow"' "$summary" "$wall" | sed 's/[&/\]/\\&/g')" "$out"
echo "the quick subset: $summary; $wall s wall"
