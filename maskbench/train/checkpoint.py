"""The run directory: resolved config, environment record, per-step metrics, and atomic checkpoints.

Layout of `runs/<run_id>/`:
    config.yaml      the fully resolved config (what `maskbench eval` / `repro` rebuild the run from)
    env.json         package versions, git sha, device (compared by `maskbench repro`)
    metrics.jsonl    one line per training step
    eval.jsonl       one line per evaluated eval point
    checkpoints/     point-0.25/, step-00001234/ ... (accelerate `save_state` folders + meta.json)
    samples/         point-0.25/ PNGs and grid.png per eval point
    done.json        written once every eval point is trained and evaluated
    digests.jsonl    the ledger: the sha256 of each record and folder a result rests on, as written

A checkpoint is written into a temporary folder and renamed into place, so a crash mid-save never
leaves a checkpoint that looks complete. Each checkpoint and each point's samples folder is signed by a
digests.json inside it (`files.write_folder_digests`); the ledger signs those digests.json files and each
eval.jsonl line and leaderboard row, so `maskbench repro` can tell which bytes changed since they were written.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from safetensors.torch import load_file
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

import maskbench
from maskbench.config import DRAW_SCHEME, RunConfig, run_id
from maskbench.errors import ConfigError
from maskbench.files import DIGESTS, sha256_file, sha256_json, write_atomic, write_folder_digests

# The files of an accelerate `save_state` folder that maskbench reads back. Custom objects are numbered
# in the order `build.open_run` registers them (`register_for_checkpointing(ema, state)`): the EMA, then the counters.
MODEL_FILE, EMA_FILE, STATE_FILE = "model.safetensors", "custom_checkpoint_0.pkl", "custom_checkpoint_1.pkl"

ENV_PACKAGES = ("torch", "timm", "accelerate", "webdataset", "numpy", "open_clip_torch", "clean-fid",
                "diffusers", "triton")


@dataclass
class TrainState:
    """Counters saved with every checkpoint (registered with accelerate)."""
    step: int = 0
    flops: float = 0.0
    train_seconds: float = 0.0
    data_wait_seconds: float = 0.0
    skipped_nonfinite: int = 0
    bad_samples: dict = field(default_factory=dict)
    skipped_grad_norm: int = 0          # optimizer steps the step guard refused (`guard.StepGuard`)
    phase_skipped: dict = field(default_factory=dict)   # phase index -> its steps skipped (guard or non-finite)
    recent_norms: dict = field(default_factory=dict)    # phase index -> its latest finite grad norms (relative guard)
    refused_norms: list = field(default_factory=list)   # the latest grad norms the guard refused (a stop names them)
    switch_step: int | None = None      # the step the first phase ended at (by its rule or its budget)
    phase_ends: dict = field(default_factory=dict)  # phase index -> its steps, for phases a rule ended
    rule: dict = field(default_factory=dict)  # what a phase's rule remembers between checks (`switch.crossed`)
    # Time outside the training steps, each apart (`train_seconds` is the steps' own time, what gpu_hours reads).
    compile_seconds: float = 0.0        # the first step of each compiled graph (compilation + that step)
    eval_seconds: float = 0.0           # evaluations at eval points
    checkpoint_seconds: float = 0.0     # writing checkpoints
    resume_seconds: float = 0.0         # loading a checkpoint and reopening the data streams
    branch_flops: float = 0.0           # a cooled horizon's FLOPs spent in its branch (0 on the trunk)
    branches_flops: float = 0.0         # every branch so far: what the run spent beyond its trunk
    loader_state: dict = field(default_factory=dict)  # data stream -> its loader's position (resume seeks)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps not taken so far: the step guard's refusals and the non-finite steps."""
        return self.skipped_nonfinite + self.skipped_grad_norm

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


