"""What a researcher watching `maskbench run` sees: the plan first, each horizon's branch named, one line of
metrics per eval point, the next command at the end; `--cfg` prints the resolved config."""

from __future__ import annotations

import re

import yaml

from maskbench import cli
from tests.conftest import tiny_overrides


def test_the_main_command_tells_its_plan_its_points_and_what_to_run_next(tmp_path, synth_root, capsys):
    overrides = tiny_overrides(tmp_path, synth_root, "arm=mask75_then0")
    assert cli.main(["run", *overrides]) == 0
    out = capsys.readouterr().out.splitlines()
    first_point = next(i for i, line in enumerate(out) if line.startswith(("horizon 0.5 (", "point 1 (")))
    plan = out[:first_point]
    assert any(line.startswith("arm       mask75_then0: 0.75@75%,0@25%") for line in plan)
    assert sum(line.startswith("phase ") for line in plan) == 2
    assert any(line.startswith("paired    with every arm of seed 0") for line in plan)
    # the 0.5 horizon's branch is announced, and its switch to the unmasked phase is said to be the branch's
    assert any(line.startswith("horizon 0.5: its decay branch") for line in out)
    assert any(line.startswith("horizon 0.5's branch: phase 1 from step") for line in out)
    metrics = [line for line in out if re.match(r"(horizon 0\.5|point 1) \(step \d+, ", line)]
    assert len(metrics) == 2  # one line per eval point
    for line in metrics:
        assert re.search(r"FD [\d.e+]+ ± [\d.e+-]+", line) and re.search(r"val loss [\d.e+-]+ ± ", line), line
        assert "align " in line and line.endswith("(8 samples)")
    assert out[-1] == f"rows appended to {tmp_path / 'leaderboard.csv'}; compare the arms with " \
                      f"`maskbench leaderboard {tmp_path / 'leaderboard.csv'}`"


def test_cfg_prints_the_resolved_config_and_trains_nothing(tmp_path, synth_root, capsys):
    assert cli.main(["run", *tiny_overrides(tmp_path, synth_root, "arm=mask75"), "--cfg"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["arm"]["name"] == "mask75" and printed["train"]["batch_size"] == 8
    assert printed["eval"]["points"] == [0.5, 1.0] and not (tmp_path / "runs").exists()
