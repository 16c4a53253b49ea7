"""Analytic FLOPs of a training step (the split of a budget into steps is `maskbench.train.schedule`).

The budget every arm gets is counted, not measured: an analytic count is hardware independent,
identical for every arm, and known before the run starts, so phases can be sized up front.

Convention: matmuls cost 2·M·N·K; attention counts both products (QKᵀ and AV); norms, activations,
softmax, gathers and the optimizer are free. Backward costs 2× forward per matmul (input grad and
weight grad), except where the input needs no grad (the patch embed on the data, the first layer after
the frozen token table, the timestep MLP's first layer, the projection of precomputed text
embeddings): there autograd computes the weight grad only, 1×. This is exactly what
torch.utils.flop_counter.FlopCounterMode reports for unfused attention (meta tensors, or the MATH
SDPA backend); fused GPU attention kernels recompute QKᵀ in backward, which is hardware work, not
model FLOPs, and is not counted here.
"""

from __future__ import annotations

from dataclasses import dataclass

from maskbench.config.presets import (
    LEARNED_SKIP_SCALES,
    SKIP_GATE_REDUCTION,
    LongSkipKind,
    ModelConfig,
    decoder_width,
    maskdit_decoder,
    route_span,
)
from maskbench.models.dit import TIMESTEP_FREQ_DIM, long_skip_pairs
from maskbench.models.masking import keep_count
from maskbench.models.text import MLP_RATIO as TEXT_MLP_RATIO


@dataclass(frozen=True)
class _Counter:
    """FLOPs of the model's primitives, either forward only or forward + backward."""

    train: bool

    def linear(self, rows: int, fan_in: int, fan_out: int, input_grad: bool = True) -> int:
        forward = 2 * rows * fan_in * fan_out
        if not self.train:
            return forward
        return forward * (3 if input_grad else 2)

    def attention(self, batch: int, q_len: int, kv_len: int, width: int) -> int:
        forward = 2 * (2 * batch * q_len * kv_len * width)  # QKᵀ and AV, heads × head_dim = width
        return forward * (3 if self.train else 1)

    def transformer_mlp(self, rows: int, width: int, hidden: int) -> int:
        return self.linear(rows, width, hidden) + self.linear(rows, hidden, width)


def _dit_block(n: _Counter, batch: int, tokens: int, context_len: int, width: int, hidden: int,
               cond_width: int | None = None) -> int:
    """One DiTBlock; cond_width: the condition's and text tokens' width where it is not the block's (MaskDiT's
    narrow decoder blocks read the model-width ones: adaLN and the cross-attention's k, v project from it)."""
    rows, cond = batch * tokens, cond_width or width
    adaln = n.linear(batch, cond, 9 * width)
    self_attn = (n.linear(rows, width, 3 * width) + n.attention(batch, tokens, tokens, width)
                 + n.linear(rows, width, width))
    cross_attn = (n.linear(rows, width, width) + n.linear(batch * context_len, cond, 2 * width)
                  + n.attention(batch, tokens, context_len, width) + n.linear(rows, width, width))
    return adaln + self_attn + cross_attn + n.transformer_mlp(rows, width, hidden)


def _text_encoder(n: _Counter, batch: int, context_len: int, width: int, depth: int) -> int:
    rows = batch * context_len
    block = (n.linear(rows, width, 3 * width) + n.attention(batch, context_len, context_len, width)
             + n.linear(rows, width, width) + n.transformer_mlp(rows, width, int(width * TEXT_MLP_RATIO)))
    return n.linear(rows, width, width, input_grad=False) + depth * block  # first layer reads the frozen table


def _long_skip(n: _Counter, cfg: ModelConfig, batch: int, seq_len: int, kept: int) -> int:
    """One skip's fusion, concat -> Linear(2D -> D), and ScaleLong's learned gate if any: an MLP
    L -> L // 16 -> L over each sample's per-token means (a shared gate still runs once per skip)."""
    fusion = n.linear(batch * kept, 2 * cfg.width, cfg.width)
    if cfg.skip_scale not in LEARNED_SKIP_SCALES:
        return fusion
    hidden = seq_len // SKIP_GATE_REDUCTION
    return fusion + n.linear(batch, seq_len, hidden) + n.linear(batch, hidden, seq_len)


