"""Cooled horizons (warmup-stable-decay): each eval point before the last is a decay branch forked from the
trunk, and trains to exactly the weights of a standalone run whose budget is that horizon."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from maskbench.config import load_config
from maskbench.data.dataset import resolve_dataset
from maskbench.errors import ConfigError
from maskbench.results.rows import read_rows
from maskbench.runs.launch import train
from maskbench.train.schedule import make_schedule
from tests.conftest import tiny_overrides
from tests.paired_runs import PAIRED_BUDGET, leaderboard_of, paired_overrides


def _checkpoint(run_dir: Path, point: str) -> Path:
    return run_dir / "checkpoints" / f"point-{point}"


@pytest.mark.parametrize("arm", ["mask75", "mask75_then0"])
def test_a_decay_branch_trains_to_the_weights_of_a_standalone_run_of_its_budget(tmp_path, synth_root, paired_runs,
                                                                                arm):
    # the standalone run of the 0.5 horizon's budget: test_paired_draws' run
    trunk = train(load_config(paired_overrides(tmp_path / "trunk", synth_root, arm, f"budget.flops={2 * PAIRED_BUDGET}",
                                               "eval.points=[0.5,1.0]")))
    alone = paired_runs[arm]
    branch, whole = _checkpoint(trunk, "0.5"), _checkpoint(alone, "1")
    raw_a, raw_b = load_file(branch / "model.safetensors"), load_file(whole / "model.safetensors")
    assert raw_a.keys() == raw_b.keys() and all((raw_a[k] == raw_b[k]).all() for k in raw_a)
    assert (branch / "custom_checkpoint_0.pkl").read_bytes() == (whole / "custom_checkpoint_0.pkl").read_bytes()  # EMA
    trunk_rows = {r["point"]: r for r in read_rows([tmp_path / "trunk" / "leaderboard.csv"])}
    (alone_row,) = read_rows([leaderboard_of(alone)])
    assert alone_row["budget_flops"] == PAIRED_BUDGET
    assert trunk_rows[0.5]["step"] == alone_row["step"] and trunk_rows[0.5]["train_flops"] == alone_row["train_flops"]
    assert trunk_rows[0.5]["val_loss"] == alone_row["val_loss"]
    assert 0 < trunk_rows[0.5]["branch_flops"] < trunk_rows[0.5]["train_flops"] and trunk_rows[1.0]["branch_flops"] == 0
    branch_steps = [json.loads(line) for line in (trunk / "branches" / "point-0.5.jsonl").read_text().splitlines()]
    assert branch_steps[-1]["lr"] < branch_steps[0]["lr"]  # it cooled
    # the trunk went on at the constant LR past the fork: its steps there are not the branch's
    trunk_steps = {s["step"]: s for s in map(json.loads, (trunk / "metrics.jsonl").read_text().splitlines())}
    assert trunk_steps[branch_steps[-1]["step"]]["lr"] > branch_steps[-1]["lr"]


def test_the_fork_is_where_a_horizon_leaves_the_trunk(tmp_path, synth_root):
    def schedule(arm: str):
        cfg = load_config(tiny_overrides(tmp_path, synth_root, f"arm={arm}", "budget.flops=5e9",
                                         "eval.points=[0.25,0.5,1.0]"))
        return make_schedule(cfg, resolve_dataset(cfg.data, cfg.paths.data, create=False), 1)

    single, two = schedule("mask75"), schedule("mask75_then0")
    for horizon in single.horizons:  # one phase: the branch is the horizon's LR decay
        assert horizon.fork == horizon.schedule.decay_start < horizon.schedule.total_steps
    for horizon in two.horizons:  # two phases: the branch is the whole unmasked phase (it holds the decay)
        assert horizon.fork == horizon.schedule.phases[1].start <= horizon.schedule.decay_start
        assert [p.mask_ratio for p in horizon.schedule.phases] == [0.75, 0.0]
    assert [h.point for h in two.horizons] == [0.25, 0.5] and list(two.eval_steps.values()) == [1.0]
    # the LR is constant from the warm-up to a horizon's fork, then decays (1 - sqrt) to near zero
    h = single.horizons[-1].schedule
    factors = [h.lr_factor(step, 2, "wsd") for step in range(h.total_steps)]
    assert factors[2:h.decay_start + 1] == [1.0] * (h.decay_start - 1)
    assert all(a > b for a, b in zip(factors[h.decay_start:], factors[h.decay_start + 1:])) and factors[-1] > 0


def test_a_rule_phase_has_cooled_early_points_only_as_the_first_phase(tmp_path, synth_root):
    """A horizon is the standalone run of its budget only if the rule decides it as it decides the trunk."""
    arm = tmp_path / "late_rule.yaml"
    arm.write_text("name: late_rule\nphases:\n  - {mask_ratio: 0.75, fraction: 0.25}\n"
                   "  - {mask_ratio: 0.5, fraction: 0.5, until: {grad_cosine_below: 0.9}}\n"
                   "  - {mask_ratio: 0.0, fraction: 0.25}\n")
    with pytest.raises(ConfigError, match="to be the first"):
        load_config(tiny_overrides(tmp_path, synth_root, f"arm={arm}"))
    load_config(tiny_overrides(tmp_path, synth_root, f"arm={arm}", "eval.points=[1.0]"))  # one point: no branch


def test_an_arm_can_carry_its_authors_learning_rates_phase_by_phase(tmp_path, synth_root):
    """MicroDiT's schedule: cosine from the LR to a third over the masked phase, then a third, constant."""
    cfg = load_config(tiny_overrides(tmp_path, synth_root, "arm=mask75_then0_microdit"))
    plan = make_schedule(cfg, resolve_dataset(cfg.data, cfg.paths.data, create=False), 1)
    masked, unmasked = plan.phases
    factors = [plan.lr_factor(step, 0, cfg.train.schedule) for step in range(plan.total_steps + 1)]
    assert factors[0] == pytest.approx(1.0) and factors[masked.steps - 1] == pytest.approx(1 / 3)
    assert all(a > b for a, b in zip(factors[:masked.steps - 1], factors[1:masked.steps]))  # cosine, falling
    assert factors[masked.steps:] == pytest.approx([1 / 3] * (unmasked.steps + 1))         # then constant
    with pytest.raises(ConfigError, match="carry their own learning rates"):
        load_config(tiny_overrides(tmp_path, synth_root, "arm=mask75_then0_microdit", "train.schedule=wsd"))
    with pytest.raises(ConfigError, match=r"lr is \[start, end\]"):
        load_config(tiny_overrides(tmp_path, synth_root, "arm=mask75_then0_microdit",
                                   "arm.phases=[{mask_ratio: 0.75, fraction: 1.0, lr: [1.0, 0.0]}]"))
