"""The DiT's configuration and its presets: plain data, importable without torch.

The command line composes configs (and answers `--help`, `arms`, `sweep --emit`) from these alone, so
they live apart from the network in `dit.py`, which needs torch and timm.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from maskbench.config.fields import added, not_result

Kernels = StrEnum("Kernels", "auto torch triton")              # gather/scatter: auto is Triton on CUDA
LongSkipKind = StrEnum("LongSkipKind", "none concat_ln concat")       # concat_ln: Skip-DiT's fusion; concat: U-ViT's
# ScaleLong's coefficient on each long skip: kappa (CS, kappa^(N-1-j) on the j-th skip fused, innermost first),
# constant (1/sqrt(2) on every skip, its control), learned_shared / learned_per_skip (LS, a per-token gate).
SkipScale = StrEnum("SkipScale", "none kappa constant learned_shared learned_per_skip")
LEARNED_SKIP_SCALES = (SkipScale.learned_shared, SkipScale.learned_per_skip)
SKIP_GATE_REDUCTION = 16  # ScaleLong's LS gate: an MLP over the L tokens with L // 16 hidden units
# The long-skip fusion layers' init (`DiT.init_skips`): dit = xavier like every DiT Linear; skipdit = PyTorch's
# own Linear/LayerNorm init, as Skip-DiT leaves them; uvit = trunc_normal(0.02) weights and zero bias, as U-ViT
# (ScaleLong) inits every Linear; identity = the fused output starts as the running tokens.
SkipInit = StrEnum("SkipInit", "dit skipdit uvit identity")


@dataclass
class ModelConfig:
    """Architecture of the DiT; plain fields so OmegaConf can compose it from YAML."""

    name: str = "tiny"        # the preset's name (rows carry it); `model=NAME` picks a preset
    patch_size: int = 4       # pixels (or latent cells) per token side
    width: int = 128          # token width D
    depth: int = 4            # backbone blocks, run on kept tokens only
    heads: int = 4            # attention heads
    mixer_depth: int = 0      # patch-mixer blocks on ALL tokens before dropping (MicroDiT); 0 = MaskDiT-style early drop
    mlp_ratio: float = 4.0    # MLP hidden width over D
    text_width: int = 64      # width of the small trainable synth text encoder
    text_depth: int = 2       # blocks of the small synth text encoder
    text_len: int = 32        # caption context length (tokens) for the synth text encoder
    kernels: Kernels = not_result(Kernels.auto)  # passed to gather/scatter
    structured_mask: bool = False  # SPRINT-style: keep one token per 2x2 group (only at mask 0.75)
    long_skip: LongSkipKind = added(LongSkipKind.none)  # long skips from block i to depth-1-i: concat_ln (Skip-DiT) or concat (U-ViT); none
    skip_scale: SkipScale = added(SkipScale.none)  # ScaleLong's coefficient on each long skip: kappa, constant, learned_shared, learned_per_skip
    skip_kappa: float = added(0.5)  # ScaleLong's kappa (skip_scale=kappa); its code's default
    skip_init: SkipInit = added(SkipInit.dit)  # how the long-skip fusion layers start (matters most when converting)
    decoder_depth: int = added(0)  # MaskDiT: blocks on all L tokens after refilling dropped slots with a mask token
    decoder_ratio: float | None = None  # MaskDiT: its decoder's width over the model's, after the DecoderLayer;
                                        # None: the authors' 512 / 1152 (`decoder_width`). SPRINT's is full width
    sparse_fusion: bool = added(False)  # SPRINT: the decoder reads Linear(cat[deep path refilled with a fixed mask token,
                                        # the mixer's dense path]) and every token carries loss (needs mixer and decoder)
    path_drop: float = added(0.0)  # SPRINT: the chance a training sample's whole deep path is the mask token
    resplit: bool = added(False)  # the arm keeps the baseline's full-width blocks: its mixer and full-width decoder
                                  # blocks come out of them (SPRINT's 2 + 24 + 2 is SiT-XL's 28; MaskDiT's narrow
                                  # decoder is added, as on DiT-XL's 28): `depth` is what is left (config.compose)
    route_ratio: float = added(0.0)  # TREAD: the share of the backbone's tokens that bypass the routed span in training
    route_start: int | None = added(None)  # TREAD: the span's first backbone block; None: the authors' (`route_span`)
    route_end: int | None = added(None)  # TREAD: its last backbone block, inclusive (their end_layer_idx); None: theirs


def tiny() -> ModelConfig: return ModelConfig()
# MicroDiT-shaped (deferred masking): a patch mixer on all tokens before the drop, about MicroDiT's
# 6 mixer : 28 backbone blocks. micro_s is tiny plus one mixer block: the mission arms' default model.
def micro_xs() -> ModelConfig: return ModelConfig(name="micro_xs", width=64, heads=2, mixer_depth=1)
# Half micro_xs's width: the plateau study's candidate whose capacity, not its budget, ends its learning curve.
def micro_xxs() -> ModelConfig: return ModelConfig(name="micro_xxs", width=32, heads=2, mixer_depth=1)
def micro_s() -> ModelConfig: return ModelConfig(name="micro_s", mixer_depth=1)
def micro_m() -> ModelConfig: return ModelConfig(name="micro_m", width=192, depth=6, heads=6, mixer_depth=1)
# U-ViT's "depth 12" layout (6 in-blocks, a mid block, 6 out-blocks: 13 blocks and 6 long skips, as ScaleLong's
# CIFAR-10 U-ViT, sail-sg/ScaleLong libs/uvit.py; docs/arms.md cites the lines) at tiny's cost per step: at width
# 68, 13 blocks cost 98.4% of what tiny's 4 at width 128 do (tests/test_flops.py).
def tiny_deep() -> ModelConfig: return ModelConfig(name="tiny_deep", depth=13, width=68, heads=4)
def dit_s2() -> ModelConfig: return ModelConfig(name="dit_s2", depth=12, width=384, heads=6, patch_size=2)
def dit_b2() -> ModelConfig: return ModelConfig(name="dit_b2", depth=12, width=768, heads=12, patch_size=2)
def dit_l2() -> ModelConfig: return ModelConfig(name="dit_l2", depth=24, width=1024, heads=16, patch_size=2)
def dit_xl2() -> ModelConfig: return ModelConfig(name="dit_xl2", depth=28, width=1152, heads=16, patch_size=2)
# MicroDiT's XL/2 shape at one width (its mixer is 768 wide, its backbone 1024 and mixture-of-experts: not modelled).
def microdit_xl2() -> ModelConfig: return ModelConfig(name="microdit_xl2", depth=28, width=1024, heads=16,
                                                      patch_size=2, mixer_depth=6)


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "tiny": tiny, "tiny_deep": tiny_deep, "micro_xxs": micro_xxs, "micro_xs": micro_xs, "micro_s": micro_s, "micro_m": micro_m,
    "dit_s2": dit_s2, "dit_b2": dit_b2, "dit_l2": dit_l2, "dit_xl2": dit_xl2, "microdit_xl2": microdit_xl2,
}


# MaskDiT's decoder (Anima-Lab/MaskDiT models/maskdit.py; docs/arms.md cites the lines): 8 blocks 512 wide with
# 16 heads after DiT-XL/2's 28 blocks 1152 wide with 16 heads, behind a DecoderLayer that takes the encoder's
# width down to 512.
MASKDIT_DECODER_WIDTH, MASKDIT_WIDTH = 512, 1152


def maskdit_decoder(cfg: ModelConfig) -> bool:
    """True if the model has MaskDiT's decoder: decoder blocks without SPRINT's fusion."""
    return cfg.decoder_depth > 0 and not cfg.sparse_fusion


def decoder_width(cfg: ModelConfig) -> int:
    """The width the decoder blocks and the final layer after them run at.

    MaskDiT's decoder: model.width times model.decoder_ratio, or the authors' 512 / 1152 (models/maskdit.py,
    at DiT-XL/2's width), rounded to the nearest multiple of lcm(4, heads), at least one (the 2-D sin-cos
    positions need a multiple of 4; the decoder keeps the encoder's head count, as the authors' 16 and 16):
    512 on dit_xl2, 56 on tiny (the `maskdit50` arms set 0.3125: 40 on tiny, docs/arms.md says why).
    SPRINT's decoder (and a model without one) is model.width: SPRINT's authors run their decoder blocks and
    final layer at the encoder's width (snap-research/Sprint src/models/sit.py). docs/arms.md cites the lines.
    """
    if not maskdit_decoder(cfg):
        return cfg.width
    ratio = MASKDIT_DECODER_WIDTH / MASKDIT_WIDTH if cfg.decoder_ratio is None else cfg.decoder_ratio
    step = math.lcm(4, cfg.heads)
    return max(1, round(cfg.width * ratio / step)) * step


def route_span(cfg: ModelConfig) -> tuple[int, int]:
    """(first, last) backbone block of TREAD's routed span, last inclusive: as set, else the authors' span scaled.

    The authors give one span, blocks 2..8 of DiT-B/2's 12 (CompVis/tread configs/model/tread.yaml; docs/arms.md
    cites the lines): 2 dense blocks before it, 3 after. Scaled to model.depth it is
    round(depth·2/12)..round(depth·9/12) − 1, which is theirs at depth 12, blocks 1..2 of the default 4 (dit_xl2's
    28: 5..20).
    """
    start = round(cfg.depth * 2 / 12) if cfg.route_start is None else cfg.route_start
    end = round(cfg.depth * 9 / 12) - 1 if cfg.route_end is None else cfg.route_end
    return start, end


def check_model(cfg: ModelConfig) -> None:
    """Raise ValueError (one line) for an architecture the DiT cannot build, whatever its input. The config's
    validation calls it once; what depends on the input's size is `check_grid`, which the DiT calls."""
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
    for name, enum in {"long_skip": LongSkipKind, "skip_scale": SkipScale, "skip_init": SkipInit,
                       "kernels": Kernels}.items():
        if getattr(cfg, name) not in {m.value for m in enum}:
            raise ValueError(f"model.{name} must be {'|'.join(m.value for m in enum)}; got {getattr(cfg, name)!r}")
    _check_long_skip(cfg)
    _check_decoder_width(cfg)
    _check_sparse_fusion(cfg)
    _check_routing(cfg)


