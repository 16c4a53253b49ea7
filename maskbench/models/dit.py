"""A token-dropping text-to-image DiT.

The layout follows DiT (Peebles & Xie) with the pieces the masked-training papers add:

    patch embed + fixed 2-D sin-cos positions
    -> mixer blocks on all L tokens      (MicroDiT's deferred masking; mixer_depth 0 = MaskDiT early drop;
                                          SPRINT's dense shallow path)
    -> drop to K kept tokens             (gather_tokens, so the Triton kernel can plug in)
    -> backbone blocks on the K tokens   (optional long skips: block i fuses block depth-1-i; an odd depth is
                                          U-ViT's in-blocks, mid block, out-blocks, an even one Skip-DiT's halves;
                                          each skip optionally scaled as ScaleLong does)
    -> optional decoder blocks on all L tokens: MaskDiT's DecoderLayer takes the kept tokens down to the
       narrower decoder width, dropped slots are refilled with a learned mask token and the decoder's positions
       added; or SPRINT's fusion of the deep path with the dense one, at full width
    -> final layer: a prediction for each kept token (each token, with a decoder).

Every block is adaLN-Zero conditioned on (timestep + pooled text), with self-attention,
cross-attention to the text tokens and an MLP, each gated so a fresh block is the identity.
Unmasking is just keep_idx=None: the architecture is the same, so checkpoints carry over between
the phases of an arm.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from timm.layers import Attention, Mlp, PatchEmbed
from timm.layers.pos_embed_sincos import build_sincos2d_pos_embed
from torch import nn

from maskbench.config.presets import (
    SKIP_GATE_REDUCTION,
    LongSkipKind,
    ModelConfig,
    SkipInit,
    SkipScale,
    check_grid,
    decoder_width,
    maskdit_decoder,
)
from maskbench.models.inputs import FULL, StepInputs
from maskbench.models.kernels import gather_tokens, scatter_tokens
from maskbench.models.routing import run_routed

TIMESTEP_FREQ_DIM = 256  # sinusoidal timestep features before the timestep MLP (as DiT)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN: a condition-dependent affine after a parameter-free LayerNorm."""
    return x * (1 + scale) + shift


def masked_mean(tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of B×T×D tokens over the positions where mask (B×T) is True -> B×D."""
    weights = mask.to(tokens.dtype)[..., None]                                    # B×T×1
    return (tokens * weights).sum(1) / weights.sum(1).clamp(min=1)               # B×D


def _layer_norm(width: int) -> nn.LayerNorm:
    return nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)


def _mlp(width: int, mlp_ratio: float) -> Mlp:
    return Mlp(width, int(width * mlp_ratio), act_layer=lambda: nn.GELU(approximate="tanh"))


class TimestepEmbedder(nn.Module):
    """t in [0, 1] -> B×width, DiT's sinusoid + MLP (t is scaled to DiT's 0..1000 range first)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(TIMESTEP_FREQ_DIM, width), nn.SiLU(), nn.Linear(width, width))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = TIMESTEP_FREQ_DIM // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device) / half)  # half
        args = 1000.0 * t.float()[:, None] * freqs[None, :]                                 # B×half
        return self.mlp(torch.cat([torch.cos(args), torch.sin(args)], dim=-1))              # B×width


class CrossAttention(nn.Module):
    """Image tokens attend to text tokens; padded text tokens are masked out as keys.

    timm has no cross-attention layer, so this is timm's Attention with q from x and k, v from context.
    context_width: the text tokens' width when it is not the image tokens' (MaskDiT's narrow decoder reads the
    model-width text tokens; k and v come out at the decoder's width).
    """

    def __init__(self, width: int, heads: int, context_width: int | None = None) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(width, width)
        self.kv = nn.Linear(context_width or width, 2 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, context: torch.Tensor, context_mask: torch.Tensor) -> torch.Tensor:
        B, N, D = x.shape
        T = context.shape[1]
        q = self.q(x).view(B, N, self.heads, D // self.heads).transpose(1, 2)                  # B×H×N×d
        k, v = self.kv(context).view(B, T, 2, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)  # 2× B×H×T×d
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=context_mask[:, None, None, :])  # B×H×N×d
        return self.proj(x.transpose(1, 2).reshape(B, N, D))                                  # B×N×D


