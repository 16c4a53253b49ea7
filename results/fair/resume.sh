#!/usr/bin/env bash
# Resume the fair study (results/fair/PLAN.md) where its CSV says: every row comes from the study's commit.
#
#   bash results/fair/resume.sh            # from the repository root, with .venv installed; runs alone, for hours
#   kill -TERM <pid>                       # stops it cleanly at the end of a step (a checkpoint resumes it)
#
# The code is a worktree pinned at STUDY_COMMIT beside this checkout, so later commits on main never change a
# row; the rows are appended to this folder's leaderboard.csv (commit it as cells finish). A cell cut short in
# an earlier sitting whose run directory is gone restarts from its beginning: drop its rows first
# (`maskbench sweep study=fair ... --status` lists it as partial).
set -euo pipefail
STUDY_COMMIT=0e23178
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
TREE="${FAIR_STUDY_TREE:-$ROOT/../fair-study}"
if [ ! -d "$TREE" ]; then
  git -C "$ROOT" worktree add --detach "$TREE" "$STUDY_COMMIT"
fi
[ "$(git -C "$TREE" rev-parse --short=7 HEAD)" = "$STUDY_COMMIT" ] || { echo "$TREE is not at $STUDY_COMMIT" >&2; exit 2; }
. "$ROOT/.venv/bin/activate"
cd "$TREE"
exec env PYTHONPATH="$TREE" python -m maskbench sweep study=fair \
  paths.leaderboard="$ROOT/results/fair/leaderboard.csv" paths.data="$ROOT/data" paths.runs="$TREE/runs" "$@"
