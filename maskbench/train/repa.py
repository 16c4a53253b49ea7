"""REPA, representation alignment (sihyun-yu/REPA): one block's tokens, through a small trained MLP projector,
are pulled towards a frozen encoder's patch features of the clean image by a negative cosine similarity.

The authors' pieces, by file of sihyun-yu/REPA (docs/arms.md, the `repa` row and "REPA: how the alignment is
built", cites the lines):
    projector   models/sit.py: Linear -> SiLU -> Linear -> SiLU -> Linear, hidden 2048, xavier init
    the tap     models/sit.py: after block `encoder_depth` (counted from 1), every token projected
    the loss    loss.py: −cos(projected token, encoder token), averaged over tokens, then over the batch
    λ, depth    train.py: loss + proj_coeff · proj_loss, proj_coeff 0.5, encoder_depth 8;
                README.md: that default is for SiT-XL/2, 28 blocks (models/sit.py)
    encoder     train.py: DINOv2-B on the clean image, under no_grad, its `x_norm_patchtokens`, normalised with
                ImageNet's mean and std, resized so its patch grid is the latent token grid (224 px at 256)
With token dropping the aligned block may see only the kept tokens; the targets are then the encoder's tokens at
the kept positions, as SPRINT does when it combines the two (snap-research/Sprint src/scheduler/flow_matching.py,
its projector on the sparse path in src/models/sit.py; docs/arms.md, the `repa_mask75_then0` row, cites the lines).

Scaled to maskbench's models (docs/arms.md, REPA): the depth is the smallest whose share of the model's blocks
(mixer, backbone, decoder, in the order they run, as SPRINT counts) is at least the authors' 8 of 28; the
projector's hidden width keeps the authors' ratio to the model width, 2048 : 1152; λ = 0.5 as is.

The encoder: on real pixel data timm's DINOv2-B from a local file (the authors' default); latent shards carry no
pixels and decoding every batch with the VAE would cost more than the DiT's step, so REPA refuses them. On the
embedded synth data, `repa-synth-v2`: a small CNN shipped in maskbench/assets, pretrained self-supervised, as
DINOv2 is, on synth pixels only (`train/repa_pretrain.py`: dense InfoNCE between two views of each image; no scene,
caption or label, nothing of the evaluation). It is not the evaluation oracle (`oracle-synth-v1`), and it never saw
the attributes that oracle reads: aligning to a network trained on the metric's labels would game the metric.

`train.repa_encoder=random` is the control: a frozen, randomly initialised encoder of the same architecture
(`init_synth_encoder(RANDOM_SEED)`, on real pixels a random DINOv2-B), so that a gain from aligning to learnt
features reads against one from an extra loss alone. `encoder_pretrain_flops` is what each encoder cost to train.

    python -m maskbench.train.repa_pretrain --train   # re-train and rewrite the shipped synth encoder
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from maskbench.config import RunConfig
from maskbench.config.presets import ModelConfig, decoder_width
from maskbench.data import synth
from maskbench.data.dataset import DatasetInfo
from maskbench.errors import ConfigError
from maskbench.models.dit import DiT
from maskbench.models.kernels import gather_tokens
from maskbench.train import flops
from maskbench.weights import REGISTRY, weights_folder

AUTHORS_WEIGHT = 0.5                       # train.py: proj_coeff
AUTHORS_DEPTH, AUTHORS_BLOCKS = 8, 28      # train.py: encoder_depth, for SiT-XL/2's 28 blocks
AUTHORS_HIDDEN, AUTHORS_WIDTH = 2048, 1152  # models/sit.py: projector_dim, for SiT-XL/2's width

SYNTH_ENCODER = "repa-synth-v2"
SYNTH_WEIGHTS = Path(__file__).resolve().parents[1] / "assets" / "repa_synth_v2.safetensors"
SYNTH_RETRAIN = "python -m maskbench.train.repa_pretrain --train"
RANDOM = "random"                # train.repa_encoder's control: a frozen, randomly initialised encoder
RANDOM_DINOV2 = "random-dinov2"  # what RANDOM means on real pixels: DINOv2-B's architecture, random weights
RANDOM_SEED = 1                  # its init: the synth encoder's own before pretraining (repa_pretrain's seed 1)
SYNTH_SIZE = 32  # the side the synth encoder reads (its 8×8 map: one feature per 4×4-pixel patch)
# (in, out, kernel, stride) of the synth encoder's convolutions: 32×32 -> 8×8, a 32-pixel receptive field (a
# patch anywhere in a 16-pixel cell sees all of it); ~23 MFLOPs a 32-pixel image, ~5% of a micro_s training step's per sample.
SYNTH_LAYERS = ((3, 16, 3, 1), (16, 32, 4, 2), (32, 32, 3, 1), (32, 64, 4, 2), (64, 64, 3, 1), (64, 64, 3, 1))

DINOV2_MODEL = "vit_base_patch14_dinov2.lvd142m"  # train.py: dinov2-vit-b
DINOV2_FILE = next(entry.file for entry in REGISTRY if entry.name == "dinov2-vitb14")  # in a paths.weights folder
DINOV2_PATCH, DINOV2_WIDTH, DINOV2_DEPTH, DINOV2_MLP = 14, 768, 12, 4.0


def block_count(cfg: ModelConfig) -> int:
    """The blocks a token passes through, in order: mixer, backbone, decoder."""
    return cfg.mixer_depth + cfg.depth + cfg.decoder_depth


def default_depth(cfg: ModelConfig) -> int:
    """The smallest depth whose share of the blocks is at least the authors' 8 of 28 (8 on a 28-block model)."""
    return max(1, math.ceil(AUTHORS_DEPTH * block_count(cfg) / AUTHORS_BLOCKS))


