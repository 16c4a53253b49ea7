# The device commands' machinery, sourced by benchmarks/gpu_check.sh and benchmarks/device/gpu_bench.sh from the
# repository root. The command sets NAME (its report's name) and STEPS (its steps, comma-separated), calls
# parse_args, sets each step's limit L_<STEP> for its mode, calls start, then runs `step NAME COMMAND...` for each.
#
# Three settings rehearse what the device may do to a command:
#   GPU_CHECK_LIMIT_S=N   every step's limit is N seconds (a step cut by its limit keeps the items it wrote)
#   GPU_CHECK_STEPS=a,b   only these steps run (a later step may need what an earlier one made); the report plans
#                         only these
#   GPU_CHECK_CUT_AFTER=N tests only: a streaming step's limit ends right after its N-th item (benchmarks/stream.py
#                         signals its `timeout`), so tests/test_gpu_check.py finds a cut at a known item on any
#                         machine, fast or slow
KILL_S=3
PY=${PYTHON:-python3}

parse_args() {  # --cpu, --out DIR, --plan
  mode=gpu out=${GPU_CHECK_OUT:-results} plan=0
  while [ $# -gt 0 ]; do
    case $1 in
      --cpu) mode=cpu ;;
      --out) out=$2; shift ;;
      --plan) plan=1 ;;
      *) echo "usage: bash $0 [--cpu] [--out DIR] [--plan]" >&2; exit 2 ;;
    esac
    shift
  done
}

selected() {  # is step $1 among those to run?
  [[ ",${GPU_CHECK_STEPS:-$STEPS}," == *",$1,"* ]]
}

limit_of() {  # step $1's limit in seconds: GPU_CHECK_LIMIT_S, else its L_<STEP>
  local var
  var="L_$(tr 'a-z' 'A-Z' <<< "$1")"
  echo "${GPU_CHECK_LIMIT_S:-${!var}}"
}

print_plan() {  # each step to run and its limit, then the longest the steps can take (every limit + its kill grace)
  local total=0 name limit
  for name in ${STEPS//,/ }; do
    selected "$name" || continue
    limit=$(limit_of "$name")
    total=$((total + limit + KILL_S))
    printf '%s\t%s\n' "$name" "$limit"
  done
  printf 'total\t%s\n' "$total"
}

start() {  # --plan: print it and stop; no GPU (without --cpu): one line and stop; else the work folder and traps
  if [ "$plan" = 1 ]; then
    print_plan
    exit 0
  fi
  if [ "$mode" = gpu ] && ! $PY -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    echo "$NAME: needs a CUDA GPU and this machine has none; nothing was run (--cpu runs a toy-size dry run)"
    exit 0
  fi
  work=${GPU_CHECK_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/$NAME.XXXXXX")}
  logs=$work/logs
  mkdir -p "$logs" "$out"
  : > "$logs/steps.tsv"
  failed=0
  trap finish EXIT
  trap 'exit 143' TERM INT  # a stop from outside still writes the report and the tar (the EXIT trap)
}

report() {  # the JSON report of what has run so far (rewritten after every step); --pack TAR also packs the tar
  $PY benchmarks/gpu_check_report.py "$work" --mode "$mode" --steps "${GPU_CHECK_STEPS:-$STEPS}" \
    --out "$out/$NAME.json" "$@" > "$logs/report.log" 2>&1 ||
    { echo "$NAME: the report failed:"; tail -3 "$logs/report.log"; }
}

finish() {
  report --pack "$out/$NAME.tar.gz"
  echo "$NAME: $([ $failed = 0 ] && echo all steps passed || echo some steps FAILED); report in $out/$NAME.json," \
    "logs and grids in $out/$NAME.tar.gz"
}

# step NAME COMMAND...: one step under `timeout -k` with its limit; its output in logs/NAME.log, its line in steps.tsv
step() {
  local name=$1 limit start rc
  shift
  selected "$name" || return 0
  limit=$(limit_of "$name")
  echo "== $name (at most ${limit}s): $*"
  start=$SECONDS
  timeout -k "$KILL_S" "$limit" "$@" > "$logs/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" "$limit" >> "$logs/steps.tsv"
  tail -2 "$logs/$name.log"
  if [ $rc -eq 0 ]; then echo "== $name: ok in $((SECONDS - start))s"; else echo "== $name: FAILED ($rc)"; failed=1; fi
  report
}
