"""The synth oracle: a small CNN that reads every cell's shape, colour and size off a synth image.

Because the embedded dataset is drawn procedurally, its attributes are known exactly, so a tiny
classifier trained once on freshly rendered scenes gives two metrics without any download:
(a) a Fréchet distance in its penultimate feature space, named `oracle-synth-v1` (never passed
off as Inception FID), and (b) a GenEval-style alignment: the fraction of samples whose detected
attributes match their prompt's scene exactly. Its weights ship in maskbench/assets; the synth
parameters they were trained for are stored in the file and checked on load.

    python -m maskbench.eval.oracle --train   # re-train and rewrite the shipped weights
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from maskbench.data import synth
from maskbench.errors import ConfigError
from maskbench.eval.fid import as_uint8_images

ORACLE_NAME = "oracle-synth-v1"
WEIGHTS_PATH = Path(__file__).resolve().parents[1] / "assets" / "oracle_synth_v1.safetensors"
HEAD_CLASSES = {"shape": len(synth.SHAPES) + 1, "colour": len(synth.COLOURS), "size": len(synth.SIZES)}


class OracleNet(nn.Module):
    """Conv trunk down to a 2×2 map, one position per cell (row-major, as synth.POSITIONS), with
    heads shared by the cells: each cell's embedding is classified the same way wherever it sits."""

    def __init__(self, width: int = 16, cell_dim: int = 32):
        super().__init__()
        self.trunk = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.GELU(),  # 32×32
            nn.Conv2d(width, 2 * width, 4, stride=2, padding=1), nn.GELU(),  # 16×16
            nn.Conv2d(2 * width, 2 * width, 3, padding=1), nn.GELU(),  # 16×16
            nn.Conv2d(2 * width, 4 * width, 4, stride=2, padding=1), nn.GELU(),  # 8×8
            nn.Conv2d(4 * width, 4 * width, 4, stride=2, padding=1), nn.GELU(),  # 4×4
            nn.Conv2d(4 * width, cell_dim, 2, stride=2), nn.GELU(),  # 2×2: one vector per cell
        )
        self.heads = nn.ModuleDict({name: nn.Linear(cell_dim, n) for name, n in HEAD_CLASSES.items()})

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """uint8 N×32×32×3 -> (features N×(4·cell_dim), logits {name: N×4×classes})."""
        x = images.permute(0, 3, 1, 2).float() / 127.5 - 1.0  # N×3×32×32 in [-1, 1]
        cells = self.trunk(x).flatten(2).transpose(1, 2)  # N×4×cell_dim, cells in POSITIONS order
        logits = {name: head(cells) for name, head in self.heads.items()}  # name -> N×4×classes
        return cells.flatten(1), logits  # N×(4·cell_dim)


