"""Data-parallel training: 2 CPU processes (torchrun, gloo) against 1 process, at one config.

A step's data and randomness are a function of its data stream, so a run whose global batch is split into 2
streams (train.data_streams=2) trains on the same samples with the same t, dropout, noise and mask on 2 processes
(one stream each) as on 1 (both streams as micro-batches); the only difference left is where the two halves of the
gradient are summed (a gloo all-reduce or autograd accumulation), so their loss traces must agree to float rounding
(LOSS_RTOL). Without data_streams the streams are processes × train.grad_accum: the conversion below pairs 2
processes with 1 process at grad_accum 2.

The 2-process runs share one torchrun launch (tests/launch_commands.py runs several `maskbench` commands in one,
each starting its own process group): a launch costs seconds of imports per process before any work. `maskbench
sweep` and `maskbench repro` run in it too: a sweep trains its cells one after another in one launch, so the
process group must outlive each cell (destroyed after the first, the second cell stopped at "Default process
group has not been initialized"); repro retrains a run in a temporary folder that every process must share (a
folder per process left rank 1 looking for the run files only rank 0 writes: FileNotFoundError).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from maskbench.cli import main
from maskbench.config import demote_routes, load_config, run_id
from maskbench.data.dataset import resolve_dataset
from maskbench.data.loader import make_loader
from maskbench.eval.evaluate import load_samples
from maskbench.models.build import build_model
from maskbench.models.dit import idle_parameters
from maskbench.models.inputs import Demotion, StepInputs
from maskbench.models.masking import random_keep_idx
from maskbench.models.objective import windowed_flow_loss
from maskbench.results.rows import read_rows
from maskbench.runs.launch import train
from maskbench.train.build import make_accelerator
from maskbench.train.steplog import batch_digest
from tests.conftest import arm_overrides, distinct_arms, new_trainer, tiny_overrides

LAUNCH = Path(__file__).with_name("launch_commands.py")

LOSS_RTOL = 1e-5   # float32 summation order; observed bit-identical on CPU
# two data streams whatever the process count: 1 process runs both as micro-batches, 2 processes one each
ARM = ("arm=mask75_then0", "budget.flops=1.4e9", "data.shuffle_buffer=32", "train.data_streams=2")

CONVERT = """arm:
  name: convert
  phases:
    - {mask_ratio: 0.0, fraction: 0.5, trainable: skips}
    - {mask_ratio: 0.0, fraction: 0.5}
model:
  long_skip: concat_ln
