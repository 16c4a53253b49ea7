"""`maskbench eval RUN_DIR`: (re)evaluate a run's eval-point checkpoints with the current eval config.

The EMA weights and training counters are read from the checkpoint saved at the point, so the row
written has the same training figures (step, FLOPs, GPU-hours) as the one the run wrote itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from maskbench.config import RunConfig, load_run_config
from maskbench.data.dataset import resolve_dataset
from maskbench.errors import ConfigError
from maskbench.eval.evaluate import Evaluator, check_eval_inputs
from maskbench.models.build import build_model
from maskbench.runs.record import leaderboard_row, record_point
from maskbench.train.checkpoint import RunDir, TrainState


def load_point(run: RunDir, point: float, model: torch.nn.Module) -> TrainState:
    """Load the EMA weights saved at an eval point into model; return the training counters there."""
    ckpt = run.point_checkpoint(point)
    if not ckpt.is_dir():
        have = ", ".join(f"{p:g}" for p in run.saved_points()) or "none"
        raise ConfigError(f"{run.root} has no checkpoint for point {point:g} (have: {have})")
    model.load_state_dict(run.ema_weights(ckpt))
    return run.train_state(ckpt)


def evaluate_run(run_dir: str | Path, points: list[float] | None = None, overrides: RunConfig | None = None,
                 device: torch.device | None = None) -> list[dict]:
    """Evaluate the given points (default: every saved one); append eval.jsonl lines and leaderboard rows."""
    run = RunDir(Path(run_dir))
    cfg = overrides or load_run_config(run.root)
    if not run.env.is_file() or not run.saved_points():  # before any data is generated or network loaded
        raise ConfigError(f"{run.root} has no {'env.json' if not run.env.is_file() else 'eval-point checkpoint'}: "
                          "a run stopped before its first eval point (or while it was being created); "
                          "train it first (rerun its `maskbench run` command)")
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = resolve_dataset(cfg.data, cfg.paths.data)  # synth is regenerated identically if deleted
    check_eval_inputs(data, cfg.eval)
    points = points or run.saved_points()
    model = build_model(cfg.model, data).to(device).eval()
    params = sum(p.numel() for p in model.parameters())
    env = json.loads(run.env.read_text())
    evaluator = Evaluator(data, cfg.eval, device)
    rows = []
    for point in points:
        state = load_point(run, point, model)
        result = evaluator.evaluate(model, run.point_samples(point), point=point)
        trained = [r for r in run.eval_records() if r["point"] == point]  # MFU is a training figure: keep it
        row = leaderboard_row(cfg, data, state, point, result, params, env["n_devices"], env["device"],
                              trained[-1].get("mfu") if trained else None, env.get("precision"),
                              env.get("draw_scheme"))
        record_point(run, row, result, cfg.paths.leaderboard)
        rows.append(row)
    return rows
