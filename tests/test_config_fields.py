"""What names a run is declared on each config field (`maskbench.config.fields`: `added`, `not_result`, or neither:
hashed always), and identity reads it: these check that the declarations are read where config_hash reads them,
that a declared field hashes as declared, and that the names of shipped runs do not move."""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from dataclasses import dataclass, field

import pytest

from maskbench.config import Phase, RunConfig, Until, config_hash, identity, load_config, run_id, to_dict
from maskbench.config.fields import ADDED, NOT_RESULT, added, identity_of, not_result


def dotted_fields(tree: dict, prefix: str = "") -> set[str]:
    """Every field of a config tree and every group above it, as dotted names."""
    names = set()
    for key, value in tree.items():
        names.add(f"{prefix}{key}")
        if isinstance(value, dict):
            names |= dotted_fields(value, f"{prefix}{key}.")
    return names


@pytest.mark.parametrize(("listing", "config"), [("NOT_RESULT_FIELDS", RunConfig), ("HASHED_WHEN_SET", RunConfig),
                                                 ("PHASE_HASHED_WHEN_SET", Phase), ("UNTIL_HASHED_WHEN_SET", Until)])
def test_every_listed_field_exists(listing: str, config: type) -> None:
    listed = getattr(identity, listing)
    assert listed and sorted(listed - dotted_fields(to_dict(config()))) == []


def test_a_field_is_either_hashed_when_set_or_never_hashed() -> None:
    assert identity.NOT_RESULT_FIELDS & identity.HASHED_WHEN_SET == set()


@dataclass
class _Group:
    old: int = 1                     # hashed always
    new: int = added(2)              # hashed when set
    scratch: str = not_result("x")   # never


@dataclass
class _Toy:
    group: _Group = field(default_factory=_Group)
    cache: _Group = not_result(default_factory=_Group)  # the whole group, declared once
    later: list[int] = added(default_factory=list)


def test_declarations_are_read_from_the_fields_through_nested_groups() -> None:
    assert identity.declared(_Toy(), ADDED) == {"group.new", "later"}
    assert identity.declared(_Toy(), NOT_RESULT) == {"group.scratch", "cache"}
    assert _Toy().later == [] and _Toy().later is not _Toy().later and _Group.new == 2  # defaults as plain fields'


def _config_classes(cls: type, seen: set[type] | None = None) -> set[type]:
    """Every dataclass the schema reaches from `cls`, through groups, optionals and lists."""
    seen = set() if seen is None else seen
    seen.add(cls)
    for hint in typing.get_type_hints(cls).values():
        for part in (hint, *typing.get_args(hint), *(a for h in typing.get_args(hint) for a in typing.get_args(h))):
            if dataclasses.is_dataclass(part) and part not in seen:
                _config_classes(part, seen)
    return seen


def test_every_declaration_is_where_config_hash_reads_it() -> None:
    """config_hash reads the run config's groups (down to a declared group), a phase's `added` fields and its
    `until` rule's: a declaration anywhere else (a field of a data mix source or a demotion route, a field inside a
    `not_result` group, a phase field declared `not_result`) would be silently ignored."""
    read = {RunConfig, Phase, Until, *(type(getattr(RunConfig(), group)) for group in ("arm", "data", "model", "eval",
                                                                                         "train", "budget"))}
    elsewhere = [f"{cls.__name__}.{f.name}" for cls in _config_classes(RunConfig) - read
                 for f in dataclasses.fields(cls) if identity_of(f) is not None]
    assert elsewhere == []
    assert [f.name for cls in (Phase, Until) for f in dataclasses.fields(cls) if identity_of(f) == NOT_RESULT] == []
    assert {identity_of(f) for cls in read for f in dataclasses.fields(cls)} <= {None, ADDED, NOT_RESULT}


