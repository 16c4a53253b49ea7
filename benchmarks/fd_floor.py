"""The real-vs-real floor of oracle FD on a synth dataset: held-out scenes against fresh scenes of the same renderer.

A model's FD is read against this floor at the same sample count (FD's bias depends on it): it is what fresh
real scenes score. The fresh scenes are the held-out split of a second synth dataset drawn with another
generation seed, so they share no scene, and no caption, with the reference; a model prompted with the
held-out captions themselves can score below it. Each run writes one row per (dataset, count) into
results/fd_floor.csv (--out), replacing that row and keeping the others: docs/studies.md quotes the floor from
this file (`python -m tools.doctables`), with its sample count.

    python benchmarks/fd_floor.py data.max_objects=1 --n 2048     # one-object scenes (the plateau study's stage 1c)
    python benchmarks/fd_floor.py --n 256 --n 2048                # the default 1-3 object scenes
    python benchmarks/fd_floor.py --smoke                         # 32 scenes of a toy dataset: the script runs
"""

from __future__ import annotations

import argparse
import csv
import tempfile
from pathlib import Path

from results_csv import write_rows  # benchmarks/ is on sys.path when a script runs

from maskbench.config import load_config
from maskbench.data.dataset import resolve_dataset
from maskbench.eval.evaluate import load_eval_set, synth_reference_stats
from maskbench.eval.fid import reference_stats
from maskbench.eval.oracle import load_oracle
from maskbench.eval.sample import to_uint8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="data.* overrides of the dataset the reference is built from")
    parser.add_argument("--n", type=int, action="append", help="fresh scenes per FD (repeatable; default 2048)")
    parser.add_argument("--out", default="results/fd_floor.csv")
    parser.add_argument("--smoke", action="store_true", help="a toy dataset in a temporary folder, 32 scenes")
    args = parser.parse_args()
    if args.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            floor([f"paths.data={tmp}", "data.n_train=64"], [32], Path(args.out))
    else:
        floor(args.overrides, args.n or [2048], Path(args.out))


def floor(overrides: list[str], counts: list[int], out: Path) -> None:
    """Write one row per count: the oracle FD of that many fresh scenes to the held-out split's statistics."""
    cfg = load_config([*overrides, f"data.n_val={max(counts)}"])
    reference_data = resolve_dataset(cfg.data, cfg.paths.data)
    kept = [o for o in overrides if not o.startswith(("data.n_train=", "data.seed="))]
    fresh_cfg = load_config([*kept, f"data.n_val={max(counts)}", "data.n_train=1", f"data.seed={cfg.data.seed + 1}"])
    fresh_data = resolve_dataset(fresh_cfg.data, fresh_cfg.paths.data)
    oracle = load_oracle()
    reference = synth_reference_stats(reference_data, oracle)
    images = to_uint8(load_eval_set(fresh_data, max(counts)).images)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in counts:
            fresh = reference_stats([images[:n]], oracle, Path(tmp) / f"fresh_{n}.npz")
            distance = fresh.frechet_distance(reference)
            name = reference_data.val_dir.parent.name
            rows.append({"dataset": name, "reference_n": reference.n, "fresh": fresh_data.val_dir.parent.name,
                         "fresh_n": n, "fd_floor": round(distance, 2)})
            print(f"{name}: oracle FD of {n} fresh scenes to the {reference.n} held-out ones = {distance:.1f}")
    write_rows(out, merged(out, rows))


def merged(out: Path, rows: list[dict]) -> list[dict]:
    """The rows already in `out` less those these replace (same dataset and count), then these."""
    if not out.is_file():
        return rows
    with out.open(newline="") as f:
        kept = [row for row in csv.DictReader(f)
                if (row.get("dataset"), str(row.get("fresh_n"))) not in {(r["dataset"], str(r["fresh_n"])) for r in rows}]
    return [{key: row.get(key, "") for key in rows[0]} for row in kept] + rows


if __name__ == "__main__":
    main()
