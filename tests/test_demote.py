"""Demotion routes: sizes, gates, the route table's loss, positions of non-integer grids, exact FLOPs plans."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from maskbench.cli import main
from maskbench.config import DemoteWindow, demote_routes, format_arm, load_config
from maskbench.data.dataset import resolve_dataset
from maskbench.data.demote import demoted_size
from maskbench.errors import ConfigError
from maskbench.models import objective
from maskbench.models.build import build_model
from maskbench.models.inputs import Demotion, StepInputs
from maskbench.models.objective import demote, window_choice, windowed_flow_loss
from maskbench.runs.launch import train
from maskbench.train.schedule import batch_step_flops, downscaled_count, make_schedule, step_generator
from maskbench.train.step import Stepper
from tests.conftest import SMALL_EVAL, new_trainer, randomized, tiny_overrides
from tests.test_arms import _inputs, _model, _sample_mse

ROUTES = "train.demote_routes=[{ratio: 0.75, t: [0.0, 0.5], priority: 1}, {ratio: 0.5, t: [0.3, 1.0]}]"


def test_demoted_sizes_snap_to_the_patch_grid() -> None:
    assert [demoted_size(32, r, 4) for r in (0.5, 0.75, 0.875)] == [16, 24, 28]
    assert [demoted_size(16, r, 2) for r in (0.75, 0.875)] == [12, 14]       # latent pixels, patch 2


def test_sample_gate_takes_the_first_matching_route_and_batch_gate_needs_every_sample() -> None:
    routes = demote_routes(load_config(["arm=mask0", ROUTES]).train)
    assert [r.ratio for r in routes] == [0.75, 0.5]                           # priority 1 is tried first
    t = torch.tensor([0.1, 0.4, 0.6, 0.95])
    assert window_choice(t, routes, "sample").tolist() == [0, 0, 1, 1]         # 0.4 is in both: 0.75 wins
    assert window_choice(t, routes, "batch").tolist() == [-1] * 4             # no one route holds every t
    assert window_choice(t[1:], routes, "batch").tolist() == [1] * 3          # [0.3, 1] holds 0.4, 0.6, 0.95
    assert window_choice(t[:2], routes, "batch").tolist() == [0] * 2


def test_non_integer_demotion_resizes_with_antialiasing_and_draws_fresh_unit_noise() -> None:
    x0 = torch.randn(64, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    noise = torch.randn(64, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    low, fresh = demote(x0, noise, 0.75, 4, torch.Generator().manual_seed(2))
    want = F.interpolate(x0, size=(24, 24), mode="bilinear", antialias=True, align_corners=False)
    torch.testing.assert_close(low, want)
    assert fresh.shape == (64, 3, 24, 24) and abs(fresh.std().item() - 1) < 0.02 and abs(fresh.mean().item()) < 0.02
    torch.testing.assert_close(fresh, torch.randn(64, 3, 24, 24, generator=torch.Generator().manual_seed(2)))
    low2, pooled = demote(x0, noise, 0.5, 4, None)                          # integer factor: box filter, no draw
    torch.testing.assert_close(low2, F.avg_pool2d(x0, 2))
    torch.testing.assert_close(pooled, 2 * F.avg_pool2d(noise, 2))


def test_non_integer_grids_take_the_table_resampled_at_their_token_centres() -> None:
    model = _model(depth=1)                                                  # 16px, patch 4: a 4×4 grid
    table = model.pos_embed.T.reshape(1, -1, 4, 4)
    want = F.interpolate(table, size=(3, 3), mode="bilinear", antialias=True, align_corners=False)
    torch.testing.assert_close(model.positions(3, 3), want.flatten(2)[0].T)
    # the centre token of the 3×3 grid sits at the native grid's centre, between native tokens 1 and 2
    torch.testing.assert_close(model.positions(3, 3)[4], model.pos_embed.view(4, 4, -1)[1:3, 1:3].mean((0, 1)))


def test_route_table_loss_is_the_sample_mean_of_every_route_and_the_native_part() -> None:
    model = randomized(_model(depth=1), std=0.1)
    x0, noise, _, ids, mask = _inputs(model)
    t = torch.tensor([0.2, 0.7, 0.9])
    drop = torch.tensor([False, True, False])
    routes = [DemoteWindow(0.75, [0.6, 0.8], priority=1), DemoteWindow(0.5, [0.85, 1.0])]
    gen = torch.Generator().manual_seed(3)
    fresh = torch.randn(1, 3, 12, 12, generator=torch.Generator().manual_seed(3))   # sample 1's 12×12 noise
    low75 = _sample_mse(model, F.interpolate(x0[1:2], size=(12, 12), mode="bilinear", antialias=True), fresh,
                        t[1:2], ids[1:2], mask[1:2], drop[1:2])
    low50 = _sample_mse(model, F.avg_pool2d(x0[2:], 2), 2 * F.avg_pool2d(noise[2:], 2), t[2:], ids[2:], mask[2:],
                        drop[2:])
    full = _sample_mse(model, x0[:1], noise[:1], t[:1], ids[:1], mask[:1], drop[:1])
    got = windowed_flow_loss(model, x0, noise, t, ids, mask, drop, StepInputs(demotion=Demotion(routes, "sample", gen)))
    torch.testing.assert_close(got, torch.cat([full, low75, low50]).mean())


def test_a_routed_step_reads_the_device_once_for_its_part_sizes(monkeypatch) -> None:
    """Three parts (native, 0.75, 0.5): the sizes come to the host in one transfer, the rest stays on the device."""
    model = randomized(_model(depth=1), std=0.1)
    x0, noise, _, ids, mask = _inputs(model)
    routes = [DemoteWindow(0.75, [0.6, 0.8], priority=1), DemoteWindow(0.5, [0.85, 1.0])]
    reads = []
    for method in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        original = getattr(torch.Tensor, method)
        monkeypatch.setattr(torch.Tensor, method, lambda self, *a, _f=original, _m=method: reads.append(_m) or _f(self, *a))
    windowed_flow_loss(model, x0, noise, torch.tensor([0.2, 0.7, 0.9]), ids, mask, torch.zeros(3, dtype=torch.bool),
                       StepInputs(demotion=Demotion(routes, "sample", torch.Generator().manual_seed(3))))
    assert reads == ["tolist"]


def test_route_table_refusals() -> None:
    for extra, message in [(["train.demote_routes=[{ratio: 1.5, t: [0, 1]}]"], "outside"),
                           (["train.demote_routes=[{ratio: 0.75, t: [0.5, 0.2]}]"], "t window"),
                           (["train.demote_routes=[{ratio: 0.75, t: [0, 1]}]", "train.downscale_window=[0.0,0.25]"],
                            "shorthand")]:
        with pytest.raises(ConfigError, match=message):
            load_config(["arm=mask0", *extra])
    with pytest.raises(ConfigError, match="does nothing"):
        load_config(["arm=mask0", "train.demote_gate=batch"])
    with pytest.raises(ConfigError, match="token dropping"):
        load_config(["arm=mask75", ROUTES])
    assert demote_routes(load_config(["arm=downscale_window"]).train) == [DemoteWindow(0.5, [0.0, 0.125])]
    with pytest.raises(ConfigError, match="`demote: false` does nothing without train.demote_routes"):
        load_config(["arm=mask0", "arm.phases=[{mask_ratio: 0.0, fraction: 1.0, demote: false}]"])


@pytest.mark.parametrize("gate", ["sample", "batch"])
def test_planned_step_flops_equal_the_flop_counter_on_the_demoted_batches(tmp_path, synth_root, gate) -> None:
    """Each planned step cost is what FlopCounterMode counts for the loss the step runs (its own t, routes and
    sizes: 24 and 16 px beside 32), forward and backward, within the analytic count's 2%."""
    cfg = load_config(tiny_overrides(tmp_path, synth_root, "arm=mask0", ROUTES, f"train.demote_gate={gate}", "train.batch_size=4"))
    data = resolve_dataset(cfg.data, cfg.paths.data, create=False)
    torch.manual_seed(0)
    model = build_model(cfg.model, data)
    routes, seen = demote_routes(cfg.train), set()
    ids, mask = model.text_encoder.tokenize(["a red circle"] * 4)
    for step in range(6):
        gen = step_generator(cfg.seed, 0, step, "t")
        t = objective.sample_t(4, gen, torch.device("cpu"))
        counts = downscaled_count(cfg, 1, step)
        seen |= {i for i, n in enumerate(counts) if n}
        x0, noise = torch.randn(4, 3, 32, 32), torch.randn(4, 3, 32, 32)
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            windowed_flow_loss(model, x0, noise, t, ids, mask, torch.zeros(4, dtype=torch.bool),
                               StepInputs(demotion=Demotion(routes, gate, gen))).backward()
        assert batch_step_flops(cfg, data, 0.0, counts) == pytest.approx(counter.get_total_flops(), rel=0.02)
    if gate == "sample":
        assert seen == {0, 1}                                                 # both routes ran within 6 steps