"""


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _launch(tmp: Path, *commands: dict) -> subprocess.CompletedProcess:
    """The `maskbench` commands, one after another, in both processes of one torchrun launch (2 CPU processes,
    gloo): a launch costs seconds of imports per process, so the 2-process checks share them."""
    plan = tmp / f"plan-{len(list(tmp.glob('plan-*.json')))}.json"
    plan.write_text(json.dumps(list(commands)))
    for out in {command["out"] for command in commands}:  # what an earlier launch in the same folder left
        for rank in (0, 1):
            (Path(out) / f"rank-{rank}.rc").unlink(missing_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(LAUNCH), str(plan)]
    scratch = tmp / "tmpdir"  # the launch's temporary folders (repro's shared one is made here)
    scratch.mkdir(exist_ok=True)
    return subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(scratch)})


def _run(out: Path, synth_root: Path, *extra: str, base: tuple[str, ...] = ARM, skewed_clock: bool = False) -> dict:
    """One `maskbench run` of a launch, in folder `out` (its runs/ and leaderboard.csv)."""
    return {"argv": ["run", *tiny_overrides(out, synth_root, *base, *extra)], "out": str(out),
            "skewed_clock": skewed_clock}


def _finished(out: Path, done: subprocess.CompletedProcess) -> None:
    """Both processes ran the command in `out` to exit code 0."""
    codes = [(out / f"rank-{rank}.rc").read_text() if (out / f"rank-{rank}.rc").exists() else None for rank in (0, 1)]
    assert codes == ["0", "0"], (codes, done.stderr[-3000:])


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, synth_root) -> Path:
    """The reference: one process reading both data streams as two micro-batches."""
    tmp = tmp_path_factory.mktemp("one")
    return train(load_config(tiny_overrides(tmp, synth_root, *ARM)))


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, synth_root, one_process) -> dict:
    """One torchrun launch of the 2-process runs below (each in its own folder): the first 3 steps of a run and
    then the same run resumed (its exit codes and output in `resumed`), MaskDiT across its switch, the
    conversion's two stages, a rank whose clock runs ahead, a run left unfinished after its first step, a sweep
    of two cells (mask0, mask75, a few steps each, eval points 0.5 and 1) and `maskbench repro` of its mask75 run.
    The conversion's 1-process reference is trained here first, in this process; its source is the 1-process
    reference run above (a trained DiT of the same model). mask0's point 0.5 in the sweep is a cooled branch
    forked at that very step: a rerun stopped there (train.stop_at_step) ends before the fork, on one process as
    on two (a trainer matter)."""
    tmp = tmp_path_factory.mktemp("two")
    (tmp / "convert.yaml").write_text(CONVERT)
    convert = (f"arm={tmp / 'convert.yaml'}", f"init_from={one_process}", "budget.flops=1.5e9", "eval.points=[1.0]",
               "data.shuffle_buffer=32")
    one_convert = train(load_config(tiny_overrides(tmp / "one", synth_root, *convert, "train.grad_accum=2")))
    swept = tiny_overrides(tmp / "swept", synth_root, "budget.flops=1e9", "data.shuffle_buffer=32")
    mask75 = tmp / "swept" / "runs" / run_id(load_config([*swept, "arm=mask75"]))
    done = _launch(tmp, _run(tmp / "resume", synth_root, "train.stop_at_step=3"),
                   dict(_run(tmp / "resume", synth_root), out=str(tmp / "resumed")),
                   _run(tmp / "maskdit", synth_root, "arm=maskdit50", "budget.flops=2e9", "eval.points=[1.0]",
                        "data.shuffle_buffer=32", base=()),
                   _run(tmp / "convert", synth_root, *convert, base=()),
                   _run(tmp / "skewed", synth_root, "eval.points=[1.0]", "budget.flops=1e9", skewed_clock=True),
                   _run(tmp / "unfinished", synth_root, "train.stop_at_step=1"),
                   {"argv": ["sweep", "arm=mask0,mask75", *swept], "out": str(tmp / "sweep")},
                   {"argv": ["repro", str(mask75)], "out": str(tmp / "repro")})
    return {"tmp": tmp, "done": done, "one_convert": one_convert, "mask75": mask75}


def test_two_processes_with_resume_match_one_process(synth_root, one_process, two_processes, capsys):
    tmp = two_processes["tmp"] / "resume"
    for command in ("resume", "resumed", "unfinished"):
        _finished(two_processes["tmp"] / command, two_processes["done"])
    [run_dir] = (tmp / "runs").iterdir()
    # the first command stopped after step 3; the second resumed there, on both ranks
    assert f"resuming {run_dir.name} at step 3\n" in (two_processes["tmp"] / "resumed" / "rank-0.out").read_text()
    # one process cannot resume a 2-process run: each rank replays its own data streams
    unfinished = two_processes["tmp"] / "unfinished"
    [stopped] = (unfinished / "runs").iterdir()
    assert len(_metrics(stopped)) == 1 and not (stopped / "done.json").exists()
    assert main(["run", *tiny_overrides(unfinished, synth_root, *ARM)]) == 2
    assert "was trained on 2 processes" in capsys.readouterr().err
    two, one = _metrics(run_dir), _metrics(one_process)
    assert run_dir.name == one_process.name  # one config: the process count does not name another run
    assert (run_dir / "done.json").exists() and len(two) == len(one) > 10
    assert [m["data_digest"] for m in two] == [m["data_digest"] for m in one]  # both streams' digests, every step
    assert [m["draw_digest"] for m in two] == [m["draw_digest"] for m in one]
    assert all(len(m["data_digest"]) == len(m["draw_digest"]) == 2 for m in two)
    assert two[0]["loss"] == one[0]["loss"]  # step 0: the same samples, draws and weights, nothing summed yet
    for a, b in zip(two, one):
        assert a["loss"] == pytest.approx(b["loss"], rel=LOSS_RTOL), (a["step"], a["loss"], b["loss"])
    rows = read_rows([tmp / "leaderboard.csv"])
    assert [r["point"] for r in rows] == [0.5, 1.0]                       # written once, by rank 0
    # MFU is recorded (its size is a timing figure: benchmarks/step_time.py prints it)
    assert all(r["n_devices"] == 2 and r["batch_size"] == 8 and r["mfu"] > 0 for r in rows)
    reference = read_rows([one_process.parent.parent / "leaderboard.csv"])
    assert [r["train_flops"] for r in rows] == [r["train_flops"] for r in reference]
    assert [r["data_streams"] for r in rows + reference] == [2] * 4  # so the leaderboard pairs them
    for a, b in zip(rows, reference):  # the final validation loss, to float rounding (observed: see docs/runs.md)
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=LOSS_RTOL)
    # both ranks sampled half of the prompts; gathered in prompt order they match the 1-process samples
    two_samples, one_samples = (load_samples(d / "samples" / "point-1") for d in (run_dir, one_process))
    assert two_samples.shape == one_samples.shape == (8, 32, 32, 3)
    assert (two_samples.float() - one_samples.float()).abs().mean() < 1.0


def test_each_stream_reads_its_own_shards_and_logs_what_it_read(synth_root, one_process):
    """The logged digests are those of make_loader's stream 0 and 1, whose samples never overlap."""
    logged = [m["data_digest"] for m in _metrics(one_process)][:6]
    keys = []
    for stream in (0, 1):
        loader = make_loader(synth_root / "train", batch_size=4, seed=0, rank=stream, world_size=2,
                             shuffle_buffer=32)
        batches = [batch for batch, _ in zip(loader, range(6))]
        assert [f"{batch_digest(b):08x}" for b in batches] == [digests[stream] for digests in logged]
        keys.append({key for b in batches for key in b["key"]})
    assert keys[0] and keys[1] and not keys[0] & keys[1]


