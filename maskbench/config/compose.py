"""Composing a run's config: Hydra's compose API over the YAML packaged in `maskbench/conf`, the arm
(shipped or a user's file), the data's label from its manifest and the weights folder.

Hydra's compose API (not `@hydra.main`) is used so the CLI keeps its own subcommands and so every bad
input becomes one clear line and exit code 2 *before* any work starts (`ConfigError`). Model presets are
the one-line functions in `maskbench.config.presets`, registered as the `model` group.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from pathlib import Path
from typing import Optional

import yaml
from hydra import compose, initialize_config_module
from hydra._internal.config_loader_impl import ConfigLoaderImpl  # Hydra's own: how compose applies key=value
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from maskbench.config.presets import PRESETS, ModelConfig, maskdit_decoder
from maskbench.config.schema import CONF_DIR, CONFIG_GROUPS, ArmConfig, DataConfig, EvalConfig, RunConfig
from maskbench.config.validate import validate
from maskbench.errors import ConfigError
from maskbench.manifest import read_manifest
from maskbench.weights import REGISTRY, WeightFile, weights_folder


@functools.cache  # the store is the process's: once is enough (each call re-converts every preset)
def _register_schema() -> None:
    store = ConfigStore.instance()
    store.store(name="run_schema", node=RunConfig)
    for name, preset in PRESETS.items():
        store.store(group="model", name=name, node=preset())


def known_arms() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "arm").glob("*.yaml"))


def shipped_arm(name: str) -> ArmConfig:
    """A shipped arm's phases and description, read from its YAML alone (no Hydra compose: `maskbench arms`)."""
    loaded = OmegaConf.load(CONF_DIR / "arm" / f"{name}.yaml")
    node = loaded.arm if "arm" in loaded else loaded
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ArmConfig), node))


def arm_settings(name: str) -> list[str]:
    """The model/train options a shipped arm sets besides its phases, as `key=value` strings."""
    loaded = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "arm" / f"{name}.yaml"))
    if "arm" not in loaded:  # a phases-only arm file
        return []
    return [f"{group}.{key}={value}" for group, options in loaded.items() if group != "arm"
            for key, value in options.items()]


def _split_arm_file(overrides: list[str]) -> tuple[list[str], Optional[Path]]:
    """`arm=path/to/arm.yaml` names a user's arm file; Hydra only knows packaged group options."""
    rest, arm_file = [], None
    for item in overrides:
        key, _, value = item.partition("=")
        if key == "arm" and (value.endswith((".yaml", ".yml")) or "/" in value):
            arm_file = Path(value)
            if not arm_file.is_file():
                raise ConfigError(f"arm file not found: {arm_file}")
        else:
            rest.append(item)
    return rest, arm_file


def _check_overrides(overrides: list[str]) -> None:
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"expected key=value, got {item!r}")
        if key == "arm" and value not in known_arms():
            raise ConfigError(f"unknown arm {value!r}; known arms: {', '.join(known_arms())} "
                              "(or pass arm=path/to/arm.yaml)")
        if key == "model" and value not in PRESETS:
            raise ConfigError(f"unknown model {value!r}; known models: {', '.join(PRESETS)}")


def load_config(overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Compose the packaged defaults with `key=value` overrides, validate, and return a RunConfig."""
    overrides, arm_file = _split_arm_file(list(overrides))
    _check_overrides(overrides)
    _register_schema()
    try:
        composed = composed_config(overrides)
        if arm_file is not None:
            composed = _merge_arm_file(composed, arm_file, overrides)
        cfg: RunConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), composed))
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(_one_line(err)) from None
    if cfg.model.resplit:
        cfg.model.depth = resplit_depth(cfg.model, baseline_model(cfg.model.name, overrides))
    validate(cfg)
    _label_data(cfg.data, named=any(o.partition("=")[0].lstrip("+") in ("data", "data.name") for o in overrides))
    _fill_weights(cfg)
    return cfg


def hydra_compose(overrides: tuple[str, ...]) -> DictConfig:
    """Hydra's compose of the packaged YAML (`maskbench/conf`) with `overrides`."""
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="maskbench.conf", version_base=None):
        return compose(config_name="config", overrides=list(overrides))


