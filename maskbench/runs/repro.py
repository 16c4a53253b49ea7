"""`maskbench repro RUN_DIR`: can this run's numbers be trusted to come from its recorded config?

Four checks, each compared against something the run itself saved, never against a second opinion:
  rerun        retrain the recorded config from scratch (same seed, in a temporary runs dir) up to the
               first eval-point checkpoint; the loss trace must equal metrics.jsonl and the raw and EMA
               weights must equal that checkpoint's.
  resume       the same rerun stopped half way (`train.stop_at_step`, as a preemption would) and resumed
               must equal the uninterrupted rerun: loss trace and weights.
  metrics      recompute every evaluated point from its saved sample PNGs and its EMA weights; the image
               metrics and val loss must equal eval.jsonl and the run's leaderboard rows.
  environment  env.json against this machine: a different torch/numpy, device, device count or git sha
               means the bit-exact comparisons above are not expected to hold, so it is a FAIL too.

Comparisons are bit-exact on CPU, where training is deterministic; on GPU (bf16, non-deterministic
kernels) they use a relative tolerance, stated in the output. Stopping at the first eval point keeps
the cost proportional to it: two retrainings up to that point (e.g. 2 × 25% of a run, each ending
with that point's evaluation), then the metrics of every point from the saved samples (no sampling).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import signal
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from maskbench.config import ConfigError, RunConfig, UserError, load_run_config, run_id
from maskbench.data.dataset import DatasetInfo, resolve_dataset
from maskbench.eval.evaluate import Evaluator, check_eval_inputs, load_samples, validation_loss
from maskbench.runs.reevaluate import load_point
from maskbench.models.build import build_model
from maskbench.results.leaderboard import read_rows
from maskbench.train.checkpoint import RunDir, environment
from maskbench.runs.launch import train
from maskbench.train.loop import make_accelerator

GPU_TOLERANCE = 1e-3     # relative, on losses and weights, when reruns happen on a GPU
METRIC_TOLERANCE = 1e-6  # relative, image metrics recomputed from the very same PNGs
METRICS = ("val_loss", "fid", "fd_dinov2", "align_acc", "clip_score", "clip_cos")
# Fields of env.json whose change makes a rerun differ in its bits; the others are only reported.
BLOCKING_ENV = ("torch", "numpy", "device", "n_devices", "git_sha")


@dataclass
class CheckResult:
    name: str
    ok: bool
    detail: str


@dataclass
class Target:
    """What the reruns reproduce: `steps` training steps, and the first eval point's checkpoint."""
    point: float
    point_step: int
    steps: int

    @property
    def at_point(self) -> bool:
        return self.steps == self.point_step


# ------------------------------------------------------------------------------------- comparisons
def close(got: float, want: float, tolerance: float) -> bool:
    """Relative closeness; tolerance 0 means equal bits (and a skipped step's NaN equals NaN)."""
    return (math.isnan(got) and math.isnan(want)) or math.isclose(got, want, rel_tol=tolerance, abs_tol=0.0)


def read_losses(run: RunDir, steps: int) -> list[float]:
    """The loss of each of the first `steps` steps, from metrics.jsonl."""
    lines = run.metrics.read_text().splitlines()[:steps] if run.metrics.exists() else []
    return [json.loads(line)["loss"] for line in lines]


def trace_mismatch(got: list[float], want: list[float], tolerance: float) -> str | None:
    """None if the two loss traces agree step by step; else the first step that differs."""
    if len(got) != len(want):
        return f"loss trace has {len(got)} steps, expected {len(want)}"
    for step, (a, b) in enumerate(zip(got, want)):
        if not close(a, b, tolerance):
            return f"loss at step {step} is {a!r}, expected {b!r}"
    return None


def checkpoint_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """The raw and EMA weights of a checkpoint: what a rerun must reproduce."""
    ema = RunDir.ema_weights(ckpt)
    return {**RunDir.raw_weights(ckpt), **{f"ema.{name}": value for name, value in ema.items()}}


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over names and raw bytes, in name order: one short string that pins the weights."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def relative_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got − want| / max |want| (inf if the shapes differ): 0 exactly when the values are equal."""
    if got.shape != want.shape:
        return math.inf
    got, want = got.double(), want.double()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30)) if want.numel() else 0.0


