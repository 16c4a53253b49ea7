"""Skip-DiT's conversion: init_from, skips-only phases (what trains and what they cost), switch rules, the step guard."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from maskbench.config import Until, config_hash, load_config, run_id
from maskbench.config.presets import PRESETS
from maskbench.data.dataset import resolve_dataset
from maskbench.errors import ConfigError
from maskbench.models.build import build_model
from maskbench.models.dit import DiT
from maskbench.models.inputs import StepInputs
from maskbench.models.masking import random_keep_idx
from maskbench.models.text import VOCAB_SIZE, SynthTextEncoder
from maskbench.results.rows import read_rows
from maskbench.runs.launch import train
from maskbench.runs.source import load_source
from maskbench.train.checkpoint import RunDir
from maskbench.train.flops import skips_only_step_flops, train_step_flops
from maskbench.train.schedule import make_schedule
from maskbench.train.switch import crossed, set_trainable, skip_weight_norm
from tests.conftest import FAST, tiny_overrides
from tests.paired_runs import leaderboard_of

BATCH = 2


def _tiny_dit(**fields) -> DiT:
    cfg = dataclasses.replace(PRESETS["tiny"](), width=64, heads=2, **fields)
    return DiT(cfg, 32, 3, cfg.text_width, SynthTextEncoder(cfg.text_width, cfg.text_depth, cfg.text_len))


def _loss(model: DiT, mask_ratio: float = 0.0) -> torch.Tensor:
    cfg = model.cfg
    context = torch.randint(0, VOCAB_SIZE, (BATCH, cfg.text_len))
    keep_idx = random_keep_idx(BATCH, model.seq_len, mask_ratio, grid=model.grid)
    out = model(torch.randn(BATCH, 3, 32, 32), torch.rand(BATCH), context,
                torch.ones(BATCH, cfg.text_len, dtype=torch.bool), torch.tensor([True, False]), StepInputs(keep_idx))
    return out.square().mean()


@pytest.mark.parametrize(("fusion", "depth", "mask_ratio"), [
    ("concat_ln", 4, 0.0), ("concat", 4, 0.0), ("concat_ln", 5, 0.5), ("concat", 3, 0.75)])
def test_skips_only_step_flops_match_flop_counter_with_the_rest_frozen(fusion: str, depth: int,
                                                                       mask_ratio: float) -> None:
    """Real CPU tensors and unfused attention: FlopCounterMode sees exactly the backward ops autograd runs."""
    model = _tiny_dit(long_skip=fusion, depth=depth)
    set_trainable(model, "skips")
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        _loss(model, mask_ratio).backward()
    cfg = model.cfg
    args = (cfg, 32, 3, cfg.text_width, cfg.text_len, BATCH, mask_ratio, True)
    assert skips_only_step_flops(*args) == counter.get_total_flops()
    assert skips_only_step_flops(*args) < 0.6 * train_step_flops(*args)


def test_a_skips_only_step_changes_the_skip_layers_and_nothing_else() -> None:
    torch.manual_seed(0)
    model = _tiny_dit(long_skip="concat_ln")
    with torch.no_grad():  # like a trained DiT: no zero-initialised gates, so every layer gets a gradient
        for param in model.parameters():
            param.normal_(std=0.05)
    set_trainable(model, "skips")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    _loss(model).backward()
    optimizer.step()
    skips = {name for name, _ in model.skip_parameters()}
    assert skips == {f"long_skips.{i}.{layer}.{p}" for i in (2, 3) for layer in ("norm", "proj")
                     for p in ("weight", "bias")}
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert changed == skips
    set_trainable(model, "all")
    assert all(p.requires_grad for p in model.parameters())


def test_skip_init_options() -> None:
    """identity: with concat fusion the skip layer returns the running tokens; skipdit: PyTorch's own init."""
    model = _tiny_dit(long_skip="concat", skip_init="identity")
    x, skip = torch.randn(2, 5, 64), torch.randn(2, 5, 64)
    assert torch.equal(model.long_skips["2"](x, skip), x)
    torch.manual_seed(0)
    dit = _tiny_dit(long_skip="concat_ln")
    torch.manual_seed(0)
    skipdit = _tiny_dit(long_skip="concat_ln", skip_init="skipdit")
    bound = 1 / math.sqrt(128)  # nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias
    proj = skipdit.long_skips["2"].proj
    assert proj.bias.abs().max() <= bound and proj.bias.abs().max() > 0 and proj.weight.abs().max() <= bound
    assert torch.equal(dit.long_skips["2"].proj.bias, torch.zeros(64))
    others = [name for name, _ in dit.named_parameters() if not name.startswith("long_skips")]
    assert all(torch.equal(dit.get_parameter(n), skipdit.get_parameter(n)) for n in others)


