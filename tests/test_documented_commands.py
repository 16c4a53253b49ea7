"""Every `maskbench …` command that README.md, docs/*.md and datasets/*.md show still works, so the docs cannot rot.

Each command is found in a fenced code block (backslash continuations joined, `for VAR in A ...` loops
taking their first value) or an inline code span, its placeholders mapped onto a fixture world in the
real formats (`world`: latent shards with their manifest and reference statistics, stand-in weights at
the documented /models paths, the repository's leaderboard CSVs, a run directory), and run in-process
through `maskbench.cli.main`, each as `how_run` says (`python -m tests.test_documented_commands` prints the
table: each command, how it runs and why). The first command of each kind (`toy_kind`: a run per data source,
starting run and arm file; a sweep; `data pack` per source; `data encode`, `data synth`, `eval`, `eval reference`,
`sample`) is executed at toy size (`at_toy_size`: a tiny model of its preset, a few steps, stand-in weights, fresh
output folders) and must write what it promises; the others of its kind, `run` and `sweep` with `--dry-run` (every
check a run makes, no training), the rest through their handlers up to the work itself. `arms`, `leaderboard`,
`sweep --emit/--status/--list-studies`, `data verify` run for real; `repro` and `probe` for real on a trained toy
run, `bench` for real; an inline mention that names a command's options without a whole command, its options
checked. An unknown option, key, arm or preset fails.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import io
import json
import os
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml

from maskbench import cli
from maskbench.config import EvalConfig, load_config, to_dict
from maskbench.data.shards import build_manifest, encode_npy, shard_entry
from maskbench.eval import standins
from maskbench.eval.fid import STANDIN_FEATURES_NAME, FeatureStats, save_stats
from tests.conftest import FAST, TINY_MODEL, TINY_TRAIN
from tests.fixtures_real import make_brushdata, make_journeydb, make_sa1b, write_tar

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "datasets").glob("*.md"))]
SEPARATORS = {";", "|", "||", "&", "&&", ">", ">>", "<", "(", ")"}
ELLIPSIS = ("...", "…")
# Run for real on the world's trained toy run (`maskbench bench`: on the world's own peak cache), and why there.
ON_THE_TRAINED_RUN = {"repro": "run on a trained toy run: reruns it, then its checks",
                      "probe": "run on a trained toy run: its options checked, the probe at 2 t bins x 3 batches of 2 "
                               "samples (`toy_probe`), its map, table and certificate",
                      "bench": "run: measures (or reads the world's cached) GEMM peak of this machine"}
UP_TO_THE_WORK = {("data", "pack"), ("data", "encode")}


@dataclass(frozen=True)
class Documented:
    where: str              # FILE:LINE
    argv: tuple[str, ...]   # after `maskbench`, placeholders still in
    inline: bool            # an inline span: may name a command's option without its arguments

    def __str__(self) -> str:
        return f"{self.where}: maskbench {' '.join(self.argv)}"


def code_lines(text: str) -> list[tuple[int, str, bool]]:
    """(line, code, inline) of every fenced line (continuations joined, loop variables set) and inline span."""
    out, fenced, loops = [], False, {}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line, start = lines[i], i + 1
        if line.lstrip().startswith("```"):
            fenced, loops = not fenced, {}
        elif fenced:
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1] + " " + lines[i].strip()
            if loop := re.match(r"\s*for (\w+) in (\S+)", line):
                loops[loop[1]] = loop[2]
            for name, value in loops.items():
                line = line.replace(f"${name}", value)
            out.append((start, line.removeprefix("$ "), False))
        else:
            out += [(start, span, True) for span in re.findall(r"`([^`]+)`", line)]
        i += 1
    return out


def without_options_groups(tokens: list[str]) -> list[str] | None:
    """`[--opt X]` kept without its brackets, `[CSV ...]` dropped; None if an ellipsis is left (a synopsis)."""
    out, group = [], None
    for token in tokens:
        if group is None and token.startswith("["):
            group, token = [], token[1:]
        if group is None:
            out.append(token)
            continue
        closes = token.endswith("]")
        group.append(token.removesuffix("]"))
        if closes:
            out += [] if any(e in t for t in group for e in ELLIPSIS) else [t for t in group if t]
            group = None
    return None if group is not None or any(e in t for t in out for e in ELLIPSIS) else out


def documented_commands() -> list[Documented]:
    found = []
    for path in DOCS:
        for line, code, inline in code_lines(path.read_text()):
            if "maskbench " not in code:
                continue
            code = re.sub(r"<(\w+)>", r"PLACEHOLDER-\1", code)  # `runs/<run_id>`: not a redirection
            lexer = shlex.shlex(code, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            tokens = list(lexer)
            for i, token in enumerate(tokens):
                if token != "maskbench" or i + 1 == len(tokens) or tokens[i + 1] not in cli.COMMANDS:
                    continue
                rest = tokens[i + 1:]
                end = next((j for j, t in enumerate(rest) if t in SEPARATORS), len(rest))
                argv = without_options_groups(rest[:end])
                if argv is not None:
                    found.append(Documented(f"{path.relative_to(ROOT)}:{line}", tuple(argv), inline))
    return found


# ------------------------------------------------------------------------------ the fixture world
def write_latent_split(out: Path, vae: Path, n: int, source: str = "sa1b") -> None:
    """A latent split as `data encode` writes it (manifest with its `latent` block), n tiny samples."""
    members = []
    for i in range(n):
        latent = np.full((4, 32, 32), i % 7, np.float16)
        members += [(f"{i:06d}.latent.npy", encode_npy(latent)), (f"{i:06d}.txtemb.npy", encode_npy(np.zeros((8, 16), np.float16))),
                    (f"{i:06d}.txt", f"scene {i}".encode()), (f"{i:06d}.json", b'{"text_tokens": 4}')]
    shard = write_tar(out / "latent-000000.tar", members)
    latent = {"size": 32, "channels": 4, "text_dim": 16, "text_len": 8, "dtype": "float16", "vae": str(vae),
              "scaling_factor": 0.5, "shift_factor": 0.0, "resolution": 64}  # the stand-in VAE: 2x
    header = {"source": source, "packer_version": 1, "filters": {}, "latent": latent}
    (out / "manifest.json").write_text(json.dumps(build_manifest(header, [shard_entry(shard, n)], {})))


def write_latent_root(root: Path, vae: Path, source: str = "sa1b") -> None:
    """train/ and val/ latent splits of `source`, and the reference statistics a run on them needs (stand-in
    features)."""
    for split in ("train", "val"):
        write_latent_split(root / split, vae, 512, source)
    rng = np.random.default_rng(0)
    features = rng.normal(size=(8, 2048))
    save_stats(root / "val" / "inception_stats.npz",
               FeatureStats(features.mean(0), np.eye(2048), 8, STANDIN_FEATURES_NAME, "fixture", 64))
    save_stats(root / "val" / "dinov2_stats.npz",
               FeatureStats(features.mean(0), np.eye(2048), 8, EvalConfig.dinov2_model, "fixture", 64))


def copy_results(results: Path) -> None:
    """The repository's leaderboard CSVs and plans; a user's default leaderboard holding rows (the pre-common-
    random-numbers ones: a fresh clone has none), and per-arm CSVs as a cluster's machines would write them."""
    for src in (ROOT / "results").rglob("*"):
        if src.suffix in (".csv", ".md") and src.is_file():
            (results / src.relative_to(ROOT / "results")).parent.mkdir(parents=True, exist_ok=True)
            (results / src.relative_to(ROOT / "results")).write_bytes(src.read_bytes())
    (results / "leaderboard.csv").write_bytes((ROOT / "results" / "pre_crn" / "leaderboard.csv").read_bytes())
    with open(results / "leaderboard.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    with open(results / "leaderboard.csv", "a", newline="") as f:
        csv.DictWriter(f, fieldnames=list(rows[0])).writerows(more_seeds(rows))
    for arm in ("mask0", "mask75"):
        with open(results / f"{arm}-s0.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(row for row in rows if row["arm"] == arm and row["seed"] == "0")


def more_seeds(rows: list[dict]) -> list[dict]:
    """Seeds 2-9 of tiny's mask0 and mask75, copies of seeds 0 and 1 a little slower each: `leaderboard
    --mlperf` scores arms with >= 10 finished runs (and says so, exit 1, when there are fewer)."""
    tiny = [row for row in rows if row["model"] == "tiny" and row["arm"] in ("mask0", "mask75")]
    return [dict(row, seed=str(seed), run_id=row["run_id"].replace(f"-s{row['seed']}-", f"-s{seed}-"),
                 gpu_hours=str(float(row["gpu_hours"]) * (1 + seed / 100)))
            for seed in range(2, 10) for row in tiny if int(row["seed"]) == seed % 2]


def write_source_run(root: Path, cfg) -> None:
    """A run with an eval-point checkpoint of freshly initialised weights: what `init_from` loads."""
    import torch

    from maskbench.data.dataset import resolve_dataset
    from maskbench.models.build import build_model
    from maskbench.train.checkpoint import EMA_FILE, RunDir

    ckpt = RunDir(root).point_checkpoint(1.0)
    ckpt.mkdir(parents=True)
    (root / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
    (ckpt / "meta.json").write_text(json.dumps({"step": 1}))
    model = build_model(cfg.model, resolve_dataset(cfg.data, cfg.paths.data, create=False))
    torch.save({"model": model.state_dict()}, ckpt / EMA_FILE)


def write_card_inputs(data: Path, vae: Path) -> None:
    """What datasets/*.md read and write: BrushData's and JourneyDB's raw inputs in their real formats beside
    SA-1B's, and each dataset's latent folders under data/mb/ (its canonical ones: sa1b's latent shards stand in)."""
    make_brushdata(data / "brushdata", shards=3)
    for split, anno_name in (("train", "train_anno_realease_repath"), ("valid", "valid_anno_repath")):
        anno, _, _ = make_journeydb(data / "jdb" / "data" / split)
        anno.rename(anno.with_name(f"{anno_name}.jsonl.tgz"))
    for name in ("sa1b", "brushdata", "journeydb"):
        write_latent_root(data / "mb" / name / "latent", vae, name)
        shutil.copytree(data / "sa1b" / "canon", data / "mb" / name / "canon")


@pytest.fixture(scope="module")
def world(tmp_path_factory, paired_runs, synth_root) -> Path:
    """What the documented commands read, at the paths they name (absolute ones rooted here)."""
    world = tmp_path_factory.mktemp("world")
    models = world / "models"
    vae = standins.write_vae(models / "sd-vae-ft-ema")
    standins.write_inception(models / "inception-2015-12-05.pt")
    for checked_only in ("open_clip_vit_h14.bin", "vit_large_patch14_dinov2.lvd142m.safetensors"):
        (models / checked_only).write_bytes(b"stand-in")  # a run only checks that the file is there
    for shared in ("inception-2015-12-05.pt", "open_clip_vit_h14.bin"):
        (world / "shared" / "models").mkdir(parents=True, exist_ok=True)
        (world / "shared" / "models" / shared).write_bytes((models / shared).read_bytes())
    write_latent_root(world / "data" / "sa1b" / "latent", vae)
    for root in ("data/jdb/latent", "shared/latents"):  # the same shards and statistics: copied, not re-encoded
        shutil.copytree(world / "data" / "sa1b" / "latent", world / root)
    tars, captions, _ = make_sa1b(world / "raw", tars=3)
    for tar in tars.iterdir():
        (world / "data" / "sa1b" / tar.name).write_bytes(tar.read_bytes())
    (world / "data" / "internvl").mkdir(parents=True)
    (world / "data" / "internvl" / captions.name).write_bytes(captions.read_bytes())
    for split in ("train", "val"):  # canonical shards: the latent split's shards stand in (verify reads both)
        canon = world / "data" / "sa1b" / "canon" / split
        canon.mkdir(parents=True)
        for item in (world / "data" / "sa1b" / "latent" / split).glob("*[rn]"):
            (canon / item.name).write_bytes(item.read_bytes())
    run = world / "runs" / "fixture-run"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(load_config([]))))
    shutil.copytree(paired_runs["mask0"], world / "runs" / "trained-run")  # what repro and probe work on
    cache = world / "cache"  # bench's peak: the session's measurement if there is one, a --remeasure writes here
    cache.mkdir()
    if (measured := Path(os.environ["MASKBENCH_CACHE"]) / "gemm_peak.json").is_file():
        shutil.copy(measured, cache)
    write_source_run(world / "runs" / "source-tiny_deep", load_config(["arm=mask0", "model=tiny_deep"]))
    write_card_inputs(world / "data", vae)
    (world / "my_arm.yaml").write_text("phases: [{mask_ratio: 0.5, fraction: 1.0}]\n")
    copy_results(world / "results")
    write_toy_inputs(world / "toy", paired_runs, synth_root)
    return world


def write_toy_inputs(toy: Path, paired_runs, synth_root: Path) -> None:
    """What the commands executed at toy size read besides the world: a stand-in CLIP, canonical shards of real
    images (BrushData's fixture packed), the session's synth scenes, a trained run to evaluate and sample from
    (a copy: repro's run stays as trained) and a toy-size source run for `init_from`."""
    from maskbench.data.pack import PackOptions, pack
    from maskbench.data.sources.brushdata import plan_brushdata

    standins.write_clip(toy / "standin-clip")
    make_brushdata(toy / "raw", shards=1, per_shard=4)
    pack(toy / "canon", "brushdata", plan_brushdata([toy / "raw"]), PackOptions(), progress=False)
    (toy / "synth").symlink_to(synth_root)
    shutil.copytree(paired_runs["mask0"], toy / "evaluated-run")
    write_source_run(toy / "source-tiny_deep", load_config(["arm=mask0", "model=tiny_deep", *TINY_MODEL]))


WORDS = {"CSV": "results/leaderboard.csv", "ARM": "mask75", "EPS": "0.05"}  # placeholders standing alone
VALUES = {"DIR": "data/sa1b/latent", "FILE": "my_arm.yaml", "NAME": "example", "PLACEHOLDER-arm": "mask0",
          "my_arm.yaml": "my_arm.yaml"}  # placeholders after `key=`, paths relative to the world


def placed(token: str, world: Path, run: str = "fixture-run") -> str:
    """A documented token with its placeholders put into the world (a run named: world/runs/`run`)."""
    token = WORDS.get(token, token).replace("results/PLACEHOLDER-study/", "results/powered/")
    token = re.sub(r"runs/mask0-synth-tiny_deep-s0-PLACEHOLDER-hash", str(world / "runs" / "source-tiny_deep"), token)
    token = re.sub(r"RUN_DIR|runs/PLACEHOLDER-run_id|runs/mask0-synth-\w+-s0-[0-9a-f]{8}",
                   str(world / "runs" / run), token)
    token = re.sub(r"(?<![\w.])/(data|models|shared)(?=/|$)", lambda m: f"{world}/{m[1]}", token)
    key, eq, value = token.partition("=")
    return f"{key}={world / VALUES[value]}" if eq and value in VALUES and "/" in VALUES[value] or \
        value == "my_arm.yaml" else f"{key}={VALUES[value]}" if eq and value in VALUES else token


def runs_training(argv: list[str]) -> bool:
    return argv[0] == "run" or (argv[0] == "sweep" and not {"--emit", "--status", "--list-studies"} & set(argv))


def is_whole(argv: list[str]) -> bool:
    """Whether the command's parser takes argv (an inline mention may name a command without its arguments)."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            cli.build_parser(argv[0]).parse_args(argv)
    except SystemExit:
        return False
    return True


def how_run(documented: Documented) -> str:
    """How the test runs a documented command, and why not further."""
    argv = list(documented.argv)
    kind = toy_kind(documented)
    if kind is not None and EXECUTED[kind] == documented:
        return f"executed at toy size: {TOY_SIZE[kind[0] if kind[0] in TOY_SIZE else kind[:2]]}"
    if kind is not None:
        return f"{how_run_here(documented)}; its code path runs at toy size as {EXECUTED[kind].where}"
    if "eval.dinov2_weights" in " ".join(argv) and argv[0] in ("run", "eval"):
        return f"{how_run_here(documented)}; FD-DINOv2 needs ViT-L/14's weights (its path with a small network: " \
               "test_metrics.py)"
    return how_run_here(documented)


def how_run_here(documented: Documented) -> str:
    """How a command that is not executed at toy size runs, and why not further."""
    argv = list(documented.argv)
    if documented.inline and not is_whole(argv):
        return "options checked: an inline mention of the command, its options named without a whole command"
    if runs_training(argv):
        return "--dry-run: every check of a run, no training (the training tests train at toy size)"
    if argv[0] in ON_THE_TRAINED_RUN:
        return ON_THE_TRAINED_RUN[argv[0]]
    if tuple(argv[:2]) in UP_TO_THE_WORK:
        return "up to the work: inputs read and checked (packing, encoding: test_sources.py, test_encode.py)"
    if argv[0] in ("eval", "sample"):
        return "up to the work: the run's config and overrides checked (the work: test_eval_cli.py, test_sample.py)"
    if tuple(argv[:2]) == ("data", "synth"):
        return "up to the work: the data overrides checked (generating: test_synth.py)"
    if argv[0] == "leaderboard" and {"--plot", "--html"} & set(argv):
        return "run, figures built not rendered: rendering is tested in test_html.py and test_leaderboard.py"
    return "run"


def unrendered(monkeypatch: pytest.MonkeyPatch) -> None:
    """Figures are built (every axis, line and label a plot or study page draws) but not rendered: an empty file
    stands for each PNG. Rendering is matplotlib's layout and rasterising, most of a plotting command's time here;
    test_html.py and test_leaderboard.py render them."""
    from matplotlib.figure import Figure

    def empty_png(figure: Figure, target, *args, **kwargs) -> None:
        target.write(b"") if hasattr(target, "write") else Path(target).write_bytes(b"")

    monkeypatch.setattr(Figure, "savefig", empty_png)


# ------------------------------------------------------------------------------ executed at toy size
# What differs in a toy execution from the documented command, by command.
TOY_SIZE = {
    "run": "its own arm, data source and start, with a 2-block width-32 model of its preset, ~8-12 steps of 8 "
           "samples, one eval point on 2 samples (stand-in Inception and CLIP for latent data; synth: the session's scenes)",
    "sweep": "its grid, each cell a toy run (as `run`)",
    ("data", "pack"): "its raw inputs (the fixture's, in the source's real format) packed into a fresh folder, one "
                      "worker, no minimum side",
    ("data", "encode"): "4 real images packed from BrushData's fixture, encoded at 32 px with the stand-in VAE and "
                        "CLIP text tower into a fresh folder",
    ("data", "synth"): "64 training and 16 held-out scenes into a fresh folder",
    ("eval", "reference"): "the statistics of 4 real packed images with the stand-in Inception, into a fresh file",
    ("eval", "run"): "a trained toy run's point evaluated on 8 samples, its row in a fresh CSV",
    ("sample",): "drawn from a trained toy run's EMA weights",
}
TOY_EVAL = (*FAST, "eval.points=[1.0]", "eval.sampler_steps=2", "eval.batch_size=16", "data.shuffle_buffer=64")


def toy_kind(documented: Documented) -> tuple[str, ...] | None:
    """What a documented command's toy execution differs in: its command, and for a run its data source, a
    starting run and an arm file. The first command of each kind (README, then docs/, then datasets/) is executed,
    the others dry-run or run up to the work; None: not executed here (an inline mention, FD-DINOv2's weights)."""
    argv = list(documented.argv)
    if documented.inline or "eval.dinov2_weights" in " ".join(argv):
        return None
    keys = dict(token.split("=", 1) for token in argv if "=" in token and not token.startswith("-"))
    if argv[0] == "run":
        data = "mix" if keys.get("data") == "mix" else "latent" if "data.path" in keys else "synth"
        arm = keys.get("arm", "")
        return "run", data, str("init_from" in keys), str(arm.endswith(".yaml") or arm == "FILE")
    if runs_training(argv):
        return ("sweep",)
    if tuple(argv[:2]) == ("data", "pack"):
        return "data", "pack", argv[2]
    if tuple(argv[:2]) in {("data", "encode"), ("data", "synth"), ("eval", "reference")}:
        return tuple(argv[:2])
    return ("eval", "run") if argv[0] == "eval" else ("sample",) if argv[0] == "sample" else None


def at_toy_size(documented: Documented, argv: list[str], world: Path) -> tuple[list[str], Path]:
    """The documented command (its placeholders placed) at toy size, and what it must have written."""
    kind, toy = toy_kind(documented), world / "toy"
    out = toy / "out" / re.sub(r"\W", "_", documented.where)
    argv = [with_standin_clip(token, toy) for token in argv]
    if kind[0] in ("run", "sweep"):
        argv = [token.replace(str(world / "runs" / "source-tiny_deep"), str(toy / "source-tiny_deep"))
                for token in argv]
        synth = [f"data.path={toy / 'synth'}"] if kind[1:2] in (("synth",), ()) and not any(
            token.startswith("data") for token in argv[1:]) else []
        latent = ["budget.flops=1e10"] if kind[1:2] in (("latent",), ("mix",)) else []  # 256 tokens: ~12 steps
        return [*argv, *TINY_MODEL, *TINY_TRAIN, *latent, *TOY_EVAL, *synth, f"paths.runs={out / 'runs'}",
                f"paths.leaderboard={out / 'leaderboard.csv'}"], out / "leaderboard.csv"
    if kind[:2] == ("data", "pack"):
        argv = replaced(argv, "--min-side", "0") if "--min-side" in argv else argv  # the fixture's images are small
        return [*replaced(argv, "--out", str(out)), "--workers", "1"], out / "manifest.json"
    if kind == ("data", "encode"):
        return ["data", "encode", str(toy / "canon"), str(out), *argv[4:], "--resolution", "32",
                "--batch-size", "2"], out / "manifest.json"
    if kind == ("data", "synth"):
        return [*argv, "data.n_train=64", "data.n_val=16", f"paths.data={out}"], out
    if kind == ("eval", "reference"):
        return ["eval", "reference", str(toy / "canon"), *argv[3:], "--out", str(out / "stats.npz")], \
            out / "stats.npz"
    run = str(toy / "evaluated-run")
    argv = [run if token == str(world / "runs" / "fixture-run") else token for token in argv]
    if kind == ("eval", "run"):
        return [*argv, "eval.n_samples=8", "eval.bootstrap_resamples=0", f"paths.leaderboard={out / 'rows.csv'}"], \
            out / "rows.csv"
    return replaced(argv, "--out", str(out / "grid.png")), out / "grid.png"


def with_standin_clip(token: str, toy: Path) -> str:
    """ViT-H-14 (as `--text-model` or `eval.clip_model=`) becomes the stand-in CLIP (whose folder carries its own
    weights: a weights file named beside it is ignored, with open_clip's warning)."""
    name = f"local-dir:{(toy / 'standin-clip').resolve()}"
    return name if token == "ViT-H-14" else token.replace("=ViT-H-14", f"={name}")


def replaced(argv: list[str], option: str, value: str) -> list[str]:
    """argv with `option`'s value replaced (appended if it has none)."""
    if option not in argv:
        return [*argv, option, value]
    i = argv.index(option)
    return [*argv[:i + 1], value, *argv[i + 2:]]


class WorkReached(Exception):
    """Raised in place of packing or encoding: the command got there with its inputs read and checked."""


def toy_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """`probe gradfid` at 2 t bins x 3 batches of 2 samples (its jackknife needs 3), whatever the command asks:
    the documented sizes take ~10 s each on a toy run, and change how many gradients it averages, not which
    code runs."""
    from maskbench.runs import gradfid

    probe = gradfid.probe_gradfid
    monkeypatch.setattr(gradfid, "probe_gradfid", lambda run_dir, bins, batches, batch_size, seed, **options:
                        probe(run_dir, 2, 3, 2, seed, **options))


def run_documented(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> int:
    """Run one documented command as the module docstring says; its exit code."""
    from maskbench.data import dataset
    from maskbench.eval import reference
    from maskbench.runs import draw_samples, reevaluate

    if runs_training(argv):
        return cli.main([*argv, "--dry-run"])
    unrendered(monkeypatch)
    if argv[0] == "probe":
        toy_probe(monkeypatch)
    # up to the work itself: overrides composed and validated against the recorded / packaged config
    monkeypatch.setattr(reevaluate, "evaluate_run", lambda *args, **kwargs: [])
    monkeypatch.setattr(draw_samples, "sample_run", lambda *args, **kwargs: Path("grid.png"))  # run in tests/test_sample.py
    monkeypatch.setattr(reference, "build_reference", lambda *args, **kwargs: [])
    monkeypatch.setattr(dataset, "resolve_dataset", functools.partial(dataset.resolve_dataset, create=False))
    if tuple(argv[:2]) in UP_TO_THE_WORK:
        return reach_the_work(argv, monkeypatch)
    return cli.main(argv)


def reach_the_work(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> int:
    """`data pack` with its source's plan built from the fixture's raw inputs, `data encode` with its options
    checked, each stopped where the packing or encoding would start (they run at toy size in test_sources.py,
    test_pack_resume.py and test_encode.py): 0 if it got there, else the command's own exit code."""
    import maskbench.data.encode as encode
    import maskbench.data.sources as sources

    def reached(*args, **kwargs):
        raise WorkReached

    monkeypatch.setattr(sources, "pack", reached)
    monkeypatch.setattr(encode, "encode", reached)
    try:
        return cli.main(argv)
    except WorkReached:
        return 0


COMMANDS = documented_commands()
EXECUTED: dict[tuple[str, ...], Documented] = {}  # kind -> the first command of that kind, executed at toy size
for _documented in COMMANDS:
    if (_kind := toy_kind(_documented)) is not None:
        EXECUTED.setdefault(_kind, _documented)
# (argv as run, inline) -> (exit code, stderr): a command the docs show in several places runs once per world
RESULTS: dict[tuple[tuple[str, ...], bool], tuple[int, str]] = {}


def test_the_docs_show_at_least_30_commands_and_each_dataset_card_is_collected() -> None:
    assert len(COMMANDS) >= 30, [str(c) for c in COMMANDS]
    cards = {c.where.split(":")[0] for c in COMMANDS if c.where.startswith("datasets/")}
    assert cards == {f"datasets/{p.name}" for p in (ROOT / "datasets").glob("*.md")}
    assert not any(e in token for c in COMMANDS for token in c.argv for e in ELLIPSIS)


@pytest.mark.parametrize("documented", COMMANDS, ids=str)
def test_a_documented_command_runs(documented: Documented, world: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(world)
    monkeypatch.setenv("MASKBENCH_CACHE", str(world / "cache"))
    run = "trained-run" if documented.argv[0] in ON_THE_TRAINED_RUN else "fixture-run"
    argv = [placed(token, world, run) for token in documented.argv]
    if (kind := toy_kind(documented)) is not None and EXECUTED[kind] == documented:
        argv, written = at_toy_size(documented, argv, world)
        assert cli.main(argv) == 0, f"{documented}: {capsys.readouterr().err.strip()}"
        assert written.exists() and (written.is_dir() or written.stat().st_size > 0), f"{documented}: no {written}"
        if written.name == "manifest.json":  # shards packed or encoded, not an empty folder's manifest
            assert json.loads(written.read_text())["total"] > 0
        return
    key = (tuple(argv), documented.inline)
    if key not in RESULTS:
        try:
            code = run_documented(argv, monkeypatch)
        except SystemExit as exit_:  # argparse: an unknown option, a missing argument
            code = exit_.code
            if documented.inline:  # `maskbench data encode --demote` names an option, not a whole command
                code = run_documented_options(argv)
        RESULTS[key] = (code, capsys.readouterr().err.strip())
    code, err = RESULTS[key]
    assert code == 0, f"{documented}: {err}"


def run_documented_options(argv: list[str]) -> int:
    """An inline mention without its arguments: every option it names must be one of its command's."""
    parser = cli.build_parser(argv[0])
    for word in argv:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or word not in sub.choices:
            break
        parser = sub.choices[word]
    options = {option for action in parser._actions for option in action.option_strings}
    return 0 if all(token in options for token in argv if token.startswith("--")) else 2


def test_a_broken_documented_command_fails(world: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture) -> None:
    """The check has teeth: a misspelled option, key, arm or preset in a documented command is caught."""
    monkeypatch.chdir(world)
    for broken in (["run", "arm=mask0", "sed=1"], ["run", "arm=mask00"], ["run", "model=dit_s3"],
                   ["sweep", "arm=mask0,mask75", "--emitt", "slurm"], ["leaderboard", "--plott", "x.png"],
                   ["eval", str(world / "runs" / "fixture-run"), "eval.n_sample=10"],
                   ["repro", str(world / "runs" / "fixture-run"), "--thru", "last"],
                   ["eval", "reference", str(world / "data"), "--inception-weights", "x.pt"],
                   ["eval", "reference", str(world / "data"), "eval.inception_weight=x.pt"]):
        try:
            code = run_documented(broken, monkeypatch)
        except SystemExit as exit_:
            code = exit_.code
        assert code == 2, broken


def test_dry_run_plans_without_writing_and_estimates_time_from_a_previous_run(tmp_path: Path,
                                                                              capsys: pytest.CaptureFixture) -> None:
    import torch

    from maskbench.config import run_id
    from maskbench.train.checkpoint import device_name

    paths = [f"paths.runs={tmp_path / 'runs'}", f"paths.data={tmp_path / 'data'}"]
    assert cli.main(["run", "arm=mask75_then0", *paths, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "not generated yet" in out and "no measured step rate yet" in out and "phase 1   mask 0:" in out
    assert not (tmp_path / "runs").exists() and not (tmp_path / "data").exists()
    cfg = load_config(["arm=mask0", *paths])
    previous = tmp_path / "runs" / run_id(cfg)
    previous.mkdir(parents=True)
    (previous / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
    (previous / "env.json").write_text(json.dumps({"device": device_name(torch.device("cpu")), "n_devices": 1}))
    (previous / "metrics.jsonl").write_text(json.dumps({"step": 9, "flops": 6e11, "seconds": 10.0}) + "\n")
    assert cli.main(["run", "arm=mask75_then0", *paths, "--dry-run"]) == 0
    out = capsys.readouterr().out
    total = float(re.search(r"FLOPs     (\S+) ", out)[1])
    assert f"at 6e+10 FLOP/s, measured by {previous.name}" in out
    assert float(re.search(r"~(\S+) min", out)[1]) == pytest.approx(total / 6e10 / 60, rel=0.01)


def test_a_dry_run_names_every_missing_weight_file_and_the_setting_that_fixes_it(
        world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Latent sa1b shards: without weights one line names the files the evaluation loads and paths.weights
    (exit 2); an empty weights folder, every file it lacks; the folder of stand-ins, exit 0 and a plan."""
    monkeypatch.chdir(world)
    monkeypatch.delenv("MASKBENCH_WEIGHTS", raising=False)
    run = ["run", "arm=mask75", "data=sa1b", f"data.path={world / 'data' / 'sa1b' / 'latent'}",
           "eval.clip_model=ViT-H-14", f"paths.runs={tmp_path / 'runs'}"]
    (tmp_path / "empty").mkdir()
    for setting, named in ([], ["inception-2015-12-05.pt (eval.inception_weights unset)", "paths.weights=DIR"]), \
                          ([f"paths.weights={tmp_path / 'empty'}"],
                           [str(tmp_path / "empty" / "inception-2015-12-05.pt"),
                            str(tmp_path / "empty" / "open_clip_vit_h14.bin"), "(paths.weights)"]):
        assert cli.main([*run, *setting, "--dry-run"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and all(name in err for name in named), err
    assert cli.main([*run, f"paths.weights={world / 'models'}", "--dry-run"]) == 0
    assert "FLOPs     " in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


if __name__ == "__main__":  # the table: every collected command, how the test runs it and why
    for documented in COMMANDS:
        print(f"{documented}\n    {how_run(documented)}")
    modes = [how_run(documented).split(":")[0] for documented in COMMANDS]
    print(f"{len(COMMANDS)} documented commands: " + ", ".join(f"{modes.count(m)} {m}" for m in dict.fromkeys(modes)))
