"""Encoding canonical shards with a tiny random VAE and a tiny random open_clip text tower."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import open_clip
import pytest
import torch
from diffusers import AutoencoderKL
from PIL import Image, ImageOps

from maskbench.data.encode import EncodeOptions, encode
from maskbench.data.pack import iter_tar_samples
from maskbench.data.shards import shard_urls
from maskbench.data.verify import verify


def test_latent_shards_have_declared_shapes_and_values(tmp_path: Path, opts: EncodeOptions, shards: Path) -> None:
    manifest = encode(shards, tmp_path / "lat", opts, progress=False)
    latent_info = manifest["latent"]
    assert manifest["total"] == 6 and [s["name"] for s in manifest["shards"]] == ["00200-000000.tar", "00201-000000.tar"]
    assert (latent_info["channels"], latent_info["size"], latent_info["text_len"], latent_info["text_dim"]) == (4, 16, 77, 32)
    assert latent_info["scaling_factor"] == 0.5 and latent_info["dtype"] == "float16"
    assert verify(tmp_path / "lat").ok

    key, fields = next(iter_tar_samples(Path(shard_urls(tmp_path / "lat")[0])))
    latent = np.load(io.BytesIO(fields["latent.npy"]), allow_pickle=False)
    text = np.load(io.BytesIO(fields["txtemb.npy"]), allow_pickle=False)
    assert latent.dtype == text.dtype == np.float16 and latent.shape == (4, 16, 16) and text.shape == (77, 32)
    canon = dict(next(iter_tar_samples(Path(shard_urls(shards)[0])))[1])
    assert fields["txt"] == canon["txt"]
    meta = json.loads(fields["json"])
    assert meta["id"] == key and meta["text_tokens"] == len(open_clip.get_tokenizer(opts.text_model).encode(canon["txt"].decode())) + 2

    vae = AutoencoderKL.from_pretrained(opts.vae)
    image = ImageOps.fit(Image.open(io.BytesIO(canon["jpg"])).convert("RGB"), (32, 32))
    pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1).float()[None] / 127.5 - 1.0  # 1×3×32×32
    with torch.no_grad():
        want = vae.encode(pixels).latent_dist.mean[0] * 0.5  # 4×16×16
    np.testing.assert_allclose(latent.astype(np.float32), want.numpy(), atol=2e-3, rtol=1e-2)
    assert np.abs(text).sum() > 0 and not np.allclose(text[0], text[1])


def test_encoding_resumes_and_refuses_other_options(tmp_path: Path, opts: EncodeOptions, shards: Path) -> None:
    first = encode(shards, tmp_path / "lat", opts, progress=False)
    (tmp_path / "lat" / ".parts" / "00201-000000.json").unlink()
    (tmp_path / "lat" / "00201-000000.tar").write_bytes(b"partial")
    again = encode(shards, tmp_path / "lat", opts, progress=False)
    assert again["shards"] == first["shards"] and verify(tmp_path / "lat").ok
    with pytest.raises(ValueError, match="other options"):
        encode(shards, tmp_path / "lat", EncodeOptions(**{**opts.__dict__, "resolution": 64}), progress=False)
    with pytest.raises(ValueError, match="VAE folder not found"):
        encode(shards, tmp_path / "lat2", EncodeOptions(vae=str(tmp_path / "nope")), progress=False)


def test_verify_checks_latent_shapes_against_the_manifest(tmp_path: Path, opts: EncodeOptions, shards: Path) -> None:
    encode(shards, tmp_path / "lat", opts, progress=False)
    manifest = json.loads((tmp_path / "lat" / "manifest.json").read_text())
    manifest["latent"]["size"] = 8
    (tmp_path / "lat" / "manifest.json").write_text(json.dumps(manifest))
    problems = verify(tmp_path / "lat").problems
    assert len(problems) == 6 and "latent.npy is float16[4, 16, 16], manifest says float16[4, 8, 8]" in problems[0]


CHILD = """
import sys, torch
from pathlib import Path
import maskbench.data.encode as enc
from accelerate import PartialState
commit = enc.commit_unit