def test_rule_fires_at_the_first_check_that_crosses() -> None:
    """Growth: at the first check where it falls below the threshold, after one where it was at or above."""
    growth = Until(skip_norm_growth_below=0.01, every=5)
    norms = [10.0, 10.05, 10.5, 10.9, 11.0, 11.3, 11.35]  # growth 0.5%, 4.5%, 3.8%, 0.9%, 2.7%, 0.4%
    memory = {"previous": norms[0]}
    fired = [crossed(growth, value, memory, None) for value in norms[1:]]
    assert fired == [False, False, False, True, False, True]
    assert not crossed(growth, 10.0, {}, None)  # no baseline yet
    within = Until(val_loss_within=0.05)
    assert [crossed(within, v, {}, 0.2) for v in (0.3, 0.211, 0.21, 0.19)] == [False, False, True, True]


# ---------------------------------------------------------------------------------------- runs
@pytest.fixture(scope="module")
def source(paired_runs) -> Path:
    """A trained tiny mask0 run, one eval point (test_paired_draws' own; read only): what a conversion starts from."""
    return paired_runs["mask0"]


def _arm_file(tmp: Path, until: str = "") -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "convert.yaml"
    rule = f", until: {until}" if until else ""
    path.write_text("arm:\n  name: convert\n  phases:\n"
                    f"    - {{mask_ratio: 0.0, fraction: 0.5, trainable: skips{rule}}}\n"
                    "    - {mask_ratio: 0.0, fraction: 0.5}\n"
                    "model:\n  long_skip: concat_ln\n")
    return path


def _convert(tmp: Path, synth_root: Path, source: Path, until: str = "", *extra: str):
    cfg = load_config(tiny_overrides(tmp, synth_root, f"arm={_arm_file(tmp, until)}", f"init_from={source}",
                                     "budget.flops=5e9", "eval.points=[1.0]", *FAST, *extra))
    return cfg, train(cfg)


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _skip_weight_norm(record: dict) -> float:
    return math.sqrt(sum(v ** 2 for k, v in record["skip_norm"].items() if k.endswith(".weight")))


