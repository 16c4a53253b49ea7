"""One run end to end: a trainer whose eval points are evaluated and recorded (`runs.record`), started from
another run's weights where `init_from` says so (`runs.source`), after the plan it prints (`runs.preflight`).
"""

from __future__ import annotations

from pathlib import Path

from maskbench.config import RunConfig
from maskbench.data.dataset import resolve_dataset
from maskbench.eval.evaluate import check_eval_inputs
from maskbench.runs.preflight import plan_lines
from maskbench.runs.record import PointRecorder
from maskbench.runs.source import load_source
from maskbench.train.loop import Trainer, trainer_for


def make_trainer(cfg: RunConfig) -> Trainer:
    """A trainer that evaluates and records its eval points; refuses, before any training, a run whose
    evaluation could not run (missing weights, reference statistics, too few held-out prompts) or whose
    init_from source does not fit."""
    data = resolve_dataset(cfg.data, cfg.paths.data, create=False)  # once: `trainer_for` generates synth data
    start = load_source(cfg, data) if cfg.init_from else None
    recorder = PointRecorder()
    trainer = trainer_for(cfg, data, on_point=recorder, start=start, validation=recorder.validation_loss)
    check_eval_inputs(data, cfg.eval)
    lines = plan_lines(cfg, data, trainer.progress.schedule, trainer.run, exists=True)
    trainer.accelerator.print("\n".join(lines), flush=True)
    return trainer


def train(cfg: RunConfig) -> Path:
    """Train, evaluate and record one run; its run directory."""
    return make_trainer(cfg).fit()