def weights_mismatch(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tolerance: float) -> str | None:
    """None if every tensor agrees within the relative tolerance; else the worst tensor, named."""
    if got.keys() != want.keys():
        return f"different tensors: {sorted(got.keys() ^ want.keys())[:3]}"
    name, worst = max(((name, relative_diff(got[name], want[name])) for name in want), key=lambda item: item[1])
    return None if worst <= tolerance else f"weights differ: {name} by {worst:.3g} (relative)"


def describe(tolerance: float) -> str:
    return "bit-exact" if tolerance == 0 else f"relative tolerance {tolerance:g}"


# ------------------------------------------------------------------------------------------ inputs
def first_point(run: RunDir) -> tuple[float, int]:
    """(point, step) of the run's first eval-point checkpoint; ConfigError if it has none yet."""
    points = [(step, path) for step, path in run.list_checkpoints() if path.name.startswith("point-")]
    if not points:
        raise ConfigError(f"{run.root} has no eval-point checkpoint yet; train past its first eval point first")
    step, path = points[0]
    return float(path.name.removeprefix("point-")), step


def plan_target(run: RunDir, steps: int | None) -> Target:
    """Validate --steps against what the run saved: 2 <= steps <= the first eval point's step."""
    point, point_step = first_point(run)
    steps = point_step if steps is None else steps
    if not 2 <= steps <= point_step:
        raise ConfigError(f"--steps must be between 2 and {point_step} (the step of the first eval point "
                          f"{point:g}), got {steps}")
    if len(read_losses(run, steps)) < steps:
        raise ConfigError(f"{run.metrics} has fewer than {steps} steps")
    return Target(point, point_step, steps)


# ----------------------------------------------------------------------------------------- reruns
def retrain(cfg: RunConfig, root: Path, stop_at: int) -> RunDir:
    """Train the recorded config from scratch under `root` and stop after `stop_at` steps.

    paths.runs and paths.leaderboard point into `root`, so nothing of the user's is touched; the same
    root twice resumes (that is check (b)). The trainer turns Ctrl-C into "save and stop": repro
    restores the previous handlers and turns an early stop back into an interrupt.
    """
    paths = replace(cfg.paths, runs=str(root / "runs"), leaderboard=str(root / "leaderboard.csv"))
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        run = RunDir(train(replace(cfg, paths=paths, train=replace(cfg.train, stop_at_step=stop_at))))
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if run.list_checkpoints()[-1][0] != stop_at:
        raise KeyboardInterrupt(f"rerun interrupted before step {stop_at}")
    return run


def check_rerun(run: RunDir, rerun: RunDir, target: Target, tolerance: float) -> CheckResult:
    """(a) The rerun's losses match metrics.jsonl; at the eval point, its weights match the checkpoint's."""
    problem = trace_mismatch(read_losses(rerun, target.steps), read_losses(run, target.steps), tolerance)
    if not target.at_point:
        weights = f"weights not compared (the run saved none at step {target.steps})"
    elif problem is None:
        got = checkpoint_tensors(rerun.point_checkpoint(target.point))
        problem = weights_mismatch(got, checkpoint_tensors(run.point_checkpoint(target.point)), tolerance)
        weights = f"weights at point {target.point:g} match (sha256 {digest(got)[:12]})"
    return CheckResult("rerun", problem is None, problem or f"{target.steps} steps: loss trace matches, {weights}")


def check_resume(cfg: RunConfig, rerun: RunDir, root: Path, target: Target, tolerance: float) -> CheckResult:
    """(b) Stopped at half the steps and resumed equals the uninterrupted rerun."""
    half = target.steps // 2
    retrain(cfg, root, half)
    resumed = retrain(cfg, root, target.steps)
    problem = trace_mismatch(read_losses(resumed, target.steps), read_losses(rerun, target.steps), tolerance)
    if problem is None:
        problem = weights_mismatch(checkpoint_tensors(resumed.latest_checkpoint()),
                                   checkpoint_tensors(rerun.latest_checkpoint()), tolerance)
    return CheckResult("resume", problem is None,
                       problem or f"stopped at step {half}, resumed to {target.steps}: loss trace and weights match "
                                  "the uninterrupted rerun")