def test_a_growth_rule_switches_at_the_first_logged_crossing_and_resume_keeps_it(tmp_path, synth_root, source):
    # Without a rule, stage 1 runs to its cap; its logged skip norms (after each step) give every check's growth.
    cfg, capped = _convert(tmp_path / "capped", synth_root, source)
    records = _records(capped)
    data = resolve_dataset(cfg.data, cfg.paths.data, create=False)
    stage1 = make_schedule(cfg, data, n_streams=1).phases[0].steps
    torch.manual_seed(cfg.seed)  # the skip layers start as the run built them (they are not in the source)
    norms = [skip_weight_norm(build_model(cfg.model, data))] + [_skip_weight_norm(r) for r in records[:stage1]]
    growths = [(b - a) / a for a, b in zip(norms, norms[1:])]  # growths[k]: the check after step k
    # Checks after steps 1 .. stage1-1 (the last step ends the phase anyway): a threshold the growth rises
    # above and later falls below; the switch is the first check below it after one at or above it.
    checked = growths[:stage1 - 1]
    peak = checked.index(max(checked))
    threshold = (checked[peak] + min(checked[peak + 1:])) / 2
    j = next(k for k, g in enumerate(checked) if g < threshold and max(checked[:k], default=-1) >= threshold)
    assert 2 <= j < stage1 - 1
    until = f"{{skip_norm_growth_below: {threshold!r}, every: 1}}"
    cfg, ruled = _convert(tmp_path / "ruled", synth_root, source, until)
    switch = j + 1
    checks = [r["until"] for r in _records(ruled) if "until" in r]
    assert [c["fired"] for c in checks] == [False] * j + [True]
    assert [c["value"] for c in checks] == norms[1:switch + 1]  # the metric the capped run logged
    row = read_rows([tmp_path / "ruled" / "leaderboard.csv"])[-1]
    assert row["switch_step"] == switch and row["init_from"] == source.name
    # The rest of stage 1's allowance moved to stage 2: whole stage-2 steps of what the budget has left.
    frozen, full = records[0]["flops"], records[-1]["flops"] - records[-2]["flops"]
    stage2 = int((cfg.budget.flops - switch * frozen) // full)
    assert (row["step"], row["train_flops"]) == (switch + stage2, switch * frozen + stage2 * full)
    assert stage2 > make_schedule(cfg, data, n_streams=1).phases[1].steps  # more than its own fraction bought
    # Interrupted right after the switch, the resumed run keeps it and ends where the uninterrupted one did.
    _convert(tmp_path / "resumed", synth_root, source, until, f"train.stop_at_step={switch + 1}")
    _, resumed = _convert(tmp_path / "resumed", synth_root, source, until)
    assert [r["loss"] for r in _records(resumed)] == [r["loss"] for r in _records(ruled)]
    assert read_rows([tmp_path / "resumed" / "leaderboard.csv"])[-1]["switch_step"] == switch


def test_the_frozen_stage_keeps_the_source_weights_outside_the_skips(tmp_path, synth_root, source):
    cfg, run_dir = _convert(tmp_path, synth_root, source, "", "train.stop_at_step=2")
    raw = RunDir.raw_weights(RunDir(run_dir).latest_checkpoint())
    src = RunDir.ema_weights(RunDir(source).point_checkpoint(1.0))
    assert set(raw) - set(src) == {k for k in raw if k.startswith("long_skips.")} != set()
    assert all(torch.equal(raw[k], src[k]) for k in src)


def test_continuing_the_source_loads_every_weight_and_names_the_source(tmp_path, synth_root, source):
    overrides = tiny_overrides(tmp_path, synth_root, "arm=mask0", f"init_from={source}", "init_weights=raw")
    cfg = load_config(overrides)
    data = resolve_dataset(cfg.data, cfg.paths.data, create=False)
    model = build_model(cfg.model, data)
    load_source(cfg, data).load(model)
    raw = RunDir.raw_weights(RunDir(source).point_checkpoint(1.0))
    assert all(torch.equal(p, raw[k]) for k, p in model.state_dict().items())
    assert run_id(cfg) != run_id(load_config(tiny_overrides(tmp_path, synth_root, "arm=mask0")))
    assert run_id(cfg) != run_id(load_config(overrides[:-1]))  # init_weights names the run too
    moved = load_config([*overrides[:-2], f"init_from={source.parent}/./{source.name}", "init_weights=raw"])
    assert config_hash(moved) == config_hash(cfg)  # named by the source's run id, not its path


@pytest.mark.parametrize(("extra", "message"), [
    (("model.width=64",), "differs from this run's in width"),
    (("init_from={source}@0.25",), "no checkpoint at point 0.25"),
])
def test_a_source_that_does_not_fit_is_refused(tmp_path, synth_root, source, extra, message):
    overrides = [f"init_from={source}", *[e.format(source=source) for e in extra]]
    cfg = load_config(tiny_overrides(tmp_path, synth_root, "arm=mask0", *overrides))
    with pytest.raises(ConfigError, match=message):
        load_source(cfg, resolve_dataset(cfg.data, cfg.paths.data, create=False))


def test_skips_only_phases_and_rules_need_what_they_use(tmp_path, synth_root):
    arm = _arm_file(tmp_path, "{val_loss_within: 0.05}")
    with pytest.raises(ConfigError, match="needs model.long_skip and init_from"):
        load_config(tiny_overrides(tmp_path, synth_root, f"arm={arm}"))
    last = tmp_path / "last.yaml"
    last.write_text("phases: [{mask_ratio: 0.0, fraction: 1.0, until: {val_loss_within: 0.05}}]\n")
    with pytest.raises(ConfigError, match="last phase cannot end early"):
        load_config(tiny_overrides(tmp_path, synth_root, f"arm={last}", "init_from=runs/a-run"))


def test_step_guard_skips_every_step_above_it_and_still_spends_the_budget(tmp_path, synth_root):
    """Asked for (`train.max_skipped_share=1`; else the run stops, tests/test_step_guard.py): every step skipped,
    and the row says so."""
    cfg = load_config(tiny_overrides(tmp_path, synth_root, "arm=mask0", "train.skip_step_grad_norm=1e-9",
                                     "train.max_skipped_share=1", "budget.flops=1e9", "eval.points=[1.0]", *FAST))
    run_dir = train(cfg)
    records = _records(run_dir)
    assert [r["skipped_grad_norm"] for r in records] == list(range(1, len(records) + 1))
    assert records[-1]["skipped_nonfinite"] == 0
    torch.manual_seed(cfg.seed)
    fresh = build_model(cfg.model, resolve_dataset(cfg.data, cfg.paths.data, create=False))
    raw = RunDir.raw_weights(RunDir(run_dir).point_checkpoint(1.0))
    assert all(torch.equal(p, raw[k]) for k, p in fresh.state_dict().items())  # never stepped
    row = read_rows([cfg.paths.leaderboard])[-1]
    assert row["train_flops"] == records[-1]["flops"] > 0.9 * cfg.budget.flops
    assert row["skipped_steps"] == row["step"] == len(records)


def test_a_converted_run_that_charges_its_source_carries_the_sources_flops(tmp_path, synth_root, source):
    """arm.charge_source: the source's training FLOPs at the point the run starts from go into the rows'
    auxiliary_flops (which the charged multiplier adds); without it the conversion's rows carry 0 (no REPA either)."""
    charged_cfg, _ = _convert(tmp_path / "charged", synth_root, source, "", "arm.charge_source=true")
    plain_cfg, _ = _convert(tmp_path / "plain", synth_root, source)
    (source_row,) = read_rows([leaderboard_of(source)])
    assert [row["auxiliary_flops"] for row in read_rows([charged_cfg.paths.leaderboard])] == [source_row["train_flops"]]
    assert [row["auxiliary_flops"] for row in read_rows([plain_cfg.paths.leaderboard])] == [0.0]  # none spent


def test_the_conversion_as_shipped_trains_in_every_phase(tmp_path, synth_root, source):
    """`lsc_convert` from a trained source: its step guard (relative to the phase's own norms) lets the skips train
    in stage 1 and every weight in stage 2, where Skip-DiT's absolute 0.02 refused every step."""
    cfg = load_config(tiny_overrides(tmp_path, synth_root, "arm=lsc_convert", f"init_from={source}",
                                     "budget.flops=1e10", "eval.points=[1.0]", *FAST))
    run_dir = train(cfg)
    records, row = _records(run_dir), read_rows([cfg.paths.leaderboard])[-1]
    totals = [0] + [r["skipped_grad_norm"] + r["skipped_nonfinite"] for r in records]
    skipped = [after > before for before, after in zip(totals, totals[1:])]
    assert row["skipped_steps"] == sum(skipped) <= 0.05 * len(records)  # measured: 0 of 78
    switch = row["switch_step"]
    assert 0 < switch < len(records) and not all(skipped[:switch]) and not all(skipped[switch:])
    data = resolve_dataset(cfg.data, cfg.paths.data, create=False)
    torch.manual_seed(cfg.seed)  # the skips as the run built them (each step's log is after its update)
    model = build_model(cfg.model, data)
    norms = [skip_weight_norm(model)] + [_skip_weight_norm(r) for r in records]
    assert [after != before for before, after in zip(norms, norms[1:])] == [not s for s in skipped]
    raw = RunDir.raw_weights(RunDir(run_dir).point_checkpoint(1.0))
    src = RunDir.ema_weights(RunDir(source).point_checkpoint(1.0))
    trained = [name for name, _ in model.named_parameters() if name in src]  # frozen in stage 1: moved by stage 2
    assert trained and all(not torch.equal(raw[name], src[name]) for name in trained)
