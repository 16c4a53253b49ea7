"""Device placement: the EMA and everything the trainer makes live on the accelerator's device.

CI has no GPU, so the first test stands another device in for CUDA: an Accelerator whose device is
`meta` and whose `prepare` moves models there, as accelerate's does for a GPU. Anything left on the
CPU (the EMA copied before the move, say) is then visible without a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from torch import nn

from maskbench.config import load_config
from maskbench.eval.sample import euler_sample
from maskbench.results.leaderboard import read_rows
from maskbench.runs.launch import make_trainer
from maskbench.train.loop import Trainer
from tests.conftest import tiny_overrides


class StandInDeviceAccelerator(Accelerator):
    """accelerate on the CPU, but with `meta` where a GPU would be."""

    @property
    def device(self) -> torch.device:
        return torch.device("meta")

    def prepare(self, *objects):
        return tuple(o.to(self.device) if isinstance(o, nn.Module) else o for o in objects)


def test_ema_and_model_are_on_the_accelerators_device(tmp_path: Path, synth_root: Path) -> None:
    trainer = Trainer(load_config(tiny_overrides(tmp_path, synth_root)), StandInDeviceAccelerator(cpu=True))
    trainer.setup()
    assert {p.device.type for p in trainer.model.parameters()} == {"meta"}
    assert {t.device.type for t in trainer.ema.model.state_dict().values()} == {"meta"}
    assert {s.device.type for group in trainer.optimizer.param_groups for s in group["params"]} == {"meta"}


def test_the_sampler_stays_on_the_noises_device(tmp_path: Path, synth_root: Path) -> None:
    trainer = Trainer(load_config(tiny_overrides(tmp_path, synth_root)), StandInDeviceAccelerator(cpu=True))
    trainer.setup()
    model = trainer.ema.model
    noise = torch.randn(2, 3, 32, 32, device="meta")
    context = torch.zeros(2, model.text_encoder.context_len, dtype=torch.long, device="meta")
    mask = torch.ones(2, model.text_encoder.context_len, dtype=torch.bool, device="meta")
    assert euler_sample(model, noise, context, mask, steps=2, cfg_scale=2.0).device.type == "meta"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_short_run_trains_and_evaluates_on_cuda(tmp_path: Path, synth_root: Path) -> None:
    trainer = make_trainer(load_config(tiny_overrides(tmp_path, synth_root)))
    trainer.fit()
    assert {t.device.type for t in trainer.ema.model.state_dict().values()} == {"cuda"}
    rows = read_rows([tmp_path / "leaderboard.csv"])
    assert [row["point"] for row in rows] == [0.5, 1.0] and all(row["fid"] is not None for row in rows)
