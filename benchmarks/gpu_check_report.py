"""Collect what `benchmarks/gpu_check.sh` measured into one JSON (and, with --pack, one tar of logs and grids).

    python benchmarks/gpu_check_report.py WORK [--mode gpu|cpu] [--out results/gpu_check.json] [--pack TAR]
    python benchmarks/gpu_check_report.py WORK --check-switches RUNS   # exit 1 unless each run crossed its switch

WORK is the check's working folder (GPU_CHECK_DIR): logs/steps.tsv (one line per step: name, exit status,
seconds, limit), logs/NAME.log, env.jsonl, kernels.csv, the train run, arms.jsonl, step_time.csv and the ddp runs.
Every part is optional: the report is written after each step, from whatever exists by then. The steps that
measure several items write each the moment it exists (benchmarks/stream.py) and print how many they plan first,
so a step cut by its time limit is reported as "timed out after N of M items", its N items in the report.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
import tarfile
import time
from pathlib import Path

STEPS = ("env", "kernels", "standins", "synth", "encode", "reference", "train", "arms", "ddp")
ROW_FIELDS = ("point", "step", "train_flops", "gpu_hours", "device", "precision", "mfu", "val_loss", "fid",
              "fid_features", "fid_ref", "clip_score", "clip_model", "grid")
KERNEL_FIELDS = ("op", "pass", "impl", "seq_len", "mask_ratio", "dtype", "ms", "gb_per_s", "pct_peak", "peak_gb_per_s",
                 "pct_copy", "copy_gb_per_s")
TIMED_OUT = (124, 137)  # timeout's status after TERM, and after the KILL that follows -k
ITEMS = {"env": "env.jsonl", "kernels": "kernels.csv", "arms": "arms.jsonl", "step_time": "step_time.csv"}
PLANNED = re.compile(r"^items planned: (\d+)", re.MULTILINE)  # stream.announce's line
EXCEPTION = re.compile(r"^\s*(\[rank\d+\]:\s*)?[\w.]*(Error|Exception|Interrupt|Exit)\b:?")
ERROR = re.compile(r"(error:|Error:|FAILED|FAIL:|Killed|Segmentation fault)")


def first_error_line(log: Path) -> str | None:
    """The first line of a log that names an error: an exception's line, else an `error:`/FAIL line, else its
    last line."""
    if not log.is_file():
        return None
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    for pattern in (EXCEPTION, ERROR):
        hit = next((line for line in lines if pattern.search(line) and not line.startswith("Traceback")), None)
        if hit:
            return hit[:400]
    return lines[-1][:400] if lines else None


def items(work: Path, name: str) -> dict:
    """A streaming step's items: how many it wrote and how many it planned (None: it was cut before it said)."""
    path, log = work / ITEMS[name], work / "logs" / f"{name}.log"
    planned = PLANNED.search(log.read_text(errors="replace")) if log.is_file() else None
    done = len(read_jsonl(path) if path.suffix == ".jsonl" else read_csv(path))
    return {"items_done": done, "items_planned": int(planned.group(1)) if planned else None}


def timed_out(step: dict, error: str | None) -> str:
    """'timed out after N of M items in Ls' for a step that streams its items, else 'timed out after Ls'; then the
    log's last (or first error) line."""
    last = f"; last: {error}" if error else "; no output"
    if "items_done" not in step:
        return f"timed out after {step['limit_s']}s{last}"
    of = f" of {step['items_planned']}" if step["items_planned"] is not None else ""
    return f"timed out after {step['items_done']}{of} items in {step['limit_s']}s{last}"


def read_steps(work: Path) -> list[dict]:
    path = work / "logs" / "steps.tsv"
    rows = [line.split("\t") for line in path.read_text().splitlines()] if path.is_file() else []
    steps = []
    for name, rc, seconds, limit in rows:
        rc = int(rc)
        status = "ok" if rc == 0 else "timed out" if rc in TIMED_OUT else "failed"
        step = {"name": name, "status": status, "rc": rc, "seconds": int(seconds), "limit_s": int(limit),
                **(items(work, name) if name in ITEMS else {})}
        if rc:
            error = first_error_line(work / "logs" / f"{name}.log")
            step["first_error"] = timed_out(step, error) if status == "timed out" else error
        steps.append(step)
    return steps