def aligned_depth(cfg: RunConfig) -> int:
    """train.repa_depth, or the scaled default: the aligned block, counted from 1 over `block_count`'s order."""
    return cfg.train.repa_depth or default_depth(cfg.model)


def aligned_width(cfg: ModelConfig, depth: int) -> int:
    """The width of block `depth`'s tokens, the projector's input: the model's, or a MaskDiT decoder's narrower one."""
    return decoder_width(cfg) if depth > cfg.mixer_depth + cfg.depth else cfg.width


def projector_hidden(width: int) -> int:
    """The projector's hidden width at the authors' ratio to the model width (2048 at width 1152)."""
    return round(width * AUTHORS_HIDDEN / AUTHORS_WIDTH)


def aligned_block(model: DiT, depth: int) -> nn.Module:
    """Block `depth` (from 1) of the mixer, backbone and decoder blocks, in the order they run."""
    return [*model.mixer, *model.blocks, *model.decoder][depth - 1]


def make_projector(width: int, hidden: int, z_dim: int) -> nn.Sequential:
    """The authors' projector (models/sit.py; docs/arms.md cites the lines) with their init: `initialize_weights`
    runs after it is built and gives every Linear xavier-uniform weights and zero bias."""
    projector = nn.Sequential(nn.Linear(width, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(),
                              nn.Linear(hidden, z_dim))
    for layer in projector[::2]:
        nn.init.xavier_uniform_(layer.weight)
        nn.init.zeros_(layer.bias)
    return projector


def repa_loss(projected: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """−cos(projected, target) per token, averaged over tokens and samples (loss.py). B×N×Dz each -> scalar.

    Every sample holds the same number of tokens (all, or the K kept), so the mean over B×N is the authors'
    mean over tokens, then over the batch."""
    cosine = (F.normalize(projected.float(), dim=-1) * F.normalize(target.float(), dim=-1)).sum(-1)  # B×N
    return -cosine.mean()


# ---------------------------------------------------------------------------------------------- encoders
class SynthEncoder(nn.Module):
    """A small conv trunk: B×3×32×32 in [-1, 1] -> B×64×8×8, a feature for each 4×4-pixel patch.

    Pretrained without labels (`train/repa_pretrain.py`) so that each patch's feature tells what surrounds its
    place in the image apart from every other place and image, whatever the view's shift, brightness and noise."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for index, (c_in, c_out, kernel, stride) in enumerate(SYNTH_LAYERS):
            layers.append(nn.Conv2d(c_in, c_out, kernel, stride, padding=(kernel - stride + 1) // 2))
            if index < len(SYNTH_LAYERS) - 1:
                layers.append(nn.GELU())
        self.trunk = nn.Sequential(*layers)
        self.out_dim = SYNTH_LAYERS[-1][1]

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.shape[-1] != SYNTH_SIZE:
            images = F.interpolate(images, size=(SYNTH_SIZE, SYNTH_SIZE), mode="bilinear", antialias=True)
        return self.trunk(images)                                                     # B×64×8×8

    @staticmethod
    def forward_flops(batch: int) -> int:
        """Analytic forward FLOPs of `batch` images (the conv stack at SYNTH_SIZE)."""
        total, side = 0, SYNTH_SIZE
        for c_in, c_out, kernel, stride in SYNTH_LAYERS:
            side //= stride
            total += flops.conv_forward_flops(batch, c_in, c_out, kernel, side * side)
        return total


class DinoV2Encoder(nn.Module):
    """timm's DINOv2-B from a local weights file (None: timm's random init, the control), built for an input of
    14·grid pixels so that its patch tokens sit on the DiT's token grid (the authors' 224 px for a 16×16 latent
    grid). B×3×H×W in [-1, 1] -> B×768×h×w."""

    def __init__(self, weights: str | None, grid: tuple[int, int]) -> None:
        super().__init__()
        import timm

        self.size = (DINOV2_PATCH * grid[0], DINOV2_PATCH * grid[1])
        loaded = {"pretrained": True, "pretrained_cfg_overlay": {"file": weights}} if weights else {}
        self.model = timm.create_model(DINOV2_MODEL, num_classes=0, img_size=self.size, **loaded)
        config = self.model.pretrained_cfg
        self.register_buffer("mean", torch.tensor(config["mean"]).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(config["std"]).view(1, 3, 1, 1), persistent=False)
        self.out_dim = DINOV2_WIDTH

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = ((images + 1) / 2 - self.mean) / self.std                                 # B×3×H×W, as train.py
        x = F.interpolate(x, size=self.size, mode="bicubic")                          # B×3×14h×14w
        tokens = self.model.forward_features(x)[:, self.model.num_prefix_tokens:]    # B×hw×768, x_norm_patchtokens
        return tokens.transpose(1, 2).unflatten(2, self.model.patch_embed.grid_size)  # B×768×h×w

    @staticmethod
    def forward_flops(batch: int, grid: tuple[int, int]) -> int:
        """Analytic forward FLOPs: the ViT-B/14 on grid[0]·grid[1] patches and its class token."""
        return flops.vit_forward_flops(batch, grid[0] * grid[1], 1, DINOV2_PATCH, DINOV2_WIDTH, DINOV2_DEPTH,
                                       DINOV2_MLP)


def init_synth_encoder(seed: int) -> SynthEncoder:
    """A SynthEncoder at PyTorch's default init drawn from `seed`; the global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return SynthEncoder()


