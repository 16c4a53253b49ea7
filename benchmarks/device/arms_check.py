"""Every shipped arm for a few steps, in one process per shard, with Dynamo's counts per arm and the draws compared.

    python benchmarks/device/arms_check.py --work DIR --out arms.jsonl [--arms A B ...] [--jobs N]
        [--backend aot_eager] [--deadline-s S] -- KEY=VALUE...

Each arm trains through every phase on the overrides after `--` (data, model, kernels, compile, budget: the
caller sizes them), then evaluates once. Per arm, one JSON line: status, seconds, the first error line, steps
and mask ratios seen, Dynamo's frames, graphs, graph breaks and recompiles (with their first reasons and any hit
of the recompile limit, after which a frame runs eagerly), and whether its draws (t, caption dropout, noise:
`draw_digest`) equal mask0's at every step both took. Two arms of one seed must draw the same: mask75 and
mask75_then0 against mask0 decide this script's exit status, with every arm's own.

Shipped arms that need more than a name: lsc_convert starts from this check's mask0 run (init_from, so both go to
one shard, mask0 first); mask75_until_cosine checks its rule every 2 steps instead of 100 (a copy of the arm file
with `every: 2`), so the probe and the switch it decides run within a few steps; an arm whose shortest phase would
buy no whole step gets the budget doubled until it does (`fitting_budget`). A phase switch is one recompile (a graph per phase, as designed):
the counts show any beyond that.

--jobs N runs N shards as N processes (compilation is CPU-bound; the arms of a shard share one process), each
given the same deadline: an arm not started by then is reported as not reached, and the shard ends cleanly.
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
from instruments import DynamoCounts, use_backend  # this script's folder is on sys.path

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
    from maskbench.errors import ConfigError
    from maskbench.train.loop import plan_run

    budget = next((o for o in reversed(arm_overrides) if o.startswith("budget.flops=")), None)
    if budget is None:
        return []
    flops = float(budget.partition("=")[2])
    for _ in range(MAX_DOUBLINGS):
        try:
            plan_run(load_config([*arm_overrides, f"budget.flops={flops:g}"]), 1)
            break
        except ConfigError as err:
            if "too small for one step" not in str(err):
                break  # the run itself will say what is wrong
            flops *= 2
    return [f"budget.flops={flops:g}"]


def first_error_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"[:300]


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
    tick = time.perf_counter()
    try:
        run_dir = train(load_config([f"arm={spec}", *overrides, *extra, f"paths.runs={root / 'runs'}",
                                     f"paths.leaderboard={root / 'leaderboard.csv'}"]))
        steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        evaluated = (run_dir / "eval.jsonl").is_file()
        record.update(status="ok" if evaluated else "failed", run_dir=str(run_dir), steps=len(steps),
                      mask_ratios=sorted({s["mask_ratio"] for s in steps}, reverse=True),
                      switched_at=next((s["step"] for s in steps if s["mask_ratio"] != steps[0]["mask_ratio"]), None),
                      finite=all(s["loss"] == s["loss"] for s in steps), evaluated=evaluated,
                      draw_digests=[s["draw_digest"] for s in steps])
        if not evaluated:
            record["error"] = "no eval.jsonl: the run did not evaluate"
    except Exception as err:  # a failing arm is a finding; the next arm still runs
        record["error"] = first_error_line(err)
        traceback.print_exc()
    record["seconds"] = round(time.perf_counter() - tick, 1)
    record["dynamo"] = counts.summary()
    print(f"arms_check: {arm} {record['status']} in {record['seconds']}s"
          + (f": {record['error']}" if "error" in record else f", {record['steps']} steps, dynamo {record['dynamo']}"),
          flush=True)
    return record


def run_shard(arms: list[str], work: Path, overrides: list[str], backend: str, deadline: float) -> list[dict]:
    counts = DynamoCounts()
    use_backend(backend)
    records, source = [], None
    for arm in arms:
        if time.time() > deadline:
            records.append({"arm": arm, "status": "not reached", "error": "the check's deadline came first"})
            continue
        record = run_arm(arm, work, overrides, counts, source)
        record["backend"] = backend
        if arm == "mask0" and record["status"] == "ok":
            source = Path(record["run_dir"])
        records.append(record)
    return records


def compare_draws(records: list[dict]) -> None:
    """Each arm's `draws_match_mask0`: its draw digests equal mask0's at every step both took (None: not compared)."""
    base = next((r.get("draw_digests") for r in records if r["arm"] == "mask0"), None)
    for record in records:
        digests = record.pop("draw_digests", None)
        shared = min(len(base), len(digests)) if base and digests else 0
        record["draws_match_mask0"] = (digests[:shared] == base[:shared]) if shared and record["arm"] != "mask0" \
            else None


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
    if args.shard is not None:  # one shard: its records as JSON lines
        records = run_shard(plan[args.shard], args.work, overrides, args.backend, deadline)
        args.out.write_text("".join(json.dumps(r) + "\n" for r in records))
        return 0
    if len(plan) == 1:
        records = run_shard(plan[0], args.work, overrides, args.backend, deadline)
    else:
        env = {**os.environ, "ARMS_CHECK_DEADLINE": str(deadline)}
        outs = [args.out.with_name(f"{args.out.stem}.shard{i}.jsonl") for i in range(len(plan))]
        procs = [subprocess.Popen([sys.executable, __file__, "--work", str(args.work), "--out", str(out),
                                   "--jobs", str(args.jobs), "--shard", str(i), "--backend", args.backend,
                                   *(["--arms", *arms]), "--", *overrides], env=env)
                 for i, out in enumerate(outs)]
        for proc in procs:
            proc.wait()
        records = [json.loads(line) for out in outs if out.is_file() for line in out.read_text().splitlines()]
        done = {r["arm"] for r in records}
        records += [{"arm": a, "status": "failed", "error": "its shard's process ended without a record"}
                    for a in arms if a not in done]
    records.sort(key=lambda r: ordered(arms).index(r["arm"]))
    compare_draws(records)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in records))
    failed = [r["arm"] for r in records if r["status"] != "ok"]
    unpaired = [r["arm"] for r in records if r["arm"] in PAIRED and r["draws_match_mask0"] is False]
    ok = sum(r["status"] == "ok" for r in records)
    print(f"arms_check: {ok} of {len(records)} arms ok" + (f"; not ok: {', '.join(failed)}" if failed else "")
          + (f"; draws differ from mask0's: {', '.join(unpaired)}" if unpaired else ""))
    return 1 if failed or unpaired or not records else 0


if __name__ == "__main__":
    sys.exit(main())