# ---------------------------------------------------------------------------------------- metrics
def recorded_points(run: RunDir, cfg: RunConfig) -> dict[float, dict[str, dict]]:
    """{point: {source: record}}: the latest eval.jsonl line and leaderboard row of each evaluated point."""
    records: dict[float, dict[str, dict]] = {}
    if run.evals.exists():
        for line in run.evals.read_text().splitlines():
            record = json.loads(line)
            records.setdefault(record["point"], {})["eval.jsonl"] = record
    board = Path(cfg.paths.leaderboard)
    if board.is_file():
        for row in read_rows([board]):
            if row["run_id"] == run_id(cfg) and row["point"] in records:
                records[row["point"]][board.name] = row
    return records


def recompute_point(run: RunDir, point: float, evaluator: Evaluator, model: torch.nn.Module) -> dict:
    """The metrics of one eval point from what the run saved: its EMA weights and its sample PNGs."""
    load_point(run, point, model)
    cfg = evaluator.cfg
    val_loss, _ = validation_loss(model, evaluator.evalset, cfg.val_t, cfg.noise_seed, cfg.batch_size,
                                  evaluator.device, cfg.val_samples)
    sample_dir = run.point_samples(point)  # decoded images, on latent data
    if not any(sample_dir.glob("[0-9]*.png")):
        raise FileNotFoundError(f"no sample PNGs in {sample_dir}")
    return {"val_loss": val_loss, **evaluator.image_metrics(load_samples(sample_dir))}


def metric_mismatches(fresh: dict, recorded: dict, tolerance: float) -> list[str]:
    """Each metric whose recorded value differs from the recomputed one (a metric on one side only counts)."""
    problems = []
    for name in METRICS:
        got, want = fresh.get(name), recorded.get(name)
        allowed = tolerance if name == "val_loss" else max(tolerance, METRIC_TOLERANCE)
        if (got is None) != (want is None) or (got is not None and not close(got, want, allowed)):
            problems.append(f"{name} recorded {want!r}, recomputed {got!r}")
    return problems


