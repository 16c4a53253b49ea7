"""The package's import graph: data flows one way, and no module imports itself back through others.

Layers, lowest first: data -> models -> train -> eval -> results -> runs (the tools that work on a run
directory) -> the command line. A module may import its own layer and the ones below it, never one
above. Under every layer sits the config schema (`config`, `conf`, `models.presets`, `files`, `errors`,
`manifest`, `weights`), which imports nothing else of maskbench. Imports inside functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "maskbench"
LAYERS = ["data", "models", "train", "eval", "results", "runs", "cli"]
BASE = {"maskbench", "maskbench.conf", "maskbench.config", "maskbench.models.presets", "maskbench.files",
        "maskbench.errors", "maskbench.manifest", "maskbench.weights"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every maskbench module a file imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("maskbench")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("maskbench"):
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}  # `from package import module`
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {name: {m for m in imports(path) if m in modules and m != name} for name, path in modules.items()}


def layer(module: str) -> int:
    if module in BASE:
        return -1
    part = module.split(".")[1]
    return LAYERS.index("cli" if part == "__main__" else part)


def test_no_module_imports_a_layer_above_its_own() -> None:
    upward = sorted(f"{module} -> {target}" for module, targets in graph().items() for target in targets
                    if layer(target) > layer(module))
    assert upward == []


def test_there_is_no_import_loop() -> None:
    edges, state, loops = graph(), {}, []

    def visit(module: str, trail: list[str]) -> None:
        state[module] = "open"
        for target in sorted(edges[module]):
            if state.get(target) == "open":
                loops.append(" -> ".join(trail[trail.index(target):] + [target]))
            elif target not in state:
                visit(target, trail + [target])
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert loops == []


def test_the_layers_cover_every_module() -> None:
    assert all(layer(module) >= -1 for module in graph())
