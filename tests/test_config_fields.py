"""The dotted names that decide what names a run are real fields: a renamed field must not silently
rename every run (or start hashing a path)."""

from __future__ import annotations

import pytest

from maskbench.config import RunConfig, identity, to_dict


def dotted_fields(tree: dict, prefix: str = "") -> set[str]:
    """Every field of a config tree and every group above it, as dotted names."""
    names = set()
    for key, value in tree.items():
        names.add(f"{prefix}{key}")
        if isinstance(value, dict):
            names |= dotted_fields(value, f"{prefix}{key}.")
    return names


@pytest.mark.parametrize("listing", ["NOT_RESULT_FIELDS", "HASHED_WHEN_SET"])
def test_every_listed_field_exists(listing: str) -> None:
    assert sorted(getattr(identity, listing) - dotted_fields(to_dict(RunConfig()))) == []


def test_a_field_is_either_hashed_when_set_or_never_hashed() -> None:
    assert identity.NOT_RESULT_FIELDS & identity.HASHED_WHEN_SET == set()


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