@functools.lru_cache(maxsize=64)
def _groups_composed(choices: tuple[str, ...]) -> DictConfig:
    """`hydra_compose` of group choices alone (arm=, model=, data=, eval=), kept: the packaged files do not change
    while a process runs. Read only: `composed_config` copies it."""
    return hydra_compose(choices)


@functools.cache
def _hydra_groups() -> frozenset[str]:
    """The config groups Hydra knows: the folders of `maskbench/conf` and the stored `model` presets."""
    folders = {path.name for path in CONF_DIR.iterdir() if path.is_dir() and not path.name.startswith("_")}
    return frozenset(folders | {"model"})


def composed_config(overrides: list[str]) -> DictConfig:
    """What `hydra_compose(overrides)` returns, in ~0.01 s instead of ~0.2 s (a sweep composes each cell several
    times; the test suite, thousands of runs): the group choices' composition is made once and copied, and the
    key=value overrides are applied to the copy as Hydra applies them after composing the defaults, in struct
    mode (`ConfigLoaderImpl._apply_overrides_to_config`: the same values, the same errors). Hydra sorts the
    overrides the same way (`defaults_list.Overrides`): one naming a group, unless its value is a dict, is a
    choice. A sweep or `hydra.*` override goes to Hydra whole."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    if any(o.is_sweep_override() or o.is_hydra_override() for o in parsed):
        return hydra_compose(tuple(overrides))
    is_choice = [o.key_or_group in _hydra_groups() and not isinstance(o.value(), dict) for o in parsed]
    cfg = copy.deepcopy(_groups_composed(tuple(o.input_line for o, choice in zip(parsed, is_choice) if choice)))
    ConfigLoaderImpl._apply_overrides_to_config([o for o, choice in zip(parsed, is_choice) if not choice], cfg)
    return cfg


def baseline_model(name: str, overrides: list[str]) -> ModelConfig:
    """The model the same command gives the baseline: the preset with the command line's model.* options."""
    model = OmegaConf.structured(PRESETS[name]())
    options = [o for o in overrides if o.startswith("model.")]
    merged = OmegaConf.merge(model, OmegaConf.from_dotlist([o.removeprefix("model.") for o in options]))
    return OmegaConf.to_object(merged)


def resplit_depth(model: ModelConfig, baseline: ModelConfig) -> int:
    """The backbone depth that keeps the baseline's full-width blocks once the arm's mixer and full-width decoder
    blocks are taken out of them (`ModelConfig.resplit`). SPRINT splits SiT-XL's own 28 blocks into 2 dense + 24
    sparse + 2 decoder (snap-research/Sprint configs/train/SIT_XL_SPRINT_256.yaml) rather than adding blocks;
    MaskDiT keeps DiT-XL's 28 as its encoder and adds a narrow decoder (Anima-Lab/MaskDiT models/maskdit.py), so
    on micro_s its encoder runs the mixer's block too. docs/arms.md cites the lines of both."""
    blocks = baseline.mixer_depth + baseline.depth + baseline.decoder_depth
    depth = blocks - model.mixer_depth - (0 if maskdit_decoder(model) else model.decoder_depth)
    if depth < 1:
        raise ConfigError(f"model.resplit: {model.name}'s {blocks} blocks leave no backbone block after "
                          f"{model.mixer_depth} mixer and {model.decoder_depth} decoder block(s)")
    return depth


def _label_data(data: DataConfig, named: bool) -> None:
    """Data on data.path takes the name its shards' manifest records, so the run id and the rows say what
    was trained on; `named`: the command line named the data (data=NAME, data.name=NAME), and a name that
    contradicts the manifest is refused. A manifest written before sources were recorded keeps a given
    name, or else takes the folder's name, and says so in one printed line."""
    if data.path is None or data.mix:
        return
    root = Path(data.path)
    source = read_manifest(root / "train").get("source")
    if source is None:
        if not named:
            print(f"maskbench: {root / 'train' / 'manifest.json'} records no source: labelling the data "
                  f"{root.resolve().name!r} after its folder (data.name=NAME names it)")
            data.name = root.resolve().name
        return
    if named and data.name != source:
        raise ConfigError(f"data.name={data.name} contradicts the shards at {root}, whose manifest records the source "
                          f"{source!r}: drop data=/data.name= (the manifest names the data) or pass data.name={source}")
    data.name = source


