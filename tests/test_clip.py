"""CLIP score: the formula, offline weight resolution, and the scorer end to end on a small model."""

import numpy as np
import open_clip
import pytest
import torch

from maskbench.eval.clip import ClipScorer, clip_metrics, paired_cosines, resolve_pretrained
from maskbench.eval.fid import MissingWeights

SMALL_MODEL = "ViT-S-32-alt"  # 43M parameters: builds in well under a second


def test_paired_cosines_on_known_embeddings():
    image = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0]])
    text = torch.tensor([[1.0, 1.0], [0.0, 5.0], [-1.0, 0.0]])
    np.testing.assert_allclose(paired_cosines(image, text).numpy(), [2**-0.5, 1.0, -1.0], rtol=1e-6)


def test_clip_metrics_conventions():
    assert clip_metrics([0.2, 0.4]) == pytest.approx({"clip_cos": 0.3, "clip_score": 30.0})
    negative = clip_metrics(np.array([-0.3, 0.1]))
    assert negative["clip_cos"] == pytest.approx(-0.1) and negative["clip_score"] == 0.0


def test_uncached_tag_raises_missing_weights_at_once(tmp_path):
    with pytest.raises(MissingWeights) as info:
        ClipScorer("ViT-H-14", "laion2b_s32b_b79k", cache_dir=str(tmp_path))
    message = str(info.value)
    assert "\n" not in message and "eval.clip_weights=PATH" in message
    assert "laion/CLIP-ViT-H-14-laion2B-s32B-b79K" in message


def test_missing_file_and_unknown_tag(tmp_path):
    with pytest.raises(MissingWeights, match="eval.clip_weights=PATH"):
        resolve_pretrained(SMALL_MODEL, str(tmp_path / "nope.safetensors"))
    with pytest.raises(ValueError, match="neither a weights file nor an open_clip tag"):
        resolve_pretrained(SMALL_MODEL, "not_a_tag")


def test_tag_resolves_to_hf_cache_file(tmp_path):
    """A tag whose weights sit in the HF hub cache resolves to that file, with the tag's preprocessing."""
    repo = tmp_path / "models--laion--CLIP-ViT-H-14-laion2B-s32B-b79K"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "open_clip_model.safetensors").write_bytes(b"weights")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    path, tag_cfg = resolve_pretrained("ViT-H-14", "laion2b_s32b_b79k", cache_dir=str(tmp_path))
    assert path == str(snapshot / "open_clip_model.safetensors")
    assert tag_cfg["interpolation"] == "bicubic"


@pytest.fixture(scope="module")
def random_scorer():
    torch.manual_seed(0)
    return ClipScorer(SMALL_MODEL, pretrained=None, batch_size=2)


def test_random_scorer_end_to_end(random_scorer):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(3, 32, 32, 3), dtype=np.uint8)
    captions = ["a small red circle at the top left", "a large blue square at the bottom right", "a white triangle"]
    cosines = random_scorer(images, captions)
    assert random_scorer.is_random and random_scorer.model_label == f"{SMALL_MODEL}/random-init"
    assert cosines.shape == (3,) and np.all(np.abs(cosines) <= 1.0 + 1e-6)
    one_by_one = [random_scorer(images[i : i + 1], captions[i : i + 1])[0] for i in range(3)]
    np.testing.assert_allclose(cosines, one_by_one, rtol=1e-4, atol=1e-5)
    assert random_scorer(images[::-1], captions[::-1])[0] == pytest.approx(cosines[2], abs=1e-5)
    with pytest.raises(ValueError, match="captions"):
        random_scorer(images, captions[:2])


def test_local_weights_file_is_loaded(random_scorer, tmp_path):
    path = tmp_path / "clip.pt"
    torch.manual_seed(1)
    saved = open_clip.create_model(SMALL_MODEL).state_dict()
    torch.save(saved, path)
    scorer = ClipScorer(SMALL_MODEL, pretrained=str(path))
    assert not scorer.is_random
    loaded = scorer.model.state_dict()
    for name in ("visual.conv1.weight", "text_projection", "token_embedding.weight"):
        torch.testing.assert_close(loaded[name], saved[name])
    assert not torch.equal(loaded["visual.conv1.weight"], random_scorer.model.state_dict()["visual.conv1.weight"])