class DiTBlock(nn.Module):
    """adaLN-Zero block: gated self-attention, cross-attention to text, MLP.

    cond_width: the conditioning vector's and text tokens' width when it is not the block's: MaskDiT's decoder
    blocks run at the decoder width on the model-width condition (Anima-Lab/MaskDiT models/maskdit.py:
    `DiTBlock(decoder_hidden_size, hidden_size, ...)`; docs/arms.md cites the lines).
    """

    def __init__(self, width: int, heads: int, mlp_ratio: float, cond_width: int | None = None) -> None:
        super().__init__()
        self.norm1, self.norm2, self.norm3 = _layer_norm(width), _layer_norm(width), _layer_norm(width)
        self.attn = Attention(width, num_heads=heads, qkv_bias=True)
        self.cross_attn = CrossAttention(width, heads, cond_width)
        self.mlp = _mlp(width, mlp_ratio)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(cond_width or width, 9 * width))

    def forward(self, x: torch.Tensor, c: torch.Tensor, context: torch.Tensor,
                context_mask: torch.Tensor) -> torch.Tensor:
        (shift_sa, scale_sa, gate_sa, shift_ca, scale_ca, gate_ca,
         shift_ff, scale_ff, gate_ff) = self.adaLN_modulation(c)[:, None, :].chunk(9, dim=-1)  # 9× B×1×D
        x = x + gate_sa * self.attn(modulate(self.norm1(x), shift_sa, scale_sa))                # B×N×D
        x = x + gate_ca * self.cross_attn(modulate(self.norm2(x), shift_ca, scale_ca), context, context_mask)  # B×N×D
        x = x + gate_ff * self.mlp(modulate(self.norm3(x), shift_ff, scale_ff))                 # B×N×D
        return x


class FinalLayer(nn.Module):
    """adaLN + Linear to one patch of pixels/latents per token (width: the tokens'; cond_width: the condition's,
    the model width, when a narrow decoder comes before: MaskDiT models/maskdit.py; docs/arms.md cites the
    lines)."""

    def __init__(self, width: int, out_dim: int, cond_width: int | None = None) -> None:
        super().__init__()
        self.norm = _layer_norm(width)
        self.linear = nn.Linear(width, out_dim)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(cond_width or width, 2 * width))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c)[:, None, :].chunk(2, dim=-1)  # 2× B×1×D
        return self.linear(modulate(self.norm(x), shift, scale))              # B×N×out_dim


class DecoderLayer(nn.Module):
    """MaskDiT's step from the encoder to its narrower decoder (Anima-Lab/MaskDiT models/maskdit.py; docs/arms.md
    cites the lines): a parameter-free LayerNorm, adaLN shift and scale from the model-width condition, then
    Linear(width -> decoder width). It runs on the kept tokens, before the mask token refills the dropped slots."""

    def __init__(self, width: int, decoder_width: int) -> None:
        super().__init__()
        self.norm = _layer_norm(width)
        self.linear = nn.Linear(width, decoder_width)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 2 * width))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c)[:, None, :].chunk(2, dim=-1)  # 2× B×1×D
        return self.linear(modulate(self.norm(x), shift, scale))              # B×K×D_dec


