"""The DiT's configuration and its presets: plain data, importable without torch.

The command line composes configs (and answers `--help`, `arms`, `sweep --emit`) from these alone, so
they live apart from the network in `dit.py`, which needs torch and timm.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Callable


Kernels = StrEnum("Kernels", "auto torch triton")              # gather/scatter: auto is Triton on CUDA
LongSkip = StrEnum("LongSkip", "none concat_ln concat")       # concat_ln: Skip-DiT's fusion; concat: U-ViT's
# ScaleLong's coefficient on each long skip: kappa (CS, kappa^(N-1-j) on the j-th skip fused, innermost first),
# constant (1/sqrt(2) on every skip, its control), learned_shared / learned_per_skip (LS, a per-token gate).
SkipScale = StrEnum("SkipScale", "none kappa constant learned_shared learned_per_skip")
LEARNED_SKIP_SCALES = (SkipScale.learned_shared, SkipScale.learned_per_skip)
SKIP_GATE_REDUCTION = 16  # ScaleLong's LS gate: an MLP over the L tokens with L // 16 hidden units
# The long-skip fusion layers' init (`DiT.init_skips`): dit = xavier like every DiT Linear; skipdit = PyTorch's
# own Linear/LayerNorm init, as Skip-DiT leaves them; identity = the fused output starts as the running tokens.
SkipInit = StrEnum("SkipInit", "dit skipdit identity")


@dataclass
class ModelConfig:
    """Architecture of the DiT; plain fields so OmegaConf can compose it from YAML."""

    name: str = "tiny"
    patch_size: int = 4
    width: int = 128
    depth: int = 4            # backbone blocks, run on kept tokens only
    heads: int = 4
    mixer_depth: int = 0      # patch-mixer blocks on ALL tokens before dropping (MicroDiT); 0 = MaskDiT-style early drop
    mlp_ratio: float = 4.0
    text_width: int = 64      # width of the small trainable synth text encoder
    text_depth: int = 2
    text_len: int = 32        # caption context length (tokens) for the synth text encoder
    kernels: Kernels = Kernels.auto  # passed to gather/scatter
    structured_mask: bool = False  # SPRINT-style: keep one token per 2x2 group (only at mask 0.75)
    long_skip: LongSkip = LongSkip.none
    skip_scale: SkipScale = SkipScale.none
    skip_kappa: float = 0.5   # ScaleLong's kappa (skip_scale=kappa); its code's default
    skip_init: SkipInit = SkipInit.dit  # how the long-skip fusion layers start (matters most when converting)
    decoder_depth: int = 0    # MaskDiT: blocks on all L tokens after refilling dropped slots with a mask token


def tiny() -> ModelConfig: return ModelConfig()
# MicroDiT-shaped (deferred masking): a patch mixer on all tokens before the drop, about MicroDiT's
# 6 mixer : 28 backbone blocks. micro_s is tiny plus one mixer block: the mission arms' default model.
def micro_xs() -> ModelConfig: return ModelConfig(name="micro_xs", width=64, heads=2, mixer_depth=1)
def micro_s() -> ModelConfig: return ModelConfig(name="micro_s", mixer_depth=1)
def micro_m() -> ModelConfig: return ModelConfig(name="micro_m", width=192, depth=6, heads=6, mixer_depth=1)
# Depth 12 (6 long skips, as ScaleLong's CIFAR-10 U-ViT) at tiny's cost per step: at width 72, 12 blocks cost
# what tiny's 4 at width 128 do (28.8 GFLOPs per unmasked synth step against 28.5; tests/test_flops.py).
def tiny_deep() -> ModelConfig: return ModelConfig(name="tiny_deep", depth=12, width=72, heads=4)
def dit_s2() -> ModelConfig: return ModelConfig(name="dit_s2", depth=12, width=384, heads=6, patch_size=2)
def dit_b2() -> ModelConfig: return ModelConfig(name="dit_b2", depth=12, width=768, heads=12, patch_size=2)
def dit_l2() -> ModelConfig: return ModelConfig(name="dit_l2", depth=24, width=1024, heads=16, patch_size=2)
def dit_xl2() -> ModelConfig: return ModelConfig(name="dit_xl2", depth=28, width=1152, heads=16, patch_size=2)
# MicroDiT's XL/2 shape at one width (its mixer is 768 wide, its backbone 1024 and mixture-of-experts: not modelled).
def microdit_xl2() -> ModelConfig: return ModelConfig(name="microdit_xl2", depth=28, width=1024, heads=16,
                                                      patch_size=2, mixer_depth=6)


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "tiny": tiny, "tiny_deep": tiny_deep, "micro_xs": micro_xs, "micro_s": micro_s, "micro_m": micro_m,
    "dit_s2": dit_s2, "dit_b2": dit_b2, "dit_l2": dit_l2, "dit_xl2": dit_xl2, "microdit_xl2": microdit_xl2,
}


LONG_SKIPS = tuple(m.value for m in LongSkip)
SKIP_SCALES = tuple(m.value for m in SkipScale)


def check_model(cfg: ModelConfig, image_size: int | None = None) -> None:
    """Raise ValueError (one line) for an architecture the DiT cannot build; image_size None skips the
    patch-grid check (the size of latent data is known only once its manifest is read)."""
    positive = {"width": cfg.width, "heads": cfg.heads, "patch_size": cfg.patch_size,
                "text_width": cfg.text_width, "text_depth": cfg.text_depth, "text_len": cfg.text_len}
    for name, value in positive.items():
        if value < 1:
            raise ValueError(f"model.{name} must be at least 1, got {value}")
    if min(cfg.depth, cfg.decoder_depth, cfg.mixer_depth) < 0:  # depth 0: no backbone (a test construction)
        raise ValueError(f"model.depth, model.decoder_depth and model.mixer_depth must be >= 0, got {cfg.depth}, "
                         f"{cfg.decoder_depth}, {cfg.mixer_depth}")
    if cfg.mlp_ratio <= 0:
        raise ValueError(f"model.mlp_ratio must be positive, got {cfg.mlp_ratio:g}")
    if cfg.width % 4:
        raise ValueError(f"model.width={cfg.width} must be divisible by 4 (2-D sin-cos positions)")
    if cfg.width % cfg.heads:
        raise ValueError(f"model.width={cfg.width} is not divisible by model.heads={cfg.heads}")
    if cfg.long_skip not in {m.value for m in LongSkip} or cfg.skip_scale not in {m.value for m in SkipScale}:
        raise ValueError(f"model.long_skip must be {'|'.join(LONG_SKIPS)} and model.skip_scale "
                         f"{'|'.join(SKIP_SCALES)}; got {cfg.long_skip!r}, {cfg.skip_scale!r}")
    _check_long_skip(cfg)
    if image_size is not None and image_size % cfg.patch_size:
        raise ValueError(f"model.patch_size={cfg.patch_size} does not divide the {image_size}-pixel input")
    if image_size is not None and cfg.skip_scale in LEARNED_SKIP_SCALES \
            and (image_size // cfg.patch_size) ** 2 < SKIP_GATE_REDUCTION:
        raise ValueError(f"model.skip_scale={cfg.skip_scale} needs at least {SKIP_GATE_REDUCTION} tokens "
                         f"(its gate has tokens // {SKIP_GATE_REDUCTION} hidden units)")


def _check_long_skip(cfg: ModelConfig) -> None:
    """The ScaleLong options act on long skips only: a scale without skips, or a kappa without the kappa
    scale, would train a model other than the one its config names."""
    if cfg.skip_scale != SkipScale.none and cfg.long_skip == LongSkip.none:
        raise ValueError(f"model.skip_scale={cfg.skip_scale} scales long skips: set model.long_skip=concat "
                         "(U-ViT's fusion, as ScaleLong) or concat_ln")
    if cfg.skip_kappa != ModelConfig.skip_kappa and cfg.skip_scale != SkipScale.kappa:
        raise ValueError(f"model.skip_kappa={cfg.skip_kappa:g} does nothing without model.skip_scale=kappa")
    if not 0.0 < cfg.skip_kappa <= 1.0:
        raise ValueError(f"model.skip_kappa must be in (0, 1], got {cfg.skip_kappa:g}")