def fill_eval_weights(cfg: EvalConfig, folder: Path, registry: tuple[WeightFile, ...] = REGISTRY) -> EvalConfig:
    """`cfg` with each unset eval.*_weights option pointing at its registry file in `folder`.

    A needed file is pointed at even when absent, so the loader's refusal names the path it expected; an
    optional one (FD-DINOv2) only when present, since setting it turns its metric on. A file fills its
    option only for the architecture it holds weights of (CLIP weights are ViT-H-14's).
    """
    filled = {}
    for entry in registry:
        path = folder / entry.file
        if entry.fills is None or getattr(cfg, entry.fills) is not None:
            continue
        if entry.arch is not None and getattr(cfg, entry.arch[0]) != entry.arch[1]:
            continue
        if entry.needed or path.is_file():
            filled[entry.fills] = str(path)
    return dataclasses.replace(cfg, **filled)


def _fill_weights(cfg: RunConfig) -> None:
    """eval.*_weights left unset take their file from the weights folder (paths.weights or $MASKBENCH_WEIGHTS)."""
    cfg.paths.weights = weights_folder(cfg.paths.weights)
    if cfg.paths.weights is not None:
        cfg.eval = fill_eval_weights(cfg.eval, Path(cfg.paths.weights))


def _merge_arm_file(composed: DictConfig, arm_file: Path, overrides: list[str]) -> DictConfig:
    """A user's arm file: phases only (the `arm` group's keys), or, like the shipped arms in the global
    package, an `arm:` section plus model/train options. Command-line overrides still win over the file."""
    try:
        loaded = OmegaConf.load(arm_file)
    except (UnicodeDecodeError, yaml.YAMLError) as err:  # binary, or not YAML
        raise ConfigError(f"arm file {arm_file} is not valid YAML: {_one_line(err)}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"arm file {arm_file} must be a mapping with `phases` (or an `arm:` section)")
    arm_only = "arm" not in loaded
    arm = loaded if arm_only else loaded.arm
    if not isinstance(arm, DictConfig) or "phases" not in arm:
        raise ConfigError(f"arm file {arm_file} has no `phases` list: an arm is its phases "
                          "(e.g. phases: [{mask_ratio: 0.75, fraction: 1.0}])")
    if "name" not in arm:
        arm.name = arm_file.stem
    if arm_only:
        composed.arm = OmegaConf.merge(OmegaConf.structured(ArmConfig), arm)
        return composed
    values = [o for o in overrides if o.partition("=")[0] not in CONFIG_GROUPS]  # groups were composed already
    return OmegaConf.merge(composed, loaded, OmegaConf.from_dotlist(values))


def load_run_config(run_dir: str | Path) -> RunConfig:
    """The resolved config a run recorded in its directory (what `eval` and `repro` rebuild it from)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no config.yaml)")
    try:
        recorded = OmegaConf.load(path)
    except (UnicodeDecodeError, yaml.YAMLError) as err:  # a binary or truncated file: not what a run writes
        raise ConfigError(f"{path} is not a run's config (not YAML text: {_one_line(err)})") from None
    if not isinstance(recorded, DictConfig) or not recorded:  # empty, or a list: defaults would stand in for it
        raise ConfigError(f"{path} is not a run's config (not a mapping of its settings)")
    try:
        cfg: RunConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), recorded))
    except OmegaConfBaseException as err:
        raise ConfigError(f"{path}: {_one_line(err)}") from None
    return cfg


def with_eval_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """A recorded run's config with eval.* / paths.* changed (what re-evaluation may change), validated."""
    bad = [o for o in overrides if not o.startswith(("eval.", "paths."))]
    if bad:
        raise ConfigError(f"only eval.* and paths.* can change when re-evaluating; got {bad[0]!r}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(cfg), OmegaConf.from_dotlist(overrides))
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(_one_line(err)) from None
    validate(cfg)
    _fill_weights(cfg)
    return cfg


def _one_line(err: BaseException) -> str:
    """The first line of an error and of each error that caused it (Hydra wraps OmegaConf's reason)."""
    parts = []
    while err is not None:
        text = str(err).strip()
        parts.append(text.splitlines()[0] if text else type(err).__name__)
        err = err.__cause__
    return ": ".join(parts).replace("Could not override", "unknown or invalid key:").strip()