def test_route_table_arm_trains_to_its_exact_budget(tmp_path, synth_root, monkeypatch) -> None:
    cfg = load_config(["arm=downscale_routes", *tiny_overrides(tmp_path, synth_root, "eval.points=[1.0]", *SMALL_EVAL)])
    sizes: list[int] = []
    original = objective.flow_loss
    monkeypatch.setattr(objective, "flow_loss", lambda model, x0, *a, **k: sizes.append(x0.shape[-1]) or
                        original(model, x0, *a, **k))
    run = new_trainer(cfg).fit()
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    schedule = make_schedule(cfg, resolve_dataset(cfg.data, cfg.paths.data, create=False), n_streams=1)
    assert steps[-1]["flops"] == schedule.total_flops and 32 in sizes and len(set(sizes) - {32}) >= 2


def test_a_phase_without_demotion_trains_native_and_is_planned_at_the_native_cost(tmp_path, synth_root,
                                                                                 monkeypatch) -> None:
    """downscale_routes_late (anima's schedule): every step of its first 25% trains every sample at 32 px and
    is planned at a native step's cost; the routes start at the switch, and the run spends its exact budget."""
    cfg = load_config(["arm=downscale_routes_late", *tiny_overrides(tmp_path, synth_root, "eval.points=[1.0]",
                                                                     *SMALL_EVAL)])
    data = resolve_dataset(cfg.data, cfg.paths.data, create=False)
    assert format_arm(cfg.arm) == "0@25%/native,0@75%"                            # the leaderboard's phases column
    native, late = make_schedule(cfg, data, n_streams=1).phases
    full = batch_step_flops(cfg, data, 0.0)
    assert set(native.flops_per_step) == {full} and min(late.flops_per_step) < full
    now, sizes = {}, []
    stream_loss, flow_loss = Stepper.stream_loss, objective.flow_loss
    monkeypatch.setattr(Stepper, "stream_loss", lambda self, batch, phase, stream, step:
                        now.update(step=step) or stream_loss(self, batch, phase, stream, step))
    monkeypatch.setattr(objective, "flow_loss", lambda model, x0, *a, **k: sizes.append((now.get("step"), x0.shape[-1]))
                        or flow_loss(model, x0, *a, **k))
    run = new_trainer(cfg).fit()
    trained = [(step, size) for step, size in sizes if step is not None]
    assert {size for step, size in trained if step < late.start} == {32}
    assert min(size for step, size in trained if step >= late.start) < 32
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1]["flops"] == make_schedule(cfg, data, n_streams=1).total_flops


def test_probe_certifies_a_route_table_that_run_takes(tmp_path, synth_root, capsys) -> None:
    """`--certify` with a tolerance every finite gap passes: the arm file holds the 0.75 route on every bin with
    signal, and `maskbench run arm=FILE` loads it."""
    run_dir = train(load_config(tiny_overrides(tmp_path, synth_root, "arm=mask0", "eval.points=[1.0]", *SMALL_EVAL)))
    arm = tmp_path / "certified.yaml"
    assert main(["probe", "gradfid", str(run_dir), "--bins", "2", "--batches", "3", "--batch-size", "4",
                 "--demote", "0.75", "--certify", "100", "--certify-out", str(arm)]) == 0
    assert "certified: ratio 0.75" in capsys.readouterr().out
    cfg = load_config([f"arm={arm}"])
    assert cfg.arm.name == "certified" and [r.ratio for r in cfg.train.demote_routes] == [0.75]
    assert cfg.train.demote_routes[0].t[0] in (0.0, 0.5) and cfg.train.demote_routes[0].t[1] in (0.5, 1.0)