def test_activation_checkpointing_and_math_attention_keep_the_loss_trace(tmp_path, synth_root, one_process):
    run_dir = train(load_config(tiny_overrides(tmp_path, synth_root, *ARM, "train.activation_checkpointing=true",
                                               "train.attention=math")))
    assert run_dir.name == one_process.name  # speed switches do not name a different run
    for a, b in zip(_metrics(run_dir), _metrics(one_process), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=LOSS_RTOL)


def test_batch_must_split_evenly_over_streams(tmp_path, synth_root):
    with pytest.raises(ValueError, match="divisible by processes × train.grad_accum = 3"):
        new_trainer(load_config(tiny_overrides(tmp_path, synth_root, "train.grad_accum=3")))


def test_maskdit_crosses_its_switch_on_two_processes(two_processes):
    """At mask 0 MaskDiT's mask token gets no gradient (nothing is dropped, so nothing is filled). DDP does not
    search for unused parameters (`make_accelerator`), so the switch wraps the model again ignoring the token;
    a wrapper that still waited for its gradient would stop there ("Expected to have finished reduction in the
    prior iteration")."""
    tmp = two_processes["tmp"] / "maskdit"
    _finished(tmp, two_processes["done"])
    [run_dir] = (tmp / "runs").iterdir()
    ratios = [m["mask_ratio"] for m in _metrics(run_dir)]
    assert ratios[0] == 0.5 and ratios[-3:] == [0.0] * 3 and (run_dir / "done.json").exists()


def test_a_conversion_runs_its_frozen_and_full_stages_on_two_processes(two_processes):
    """Skip-DiT's conversion freezes all but the new skips after DDP wrapped the model, then unfreezes them:
    each stage is wrapped again with what it trains (the frozen parameters' grads stay None, so AdamW leaves
    them), and 2 processes train what 1 process with 2 micro-batches does, through the switch."""
    tmp = two_processes["tmp"] / "convert"
    _finished(tmp, two_processes["done"])
    [two] = (tmp / "runs").iterdir()
    one = two_processes["one_convert"]
    assert [m["loss"] for m in _metrics(two)] == pytest.approx([m["loss"] for m in _metrics(one)], rel=LOSS_RTOL)
    assert read_rows([tmp / "leaderboard.csv"])[-1]["switch_step"] > 0


