"""The metric registry: a metric defined once in `maskbench.metrics` is a leaderboard column (with its sampling
error), a metric of the statistics and one the command line prints, with no other file touched."""

import json
import subprocess
import sys

import pytest

from maskbench.metrics import CO_PRIMARY, METRICS, compared_metrics, get_metric
from maskbench.results.rows import COLUMNS, FLOAT_COLUMNS

# Runs in a fresh interpreter: the registry gains an entry before anything reads it, as an edit of
# maskbench/metrics.py would, and reports what the leaderboard, the statistics and `maskbench eval` make of it.
WITH_A_NEW_METRIC = r"""
import csv, io, json, sys
import maskbench.metrics as registry
registry.METRICS += (registry.Metric("sharpness", "sharp", False, "a test's stand-in"),)

import maskbench.config as config
import maskbench.runs.reevaluate as reevaluate
from maskbench.cli import main
from maskbench.results.rows import COLUMNS, FLOAT_COLUMNS, as_read
from maskbench.results.summary import summarize
from maskbench.results.tables import render

def row(arm, seed, sharpness):
    return as_read({"run_id": f"{arm}-{seed}", "arm": arm, "dataset": "synth", "model": "dit-t", "seed": seed,
                    "budget_flops": 1e12, "point": 1.0, "sharpness": sharpness, "sharpness_se": 0.01})

rows = [row("mask0", 0, 0.5), row("mask0", 1, 0.6), row("mask75", 0, 0.7), row("mask75", 1, 0.9)]
summary = summarize(rows, "mask0", ("sharpness",))
arm = next(record for record in summary if record.arm == "mask75")

config.load_run_config = lambda path: None
config.with_eval_overrides = lambda cfg, overrides: overrides
reevaluate.evaluate_run = lambda *args, **kwargs: [{"point": 1.0, "step": 10, "val_loss": 0.5, "sharpness": 0.25}]
out, sys.stdout = sys.stdout, io.StringIO()
main(["eval", "RUN"])
printed, sys.stdout = sys.stdout.getvalue(), out

import maskbench.results.plots as plots
curves = []
plots._plot_group = lambda fig, group, records, colors, drawn, level: curves.append(list(drawn))
plots.group_curves(summary)

print(json.dumps({
    "table": render(summary, "table", details=True).splitlines()[0], "curves": curves,
    "columns": COLUMNS[-2:], "float": sorted({"sharpness", "sharpness_se"} & FLOAT_COLUMNS),
    "estimate": arm.metrics["sharpness"], "difference": arm.comparisons["sharpness"].difference.mean,
    "csv_header": next(csv.reader(io.StringIO(render(summary, "csv")))), "cli": printed,
}))
"""


def test_a_new_registry_entry_reaches_leaderboard_statistics_and_cli():
    done = subprocess.run([sys.executable, "-c", WITH_A_NEW_METRIC], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["columns"] == ["sharpness", "sharpness_se"]     # after every committed column, typed
    assert found["float"] == ["sharpness", "sharpness_se"]
    assert found["estimate"][0] == pytest.approx(0.8)             # mean over mask75's two seeds
    assert found["difference"] == pytest.approx(0.25)             # paired: (0.7 − 0.5 + 0.9 − 0.6) / 2
    assert {"sharpness", "sharpness_ci"} <= set(found["csv_header"])
    assert "sharpness 0.25" in found["cli"]
    assert found["table"].split()[-3] == "sharp"                  # the summary table's last metric column
    assert found["curves"] == [["sharpness"]]                     # the study page plots it (the only one measured)


def test_every_metric_has_its_columns_and_the_statistics_read_the_registry():
    for m in METRICS:
        assert {m.name, m.se_column} <= set(COLUMNS) & FLOAT_COLUMNS
    assert compared_metrics() == ("fid", "clip_score", "val_loss", "align_acc")  # the statistics' CSV order
    assert set(CO_PRIMARY) <= set(compared_metrics())
    assert get_metric("fid").lower_is_better and not get_metric("clip_score").lower_is_better


def test_an_unknown_metric_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown metric 'fdd'; choose from fid, clip_score"):
        get_metric("fdd")


class MeanBrightness:
    """A toy image metric, as a new one would be written: its per-sample value and its summary (`ImageScorer`)."""

    metric = "brightness"

    def score(self, images, captions, meta):
        return images.float().mean(dim=(1, 2, 3)).numpy() / 255                             # S

    def summarize(self, values, counts):
        resampled = counts @ values / len(values)                                             # R
        return {"brightness": float(values.mean()), "brightness_se": float(resampled.std(ddof=1))}


def test_a_new_image_scorer_is_measured_gathered_and_summarised_without_an_evaluator_change(tmp_path, synth_root):
    """The evaluator's half of a new image metric: one scorer in its list (what `image_scorers` returns) is scored
    on the samples, summarised with the bootstrap resamples every metric shares, and reported beside the rest."""
    import torch

    from maskbench.config import load_config
    from maskbench.data.dataset import resolve_dataset
    from maskbench.eval.evaluate import Evaluator, load_samples
    from maskbench.models.build import build_model
    from tests.conftest import randomized, tiny_overrides

    cfg = load_config(tiny_overrides(tmp_path, synth_root, "eval.n_samples=6", "eval.bootstrap_resamples=20"))
    data = resolve_dataset(cfg.data, cfg.paths.data)
    evaluator = Evaluator(data, cfg.eval, torch.device("cpu"))
    evaluator.scorers.append(MeanBrightness())
    result = evaluator.evaluate(randomized(build_model(cfg.model, data), 0.05), tmp_path / "samples")
    images = load_samples(tmp_path / "samples")                                              # the 6 saved PNGs
    assert result["brightness"] == pytest.approx(images.float().mean().item() / 255)
    assert result["brightness_se"] > 0 and {"fid", "fid_se", "align_acc", "val_loss"} <= result.keys()
