"""Data that names itself: a run on data.path is labelled by the source its shards' manifest records.

The shards are BrushData-format fixtures packed by the real adapter and encoded with the stand-in VAE
and text tower (as conftest's `shards` and `opts` make them), as in a real latent run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from maskbench.cli import main
from maskbench.config import DataConfig, Phase, RunConfig, Until, config_hash, data_label, load_config
from maskbench.data.encode import EncodeOptions, encode
from maskbench.data.pack import PackOptions, pack
from maskbench.data.sources.brushdata import plan_brushdata
from maskbench.eval import standins
from tests.fixtures_real import make_brushdata
from tests.test_latent_run import run_overrides


@pytest.fixture(scope="module")
def latent_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """conftest's `shards` encoded with its `opts` (as tests/test_latent_run.py's `latent_root`), built once for
    this file: every test only reads it, and the one that edits a manifest edits its own copy."""
    world = tmp_path_factory.mktemp("labelled")
    torch.manual_seed(0)
    opts = EncodeOptions(vae=str(standins.write_vae(world / "vae")), text_model=standins.write_clip(world / "clip"),
                         resolution=32, batch_size=2)
    make_brushdata(world / "raw", shards=2, per_shard=3)
    pack(world / "canon", "brushdata", plan_brushdata([world / "raw"]), PackOptions(), progress=False)
    for split in ("train", "val"):
        encode(world / "canon", world / "latent" / split, opts, progress=False)
    return world / "latent"


def unnamed(tmp_path: Path, root: Path, *extra: str) -> list[str]:
    """The tiny latent run's overrides with data.path alone naming the data."""
    return [item for item in run_overrides(tmp_path, root) if not item.startswith("data.name=")] + list(extra)


# A run given only data.path, trained end to end, is named after its shards' source (run id, run directory and
# leaderboard rows): asserted on the latent run of tests/test_latent_run.py::test_latent_run_decodes_samples_and_
# scores_fid_and_clip, which trains without data.name, so that one training and evaluation serves both.


@pytest.mark.parametrize("name", ["data=sa1b", "data=synth", "data.name=photos"])
def test_a_name_that_contradicts_the_manifest_is_refused(tmp_path: Path, latent_root: Path, name: str,
                                                         capsys: pytest.CaptureFixture) -> None:
    assert main(["run", *unnamed(tmp_path, latent_root, name)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "contradicts" in err and "'brushdata'" in err, err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("name", ["data=brushdata", "data.name=brushdata"])
def test_a_name_that_agrees_with_the_manifest_is_kept(tmp_path: Path, latent_root: Path, name: str) -> None:
    assert load_config(unnamed(tmp_path, latent_root, name)).data.name == "brushdata"


def test_a_manifest_without_a_source_labels_the_data_after_its_folder(tmp_path: Path, latent_root: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    latent_root = shutil.copytree(latent_root, tmp_path / "latent")  # the shared shards stay as encoded
    manifest = latent_root / "train" / "manifest.json"
    recorded = json.loads(manifest.read_text())
    del recorded["source"]  # as written before sources were recorded
    manifest.write_text(json.dumps(recorded))
    capsys.readouterr()
    assert load_config(unnamed(tmp_path, latent_root)).data.name == latent_root.name == "latent"
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1 and "records no source" in out and "'latent'" in out, out
    assert load_config(unnamed(tmp_path, latent_root, "data.name=brushdata")).data.name == "brushdata"


def test_synth_rows_name_every_generation_setting_that_differs_from_the_default() -> None:
    """One-object scenes are another distribution: their rows must not pool with the default scenes'."""
    assert data_label(DataConfig()) == "synth"
    assert data_label(DataConfig(n_val=2048)) == "synth"  # the held-out count is evaluation, not data
    assert data_label(DataConfig(max_objects=1)) == "synth-o11"
    assert data_label(DataConfig(n_train=5000, seed=1)) == "synth-n5000-s1"
    assert data_label(DataConfig(name="brushdata", path="/x")) == "brushdata"


def test_a_rule_arm_from_before_the_cosine_rule_keeps_its_run_id() -> None:
    """The cosine rule's fields are hashed only when set, so the growth rule's runs still resume."""
    def cfg(until: Until) -> RunConfig:
        run = RunConfig()
        run.arm.phases = [Phase(0.0, 0.3, until=until), Phase(0.0, 0.7)]
        return run

    growth = Until(skip_norm_growth_below=0.001, every=25)
    hashed = config_hash(cfg(growth))
    assert hashed == "350d08c10fbabd4284c827fdc61d23d93e02a0640a073efe64ecf76793d76211"  # as before the rule (06dd8fa), under crn-v3
    assert config_hash(cfg(Until(skip_norm_growth_below=0.001, every=25, probe_splits=5))) != hashed
