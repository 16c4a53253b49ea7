"""`maskbench sweep`: a grid of runs, trained one after another here or printed as cluster launch lines.

`key=a,b,c` sweeps a key over values, parsed by Hydra's override parser (so `eval.points=[0.5,1.0]` is
one value, and quoting works as in Hydra).
Every combination is validated before the first run starts, so a typo in the last one cannot waste
the hours spent on the first.

A cell (one combination) is done when the leaderboard CSV has its rows, same config hash, for every
eval point of its config: a sweep skips done cells, so a long grid can be run over several sittings
or machines and merged (`--status` says which cells are done, partial or missing, reading CSVs only).
A partial cell resumes from its run directory's checkpoint when trained again.

A named study is a YAML file, `maskbench/conf/study/NAME.yaml` or a path, holding a description and
the grid as a list of overrides; `study=NAME` expands it, and an override of the same key given
on the command line replaces the study's axis (`--list-studies` lists the shipped ones).
"""

from __future__ import annotations

import copy
import itertools
import math
import shlex
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException

from maskbench.config import CONF_DIR, RunConfig, config_hash, load_config, run_id
from maskbench.errors import ConfigError

STUDY_DIR = CONF_DIR / "study"
STATUSES = ("done", "partial", "missing")


def _parse(overrides: list[str]) -> list[Override]:
    try:
        return OverridesParser.create().parse_overrides(overrides)
    except HydraException as err:
        raise ConfigError(str(err).strip().splitlines()[0]) from None


