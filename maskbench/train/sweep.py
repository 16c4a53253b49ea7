"""`maskbench sweep`: a grid of runs, trained one after another here or printed as cluster launch lines.

`key=a,b,c` sweeps a key over values, parsed by Hydra's override parser (so `eval.points=[0.5,1.0]` is
one value, and quoting works as in Hydra).
Every combination is validated before the first run starts, so a typo in the last one cannot waste
the hours spent on the first.
"""

from __future__ import annotations

import itertools
import shlex

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from maskbench.config import ConfigError, RunConfig, load_config, run_id

LAUNCHERS = ("accelerate", "torchrun", "slurm")


def expand_grid(overrides: list[str]) -> list[list[str]]:
    """Cartesian product of every swept key (Hydra's own `key=a,b,c` syntax), in the order given."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as err:
        raise ConfigError(str(err).strip().splitlines()[0]) from None
    axes = [[f"{o.key_or_group}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override() else [o.input_line]
            for o in parsed]
    return [list(combo) for combo in itertools.product(*axes)]


def plan_sweep(overrides: list[str]) -> list[tuple[list[str], RunConfig]]:
    """(overrides, validated config) per run; raises ConfigError on the first bad combination."""
    return [(combo, load_config(combo)) for combo in expand_grid(overrides)]


def launch_lines(runs: list[tuple[list[str], RunConfig]], launcher: str, nproc: int) -> str:
    """One launch command per run, or a SLURM array script whose task i runs combination i."""
    args = [" ".join(shlex.quote(o) for o in combo) for combo, _ in runs]
    if launcher == "accelerate":
        return "\n".join(f"accelerate launch --num_processes {nproc} -m maskbench run {a}" for a in args)
    if launcher == "torchrun":
        return "\n".join(f"torchrun --nproc_per_node {nproc} -m maskbench run {a}" for a in args)
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=maskbench-sweep --array=0-{len(args) - 1}",
        f"#SBATCH --nodes=1 --ntasks-per-node=1 --gpus-per-node={nproc} --requeue",
        "# One array task per run. A requeued (preempted) task resumes from its last checkpoint,",
        "# because maskbench saves on SIGTERM and a rerun of the same overrides resumes.",
        "set -f  # overrides such as eval.points=[0.5,1.0] must not glob",
        "RUNS=(",
        *[f"  {shlex.quote(' '.join(combo))}  # {run_id(cfg)}" for combo, cfg in runs],
        ")",
        f'srun accelerate launch --num_processes {nproc} -m maskbench run ${{RUNS[$SLURM_ARRAY_TASK_ID]}}',
    ]
    return "\n".join(lines)
