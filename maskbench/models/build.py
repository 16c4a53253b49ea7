"""Build the model a run trains, and turn a batch's text into the model's context input."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from maskbench.config.presets import ModelConfig
from maskbench.data.dataset import DatasetInfo
from maskbench.models.dit import DiT
from maskbench.models.text import SynthTextEncoder, with_token_ids


def build_model(cfg: ModelConfig, data: DatasetInfo) -> DiT:
    """Latent data brings precomputed text embeddings; synth captions go through a small trainable encoder."""
    if data.latent:
        return DiT(cfg, data.image_size, data.channels, data.context_dim, text_encoder=None)
    text_encoder = SynthTextEncoder(cfg.text_width, cfg.text_depth, cfg.text_len)
    return DiT(cfg, data.image_size, data.channels, cfg.text_width, text_encoder=text_encoder)


def count_params(cfg: ModelConfig, data: DatasetInfo) -> int:
    """The parameter count of the model a run trains, built on the meta device: no weights are allocated or
    initialised, so every shipped arm is sized in seconds (`maskbench arms --sizes`)."""
    with torch.device("meta"):
        return sum(p.numel() for p in build_model(cfg, data).parameters())


def loader_decoder(data: DatasetInfo, cfg: ModelConfig) -> Callable[[dict], dict]:
    """The shard decoder a loader for this model uses: synth captions are tokenized in the loader, off
    the training step, for the model's own text encoder; latent shards carry their text embeddings."""
    if data.latent:
        return data.decode
    return functools.partial(with_token_ids, decode=data.decode, context_len=cfg.text_len)


def batch_context(model: DiT, batch: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(context B×T, mask B×T bool): token ids for the synth encoder, or precomputed embeddings."""
    if model.text_encoder is not None:
        if "txtids" in batch:  # tokenized by the loader (`with_token_ids`)
            return batch["txtids"].to(device, non_blocking=True), batch["txtmask"].to(device, non_blocking=True)
        ids, mask = model.text_encoder.tokenize(batch["caption"])
        return ids.to(device), mask.to(device)
    context = batch["txtemb"].to(device, non_blocking=True).float()               # B×T×D, cast on the device
    mask = batch.get("txtmask")
    if mask is None:
        mask = torch.ones(context.shape[:2], dtype=torch.bool)
    return context, mask.to(device)
