"""The validation loss reads exactly eval.val_samples held-out samples, however many prompts are sampled."""

from __future__ import annotations

from pathlib import Path

import torch

from maskbench.config import load_config
from maskbench.data.dataset import resolve_dataset
from maskbench.eval.evaluate import Evaluator, validation_loss
from maskbench.models.build import build_model
from tests.conftest import tiny_overrides


def test_val_samples_bounds_the_validation_loss_when_more_prompts_are_sampled(tmp_path: Path, synth_root: Path) -> None:
    cfg = load_config(tiny_overrides(tmp_path, synth_root, "eval.n_samples=16", "eval.val_samples=4",
                                     "eval.batch_size=3"))
    data = resolve_dataset(cfg.data, cfg.paths.data)
    torch.manual_seed(0)
    model = build_model(cfg.model, data).eval()
    evaluator = Evaluator(data, cfg.eval, torch.device("cpu"))
    result = evaluator.evaluate(model, tmp_path / "samples")
    first_four, _ = validation_loss(model, evaluator.evalset, cfg.eval.val_t, cfg.eval.noise_seed, 3,
                                    torch.device("cpu"), n=4)
    all_sixteen, _ = validation_loss(model, evaluator.evalset, cfg.eval.val_t, cfg.eval.noise_seed, 3,
                                     torch.device("cpu"))
    assert len(evaluator.evalset.captions) == 16 and result["fid_n"] == 16
    assert result["val_loss"] == first_four != all_sixteen