def spy(out, name, *args):
    with open(Path(sys.argv[5]) / f"rank{PartialState().process_index}.log", "a") as log:
        log.write(name + "\\n")
    commit(out, name, *args)

enc.commit_unit = spy
enc.encode(sys.argv[2], sys.argv[3], enc.EncodeOptions(vae=sys.argv[4], text_model=sys.argv[1], resolution=32), progress=False)
"""


def arrays(shard_dir: Path) -> dict[str, np.ndarray]:
    return {f"{key}/{name}": np.load(io.BytesIO(fields[name]), allow_pickle=False)
            for url in shard_urls(shard_dir) for key, fields in iter_tar_samples(Path(url))
            for name in ("latent.npy", "txtemb.npy")}


@pytest.mark.slow
def test_two_processes_encode_disjoint_shards(tmp_path: Path, opts: EncodeOptions, shards: Path) -> None:
    """Under torchrun (gloo on CPU) each rank takes every other shard; the result equals one process."""
    (tmp_path / "child.py").write_text(CHILD)
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",  # a free port
         str(tmp_path / "child.py"), opts.text_model, str(shards), str(tmp_path / "lat2"), opts.vae, str(tmp_path)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "rank0.log").read_text().split() == ["00200-000000"]
    assert (tmp_path / "rank1.log").read_text().split() == ["00201-000000"]
    encode(shards, tmp_path / "lat1", opts, progress=False)
    two, one = arrays(tmp_path / "lat2"), arrays(tmp_path / "lat1")
    assert two.keys() == one.keys() and len(one) == 12
    for name in one:  # thread counts differ between the runs, so fp16 rounding may too
        np.testing.assert_allclose(two[name].astype(np.float32), one[name].astype(np.float32), atol=2e-3, rtol=1e-2)


def test_demoted_latents_are_the_vae_of_the_resized_image(tmp_path: Path, opts: EncodeOptions, shards: Path) -> None:
    """`--demote 0.75`: each sample also holds latent_0.75.npy = VAE(antialiased resize of the 32px image to
    24px) · scale, a 12×12 latent (16 × 0.75, a multiple of patch 2), listed in the manifest and verified."""
    manifest = encode(shards, tmp_path / "lat", EncodeOptions(**{**opts.__dict__, "demote": (0.75,)}), progress=False)
    assert manifest["latent"]["demote"] == {"0.75": 12} and verify(tmp_path / "lat").ok
    _, fields = next(iter_tar_samples(Path(shard_urls(tmp_path / "lat")[0])))
    stored = np.load(io.BytesIO(fields["latent_0.75.npy"]), allow_pickle=False).astype(np.float32)
    canon = dict(next(iter_tar_samples(Path(shard_urls(shards)[0])))[1])
    image = ImageOps.fit(Image.open(io.BytesIO(canon["jpg"])).convert("RGB"), (32, 32))
    pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1).float()[None] / 127.5 - 1.0  # 1×3×32×32
    small = torch.nn.functional.interpolate(pixels, size=(24, 24), mode="bilinear", antialias=True, align_corners=False)
    vae = AutoencoderKL.from_pretrained(opts.vae)
    with torch.no_grad():
        want = vae.encode(small).latent_dist.mean[0] * 0.5                     # 4×12×12, scale 0.5, shift 0
        native = vae.encode(pixels).latent_dist.mean * 0.5                     # 1×4×16×16
    np.testing.assert_allclose(stored, want.numpy(), atol=2e-3, rtol=1e-2)
    resized_latent = torch.nn.functional.interpolate(native, size=(12, 12), mode="bilinear", antialias=True)[0]
    assert np.abs(stored - resized_latent.numpy()).max() > 0.05               # not a resized native latent
