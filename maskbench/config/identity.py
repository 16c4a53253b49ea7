"""What names a run: the fields that change its results, hashed with the draw scheme into its run id.

Two configs that would train and measure the same thing get the same id (so a run resumes and a sweep
skips a finished cell); any change to what is learned or measured gives a new one.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import pickle
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from maskbench.config.fields import ADDED, NOT_RESULT, identity_of
from maskbench.config.presets import decoder_width, maskdit_decoder
from maskbench.config.schema import ArmConfig, DataConfig, Phase, RunConfig, Trainable, Until
from maskbench.errors import ConfigError


def declared(node: object, kind: str, prefix: str = "") -> set[str]:
    """Dotted names of a config's fields (and groups) declared `kind` (`fields.ADDED` or `fields.NOT_RESULT`),
    read from the dataclasses' field metadata: nested groups are walked, a declared group is named as a whole."""
    names = set()
    for f in dataclasses.fields(node):
        name, value = f"{prefix}{f.name}", getattr(node, f.name)
        if identity_of(f) == kind:
            names.add(name)
        elif identity_of(f) is None and dataclasses.is_dataclass(value):
            names |= declared(value, kind, f"{name}.")
    return names


# Fields added after the first results landed: hashed only when set, so runs that do not use them keep
# their names (and resume) across upgrades. Declared on the fields (`added`); these are views for reading.
HASHED_WHEN_SET = declared(RunConfig(), ADDED)
# The same for the fields of each phase (a list element, so not a dotted name above).
PHASE_HASHED_WHEN_SET = declared(Phase(), ADDED)
# ... and of a phase's `until` (the cosine rule's fields came after the first rule arms' runs).
UNTIL_HASHED_WHEN_SET = declared(Until(), ADDED)
# Fields that cannot change what a run learns or measures (`not_result`); everything else names the run.
NOT_RESULT_FIELDS = declared(RunConfig(), NOT_RESULT)


def to_dict(cfg: RunConfig | Phase | Until) -> dict:
    """A config dataclass as plain data (enums as strings), as it is hashed and saved."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)


def _drop_fields(tree: dict, dotted: set[str], prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if name in dotted:
            continue
        out[key] = _drop_fields(value, dotted, f"{name}.") if isinstance(value, dict) else value
    return out


def _lookup(tree: dict, dotted: str) -> object:
    for key in dotted.split("."):
        tree = tree[key]
    return tree


# How a step's random draws are keyed (`maskbench.train.schedule.step_generator`) and its data read (v2: every
# loader interleaves `LOADER_STREAMS` streams, whatever its worker count; v3: every draw on a CPU generator,
# so a GPU draws what the CPU does, on any GPU model; the numbers a CPU run draws are v2's). Hashed into every
# run id and written in every row: runs trained under an older scheme drew differently, so a new run must not
# resume one of them, and the leaderboard pairs rows of one scheme only.
DRAW_SCHEME = "crn-v3"


def config_hash(cfg: RunConfig) -> str:
    """sha256 of the fields that change results (paths, worker counts, kernel choice excluded), and of
    the draw scheme.

    init_from is hashed as the source's run id and point, not its path: the same source moved or named
    by a relative path is the same start."""
    return _hash_of(pickle.dumps(cfg))


@functools.lru_cache(maxsize=256)  # a function of the config's values alone: a sweep names each cell several times
def _hash_of(pickled: bytes) -> str:
    cfg: RunConfig = pickle.loads(pickled)
    tree, (defaults, phase_defaults, until_defaults) = to_dict(cfg), _defaults()
    unset = {name for name in HASHED_WHEN_SET if _lookup(tree, name) == _lookup(defaults, name)}
    relevant = _drop_fields(tree, NOT_RESULT_FIELDS | unset)
    relevant["arm"]["phases"] = [{k: v for k, v in phase.items()
                                  if k not in PHASE_HASHED_WHEN_SET or v != phase_defaults[k]}
                                 for phase in relevant["arm"]["phases"]]
    for phase in relevant["arm"]["phases"]:
        if phase.get("until"):
            phase["until"] = {k: v for k, v in phase["until"].items()
                              if k not in UNTIL_HASHED_WHEN_SET or v != until_defaults[k]}
    if cfg.init_from is not None:
        relevant["init_from"] = source_label(cfg.init_from)
    relevant["model"].pop("decoder_ratio", None)  # the width it resolves to names the run: ratios that round alike
    if maskdit_decoder(cfg.model):  # are one run, and its runs before the DecoderLayer (full width) are others
        relevant["model"]["decoder_width"] = decoder_width(cfg.model)
    relevant["draws"] = DRAW_SCHEME
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()


def _phase_dict(phase: Phase) -> dict:
    return to_dict(phase)


@functools.cache
def _defaults() -> tuple[dict, dict, dict]:
    """The default config, phase and `until` rule as plain data: constants, so converted once (only read)."""
    return to_dict(RunConfig()), _phase_dict(Phase()), to_dict(Until())


def data_label(data: DataConfig) -> str:
    """The rows' dataset column: the data's name, and for generated synth scenes every generation setting that
    differs from the default (`synth-o11` for one-object scenes), so rows of different scene distributions are
    never pooled. The held-out count is left out: it changes the evaluation's noise, not the data trained on."""
    if data.name != "synth" or data.path is not None or data.mix:
        return data.name
    default = DataConfig()
    differs = [(f"o{data.min_objects}{data.max_objects}", (data.min_objects, data.max_objects) !=
                (default.min_objects, default.max_objects)),
               (f"{data.image_size}px", data.image_size != default.image_size),
               (f"n{data.n_train}", data.n_train != default.n_train), (f"s{data.seed}", data.seed != default.seed)]
    return "-".join(["synth", *(part for part, changed in differs if changed)])


def split_source(init_from: str) -> tuple[Path, Optional[float]]:
    """RUN_DIR@POINT -> (RUN_DIR, POINT); RUN_DIR alone -> (RUN_DIR, None: its final point)."""
    path, at, point = init_from.rpartition("@")
    if not at:
        return Path(init_from), None
    try:
        return Path(path), float(point)
    except ValueError:
        raise ConfigError(f"init_from={init_from!r}: expected RUN_DIR or RUN_DIR@POINT (a fraction such as 0.5)") from None


def source_label(init_from: str) -> str:
    """The source's run id, with @point when one was given (the leaderboard's init_from column)."""
    path, point = split_source(init_from)
    return path.name if point is None else f"{path.name}@{point:g}"


def run_id(cfg: RunConfig) -> str:
    return f"{cfg.arm.name}-{cfg.data.name}-{cfg.model.name}-s{cfg.seed}-{config_hash(cfg)[:8]}"


def format_arm(arm: ArmConfig) -> str:
    """Compact phase list, e.g. `0.75@75%,0@25%` (the leaderboard's `phases` column); a rule phase's
    fraction is a cap (`0@<=30%`), a skips-only phase says so (`/skips`), and so does a phase that turns
    the demotion routes off (`/native`)."""
    return ",".join(f"{p.mask_ratio:g}@{'<=' if p.until else ''}{p.fraction * 100:g}%"
                    f"{'/skips' if p.trainable == Trainable.skips else ''}{'' if p.demote else '/native'}"
                    for p in arm.phases)
