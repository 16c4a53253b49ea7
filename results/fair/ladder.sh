#!/usr/bin/env bash
# Run or resume the fair study's baseline ladder (results/fair/PLAN.md, "Amendment: the baseline's ladder"):
# mask0 to 4 B, seeds 0-4, every row from the amendment's commit, 8a52ef0, appended to results/fair/ladder.csv.
#   bash results/fair/ladder.sh            # from the repository root, with .venv installed; runs alone, for hours
exec env STUDY_CSV="$(cd "$(dirname "$0")" && pwd)/ladder.csv" bash "$(dirname "$0")/../study.sh" fair_ladder 8a52ef0 "$@"
