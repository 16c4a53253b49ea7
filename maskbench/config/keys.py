"""Every config key with its default and its meaning, read from the schema itself (docs/config.md is generated
from it): the dataclasses give the keys and defaults, the comment on each field's line gives the meaning, so the
page cannot drift from the code.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import io
import os
import tokenize
from dataclasses import dataclass
from functools import cache

from maskbench.config.identity import format_arm
from maskbench.weights import ENV


@dataclass(frozen=True)
class ConfigKey:
    key: str        # dotted, as on the command line: train.lr
    default: str    # as Hydra prints it: null for None, a list as [..]
    meaning: str    # the field's comment in the schema ("" where it has none)


@cache
def field_comments(cls: type) -> dict[str, str]:
    """A dataclass's fields' comments: the one on the field's line, with the comment lines right below it that
    continue it (a comment alone on its line, before the next field)."""
    source = inspect.getsource(cls)
    comments: dict[str, str] = {}
    current, names = None, {f.name for f in dataclasses.fields(cls)}
    for line in source.splitlines():
        code, _, comment = _split_comment(line)
        name = code.strip().split(":", 1)[0].strip() if ":" in code else ""
        if name in names:
            current = name
            comments[name] = comment
        elif current and not code.strip() and comment:
            comments[current] = f"{comments[current]} {comment}".strip()
        elif code.strip():
            current = None
    return comments


def _split_comment(line: str) -> tuple[str, str, str]:
    """(code, '#', comment) of one source line, a '#' inside a string left alone."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line).readline))
    except (tokenize.TokenError, IndentationError):  # a line of a bracket opened above: no comment of its own
        return line, "", ""
    for token in tokens:
        if token.type == tokenize.COMMENT:
            return line[:token.start[1]], "#", token.string.lstrip("#").strip()
    return line, "", ""


def config_keys(node: object | None = None, prefix: str = "") -> list[ConfigKey]:
    """Every key of a config (default: what `maskbench run` composes with no override, so the defaults shown are
    a run's: the micro_s model, the mask75_then0 arm), groups (a nested dataclass) expanded, in schema order."""
    if node is None:
        node = default_config()
    keys = []
    comments = field_comments(type(node))
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if f.name == "phases":  # the arm's phases as the leaderboard's phases column writes them
            keys.append(ConfigKey(f"{prefix}{f.name}", format_arm(node), comments.get(f.name, "")))
            continue
        if dataclasses.is_dataclass(value):
            keys += config_keys(value, f"{prefix}{f.name}.")
            continue
        keys.append(ConfigKey(f"{prefix}{f.name}", _shown(value), comments.get(f.name, "")))
    return keys


def default_config():
    """What `maskbench run` composes with no override, on a machine without $MASKBENCH_WEIGHTS (which would fill
    the weight paths): the same page everywhere."""
    from maskbench.config.compose import load_config  # Hydra: only when the page is made

    saved = os.environ.pop(ENV, None)
    try:
        return load_config([])
    finally:
        if saved is not None:
            os.environ[ENV] = saved


def _shown(value: object) -> str:
    """A default as it is written in an override."""
    if value is None:
        return "null"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):  # the arm's phases, routes, mixes
        return f"{len(value)} item(s)"
    if isinstance(value, list):
        return "[" + ",".join(_shown(v) for v in value) + "]"
    return f"{value:g}" if isinstance(value, float) else str(value)
