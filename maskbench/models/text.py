"""A small trainable text encoder for the synthetic dataset.

On real data the DiT reads frozen open_clip embeddings precomputed into the latent shards. The
synthetic default has no such tower to lean on (nothing can be downloaded), so it trains this one from
scratch over open_clip's BPE tokenizer, which ships inside the package and works offline.

The 49408-row token table is a FROZEN random projection regenerated from a fixed seed: a trainable
table would hold most of the tiny model's parameters and most of its optimizer time while the
synthetic captions use a few dozen words. The trainable layers after it (a Linear and a few
transformer blocks) learn everything the captions need. Being a non-persistent buffer, the table is
not written to checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import open_clip
import torch
from timm.models.vision_transformer import Block
from torch import nn

TOKENIZER = "ViT-B-32"
VOCAB_SIZE = 49408
TABLE_SEED = 20240601
MLP_RATIO = 4.0


@lru_cache(maxsize=1)
def _tokenizer() -> open_clip.tokenizer.SimpleTokenizer:
    """One BPE tokenizer per process, kept out of the module so deepcopy (EMA) and pickling stay cheap."""
    return open_clip.get_tokenizer(TOKENIZER)


def tokenize(captions: list[str], context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Captions -> (ids B×T long, mask B×T bool, True up to and including the end-of-text token).

    A function of the captions alone, so the data pipeline can run it (`with_token_ids`): open_clip's
    Python BPE costs ~10 ms per batch of 64, time a training step should not wait for.
    """
    ids = _tokenizer()(captions, context_length=context_len)                    # B×T, EOT kept on truncation
    eot = (ids == _tokenizer().eot_token_id).int().argmax(dim=1)                # B, position of EOT
    mask = torch.arange(context_len)[None, :] <= eot[:, None]                   # B×T
    return ids, mask


@lru_cache(maxsize=1 << 16)
def _caption_tokens(caption: str, context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One caption's (ids T, mask T), memoised: captions recur across epochs (and within the synth set), and
    the BPE call costs ~0.5 ms each, a tenth of a batch-16 step. Callers must not write into the tensors."""
    ids, mask = tokenize([caption], context_len)                                # 1×T each
    return ids[0], mask[0]


def with_token_ids(sample: dict, decode: Callable[[dict], dict], context_len: int) -> dict:
    """A shard decoder that also tokenizes the caption (txtids, txtmask), for the loader to run."""
    decoded = decode(sample)
    ids, mask = _caption_tokens(decoded["caption"], context_len)                 # T each
    return {**decoded, "txtids": ids, "txtmask": mask}


class SynthTextEncoder(nn.Module):
    """ids B×T (open_clip BPE) + mask B×T -> B×T×width contextual token embeddings."""

    def __init__(self, width: int, depth: int, context_len: int, heads: int = 4) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"text width {width} is not divisible by {heads} heads")
        self.width = width
        self.context_len = context_len
        table = torch.randn(VOCAB_SIZE, width, generator=torch.Generator().manual_seed(TABLE_SEED),
                            device="cpu")  # drawn on CPU so every device gets the same table
        self.register_buffer("token_table", table.to(torch.get_default_device()), persistent=False)
        self.token_proj = nn.Linear(width, width)
        self.pos_embed = nn.Parameter(torch.randn(context_len, width) * 0.01)
        self.blocks = nn.ModuleList(Block(width, heads, mlp_ratio=MLP_RATIO, qkv_bias=True) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def tokenize(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Captions -> (ids B×T long, mask B×T bool, True up to and including the end-of-text token)."""
        return tokenize(captions, self.context_len)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Padded tokens are masked out as keys, so real tokens never depend on padding."""
        if ids.ndim != 2 or ids.shape != mask.shape or ids.shape[1] > self.context_len:
            raise ValueError(f"expected ids and mask B×T with T <= {self.context_len}, "
                             f"got {tuple(ids.shape)} and {tuple(mask.shape)}")
        T = ids.shape[1]
        x = self.token_proj(self.token_table[ids]) + self.pos_embed[:T]         # B×T×width
        attn_mask = mask[:, None, None, :]                                       # B×1×1×T, True = attend
        for block in self.blocks:
            x = block(x, attn_mask=attn_mask)                                    # B×T×width
        return self.norm(x)                                                      # B×T×width
