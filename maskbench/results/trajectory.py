"""A run's early training trajectory in a few numbers, read from its folder: the backbone's feature-norm spike,
how long it lasts, the objective and the gradient norm through it.

Why: in the literature re-run every arm's block outputs spike early while the loss is still high, and
`maskdit50`'s spike lasts hundreds of steps longer (docs/studies.md). A reading that says so must come
from a committed CSV and a command that rebuilds it from the run folders, so these are those numbers. They are
exploratory diagnostics, not a plan's metrics: the objective is each arm's own training loss (REPA's includes its
negative alignment term, MaskDiT's its reconstruction term), so it is comparable across seeds of one arm only.

    python -m maskbench.results.trajectory ../literature-study/runs --out results/literature/trajectories.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import yaml

STEPS = (100, 300, 500)   # where the spike is read (Trajectory's fields name them): after most arms' has settled
WINDOW = 25               # steps in the objective's running mean (one step's loss is one batch: noisy)


@dataclass(frozen=True)
class Trajectory:
    """One run's trunk (metrics.jsonl), block norms being the largest block's mean token norm in a step."""
    arm: str
    seed: int
    run: str
    steps: int
    peak_block_norm: float
    peak_step: int
    block_norm_100: float | None
    block_norm_300: float | None
    block_norm_500: float | None
    objective_100: float | None        # mean of the WINDOW steps ending there
    objective_300: float | None
    objective_500: float | None
    grad_norm_median_100_500: float | None


def _at(values: Sequence[float], step: int) -> float | None:
    return values[step] if step < len(values) else None


def _mean_ending(values: Sequence[float], step: int) -> float | None:
    return statistics.fmean(values[step - WINDOW + 1:step + 1]) if step < len(values) else None


def read_trajectory(run: Path) -> Trajectory:
    """The numbers of one run folder (a finished or a checkpointed one: its steps so far)."""
    config = yaml.safe_load((run / "config.yaml").read_text())
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not lines or not lines[0].get("block_norm"):
        raise ValueError(f"{run}: metrics.jsonl has no block norms (a run from before train/diagnostics.py?)")
    norms = [max(line["block_norm"].values()) for line in lines]    # [steps]
    objective = [line["loss"] for line in lines]
    peak = max(range(len(norms)), key=norms.__getitem__)
    grad = [line["grad_norm"] for line in lines[STEPS[0]:STEPS[-1] + 1]]
    return Trajectory(
        arm=config["arm"]["name"], seed=int(config["seed"]), run=run.name, steps=len(lines),
        peak_block_norm=norms[peak], peak_step=peak,
        **{f"block_norm_{step}": _at(norms, step) for step in STEPS},
        **{f"objective_{step}": _mean_ending(objective, step) for step in STEPS},
        grad_norm_median_100_500=statistics.median(grad) if grad else None)


def run_folders(roots: Sequence[Path]) -> list[Path]:
    """Every run folder (one holding metrics.jsonl and config.yaml) under `roots`, or a root that is one."""
    found = {path.parent for root in roots for path in [root / "metrics.jsonl", *root.glob("*/metrics.jsonl")]
             if path.exists() and (path.parent / "config.yaml").exists()}
    return sorted(found)


def _cell(value: float | int | str | None) -> str:
    if value is None:
        return ""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def write_csv(trajectories: Sequence[Trajectory], out) -> None:
    """One row per run, ordered by arm then seed."""
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([field.name for field in fields(Trajectory)])
    for trajectory in sorted(trajectories, key=lambda t: (t.arm, t.seed)):
        writer.writerow([_cell(value) for value in asdict(trajectory).values()])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m maskbench.results.trajectory",
        description="Summarise the early training trajectory (block-norm spike, objective, grad norm) of every run "
                    "folder under RUNS as one CSV row per run. Exploratory diagnostics, not a plan's metrics.")
    parser.add_argument("runs", nargs="+", type=Path, help="run folders, or folders holding them (a study's runs/)")
    parser.add_argument("--out", type=Path, help="CSV to write (default: standard output)")
    args = parser.parse_args(argv)
    folders = run_folders(args.runs)
    if not folders:
        print(f"no run folders (metrics.jsonl beside config.yaml) under {', '.join(map(str, args.runs))}",
              file=sys.stderr)
        return 2
    try:
        trajectories = [read_trajectory(folder) for folder in folders]
    except (ValueError, KeyError, OSError) as error:
        print(f"cannot read a run: {error}", file=sys.stderr)
        return 2
    if args.out is None:
        write_csv(trajectories, sys.stdout)
    else:
        with args.out.open("w", newline="") as out:
            write_csv(trajectories, out)
        print(f"{len(trajectories)} runs → {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