def oracle_loss(logits: dict[str, torch.Tensor], labels: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum of per-attribute cross-entropies; empty cells carry synth.NO_LABEL for colour and size."""
    return sum(
        F.cross_entropy(logits[name].flatten(0, 1), labels[name].flatten(), ignore_index=synth.NO_LABEL)
        for name in HEAD_CLASSES
    )


def render_batch(rng: np.random.Generator, n: int) -> tuple[np.ndarray, list[synth.Scene]]:
    """n freshly drawn scenes and their images (N×32×32×3 uint8), all from `rng`."""
    scenes = [synth.sample_scene(rng) for _ in range(n)]
    return np.stack([synth.render(scene, rng, synth.ORACLE_IMAGE_SIZE) for scene in scenes]), scenes


def stack_labels(scenes: Sequence[synth.Scene]) -> dict[str, np.ndarray]:
    """synth.cell_labels for a batch: {name: N×4 int64}."""
    per_scene = [synth.cell_labels(scene) for scene in scenes]
    return {name: np.stack([labels[name] for labels in per_scene]) for name in HEAD_CLASSES}


def train_oracle(
    seed: int = 0, n_train: int = 20_000, steps: int = 300, batch_size: int = 64, lr: float = 3e-3
) -> OracleNet:
    """Train on `n_train` images rendered in memory from `seed`; same seed, same weights (on CPU).

    One-cycle LR: the task is easy, and annealing to zero is what takes the oracle from "mostly
    right" to the near-perfect exact-scene accuracy an evaluation instrument needs.
    """
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    images, scenes = render_batch(rng, n_train)
    images_t, labels = torch.from_numpy(images), {k: torch.from_numpy(v) for k, v in stack_labels(scenes).items()}
    net = OracleNet()
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        index = torch.randint(n_train, (batch_size,), generator=generator)  # B
        _, logits = net(images_t[index])
        loss = oracle_loss(logits, {k: v[index] for k, v in labels.items()})
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    return net.eval()


class Oracle:
    """Batch-oriented wrapper of a trained OracleNet; also a fid.FeatureExtractor (`name`, `__call__`)."""

    name = ORACLE_NAME

    def __init__(self, net: OracleNet, device: str | torch.device = "cpu", batch_size: int = 512):
        self.device = torch.device(device)
        self.net = net.to(self.device).eval()
        self.batch_size = batch_size

    @torch.no_grad()
    def _run(self, images: np.ndarray | torch.Tensor) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """-> features N×F and per-cell class indices {name: N×4}, in batches of `batch_size`."""
        images = as_uint8_images(images)
        if images.shape[1:3] != (synth.ORACLE_IMAGE_SIZE, synth.ORACLE_IMAGE_SIZE):
            size = f"{images.shape[1]}×{images.shape[2]}"
            raise ValueError(f"the oracle reads {synth.ORACLE_IMAGE_SIZE}×{synth.ORACLE_IMAGE_SIZE} synth images, got {size}")
        features, classes = [], {name: [] for name in HEAD_CLASSES}
        for start in range(0, len(images), self.batch_size):
            batch = torch.from_numpy(images[start : start + self.batch_size]).to(self.device)  # B×32×32×3
            batch_features, logits = self.net(batch)
            features.append(batch_features.cpu().numpy())  # B×F
            for name, cell_logits in logits.items():
                classes[name].append(cell_logits.argmax(-1).cpu().numpy())  # B×4
        return np.concatenate(features), {name: np.concatenate(c) for name, c in classes.items()}

    def features(self, images: np.ndarray | torch.Tensor) -> np.ndarray:
        """Penultimate features N×128, for the Fréchet distance."""
        return self._run(images)[0]

    __call__ = features

    def predict(self, images: np.ndarray | torch.Tensor) -> dict[str, np.ndarray]:
        """Detected labels in synth.cell_labels' form, batched ({name: N×4}): colour and size are
        synth.NO_LABEL where the cell is seen as empty, so predictions and labels compare with ==."""
        classes = self._run(images)[1]
        occupied = classes["shape"] > 0  # N×4
        return {name: c if name == "shape" else np.where(occupied, c, synth.NO_LABEL) for name, c in classes.items()}

    def matches(self, images: np.ndarray | torch.Tensor, scenes: Sequence[synth.Scene]) -> np.ndarray:
        """Whether each image's every cell matches its prompt's scene (shape-or-empty; colour and size
        where occupied): N booleans."""
        if len(scenes) != len(images):
            raise ValueError(f"got {len(images)} images but {len(scenes)} scenes")
        predicted, expected = self.predict(images), stack_labels(scenes)
        return np.logical_and.reduce([(predicted[k] == expected[k]).all(axis=1) for k in HEAD_CLASSES])  # N

    def alignment(self, images: np.ndarray | torch.Tensor, scenes: Sequence[synth.Scene]) -> float:
        """Fraction of images that match their prompt's scene exactly."""
        return float(self.matches(images, scenes).mean())


def save_oracle(net: OracleNet, path: str | Path, train_args: dict) -> None:
    metadata = {"fid_features": ORACLE_NAME, "synth": json.dumps(synth.renderer_params()), "train": json.dumps(train_args)}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(net.state_dict(), str(path), metadata=metadata)


def load_oracle(path: str | Path = WEIGHTS_PATH, device: str | torch.device = "cpu") -> Oracle:
    """The shipped oracle; refuses weights trained for a different synth renderer."""
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    if metadata.get("fid_features") != ORACLE_NAME or json.loads(metadata.get("synth", "null")) != synth.renderer_params():
        retrain = "python -m maskbench.eval.oracle --train"
        raise ConfigError(f"{path} was trained for other synth parameters: run `{retrain}`")
    net = OracleNet()
    net.load_state_dict(load_file(str(path)))
    return Oracle(net, device)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train the synth oracle and write its weights.")
    parser.add_argument("--train", action="store_true", required=True)
    parser.add_argument("--out", type=Path, default=WEIGHTS_PATH)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-train", type=int, default=20_000)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    train_args = {"seed": args.seed, "n_train": args.n_train, "steps": args.steps}
    start = time.perf_counter()
    net = train_oracle(**train_args)
    seconds = time.perf_counter() - start
    save_oracle(net, args.out, train_args)
    images, scenes = render_batch(np.random.default_rng(args.seed + 12345), 2_000)
    accuracy = Oracle(net).alignment(images, scenes)
    print(f"trained in {seconds:.0f} s; held-out exact-scene accuracy {accuracy:.4f}; wrote {args.out}")


if __name__ == "__main__":
    main()
