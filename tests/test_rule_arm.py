"""The arm that unmasks when masking stops paying (issue 28): a masked phase ended by the masked gradient's
debiased cosine to the full one, its probe charged to the budget, and cooled horizons that are the
standalone runs of their budgets whether the rule fired before their cap or not."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from maskbench.config import Until, load_config
from maskbench.data.dataset import resolve_dataset
from maskbench.errors import ConfigError
from maskbench.results.estimators import debiased_cosine
from maskbench.results.rows import read_rows
from maskbench.runs.launch import train
from maskbench.train.schedule import batch_step_flops, make_schedule
from maskbench.train.switch import cosine_from_products, cross_products, crossed
from tests.conftest import FAST, new_trainer, tiny_overrides
from tests.paired_runs import leaderboard_of


def test_cross_products_give_the_probe_estimators_debiased_cosine() -> None:
    """Known gradients (loss = w·v has gradient v): the sums give `debiased_cosine`'s point estimate."""
    gen = torch.Generator().manual_seed(0)
    mean = torch.randn(50, generator=gen)
    full = [mean + 0.5 * torch.randn(50, generator=gen) for _ in range(5)]                     # a_i
    masked = [0.8 * mean + torch.randn(50, generator=gen) for _ in range(5)]                    # b_i
    weight = torch.nn.Linear(50, 1, bias=False)

    def losses(a: torch.Tensor, b: torch.Tensor):
        return lambda: ((weight.weight[0] * a).sum(), (weight.weight[0] * b).sum())

    products = cross_products([losses(a, b) for a, b in zip(full, masked)], weight)
    a, b = torch.stack(full).double().numpy(), torch.stack(masked).double().numpy()
    estimate = debiased_cosine(a @ a.T, b @ b.T, a @ b.T)
    assert cosine_from_products(products) == pytest.approx(estimate.cosine, rel=1e-9)
    assert estimate.cosine - estimate.naive > 0.3  # noisy enough that the per-part cosines are far lower
    assert np.isnan(cosine_from_products(torch.tensor([-1.0, 2.0, 0.5], dtype=torch.float64)))


def test_the_cosine_rule_fires_below_its_threshold_and_never_on_nan() -> None:
    rule = Until(grad_cosine_below=0.9)
    assert [crossed(rule, v, {}, None) for v in (0.95, 0.9, 0.89, float("nan"))] == [False, False, True, False]


# ---------------------------------------------------------------------------------------- runs
def _arm(tmp: Path, threshold: float, every: int = 2, per_flop: bool = False) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "rule.yaml"
    path.write_text("name: rule\nphases:\n"
                    f"  - {{mask_ratio: 0.75, fraction: 0.75, until: {{grad_cosine_below: {threshold}, "
                    f"every: {every}, probe_splits: 4, per_flop: {str(per_flop).lower()}}}}}\n"
                    "  - {mask_ratio: 0.0, fraction: 0.25}\n")
    return path


def _cfg(tmp: Path, synth_root: Path, threshold: float, *extra: str, every: int = 2, per_flop: bool = False):
    """~30 steps (~11 checks at every 2); no eval metric is read but the val loss, compared between runs alike."""
    return load_config(tiny_overrides(tmp, synth_root, f"arm={_arm(tmp, threshold, every, per_flop)}",
                                      "budget.flops=5e9", "eval.points=[1.0]", *FAST, *extra))


@pytest.fixture(scope="module")
def never(tmp_path_factory, synth_root) -> Path:
    """The rule run whose rule never fires, with a cooled horizon at 0.5: its checks' logged cosines give the switch
    test its threshold (the trunk's checks are a one-point run's), and it is the cooled-horizon test's trunk at -1."""
    return train(_cfg(tmp_path_factory.mktemp("never"), synth_root, -1.0, "eval.points=[0.5,1.0]"))


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_plan_charges_one_full_and_one_masked_pass_at_each_check(tmp_path, synth_root):
    cfg = _cfg(tmp_path, synth_root, -1.0, every=3)
    data = resolve_dataset(cfg.data, cfg.paths.data, create=False)
    masked = make_schedule(cfg, data, 1).phases[0]
    probe = batch_step_flops(cfg, data, 0.0) + batch_step_flops(cfg, data, 0.75)
    step = batch_step_flops(cfg, data, 0.75)
    assert masked.steps > 6
    assert list(masked.flops_per_step) == [step + (probe if (k + 1) % 3 == 0 else 0) for k in range(masked.steps)]


def test_the_probe_costs_what_the_plan_charges(tmp_path, synth_root):
    """FlopCounterMode around the probe of one step: a full and a masked forward + backward of the batch."""
    cfg = _cfg(tmp_path, synth_root, -1.0)
    trainer = new_trainer(cfg)
    batches = [next(iter(loader)) for loader in trainer.streams.open(0, {})]
    phase = trainer.progress.schedule.phases[0]
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:  # the fused kernel is not counted
        value = trainer.rules.probe_cosine(batches, phase, 0)
    planned = batch_step_flops(cfg, trainer.data, 0.0) + batch_step_flops(cfg, trainer.data, 0.75)
    assert counter.get_total_flops() == pytest.approx(planned, rel=0.02)
    assert -1.5 < value < 1.5
    assert all(p.grad is None for p in trainer.parts.net.parameters())  # the probe leaves the step's gradients alone


