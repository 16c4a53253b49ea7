"""Configuration: composition, validation (one line, exit 2, no run directory) and run naming."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest

from maskbench.cli import main
from maskbench.config import config_hash, known_arms, load_config, run_id
from maskbench.errors import ConfigError
from tests.conftest import tiny_overrides


def test_defaults_compose_to_the_main_arm():
    cfg = load_config([])
    assert cfg.arm.name == "mask75_then0"
    assert [(p.mask_ratio, p.fraction) for p in cfg.arm.phases] == [(0.75, 0.75), (0.0, 0.25)]
    assert cfg.model.name == "micro_s" and cfg.data.name == "synth"
    assert cfg.model.mixer_depth == 1  # MicroDiT's deferred masking: the model micro_diffusion #10 ran


def test_model_presets_are_selectable():
    cfg = load_config(["model=dit_b2"])
    assert (cfg.model.depth, cfg.model.width, cfg.model.heads, cfg.model.patch_size) == (12, 768, 12, 2)


def test_user_arm_file(tmp_path):
    arm = tmp_path / "half.yaml"
    arm.write_text("phases:\n  - {mask_ratio: 0.5, fraction: 0.6}\n  - {mask_ratio: 0.0, fraction: 0.4}\n")
    cfg = load_config([f"arm={arm}"])
    assert cfg.arm.name == "half"
    assert [(p.mask_ratio, p.fraction) for p in cfg.arm.phases] == [(0.5, 0.6), (0.0, 0.4)]


def test_an_arm_file_with_options_takes_a_model_preset_and_overrides(tmp_path):
    """A global-package arm file (the kind `probe gradfid --certify` writes) beside `model=PRESET`: the preset is
    a group choice, composed before the file; dotted overrides still win over the file."""
    arm = tmp_path / "routes.yaml"
    arm.write_text("arm:\n  name: routes\n  phases:\n  - {mask_ratio: 0.0, fraction: 1.0}\n"
                   "train:\n  demote_routes:\n  - {ratio: 0.75, t: [0.0, 0.5]}\n  lr: 0.002\n")
    cfg = load_config([f"arm={arm}", "model=tiny_deep", "train.lr=3e-3", "seed=2"])
    assert (cfg.model.name, cfg.model.depth, cfg.train.lr, cfg.seed) == ("tiny_deep", 13, 3e-3, 2)
    assert [(r.ratio, list(r.t)) for r in cfg.train.demote_routes] == [(0.75, [0.0, 0.5])]


def test_run_id_names_arm_data_model_seed_and_hash():
    cfg = load_config(["arm=mask0", "seed=3"])
    assert run_id(cfg).startswith("mask0-synth-micro_s-s3-")
    assert config_hash(cfg) != config_hash(load_config(["arm=mask0", "seed=4"]))
    # paths and worker counts do not change results, so they do not change the name
    assert config_hash(cfg) == config_hash(load_config(["arm=mask0", "seed=3", "paths.runs=/elsewhere",
                                                        "data.num_workers=2"]))


def _arm_file(tmp_path, name: str, body: str) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(body)
    return f"arm={path}"


@pytest.mark.parametrize("case, expected", [
    ("unknown_arm", "unknown arm 'nope'; known arms: downscale_routes, downscale_routes_late, downscale_window"),
    ("unknown_key", "unknown or invalid key: 'train.no_such_key'"),
    ("fractions", "phase fractions sum to 0.9, not 1"),
    ("ratio", "mask ratio 1.0 is outside [0, 1)"),
    ("budget", "too small for one step"),
])
def test_bad_input_exits_2_with_one_line_and_no_run_dir(tmp_path, synth_root, capsys, case, expected):
    bad = {
        "unknown_arm": "arm=nope",
        "unknown_key": "train.no_such_key=1",
        "fractions": _arm_file(tmp_path, "fractions", "phases:\n  - {mask_ratio: 0.75, fraction: 0.5}\n"
                                         "  - {mask_ratio: 0.0, fraction: 0.4}\n"),
        "ratio": _arm_file(tmp_path, "ratio", "phases:\n  - {mask_ratio: 1.0, fraction: 1.0}\n"),
        "budget": "budget.flops=1e6",
    }[case]
    code = main(["run", *tiny_overrides(tmp_path, synth_root, bad)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and expected in err, err
    assert not (tmp_path / "runs").exists()


def test_console_script_help_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "maskbench", "--help"], capture_output=True, text=True, check=True)
    for command in ("run", "arms", "data"):
        assert command in out.stdout


@pytest.mark.parametrize("override", ["eval.points=[0.0]", "train.batch_size=many", "train.no_such_key=1"])
def test_config_error_is_a_value_error(override):
    """Code that catches ValueError catches every bad config: one refused by validation and ones Hydra
    refuses (its errors are not ValueErrors), each as a ConfigError rather than whatever raised it."""
    with pytest.raises(ValueError) as raised:
        load_config([override])
    assert raised.type is ConfigError


@functools.cache
def shipped_schedule(arm: str):
    """A shipped arm's default config, its dataset and its schedule, made once per test process."""
    from maskbench.data.dataset import resolve_dataset
    from maskbench.train.schedule import make_schedule

    conversion = ["init_from=runs/a-trained-run", "model=tiny_deep"]  # Skip-DiT's conversion: no mixer
    cfg = load_config([f"arm={arm}", *(conversion if arm == "lsc_convert" else [])])
    data = resolve_dataset(cfg.data, cfg.paths.data, create=False)
    return cfg, data, make_schedule(cfg, data, n_streams=1)


