#!/usr/bin/env bash
# Resume the fair study (results/fair/PLAN.md) where its CSV says: every row comes from its commit, 0e23178.
#   bash results/fair/resume.sh            # from the repository root, with .venv installed; runs alone, for hours
exec bash "$(dirname "$0")/../study.sh" fair 0e23178 "$@"
