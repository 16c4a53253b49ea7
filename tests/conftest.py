"""Shared fixtures: a small synth dataset and the overrides that make a run take seconds."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import torch._dynamo
from omegaconf import OmegaConf

from maskbench.config import known_arms
from maskbench.config.compose import arm_settings, shipped_arm
from maskbench.config.schema import CONF_DIR
from maskbench.data.encode import EncodeOptions
from maskbench.data.pack import PackOptions, pack
from maskbench.data.sources.brushdata import plan_brushdata
from maskbench.data.synth import write_synth
from maskbench.eval import standins
from tests import suite_costs
from tests.fixtures_real import make_brushdata
from tests.suite_costs import fixture_key, is_slow, recorded_costs

torch.set_num_threads(1)
# One BLAS and OpenMP thread in every process the tests start: xdist's workers (`-n auto`, one per core) and the
# processes tests launch inherit it. With numpy's and scipy's OpenBLAS at a thread per core in each of two workers,
# a 2048-d eigendecomposition took 21 s instead of 1.5 s, and tests/test_latent_run.py 98 s instead of 34 s.
for _threads in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_threads, "1")
# Measured GEMM peaks are cached per machine; the tests (and the processes they start) share one fresh cache.
os.environ.setdefault("MASKBENCH_CACHE", tempfile.mkdtemp(prefix="maskbench-cache-"))


def pytest_configure(config: pytest.Config) -> None:
    """What each shared fixture costs, recorded by tests/suite_costs.py's hooks, for the session's fixtures too."""
    config.pluginmanager.register(suite_costs, "suite_costs")


def shared_fixtures(item: pytest.Item) -> list[str]:
    """The keys (tests.suite_costs.fixture_key) of the fixtures wider than one test that `item` needs, directly or
    through other fixtures. (`_fixtureinfo` is pytest's record of them; no public attribute names their scope.)"""
    return [fixture_key(defs[-1].baseid, name) for name, defs in item._fixtureinfo.name2fixturedefs.items()
            if defs and defs[-1].scope != "function"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test is `slow` (not in the quick subset) when it took over QUICK_S seconds, or a shared fixture it needs
    over QUICK_FIXTURE_S, when the suite was last measured (tests/suite_costs.py). The test files run longest
    first (their tests in their own order, so a module's fixtures are made once per process): under `-n auto` the
    longest files start at once instead of last, and no core idles at the end."""
    tests, fixtures = recorded_costs()
    for item in items:
        if is_slow(item.nodeid, shared_fixtures(item), tests, fixtures):
            item.add_marker(pytest.mark.slow)
    per_file: dict[str, float] = defaultdict(float)
    for nodeid, spent in tests.items():
        per_file[nodeid.split("::")[0]] += spent
    items.sort(key=lambda item: -per_file[item.nodeid.split("::")[0]])  # stable: each file's own order kept


@pytest.fixture(scope="session")
def synth_root(tmp_path_factory) -> Path:
    """512 training and 64 held-out scenes, shared by every test that trains."""
    return write_synth(tmp_path_factory.mktemp("data") / "synth", n_train=512, n_val=64, seed=0, shard_size=128)


# Any preset at toy size: a very small DiT of its layout (2 blocks of width 32, a 1-block text tower) ...
TINY_MODEL = ("model.width=32", "model.depth=2", "model.heads=2", "model.text_width=32", "model.text_depth=1",
              "model.text_len=24")
# ... trained in batches of 8 for ~8 unmasked steps.
TINY_TRAIN = ("train.batch_size=8", "train.warmup_steps=2", "budget.flops=2.5e9")


def tiny_overrides(tmp_path: Path, synth_root: Path, *extra: str) -> list[str]:
    """A run of a few seconds: a very small early-drop DiT (tiny's layout, no mixer), batch 8, ~8 unmasked
    steps, 2 eval points."""
    return [
        "model=tiny", f"paths.runs={tmp_path / 'runs'}", f"paths.data={tmp_path / 'data'}",
        f"paths.leaderboard={tmp_path / 'leaderboard.csv'}", f"data.path={synth_root}", *TINY_MODEL, *TINY_TRAIN,
        "eval.points=[0.5,1.0]", "eval.n_samples=8", "eval.val_samples=16", "eval.sampler_steps=2",
        "eval.batch_size=16", "eval.grid_size=4", "data.shuffle_buffer=64", *extra,
    ]


# Evaluation at its smallest: 2 generated samples (a Fréchet distance needs two), 4 held-out samples for the
# validation loss, no bootstrap, a 1-image grid. For runs whose tests read no eval metric's value.
SMALL_EVAL = ("eval.n_samples=2", "eval.val_samples=4", "eval.bootstrap_resamples=0", "eval.grid_size=1")
# ... and the data loaded in the training process: no loader worker to start (~0.7 CPU-s of a ~2 s run). The data
# order never depends on the worker count; the tests of the loader's workers, their signals, seeks and bad-sample
# counts, and the runs that others compare with, keep the default.
FAST = (*SMALL_EVAL, "data.num_workers=0")


def new_trainer(cfg, accelerator=None):
    """A run's loop with what it trains built, without the evaluation `maskbench run` adds: checkpoints only."""
    from maskbench.data.dataset import resolve_dataset
    from maskbench.train.loop import trainer_for

    return trainer_for(cfg, resolve_dataset(cfg.data, cfg.paths.data, create=False), accelerator)


def arm_overrides(tmp_path: Path, synth_root: Path, arm: str, *extra: str) -> list[str]:
    """`tiny_overrides` for a shipped arm: 3 backbone blocks for an arm that re-splits the baseline's (SPRINT's
    mixer and decoder come out of them, and 2 would leave no backbone block). Whether it re-splits is read from the
    arm's YAML, not from a second composed config (composing one costs most of a parametrized case; an arm that
    re-splits some other way fails loudly here: "no backbone block")."""
    overrides = tiny_overrides(tmp_path, synth_root, f"arm={arm}", *extra)
    if OmegaConf.load(CONF_DIR / "arm" / f"{arm}.yaml").get("model", {}).get("resplit", False):
        overrides = [o.replace("model.depth=2", "model.depth=3") for o in overrides]
    return overrides


def distinct_arms() -> list[str]:
    """The shipped arms (but lsc_convert, whose skips-only phase needs an init_from source run) less each one that
    another arm covers: the same model and training options (`arm_settings`) and a strict subset of its phases,
    compared on every field but the fraction (mask0 and mask75 are two of mask75_then0's phases, on the same
    model). A parametrized check of each phase's step runs the same code for it."""
    def phases(arm: str) -> frozenset[str]:
        return frozenset(json.dumps({k: v for k, v in dataclasses.asdict(p).items() if k != "fraction"}, sort_keys=True,
                                    default=str) for p in shipped_arm(arm).phases)

    arms = [arm for arm in known_arms() if arm != "lsc_convert"]
    keys = {arm: (sorted(arm_settings(arm)), phases(arm)) for arm in arms}
    return [arm for arm in arms
            if not any(keys[other][0] == keys[arm][0] and keys[arm][1] < keys[other][1] for other in arms)]


@contextlib.contextmanager
def fresh_dynamo():
    """Nothing compiled before is reused inside, nor kept after: a graph another test in the same worker
    compiled would otherwise be a cache hit, and a test that counts graphs or compile time would see none."""
    torch._dynamo.reset()
    try:
        yield
    finally:
        torch._dynamo.reset()


def randomized(model: torch.nn.Module, std: float) -> torch.nn.Module:
    """Every parameter redrawn from a fixed seed. A fresh DiT is adaLN-Zero: it predicts 0 for every token and
    its blocks are the identity, so a loss reading the wrong tokens, or skips paired wrongly, would go unseen."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(std=std, generator=gen)
    return model


@pytest.fixture
def opts(tmp_path: Path) -> EncodeOptions:
    """A random 2-level VAE (2× downsampling) and a random tiny open_clip text tower (`local-dir:` folder)."""
    torch.manual_seed(0)
    vae = standins.write_vae(tmp_path / "vae")
    clip = standins.write_clip(tmp_path / "standin-clip")
    return EncodeOptions(vae=str(vae), text_model=clip, resolution=32, batch_size=2)


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    make_brushdata(tmp_path / "raw", shards=2, per_shard=3)
    pack(tmp_path / "canon", "brushdata", plan_brushdata([tmp_path / "raw"]), PackOptions(), progress=False)
    return tmp_path / "canon"


@pytest.fixture(scope="session")
def paired_runs(tmp_path_factory, synth_root):
    """tests.paired_runs.PairedRuns: each mission arm's `paired_overrides` run, trained at its first use in this
    process. Read only. (Imported here: that module builds on `tiny_overrides`.)"""
    from tests.paired_runs import PairedRuns

    return PairedRuns(tmp_path_factory.mktemp("paired"), synth_root)
