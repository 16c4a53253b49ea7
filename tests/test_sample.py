"""`maskbench sample`: a trained run's EMA weights draw what its evaluation drew, for any prompt."""

from __future__ import annotations

import numpy as np
from PIL import Image

from maskbench import cli
from maskbench.config import load_config
from maskbench.data.dataset import resolve_dataset
from maskbench.eval.evaluate import load_eval_set
from maskbench.runs.draw_samples import draw
from maskbench.runs.launch import train
from tests.conftest import tiny_overrides


def test_sample_draws_a_grid_and_reproduces_the_evaluations_first_sample(tmp_path, synth_root, capsys):
    cfg = load_config(tiny_overrides(tmp_path, synth_root, "arm=mask75", "eval.points=[1.0]"))
    run = train(cfg)
    capsys.readouterr()
    out = tmp_path / "grid.png"
    assert cli.main(["sample", str(run), "--prompt", "a small red circle", "--prompt", "a large blue square",
                     "--n", "4", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    assert Image.open(out).size[0] > 2 * 32  # a 2×2 grid of enlarged 32 px tiles with their prompts

    # the evaluation's sample 0 was drawn for held-out prompt 0 from noise (eval.noise_seed, 0): so is this one
    first = Image.open(sorted((run / "samples").glob("*/00000.png"))[-1])
    prompt = _first_eval_prompt(cfg)
    images, captions, point = draw(run, [prompt], n=1, seed=cfg.eval.noise_seed)
    assert point == 1.0 and captions == [prompt]
    diff = np.abs(images[0].astype(int) - np.asarray(first.convert("RGB")).astype(int))
    assert diff.max() <= 2 and diff.mean() < 0.5  # float summation order differs with the batch size
    again, _, _ = draw(run, [prompt], n=1, seed=cfg.eval.noise_seed)
    assert np.array_equal(again, images)
    other, _, _ = draw(run, [prompt], n=1, seed=cfg.eval.noise_seed + 1)
    assert not np.array_equal(other, images)


def test_sample_refuses_a_point_the_run_has_not_saved_and_a_run_never_trained(tmp_path, synth_root, capsys):
    run = train(load_config(tiny_overrides(tmp_path, synth_root, "eval.points=[1.0]")))
    capsys.readouterr()
    assert cli.main(["sample", str(run), "--prompt", "a red circle", "--point", "0.5"]) == 2
    assert "no checkpoint for point 0.5 (have: 1)" in capsys.readouterr().err
    assert cli.main(["sample", str(tmp_path / "nowhere"), "--prompt", "a red circle"]) == 2
    assert "no saved eval point to sample from" in capsys.readouterr().err


def _first_eval_prompt(cfg) -> str:
    """Held-out prompt 0, the one the evaluation's sample 0 was drawn for."""
    return load_eval_set(resolve_dataset(cfg.data, cfg.paths.data), 1).captions[0]
