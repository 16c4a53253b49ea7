"""The package's import graph: data flows one way, and no module imports itself back through others.

Layers, lowest first: data -> models -> train -> eval -> results -> runs (the tools that work on a run
directory) -> the command line. A module may import its own layer and the ones below it, never one
above. A module's layer is its folder: under every layer sits the base, the package's own files (`files`,
`errors`, `manifest`, `weights`, `metrics`) with `config/` (the schema, the model presets, composition) and
`conf/`, which import nothing else of maskbench. Imports inside functions count too: a lazy import is still a
dependency, and so is an import for type hints alone (`if TYPE_CHECKING:`). The rule holds module by module and
folder by folder.
"""

from __future__ import annotations

import ast
import functools
import re
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "maskbench"
LAYERS = ["data", "models", "train", "eval", "results", "runs", "cli"]
COMMAND_LINE = {"cli", "__main__"}  # the package's own files that are the top layer, not the base


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def dynamic_import(node: ast.Call) -> str | None:
    """The module an `importlib.import_module(...)` call names: its string, or for an f-string the literal
    text before the first `{...}` followed by `*` (any module under that prefix); None for any other call."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name != "import_module" or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return f"{arg.values[0].value}*"
    return None


def imports(path: Path, top: str = "maskbench") -> set[str]:
    """Every module of package `top` a file imports, at any depth of its code, importlib loads and imports under
    `if TYPE_CHECKING:` included: a module that names in a type hint the class driving it is tied to it all the same
    (`train.switch` once took the Trainer and reached into it)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith(top)}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(top):
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}  # `from package import module`
        elif isinstance(node, ast.Call) and (target := dynamic_import(node)) and target.startswith(top):
            found.add(target)
    return found


def graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports; an f-string load stands for every module its prefix names."""
    modules = {module_name(path, package): path for path in package.rglob("*.py")}

    def resolve(target: str) -> set[str]:
        if target.endswith("*"):
            return {m for m in modules if m.startswith(target[:-1])}
        return {target} if target in modules else set()

    return {name: {m for t in imports(path, package.name) for m in resolve(t) if m != name}
            for name, path in modules.items()}


@functools.cache
def package_graph() -> dict[str, set[str]]:
    """maskbench's own `graph`, parsed once for this module's tests (read only)."""
    return graph()


def folder(module: str) -> str:
    """The layer folder a module lives in: `data`, ..., `runs`, `cli` (the command line), or "" (the base)."""
    part = module.split(".")[1] if "." in module else ""
    return "cli" if part in COMMAND_LINE else part if part in LAYERS else ""


def layer(module: str) -> int:
    """-1 for the base, else the index of its folder in LAYERS."""
    return LAYERS.index(folder(module)) if folder(module) else -1


def folder_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph folder by folder (the base one node): which layer imports which."""
    folders: dict[str, set[str]] = defaultdict(set)
    for module, targets in edges.items():
        folders[folder(module) or "base"] |= {folder(t) or "base" for t in targets} - {folder(module) or "base"}
    return dict(folders)


def test_no_module_imports_a_layer_above_its_own() -> None:
    upward = sorted(f"{module} -> {target}" for module, targets in package_graph().items() for target in targets
                    if layer(target) > layer(module))
    assert upward == []


def import_loops(edges: dict[str, set[str]]) -> list[str]:
    """Every cycle a depth-first walk of the graph meets, as "a -> b -> a"."""
    state, loops = {}, []

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
    return loops


def test_there_is_no_import_loop() -> None:
    assert import_loops(package_graph()) == []


def test_an_importlib_loop_is_caught(tmp_path: Path) -> None:
    """A driver that loads its plug-ins by name, plug-ins that import the driver back: both spellings of
    the load (a literal and an f-string over a package) close the loop the test must see."""
    package = tmp_path / "pkg"
    (package / "plugins").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "plugins" / "__init__.py").write_text("")
    (package / "plugins" / "one.py").write_text("from pkg.driver import run\n")
    for load in ['importlib.import_module("pkg.plugins.one")', 'importlib.import_module(f"pkg.plugins.{name}")']:
        (package / "driver.py").write_text(f"import importlib\n\ndef run(name):\n    return {load}\n")
        assert import_loops(graph(package)) == ["pkg.driver -> pkg.plugins.one -> pkg.driver"]


def test_no_layer_folder_imports_one_above_it_or_loops_back() -> None:
    """Folder by folder: an import from a lower folder into a higher one, or a loop between two folders (as
    `config` and `models` once imported each other), fails here even where no single module loops."""
    folders = folder_graph(package_graph())
    rank = {name: LAYERS.index(name) if name != "base" else -1 for name in (*LAYERS, "base")}
    upward = sorted(f"{source} -> {target}" for source, targets in folders.items() for target in targets
                    if rank[target] > rank[source])
    assert upward == [] and import_loops(folders) == []


def test_the_base_is_found_by_folder_and_imports_nothing_above_it() -> None:
    """The base is what lives outside the layer folders: config/, conf/ and the package's own files."""
    base = {module for module in package_graph() if layer(module) == -1}
    assert {"maskbench.config.schema", "maskbench.config.presets", "maskbench.errors", "maskbench.metrics"} <= base
    assert not {m for m in base if set(m.split(".")[1:2]) & set(LAYERS)}
    assert not {target for module in base for target in package_graph()[module] if layer(target) != -1}


def test_an_import_for_type_hints_closes_a_loop_too(tmp_path: Path) -> None:
    """The shape of the old `train.switch -> train.loop` import: the driver imports its plug-in, which imports the
    driver's class back under TYPE_CHECKING for its annotations. It is a loop, and the test fails on it."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "loop.py").write_text("from pkg.switch import PhaseRules\n")
    (package / "switch.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                       "    from pkg.loop import Trainer\n")
    assert import_loops(graph(package)) == ["pkg.loop -> pkg.switch -> pkg.loop"]


def layout_blocks(text: str) -> dict[str, str]:
    """docs/layout.md's tree, by package folder: each `  name/` line opens that folder's block (its continuation
    lines included); the other entries at that indent (`cli.py, __main__.py`, ...) are the top level's, ""."""
    blocks: dict[str, str] = defaultdict(str)
    current = ""
    for line in text.split("```")[1].splitlines():
        if entry := re.match(r"^  (\S+)", line):
            first = entry[1].rstrip(",")  # `config/, conf/`: the package folder first
            current = first.removesuffix("/") if first.endswith("/") else ""
        blocks[current] += line + "\n"
    return blocks


def test_the_layout_page_names_every_module() -> None:
    """docs/layout.md is where a newcomer finds a module: every module's file name is in its folder's block (a
    source adapter's by its name, in the `sources/ (...)` list), so a module added without a line there fails here,
    and so does one named only in another folder's block (one of runs/ named only in eval/'s block)."""
    blocks = layout_blocks((PACKAGE.parent / "docs" / "layout.md").read_text())
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        block = blocks[parts[0] if len(parts) > 1 else ""]
        named = path.stem in block if path.parent.name == "sources" else path.name in block
        if path.name != "__init__.py" and not named:
            missing.append("/".join(parts))
    assert missing == []
