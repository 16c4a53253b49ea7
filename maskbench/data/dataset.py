"""Resolve a data config to shard directories and the shapes the model needs.

The one place that knows the difference between the embedded `synth` default (pixels + captions,
generated on first use, a small trainable text encoder) and latent shards from `maskbench data encode`
(VAE latents + precomputed text embeddings, shapes read from the manifest).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from maskbench.config import DataConfig
from maskbench.data.demote import demoted_size, ratio_key
from maskbench.data.shards import decode_image_caption, decode_latent_text
from maskbench.errors import ConfigError
from maskbench.manifest import read_manifest


@dataclass(frozen=True)
class VaeSpec:
    """The VAE that encoded a latent dataset, as `maskbench data encode` recorded it in the manifest.

    Encoding stored latent = (posterior mean − shift) · scale; decoding must undo exactly that, so the
    factors travel with the data rather than with the evaluation config.
    """
    path: str              # a diffusers AutoencoderKL folder
    scaling_factor: float
    shift_factor: float
    resolution: int        # pixel side of the encoded (and so of the decoded) images

    @classmethod
    def from_manifest(cls, latent: dict) -> VaeSpec:
        return cls(str(latent["vae"]), float(latent["scaling_factor"]), float(latent.get("shift_factor") or 0.0),
                   int(latent["resolution"]))


@dataclass(frozen=True)
class DatasetInfo:
    name: str
    train_dir: Path
    val_dir: Path
    image_size: int       # pixels or latent size (the model's input)
    channels: int
    latent: bool          # True: KEY.latent.npy + KEY.txtemb.npy; False: image + caption
    context_dim: int      # text embedding width (0 = the model's own synth text encoder)
    context_len: int
    mix: tuple[tuple[Path, float], ...] = ()  # data=mix: (train dir, weight) of every source
    vae: VaeSpec | None = None                # latent data: the VAE its latents decode with
    synthetic: bool = False                   # synth scenes in pixels: the shipped oracle scores them
    demoted: tuple[tuple[str, int], ...] = ()  # latent data: (ratio key, latent side) encoded with --demote

    def demoted_size(self, ratio: float, patch: int) -> int:
        """The side a demotion route at `ratio` trains at: pixels are resized in the step, latents must
        have been encoded at that ratio (`maskbench data encode --demote`)."""
        if not self.latent:
            size = demoted_size(self.image_size, ratio, patch)
        elif (size := dict(self.demoted).get(ratio_key(ratio))) is None:
            encoded = ", ".join(key for key, _ in self.demoted) or "none"
            raise ConfigError(f"demotion route {ratio:g} needs demoted latents, and {self.train_dir} has {encoded}: "
                              f"encode with `maskbench data encode ... --demote {ratio:g}`")
        if size % patch or not patch <= size < self.image_size:
            raise ConfigError(f"demotion route {ratio:g} gives {size}×{size} inputs, not a smaller whole number of "
                              f"{patch}-pixel patches of the native {self.image_size}")
        return size

    @property
    def pixel_size(self) -> int:
        """Side of the images the image metrics see: the data's own, or the decoded latents'."""
        return self.vae.resolution if self.vae else self.image_size

    @property
    def train_source(self) -> Path | list[tuple[Path, float]]:
        """What the loader reads: the train shard dir, or the weighted train dirs of a mix."""
        return list(self.mix) if self.mix else self.train_dir

    def decode(self, sample: dict) -> dict:
        """The shard decoder for this data: image + caption, or latent + text embedding."""
        return decode_latent_text(sample) if self.latent else decode_image_caption(sample)


def synth_dir(cfg: DataConfig, data_root: str | Path) -> Path:
    """Where the synth data for these parameters lives: one folder per parameter set."""
    return Path(data_root) / (f"synth-{cfg.image_size}px-o{cfg.min_objects}{cfg.max_objects}"
                              f"-n{cfg.n_train}-v{cfg.n_val}-s{cfg.seed}")


def resolve_mix(cfg: DataConfig) -> DatasetInfo:
    """Several shard roots sampled by weight; they must agree on shapes. Eval uses the first's val split."""
    if not cfg.mix:
        raise ConfigError("data=mix needs data.mix=[{path: DIR, weight: W}, ...]")
    infos = [resolve_dataset(DataConfig(name=cfg.name, path=source.path, image_size=cfg.image_size,
                                        channels=cfg.channels), "") for source in cfg.mix]
    shapes = {(i.image_size, i.channels, i.latent, i.context_dim, i.context_len) for i in infos}
    if len(shapes) > 1:
        raise ConfigError(f"data.mix sources differ in shape (size, channels, latent, text dim, text len): {shapes}")
    if any(source.weight <= 0 for source in cfg.mix):
        raise ConfigError("data.mix weights must be positive")
    mix = tuple((info.train_dir, source.weight) for info, source in zip(infos, cfg.mix))
    return replace(infos[0], name=cfg.name, mix=mix, synthetic=all(info.synthetic for info in infos))


def generate_synth(cfg: DataConfig, data_root: str | Path) -> None:
    """Write the synth scenes a config names if they are not there yet; nothing for shards on disk or a mix.

    Apart from `resolve_dataset` so that a run plans on the data's description (`create=False`) and generates
    it only once the plan holds, without resolving twice."""
    if cfg.path is None and not cfg.mix and cfg.name == "synth":
        from maskbench.data.synth import write_synth
        write_synth(synth_dir(cfg, data_root), n_train=cfg.n_train, n_val=cfg.n_val, seed=cfg.seed,
                    image_size=cfg.image_size, min_objects=cfg.min_objects, max_objects=cfg.max_objects)


def resolve_dataset(cfg: DataConfig, data_root: str | Path, create: bool = True) -> DatasetInfo:
    """Locate (and, for synth, generate on first use unless `create` is off) the train/val shards of a data
    config. Synth data not generated is described from its config: what it will be once `generate_synth` runs."""
    if cfg.mix:
        return resolve_mix(cfg)
    if cfg.path is None and cfg.name != "synth":
        raise ConfigError(f"data {cfg.name!r} needs data.path=DIR (a folder with train/ and val/ shards)")
    if create:
        generate_synth(cfg, data_root)
    root = synth_dir(cfg, data_root) if cfg.path is None else Path(cfg.path)
    train_dir, val_dir = root / "train", root / "val"
    if cfg.path is None and not create:
        return DatasetInfo(cfg.name, train_dir, val_dir, cfg.image_size, cfg.channels, False, 0, 0, synthetic=True)
    for split in (train_dir, val_dir):
        if not (split / "manifest.json").is_file():
            raise ConfigError(f"no shards at {split} (expected manifest.json; build them with `maskbench data ...`)")
    latent = read_manifest(train_dir).get("latent")
    if latent is None:
        # The oracle knows synth scenes only: synth shards count as synth when used as such (or in a mix).
        synthetic = cfg.name in ("synth", "mix") and read_manifest(val_dir).get("source") == "synth"
        return DatasetInfo(cfg.name, train_dir, val_dir, cfg.image_size, cfg.channels, False, 0, 0,
                           synthetic=synthetic)
    return DatasetInfo(cfg.name, train_dir, val_dir, int(latent["size"]), int(latent["channels"]), True,
                       int(latent["text_dim"]), int(latent["text_len"]), vae=VaeSpec.from_manifest(latent),
                       demoted=tuple(sorted(latent.get("demote", {}).items())))
