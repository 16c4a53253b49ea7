#!/usr/bin/env bash
# Run or resume the literature re-run (results/literature/PLAN.md): every row comes from its commit, 9b54753.
#   bash results/literature/resume.sh      # from the repository root, with .venv installed; runs alone, for hours
exec bash "$(dirname "$0")/../study.sh" literature 9b54753 "$@"