def expand_grid(overrides: list[str]) -> list[list[str]]:
    """Cartesian product of every swept key (Hydra's own `key=a,b,c` syntax), in the order given."""
    axes = [[f"{o.key_or_group}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override() else [o.input_line]
            for o in _parse(overrides)]
    return [list(combo) for combo in itertools.product(*axes)]


# ------------------------------------------------------------------------------------------ studies
@dataclass(frozen=True)
class Study:
    """A named grid: what it is for, its overrides (each one axis, `key=a,b` or a fixed `key=v`), and the
    baseline it names (`baseline: ARM` in its file), whose runs a sweep extends into a ladder (`Ladder`)."""
    name: str
    description: str
    grid: tuple[str, ...]
    baseline: str | None = None


def known_studies() -> list[str]:
    return sorted(p.stem for p in STUDY_DIR.glob("*.yaml"))


def load_study(name: str) -> Study:
    """A shipped study by name, or a study file (a value ending in .yaml/.yml or holding a `/`)."""
    if name.endswith((".yaml", ".yml")) or "/" in name:
        path = Path(name)
        if not path.is_file():
            raise ConfigError(f"study file not found: {path}")
    elif name in known_studies():
        path = STUDY_DIR / f"{name}.yaml"
    else:
        raise ConfigError(f"unknown study {name!r}; shipped studies: {', '.join(known_studies()) or 'none'} "
                          "(or pass study=path/to/study.yaml)")
    try:
        loaded = yaml.safe_load(path.read_text())
    except (UnicodeDecodeError, yaml.YAMLError) as err:  # binary, or not YAML
        raise ConfigError(f"study file {path} is not valid YAML: {str(err).splitlines()[0]}") from None
    grid = loaded.get("grid") if isinstance(loaded, dict) else None
    if not isinstance(grid, list) or not grid or not all(isinstance(o, str) and "=" in o for o in grid):
        raise ConfigError(f"study file {path} needs `grid:`, a list of key=value overrides "
                          "(e.g. - arm=mask0,mask75)")
    if any(o.partition("=")[0] == "study" for o in grid):
        raise ConfigError(f"study file {path}: a study cannot name another study")
    _parse(grid)  # a bad axis is refused here, naming nothing yet
    baseline = loaded.get("baseline")
    if baseline is not None and not isinstance(baseline, str):
        raise ConfigError(f"study file {path}: baseline must be an arm's name, got {baseline!r}")
    return Study(path.stem, str(loaded.get("description", "")).strip(), tuple(grid), baseline)


def with_study(overrides: list[str]) -> tuple[Study | None, list[str]]:
    """Split `study=NAME` out of a sweep's overrides: (the study or None, the grid to expand).

    The grid is the study's axes in its order, each replaced by the command line's override of the
    same key if there is one, then the command line's other overrides.
    """
    named = [o for o in overrides if o.partition("=")[0] == "study"]
    rest = [o for o in overrides if o.partition("=")[0] != "study"]
    if not named:
        return None, overrides
    if len(named) > 1 or "," in named[0]:
        raise ConfigError("one study at a time: study=NAME (more axes are key=a,b overrides)")
    study = load_study(named[0].partition("=")[2])
    given = {o.key_or_group: line for o, line in zip(_parse(rest), rest)}
    own = [o.key_or_group for o in _parse(list(study.grid))]
    grid = [given.get(key, line) for key, line in zip(own, study.grid)]
    return study, grid + [line for key, line in given.items() if key not in own]


# ------------------------------------------------------------------------------------- the baseline's ladder
DEFAULT_REACH = 4.0  # a study that names its baseline runs it to 4·B unless `baseline.reach=` says otherwise


@dataclass(frozen=True)
class Ladder:
    """The baseline's runs extended past the arms' budget B to reach·B, on the same grid of horizons continued
    by doublings, so that every arm's value can be located on the baseline's *measured* curve of its seed (the
    measured compute multiplier, `results/multiplier.py`). A cooled horizon equals the standalone run of its
    budget, so the ladder's horizons up to B are the arms' horizons, draw for draw."""
    arm: str
    reach: float

    def overrides(self, cfg: RunConfig) -> list[str]:
        """What turns a baseline cell of budget B into its ladder: budget reach·B, and its eval points (fractions
        of that) the cell's own points divided by reach, then B·2, B·4, ... up to reach·B."""
        doublings = [2.0**j for j in range(1, int(math.log2(self.reach)) + 1) if 2.0**j < self.reach]
        points = [p / self.reach for p in cfg.eval.points] + [d / self.reach for d in doublings] + [1.0]
        return [f"budget.flops={cfg.budget.flops * self.reach:g}",
                "eval.points=[" + ",".join(f"{p:g}" for p in sorted(set(points))) + "]"]


def with_ladder(overrides: list[str], study: Study | None = None) -> tuple[Ladder | None, list[str]]:
    """Split `baseline=ARM` and `baseline.reach=K` out of a sweep's overrides: (the ladder or None, the rest). A
    study's named baseline gets DEFAULT_REACH unless `baseline.reach=` is given; reach 1 turns the ladder off."""
    keys = {o.partition("=")[0]: o.partition("=")[2] for o in overrides if o.partition("=")[0] in LADDER_KEYS}
    rest = [o for o in overrides if o.partition("=")[0] not in LADDER_KEYS]
    arm = keys.get("baseline") or (study.baseline if study else None)
    if "baseline.reach" in keys and arm is None:
        raise ConfigError("baseline.reach needs a baseline: baseline=ARM (or a study that names one)")
    if arm is None:
        return None, rest
    try:
        reach = float(keys.get("baseline.reach", DEFAULT_REACH))
    except ValueError:
        raise ConfigError(f"baseline.reach must be a number, got {keys['baseline.reach']!r}") from None
    if not reach >= 1:
        raise ConfigError(f"baseline.reach must be at least 1 (1: no ladder), got {reach:g}")
    return (Ladder(arm, reach) if reach > 1 else None), rest


LADDER_KEYS = ("baseline", "baseline.reach")


def ladder_summary(runs: list[tuple[list[str], RunConfig]], ladder: Ladder | None) -> str:
    """One line for a sweep's plan, --dry-run and --emit: what the ladder adds (its cells and extra FLOPs, the
    trunk's; cooled branches add their decay share on top, as for every cell)."""
    if ladder is None:
        return "baseline ladder: none (baseline=ARM baseline.reach=K runs the baseline to K·B)"
    extended = [cfg for _, cfg in runs if cfg.arm.name == ladder.arm]
    extra = sum(cfg.budget.flops * (1 - 1 / ladder.reach) for cfg in extended)
    without = sum(cfg.budget.flops for _, cfg in runs) - extra
    return (f"baseline ladder: {ladder.arm} to {ladder.reach:g}·B in {len(extended)} cell(s): +{extra:.3g} FLOPs of "
            f"trunk, {extra / without:+.0%} on the grid's {without:.3g} without it" if without else
            "baseline ladder: no cells")


def format_studies() -> str:
    """`maskbench sweep --list-studies`: each shipped study, its description and its grid."""
    lines = []
    for name in known_studies():
        study = load_study(name)
        lines.append(f"{name:18s} {study.description}")
        lines.append(f"{'':18s} {' '.join(study.grid)}")
    return "\n".join(lines) if lines else f"no studies in {STUDY_DIR}"


# --------------------------------------------------------------------------------------- done cells
@dataclass(frozen=True)
class GridCell:
    """One combination of a sweep, and how much of it the leaderboard CSVs already hold."""
    overrides: list[str]
    cfg: RunConfig
    status: str          # done (a row for every eval point), partial (some), missing (none)
    points_done: int
    started: bool        # its run directory exists (a partial cell resumes from its checkpoint)

    @property
    def command(self) -> str:
        return "maskbench run " + " ".join(shlex.quote(o) for o in self.overrides)


def _point_key(point: float) -> float:
    return round(float(point), 6)


def csv_paths(runs: list[tuple[list[str], RunConfig]], extra_csvs: Sequence[str] = ()) -> list[str]:
    """The leaderboard CSVs that say which cells are done: every cell's `paths.leaderboard` that exists,
    and extra_csvs (other machines' results), which must exist."""
    missing = [p for p in extra_csvs if not Path(p).is_file()]
    if missing:
        raise ConfigError(f"no such leaderboard CSV: {', '.join(missing)}")
    return sorted(p for p in {cfg.paths.leaderboard for _, cfg in runs} | set(extra_csvs) if Path(p).is_file())


def cell_states(runs: list[tuple[list[str], RunConfig]], rows: Iterable[Mapping]) -> list[GridCell]:
    """Each cell's status from leaderboard rows (those of `csv_paths`, read by the caller: the CSV
    schema lives a layer above): its rows are those with its config hash, one per eval point wanted."""
    evaluated: dict[str, set[float]] = {}
    for row in rows:
        if not row["source"] and row["config_hash"]:
            evaluated.setdefault(row["config_hash"], set()).add(_point_key(row["point"]))
    cells = []
    for overrides, cfg in runs:
        wanted = {_point_key(p) for p in cfg.eval.points}
        have = len(wanted & evaluated.get(config_hash(cfg), set()))
        status = "done" if have == len(wanted) else "partial" if have else "missing"
        started = (Path(cfg.paths.runs) / run_id(cfg)).is_dir()
        cells.append(GridCell(overrides, cfg, status, have, started))
    return cells


def format_status(cells: list[GridCell], csvs: Sequence[str]) -> str:
    """`maskbench sweep --status`: one line per cell (status, points in the CSV, run id, overrides), a count."""
    width = len(str(len(cells)))
    lines = []
    for i, cell in enumerate(cells, 1):
        points = f"{cell.points_done}/{len(cell.cfg.eval.points)} points"
        resumes = ("  (run directory exists: resumes from its checkpoint)"
                   if cell.started and cell.status != "done" else "")
        lines.append(f"[{i:>{width}}/{len(cells)}] {cell.status:7s} {points:11s} {run_id(cell.cfg)}  "
                     f"{' '.join(cell.overrides)}{resumes}")
    counts = Counter(cell.status for cell in cells)
    lines.append(", ".join(f"{counts[s]} {s}" for s in STATUSES) + f" of {len(cells)} cells "
                 f"(rows read from {', '.join(csvs) or 'no CSV: none exists yet'})")
    return "\n".join(lines)


def plan_sweep(overrides: list[str], ladder: Ladder | None = None) -> list[tuple[list[str], RunConfig]]:
    """(overrides, validated config) per run; raises ConfigError on the first bad combination. With a ladder,
    the baseline's cells run to its reach (`Ladder.overrides`), the other arms' to B.

    Composing a config takes about half a second, and a study's seed axis repeats every other cell: the
    run seed is a plain integer that no other setting is derived from, so cells that differ only in it
    are composed once and the others are copies with their seed set.
    """
    composed: dict[tuple[str, ...], RunConfig] = {}
    runs = []
    for combo in expand_grid(overrides):
        combo = _laddered(combo, ladder, composed)
        shape, seed = tuple(o for o in combo if o.partition("=")[0] != "seed"), _plain_seed(combo)
        if shape in composed and seed is not None:
            cfg = copy.deepcopy(composed[shape])
            cfg.seed = seed
        else:
            cfg = load_config(combo)
            composed.setdefault(shape, cfg)
        runs.append((combo, cfg))
    return runs


def _laddered(combo: list[str], ladder: Ladder | None, composed: dict[tuple[str, ...], RunConfig]) -> list[str]:
    """The combination, extended to the ladder's reach when it is the baseline's (its B and points composed)."""
    if ladder is None:
        return combo
    shape = tuple(o for o in combo if o.partition("=")[0] != "seed")
    cfg = composed.get(shape) or composed.setdefault(shape, load_config(combo))
    if cfg.arm.name != ladder.arm:
        return combo
    extended = ladder.overrides(cfg)
    replaced = {o.partition("=")[0] for o in extended}
    return [o for o in combo if o.partition("=")[0] not in replaced] + extended


def _plain_seed(combo: list[str]) -> int | None:
    """The cell's `seed=N` as an integer; None when it sets none or not a plain integer (composed in full)."""
    seeds = [o for o in _parse(combo) if o.key_or_group == "seed"]
    value = seeds[-1].value() if seeds else None
    return value if type(value) is int else None


# CPUs per GPU process for its loader workers: results/loader_workers.csv needs 1-3 per H100 unmasked and 11 for
# dit_b2 at 75% masking; 8 is a node's usual share (raise it with the script's header for small masked models).
CPUS_PER_GPU = 8
# An array task restarted this many times (SLURM_RESTART_COUNT: by its own requeues, preemptions and node failures
# together) is not requeued again: at --time=24:00:00, about 11 days of a cell's time limits.
MAX_RESTARTS = 10
# torchrun's agent (behind `accelerate launch` of several processes), on the time-limit SIGTERM, gives its ranks
# this long to save before it SIGKILLs them (its default is 30 s); under the 300 s the signal leaves.
SHUTDOWN_S = 240
SLURM_HEADER = """\
#!/bin/bash
#SBATCH --job-name=maskbench-sweep --array=0-{last}
#SBATCH --nodes=1 --ntasks-per-node=1 --gpus-per-node={nproc} --cpus-per-task={cpus}
#SBATCH --time=24:00:00 --signal=TERM@300 --requeue --open-mode=append --output=maskbench-%A_%a.out
# One array task per run; a rerun of the same overrides resumes from the run's last checkpoint. Set --time to your
# queue's limit. What happens when a task is stopped:
# - Time limit. 300 s before --time (Slurm may send it up to 60 s earlier) every process of the run, not this
#   script, gets SIGTERM: each saves a checkpoint at the end of its step and the run exits 130 (143 through
#   accelerate's launcher of several processes, which got the signal too). This script then requeues its own task
#   (scontrol requeue), which resumes from that checkpoint, unless it was restarted {max_restarts} times already.
#   A finished run (exit 0) and a failed one (any other code) are not requeued.
# - Preemption. The partition's PreemptMode decides: REQUEUE sends SIGTERM to the run and to this script, which
#   then ends without requeueing, and Slurm requeues the task itself (--requeue), which resumes from the last
#   checkpoint the run wrote (it saves on that SIGTERM if the grace time lets it); CANCEL ends the task: rerun the
#   sweep's --emit, which leaves done cells out, and the partial cells resume.
# - Node failure. Slurm requeues the task (--requeue) with no signal: it resumes from its last checkpoint (each
#   eval point and every train.checkpoint_minutes).
# --cpus-per-task feeds the loader workers (sized from the CPUs a task sees: with one CPU there would be none).
set -f  # overrides such as eval.points=[0.5,1.0] must not glob
MAX_RESTARTS={max_restarts}
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={shutdown_s}  # torchrun's wait for its ranks to save (its default: 30 s)
trap 'echo "maskbench: SIGTERM to the job script (preemption or scancel): not requeued here"; exit 143' TERM
"""
SLURM_FOOTER = """\
status=$?
restarts=${SLURM_RESTART_COUNT:-0}
if [ "$status" != 130 ] && [ "$status" != 143 ]; then
  echo "maskbench: exit $status: $([ "$status" = 0 ] && echo finished || echo failed), not requeued"
elif [ "$restarts" -ge "$MAX_RESTARTS" ]; then
  echo "maskbench: stopped by the time-limit signal after $restarts restarts: not requeued (at most $MAX_RESTARTS)"
else
  echo "maskbench: stopped by the time-limit signal (exit $status); requeueing, restart $((restarts + 1))"
  scontrol requeue "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"
fi
exit "$status"
"""


def slurm_script(runs: list[tuple[list[str], RunConfig]], nproc: int) -> str:
    """A SLURM array script whose task i trains combination i and requeues itself when the time limit stopped it.

    One process runs without a launcher: accelerate's single-process launcher, signalled with it, would kill the
    run 5 s later, before a large checkpoint is written; several go through `accelerate launch` (torchrun).
    """
    launcher = "python" if nproc == 1 else f"accelerate launch --num_processes {nproc}"
    return "\n".join([
        SLURM_HEADER.format(last=len(runs) - 1, nproc=nproc, cpus=CPUS_PER_GPU * nproc, max_restarts=MAX_RESTARTS,
                            shutdown_s=SHUTDOWN_S) + "RUNS=(",
        *[f"  {shlex.quote(' '.join(combo))}  # {run_id(cfg)}" for combo, cfg in runs],
        ")",
        f"srun {launcher} -m maskbench run ${{RUNS[$SLURM_ARRAY_TASK_ID]}}",
        SLURM_FOOTER.rstrip("\n"),
    ])


def launch_lines(runs: list[tuple[list[str], RunConfig]], launcher: str, nproc: int) -> str:
    """One launch command per run, or a SLURM array script whose task i runs combination i."""
    args = [" ".join(shlex.quote(o) for o in combo) for combo, _ in runs]
    if launcher == "accelerate":
        return "\n".join(f"accelerate launch --num_processes {nproc} -m maskbench run {a}" for a in args)
    if launcher == "torchrun":
        return "\n".join(f"torchrun --nproc_per_node {nproc} -m maskbench run {a}" for a in args)
    return slurm_script(runs, nproc)
