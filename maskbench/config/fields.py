"""What a config field does to a run's name, declared on the field itself (`identity` reads it).

A field declared with neither helper changes results and is hashed into every run id: the fields of the
first results. A field added since is declared `added`, hashed only when set to a value other than its
default, so runs that do not use it keep their names (and resume) across the upgrade. A field that cannot
change what a run learns or measures (a path, a worker count, a kernel choice) is declared `not_result`, never
hashed; declared on a group field (`RunConfig.paths`) it covers the whole group.

    mae_weight: float = added(0.0)         # ...
    demote_routes: list[DemoteWindow] = added(default_factory=list)  # ...
    num_workers: Optional[int] = not_result(None)  # ...
"""

from __future__ import annotations

import dataclasses
from typing import Any

IDENTITY = "maskbench.identity"  # the metadata key a declaration sits under
ADDED = "added"                  # hashed only when set to a non-default value
NOT_RESULT = "not_result"        # never hashed


def added(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING) -> Any:
    """A field added after the first results: hashed into the run id only when it differs from its default."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={IDENTITY: ADDED})


def not_result(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING) -> Any:
    """A field (or a whole group) that never changes what a run learns or measures: never hashed."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={IDENTITY: NOT_RESULT})


def identity_of(f: dataclasses.Field) -> str | None:
    """ADDED, NOT_RESULT, or None for a field hashed always."""
    return f.metadata.get(IDENTITY)
