"""Collect what `benchmarks/gpu_check.sh` measured into one JSON: steps, run rows, repro, benchmarks.

    python benchmarks/gpu_check_report.py RUN_DIR LOG_DIR [--out results/gpu_check.json]
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

ROW_FIELDS = ("point", "step", "train_flops", "gpu_hours", "device", "mfu", "val_loss", "fid", "fid_features",
              "fid_ref", "clip_score", "clip_model")


def read_csv(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def report(run_dir: Path, logs: Path) -> dict:
    steps = [dict(zip(("name", "rc", "seconds"), line.split("\t"))) for line in
             (logs / "steps.tsv").read_text().splitlines()]
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()] \
        if (run_dir / "eval.jsonl").is_file() else []
    repro_log = logs / "repro.log"
    return {
        "run_id": run_dir.name,
        "steps": [{**s, "rc": int(s["rc"]), "seconds": int(s["seconds"])} for s in steps],
        "all_passed": all(s["rc"] == "0" for s in steps),
        "eval_points": [{key: record.get(key) for key in ROW_FIELDS} for record in evals],
        "grids": [record.get("grid") for record in evals],
        "repro": [line for line in repro_log.read_text().splitlines() if "PASS" in line or "FAIL" in line]
        if repro_log.is_file() else [],
        "kernels": read_csv(logs / "kernels.csv"),
        "step_time": read_csv(logs / "step_time.csv"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("logs", type=Path)
    parser.add_argument("--out", type=Path, default=Path("results/gpu_check.json"))
    args = parser.parse_args()
    found = report(args.run_dir, args.logs)
    args.out.write_text(json.dumps(found, indent=2) + "\n")
    print(f"wrote {args.out}: {len(found['eval_points'])} eval points, steps "
          + ", ".join(f"{s['name']} {'ok' if s['rc'] == 0 else 'FAILED'}" for s in found["steps"]))
    if not found["all_passed"] or not found["eval_points"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