def test_a_cosine_rule_switches_at_its_first_crossing_and_spends_the_budget(tmp_path, synth_root, never):
    checks = [(r["step"], r["until"]["cosine"]) for r in _records(never) if "until" in r]
    values = np.array([v for _, v in checks])  # NaN where a part's signal is below its noise (2 samples a part)
    finite = values[np.isfinite(values)]
    assert len(values) >= 4 and len(finite) >= 3 and all(-1.5 < finite) and all(finite < 1.5)
    # A threshold between the logged values: the rule run (same draws, same weights until it fires) switches
    # at the first check below it; later checks after the switch are gone (phase 1 has no rule).
    threshold = float(np.median(finite))
    first = next(k for k, v in enumerate(values[:-1]) if v < threshold)
    cfg = _cfg(tmp_path / "ruled", synth_root, threshold)
    ruled = train(cfg)
    logged = [r["until"] for r in _records(ruled) if "until" in r]
    np.testing.assert_array_equal([c["value"] for c in logged], values[:first + 1])  # value = cosine, not per FLOP
    assert [c["fired"] for c in logged] == [False] * first + [True]
    row = read_rows([tmp_path / "ruled" / "leaderboard.csv"])[-1]
    switch = checks[first][0] + 1
    assert row["switch_step"] == switch
    assert cfg.budget.flops - batch_step_flops(cfg, resolve_dataset(cfg.data, cfg.paths.data), 0.0) \
        < row["train_flops"] <= cfg.budget.flops  # the cap's allowance moved on: the budget is spent


def test_a_per_flop_rule_divides_the_cosine_by_the_masked_steps_share(tmp_path, synth_root):
    cfg = _cfg(tmp_path, synth_root, 2.5, "budget.flops=2.5e9", per_flop=True, every=4)
    data = resolve_dataset(cfg.data, cfg.paths.data)
    share = batch_step_flops(cfg, data, 0.75) / batch_step_flops(cfg, data, 0.0)
    checks = [r["until"] for r in _records(train(cfg)) if "until" in r]
    decided = [c for c in checks if c["value"] is not None]
    assert decided and 0.2 < share < 0.8
    for check in decided:
        assert check["value"] == pytest.approx(check["cosine"] / share) or np.isnan(check["cosine"])
    # no check follows the one that fires: the masked phase has ended
    assert [c["fired"] for c in decided] == [c["value"] < 2.5 for c in decided]


@pytest.mark.parametrize("threshold", [-1.0, 2.0])  # the rule never fires / fires at its first check
def test_a_rule_arms_cooled_horizon_is_the_standalone_run_of_its_budget(tmp_path, synth_root, request, threshold):
    # the trunk that never fires is the switch test's; one that fires at its first check needs fewer steps
    budget = 5e9 if threshold < 0 else 2.5e9
    trunk = request.getfixturevalue("never") if threshold < 0 else train(
        _cfg(tmp_path / "trunk", synth_root, threshold, "eval.points=[0.5,1.0]", f"budget.flops={budget}"))
    alone = train(load_config(tiny_overrides(tmp_path / "alone", synth_root, f"arm={_arm(tmp_path, threshold)}",
                                             f"budget.flops={budget / 2}", "eval.points=[1.0]", *FAST)))
    branch, whole = trunk / "checkpoints" / "point-0.5", alone / "checkpoints" / "point-1"
    raw_a, raw_b = load_file(branch / "model.safetensors"), load_file(whole / "model.safetensors")
    assert raw_a.keys() == raw_b.keys() and all((raw_a[k] == raw_b[k]).all() for k in raw_a)
    rows = {r["point"]: r for r in read_rows([leaderboard_of(trunk)])}
    (alone_row,) = read_rows([leaderboard_of(alone)])
    for field in ("step", "train_flops", "val_loss", "switch_step"):
        assert rows[0.5][field] == alone_row[field], field
    fired = [r for r in _records(alone) if r.get("until", {}).get("fired")]
    assert bool(fired) == (threshold > 1)


@pytest.mark.parametrize("phases, message", [
    ("[{mask_ratio: 0.75, fraction: 0.9, until: {grad_cosine_below: 0.9}}, {mask_ratio: 0.0, fraction: 0.1}]",
     "end before the LR decay"),
    ("[{mask_ratio: 0.0, fraction: 0.5, until: {grad_cosine_below: 0.9}}, {mask_ratio: 0.0, fraction: 0.5}]",
     "needs mask_ratio > 0"),
    ("[{mask_ratio: 0.75, fraction: 0.5, until: {grad_cosine_below: 0.9, probe_splits: 2}}, "
     "{mask_ratio: 0.0, fraction: 0.5}]", "probe_splits must be >= 3"),
    ("[{mask_ratio: 0.75, fraction: 0.5, until: {skip_norm_growth_below: 0.1, per_flop: true}}, "
     "{mask_ratio: 0.0, fraction: 0.5}]", "per_flop scales the cosine rule"),
])
def test_a_cosine_rule_is_refused_where_it_cannot_mean_what_it_says(tmp_path, synth_root, phases, message):
    arm = tmp_path / "bad.yaml"
    arm.write_text(f"name: bad\nphases: {phases}\n")
    with pytest.raises(ConfigError, match=message):
        load_config(tiny_overrides(tmp_path, synth_root, f"arm={arm}"))