@functools.cache
def git_sha() -> str:
    """The commit of the maskbench source tree, or '' outside a git checkout.

    Read once per process: a sweep trains its runs one after another in one process, and a commit made
    while it runs must not relabel its later rows, whose code is still the code this process loaded."""
    src = Path(maskbench.__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def device_name(device: torch.device) -> str:
    """The device rows and env.json record, and pairing and `repro` compare: the GPU's name, or "cpu:" and the
    CPU's model (the same code and seed gave results 1e-5 apart on another machine's CPU)."""
    from maskbench.train.mfu import device_model

    return device_model(device) if device.type == "cuda" else f"cpu:{device_model(device)}"


def precision_name(mixed_precision: str) -> str:
    """The arithmetic a run trained in, as rows name it: accelerate's "no" is fp32."""
    return "fp32" if mixed_precision == "no" else str(mixed_precision)


def environment(accelerator: Accelerator) -> dict:
    """What a run ran on, for `maskbench repro`: versions, device, and the peak its MFU is measured against."""
    from maskbench.train.mfu import device_peak, matmul_precision

    peak, peak_source = device_peak(accelerator.device, matmul_precision(accelerator.mixed_precision,
                                                                         accelerator.device))
    versions = {}
    for name in ENV_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "maskbench": maskbench.__version__,
        "git_sha": git_sha(),
        "python": sys.version.split()[0],
        "packages": versions,
        "device": device_name(accelerator.device),
        "precision": precision_name(accelerator.mixed_precision),
        "draw_scheme": DRAW_SCHEME,
        "n_devices": accelerator.num_processes,
        "cpu_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "peak_flops": peak,
        "peak_source": peak_source,
    }


