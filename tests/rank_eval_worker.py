"""One rank of a 2-process evaluation, started (twice) by tests/test_rank_eval.py.

usage: rank_eval_worker.py OUT_DIR [--fail] -- OVERRIDES...
Writes OUT_DIR/rank-R.json: the result (rank 0), the eval set's held-out indices and how many images the
oracle scored here. With --fail, rank 1's oracle raises while scoring its share.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from accelerate import Accelerator

from maskbench.config import load_config
from maskbench.data.dataset import resolve_dataset
from maskbench.eval.evaluate import Evaluator
from maskbench.models.build import build_model
from tests.conftest import randomized


def main(out: Path, fail: bool, overrides: list[str]) -> None:
    acc = Accelerator(cpu=True)
    rank = acc.process_index
    cfg = load_config(overrides)
    data = resolve_dataset(cfg.data, cfg.paths.data)
    with acc.main_process_first():
        evaluator = Evaluator(data, cfg.eval, acc.device, rank=rank, world=acc.num_processes)
    model = randomized(build_model(cfg.model, data), 0.05)
    (alignment,) = [scorer for scorer in evaluator.scorers if scorer.metric == "align_acc"]
    scored, matches = [], alignment.oracle.matches

    def counted_matches(images, scenes):
        if fail and rank == 1:
            raise ValueError("injected on rank 1")
        scored.append(len(images))
        return matches(images, scenes)

    alignment.oracle.matches = counted_matches
    result = None
    try:
        result = evaluator.evaluate(model, out / "samples", acc)
    finally:  # what this rank held and scored, whether or not the evaluation failed
        record = {"result": result, "held": evaluator.evalset.indices, "scored": scored}
        (out / f"rank-{rank}.json").write_text(json.dumps(record))
    acc.end_training()  # destroy the process group, so no rank exits mid-collective


if __name__ == "__main__":
    split = sys.argv.index("--")
    main(Path(sys.argv[1]), "--fail" in sys.argv[2:split], sys.argv[split + 1:])