def random_dinov2(grid: tuple[int, int], seed: int = RANDOM_SEED) -> DinoV2Encoder:
    """DINOv2-B's architecture at timm's init drawn from `seed`, no weights file; the global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DinoV2Encoder(None, grid)


def frozen(encoder: nn.Module) -> nn.Module:
    """The encoder in eval mode with no parameter requiring a gradient: nothing in it ever trains."""
    return encoder.eval().requires_grad_(False)


def encoder_choice(cfg: RunConfig, data: DatasetInfo) -> str:
    """"synth", RANDOM (the synth architecture, random), RANDOM_DINOV2 or the DINOv2-B weights file REPA aligns to
    on this data; refuses latent data (ConfigError). train.repa_encoder=random is RANDOM on synth data, RANDOM_DINOV2
    on real pixels (the control of the encoder the default would load there)."""
    if data.latent:
        raise ConfigError("train.repa_weight: REPA's encoder reads pixels and latent shards carry none (decoding each "
                          "batch with the VAE would cost more than the DiT step): train REPA on pixel data")
    if cfg.train.repa_encoder == RANDOM:
        return RANDOM if data.synthetic else RANDOM_DINOV2
    if cfg.train.repa_encoder is not None:
        return cfg.train.repa_encoder
    if data.synthetic:
        return "synth"
    folder = weights_folder(cfg.paths.weights)
    if folder is None:
        raise ConfigError(f"train.repa_weight on real data needs DINOv2-B: give train.repa_encoder=PATH (timm's "
                          f"{DINOV2_MODEL} weights) or paths.weights=DIR holding {DINOV2_FILE}")
    return str(Path(folder) / DINOV2_FILE)


def load_encoder(choice: str, grid: tuple[int, int]) -> nn.Module:
    """The frozen encoder `encoder_choice` names."""
    if choice == "synth":
        return frozen(load_synth_encoder())
    if choice == RANDOM:
        return frozen(init_synth_encoder(RANDOM_SEED))
    if choice == RANDOM_DINOV2:
        return frozen(random_dinov2(grid))
    if not Path(choice).is_file():
        raise ConfigError(f"train.repa_encoder: no DINOv2 weights file at {choice} (timm's {DINOV2_MODEL})")
    return frozen(DinoV2Encoder(choice, grid))


def synth_architecture(choice: str) -> bool:
    return choice in ("synth", RANDOM)


def encoder_dim(choice: str) -> int:
    return SYNTH_LAYERS[-1][1] if synth_architecture(choice) else DINOV2_WIDTH


def encoder_flops(choice: str, grid: tuple[int, int]) -> int:
    """Forward FLOPs of the encoder on one image."""
    return SynthEncoder.forward_flops(1) if synth_architecture(choice) else DinoV2Encoder.forward_flops(1, grid)


# ------------------------------------------------------------------------------------------- alignment
class Repa(nn.Module):
    """REPA's trainable part, the projector, with the tap on the training model's aligned block.

    The frozen encoder is held in a tuple, so it is no submodule: not in `parameters()` (so not in the optimizer,
    the gradient clipping or DDP), not in `state_dict()` (checkpoints stay small), and never in the DiT's EMA.
    `forward(x0, keep_idx)` reads the tokens the tap kept in the model's last forward and returns λ·L_REPA."""

    def __init__(self, model: DiT, depth: int, encoder: nn.Module, weight: float) -> None:
        super().__init__()
        self.depth, self.weight, self.grid = depth, weight, model.grid
        self.projector = make_projector(aligned_width(model.cfg, depth), projector_hidden(model.cfg.width),
                                        encoder.out_dim)
        self.frozen = (encoder,)
        self.tokens: torch.Tensor | None = None
        # A forward hook, not a return path in the DiT: activation checkpointing and compile keep module hooks.
        self.hook = aligned_block(model, depth).register_forward_hook(self._keep)

    @property
    def encoder(self) -> nn.Module:
        return self.frozen[0]

    def _keep(self, _block: nn.Module, _inputs: tuple, output: torch.Tensor) -> None:
        self.tokens = output                                                          # B×N×D, N = L or K

    @torch.no_grad()
    def targets(self, x0: torch.Tensor, keep_idx: torch.Tensor | None, tokens: int) -> torch.Tensor:
        """The encoder's features of the clean images on the DiT's token grid, at the aligned tokens' positions.

        B×C×H×W -> B×N×Dz: all L positions when the aligned block sees every token, the kept ones otherwise. A
        feature map of another size than the grid is resampled to it (bilinear; the identity at the same size)."""
        features = self.encoder(x0).float()                                           # B×Dz×h×w
        if features.shape[-2:] != self.grid:
            features = F.interpolate(features, size=self.grid, mode="bilinear", antialias=True)  # B×Dz×gh×gw
        features = features.flatten(2).transpose(1, 2)                               # B×L×Dz
        if tokens == features.shape[1]:
            return features
        if keep_idx is None or tokens != keep_idx.shape[1]:
            raise ValueError(f"REPA: the aligned block saw {tokens} tokens, neither all {features.shape[1]} nor the "
                             "kept ones: align a block outside a routed span (train.repa_depth)")
        return gather_tokens(features, keep_idx, impl="torch")                        # B×K×Dz

    def forward(self, x0: torch.Tensor, keep_idx: torch.Tensor | None) -> torch.Tensor:
        tokens, self.tokens = self.tokens, None
        if tokens is None:
            raise RuntimeError("REPA: the aligned block has not run since the last alignment (call the model first)")
        target = self.targets(x0, keep_idx, tokens.shape[1])                         # B×N×Dz
        return self.weight * repa_loss(self.projector(tokens), target)               # B×N×D -> B×N×Dz -> scalar