def read_json(path: Path) -> dict | list | None:
    return json.loads(path.read_text()) if path.is_file() else None


def read_jsonl(path: Path) -> list[dict]:
    """The file's records; a line that does not parse (cut by a kill as it was written) is left out."""
    records = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def read_env(path: Path) -> dict | None:
    """env_check.py's lines as one record: Python, `import_seconds` of each module the later steps use, `packages`
    (each third-party package's version, folder and `via`, the import that loaded it; "not installed" for one an
    import loads only when present), `cuda_available`, `gpu` (the device and each GPU measurement) and
    `problems`."""
    lines = read_jsonl(path)
    if not lines:
        return None
    env: dict = {"import_seconds": {}, "packages": {}, "problems": []}
    for line in lines:
        part = line.pop("part")
        if problem := line.pop("problem", None):
            env["problems"].append(problem)
        if part == "import":
            env["import_seconds"][line["module"]] = line["seconds"]
            env["packages"].update({name: {**found, "via": line["module"]} for name, found in line["packages"].items()})
        elif part in ("python", "cuda"):
            env.update(line)
        else:
            env.setdefault("gpu", {}).update(line)
    return env


def draws_match_mask0(arms: list[dict]) -> dict[str, bool]:
    """Per arm but mask0: whether its draw digests equal mask0's at every step both took (an arm with no step, or no
    mask0 to compare with, is left out)."""
    base = next((r.get("draw_digests") for r in arms if r["arm"] == "mask0"), None)
    matched = {}
    for record in arms:
        digests = record.get("draw_digests")
        shared = min(len(base), len(digests)) if base and digests else 0
        if shared and record["arm"] != "mask0":
            matched[record["arm"]] = digests[:shared] == base[:shared]
    return matched


def run_summary(run: Path) -> dict:
    """One run directory: steps, mask ratios, where it switched, devices, whether it finished, its eval points."""
    steps = read_jsonl(run / "metrics.jsonl")
    env = read_json(run / "env.json") or {}
    ratios = [s["mask_ratio"] for s in steps]
    return {"run_id": run.name, "steps": len(steps), "mask_ratios": sorted(set(ratios), reverse=True),
            "switched_at": next((s["step"] for s in steps if s["mask_ratio"] != ratios[0]), None),
            "finite": all(s["loss"] == s["loss"] for s in steps), "n_devices": env.get("n_devices"),
            "device": env.get("device"), "done": (run / "done.json").is_file(),
            "eval_points": [{key: record.get(key) for key in ROW_FIELDS} for record in read_jsonl(run / "eval.jsonl")]}


def runs_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []


def measured_mfu(rows: list[dict], env: dict | None) -> None:
    """Each step-time row's MFU against the bf16 matrix product the env step timed (an H200: ~790 TFLOP/s
    measured, 989 on its spec sheet, which `mfu` divides by)."""
    tflops = ((env or {}).get("gpu") or {}).get("bf16_matmul_tflops")
    for row in rows:
        if tflops and row.get("gflop_per_s"):
            row["mfu_vs_measured_bf16"] = round(float(row["gflop_per_s"]) / (tflops * 1e3), 4)