def check_grid(cfg: ModelConfig, image_size: int) -> None:
    """Raise ValueError (one line) for an architecture its input's size does not fit. Checked where the DiT is
    built, the one place the size is always known (latent shards tell it only once their manifest is read)."""
    if image_size % cfg.patch_size:
        raise ValueError(f"model.patch_size={cfg.patch_size} does not divide the {image_size}-pixel input")
    if cfg.skip_scale in LEARNED_SKIP_SCALES and (image_size // cfg.patch_size) ** 2 < SKIP_GATE_REDUCTION:
        raise ValueError(f"model.skip_scale={cfg.skip_scale} needs at least {SKIP_GATE_REDUCTION} tokens "
                         f"(its gate has tokens // {SKIP_GATE_REDUCTION} hidden units)")


def _check_long_skip(cfg: ModelConfig) -> None:
    """The ScaleLong options act on long skips only: a scale without skips, or a kappa without the kappa
    scale, would train a model other than the one its config names."""
    if cfg.skip_scale != SkipScale.none and cfg.long_skip == LongSkipKind.none:
        raise ValueError(f"model.skip_scale={cfg.skip_scale} scales long skips: set model.long_skip=concat "
                         "(U-ViT's fusion, as ScaleLong) or concat_ln")
    if cfg.skip_kappa != ModelConfig.skip_kappa and cfg.skip_scale != SkipScale.kappa:
        raise ValueError(f"model.skip_kappa={cfg.skip_kappa:g} does nothing without model.skip_scale=kappa")
    if not 0.0 < cfg.skip_kappa <= 1.0:
        raise ValueError(f"model.skip_kappa must be in (0, 1], got {cfg.skip_kappa:g}")


def _check_decoder_width(cfg: ModelConfig) -> None:
    """model.decoder_ratio narrows MaskDiT's decoder only: without decoder blocks it would do nothing, and SPRINT's
    fused decoder is full width as its authors build it. A decoder wider than the model is not MaskDiT's."""
    if cfg.decoder_ratio is None:
        return
    if not maskdit_decoder(cfg):
        raise ValueError(f"model.decoder_ratio={cfg.decoder_ratio:g} sets MaskDiT's decoder width: it needs "
                         "model.decoder_depth >= 1 and no model.sparse_fusion (SPRINT's decoder is full width)")
    if not 0 < cfg.decoder_ratio <= 1:
        raise ValueError(f"model.decoder_ratio={cfg.decoder_ratio:g} must be in (0, 1]: the decoder's width over "
                         "the model's")


def _check_sparse_fusion(cfg: ModelConfig) -> None:
    """SPRINT's fusion joins the deep path to a dense shallow one (the mixer) before decoder blocks on every token;
    path drop replaces that deep path, so it means nothing without the fusion."""
    if cfg.sparse_fusion and (cfg.mixer_depth < 1 or cfg.decoder_depth < 1):
        raise ValueError(f"model.sparse_fusion (SPRINT) needs a dense path and decoder blocks: model.mixer_depth and "
                         f"model.decoder_depth >= 1, got {cfg.mixer_depth}, {cfg.decoder_depth}")
    if not 0.0 <= cfg.path_drop < 1.0:
        raise ValueError(f"model.path_drop must be in [0, 1), got {cfg.path_drop:g}")
    if cfg.path_drop and not cfg.sparse_fusion:
        raise ValueError(f"model.path_drop={cfg.path_drop:g} drops SPRINT's deep path: set model.sparse_fusion=true")


def _check_routing(cfg: ModelConfig) -> None:
    """TREAD's span must lie within the backbone. A span set without a ratio would route nothing; long skips
    would join tokens of the span (R of them) to tokens outside it (K), so the two are not combined."""
    if not 0.0 <= cfg.route_ratio < 1.0:
        raise ValueError(f"model.route_ratio must be in [0, 1), got {cfg.route_ratio:g}")
    if not cfg.route_ratio:
        if cfg.route_start is not None or cfg.route_end is not None:
            raise ValueError("model.route_start/route_end place TREAD's span: set model.route_ratio > 0")
        return
    start, end = route_span(cfg)
    if not 0 <= start <= end < cfg.depth:
        raise ValueError(f"model's routed span, blocks {start}..{end}, must lie within its {cfg.depth} backbone blocks")
    if cfg.long_skip != LongSkipKind.none:
        raise ValueError(f"model.route_ratio (TREAD) with model.long_skip={cfg.long_skip} is not built")