class LongSkipFusion(nn.Module):
    """Fuse a long skip into the running tokens: Linear(norm(concat(x, λ·skip))), 2D -> D, replacing x.

    concat_ln is Skip-DiT's fusion (a LayerNorm over the 2D concatenation), concat is U-ViT's (no norm),
    the one ScaleLong scales: a LayerNorm after the concatenation would normalise much of λ away.
    λ is `scale`, a fixed coefficient (1 = unscaled), or a learned per-token gate passed to forward.
    """

    def __init__(self, width: int, fusion: LongSkipKind, scale: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(2 * width, eps=1e-6) if LongSkipKind(fusion) == LongSkipKind.concat_ln else nn.Identity()
        self.proj = nn.Linear(2 * width, width)
        self.scale = scale

    def forward(self, x: torch.Tensor, skip: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        scaled = self.scale * skip if gate is None else gate * skip              # B×N×D (gate B×N×1)
        return self.proj(self.norm(torch.cat([x, scaled], dim=-1)))              # B×N×D


class SkipGate(nn.Module):
    """ScaleLong's learned scale (LS): a coefficient in (0, 1) for each token of a skip, computed from the skip.

    Each token's skip features are averaged over the channel dim D, one number per token; an MLP across the
    token axis (L -> L // 16 -> L, ReLU, then a sigmoid: squeeze-and-excitation over tokens) turns the L means
    into L gates. The MLP's weights belong to token positions, so the gate lives on the native L-token grid:
    with tokens dropped, the K kept means sit at their positions, dropped positions read 0, and the K kept
    positions' gates come back.
    """

    def __init__(self, seq_len: int) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.mlp = Mlp(seq_len, seq_len // SKIP_GATE_REDUCTION, act_layer=nn.ReLU)

    def forward(self, skip: torch.Tensor, keep_idx: torch.Tensor | None) -> torch.Tensor:
        """skip B×K×D, keep_idx B×K (None: all L tokens) -> gate B×K×1."""
        means = skip.mean(dim=-1)                                                 # B×K
        if keep_idx is not None:
            means = means.new_zeros(means.shape[0], self.seq_len).scatter(1, keep_idx, means)  # B×L
        gate = torch.sigmoid(self.mlp(means))                                     # B×L
        if keep_idx is not None:
            gate = gate.gather(1, keep_idx)                                       # B×K
        return gate[..., None]                                                    # B×K×1


class SparseDenseFusion(nn.Module):
    """SPRINT's sparse-dense residual fusion (snap-research/Sprint src/models/sit.py; docs/arms.md cites the
    lines): the deep path's kept tokens go back to their slots on the L-token grid, every other slot (and, with
    path drop, every slot of a sample) holds a fixed mask token, and Linear(cat[deep, dense], 2D -> D) fuses them
    with the dense shallow path, the mixer's output on all L tokens, which carries every position the deep path
    dropped.

    The mask token is fixed: a buffer drawn N(0, 0.02²) at init (SPRINT's is requires_grad=False), so no
    phase leaves a parameter without a gradient and `trainable: all` cannot make it learned.
    """

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mask_token", torch.zeros(width))
        self.proj = nn.Linear(2 * width, width)

    def forward(self, deep: torch.Tensor, dense: torch.Tensor, keep_idx: torch.Tensor | None,
                drop_path: torch.Tensor | None, kernels: str) -> torch.Tensor:
        """deep B×K×D (B×L×D unmasked), dense B×L×D, keep_idx B×K or None, drop_path B bool or None -> B×L×D."""
        if keep_idx is not None:
            deep = scatter_tokens(deep, keep_idx, dense.shape[1], self.mask_token, impl=kernels)  # B×L×D
        if drop_path is not None:
            deep = torch.where(drop_path[:, None, None], self.mask_token.to(deep.dtype), deep)  # B×L×D
        return self.proj(torch.cat([deep, dense], dim=-1))                                     # B×L×D


def idle_parameters(cfg: ModelConfig, mask_ratio: float) -> list[str]:
    """The parameters a training step at `mask_ratio` gives no gradient.

    With a decoder and nothing dropped, no slot is filled with the mask token. A phase trains without them
    (`train.ddp`), or DDP waits for their gradient and fails at the next step; `tests/test_distributed.py`
    checks this list against a real backward for every shipped arm.
    """
    return ["mask_token"] if cfg.decoder_depth and not cfg.sparse_fusion and mask_ratio == 0 else []


def long_skip_pairs(depth: int) -> list[tuple[int, int]]:
    """(block i, the block depth-1-i whose output it fuses) for every i in the second half, innermost first.

    Only pairs with depth-1-i < i. An odd depth is U-ViT's layout (sail-sg/ScaleLong libs/uvit.py): (depth-1)/2
    in-blocks push their outputs, a mid block fuses nothing, and out-block j pops in-block (depth-3)/2-j's, so
    every skip crosses the mid block. An even depth is Skip-DiT's (class-to-image/models.py): the first block of
    the second half fuses the output of the block just before it, which is the running tokens themselves, so the
    long-skip comparisons run at an odd depth (`tiny_deep`). docs/arms.md cites the lines of both.
    """
    return [(i, depth - 1 - i) for i in range(depth) if depth - 1 - i < i]


def skip_scales(cfg: ModelConfig) -> list[float]:
    """The fixed coefficient on each long skip, in the order the blocks fuse them (innermost skip first).

    ScaleLong's CS (`kappa`): as in its U-ViT code, the j-th fusing block (j = 0 fuses the innermost skip)
    scales its skip by kappa^(N-1-j), so the innermost of the N skips is damped the most, kappa^(N-1), and
    the outermost keeps 1. `constant` is 1/sqrt(2) on every skip; unscaled and learned skips get 1.
    """
    count = len(long_skip_pairs(cfg.depth))
    if cfg.skip_scale == SkipScale.kappa:
        return [cfg.skip_kappa ** (count - 1 - j) for j in range(count)]
    return [2 ** -0.5 if cfg.skip_scale == SkipScale.constant else 1.0] * count


class DiT(nn.Module):
    """Text-conditioned DiT that runs its backbone on the kept tokens only.

    context is B×T×context_dim float (precomputed text embeddings), or B×T long token ids when a
    text_encoder is given (which then defines context_dim). context_mask is B×T bool, True = real
    token; every sample needs at least one.
    """

    def __init__(self, cfg: ModelConfig, image_size: int, in_channels: int, context_dim: int,
                 text_encoder: nn.Module | None = None) -> None:
        super().__init__()
        _validate(cfg, image_size, context_dim, text_encoder)
        self.cfg = cfg
        self.in_channels = in_channels
        self.patch_size = cfg.patch_size
        # strict_img_size off: demoted steps feed smaller images through the same patch embed.
        self.x_embedder = PatchEmbed(image_size, cfg.patch_size, in_channels, cfg.width, strict_img_size=False)
        self.grid: tuple[int, int] = self.x_embedder.grid_size       # (h, w) token grid, raster order
        self.seq_len = self.grid[0] * self.grid[1]
        self.register_buffer("pos_embed", build_sincos2d_pos_embed(list(self.grid), cfg.width),
                             persistent=False)                        # L×D, fixed, so not checkpointed
        self.t_embedder = TimestepEmbedder(cfg.width)
        self.text_encoder = text_encoder
        self.context_proj = nn.Linear(context_dim, cfg.width)
        self.text_pool = nn.Linear(cfg.width, cfg.width)
        # Caption dropout sees T copies of one learned token: the same for any T and any padding.
        self.null_context = nn.Parameter(torch.zeros(cfg.width))
        self.mixer = nn.ModuleList(DiTBlock(cfg.width, cfg.heads, cfg.mlp_ratio) for _ in range(cfg.mixer_depth))
        self.blocks = nn.ModuleList(DiTBlock(cfg.width, cfg.heads, cfg.mlp_ratio) for _ in range(cfg.depth))
        pairs = long_skip_pairs(cfg.depth) if cfg.long_skip != LongSkipKind.none else []
        self.long_skips = nn.ModuleDict({str(i): LongSkipFusion(cfg.width, cfg.long_skip, scale)
                                         for (i, _), scale in zip(pairs, skip_scales(cfg))})  # by fusing block
        gates = {SkipScale.learned_shared: 1, SkipScale.learned_per_skip: len(pairs)}.get(cfg.skip_scale, 0)
        self.long_skip_gates = nn.ModuleList(SkipGate(self.seq_len) for _ in range(gates))  # ScaleLong's LS
        # MaskDiT's decoder (models/maskdit.py): DecoderLayer width -> decoder width, the learned mask token
        # and fixed sin-cos decoder positions at that width, decoder blocks and the final layer at it too, all
        # conditioned on the model-width c. SPRINT's decoder is full width, fed by its fusion, with a fixed token.
        dec_width = decoder_width(cfg)
        maskdit = maskdit_decoder(cfg)
        self.decoder_layer = DecoderLayer(cfg.width, dec_width) if maskdit else None
        self.decoder = nn.ModuleList(DiTBlock(dec_width, cfg.heads, cfg.mlp_ratio, cfg.width)
                                     for _ in range(cfg.decoder_depth))
        self.mask_token = nn.Parameter(torch.zeros(dec_width)) if maskdit else None
        self.register_buffer("decoder_pos_embed", build_sincos2d_pos_embed(list(self.grid), dec_width)
                             if maskdit else None, persistent=False)  # L×D_dec, MaskDiT's decoder_pos_embed
        self.sparse_fusion = SparseDenseFusion(cfg.width) if cfg.sparse_fusion else None
        self.final_layer = FinalLayer(dec_width, cfg.patch_size ** 2 * in_channels, cfg.width)
        self.initialize_weights()

    def initialize_weights(self) -> None:
        """DiT's init: xavier linears, and zero adaLN and output so every block starts as the identity.

        The text encoder is left to initialise itself (it may be pretrained); ScaleLong's gates get PyTorch's
        default Linear init, as in its code.
        """
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear) and name.startswith("long_skip_gates"):
                module.reset_parameters()  # PyTorch's default, as ScaleLong builds its gate after U-ViT's init
            elif isinstance(module, nn.Linear) and not name.startswith("text_encoder"):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        patch_weight = self.x_embedder.proj.weight
        nn.init.xavier_uniform_(patch_weight.view(patch_weight.shape[0], -1))
        nn.init.zeros_(self.x_embedder.proj.bias)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        nn.init.normal_(self.null_context, std=0.02)
        if self.mask_token is not None:
            nn.init.normal_(self.mask_token, std=0.02)
        if self.sparse_fusion is not None:
            nn.init.normal_(self.sparse_fusion.mask_token, std=0.02)
        blocks = [*self.mixer, *self.blocks, *self.decoder, self.final_layer]
        zeroed = [*(block.adaLN_modulation[-1] for block in blocks), self.final_layer.linear]
        if self.decoder_layer is not None:  # MaskDiT zeroes it as its final layer, Linear too
            zeroed += [self.decoder_layer.adaLN_modulation[-1], self.decoder_layer.linear]
        for layer in zeroed:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)
        self.init_skips(self.cfg.skip_init)

    def init_skips(self, how: SkipInit) -> None:
        """Start the long-skip fusion layers as `model.skip_init` says (last, so no other init moves).

        dit keeps DiT's xavier init above. skipdit is what Skip-DiT's layers get: its `initialize_weights`
        runs before they are built (class-to-image/models.py), so nn.Linear's and nn.LayerNorm's own defaults.
        uvit is U-ViT's `_init_weights` (ScaleLong libs/uvit.py; docs/arms.md cites the lines of both):
        trunc_normal(0.02) weights, zero bias. identity is the documented choice for converting a trained DiT:
        the projection reads the running half of the concatenation through an identity block (weight [I | 0],
        bias 0), so with `concat` fusion the converted model starts exactly as the source; with `concat_ln` it
        starts with the running tokens normalised by the concatenation's statistics (near, not at, the identity).
        """
        how = SkipInit(how)  # an unknown name raises here, before any layer moves
        for skip in self.long_skips.values():
            if how == SkipInit.skipdit:
                skip.proj.reset_parameters()
                if isinstance(skip.norm, nn.LayerNorm):
                    skip.norm.reset_parameters()
            elif how == SkipInit.uvit:
                nn.init.trunc_normal_(skip.proj.weight, std=0.02)  # timm's, as U-ViT's: cut at ±2 absolute
                nn.init.zeros_(skip.proj.bias)
            elif how == SkipInit.identity:
                width = skip.proj.out_features
                with torch.no_grad():
                    skip.proj.weight.zero_()
                    skip.proj.weight[:, :width].copy_(torch.eye(width))
                    skip.proj.bias.zero_()

    def skip_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name, parameter) of every long-skip layer (fusion and ScaleLong gate): what a skips-only phase
        trains, and the only keys a converted model may lack in its source's weights (Skip-DiT's
        `skip_linear`/`skip_norm`)."""
        return [*self.long_skips.named_parameters(prefix="long_skips"),
                *self.long_skip_gates.named_parameters(prefix="long_skip_gates")]

    def encode_context(self, context: torch.Tensor, context_mask: torch.Tensor,
                       drop_context: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Text tokens at model width (B×T×D, B×T); samples with drop_context see only the null token."""
        if self.text_encoder is not None:
            context = self.text_encoder(context, context_mask)                     # B×T×context_dim
        tokens = self.context_proj(context)                                         # B×T×D
        if drop_context is None:
            return tokens, context_mask
        drop = drop_context[:, None]                                                # B×1
        tokens = torch.where(drop[..., None], self.null_context, tokens)            # B×T×D
        return tokens, context_mask | drop                                          # B×T

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, context_mask: torch.Tensor,
                drop_context: torch.Tensor | None = None, inputs: StepInputs = FULL) -> torch.Tensor:
        """x_t B×C×H×W (native, or demoted to fewer patches), t B in [0, 1], drop_context B bool (caption
        dropped), and a training step's technique inputs (`StepInputs`: keep_idx B×K sorted, span_idx B×R
        sorted positions among the backbone's K tokens, drop_path B bool; none when sampling)
        -> B×K×(p·p·C) for the kept tokens, or B×L×(p·p·C) with decoder blocks."""
        keep_idx, span_idx, drop_path = inputs.keep_idx, inputs.span_idx, inputs.drop_path
        self._check_inputs(x, t, context_mask, drop_context, keep_idx, drop_path)
        ctx, ctx_mask = self.encode_context(context, context_mask, drop_context)       # B×T×D, B×T
        c = self.t_embedder(t) + self.text_pool(masked_mean(ctx, ctx_mask))            # B×D
        tokens = self.x_embedder(x)                                                    # B×L×D
        pos = self.positions(x.shape[-2] // self.patch_size, x.shape[-1] // self.patch_size)  # L×D
        dense = None                                                                   # the mixer's B×L×D output
        if keep_idx is not None and self.cfg.mixer_depth == 0:
            tokens = gather_tokens(tokens, keep_idx, pos, impl=self.cfg.kernels)      # B×K×D, +pos fused
        else:
            tokens = tokens + pos                                                      # B×L×D
            for block in self.mixer:
                tokens = block(tokens, c, ctx, ctx_mask)                               # B×L×D
            dense = tokens
            if keep_idx is not None:
                tokens = gather_tokens(tokens, keep_idx, impl=self.cfg.kernels)        # B×K×D
        if span_idx is None:
            tokens = self.backbone(tokens, c, ctx, ctx_mask, keep_idx)                 # B×K×D
        else:  # TREAD: the routed span's blocks run on the span_idx tokens alone (`models/routing.py`)
            tokens = run_routed(self.blocks, tokens, span_idx, self.cfg,
                                lambda block, x: block(x, c, ctx, ctx_mask))                # B×K×D
        if self.decoder:
            tokens = self.decoder_input(tokens, c, dense, keep_idx, drop_path, x.shape[-2:])  # B×L×D_dec
            for block in self.decoder:
                tokens = block(tokens, c, ctx, ctx_mask)                               # B×L×D_dec
        return self.final_layer(tokens, c)                                             # B×K×(p·p·C) or B×L×…

    def decoder_input(self, tokens: torch.Tensor, c: torch.Tensor, dense: torch.Tensor | None,
                      keep_idx: torch.Tensor | None, drop_path: torch.Tensor | None,
                      size: tuple[int, int]) -> torch.Tensor:
        """The backbone's B×K×D tokens back on all L slots of the H×W (`size`) input for the decoder blocks.

        SPRINT: fused with the dense path (`SparseDenseFusion`), B×L×D. MaskDiT (Anima-Lab/MaskDiT models/maskdit.py,
        `forward`): the DecoderLayer takes the kept tokens to the decoder width, dropped slots hold the learned mask
        token, and every token, kept or not, gets the decoder's positions (`decoder_pos_embed`, added after the
        refill at any mask ratio), B×L×D_dec.
        """
        if self.sparse_fusion is not None:
            return self.sparse_fusion(tokens, dense, keep_idx, drop_path, self.cfg.kernels)  # B×L×D
        tokens = self.decoder_layer(tokens, c)                                         # B×K×D_dec
        pos = self.positions(size[0] // self.patch_size, size[1] // self.patch_size,
                             self.decoder_pos_embed)                                   # L×D_dec
        if keep_idx is not None:
            tokens = scatter_tokens(tokens, keep_idx, pos.shape[0], self.mask_token,
                                    impl=self.cfg.kernels)                             # B×L×D_dec
        return tokens + pos                                                            # B×L×D_dec

    def backbone(self, tokens: torch.Tensor, c: torch.Tensor, ctx: torch.Tensor, ctx_mask: torch.Tensor,
                 keep_idx: torch.Tensor | None) -> torch.Tensor:
        """The backbone blocks; block i of the second half first fuses block depth-1-i's output (long skips)."""
        outputs: list[torch.Tensor] = []
        for i, block in enumerate(self.blocks):
            if str(i) in self.long_skips:
                skip = outputs[len(self.blocks) - 1 - i]                               # B×K×D
                tokens = self.long_skips[str(i)](tokens, skip, self._skip_gate(i, skip, keep_idx))  # B×K×D
            tokens = block(tokens, c, ctx, ctx_mask)                                   # B×K×D
            outputs.append(tokens)
        return tokens

    def _skip_gate(self, block: int, skip: torch.Tensor, keep_idx: torch.Tensor | None) -> torch.Tensor | None:
        """The learned gate (B×K×1) on the skip fused before this block, or None for a fixed scale."""
        if not self.long_skip_gates:
            return None
        nth = block - (len(self.blocks) - len(self.long_skips))                         # innermost skip: 0
        gate = self.long_skip_gates[0 if self.cfg.skip_scale == SkipScale.learned_shared else nth]
        return gate(skip, keep_idx)

    def positions(self, h: int, w: int, native: torch.Tensor | None = None) -> torch.Tensor:
        """L×D positions of an h×w token grid: the native sin-cos table (`pos_embed`, or `native`: the decoder's),
        filtered down on demoted grids.

        A token of a grid downscaled by an integer f covers f×f native tokens, so it gets their mean
        position: sin-cos evaluated at the covered region's centre, with frequencies finer than the token
        damped. A non-integer ratio's tokens straddle native ones, and adaptive pooling's integer windows
        would shift their centres by up to half a token, so the table is resampled instead (antialiased
        bilinear: each token's true centre, a filter as wide as the token).
        """
        native = self.pos_embed if native is None else native                         # L×D
        if (h, w) == self.grid:
            return native                                                              # L×D
        table = native.T.reshape(1, -1, *self.grid)                                    # 1×D×H×W
        if self.grid[0] % h or self.grid[1] % w:
            resampled = F.interpolate(table, size=(h, w), mode="bilinear", antialias=True, align_corners=False)
        else:
            resampled = F.adaptive_avg_pool2d(table, (h, w))                           # 1×D×h×w
        return resampled.flatten(2)[0].T                                               # (h·w)×D

    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        """B×C×H×W -> B×L×(p·p·C) in the model's token order (the regression target per token)."""
        B, C, H, W = x.shape
        p = self.patch_size
        x = x.reshape(B, C, H // p, p, W // p, p)                   # B×C×h×p×w×p
        x = x.permute(0, 2, 4, 3, 5, 1)                             # B×h×w×p×p×C
        return x.reshape(B, (H // p) * (W // p), p * p * C)         # B×L×(p·p·C)

    def unpatchify(self, tokens: torch.Tensor) -> torch.Tensor:
        """B×L×(p·p·C) -> B×C×H×W, the inverse of patchify."""
        B = tokens.shape[0]
        (h, w), p, C = self.grid, self.patch_size, self.in_channels
        x = tokens.reshape(B, h, w, p, p, C)                        # B×h×w×p×p×C
        x = x.permute(0, 5, 1, 3, 2, 4)                             # B×C×h×p×w×p
        return x.reshape(B, C, h * p, w * p)                        # B×C×H×W

    def _check_inputs(self, x: torch.Tensor, t: torch.Tensor, context_mask: torch.Tensor,
                      drop_context: torch.Tensor | None, keep_idx: torch.Tensor | None,
                      drop_path: torch.Tensor | None) -> None:
        B = x.shape[0]
        if drop_context is not None and drop_context.dtype != torch.bool:  # kept-token indices passed where they were
            raise TypeError(f"drop_context must be B bool, got {drop_context.dtype}; kept tokens go in "
                            "inputs=StepInputs(keep_idx)")
        (h, w), p = self.grid, self.patch_size
        if x.ndim != 4 or x.shape[1] != self.in_channels or not _fits_grid(x.shape[-2:], p, (h, w)):
            raise ValueError(f"expected x of shape B×{self.in_channels}×{h * p}×{w * p} (or demoted to a "
                             f"smaller whole number of {p}-pixel patches), got {tuple(x.shape)}")
        if t.shape != (B,) or context_mask.ndim != 2 or context_mask.shape[0] != B:
            raise ValueError(f"expected t of shape ({B},) and context_mask B×T, "
                             f"got {tuple(t.shape)} and {tuple(context_mask.shape)}")
        seq_len = (x.shape[-2] // p) * (x.shape[-1] // p)
        if self.long_skip_gates and seq_len != self.seq_len:
            raise ValueError(f"model.skip_scale={self.cfg.skip_scale}'s gate is defined on the native {h}×{w} "
                             f"token grid; got a downscaled input {tuple(x.shape)}")
        if keep_idx is not None and (keep_idx.ndim != 2 or keep_idx.shape[0] != B or keep_idx.shape[1] > seq_len):
            raise ValueError(f"expected keep_idx {B}×K with K <= {seq_len}, got {tuple(keep_idx.shape)}")
        if drop_path is not None and (self.sparse_fusion is None or drop_path.shape != (B,)):
            raise ValueError(f"drop_path (B bool) drops SPRINT's deep path: it needs model.sparse_fusion and shape "
                             f"({B},), got {tuple(drop_path.shape)}")


def _fits_grid(size: torch.Size, patch: int, grid: tuple[int, int]) -> bool:
    """True if an H×W input is a whole number of patches, at most the native grid and of its aspect
    (native or demoted: both sides shrink by one ratio)."""
    H, W = size
    h, w = H // patch, W // patch
    return H % patch == 0 and W % patch == 0 and 0 < h <= grid[0] and 0 < w <= grid[1] and h * grid[1] == w * grid[0]


def _validate(cfg: ModelConfig, image_size: int, context_dim: int, text_encoder: nn.Module | None) -> None:
    check_grid(cfg, image_size)
    if text_encoder is not None and getattr(text_encoder, "width", context_dim) != context_dim:
        raise ValueError(f"context_dim {context_dim} must equal the text encoder width {text_encoder.width}")
