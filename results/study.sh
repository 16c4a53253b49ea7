#!/usr/bin/env bash
# Run or resume a pinned study: every row comes from the study's commit (its PLAN.md says which).
#
#   bash results/study.sh STUDY COMMIT [key=value ...]   # from the repository root, with .venv installed
#   kill -TERM <pid>                                     # stops at the end of a step (a checkpoint resumes it)
#
# The code is a worktree pinned at COMMIT beside this checkout (../STUDY-study), so later commits on main never
# change a row; `maskbench sweep study=STUDY` runs there and appends to results/STUDY/leaderboard.csv, or to
# $STUDY_CSV where a study's rows live in another study's folder (commit them as cells finish). A cell cut
# short in an earlier sitting whose run directory is gone restarts from its beginning: drop its rows first
# (`... --status` lists it as partial).
set -euo pipefail
STUDY="$1" COMMIT="$2"
shift 2
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
TREE="${STUDY_TREE:-$ROOT/../$STUDY-study}"
if [ ! -d "$TREE" ]; then
  git -C "$ROOT" worktree add --detach "$TREE" "$COMMIT"
fi
[ "$(git -C "$TREE" rev-parse --short=7 HEAD)" = "$COMMIT" ] || { echo "$TREE is not at $COMMIT" >&2; exit 2; }
. "$ROOT/.venv/bin/activate"
cd "$TREE"
exec env PYTHONPATH="$TREE" python -m maskbench sweep "study=$STUDY" \
  paths.leaderboard="${STUDY_CSV:-$ROOT/results/$STUDY/leaderboard.csv}" paths.data="$ROOT/data" paths.runs="$TREE/runs" "$@"