class RunDir:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.checkpoints = self.root / "checkpoints"
        self.samples = self.root / "samples"
        self.config = self.root / "config.yaml"
        self.env = self.root / "env.json"
        self.metrics = self.root / "metrics.jsonl"   # the trunk's steps
        self.branches = self.root / "branches"       # a cooled horizon's branch steps, one file per point
        self.evals = self.root / "eval.jsonl"
        self.done = self.root / "done.json"
        self.ledger = self.root / "digests.jsonl"

    @classmethod
    def of(cls, cfg: RunConfig) -> RunDir:
        """The directory a config's run trains into: paths.runs/<run id>. The one place that path is made."""
        return cls(Path(cfg.paths.runs) / run_id(cfg))

    def create(self, config: dict, env: dict) -> None:
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        self.samples.mkdir(exist_ok=True)
        write_atomic(self.config, yaml.safe_dump(config, sort_keys=False))
        if not self.env.exists():
            write_atomic(self.env, json.dumps(env, indent=2))

    def is_finished(self) -> bool:
        return self.done.exists()

    def list_checkpoints(self) -> list[tuple[int, Path]]:
        """(step, path) of every complete checkpoint, oldest first."""
        found = []
        for meta in self.checkpoints.glob("*/meta.json"):
            found.append((json.loads(meta.read_text())["step"], meta.parent))
        return sorted(found)

    def latest_checkpoint(self) -> Path | None:
        found = self.list_checkpoints()
        return found[-1][1] if found else None

    @staticmethod
    def point_name(point: float) -> str:
        return f"point-{point:g}"

    def point_checkpoint(self, point: float) -> Path:
        return self.checkpoints / self.point_name(point)

    def branch_metrics(self, point: float) -> Path:
        """The steps of a cooled horizon's branch (`loop.Trainer.branch`), one line each like metrics.jsonl."""
        self.branches.mkdir(exist_ok=True)
        return self.branches / f"{self.point_name(point)}.jsonl"

    def point_samples(self, point: float) -> Path:
        return self.samples / self.point_name(point)

    def saved_points(self) -> list[float]:
        """The eval points with a checkpoint, in order."""
        return sorted(float(path.name.removeprefix("point-")) for path in self.checkpoints.glob("point-*"))

    @staticmethod
    def raw_weights(ckpt: Path) -> dict[str, torch.Tensor]:
        """The trained model's weights in a checkpoint (the DDP wrapper's `module.` prefix removed)."""
        state = load_file(ckpt / MODEL_FILE)
        consume_prefix_in_state_dict_if_present(state, "module.")
        return state

    @staticmethod
    def ema_weights(ckpt: Path) -> dict[str, torch.Tensor]:
        """The EMA weights in a checkpoint, on the CPU wherever they were saved (load_state_dict moves them)."""
        return torch.load(ckpt / EMA_FILE, weights_only=True, map_location="cpu")["model"]

    @staticmethod
    def train_state(ckpt: Path) -> TrainState:
        """The training counters saved with a checkpoint."""
        state = TrainState()
        state.load_state_dict(torch.load(ckpt / STATE_FILE, weights_only=True, map_location="cpu"))
        return state

    def eval_records(self) -> list[dict]:
        """Every line of eval.jsonl (a point evaluated again appears again, later)."""
        if not self.evals.exists():
            return []
        return [json.loads(line) for line in self.evals.read_text().splitlines()]

    def evaluated_points(self) -> list[float]:
        return [record["point"] for record in self.eval_records()]

    def record_eval(self, row: dict, result: dict) -> None:
        """Append an evaluated point to eval.jsonl: its leaderboard row plus the rest of the result."""
        with open(self.evals, "a") as f:
            extras = {key: value for key, value in result.items() if key not in row}  # per-t losses, grid, ...
            f.write(json.dumps({**row, **extras}) + "\n")

    def sign_record(self, source: str, point: float, record: dict) -> None:
        """Ledger: the digest of one record of `source` ("eval.jsonl", "leaderboard") for an eval point, as it
        reads back from that file."""
        self._sign({"record": source, "point": point, "sha256": sha256_json(record)})

    def sign_folder(self, folder: Path) -> None:
        """Ledger: the digest of a folder's digests.json, so that deleting or rewriting it is seen too."""
        self._sign({"folder": folder.relative_to(self.root).as_posix(), "sha256": sha256_file(folder / DIGESTS)})

    def _sign(self, entry: dict) -> None:
        with open(self.ledger, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def ledger_entries(self) -> list[dict]:
        """Every line of the ledger, oldest first (a folder saved or a point evaluated again is signed again)."""
        return [json.loads(line) for line in self.ledger.read_text().splitlines()] if self.ledger.exists() else []

    def result_folders(self) -> list[Path]:
        """The folders a result rests on: every complete checkpoint and every point's samples."""
        return [path for _, path in self.list_checkpoints()] + sorted(self.samples.glob("point-*/"))

    def truncate_logs(self, step: int) -> None:
        """Drop log lines written after the checkpoint being resumed (they will be redone)."""
        if self.metrics.exists():
            lines = self.metrics.read_text().splitlines()
            kept = [line for line in lines if json.loads(line)["step"] < step]
            write_atomic(self.metrics, "".join(line + "\n" for line in kept))


def save_checkpoint(accelerator: Accelerator, run: RunDir, name: str, step: int, keep_periodic: int) -> Path:
    """`save_state` on every rank into a temporary folder, signed, then an atomic rename by the main process.

    The digests.json goes in before the rename, so a complete-looking checkpoint is always a signed one; the
    ledger entry comes after it, so the ledger never signs a checkpoint that a crash left unfinished."""
    final = run.checkpoints / name
    tmp = run.checkpoints / f".tmp-{name}"
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / "meta.json").write_text(json.dumps({"step": step, "name": name}))
        write_folder_digests(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        run.sign_folder(final)
        _prune_periodic(run, keep_periodic)
    accelerator.wait_for_everyone()
    return final


def _prune_periodic(run: RunDir, keep: int) -> None:
    periodic = [path for _, path in run.list_checkpoints() if path.name.startswith("step-")]
    for path in periodic[: max(len(periodic) - keep, 0)]:
        shutil.rmtree(path)


def latest_trunk(run: RunDir, points: Iterable[float], n_processes: int) -> Path | None:
    """The run's newest checkpoint of the trunk (a cooled horizon's, at `points`, is its branch's end: no place to
    resume), or None; refused when the run was trained on another number of processes."""
    branches = {RunDir.point_name(point) for point in points}
    trunk = [path for _, path in run.list_checkpoints() if path.name not in branches]
    if not trunk:
        return None
    trained_on = json.loads(run.env.read_text())["n_devices"]
    if trained_on != n_processes:
        raise ConfigError(f"{run.root.name} was trained on {trained_on} processes; resume it on "
                          f"{trained_on} (each process replays its own data streams)")
    return trunk[-1]


def load_checkpoint(accelerator: Accelerator, path: Path) -> int:
    accelerator.load_state(str(path))
    return json.loads((path / "meta.json").read_text())["step"]
