"""benchmarks/device/kit.sh: its package lists cover what maskbench needs, and its device command is the one the
device machine takes (the build itself downloads: `bash benchmarks/device/kit.sh` and prove_kit.sh, by hand)."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
DEVICE = REPO / "benchmarks" / "device"
# Installed on the device beside its image's Python packages, and never carried: torch and its companions.
WITH_TORCH = {"torch", "torchvision", "triton"}
# Declared by a kit package but not imported on Python >= 3.8 (diffusers reads importlib.metadata there).
NOT_NEEDED = {"importlib_metadata"}
DEVICE_PYTHON = {"python_version": "3.12", "python_full_version": "3.12.3", "extra": ""}


def name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ (]", requirement.strip(), maxsplit=1)[0].lower().replace("-", "_").replace(".", "_")


def listed(path: Path) -> dict[str, str]:
    lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    return {name(line): line for line in lines if line}


def test_the_kit_and_the_image_cover_every_dependency_and_the_kit_pins_one_version_of_each():
    kit, image = listed(DEVICE / "kit-requirements.txt"), listed(DEVICE / "image-requirements.txt")
    assert all(re.fullmatch(r"[\w.-]+==[\w.]+", line) for line in kit.values()), kit  # one version, pinned
    assert not kit.keys() & image.keys()
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert {name(dep) for dep in declared} <= kit.keys() | image.keys() | WITH_TORCH
    for package in kit:  # what each carried package needs is carried too, or on the device
        requires = [Requirement(r) for r in importlib.metadata.requires(package) or []]
        needs = {name(r.name) for r in requires if r.marker is None or r.marker.evaluate(DEVICE_PYTHON)}
        assert needs <= kit.keys() | image.keys() | WITH_TORCH | NOT_NEEDED, (package, needs - kit.keys() - image.keys())


def test_the_printed_device_command_installs_with_no_index_no_deps_and_runs_the_check():
    done = subprocess.run(["bash", "benchmarks/device/kit.sh", "--print"], cwd=REPO, capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[1].strip()
    assert first.startswith("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "
                            "--target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site:$PWD")
    assert first.endswith('bash benchmarks/gpu_check.sh --out "$OUT"') and len(first) <= 2000
    assert "/.whl/" in (REPO / ".gitignore").read_text().splitlines()


def test_python_dash_m_maskbench_is_the_command_line():
    done = subprocess.run([sys.executable, "-m", "maskbench", "arms"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "mask75_then0" in done.stdout
