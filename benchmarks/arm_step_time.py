"""Seconds per training step of every shipped arm, per phase, beside its analytic FLOPs.

The leaderboard's compute-to-target is exact on the FLOPs axis; on the hours axis it depends on what
a FLOP of each arm costs in time on a device: long skips add concatenations and norms, a decoder adds
a full-length block, a downscaled sample runs a short sequence, a masked step keeps the text encoder
and the optimizer at full cost. This measures seconds per TFLOP of each (arm, phase) relative to
mask0 on one model in one process. Each step is the trainer's own (`Trainer._step`: its draws, masks,
loss, backward, clipping, AdamW, EMA, digests and diagnostics) on synth data, timed by the trainer's
own clock (`train_seconds`, the figure behind `gpu_hours`: the wait for data is not in it), with the
arms interleaved step by step so that load drift on a shared machine hits all of them alike.

    python benchmarks/arm_step_time.py [--arms mask0 lsc ...] [--model micro_s] [--batch 64] [--steps 10]
    python benchmarks/arm_step_time.py --smoke      # toy size, seconds: checks that the script runs
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import torch
from results_csv import write_rows  # benchmarks/ is on sys.path when a script runs

from maskbench.config import known_arms, load_config
from maskbench.data.dataset import resolve_dataset
from maskbench.train.loop import trainer_for
from maskbench.train.schedule import ScheduledPhase
from maskbench.train.steplog import StepLog

SMOKE = ("model.width=32", "model.depth=2", "model.heads=2", "model.text_width=32", "model.text_depth=1",
         "model.text_len=24", "model.mixer_depth=0", "data.n_train=64", "data.n_val=16", "data.shuffle_buffer=16",
         "budget.flops=1e11")  # 64 scenes to generate, a plan of ~1,000 steps to make, not the default run's


class ArmStep:
    """One arm's trainer, set up on small synth data, stepping at the steps of one of its phases."""

    def __init__(self, arm: str, model: str, batch: int, work: Path, extra: tuple[str, ...] = ()) -> None:
        self.cfg = load_config([f"arm={arm}", f"model={model}", f"train.batch_size={batch}", "data.n_train=2048",
                                "data.n_val=64", "data.shuffle_buffer=64", "train.log_with=none",
                                f"paths.runs={work / 'runs'}", f"paths.data={work / 'data'}",
                                f"paths.leaderboard={work / 'leaderboard.csv'}", *extra])
        self.trainer = trainer_for(self.cfg, resolve_dataset(self.cfg.data, self.cfg.paths.data, create=False))
        self.batch_iters = [iter(loader) for loader in self.trainer.open_loaders({})]
        self.log = StepLog(Path(os.devnull), "w", self.trainer.accelerator, self.cfg.train)

    def step(self, phase: ScheduledPhase, k: int) -> tuple[float, int]:
        """(seconds, analytic FLOPs) of step k of `phase`, as the trainer counts them."""
        trainer, state = self.trainer, self.trainer.state
        state.step = phase.start + k % phase.steps  # the phase's own draws (a demotion step's FLOPs follow its t)
        before = state.train_seconds + state.compile_seconds
        trainer.step(phase, phase.flops_per_step[k % phase.steps], self.batch_iters, [], self.log)
        return state.train_seconds + state.compile_seconds - before, phase.flops_per_step[k % phase.steps]


def measure(arms: list[str], model: str, batch: int, steps: int, warmup: int, extra: tuple[str, ...] = ()) -> list[dict]:
    """Median seconds and mean FLOPs per step of every (arm, distinct phase mask ratio), interleaved."""
    with tempfile.TemporaryDirectory() as work:
        runners = {arm: ArmStep(arm, model, batch, Path(work), extra) for arm in arms}
        cases = [(arm, phase) for arm in arms
                 for phase in {p.mask_ratio: p for p in reversed(runners[arm].trainer.progress.schedule.phases)}.values()]
        samples: dict[tuple[str, float], list[tuple[float, int]]] = {(a, p.mask_ratio): [] for a, p in cases}
        for k in range(warmup + steps):
            for arm, phase in cases:
                result = runners[arm].step(phase, k)
                if k >= warmup:
                    samples[arm, phase.mask_ratio].append(result)
    rows = []
    for (arm, ratio), timed in samples.items():
        seconds = statistics.median(s for s, _ in timed)
        flops = statistics.fmean(f for _, f in timed)
        rows.append(dict(arm=arm, mask_ratio=ratio, model=model, batch=batch, device=str(runners[arm].trainer.accelerator.device),
                         params=runners[arm].trainer.params, median_step_s=round(seconds, 5),
                         train_gflop=round(flops / 1e9, 3), s_per_tflop=round(seconds / flops * 1e12, 4)))
    baseline = next(row["s_per_tflop"] for row in rows if row["arm"] == "mask0" and row["mask_ratio"] == 0.0)
    for row in rows:
        row["time_per_flop_vs_mask0"] = round(row["s_per_tflop"] / baseline, 4)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", nargs="+", default=known_arms(), help="shipped arms (mask0, the baseline, is added)")
    parser.add_argument("--model", default="micro_s", help="model preset (the default run's)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per (arm, phase)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--smoke", action="store_true", help="a toy model, 2 steps, mask0 and mask75: does it run")
    parser.add_argument("--out", type=Path, default=Path("results/arm_step_time.csv"))
    args = parser.parse_args(argv)
    arms = list(dict.fromkeys(["mask0", *(["mask75"] if args.smoke else args.arms)]))
    steps, warmup, extra = (2, 1, SMOKE) if args.smoke else (args.steps, args.warmup, ())
    print(f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")
    rows = measure(arms, "tiny" if args.smoke else args.model, 8 if args.smoke else args.batch, steps, warmup, extra)
    for row in rows:
        print(f"{row['arm']:18s} mask {row['mask_ratio']:<5g} {row['median_step_s']:.4f} s/step "
              f"{row['train_gflop']:8.2f} GFLOP  {row['time_per_flop_vs_mask0']:.3f}× mask0's time per FLOP")
    write_rows(args.out, rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