@pytest.mark.parametrize("arm", distinct_arms())  # each arm another does not cover (its phases, same options)
def test_idle_parameters_are_exactly_those_a_phase_gives_no_gradient(tmp_path, synth_root, arm):
    """DDP ignores, in each phase, the parameters `idle_parameters` names; a real backward of each phase of
    each shipped arm must leave exactly those without a gradient, or a multi-GPU run stops."""
    cfg = load_config(arm_overrides(tmp_path, synth_root, arm, "eval.points=[1.0]"))
    torch.manual_seed(0)
    model = build_model(cfg.model, resolve_dataset(cfg.data, cfg.paths.data, create=False))
    gen = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(4, 3, 32, 32, generator=gen), torch.randn(4, 3, 32, 32, generator=gen)
    t = torch.tensor([0.1, 0.4, 0.7, 0.95])
    ids, mask = model.text_encoder.tokenize(["a red circle"] * 4)
    drop = torch.tensor([True, False, False, False])
    for phase in cfg.arm.phases:
        model.zero_grad(set_to_none=True)
        keep_idx = random_keep_idx(4, model.seq_len, phase.mask_ratio, generator=gen, grid=model.grid,
                                   structured=cfg.model.structured_mask)
        routes = demote_routes(cfg.train)
        demotion = Demotion(routes, cfg.train.demote_gate, gen) if routes else None
        windowed_flow_loss(model, x0, noise, t, ids, mask, drop, StepInputs(keep_idx, demotion=demotion),
                           cfg.train.mae_weight).backward()
        no_grad = {name for name, p in model.named_parameters() if p.requires_grad and p.grad is None}
        assert no_grad == set(idle_parameters(cfg.model, phase.mask_ratio)), (arm, phase.mask_ratio)


def test_a_rank_whose_clock_runs_ahead_does_not_checkpoint_alone(two_processes):
    """The periodic checkpoint is a collective (every rank saves, then meets in a barrier): if each rank
    decided it from its own clock, the one that runs ahead would wait in the barrier while the other
    entered the next step's all-reduce. Rank 0's clock decides for both; the run finishes. (Rank 1's clock
    reads an hour ahead at every reading: tests/launch_commands.py.)"""
    tmp = two_processes["tmp"] / "skewed"
    _finished(tmp, two_processes["done"])
    [run_dir] = (tmp / "runs").iterdir()
    assert (run_dir / "done.json").exists()
    assert not any(p.name.startswith("step-") for p in (run_dir / "checkpoints").iterdir())  # rank 0: none due


def test_ddp_does_not_rebroadcast_the_models_fixed_buffers(tmp_path, synth_root):
    """Every buffer is fixed at build (sin-cos positions, the synth token table): broadcasting them before
    each forward would only cost a collective."""
    cfg = load_config(tiny_overrides(tmp_path, synth_root))
    assert make_accelerator(cfg).ddp_handler.broadcast_buffers is False
    # nor search for unused parameters after every forward, even for an arm whose phases need different ones
    maskdit = load_config(arm_overrides(tmp_path, synth_root, "maskdit50"))
    assert make_accelerator(maskdit).ddp_handler.find_unused_parameters is False
    model = build_model(cfg.model, resolve_dataset(cfg.data, cfg.paths.data))
    assert {name for name, _ in model.named_buffers()} <= {"pos_embed", "text_encoder.token_table"}


CHECKS = ("rerun", "resume", "metrics", "environment", "digests")


def _printed(two_processes: dict, command: str) -> list[str]:
    """What each process printed running `command`, once both ran it to exit code 0."""
    _finished(two_processes["tmp"] / command, two_processes["done"])
    return [(two_processes["tmp"] / command / f"rank-{rank}.out").read_text() for rank in (0, 1)]


def test_a_sweep_of_two_cells_finishes_on_two_processes(two_processes):
    assert "sweep: 2 cells trained, 0 skipped as done" in _printed(two_processes, "sweep")[0]
    swept = two_processes["tmp"] / "swept"
    rows = read_rows([swept / "leaderboard.csv"])
    assert [(r["arm"], r["point"]) for r in rows] == [("mask0", 0.5), ("mask0", 1.0), ("mask75", 0.5), ("mask75", 1.0)]
    assert all(r["n_devices"] == 2 for r in rows)                   # each cell trained on both processes
    assert all((run / "done.json").is_file() for run in (swept / "runs").iterdir())


def test_repro_of_a_two_process_run_passes_on_two_processes(two_processes):
    assert [two_processes["mask75"]] == list((two_processes["tmp"] / "swept" / "runs").glob("mask75-*"))
    tables = [[line for line in printed.splitlines() if line.split()[:1] in [[check] for check in CHECKS]]
              for printed in _printed(two_processes, "repro")]
    table = tables[0]
    assert len(table) == 5 and all(line.split()[1] == "PASS" for line in table), table
    assert tables[1] == []                                           # printed once, by rank 0
    assert "n_devices 2" in next(line for line in table if line.startswith("environment"))
    assert list((two_processes["tmp"] / "tmpdir").glob("maskbench-repro-*")) == []  # the shared folder is gone
