"""`maskbench repro RUN_DIR`: can this run's numbers be trusted to come from its recorded config?

Five checks, each compared against something the run itself saved, never against a second opinion:
  rerun        retrain the recorded config from scratch (same seed, in a temporary runs dir) up to an
               eval-point checkpoint (the first; `--through POINT|last` for a later one); the loss trace must
               equal metrics.jsonl and the raw and EMA weights must equal those of every eval-point
               checkpoint the rerun passed.
  resume       the same rerun stopped half way (`train.stop_at_step`, as a preemption would) and resumed
               must equal the uninterrupted rerun: loss trace and weights.
  metrics      recompute every evaluated point from its saved sample PNGs and its EMA weights; the image
               metrics and val loss must equal eval.jsonl and the run's leaderboard rows.
  environment  env.json against this machine: a different torch/numpy, device, device count or git sha
               means the bit-exact comparisons above are not expected to hold, so it is a FAIL too.
  digests      every file a result rests on has the bytes it was signed with when it was written: each file
               of each checkpoint and samples folder (against the folder's digests.json), each eval.jsonl
               line and each of the run's leaderboard rows (against the ledger digests.jsonl, which also
               signs every digests.json; a row signed before a column was added to the schema matches
               without it, `row_digests`). What was written before signing existed is "not signed (older
               run)": listed, neither PASS nor FAIL.

Comparisons are bit-exact on CPU, where training is deterministic; on GPU (bf16, non-deterministic
kernels) they use a relative tolerance, stated in the output. Stopping at the first eval point keeps
the cost proportional to it: two retrainings up to that point (e.g. 2 × 25% of a run, each ending
with that point's evaluation), then the metrics of every point from the saved samples (no sampling).
The later points' weights are then vouched for by their digests (unchanged since the run wrote them)
and by their recomputed metrics, not re-derived: the printed reach says so, and `--through last` re-derives
them too, at the cost of two whole retrainings.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, replace
from itertools import zip_longest
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import broadcast_object_list

from maskbench.config import RunConfig, load_run_config, run_id
from maskbench.data.dataset import DatasetInfo, resolve_dataset
from maskbench.errors import ConfigError, UserError
from maskbench.eval.evaluate import Evaluator, check_eval_inputs, load_samples
from maskbench.files import DIGESTS, folder_change, sha256_file, sha256_json
from maskbench.metrics import METRICS
from maskbench.models.build import build_model
from maskbench.results.rows import ADDED_COLUMNS, read_rows
from maskbench.runs.launch import train
from maskbench.runs.reevaluate import load_point
from maskbench.train.checkpoint import RunDir, environment
from maskbench.train.loop import make_accelerator

GPU_TOLERANCE = 1e-3     # relative, on losses and weights, when reruns happen on a GPU
METRIC_TOLERANCE = 1e-6  # relative, image metrics recomputed from the very same PNGs
# Every registry metric, and the raw CLIP cosine behind the CLIP score: a new metric is checked without a line here.
RECOMPUTED = (*(metric.name for metric in METRICS), "clip_cos")
# Fields of env.json whose change makes a rerun differ in its bits; the others are only reported.
BLOCKING_ENV = ("torch", "numpy", "device", "n_devices", "git_sha")
NOT_SIGNED = "not signed"  # a folder or record written before runs signed what they write


@dataclass
class CheckResult:
    name: str
    ok: bool | None  # None: nothing to check it against (a run older than the check)
    detail: str

    @property
    def status(self) -> str:
        return {True: "PASS", False: "FAIL", None: "----"}[self.ok]


@dataclass
class RerunTarget:
    """What the reruns reproduce: `steps` training steps, towards the eval point `point` saved at `point_step`
    (one of the run's eval-point checkpoints `points`)."""
    point: float
    point_step: int
    steps: int
    points: tuple[float, ...]

    @property
    def at_point(self) -> bool:
        return self.steps == self.point_step

    @property
    def reach(self) -> str:
        """How far the rerun goes, in the run's terms: the points after it are not re-derived, only checked by
        their digests and recomputed metrics."""
        where = f"= eval point {self.point:g}" if self.at_point else \
            f"(eval point {self.point:g} is at step {self.point_step})"
        return f"steps 0..{self.steps} {where} of {', '.join(f'{p:g}' for p in self.points)}"


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
def point_steps(run: RunDir) -> list[tuple[float, int]]:
    """(point, step) of each eval-point checkpoint, in step order: the step is whatever its meta.json says."""
    return [(float(path.name.removeprefix("point-")), step) for step, path in run.list_checkpoints()
            if path.name.startswith("point-")]


def pick_point(saved: list[tuple[float, int]], through: str | None) -> tuple[float, int]:
    """--through: the first eval point by default, `last`, or any point the run saved."""
    if through is None or through == "last":
        return saved[0 if through is None else -1]
    try:
        point = float(through)
    except ValueError:
        point = None
    if point not in dict(saved):
        raise ConfigError(f"--through must be last or an eval point with a checkpoint "
                          f"({', '.join(f'{p:g}' for p, _ in saved)}), got {through}")
    return point, dict(saved)[point]


def plan_target(run: RunDir, steps: int | None, through: str | None = None) -> RerunTarget:
    """Validate --through and --steps against what the run saved: 2 <= steps <= the target point's step."""
    saved = point_steps(run)
    if not saved:
        raise ConfigError(f"{run.root} has no eval-point checkpoint yet; train past its first eval point first")
    point, point_step = pick_point(saved, through)
    steps = point_step if steps is None else steps
    if not 2 <= steps <= point_step:
        raise ConfigError(f"--steps must be between 2 and {point_step} (the step of eval point {point:g}), "
                          f"got {steps}")
    if len(read_losses(run, steps)) < steps:
        raise ConfigError(f"{run.metrics} has fewer than {steps} steps")
    return RerunTarget(point, point_step, steps, tuple(p for p, _ in saved))


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


def point_mismatch(run: RunDir, rerun: RunDir, point: float, tolerance: float) -> str | None:
    """None if the rerun's raw and EMA weights at an eval point match the run's; else the worst tensor."""
    if not rerun.point_checkpoint(point).is_dir():
        return f"the rerun saved no checkpoint at point {point:g}"
    problem = weights_mismatch(checkpoint_tensors(rerun.point_checkpoint(point)),
                               checkpoint_tensors(run.point_checkpoint(point)), tolerance)
    return problem and f"point {point:g}: {problem}"


def check_rerun(run: RunDir, rerun: RunDir, target: RerunTarget, tolerance: float) -> CheckResult:
    """(a) The rerun's losses match metrics.jsonl; its weights match the run's at every eval point it passed."""
    problem = trace_mismatch(read_losses(rerun, target.steps), read_losses(run, target.steps), tolerance)
    passed = [point for point, step in point_steps(run) if step <= target.steps]
    for point in passed:
        problem = problem or point_mismatch(run, rerun, point, tolerance)
    if problem is not None:
        return CheckResult("rerun", False, problem)
    if passed:
        last = digest(checkpoint_tensors(rerun.point_checkpoint(passed[-1])))
        weights = (f"raw and EMA weights at point{'s' * (len(passed) > 1)} {', '.join(f'{p:g}' for p in passed)} "
                   f"match (sha256 {last[:12]} at {passed[-1]:g})")
    else:
        weights = f"weights not compared (the run saved none by step {target.steps})"
    return CheckResult("rerun", True, f"{target.steps} steps: loss trace matches, {weights}")


def check_resume(cfg: RunConfig, rerun: RunDir, root: Path, target: RerunTarget, tolerance: float) -> CheckResult:
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
def run_records(run: RunDir, cfg: RunConfig) -> dict[str, list[dict]]:
    """The records of a run's results, in file order: eval.jsonl's lines, and as "leaderboard" the rows with
    its run_id in the CSV at its paths.leaderboard (the names the ledger signs them under)."""
    board = Path(cfg.paths.leaderboard)
    rows = [row for row in read_rows([board]) if row["run_id"] == run_id(cfg)] if board.is_file() else []
    return {"eval.jsonl": run.eval_records(), "leaderboard": rows}


def recorded_points(run: RunDir, cfg: RunConfig) -> dict[float, dict[str, dict]]:
    """{point: {source: record}}: the latest eval.jsonl line and leaderboard row of each evaluated point."""
    found, board = run_records(run, cfg), Path(cfg.paths.leaderboard).name
    records: dict[float, dict[str, dict]] = {}
    for record in found["eval.jsonl"]:
        records.setdefault(record["point"], {})["eval.jsonl"] = record
    for row in found["leaderboard"]:
        if row["point"] in records:
            records[row["point"]][board] = row
    return records


def recompute_point(run: RunDir, point: float, evaluator: Evaluator, model: torch.nn.Module,
                    losses: tuple[Evaluator, Accelerator | None] | None = None) -> dict:
    """The metrics of one eval point from what the run saved: its EMA weights and its sample PNGs. `losses`: the
    evaluator of this process's share of the held-out samples and the accelerator, for a multi-process rerun (the
    run measured its validation loss so, and summed the shares in that order)."""
    load_point(run, point, model)
    sample_dir = run.point_samples(point)  # decoded images, on latent data
    if not any(sample_dir.glob("[0-9]*.png")):
        raise FileNotFoundError(f"no sample PNGs in {sample_dir}")
    loss = losses[0].loss_metrics(model, losses[1]) if losses else evaluator.loss_metrics(model)
    return {**loss, **evaluator.image_metrics(load_samples(sample_dir))}


def metric_mismatches(fresh: dict, recorded: dict, tolerance: float) -> list[str]:
    """Each metric whose recorded value differs from the recomputed one (a metric on one side only counts)."""
    problems = []
    for name in RECOMPUTED:
        got, want = fresh.get(name), recorded.get(name)
        allowed = tolerance if name == "val_loss" else max(tolerance, METRIC_TOLERANCE)
        if (got is None) != (want is None) or (got is not None and not close(got, want, allowed)):
            problems.append(f"{name} recorded {want!r}, recomputed {got!r}")
    return problems


def check_metrics(run: RunDir, cfg: RunConfig, data: DatasetInfo, tolerance: float,
                  acc: Accelerator | None = None) -> CheckResult:
    """(c) Every evaluated point's metrics, recomputed from the saved samples and EMA weights. Under several
    processes (`acc`) every process recomputes the image metrics of all the samples, and the validation loss
    is measured as the run measured it: each process its share, summed across them."""
    records = recorded_points(run, cfg)
    if not records:
        return CheckResult("metrics", False, f"no evaluated points in {run.evals}")
    several = acc is not None and acc.num_processes > 1
    device = acc.device if several else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    evaluator = Evaluator(data, cfg.eval, device)
    losses = (Evaluator(data, cfg.eval, device, scores=False, rank=acc.process_index, world=acc.num_processes),
              acc) if several else None
    model = build_model(cfg.model, data).to(device).eval()
    problems, sources = [], set()
    for point, by_source in sorted(records.items()):
        try:
            fresh = recompute_point(run, point, evaluator, model, losses)
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


# ---------------------------------------------------------------------------------------- digests
def folder_state(folder: Path, ledger_sha: str | None) -> str | None:
    """None if a folder holds exactly the bytes it was signed with; NOT_SIGNED if nothing signed it; else
    what changed (`ledger_sha`: the ledger's digest of its digests.json, None if the ledger has none)."""
    digests = folder / DIGESTS
    if not digests.is_file():
        return NOT_SIGNED if ledger_sha is None else f"{DIGESTS} is missing"
    if ledger_sha is not None and sha256_file(digests) != ledger_sha:
        return f"{DIGESTS} changed since the ledger signed it"
    return folder_change(folder)


def row_digests(row: dict) -> set[str]:
    """The digests a leaderboard row may have been signed with: the row as it reads back now, and as it read back
    before each column added since (an empty cell in it).

    A row is signed as `read_rows` gives it back, with every column of the schema of its day. A column added
    later (`ADDED_COLUMNS`, in the order added: the schema declares each new one last) reads back empty in a row
    written before it, one key more than was signed, and every older row would read "changed since it was
    signed". So the row also matches without the latest-added columns, newest first, while they are empty in
    it: a row differs from its signature only when a cell it was written with changed. A non-empty cell ends
    the search, since no row written before that column was added can fill it.
    """
    digests, kept = {sha256_json(row)}, dict(row)
    for column in reversed(ADDED_COLUMNS):
        if kept.get(column) is not None:
            break
        kept.pop(column, None)
        digests.add(sha256_json(kept))
    return digests


def records_state(found: list[set[str]], signed: list[str]) -> str | None:
    """The same for one point's records in one file: the digests each may have been signed with (one for an
    eval.jsonl line, `row_digests` for a leaderboard row), in file order, against the ledger's."""
    if not signed:
        return NOT_SIGNED
    for index, (got, want) in enumerate(zip_longest(found, signed)):
        if got is None or want not in got:
            what = "is missing" if got is None else "is not signed" if want is None else "changed since it was signed"
            return f"record {index + 1} of {max(len(found), len(signed))} {what}"
    return None


def folder_states(run: RunDir) -> dict[str, str | None]:
    """{folder relative to the run: its `folder_state`} of every checkpoint and samples folder."""
    signed = {entry["folder"]: entry["sha256"] for entry in run.ledger_entries() if "folder" in entry}  # latest wins
    names = {folder.relative_to(run.root).as_posix(): folder for folder in run.result_folders()}
    return {name: folder_state(folder, signed.get(name)) for name, folder in names.items()}


def record_states(run: RunDir, cfg: RunConfig) -> dict[tuple[str, float], str | None]:
    """{(source, point): its `records_state`} of eval.jsonl's lines and the run's leaderboard rows."""
    signed, found = defaultdict(list), defaultdict(list)
    for entry in run.ledger_entries():
        if "record" in entry:
            signed[entry["record"], entry["point"]].append(entry["sha256"])
    for source, records in run_records(run, cfg).items():
        for record in records:
            found[source, record["point"]].append(row_digests(record) if source == "leaderboard"
                                                  else {sha256_json(record)})
    return {key: records_state(found[key], signed[key]) for key in sorted(found.keys() | signed.keys())}


def check_digests(run: RunDir, cfg: RunConfig) -> CheckResult:
    """(e) Every file a result rests on still holds the bytes signed when it was written."""
    folders, records = folder_states(run), record_states(run, cfg)
    states = {**folders, **{f"{source} point {point:g}": state for (source, point), state in records.items()}}
    problems = [f"{name}: {state}" for name, state in states.items() if state not in (None, NOT_SIGNED)]
    unsigned = [name for name, state in states.items() if state == NOT_SIGNED]
    older = f"not signed (older run): {', '.join(unsigned)}" if unsigned else ""
    if problems:
        return CheckResult("digests", False, "; ".join(problems))
    if len(unsigned) == len(states):
        return CheckResult("digests", None, older or "nothing to check")
    n_folders = sum(state is None for state in folders.values())
    n_points = len({point for (_, point), state in records.items() if state is None})
    return CheckResult("digests", True, f"{n_folders} folders and the eval.jsonl lines and leaderboard rows of "
                                        f"{n_points} points match their digests" + (f"; {older}" if older else ""))


# --------------------------------------------------------------------------------------------- main
@contextlib.contextmanager
def shared_scratch(acc: Accelerator, run: RunDir) -> Iterator[Path]:
    """One temporary folder for the reruns, the same on every process of a multi-process launch: the main process
    creates it and broadcasts its path (a folder per process would leave the other ranks looking for the run files
    only the main process writes). On one machine it is a system temporary folder; across machines, a hidden
    folder beside the run, which every process can already read. The main process removes it once every process
    is done with it."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", acc.num_processes))
    where = None if local >= acc.num_processes else run.root.parent
    path = [tempfile.mkdtemp(prefix=".maskbench-repro-" if where else "maskbench-repro-", dir=where)
            if acc.is_main_process else None]
    if acc.num_processes > 1:
        broadcast_object_list(path)
    done = False
    try:
        yield Path(path[0])
        done = True
    finally:
        if done:  # after a failure another rank may be inside a collective: no barrier then
            acc.wait_for_everyone()
        if acc.is_main_process:
            shutil.rmtree(path[0], ignore_errors=True)


def run_checks(run: RunDir, cfg: RunConfig, data: DatasetInfo, target: RerunTarget,
               tolerance: float) -> list[CheckResult]:
    """The five checks in order; the reruns live in a temporary folder removed afterwards."""
    acc = make_accelerator(cfg)  # the process group of a multi-process launch, before the scratch folder is shared
    with shared_scratch(acc, run) as tmp:
        rerun = retrain(cfg, tmp / "rerun", target.steps)
        results = [check_rerun(run, rerun, target, tolerance),
                   check_resume(cfg, rerun, tmp / "resume", target, tolerance)]
    current = environment(make_accelerator(cfg))
    return results + [check_metrics(run, cfg, data, tolerance, acc), check_environment(run, current),
                      check_digests(run, cfg)]


def repro_main(run_dir: str | Path, steps: int | None = None, tolerance: float | None = None,
               through: str | None = None) -> int:
    """All of `maskbench repro`: the PASS/FAIL table; exit 0, 1 if a check fails, 2 on bad input."""
    run = RunDir(Path(run_dir))
    try:
        cfg = load_run_config(run.root)
        target = plan_target(run, steps, through)
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
    if not PartialState().is_main_process:  # every process ran the same checks: the main process prints them
        return 1 if any(result.ok is False for result in results) else 0
    print(f"\nmaskbench repro {run.root}: rerun re-derives {target.reach}; {describe(tolerance)} "
          f"(image metrics: {describe(max(tolerance, METRIC_TOLERANCE))})")
    for result in results:
        print(f"{result.name:12s} {result.status}  {result.detail}")
    failed = [result.name for result in results if result.ok is False]
    if failed:
        print(f"FAIL: {', '.join(failed)}")
        return 1
    return 0


def add_repro_arguments(parser: argparse.ArgumentParser) -> None:
    """`repro RUN_DIR [--through POINT] [--steps N] [--tolerance X]`: arguments and handler of `repro`'s parser."""
    parser.description = ("Retrain the recorded config up to the first eval point (or --through) and compare the "
                          "loss trace and weights (bit-exact on CPU); check that stop-and-resume equals the "
                          "uninterrupted rerun; recompute the metrics from the saved samples; compare env.json "
                          "with this machine; check every checkpoint, sample, eval.jsonl line and leaderboard row "
                          "against the digest written with it. Cost: two retrainings up to the first eval point "
                          "(e.g. 2 x 25% of a run's training time, each ending with that point's evaluation), then "
                          "every point's metrics from its saved samples. Exit 1 if a check fails, 2 on bad input.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (runs/<run_id>/)")
    parser.add_argument("--through", metavar="POINT", help="rerun through this eval point, `last` or one with a "
                                                           "checkpoint (e.g. 0.5; default: the first), comparing the "
                                                           "weights at every eval point on the way; costs two "
                                                           "retrainings up to it")
    parser.add_argument("--steps", type=int, help="rerun only the first N steps (2 <= N <= the target eval "
                                                  "point's step; weights are compared only at points on the way)")
    parser.add_argument("--tolerance", type=float, help="relative tolerance on losses and weights "
                                                        f"(default: 0 on CPU, {GPU_TOLERANCE:g} on GPU)")
    parser.set_defaults(func=repro_command)


def repro_command(args: argparse.Namespace) -> int:
    return repro_main(args.run_dir, args.steps, args.tolerance, args.through)
