"""`maskbench eval`: re-evaluating a run's checkpoints, and bad eval inputs refused with one line, exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from maskbench.cli import main
from maskbench.config import load_config
from maskbench.eval import standins
from maskbench.results.rows import read_rows
from maskbench.runs.launch import train
from maskbench.weights import ENV
from tests.conftest import tiny_overrides


@pytest.fixture(scope="module")
def trained(tmp_path_factory, synth_root) -> Path:
    """One run with two eval points, a larger final sample, and a randomly initialised CLIP model; the tests
    below read it, and only the re-evaluation test adds to it (a point's record and row)."""
    tmp_path = tmp_path_factory.mktemp("eval_cli")
    return train(load_config(tiny_overrides(tmp_path, synth_root, "arm=mask0", "eval.final_n_samples=12",
                                            "eval.clip_model=ViT-S-32-alt")))


def test_reevaluating_a_point_reproduces_its_metrics_and_appends_a_row(trained, capsys):
    """Each metric's sampling error is recorded beside it (and reproduced), and the final point samples
    eval.final_n_samples prompts, in training and in re-evaluation alike."""
    run_dir = trained
    assert main(["eval", str(run_dir), "--point", "1"]) == 0
    assert "point 1 (step" in capsys.readouterr().out
    records = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    first, again = [r for r in records if r["point"] == 1]
    errors = ("val_loss_se", "fid_se", "align_acc_se")
    for metric in ("val_loss", "fid", "align_acc", "step", "train_flops", "mfu", *errors, "fid_ci"):
        assert again[metric] == first[metric], metric
    assert [r["fid_n"] for r in records] == [8, 12, 12] and len(first["fid_ci"]) == 2
    rows = read_rows([run_dir.parent.parent / "leaderboard.csv"])
    assert len(rows) == 3   # 2 points trained + 1 re-evaluated
    assert all(row[name] is not None for row in rows for name in errors)


def test_eval_of_a_missing_point_or_key_is_refused(trained, capsys):
    run_dir = trained
    assert main(["eval", str(run_dir), "--point", "0.25"]) == 2
    assert "no checkpoint for point 0.25 (have: 0.5, 1)" in capsys.readouterr().err
    assert main(["eval", str(run_dir), "train.lr=1"]) == 2
    assert "only eval.* and paths.*" in capsys.readouterr().err


def relabelled(root: Path, out: Path, source: str) -> Path:
    """A copy of shards whose manifests record another source (the run's dataset label comes from them)."""
    shutil.copytree(root, out)
    for manifest in out.glob("*/manifest.json"):
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "source": source}))
    return out


@pytest.fixture(scope="module")
def real_inputs(tmp_path_factory, synth_root) -> tuple[Path, Path, Path]:
    """Read only by the refusals below: the synth shards relabelled as photos, a file that is not TorchScript
    where the Inception weights go, and stand-in Inception weights."""
    tmp_path = tmp_path_factory.mktemp("real_inputs")
    weights = tmp_path / "inception.pt"
    weights.write_bytes(b"a TorchScript file would be here")
    return (relabelled(synth_root, tmp_path / "photos", "photos"), weights,
            standins.write_inception(tmp_path / "standin-inception.pt"))


@pytest.mark.parametrize("case, expected", [
    ("too_many", "eval.n_samples=100 / eval.val_samples=16 exceed the 64 held-out prompts"),
    ("final_too_many", "eval.n_samples=8 / eval.final_n_samples=100 / eval.val_samples=16 exceed the 64 held-out"),
    ("final_one", "eval.final_n_samples must be at least 2"),
    ("one_resample", "eval.bootstrap_resamples must be 0 (no bootstrap errors) or at least 2"),
    ("no_weights", "Inception weights not found at"),
    ("bad_weights", "are not a TorchScript file"),
    ("no_stats", "no reference statistics at"),
])
def test_bad_eval_inputs_exit_2_before_training(tmp_path, synth_root, real_inputs, capsys, case, expected):
    photos, weights, standin = real_inputs
    extra = {
        "too_many": ["eval.n_samples=100"],
        "final_too_many": ["eval.final_n_samples=100"],
        "final_one": ["eval.final_n_samples=1"],
        "one_resample": ["eval.bootstrap_resamples=1"],
        # the synth shards packed under another source: real-data evaluation (Inception FID) applies
        "no_weights": [f"data.path={photos}", f"eval.inception_weights={tmp_path / 'missing.pt'}"],
        "bad_weights": [f"data.path={photos}", f"eval.inception_weights={weights}"],
        "no_stats": [f"data.path={photos}", f"eval.inception_weights={standin}",
                     f"eval.reference_stats={tmp_path / 'stats.npz'}"],
    }[case]
    assert main(["run", *tiny_overrides(tmp_path, synth_root, *extra)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err
    assert not (tmp_path / "runs").exists()


def test_eval_reference_without_weights_exits_2(tmp_path, synth_root, capsys):
    code = main(["eval", "reference", str(synth_root / "val"), f"eval.inception_weights={tmp_path / 'nope.pt'}"])
    assert code == 2 and "pass eval.inception_weights=PATH" in capsys.readouterr().err


@pytest.mark.parametrize("given, expected", [([], "needs the Inception weights"),
                                             (["eval.inception_weight=x.pt"], "got 'eval.inception_weight=x.pt'"),
                                             (["eval.n_samples=10"], "eval reference takes eval.inception_weights=")])
def test_eval_reference_refuses_missing_or_unknown_keys_in_one_line(tmp_path, synth_root, capsys, monkeypatch,
                                                                    given, expected):
    monkeypatch.delenv(ENV, raising=False)
    assert main(["eval", "reference", str(synth_root / "val"), *given]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err


def test_random_clip_runs_end_to_end_but_is_never_written_as_a_clip_score(trained):
    """eval.clip_model without eval.clip_weights scores with a randomly initialised open_clip model:
    the plumbing runs, and the rows keep the CLIP columns empty."""
    rows = read_rows([trained.parent.parent / "leaderboard.csv"])
    assert rows and all(row["clip_score"] is None and row["clip_cos"] is None and row["clip_model"] is None
                        for row in rows)
    records = [json.loads(line) for line in (trained / "eval.jsonl").read_text().splitlines()]
    assert records and all(-1.0 <= record["clip_random_init"]["clip_cos"] <= 1.0 and record["clip_score"] is None
                           for record in records)
