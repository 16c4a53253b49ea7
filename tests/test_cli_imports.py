"""The instant commands (`--help`, `arms`, `leaderboard`, `sweep --emit`) answer without importing torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHILD = """
import contextlib, io, sys
from maskbench.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        code = main(sys.argv[1:])
    except SystemExit as stop:   # --help exits through argparse
        code = stop.code
print(code, "torch" in sys.modules, "timm" in sys.modules)
"""


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["arms"],
                                  ["leaderboard", "results/pre_crn/leaderboard.csv", "--format", "markdown"],
                                  ["sweep", "arm=mask0,mask75", "seed=0,1", "--emit", "slurm"]])
def test_instant_commands_do_not_import_torch(argv: list[str]) -> None:
    done = subprocess.run([sys.executable, "-c", CHILD, *argv], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["0", "False", "False"], done.stdout + done.stderr[-2000:]
