"""Every shipped arm for a few steps, in one process per shard, with Dynamo's counts per arm and the draws compared.

    python benchmarks/device/arms_check.py --work DIR --out arms.jsonl [--arms A B ...] [--jobs N]
        [--backend aot_eager] [--deadline-s S] -- KEY=VALUE...

Each arm trains through every phase on the overrides after `--` (data, model, kernels, compile, budget: the
caller sizes them), then evaluates once. Per arm, one JSON line, appended the moment the arm ends (a check cut
by its time limit keeps the arms it finished: benchmarks/stream.py): status, seconds, the first error line, steps
and mask ratios seen, the peak GPU memory, Dynamo's frames, graphs, graph breaks and recompiles (with their first
reasons and any hit of the recompile limit, after which a frame runs eagerly), and its draws (t, caption dropout,
noise: `draw_digest`), which must equal mask0's at every step both took (gpu_check_report.draws_match_mask0). Two
arms of one seed must draw the same: mask75 and mask75_then0 against mask0 decide this script's exit status, with
every arm's own.

Shipped arms that need more than a name: lsc_convert starts from this check's mask0 run (init_from, so both go to
one shard, mask0 first); mask75_until_cosine checks its rule every 2 steps instead of 100 (a copy of the arm file
with `every: 2`), so the probe and the switch it decides run within a few steps; an arm whose shortest phase would
buy no whole step gets the budget doubled until it does (`fitting_budget`). A phase switch is one recompile (a graph per phase, as designed):
the counts show any beyond that.

--jobs N runs N shards as N processes (compilation is CPU-bound; the arms of a shard share one process), each
given the same deadline: an arm not started by then is reported as not reached, and the shard ends cleanly. The
shards append their lines to the one file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import yaml
from instruments import DynamoCounts, peak_memory_gib, use_backend  # this script's folder is on sys.path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from gpu_check_report import draws_match_mask0  # noqa: E402
from stream import announce, append_json_line, fresh  # noqa: E402

PAIRED = ("mask75", "mask75_then0")  # must draw as mask0 does (tests/test_paired_draws.py, here on the device)
MAX_DOUBLINGS = 6  # an arm's budget grows at most 64x over the others' (`fitting_budget`)


def rule_arm_file(work: Path) -> Path:
    """mask75_until_cosine with its rule checked every 2 steps (the shipped file checks every 100)."""
    from maskbench.config import CONF_DIR

    arm = yaml.safe_load((CONF_DIR / "arm" / "mask75_until_cosine.yaml").read_text())
    arm["phases"][0]["until"]["every"] = 2
    path = work / "mask75_until_cosine_every2.yaml"
    path.write_text(yaml.safe_dump(arm, sort_keys=False))
    return path


def ordered(arms: list[str]) -> list[str]:
    """mask0 first (the draws' reference and lsc_convert's source), then the paired arms, then the rest."""
    first = [a for a in ("mask0", *PAIRED) if a in arms]
    return first + [a for a in arms if a not in first]


def shards(arms: list[str], jobs: int) -> list[list[str]]:
    """Round-robin over `ordered`, lsc_convert in mask0's shard (it starts from mask0's run)."""
    out: list[list[str]] = [[] for _ in range(max(1, jobs))]
    rest = [a for a in ordered(arms) if a != "lsc_convert"]
    for i, arm in enumerate(rest):
        out[i % len(out)].append(arm)
    if "lsc_convert" in arms:
        out[0].append("lsc_convert")
    return [shard for shard in out if shard]


def fitting_budget(arm_overrides: list[str]) -> list[str]:
    """The budget override that gives the arm's every phase a whole step: the one given, doubled while the plan
    refuses it as too small for one step (a short phase, maskdit50_authors' unmasked 5%, or a costlier step,
    REPA's). Planning only, no data touched; a hand-kept table of arms went stale with every new arm."""
    from maskbench.config import load_config
    from maskbench.data.dataset import resolve_dataset
    from maskbench.errors import ConfigError
    from maskbench.train.build import run_schedule

    budget = next((o for o in reversed(arm_overrides) if o.startswith("budget.flops=")), None)
    if budget is None:
        return []
    flops = float(budget.partition("=")[2])
    for _ in range(MAX_DOUBLINGS):
        try:
            cfg = load_config([*arm_overrides, f"budget.flops={flops:g}"])
            run_schedule(cfg, 1, resolve_dataset(cfg.data, cfg.paths.data, create=False))
            break
        except ConfigError as err:
            if "too small for one step" not in str(err):
                break  # the run itself will say what is wrong
            flops *= 2
    return [f"budget.flops={flops:g}"]


def first_error_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"[:300]


def draws_match_cpu(cfg, steps: list[dict]) -> bool | None:
    """Whether every step's logged draw digests (made where the run trained) equal the CPU's recomputation of the
    same draws (`train.step.expected_draw_digests`): on a GPU, whether the common random numbers hold across
    devices, not only across arms on one. None: no step to check."""
    import torch

    from maskbench.data.dataset import resolve_dataset
    from maskbench.train.step import expected_draw_digests

    if not steps:
        return None
    data = resolve_dataset(cfg.data, cfg.paths.data, create=False)
    n_streams = len(steps[0]["draw_digest"])
    shape = torch.Size((cfg.train.batch_size // n_streams, data.channels, data.image_size, data.image_size))
    return all(s["draw_digest"] == expected_draw_digests(cfg, n_streams, s["step"], shape) for s in steps)


def run_arm(arm: str, work: Path, overrides: list[str], counts: DynamoCounts, source: Path | None) -> dict:
    """Train one arm on the overrides; what it did, what Dynamo did, or its first error line."""
    from maskbench.config import load_config
    from maskbench.runs.launch import train

    spec = str(rule_arm_file(work)) if arm == "mask75_until_cosine" else arm
    extra = [f"init_from={source}"] if arm == "lsc_convert" and source is not None else []
    extra += fitting_budget([f"arm={spec}", *overrides, *extra])
    root = work / arm
    record: dict = {"arm": arm, "status": "failed"}
    counts.reset()
    peak_memory_gib(reset=True)
    tick = time.perf_counter()
    try:
        cfg = load_config([f"arm={spec}", *overrides, *extra, f"paths.runs={root / 'runs'}",
                           f"paths.leaderboard={root / 'leaderboard.csv'}"])
        run_dir = train(cfg)
        steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        evaluated = (run_dir / "eval.jsonl").is_file()
        record.update(status="ok" if evaluated else "failed", run_dir=str(run_dir), steps=len(steps),
                      mask_ratios=sorted({s["mask_ratio"] for s in steps}, reverse=True),
                      switched_at=next((s["step"] for s in steps if s["mask_ratio"] != steps[0]["mask_ratio"]), None),
                      finite=all(s["loss"] == s["loss"] for s in steps), evaluated=evaluated,
                      draw_digests=[s["draw_digest"] for s in steps], draws_match_cpu=draws_match_cpu(cfg, steps))
        if not evaluated:
            record["error"] = "no eval.jsonl: the run did not evaluate"
    except Exception as err:  # a failing arm is a finding; the next arm still runs
        record["error"] = first_error_line(err)
        traceback.print_exc()
    record["seconds"] = round(time.perf_counter() - tick, 1)
    record["peak_memory_gib"] = peak_memory_gib()
    record["dynamo"] = counts.summary()
    print(f"arms_check: {arm} {record['status']} in {record['seconds']}s"
          + (f": {record['error']}" if "error" in record else f", {record['steps']} steps, dynamo {record['dynamo']}"),
          flush=True)
    return record


def run_shard(arms: list[str], work: Path, overrides: list[str], backend: str, deadline: float, out: Path) -> None:
    """The shard's arms one after another, each arm's record appended to `out` as it ends."""
    counts = DynamoCounts()
    use_backend(backend)
    source = None
    for arm in arms:
        if time.time() > deadline:
            append_json_line(out, {"arm": arm, "status": "not reached", "error": "the check's deadline came first"})
            continue
        record = run_arm(arm, work, overrides, counts, source)
        record["backend"] = backend
        if arm == "mask0" and record["status"] == "ok":
            source = Path(record["run_dir"])
        append_json_line(out, record)


def run_shards(arms: list[str], args: argparse.Namespace, overrides: list[str], deadline: float) -> None:
    """Each shard in its own process (the same deadline for all), appending to args.out; an arm whose shard's
    process ended without its record gets one saying so."""
    env = {**os.environ, "ARMS_CHECK_DEADLINE": str(deadline)}
    procs = [subprocess.Popen([sys.executable, __file__, "--work", str(args.work), "--out", str(args.out),
                               "--jobs", str(args.jobs), "--shard", str(i), "--backend", args.backend,
                               "--arms", *arms, "--", *overrides], env=env)
             for i in range(len(shards(arms, args.jobs)))]
    for proc in procs:
        proc.wait()
    done = {json.loads(line)["arm"] for line in args.out.read_text().splitlines()} if args.out.is_file() else set()
    for arm in arms:
        if arm not in done:
            append_json_line(args.out, {"arm": arm, "status": "failed",
                                        "error": "its shard's process ended without a record"})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--arms", nargs="*", help="default: every shipped arm")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--shard", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="inductor", help="the compile backend (Dynamo's counts are the same)")
    parser.add_argument("--deadline-s", type=float, default=float("inf"), help="start no arm after this many seconds")
    parser.add_argument("--rule-arm-only", action="store_true", help="write the every-2-steps rule arm file to "
                                                                        "WORK, print its path and stop")
    parser.add_argument("overrides", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    overrides = args.overrides[1:] if args.overrides[:1] == ["--"] else args.overrides
    if args.rule_arm_only:
        args.work.mkdir(parents=True, exist_ok=True)
        print(rule_arm_file(args.work))
        return 0
    deadline = float(os.environ.get("ARMS_CHECK_DEADLINE", time.time() + args.deadline_s))
    args.work.mkdir(parents=True, exist_ok=True)
    if args.arms:
        arms = args.arms
    else:
        from maskbench.config import known_arms
        arms = known_arms()
    plan = shards(arms, args.jobs)
    if args.shard is not None:  # one shard of the processes below: its records appended to args.out
        run_shard(plan[args.shard], args.work, overrides, args.backend, deadline, args.out)
        return 0
    fresh(args.out)
    announce(len(arms), "arms, each one JSON line as it ends")
    if len(plan) == 1:
        run_shard(plan[0], args.work, overrides, args.backend, deadline, args.out)
    else:
        run_shards(arms, args, overrides, deadline)
    return verdict([json.loads(line) for line in args.out.read_text().splitlines()])


def verdict(records: list[dict]) -> int:
    """Print how many arms passed; 1 when one did not, or a paired arm drew otherwise than mask0."""
    failed = [r["arm"] for r in records if r["status"] != "ok"]
    unpaired = [arm for arm, same in draws_match_mask0(records).items() if arm in PAIRED and not same]
    ok = len(records) - len(failed)
    print(f"arms_check: {ok} of {len(records)} arms ok" + (f"; not ok: {', '.join(failed)}" if failed else "")
          + (f"; draws differ from mask0's: {', '.join(unpaired)}" if unpaired else ""))
    return 1 if failed or unpaired or not records else 0


if __name__ == "__main__":
    sys.exit(main())