def _backbone(n: _Counter, cfg: ModelConfig, batch: int, kept: int, context_len: int, route_ratio: float) -> int:
    """The backbone blocks on the K kept tokens; with TREAD's route, the span's blocks on the R = keep_count(K,
    route_ratio) tokens the route leaves them (the gather and the rejoin are free)."""
    hidden = int(cfg.width * cfg.mlp_ratio)
    start, end = route_span(cfg) if route_ratio else (0, -1)
    spanned = end - start + 1                                                         # 0 without a route
    return ((cfg.depth - spanned) * _dit_block(n, batch, kept, context_len, cfg.width, hidden)
            + spanned * _dit_block(n, batch, keep_count(kept, route_ratio), context_len, cfg.width, hidden))


def _decoder(n: _Counter, cfg: ModelConfig, batch: int, seq_len: int, kept: int, context_len: int) -> int:
    """The decoder blocks on all L tokens; for MaskDiT's decoder also its DecoderLayer (adaLN from the condition,
    Linear width -> decoder width on the K kept tokens) and blocks at the decoder width on the model-width
    condition (Anima-Lab/MaskDiT models/maskdit.py; docs/arms.md cites the lines). The refill and positions are
    free."""
    width, dec_width = cfg.width, decoder_width(cfg)
    blocks = cfg.decoder_depth * _dit_block(n, batch, seq_len, context_len, dec_width, int(dec_width * cfg.mlp_ratio),
                                            cond_width=width)
    if not maskdit_decoder(cfg):
        return blocks
    return blocks + n.linear(batch, width, 2 * width) + n.linear(batch * kept, width, dec_width)


