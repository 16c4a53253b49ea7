"""Device placement: the EMA and everything the trainer makes live on the accelerator's device.

CI has no GPU, so the first test stands another device in for CUDA: an Accelerator whose device is
`meta` and whose `prepare` moves models there, as accelerate's does for a GPU. Anything left on the
CPU (the EMA copied before the move, say) is then visible without a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from maskbench.config import demote_routes, load_config
from maskbench.data.demote import ratio_key
from maskbench.eval.sample import euler_sample
from maskbench.results.rows import read_rows
from maskbench.runs.launch import make_trainer
from tests.conftest import arm_overrides, distinct_arms, new_trainer, tiny_overrides


class StandInDeviceAccelerator(Accelerator):
    """accelerate on the CPU, but with `meta` where a GPU would be."""

    @property
    def device(self) -> torch.device:
        return torch.device("meta")

    def prepare(self, *objects):
        prepared = tuple(o.to(self.device) if isinstance(o, nn.Module) else o for o in objects)
        return prepared[0] if len(prepared) == 1 else prepared  # as accelerate's


def test_ema_and_model_are_on_the_accelerators_device(tmp_path: Path, synth_root: Path) -> None:
    trainer = new_trainer(load_config(tiny_overrides(tmp_path, synth_root)), StandInDeviceAccelerator(cpu=True))
    assert {p.device.type for p in trainer.parts.model.parameters()} == {"meta"}
    assert {t.device.type for t in trainer.ema.model.state_dict().values()} == {"meta"}
    assert {s.device.type for group in trainer.parts.optimizer.param_groups for s in group["params"]} == {"meta"}


def test_the_sampler_stays_on_the_noises_device(tmp_path: Path, synth_root: Path) -> None:
    trainer = new_trainer(load_config(tiny_overrides(tmp_path, synth_root)), StandInDeviceAccelerator(cpu=True))
    model = trainer.ema.model
    noise = torch.randn(2, 3, 32, 32, device="meta")
    context = torch.zeros(2, model.text_encoder.context_len, dtype=torch.long, device="meta")
    mask = torch.ones(2, model.text_encoder.context_len, dtype=torch.bool, device="meta")
    assert euler_sample(model, noise, context, mask, steps=2, cfg_scale=2.0).device.type == "meta"


class MixedDevices(TorchDispatchMode):
    """Records every operation whose tensor operands live on more than one device (copies excepted): on a
    GPU each is an error ("indices should be either on cpu or on the same device") or a silent host trip."""

    def __init__(self) -> None:
        super().__init__()
        self.mixed: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = {x.device.type for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor) and x.dim()}
        if len(devices) > 1 and func not in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            self.mixed.append(f"{func}: {sorted(devices)}")
        return func(*args, **kwargs)


@pytest.mark.parametrize("arm", distinct_arms())  # each arm another does not cover (its phases, same options)
def test_every_arms_step_keeps_its_tensors_on_the_models_device(tmp_path, synth_root, arm):
    """Each phase's loss and backward with the model on a stand-in device, from a loader batch on the host
    (with the demoted latents latent shards would bring): no operation mixes host and device tensors. Every
    draw is made on the host and copied over (`meta` cannot hold a generator: a draw made on the device fails)."""
    cfg = load_config(arm_overrides(tmp_path, synth_root, arm, "eval.points=[1.0]", "budget.flops=1e10",
                                    "data.num_workers=0"))  # a budget with a step in every arm's every phase
    trainer = new_trainer(cfg, StandInDeviceAccelerator(cpu=True))
    batch = next(iter(trainer.streams.open(0, {})[0]))
    batch["demoted"] = {ratio_key(r.ratio): F.avg_pool2d(batch["image"], 2) for r in demote_routes(cfg.train)}  # host, as loaded
    for phase in trainer.progress.schedule.phases:
        with MixedDevices() as record:
            loss, digest = trainer.stepper.stream_loss(batch, phase, stream=0, step=phase.start)
            loss.backward()
        assert record.mixed == [] and loss.device.type == digest.device.type == "meta", (phase.mask_ratio, record.mixed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_short_run_trains_and_evaluates_on_cuda(tmp_path: Path, synth_root: Path) -> None:
    trainer = make_trainer(load_config(tiny_overrides(tmp_path, synth_root)))
    trainer.fit()
    assert {t.device.type for t in trainer.ema.model.state_dict().values()} == {"cuda"}
    rows = read_rows([tmp_path / "leaderboard.csv"])
    assert [row["point"] for row in rows] == [0.5, 1.0] and all(row["fid"] is not None for row in rows)
