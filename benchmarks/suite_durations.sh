#!/usr/bin/env bash
# The test suite's cost, test by test: README's test command with `--durations=0`, RUNS times (default 3); the
# median run's table written to results/suite_durations.txt under a line saying when, at which commit, on how many
# CPUs, every run's time and the median, and each shared fixture's cost in that run; then the quick subset
# (`-m "not slow"`: tests/suite_costs.py says which tests that table makes `slow`), timed, on a second line.
# README's table of both (`tools/doctables.py`, "suite-time") reads the two lines.
#
#   bash benchmarks/suite_durations.sh            # from the repository root, with .venv active, alone on the machine
#   RUNS=1 bash benchmarks/suite_durations.sh     # one run of each
set -euo pipefail
cd "$(dirname "$0")/.."
out=results/suite_durations.txt
runs=${RUNS:-3}
work=$(mktemp -d)
header() {  # COMMAND SUMMARY [RUNS]: one '#' line
  echo "# $1 at $(git rev-parse --short HEAD), $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs: $2${3:+; $3}"
}
seconds() { grep -oE ' in [0-9.]+s' "$1" | tail -1 | grep -oE '[0-9.]+'; }  # pytest's own time of a run's log
timed_runs() {  # N ARGS...: N runs of pytest ARGS, logs $work/run-I.log; prints the median run's log path
  local n=$1
  shift
  for i in $(seq "$n"); do
    mkdir -p "$work/run-$i.fixtures"
    if ! MASKBENCH_FIXTURE_SECONDS="$work/run-$i.fixtures" python -m pytest -q -n auto -p no:cacheprovider "$@" \
        > "$work/run-$i.log" 2>&1; then
      tail -30 "$work/run-$i.log" >&2
      echo "suite_durations: a run failed; $out left as it was" >&2
      exit 1
    fi
    echo "suite_durations: run $i of $n: $(seconds "$work/run-$i.log") s" >&2
  done
  for i in $(seq "$n"); do echo "$(seconds "$work/run-$i.log") $work/run-$i.log"; done | sort -n | \
    sed -n "$(( (n + 1) / 2 ))p" | cut -d' ' -f2
}
every() {  # the seconds of every run, in order, and the median's
  local times
  times=$(for i in $(seq "$runs"); do printf '%s s, ' "$(seconds "$work/run-$i.log")"; done)
  echo "runs: ${times%, }; median $(seconds "$1") s"
}
median=$(timed_runs "$runs" --durations=0)
table=$(mktemp)
{
  header "python -m pytest -q -n auto --durations=0" "$(tail -1 "$median" | tr -d '=' | xargs)" "$(every "$median")"
  grep -E '^[0-9]+\.[0-9]+s (setup|call|teardown) ' "$median"
  # each shared fixture's cost in that run (tests/suite_costs.py): the most any test process spent making it
  cat "${median%.log}".fixtures/*.tsv | awk -F'\t' '$1 > most[$2] {most[$2] = $1} END {for (k in most)
    printf "%.2fs fixture  %s\n", most[k], k}' | sort -rn
} > "$table"
mv "$table" "$out"
python -m tools.doctables --write > /dev/null  # README's table of it: the quick subset checks it
echo "wrote $out ($(($(wc -l < "$out") - 1)) timings): $(every "$median")"
median=$(timed_runs "$runs" -m "not slow")
line=$(header 'python -m pytest -q -n auto -m "not slow"' "$(tail -1 "$median" | tr -d '=' | xargs)" "$(every "$median")")
sed -i "1a $(sed 's/[&/\]/\\&/g' <<< "$line")" "$out"
python -m tools.doctables --write > /dev/null
echo "the quick subset: $(every "$median")"