def _model_flops(n: _Counter, cfg: ModelConfig, image_size: int, in_channels: int, context_dim: int,
                 context_len: int, batch: int, mask_ratio: float, text_encoder: bool, route_ratio: float = 0.0) -> int:
    p, width = cfg.patch_size, cfg.width
    seq_len = (image_size // p) ** 2
    kept = keep_count(seq_len, mask_ratio)
    hidden = int(width * cfg.mlp_ratio)
    text = _text_encoder(n, batch, context_len, cfg.text_width, cfg.text_depth) if text_encoder else 0
    conditioning = (n.linear(batch * context_len, context_dim, width, input_grad=text_encoder)  # context proj
                    + n.linear(batch, width, width)                                          # pooled text
                    + n.linear(batch, TIMESTEP_FREQ_DIM, width, input_grad=False) + n.linear(batch, width, width))
    patch_embed = n.linear(batch * seq_len, in_channels * p * p, width, input_grad=False)
    blocks = (cfg.mixer_depth * _dit_block(n, batch, seq_len, context_len, width, hidden)
              + _backbone(n, cfg, batch, kept, context_len, route_ratio)
              + _decoder(n, cfg, batch, seq_len, kept, context_len))
    if cfg.long_skip != LongSkipKind.none:
        blocks += len(long_skip_pairs(cfg.depth)) * _long_skip(n, cfg, batch, seq_len, kept)
    if cfg.sparse_fusion:  # SPRINT's Linear(cat[deep, dense]) on every token (the refill and path drop are free)
        blocks += n.linear(batch * seq_len, 2 * width, width)
    predicted = seq_len if cfg.decoder_depth else kept  # a decoder predicts every token
    out_width = decoder_width(cfg)                       # the final layer reads the decoder's tokens
    final = n.linear(batch, width, 2 * out_width) + n.linear(batch * predicted, out_width, p * p * in_channels)
    return text + conditioning + patch_embed + blocks + final


def train_step_flops(cfg: ModelConfig, image_size: int, in_channels: int, context_dim: int, context_len: int,
                     batch: int, mask_ratio: float, text_encoder: bool) -> int:
    """Forward + backward FLOPs of one training step at this mask ratio, TREAD's route included (a training
    step routes `model.route_ratio` of the backbone's tokens around its span; a sampling step never does)."""
    return _model_flops(_Counter(train=True), cfg, image_size, in_channels, context_dim, context_len,
                        batch, mask_ratio, text_encoder, cfg.route_ratio)


def decoder_step_flops(cfg: ModelConfig, image_size: int, context_len: int, batch: int, mask_ratio: float) -> int:
    """Forward + backward FLOPs of the decoder alone in a training step at this mask ratio (MaskDiT's DecoderLayer
    and decoder blocks, or SPRINT's decoder blocks; the final layer and SPRINT's fusion are not counted): its
    share of `train_step_flops` is what the decoder costs a masked step."""
    seq_len = (image_size // cfg.patch_size) ** 2
    return _decoder(_Counter(train=True), cfg, batch, seq_len, keep_count(seq_len, mask_ratio), context_len)


def skips_only_step_flops(cfg: ModelConfig, image_size: int, in_channels: int, context_dim: int,
                          context_len: int, batch: int, mask_ratio: float, text_encoder: bool) -> int:
    """Forward + backward FLOPs of a step that trains the long-skip layers only (Skip-DiT's stage 1).

    The forward is the usual one. Backward runs only what autograd needs for the skip layers' grads:
    nothing below the first fusing block (no parameter there trains, and no input needs a grad); from
    it upward, the input grad of every matmul on the running tokens, but no weight grads (frozen) and
    nothing for the conditioning and the text keys/values, which need no grad. So: self-attention's
    products twice (dQ, dK, dV), cross-attention's once (dQ only), adaLN and kv projections not at all.
    The skip projections get their weight grad, and an input grad where one is needed: above the first
    one (the running tokens), and in the first one only behind concat_ln's trainable LayerNorm.
    """
    forward = _Counter(train=False)
    width, hidden = cfg.width, int(cfg.width * cfg.mlp_ratio)
    rows = batch * keep_count((image_size // cfg.patch_size) ** 2, mask_ratio)
    fusing = sorted(i for i, _ in long_skip_pairs(cfg.depth))
    token_matmuls = (forward.linear(rows, width, 3 * width) + 3 * forward.linear(rows, width, width)
                     + forward.transformer_mlp(rows, width, hidden))       # qkv, attn proj, cross q, cross proj
    block = (token_matmuls + 2 * forward.attention(batch, rows // batch, rows // batch, width)
             + forward.attention(batch, rows // batch, context_len, width))
    skip = forward.linear(rows, 2 * width, width)
    skips = len(fusing) * 2 * skip - (skip if cfg.long_skip != LongSkipKind.concat_ln else 0)  # the first one: weight grad only
    final = forward.linear(rows, width, cfg.patch_size ** 2 * in_channels)
    backward = (cfg.depth - fusing[0]) * block + skips + final
    return _model_flops(forward, cfg, image_size, in_channels, context_dim, context_len, batch, mask_ratio,
                        text_encoder) + backward


def conv_forward_flops(batch: int, in_channels: int, out_channels: int, kernel: int, out_pixels: int) -> int:
    """One convolution's forward (a matmul per output pixel: 2·C_in·k²·C_out; bias free)."""
    return 2 * batch * out_pixels * in_channels * kernel * kernel * out_channels


def vit_forward_flops(batch: int, patches: int, prefix_tokens: int, patch: int, width: int, depth: int,
                      mlp_ratio: float) -> int:
    """A ViT's forward (timm's VisionTransformer): the patch embedding, then `depth` blocks on the patches and
    the prefix tokens (class, registers)."""
    n, tokens = _Counter(train=False), patches + prefix_tokens
    rows = batch * tokens
    block = (n.linear(rows, width, 3 * width) + n.attention(batch, tokens, tokens, width)
             + n.linear(rows, width, width) + n.transformer_mlp(rows, width, int(width * mlp_ratio)))
    return conv_forward_flops(batch, 3, width, patch, patches) + depth * block


def repa_step_flops(cfg: ModelConfig, image_size: int, batch: int, mask_ratio: float, depth: int, hidden: int,
                    z_dim: int, encoder_forward: int) -> int:
    """What REPA adds to a training step: its projector (3 linears, forward and backward) on the tokens of the
    aligned block `depth` (counted over mixer, backbone, decoder: only the kept ones in a masked backbone block),
    and the frozen encoder's forward on the clean images (`encoder_forward` FLOPs each; no backward, nothing in it
    trains). The gradient the loss sends into the blocks below rides on the backward the velocity loss already
    runs through them: no more matmuls."""
    n = _Counter(train=True)
    seq_len = (image_size // cfg.patch_size) ** 2
    sparse = cfg.mixer_depth < depth <= cfg.mixer_depth + cfg.depth
    rows = batch * (keep_count(seq_len, mask_ratio) if sparse else seq_len)
    width = decoder_width(cfg) if depth > cfg.mixer_depth + cfg.depth else cfg.width  # a MaskDiT decoder's is narrower
    projector = n.linear(rows, width, hidden) + n.linear(rows, hidden, hidden) + n.linear(rows, hidden, z_dim)
    return projector + batch * encoder_forward
