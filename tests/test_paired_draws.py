"""Common random numbers: arms with one seed draw the same batches, t, caption dropout and noise at every
step they share; the mask is the only extra draw (DESIGN.md, "Fairness of a comparison")."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from maskbench.config import load_config
from maskbench.runs.launch import train
from maskbench.train.schedule import DRAWS, step_generator
from tests.paired_runs import paired_overrides


def _steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_mission_arms_draw_identical_batches_t_dropout_and_noise_at_every_shared_step(tmp_path, synth_root,
                                                                                         paired_runs):
    runs = {arm: _steps(paired_runs[arm]) for arm in ("mask0", "mask75", "mask75_then0")}
    shared = min(len(steps) for steps in runs.values())
    assert shared > 5
    for arm in ("mask75", "mask75_then0"):
        for base, other in zip(runs["mask0"][:shared], runs[arm][:shared]):
            assert other["data_digest"] == base["data_digest"], (arm, base["step"])
            assert other["draw_digest"] == base["draw_digest"], (arm, base["step"])
    assert {s["mask_ratio"] for s in runs["mask75"][:shared]} == {0.75}  # the arms did differ: mask0 drew no mask
    seed1 = _steps(train(load_config(paired_overrides(tmp_path / "seed1", synth_root, "mask0", "seed=1"))))
    assert len(seed1) == len(runs["mask0"])
    assert all(a["draw_digest"] != b["draw_digest"] for a, b in zip(seed1, runs["mask0"]))


def test_each_purpose_has_its_own_stream_keyed_by_seed_stream_and_step():
    def draw(*key: int, purpose: str = "noise") -> torch.Tensor:
        return torch.rand(4, generator=step_generator(*key, purpose=purpose))

    assert torch.equal(draw(0, 0, 5), draw(0, 0, 5))
    keys = [(0, 0, 5), (1, 0, 5), (0, 1, 5), (0, 0, 6)]
    assert len({tuple(draw(*key).tolist()) for key in keys}) == len(keys)
    assert len({tuple(draw(0, 0, 5, purpose=p).tolist()) for p in DRAWS}) == len(DRAWS)


def test_the_draw_fingerprint_sees_every_byte_and_order():
    from maskbench.train.steplog import fingerprint

    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert fingerprint(x) == fingerprint(x.clone())
    swapped, nudged, signed = x.clone(), x.clone(), torch.zeros(3)
    swapped[[3, 7]] = x[[7, 3]]
    nudged[500] = torch.nextafter(x[500], torch.tensor(1e9))
    assert len({int(fingerprint(v)) for v in (x, swapped, nudged)}) == 3
    assert fingerprint(signed) != fingerprint(-signed)  # -0.0 and 0.0 differ in their bytes
    assert fingerprint(torch.tensor([True, False])) != fingerprint(torch.tensor([False, True]))


def test_a_runs_logged_draws_are_recomputed_from_its_config_on_the_cpu(tmp_path, synth_root, paired_runs):
    """`expected_draw_digests` rebuilds every stream's t, dropout and noise from (config, stream, step) alone, so
    the device check compares a GPU's log against the CPU's (benchmarks/device/arms_check.py `draws_match_cpu`):
    a run's own log matches at every step, and one altered draw does not."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks" / "device"))
    from arms_check import draws_match_cpu

    cfg = load_config(paired_overrides(tmp_path, synth_root, "mask75"))
    steps = _steps(paired_runs["mask75"])
    assert len(steps) > 5 and draws_match_cpu(cfg, steps) is True
    altered = [dict(s, draw_digest=[f"{(int(s['draw_digest'][0], 16) + 1):08x}"]) if s["step"] == 3 else s
               for s in steps]
    assert draws_match_cpu(cfg, altered) is False
    assert draws_match_cpu(load_config(paired_overrides(tmp_path, synth_root, "mask75", "seed=1")), steps) is False