def make_repa(cfg: RunConfig, data: DatasetInfo, model: DiT) -> Repa | None:
    """REPA for this run on `model` (the training model, after its EMA copy: the hook must not be copied), or None
    when train.repa_weight is 0."""
    if not cfg.train.repa_weight:
        return None
    choice = encoder_choice(cfg, data)
    device = next(model.parameters()).device
    encoder = load_encoder(choice, model.grid).to(device)
    return Repa(model, aligned_depth(cfg), encoder, cfg.train.repa_weight).to(device)


def repa_sample_flops(cfg: RunConfig, data: DatasetInfo, mask_ratio: float) -> int:
    """REPA's FLOPs per training sample at this mask ratio (0 when off): `flops.repa_step_flops`."""
    if not cfg.train.repa_weight:
        return 0
    choice, side = encoder_choice(cfg, data), data.image_size // cfg.model.patch_size
    return flops.repa_step_flops(cfg.model, data.image_size, 1, mask_ratio, aligned_depth(cfg),
                                 projector_hidden(cfg.model.width), encoder_dim(choice),
                                 encoder_flops(choice, (side, side)))


# ------------------------------------------------------------------------------- the shipped synth encoder
PRETRAIN_FLOPS_KEY = "pretrain_flops"


def synth_metadata(train_args: dict, pretrain_flops: int | None = None) -> dict[str, str]:
    metadata = {"encoder": SYNTH_ENCODER, "synth": json.dumps(synth.renderer_params()),
                "train": json.dumps(train_args), "layers": json.dumps(SYNTH_LAYERS), "labels": "none"}
    if pretrain_flops is not None:
        metadata[PRETRAIN_FLOPS_KEY] = str(int(pretrain_flops))
    return metadata