def _other(value: object, hint: object) -> object:
    """A value of type `hint` that differs from `value`."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        return [*(value or []), item() if dataclasses.is_dataclass(item) else _other(None, item)]
    if dataclasses.is_dataclass(hint):
        return hint() if value is None else None
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return next(member for member in hint if member != value)
    if hint is bool:
        return not value
    step = {int: 1, float: 0.5, str: "x"}[hint]
    return step if value is None else value + step


def _leaves(node: object, prefix: str = "", in_not_result: bool = False):
    """(dotted name, field name, its type, never hashed) for every leaf field under `node`, groups walked."""
    hints = typing.get_type_hints(type(node))
    for f in dataclasses.fields(node):
        never = in_not_result or identity_of(f) == NOT_RESULT
        if dataclasses.is_dataclass(getattr(node, f.name)):
            yield from _leaves(getattr(node, f.name), f"{prefix}{f.name}.", never)
        elif f.name != "phases":
            yield f"{prefix}{f.name}", f.name, hints[f.name], never


# model.decoder_ratio is hashed as the decoder width it resolves to (config_hash): without a MaskDiT decoder, none.
_NAMED_BY_ANOTHER = {"model.decoder_ratio"}


def _perturbed_leaves():
    """(name, config with that one leaf changed, the config it was changed from (with an `until` rule or not),
    whether the change must rename the run)."""
    for name, attr, hint, never in _leaves(RunConfig()):
        cfg = RunConfig()
        owner = cfg
        for part in name.split(".")[:-1]:
            owner = getattr(owner, part)
        setattr(owner, attr, _other(getattr(owner, attr), hint))
        yield name, cfg, False, not never and name not in _NAMED_BY_ANOTHER
    for cls, prefix in ((Phase, "arm.phases.0."), (Until, "arm.phases.0.until.")):
        for f in dataclasses.fields(cls):
            cfg = RunConfig()
            if cls is Until:
                cfg.arm.phases[0].until = Until()
            owner = cfg.arm.phases[0] if cls is Phase else cfg.arm.phases[0].until
            setattr(owner, f.name, _other(getattr(owner, f.name), typing.get_type_hints(cls)[f.name]))
            yield f"{prefix}{f.name}", cfg, cls is Until, identity_of(f) != NOT_RESULT


@functools.cache
def _base_hash(with_until: bool) -> str:
    cfg = RunConfig()
    if with_until:
        cfg.arm.phases[0].until = Until()
    return config_hash(cfg)


@pytest.mark.parametrize(("name", "cfg", "with_until", "renames"), [pytest.param(*case, id=case[0])
                                                                     for case in _perturbed_leaves()])
def test_each_field_names_the_run_as_it_declares(name: str, cfg: RunConfig, with_until: bool, renames: bool) -> None:
    """A field with no declaration or declared `added`, set to another value, renames the run; a `not_result` one
    (or one in a `not_result` group such as paths) never does. (That an `added` field left at its default keeps
    the run's name is what the pinned names below check: each such field would otherwise enter every hash.)"""
    assert (config_hash(cfg) != _base_hash(with_until)) == renames


def test_shipped_run_names_do_not_move() -> None:
    """Pinned on purpose: a change here renames every run (it no longer resumes, a sweep retrains its finished cells
    and the leaderboard's rows stop pairing). A new field must be declared `added` (or `not_result`) to keep these."""
    assert run_id(load_config(["arm=mask0"])) == "mask0-synth-micro_s-s0-553eba80"
    assert run_id(load_config(["arm=mask75_then0"])) == "mask75_then0-synth-micro_s-s0-43d176f1"


def test_every_config_key_is_on_the_generated_page_with_a_meaning() -> None:
    """docs/config.md lists every key of the schema with a meaning: a field added without the comment that says
    what it does fails here (the page itself is checked against the schema by tests/test_doctables.py)."""
    from maskbench.config.keys import config_keys

    keys = config_keys()
    groups = {"arm", "data", "model", "eval", "train", "budget", "paths"}
    leaves = {name for name in dotted_fields(to_dict(RunConfig())) if name not in groups and not name.startswith("arm.phases.")}
    assert {key.key for key in keys} == leaves
    assert [key.key for key in keys if not key.meaning] == []
    assert next(key for key in keys if key.key == "model.name").default == "micro_s"  # a run's default, not tiny's