def check_metrics(run: RunDir, cfg: RunConfig, data: DatasetInfo, tolerance: float) -> CheckResult:
    """(c) Every evaluated point's metrics, recomputed from the saved samples and EMA weights."""
    records = recorded_points(run, cfg)
    if not records:
        return CheckResult("metrics", False, f"no evaluated points in {run.evals}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    evaluator = Evaluator(data, cfg.eval, device)
    model = build_model(cfg.model, data).to(device).eval()
    problems, sources = [], set()
    for point, by_source in sorted(records.items()):
        try:
            fresh = recompute_point(run, point, evaluator, model)
        except (FileNotFoundError, ConfigError) as err:
            problems.append(f"point {point:g}: {err}")
            continue
        for source, record in by_source.items():
            sources.add(source)
            problems += [f"point {point:g} {source}: {p}" for p in metric_mismatches(fresh, record, tolerance)]
    if problems:
        return CheckResult("metrics", False, "; ".join(problems))
    points = ", ".join(f"{p:g}" for p in sorted(records))
    return CheckResult("metrics", True, f"points {points}: recomputed metrics match {' and '.join(sorted(sources))}")


# ------------------------------------------------------------------------------------ environment
def flatten_env(env: dict) -> dict:
    """env.json with its package versions lifted to the top level (`torch`, `numpy`, ...)."""
    return {**{k: v for k, v in env.items() if k != "packages"}, **env.get("packages", {})}


def check_environment(run: RunDir, current: dict) -> CheckResult:
    """(d) env.json against this machine; blocking fields FAIL, other differences are listed."""
    if not run.env.is_file():
        return CheckResult("environment", False, f"no {run.env}")
    recorded, now = flatten_env(json.loads(run.env.read_text())), flatten_env(current)
    changed = [key for key in sorted(recorded.keys() | now.keys()) if recorded.get(key) != now.get(key)]
    blocking = [key for key in changed if key in BLOCKING_ENV]
    ordered = blocking + [key for key in changed if key not in BLOCKING_ENV]
    listed = "; ".join(f"{key} {recorded.get(key)} -> {now.get(key)}" for key in ordered)
    if blocking:
        return CheckResult("environment", False, f"{listed} (reruns are not expected to be bit-exact)")
    same = ", ".join(f"{key} {now.get(key)}" for key in BLOCKING_ENV)
    return CheckResult("environment", True, same + (f"; also differs: {listed}" if changed else ""))


# --------------------------------------------------------------------------------------------- main
def run_checks(run: RunDir, cfg: RunConfig, data: DatasetInfo, target: Target,
               tolerance: float) -> list[CheckResult]:
    """The four checks in order; the reruns live in a temporary folder removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="maskbench-repro-") as tmp:
        rerun = retrain(cfg, Path(tmp) / "rerun", target.steps)
        results = [check_rerun(run, rerun, target, tolerance),
                   check_resume(cfg, rerun, Path(tmp) / "resume", target, tolerance)]
    current = environment(make_accelerator(cfg))
    return results + [check_metrics(run, cfg, data, tolerance), check_environment(run, current)]


def repro_main(run_dir: str | Path, steps: int | None = None, tolerance: float | None = None) -> int:
    """All of `maskbench repro`: the PASS/FAIL table; exit 0, 1 if a check fails, 2 on bad input."""
    run = RunDir(Path(run_dir))
    try:
        cfg = load_run_config(run.root)
        target = plan_target(run, steps)
        if tolerance is not None and tolerance < 0:
            raise ConfigError(f"--tolerance must be >= 0, got {tolerance:g}")
        data = resolve_dataset(cfg.data, cfg.paths.data)  # synth is regenerated identically if deleted
        check_eval_inputs(data, cfg.eval)
    except UserError as err:  # `repro_main` is also called directly: it reports its bad input itself
        print(f"maskbench repro: error: {err}", file=sys.stderr)
        return 2
    if tolerance is None:
        tolerance = GPU_TOLERANCE if torch.cuda.is_available() else 0.0
    results = run_checks(run, cfg, data, target, tolerance)
    print(f"\nmaskbench repro {run.root}: first eval point {target.point:g} at step {target.point_step}, "
          f"rerun {target.steps} steps, {describe(tolerance)} "
          f"(image metrics: {describe(max(tolerance, METRIC_TOLERANCE))})")
    for result in results:
        print(f"{result.name:12s} {'PASS' if result.ok else 'FAIL'}  {result.detail}")
    failed = [result.name for result in results if not result.ok]
    if failed:
        print(f"FAIL: {', '.join(failed)}")
        return 1
    return 0


def add_repro_arguments(parser: argparse.ArgumentParser) -> None:
    """`repro RUN_DIR [--steps N] [--tolerance X]`: arguments and handler of the `repro` command's parser."""
    parser.description = ("Retrain the recorded config up to the first eval point and compare the loss trace and "
                          "weights (bit-exact on CPU); check that stop-and-resume equals the uninterrupted rerun; "
                          "recompute the metrics from the saved samples; compare env.json with this machine. "
                          "Cost: two retrainings up to the first eval point (e.g. 2 x 25% of a run's training "
                          "time, each ending with that point's evaluation), then every point's metrics from its "
                          "saved samples. Exit 1 if a check fails, 2 on bad input.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (runs/<run_id>/)")
    parser.add_argument("--steps", type=int, help="rerun only the first N steps (2 <= N <= the first eval "
                                                  "point's step; weights are compared only at that step)")
    parser.add_argument("--tolerance", type=float, help="relative tolerance on losses and weights "
                                                        f"(default: 0 on CPU, {GPU_TOLERANCE:g} on GPU)")
    parser.set_defaults(func=repro_command)


def repro_command(args: argparse.Namespace) -> int:
    return repro_main(args.run_dir, args.steps, args.tolerance)