def save_synth_encoder(encoder: SynthEncoder, path: str | Path, train_args: dict, pretrain_flops: int) -> None:
    """The trunk's weights with what they depend on and what they cost (`pretrain_flops`) in the metadata."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(encoder.state_dict(), str(path), metadata=synth_metadata(train_args, pretrain_flops))


def synth_file_metadata(path: str | Path = SYNTH_WEIGHTS) -> dict[str, str]:
    """The shipped synth encoder's metadata; refuses weights trained for another renderer or architecture."""
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    expected = synth_metadata({})
    if any(metadata.get(key) != expected[key] for key in ("encoder", "synth", "layers")):
        raise ConfigError(f"{path} was trained for other synth parameters or is not {SYNTH_ENCODER}: run "
                          f"`{SYNTH_RETRAIN}`")
    return metadata


def load_synth_encoder(path: str | Path = SYNTH_WEIGHTS) -> SynthEncoder:
    """The shipped synth encoder (checked by `synth_file_metadata`)."""
    synth_file_metadata(path)
    encoder = SynthEncoder()
    encoder.load_state_dict(load_file(str(path)))
    return encoder


def synth_pretrain_flops(path: str | Path = SYNTH_WEIGHTS) -> float:
    """What pretraining the synth encoder in `path` cost, from its metadata (`repa_pretrain.pretrain_flops`)."""
    metadata = synth_file_metadata(path)
    if PRETRAIN_FLOPS_KEY not in metadata:
        raise ConfigError(f"{path} records no {PRETRAIN_FLOPS_KEY}: run `{SYNTH_RETRAIN}`")
    return float(metadata[PRETRAIN_FLOPS_KEY])


def encoder_pretrain_flops(cfg: RunConfig, data: DatasetInfo) -> float:
    """FLOPs spent training REPA's frozen encoder before this run, not counted in its budget: 0 without REPA and
    for the random control; the shipped synth encoder's, read from its file; NaN, unknown, for DINOv2-B (distilled
    from a ViT-g on LVD-142M: no FLOPs count of that training is cited here, so none is made up)."""
    if not cfg.train.repa_weight:
        return 0.0
    choice = encoder_choice(cfg, data)
    if choice == "synth":
        return synth_pretrain_flops()
    if choice in (RANDOM, RANDOM_DINOV2):
        return 0.0
    return math.nan