def test_shipped_arms_spend_the_default_budget_within_one_percent_of_each_other():
    spent = {}
    for arm in known_arms():
        cfg, _, schedule = shipped_schedule(arm)
        spent[arm] = schedule.total_flops
        assert spent[arm] <= cfg.budget.flops
    assert max(spent.values()) / min(spent.values()) < 1.01, spent


@pytest.mark.parametrize("arm", known_arms())
def test_a_phase_of_equal_steps_is_planned_as_the_step_by_step_count_plans_it(arm, monkeypatch):
    """`constant_cost` counts a phase's steps at once where every step costs the same; for each shipped arm (its rule
    probes, demotions and skips-only phases included) the plan is the one counting step by step gives."""
    import maskbench.train.schedule as schedule

    cfg, data, at_once = shipped_schedule(arm)
    schedule_phases = schedule.schedule_phases
    monkeypatch.setattr(schedule, "schedule_phases", lambda *args: schedule_phases(*args[:4]))  # no constant_cost
    assert at_once == schedule.make_schedule(cfg, data, n_streams=1)


@pytest.mark.parametrize(("overrides", "refused"), [
    ([], False), (["arm=mask75"], False), (["model=tiny", "arm=sprint75", "model.width=32", "seed=3"], False),
    (["data=sa1b", "data.path=/x"], False),
    (["eval.points=[0.5,1.0]", "train.demote_routes=[{ratio: 0.875, t: [0, 1]}]", "arm=downscale_routes"], False),
    (["eval=default", "eval.n_samples=16", "model.kernels=torch", "model=micro_xs"], False),
    (["model.width=32", "model=tiny"], False),  # a value before its group's choice: the choice first, as in Hydra
    (["eval.n_sample=10"], True), (["+model.unheard_of=1"], False), (["model=dit_s3"], True),
    (["seed=notanumber"], True), (["eval.points=[0.5"], True),
])
def test_a_composition_from_the_kept_groups_is_hydras_own(overrides, refused):
    """`composed_config` (the group choices composed once, the values applied to a copy) gives what Hydra's compose
    gives, value for value, and the same error where Hydra refuses."""
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from maskbench.config.compose import _register_schema, composed_config, hydra_compose

    _register_schema()
    outcomes = []
    for compose in (lambda: hydra_compose(tuple(overrides)), lambda: composed_config(overrides)):
        try:
            outcomes.append(OmegaConf.to_container(compose()))
        except (HydraException, OmegaConfBaseException) as err:
            outcomes.append((type(err), str(err)))
    assert outcomes[0] == outcomes[1] and isinstance(outcomes[0], tuple) == refused
