"""The real path on latent shards: encode -> reference statistics -> train -> decode -> FID, CLIP, grid.

Real weights cannot be downloaded here, so the VAE, the CLIP and the Inception are the small random
stand-ins of `maskbench.eval.standins`, loaded through the same code as real files.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from PIL import Image

from maskbench.cli import main
from maskbench.config import load_config, run_id
from maskbench.data.dataset import DatasetInfo, VaeSpec
from maskbench.data.encode import EncodeOptions, encode
from maskbench.data.pack import iter_tar_samples
from maskbench.data.shards import shard_urls
from maskbench.data.synth import write_synth
from maskbench.eval import standins
from maskbench.eval.decode import LatentDecoder
from maskbench.eval.evaluate import load_eval_set
from maskbench.eval.fid import STANDIN_FEATURES_NAME, FeatureStats, InceptionFeatures, frechet_of_features, load_stats
from maskbench.eval.grid import upscale_factor
from maskbench.eval.oracle import load_oracle
from maskbench.eval.sample import fixed_noise, to_uint8
from maskbench.results.rows import read_rows
from maskbench.runs.launch import train


@pytest.fixture
def latent_root(tmp_path: Path, opts: EncodeOptions, shards: Path) -> Path:
    root = tmp_path / "latent"
    encode(shards, root / "train", opts, progress=False)
    encode(shards, root / "val", opts, progress=False)   # a real run encodes a held-out split here
    return root


def run_overrides(tmp_path: Path, root: Path, *extra: str) -> list[str]:
    return [
        f"paths.runs={tmp_path / 'runs'}", f"paths.leaderboard={tmp_path / 'lb.csv'}", f"data.path={root}",
        "data.name=brushdata", "model.patch_size=2", "model.width=32", "model.depth=1", "model.heads=2",
        "train.batch_size=2", "budget.flops=3.5e8", "eval.points=[0.5,1.0]", "eval.n_samples=4", "eval.val_samples=4",
        "eval.sampler_steps=2", "eval.grid_size=4", "data.shuffle_buffer=4", *extra,
    ]


def test_latent_run_decodes_samples_and_scores_fid_and_clip(tmp_path: Path, opts: EncodeOptions, latent_root: Path,
                                                            shards: Path) -> None:
    inception = standins.write_inception(tmp_path / "standin-inception.pt")
    dinov2 = tmp_path / "random-vit.pth"  # a random small timm ViT in DINOv2's place: plumbing, not FD-DINOv2
    torch.save(timm.create_model("vit_tiny_patch16_224", num_classes=0).state_dict(), dinov2)
    assert main(["eval", "reference", str(latent_root / "val"), f"eval.inception_weights={inception}",
                 "eval.dinov2_model=vit_tiny_patch16_224", f"eval.dinov2_weights={dinov2}"]) == 0
    reference = load_stats(latent_root / "val" / "inception_stats.npz")
    assert (reference.resolution, reference.n, reference.source) == (32, 6, str(shards.resolve()))
    assert load_stats(latent_root / "val" / "dinov2_stats.npz").mu.shape == (192,)

    # data.path alone names the data (tests/test_data_label.py): the run is named after its shards' source
    overrides = [item for item in run_overrides(tmp_path, latent_root, f"eval.inception_weights={inception}",
                                                f"eval.clip_model={opts.text_model}",
                                                "eval.dinov2_model=vit_tiny_patch16_224",
                                                f"eval.dinov2_weights={dinov2}") if not item.startswith("data.name=")]
    cfg = load_config(overrides)
    assert cfg.data.name == "brushdata" and run_id(cfg).startswith(f"{cfg.arm.name}-brushdata-")
    run_dir = train(cfg)
    assert run_dir.name == run_id(cfg)
    rows = read_rows([tmp_path / "lb.csv"])
    assert [row["point"] for row in rows] == [0.5, 1.0] and {row["dataset"] for row in rows} == {"brushdata"}
    for row in rows:
        assert row["resolution"] == 16 and row["val_loss"] > 0 and row["fid"] > 0
        assert row["fid_features"] == STANDIN_FEATURES_NAME and row["fid_n"] == 4 and row["fid_ref"] == reference.label
        assert row["clip_model"] == opts.text_model and row["clip_cos"] is not None and row["clip_score"] >= 0
        assert row["fd_dinov2"] > 0 and row["fd_dinov2_features"] == "vit_tiny_patch16_224"
    samples = run_dir / "samples" / "point-1"
    assert np.asarray(Image.open(samples / "00000.png")).shape == (32, 32, 3)   # decoded, not the 16×16 latent
    width, height = Image.open(samples / "grid.png").size                      # 2×2 decoded samples, enlarged
    assert width >= 2 * 32 * upscale_factor(32) and height > width             # with prompts under the tiles
    assert len(list(samples.glob("[0-9]*.png"))) == 4

    assert main(["repro", str(run_dir)]) == 0                                    # metrics recomputed from the PNGs


def test_latent_run_without_image_metric_inputs_is_refused_before_training(
        tmp_path: Path, latent_root: Path, shards: Path, capsys: pytest.CaptureFixture) -> None:
    inception = standins.write_inception(tmp_path / "standin-inception.pt")
    with_weights = f"eval.inception_weights={inception}"
    other_size = tmp_path / "ref64" / "inception_stats.npz"
    assert main(["eval", "reference", str(shards), "--size", "64",
                 f"eval.inception_weights={inception}", "--out", str(other_size)]) == 0
    cases = {
        "Inception weights not configured": [],
        "no reference statistics at": [with_weights],
        "VAE not found at": [with_weights, f"eval.vae={tmp_path / 'no-vae'}"],
        "are of 64px images; the samples will be 32px": [with_weights, f"eval.reference_stats={other_size}"],
    }
    capsys.readouterr()
    for message, extra in cases.items():
        assert main(["run", *run_overrides(tmp_path, latent_root, *extra)]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "runs").exists()                                      # refused before any run directory


def test_a_missing_recorded_vae_is_refused(tmp_path: Path, opts: EncodeOptions, latent_root: Path,
                                           capsys: pytest.CaptureFixture) -> None:
    inception = standins.write_inception(tmp_path / "standin-inception.pt")
    main(["eval", "reference", str(latent_root / "val"), f"eval.inception_weights={inception}"])
    Path(opts.vae, "config.json").unlink()                                       # the VAE the manifest records
    capsys.readouterr()
    assert main(["run", *run_overrides(tmp_path, latent_root, f"eval.inception_weights={inception}")]) == 2
    assert "pass eval.vae=PATH" in capsys.readouterr().err


def fit_vae(images: torch.Tensor, steps: int = 160):
    """A stand-in VAE trained briefly to reconstruct `images`: decoding then has something to invert."""
    torch.manual_seed(0)
    vae = standins.make_vae()
    optimizer = torch.optim.Adam(vae.parameters(), lr=3e-3)
    for _ in range(steps):
        batch = images[torch.randint(len(images), (16,))]                        # 16×3×32×32
        loss = (vae.decode(vae.encode(batch).latent_dist.mean).sample - batch).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return vae


def test_decoded_held_out_latents_score_far_below_decoded_noise(tmp_path: Path) -> None:
    synth = write_synth(tmp_path / "synth", n_train=128, n_val=64, seed=0, shard_size=64)
    pixels = DatasetInfo("synth", synth / "train", synth / "train", 32, 3, False, 0, 0)  # trains the VAE
    fit_vae(load_eval_set(pixels, 128).images).save_pretrained(tmp_path / "vae")
    clip = standins.write_clip(tmp_path / "standin-clip")
    encode(synth / "val", tmp_path / "latent-val", EncodeOptions(vae=str(tmp_path / "vae"), text_model=clip,
                                                                 resolution=32), progress=False)
    inception = standins.write_inception(tmp_path / "standin-inception.pt")
    assert main(["eval", "reference", str(tmp_path / "latent-val"), f"eval.inception_weights={inception}"]) == 0
    reference = load_stats(tmp_path / "latent-val" / "inception_stats.npz")
    manifest = json.loads((tmp_path / "latent-val" / "manifest.json").read_text())
    decoder = LatentDecoder(VaeSpec.from_manifest(manifest["latent"]), torch.device("cpu"))
    latents = DatasetInfo("synth", synth / "val", tmp_path / "latent-val", 16, 4, True, 32, 77)
    pixels_val = DatasetInfo("synth", synth / "train", synth / "val", 32, 3, False, 0, 0)
    held_out = load_eval_set(latents, 64).images                                 # 64×4×16×16
    noise = fixed_noise(range(64), tuple(held_out.shape[1:]), 0)                 # the sampler's starting point
    inception_fid = fid_against(reference, InceptionFeatures(str(inception)), decoder)
    # The stand-in Inception is random; the synth oracle is a trained network of these very scenes.
    oracle = load_oracle()
    oracle_reference = FeatureStats.from_features(oracle(to_uint8(load_eval_set(pixels_val, 64).images)), oracle.name)
    oracle_fd = fid_against(oracle_reference, oracle, decoder)
    fid_held_out, fid_noise = inception_fid(held_out), inception_fid(noise)
    fd_held_out, fd_noise = oracle_fd(held_out), oracle_fd(noise)
    print(f"decoded held-out latents / decoded noise: stand-in FID {fid_held_out:.2f} / {fid_noise:.2f}, "
          f"oracle FD {fd_held_out:.0f} / {fd_noise:.0f}")
    assert fid_held_out * 2 < fid_noise
    assert fd_held_out * 5 < fd_noise


def fid_against(reference: FeatureStats, features, decoder: LatentDecoder):
    """Fréchet distance of decoded latents to `reference`, in the feature space of `features` (the evaluator's
    point value: 64 rows of 2048-d features, one 64×64 eigen-decomposition instead of a 2048×2048 one)."""
    def fid(latents: torch.Tensor) -> float:
        return frechet_of_features(features(to_uint8(decoder(latents))), reference, features.name)
    return fid


def test_latent_demotion_end_to_end_with_a_small_random_vae(tmp_path: Path, opts: EncodeOptions, shards: Path,
                                                            monkeypatch) -> None:
    """encode --demote 0.75,0.5 -> train a route table on the demoted latents (the exact FLOPs plan) -> probe
    them with the round-trip control; a route whose ratio was not encoded is refused before any work."""
    from maskbench.errors import ConfigError
    from maskbench.models import objective
    from maskbench.runs.gradfid import probe_gradfid
    from maskbench.train.schedule import make_schedule
    from tests.conftest import new_trainer

    root = tmp_path / "latent"
    demoting = EncodeOptions(**{**opts.__dict__, "demote": (0.75, 0.5)})
    for split in ("train", "val"):
        encode(shards, root / split, demoting, progress=False)
    routes = "train.demote_routes=[{ratio: 0.75, t: [0.0, 0.6], priority: 1}, {ratio: 0.5, t: [0.5, 1.0]}]"
    cfg = load_config(run_overrides(tmp_path, root, "arm=mask0", routes, "eval.points=[1.0]"))
    inputs: list[torch.Tensor] = []
    original = objective.flow_loss
    monkeypatch.setattr(objective, "flow_loss", lambda model, x0, *a, **k: inputs.append(x0.detach()) or
                        original(model, x0, *a, **k))
    trainer = new_trainer(cfg)
    run = trainer.fit()
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1]["flops"] == trainer.progress.schedule.total_flops == make_schedule(cfg, trainer.data, 1).total_flops
    assert {x.shape[-1] for x in inputs} >= {12, 8}                               # 16 × 0.75 and 16 × 0.5 latents
    encoded = [torch.from_numpy(np.load(io.BytesIO(fields["latent_0.5.npy"])).astype(np.float32))
               for url in shard_urls(root / "train") for _, fields in iter_tar_samples(Path(url))]
    halves = [sample for x in inputs if x.shape[-1] == 8 for sample in x]         # 4×8×8 each
    assert halves and all(any(torch.equal(h, e) for e in encoded) for h in halves)  # the stored VAE latents, not pooled
    rows = probe_gradfid(run, bins=1, batches=3, batch_size=2, ratios=(0.75,))
    assert [row["route"] for row in rows] == ["mask50", "mask75", "sprint75", "demote0.75", "native2", "roundtrip"]
    roundtrip = rows[-1]
    demoted = rows[3]
    assert demoted["gap"] == pytest.approx((1 - demoted["cosine"]) - (1 - roundtrip["cosine"]), nan_ok=True)
    with pytest.raises(ConfigError, match="--demote 0.875"):
        new_trainer(load_config(run_overrides(tmp_path, root, "arm=mask0", "train.demote_routes=[{ratio: 0.875, t: [0, 1]}]")))