def report(work: Path, mode: str, planned: tuple[str, ...] = STEPS) -> dict:
    steps = read_steps(work)
    ran = {s["name"] for s in steps}
    env = read_env(work / "env.jsonl")
    tables = {path.stem: read_csv(path) for path in sorted(work.glob("*.csv")) if path.stem != "kernels"}
    measured_mfu(tables.get("step_time", []), env)
    repro_log = work / "logs" / "repro.log"
    repro = [line for line in repro_log.read_text().splitlines() if "PASS" in line or "FAIL" in line] \
        if repro_log.is_file() else []
    arms = read_jsonl(work / "arms.jsonl")
    kernels = [{k: row.get(k) for k in KERNEL_FIELDS} for row in read_csv(work / "kernels.csv")]
    train = [{**run_summary(run), "dynamo": read_json(work / "train_dynamo.json")}
             for run in runs_in(work / "train" / "runs")]
    ddp = [run_summary(run) for run in runs_in(work / "ddp" / "runs")]
    paired = draws_match_mask0(arms)
    return {
        "mode": mode,
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "all_passed": bool(steps) and all(s["status"] == "ok" for s in steps) and ran >= set(planned),
        "steps": steps + [{"name": name, "status": "not run"} for name in planned if name not in ran],
        "seconds": sum(s["seconds"] for s in steps),
        "env": env,
        "kernels": kernels,
        "train": train,
        "arms": [{**{k: v for k, v in r.items() if k not in ("run_dir", "draw_digests")},
                  "draws_match_mask0": paired.get(r["arm"])} for r in arms],
        "arms_ok": f"{sum(r['status'] == 'ok' for r in arms)} of {len(arms)}" if arms else None,
        "draws_match_mask0": paired,
        # each arm's logged draws against the CPU's recomputation: common random numbers across devices
        "draws_match_cpu": {r["arm"]: r.get("draws_match_cpu") for r in arms if r.get("draws_match_cpu") is not None},
        "ddp": ddp,
        "ddp_dynamo": [read_json(p) for p in sorted(work.glob("ddp_dynamo.rank*.json"))],
        **({"tables": tables} if tables else {}),
        **({"repro": repro} if repro else {}),
    }


def read_csv(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def pack(work: Path, tar_path: Path) -> int:
    """logs/, the sample grids, the runs' metrics and eval records and the check's own files, in one tar.gz."""
    names = 0
    with tarfile.open(tar_path, "w:gz") as tar:
        def add(path: Path, arcname: str) -> None:
            nonlocal names
            if path.exists():
                tar.add(path, arcname=f"gpu_check/{arcname}")
                names += 1
        add(work / "logs", "logs")
        for path in sorted([*work.glob("*.csv"), *work.glob("*.json"), *work.glob("*.jsonl")]):
            add(path, path.name)
        for group in ("train", "ddp", "bench"):
            for run in runs_in(work / group / "runs"):
                for name in ("metrics.jsonl", "eval.jsonl", "env.json", "config.yaml"):
                    add(run / name, f"{group}/{run.name}/{name}")
                for grid in sorted((run / "samples").glob("*/grid*.png")):
                    add(grid, f"grids/{group}-{run.name}-{grid.parent.name}.png")
        for grid in sorted((work / "arms").glob("*/runs/*/samples/*/grid*.png")):
            add(grid, f"grids/arms-{grid.parents[4].name}-{grid.parent.name}.png")
    return names


def check_switches(runs: Path) -> int:
    """Each run under RUNS finished, on 2 processes, through more than one mask ratio."""
    found = [run_summary(run) for run in runs_in(runs)]
    bad = [r for r in found if not (r["done"] and r["switched_at"] is not None and r["n_devices"] == 2 and r["finite"])]
    for r in found:
        print(f"{r['run_id']}: {r['steps']} steps, mask {r['mask_ratios']}, switched at {r['switched_at']}, "
              f"{r['n_devices']} processes, {'done' if r['done'] else 'NOT done'}")
    if bad or len(found) < 2:
        print(f"FAILED: {', '.join(r['run_id'] for r in bad) or 'fewer than 2 runs'} did not cross a switch on 2 "
              "processes to the end")
        return 1
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--mode", default="gpu", choices=("gpu", "cpu"))
    parser.add_argument("--out", type=Path, default=Path("results/gpu_check.json"))
    parser.add_argument("--pack", type=Path, metavar="TAR", help="also write the tar.gz of logs and grids here")
    parser.add_argument("--check-switches", type=Path, metavar="RUNS")
    parser.add_argument("--steps", help="the planned steps, comma-separated (default: gpu_check.sh's)")
    args = parser.parse_args()
    if args.check_switches:
        return check_switches(args.check_switches)
    found = report(args.work, args.mode, tuple(args.steps.split(",")) if args.steps else STEPS)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(found, indent=2) + "\n")
    tmp.replace(args.out)  # a reader never sees half a report
    print(f"wrote {args.out}: " + ", ".join(f"{s['name']} {s['status']}" for s in found["steps"]))
    if args.pack:
        print(f"wrote {args.pack}: {pack(args.work, args.pack)} entries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
