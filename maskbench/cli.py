"""The `maskbench` command line: one console script, one subcommand per job.

Bad input is reported as one line on stderr with exit code 2, before any work starts. Every command
is registered the same way, as an entry of COMMANDS: its one-line help and a function that adds its
arguments and handler. Only the chosen command's function runs, and heavy modules (torch, timm) are
imported inside handlers and those functions, so `--help`, `arms`, `leaderboard`, `sweep --emit`,
`sweep --status` and `sweep --list-studies` answer without loading torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from maskbench.config import (
    EvalConfig,
    arm_settings,
    fill_eval_weights,
    format_arm,
    known_arms,
    load_config,
    shipped_arm,
)
from maskbench.config.presets import PRESETS
from maskbench.errors import ConfigError, UserError
from maskbench.weights import add_weights, weights_folder

EXAMPLES = """examples:
  maskbench run arm=mask75_then0                 train one arm on the embedded default
  maskbench run arm=mask0 seed=1 budget.flops=3e13 eval.points=[0.5,1.0]
  maskbench run arm=path/to/my_arm.yaml model=dit_s2
  maskbench arms                                 list the shipped arms: phases and the options they set
  maskbench data synth                           generate the embedded synth dataset
"""


def fail(message: str, code: int = 2) -> int:
    print(f"maskbench: error: {message}", file=sys.stderr)
    return code


def train_one(cfg) -> int:
    """Train one validated config; the exit code (2 bad input, 1 training failed, 130 interrupted)."""
    from maskbench.data.loader import TooManyBadSamples
    from maskbench.runs.launch import make_trainer
    from maskbench.train.loop import TrainingStopped

    trainer = make_trainer(cfg)  # bad input raises UserError: main() reports it
    try:
        run_dir = trainer.fit()
    except (TooManyBadSamples, TrainingStopped) as err:
        return fail(str(err), code=1)
    finally:
        for tracker in trainer.accelerator.trackers:  # what end_training does, less destroying the process group:
            tracker.finish()                          # a sweep's next cell trains in it (main() destroys it once)
    if trainer.progress.stop_signal is not None:
        return 130
    csv = cfg.paths.leaderboard
    trainer.accelerator.print(f"run directory: {run_dir}\nrows appended to {csv}; compare the arms with "
                              f"`maskbench leaderboard {csv}`")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    cfg = load_config(args.overrides)
    if args.cfg:  # Hydra's `--cfg job`: the resolved config, as the run directory's config.yaml will hold it
        import yaml

        from maskbench.config import to_dict
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        return 0
    return print_plan(cfg) if args.dry_run else train_one(cfg)


def print_plan(cfg) -> int:
    """--dry-run: check what the run needs and print its plan; bad input raises UserError (exit 2)."""
    import os

    from maskbench.runs.preflight import dry_run

    print("\n".join(dry_run(cfg, n_processes=int(os.environ.get("WORLD_SIZE", "1")))))
    return 0


def sweep_cells(runs, extra_csvs: list[str]):
    """The sweep's cells with their status, from the leaderboard CSVs that exist (and extra_csvs)."""
    from maskbench.results.rows import read_rows
    from maskbench.runs.sweep import cell_states, csv_paths

    paths = csv_paths(runs, extra_csvs)
    try:
        rows = read_rows(paths, on_error="skip")
    except ValueError as err:  # a file that is not a leaderboard CSV: bad input (malformed rows are skipped)
        raise UserError(str(err)) from None
    return cell_states(runs, rows), paths


def cmd_sweep(args: argparse.Namespace) -> int:
    from maskbench.runs.sweep import (
        format_status,
        format_studies,
        ladder_summary,
        launch_lines,
        plan_sweep,
        with_ladder,
        with_study,
    )

    if args.list_studies:
        print(format_studies())
        return 0
    study, overrides = with_study(args.overrides)
    if study is not None:
        print(f"study {study.name}: {' '.join(overrides)}", file=sys.stderr)
    ladder, overrides = with_ladder(overrides, study)
    runs = plan_sweep(overrides, ladder)
    print(ladder_summary(runs, ladder), file=sys.stderr)
    cells, csvs = sweep_cells(runs, args.csv)
    if args.status:
        print(format_status(cells, csvs))
        return 0
    done = sum(cell.status == "done" for cell in cells)
    if args.dry_run:
        for i, cell in enumerate(cells, 1):
            print(f"[{i}/{len(cells)}] {cell.command}" + (" (done: skipped)" if cell.status == "done" else ""))
            print_plan(cell.cfg)
        return 0
    if args.emit:
        todo = [(cell.overrides, cell.cfg) for cell in cells if cell.status != "done"]
        if done:
            print(f"# {done} of {len(cells)} cells are done (rows in the leaderboard CSV): not emitted",
                  file=sys.stderr)
        if todo:
            print(launch_lines(todo, args.emit, args.nproc))
        return 0
    skipped = 0
    for i, cell in enumerate(cells, 1):
        (now,), _ = sweep_cells([(cell.overrides, cell.cfg)], args.csv)  # another machine may have run it since
        if now.status == "done":
            print(f"[{i}/{len(cells)}] done (rows in the leaderboard CSV), skipped: {cell.command}")
            skipped += 1
            continue
        print(f"[{i}/{len(cells)}] {cell.command}")
        code = train_one(cell.cfg)
        if code:
            return code
    print(f"sweep: {len(cells) - skipped} cells trained, {skipped} skipped as done")
    return 0


def cmd_arms(args: argparse.Namespace) -> int:
    if args.sizes:
        from maskbench.runs.sizes import arm_sizes, render_sizes

        print(render_sizes(arm_sizes(args.sizes), args.sizes))
        return 0
    width = max(map(len, known_arms()))
    for name in known_arms():
        arm = shipped_arm(name)
        print(f"{name:{width}s} {format_arm(arm):20s} {arm.description}")
        if settings := arm_settings(name):
            print(f"{'':{width}s} {'':20s} sets {' '.join(settings)}")
    return 0


def cmd_data_synth(args: argparse.Namespace) -> int:
    from maskbench.data.dataset import resolve_dataset

    cfg = load_config(args.overrides)
    if cfg.data.name != "synth":
        return fail("`maskbench data synth` builds data=synth only")
    info = resolve_dataset(cfg.data, cfg.paths.data)
    print(f"synth shards: {info.train_dir} and {info.val_dir}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    if args.target == "reference":
        return cmd_eval_reference(args.rest)
    from maskbench.config import load_run_config, with_eval_overrides
    from maskbench.metrics import METRICS
    from maskbench.runs.reevaluate import evaluate_run

    # REMAINDER keeps `reference`'s own options whole, so options after RUN_DIR are parsed here.
    rest = argparse.ArgumentParser(prog="maskbench eval RUN_DIR")
    rest.add_argument("--point", type=float, action="append", default=[])
    rest.add_argument("overrides", nargs="*")
    extra = rest.parse_intermixed_args(args.rest)
    points, overrides = (args.point or []) + extra.point, extra.overrides
    cfg = load_run_config(args.target)
    rows = evaluate_run(args.target, points or None, overrides=with_eval_overrides(cfg, overrides))
    for row in rows:
        metrics = ", ".join(f"{m.name} {row[m.name]:.4g}" for m in METRICS if row.get(m.name) is not None)
        print(f"point {row['point']:g} (step {row['step']}): {metrics}")
    return 0


REFERENCE_KEYS = ("eval.inception_weights", "eval.dinov2_weights", "eval.dinov2_model", "paths.weights")


def reference_weights(overrides: list[str]) -> EvalConfig:
    """The weights `eval reference` reads, spelled as on `run` and `eval` (KEY=VALUE over REFERENCE_KEYS), and
    taken from the weights folder (paths.weights or $MASKBENCH_WEIGHTS) where unset, so the statistics are
    built with the very files the runs will score against."""
    settings = dict(o.partition("=")[::2] for o in overrides)
    if bad := next((o for o in overrides if "=" not in o or o.partition("=")[0] not in REFERENCE_KEYS), None):
        raise ConfigError(f"eval reference takes {', '.join(k + '=...' for k in REFERENCE_KEYS)}; got {bad!r}")
    cfg = EvalConfig(**{k.removeprefix("eval."): v for k, v in settings.items() if k.startswith("eval.")})
    if folder := weights_folder(settings.get("paths.weights")):
        cfg = fill_eval_weights(cfg, Path(folder))
    if cfg.inception_weights is None:
        raise ConfigError("eval reference needs the Inception weights: pass eval.inception_weights=PT, or "
                          "paths.weights=DIR (or $MASKBENCH_WEIGHTS) holding inception-2015-12-05.pt")
    return cfg


def cmd_eval_reference(argv: list[str]) -> int:
    from maskbench.eval.reference import build_reference

    parser = argparse.ArgumentParser(prog="maskbench eval reference",
                                     description="Build FID reference statistics (Inception, clean-fid mode "
                                                 "'clean'; optionally DINOv2) from held-out real images: a shard "
                                                 "dir, a folder, or a latent held-out split (its pixel shards, at "
                                                 "the resolution they were encoded at).")
    parser.add_argument("src", type=Path, help="held-out images: a shard dir (with manifest.json), a folder, or "
                                               "latent val shards from `maskbench data encode`")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="eval.inception_weights=PT (clean-fid's TorchScript Inception; required unless "
                             "paths.weights holds it), eval.dinov2_weights=FILE with eval.dinov2_model=NAME "
                             "(also write dinov2_stats.npz beside --out: FD-DINOv2), paths.weights=DIR")
    parser.add_argument("--out", type=Path, help="npz to write (default: SRC/inception_stats.npz)")
    parser.add_argument("--size", type=int, help="resize images to SIZE×SIZE first (the training resolution)")
    parser.add_argument("--limit", type=int, help="use the first N images only")
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu")
    args = parser.parse_intermixed_args(argv)
    weights = reference_weights(args.overrides)
    out = args.out or args.src / "inception_stats.npz"
    dinov2 = (weights.dinov2_model, weights.dinov2_weights) if weights.dinov2_weights else None
    found = build_reference(args.src, out, weights.inception_weights, args.size, args.limit, args.device,
                            dinov2=dinov2)
    for stats in found:
        print(f"reference statistics of {stats.n} images at {stats.resolution or 'native'}px ({stats.features_name}) "
              f"from {stats.source}")
    print(f"written to {out.parent}")
    return 0


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def cmd_bench(args: argparse.Namespace) -> int:
    from maskbench.train.mfu import bench_peak_main

    return bench_peak_main(args.rest)


def cmd_leaderboard(args: argparse.Namespace) -> int:
    from maskbench.results.leaderboard import leaderboard_main

    paths = args.csvs or [p for p in ("results/leaderboard.csv", "results/reference.csv") if Path(p).is_file()]
    if not paths:
        return fail("no CSV given and no results/leaderboard.csv here; run `maskbench run` first")
    if args.html:
        if args.plot or args.mlperf or args.crossover:
            return fail("--html writes study pages instead of a report: leave out --plot, --mlperf and --crossover")
        from maskbench.results.html import html_main

        return html_main(paths, args.html, args.runs, args.plan, args.baseline, args.on_error,
                         args.allow_size_mismatch)
    return leaderboard_main(paths, args.format, args.plot, args.baseline, args.on_error, args.mlperf,
                            args.crossover, args.plan, args.allow_size_mismatch, args.details)


def cmd_probe_gradfid(args: argparse.Namespace) -> int:
    from maskbench.runs.gradfid import FLOOR, PROTOCOLS, certify, format_table, probe_gradfid, write_arm

    if args.protocol not in PROTOCOLS:
        return fail(f"--protocol must be one of {', '.join(PROTOCOLS)}, got {args.protocol!r}")
    if args.certify is not None and not args.certify > 0:
        return fail(f"--certify EPS needs a positive gap tolerance, got {args.certify:g}")
    rows = probe_gradfid(args.run_dir, args.bins, args.batches, args.batch_size, args.seed,
                         max_memory_gb=args.max_memory_gb, ratios=args.demote, vae=args.vae)
    out = Path(args.run_dir) / "probe"
    print(f"wrote {out / 'gradfid.csv'} and {out / 'gradfid.png'}")
    print(format_table(rows))
    if args.certify is None:
        return 0
    floor = max(row["gap_hi"] for row in rows if row["route"] == FLOOR.name)
    if args.protocol == "maskbench" and not floor < args.certify:
        print(f"note: the self-floor's gap bound reaches {floor:.3g} >= {args.certify:g}: two native estimates are "
              "not told apart at this tolerance; more --batches or --batch-size narrow it")
    table = certify(rows, args.certify, args.protocol)
    if not table:
        print(f"no demotion route is certified at eps {args.certify:g}; no arm file written")
        return 0
    path = args.certify_out or out / "certified_arm.yaml"
    write_arm(path, table, args.certify, Path(args.run_dir).name, args.protocol)
    for route in table:
        print(f"certified: ratio {route['ratio']:g} on t in [{route['t'][0]:g}, {route['t'][1]:g}] "
              f"(priority {route['priority']})")
    print(f"wrote {path}: train it with `maskbench run arm={path}`")
    return 0


def add_run(run: argparse.ArgumentParser) -> None:
    run.description = ("Train one run (arm, data, model, budget, seed). Settings are key=value overrides of the "
                       "packaged config (groups: arm, data, model, eval). Rerunning the same command resumes an "
                       "interrupted run; a finished run is not retrained.")
    run.epilog = EXAMPLES
    run.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. arm=mask75 seed=1")
    run.add_argument("--dry-run", action="store_true",
                     help="check the data, weights, shapes and budget and print the plan (phases, eval steps, "
                          "FLOPs, estimated time once this machine has a run of the model); train and write nothing")
    run.add_argument("--cfg", action="store_true",
                     help="print the resolved config (every key, defaults filled in: Hydra's --cfg job) and exit")
    run.set_defaults(func=cmd_run)


SWEEP_EPILOG = """examples:
  maskbench sweep arm=mask0,mask75,mask75_then0 seed=0,1            the grid, trained here one by one
  maskbench sweep arm=mask0,mask75 seed=0,1,2 --emit slurm          a SLURM array script of the missing cells
  maskbench sweep arm=mask0,mask75 seed=0,1,2 --status              which cells are done, partial, missing
  maskbench sweep study=example                                     a named study's grid
  maskbench sweep study=example seed=0,1,2,3 model=dit_s2           the same, its seed axis replaced, a key added
  maskbench sweep study=path/to/my_study.yaml --emit slurm
  maskbench sweep --list-studies

A cell is done when the leaderboard CSV (its paths.leaderboard, plus any --csv) holds its rows, same
config hash, for every eval point of its config; done cells are skipped (and left out of --emit), so
a grid can be run over several sittings or machines and the CSVs merged. A partial cell resumes from
its run directory's checkpoint.

A study is a YAML file, maskbench/conf/study/NAME.yaml or any path:
  description: what the grid is for
  grid:
    - arm=mask0,mask75
    - seed=0,1
An override on the command line whose key is one of the study's axes replaces that axis; others are
added.
"""


def add_sweep(sweep: argparse.ArgumentParser) -> None:
    sweep.description = ("Expand key=a,b,c overrides (or a named study, study=NAME) into every combination. Without "
                         "--emit, train them here one after another: cells whose rows are already in the "
                         "leaderboard CSV are skipped, interrupted ones resume. baseline=ARM baseline.reach=K runs "
                         "the baseline's cells to K times the budget, on the same horizons continued by doublings "
                         "(its ladder: the leaderboard reads every arm's compute multiplier off it); a study that "
                         "names its baseline gets K=4 unless baseline.reach=1. The extra FLOPs are printed first.")
    sweep.epilog = SWEEP_EPILOG
    sweep.add_argument("overrides", nargs="*", metavar="KEY=V1,V2,...",
                       help="sweep overrides; study=NAME|FILE.yaml expands a study's grid")
    sweep.add_argument("--emit", choices=("accelerate", "torchrun", "slurm"),
                       help="print launch lines (or a SLURM array script) of the cells not done, instead of training")
    sweep.add_argument("--nproc", type=int, default=8, help="processes (GPUs) per run in emitted lines")
    sweep.add_argument("--status", action="store_true",
                       help="print each cell as done / partial / missing and a count; train nothing")
    sweep.add_argument("--csv", action="append", default=[], metavar="CSV",
                       help="also count rows of this leaderboard CSV (another machine's) as done; repeatable")
    sweep.add_argument("--list-studies", action="store_true", help="list the shipped studies and their grids")
    sweep.add_argument("--dry-run", action="store_true",
                       help="check every cell as `run --dry-run` does and print its plan; train and write nothing")
    sweep.set_defaults(func=cmd_sweep)


def add_arms(arms: argparse.ArgumentParser) -> None:
    arms.description = ("List the shipped arms: phases, description and the options each sets. With --sizes, "
                        "each arm's parameter count on a model preset beside mask0's instead (built on the meta "
                        "device: nothing is trained or allocated).")
    arms.add_argument("--sizes", nargs="?", const="micro_s", choices=list(PRESETS), metavar="MODEL",
                      help="print parameter counts on this preset (default micro_s) against mask0's")
    arms.set_defaults(func=cmd_arms)


def add_data(data: argparse.ArgumentParser) -> None:
    from maskbench.data.encode import add_encode_arguments
    from maskbench.data.sources import add_pack_arguments
    from maskbench.data.verify import add_verify_arguments

    data_sub = data.add_subparsers(dest="data_command", required=True, metavar="DATA_COMMAND")
    synth = data_sub.add_parser("synth", help="generate the embedded synthetic dataset (also done on first run)")
    synth.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                       help="data overrides, e.g. data.n_train=100000 paths.data=/scratch/data")
    synth.set_defaults(func=cmd_data_synth)
    add_pack_arguments(data_sub)
    add_verify_arguments(data_sub)
    add_encode_arguments(data_sub)


def add_eval(evaluate: argparse.ArgumentParser) -> None:
    evaluate.description = ("maskbench eval RUN_DIR [--point P ...] [eval.key=value ...]: evaluate the run's "
                            "eval-point checkpoints (default: all) and append leaderboard rows.\n"
                            "maskbench eval reference SRC eval.inception_weights=PT: build FID reference statistics "
                            "(see `maskbench eval reference --help`).")
    evaluate.add_argument("target", metavar="RUN_DIR|reference")
    evaluate.add_argument("--point", type=float, action="append", help="eval point(s) to evaluate, e.g. 1.0")
    evaluate.add_argument("rest", nargs=argparse.REMAINDER, metavar="KEY=VALUE",
                          help="eval.* / paths.* overrides (e.g. eval.n_samples=1000)")
    evaluate.set_defaults(func=cmd_eval)


def add_sample(sample: argparse.ArgumentParser) -> None:
    sample.description = ("Draw images from a trained run's EMA weights at one of its eval points, with the sampler "
                          "and settings its evaluation used, and write them as one grid PNG, each under its prompt.")
    sample.epilog = ('example:\n  maskbench sample runs/mask75_then0-synth-micro_s-s0-XXXXXXXX '
                     '--prompt "a small red circle above a large blue square" --n 16 --out grid.png')
    sample.formatter_class = argparse.RawDescriptionHelpFormatter
    sample.add_argument("run_dir", metavar="RUN_DIR")
    sample.add_argument("--prompt", action="append", required=True,
                        help="a caption to draw (repeat for several; the images take them in turn)")
    sample.add_argument("--n", type=int, default=16, help="images to draw (default 16)")
    sample.add_argument("--point", type=float, help="the eval point's weights (default: the last one saved)")
    sample.add_argument("--out", type=Path, help="grid PNG to write (default RUN_DIR/samples/sample-<point>.png)")
    sample.add_argument("--seed", type=int, default=0, help="noise seed: image i's noise depends on (seed, i) alone")
    sample.add_argument("--steps", type=int, help="Euler steps (default: the run's eval.sampler_steps)")
    sample.add_argument("--cfg-scale", type=float, help="guidance scale (default: the run's eval.cfg_scale)")
    sample.add_argument("--text-weights", help="latent data: the text tower's weights, where not the path the "
                                               "shards' manifest records")
    sample.set_defaults(func=cmd_sample)


def cmd_sample(args: argparse.Namespace) -> int:
    from maskbench.runs.draw_samples import sample_run

    path = sample_run(args.run_dir, args.prompt, args.n, args.point, args.out, args.seed, args.steps,
                      args.cfg_scale, args.text_weights)
    print(f"wrote {path}")
    return 0


def add_leaderboard(board: argparse.ArgumentParser) -> None:
    board.description = ("Merge leaderboard CSVs (yours, a cluster's, results/reference.csv) and summarise each "
                         "(dataset, model, batch size, budget, starting run) group per arm and eval point (mean ± 95% CI over seeds), then "
                         "compare each arm with the baseline on FD and validation loss side by side (co-primary): "
                         "at the final point the difference with its paired t-interval, p, the minimum detectable "
                         "effect (80% power), a verdict that claims no more than the interval (better / worse / "
                         "no difference detected), and where the two metrics disagree. Then the measured compute "
                         "multiplier M at each of the arms' horizons: the FLOPs (and device-hours, one device model "
                         "only) the baseline needs to reach the arm's value, read off the same seed's measured "
                         "baseline curve (its ladder: the baseline's run that reaches furthest, which a plan may name "
                         "beside the CSV), over the arm's; past the ladder's end a bound; with its trend over seeds. "
                         "Fitted compute curves (L(C) = E + A·(C/B)^-alpha per arm and seed) are shown only where the "
                         "baseline's fit up to B predicted its own ladder past B. "
                         "Runs pair only when their device, precision and draw scheme match and their parameter "
                         "counts agree within 5%. A study's PLAN.md "
                         "beside the CSV (or --plan) sets the primary metrics, baseline, alpha, the multiplicity "
                         "correction, what pays and its ladder; without one every reading is exploratory.")
    board.add_argument("csvs", nargs="*", metavar="CSV",
                       help="leaderboard CSVs (default: results/leaderboard.csv and results/reference.csv)")
    board.add_argument("--format", choices=("table", "markdown", "csv"), default="table",
                       help="table (default): text within 120 columns, a heading per group, the columns a "
                            "verdict is read from, long cells and notes wrapped; markdown and csv carry every "
                            "column")
    board.add_argument("--details", action="store_true",
                       help="with the table format, every column (test, p, MDE, eval/seed SE, targets, both "
                            "compute axes' ratios, each metric's ratio verdict, the metrics' agreement), one "
                            "line per row, however wide")
    board.add_argument("--plot", metavar="PNG",
                       help="write FID vs GPU-hours and FID vs FLOPs plots here, and the compute curves (val loss "
                            "and FD against FLOPs with their fits) beside it, to PNG's name with _fits")
    board.add_argument("--baseline",
                       help="arm the others are compared to: paired by seed where every seed has a partner, "
                            "Welch's unpaired test otherwise (default: the plan's, else mask0); another arm than the plan's "
                            "sets the plan aside and reads every comparison as exploratory")
    board.add_argument("--plan", metavar="FILE",
                       help="the study's analysis plan (a PLAN.md: YAML front matter between --- lines) "
                            "(default: PLAN.md beside the CSVs, if any)")
    board.add_argument("--mlperf", action="store_true",
                       help="MLPerf-style scores instead: olympic mean of device-hours to the baseline's "
                            "worst final value over >= 10 runs per arm, and the RCP rule on FLOPs")
    board.add_argument("--crossover", metavar="ARM",
                       help="the crossover map instead: per (model, batch size, eval point of the baseline), the "
                            "FLOPs ARM needs to reach the baseline's value there over the baseline's, per seed, on "
                            "FD and validation loss, geometric mean and 95%% CI; --plot draws FD's as a heatmap and "
                            "curves (single-phase arms: an eval point of a two-phase arm is not a shorter run)")
    board.add_argument("--allow-size-mismatch", action="store_true",
                       help="compare an arm with the baseline although their parameter counts differ by more "
                            "than 5%% (refused by default: extra capacity would pass for the method's effect); "
                            "the table notes each such comparison")
    board.add_argument("--on-error", choices=("skip", "abort"), default="skip",
                       help="a malformed row: report FILE:LINE and skip it, or abort")
    board.add_argument("--html", metavar="DIR",
                       help="instead of printing, write one self-contained page per study (the CSVs of one "
                            "folder) to DIR/<study>/report.html: the verdict tables, curves, and each arm's final "
                            "sample grid")
    board.add_argument("--runs", metavar="DIR", help="run directories, for --html's grids (default: paths.runs)")
    board.set_defaults(func=cmd_leaderboard)


def add_repro(repro: argparse.ArgumentParser) -> None:
    from maskbench.runs.repro import add_repro_arguments

    add_repro_arguments(repro)


def add_probe(probe: argparse.ArgumentParser) -> None:
    from maskbench.data.demote import parse_ratios

    probe_sub = probe.add_subparsers(dest="probe_command", required=True, metavar="PROBE")
    gradfid = probe_sub.add_parser(
        "gradfid", help="debiased cosine between full-token and masked / demoted gradients per t bin",
        description="Load RUN_DIR's raw weights from its latest checkpoint; for each t bin compute, on the same "
                    "training batches, noise and t, the full-token gradient and the gradient of each route "
                    "(random mask 0.5 and 0.75, structured 2x2 mask 0.75, demotion to each --demote ratio), of "
                    "the self-floor (a second native gradient on fresh noise) and, on latent data, of the VAE "
                    "round trip (decoded and re-encoded at native size), and the debiased cosine of their "
                    "expectations with a 95% jackknife interval. Writes RUN_DIR/probe/gradfid.csv and "
                    "gradfid.png (route x t heatmap); --certify EPS also writes the certified route table as an "
                    "arm file.",
        epilog="example: maskbench probe gradfid runs/mask0-synth-tiny-s0-1a2b3c4d --bins 8 --batches 16 "
               "--demote 0.5,0.75,0.875 --certify 0.05")
    gradfid.add_argument("run_dir", metavar="RUN_DIR", help="a run directory with at least one checkpoint")
    gradfid.add_argument("--bins", type=int, default=8, help="uniform t bins over (0, 1) (default 8)")
    gradfid.add_argument("--batches", type=int, default=16,
                         help="independent batches per bin, >= 3; more narrows the interval (default 16)")
    gradfid.add_argument("--batch-size", type=int, default=32, help="samples per batch (default 32)")
    gradfid.add_argument("--seed", type=int, default=0, help="seed of the batches, t, noise and masks (default 0)")
    gradfid.add_argument("--max-memory-gb", type=float, default=16.0,
                         help="CPU memory for the held gradients, (1 + routes) x params x 4 bytes per batch; past "
                              "it, batches are summed into as many groups as fit, >= 3 (default 16)")
    gradfid.add_argument("--demote", type=parse_ratios, metavar="R1,R2,...",
                         help="demotion routes to probe, ratios in (0, 1) (default: 0.5 on pixels; on latent shards "
                              "the ratios they were encoded with, `maskbench data encode --demote`)")
    gradfid.add_argument("--vae", metavar="DIR", help="latent data: the VAE folder in place of the one the manifest "
                                                      "records (the round-trip control decodes and re-encodes)")
    gradfid.add_argument("--certify", type=float, metavar="EPS",
                         help="certify each demotion route on the t bins whose gap (1 - debiased cosine, minus the "
                              "round-trip control's on latents) has a one-sided 95%% upper bound, Bonferroni over "
                              "the bins, below EPS; contiguous bins form its window, written as an arm file")
    gradfid.add_argument("--protocol", default="maskbench", metavar="{maskbench,anima}",
                         help="what --certify reads: maskbench's debiased gap (default), or anima_lora's: per batch, "
                              "cos(two native estimates) - the route's mean cosine to them, its mean over batches "
                              "with a one-sided 95%% bound, passing within the round-trip control's band + EPS. "
                              "Both gaps are written to the CSV either way")
    gradfid.add_argument("--certify-out", type=Path, metavar="ARM.yaml",
                         help="where to write the certified arm (default RUN_DIR/probe/certified_arm.yaml)")
    gradfid.set_defaults(func=cmd_probe_gradfid)


def add_bench(bench: argparse.ArgumentParser) -> None:
    bench.add_argument("what", choices=("peak",))
    bench.add_argument("rest", nargs=argparse.REMAINDER, metavar="...", help="--device cpu|cuda --precision fp32|...")
    bench.set_defaults(func=cmd_bench)


COMMANDS = {  # name -> (one-line help, the function that adds its arguments and handler)
    "run": ("train one arm to its FLOPs budget, evaluating at each eval point", add_run),
    "sweep": ("a grid of runs: train them here one by one, or print cluster launch lines", add_sweep),
    "arms": ("list the shipped arms with their phases", add_arms),
    "data": ("build and check shards (synth, pack, verify, encode)", add_data),
    "eval": ("(re)evaluate a run's checkpoints, or build FID reference statistics", add_eval),
    "sample": ("draw images for your prompts from a trained run's EMA weights, as one grid PNG", add_sample),
    "leaderboard": ("compare arms: mean ± 95%% CI per eval point, paired comparisons with verdicts, "
                    "the measured compute multiplier, plots (--mlperf: MLPerf-style scores)",
                    add_leaderboard),
    "repro": ("reproducibility checks of a run: rerun, resume, metrics, environment, digests (PASS/FAIL)",
              add_repro),
    "probe": ("diagnostic probes of a trained run (gradfid: does masking keep the gradient's direction, per "
              "noise level?)", add_probe),
    "bench": ("device figures: `maskbench bench peak` measures the GEMM peak (MFU's denominator on devices "
              "without a table entry)", add_bench),
    "weights": ("list the weight files the metrics and the encoder load; `weights check DIR` verifies a folder",
                add_weights),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser; only `command`'s arguments are added (None: just the list, for --help)."""
    parser = argparse.ArgumentParser(
        prog="maskbench", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
        description="Compute-matched benchmarks of masked-token (token-dropping) pretraining for "
                    "text-to-image diffusion transformers.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add_arguments) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, formatter_class=argparse.RawDescriptionHelpFormatter)
        if name == command:
            add_arguments(command_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    args = build_parser(command if command in COMMANDS else None).parse_args(argv)
    try:
        return args.func(args)
    except UserError as err:  # bad input: one line, exit 2 (anything else is a bug: its traceback shows)
        return fail(str(err).strip().splitlines()[0])
    finally:
        end_process_group()


def end_process_group() -> None:
    """Destroy the process group of a multi-process launch once, when the command is done: a sweep's cells and
    repro's reruns each make an Accelerator, and all of them share the one group (destroyed after a cell, the next
    cell's trainer would find accelerate's state initialized and no group: "Default process group has not been
    initialized"). accelerate's state is reset with it, so a later command in this process starts afresh."""
    torch = sys.modules.get("torch")  # commands that never loaded torch started no group
    if torch is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return
    from accelerate.state import AcceleratorState, GradientState

    torch.distributed.destroy_process_group()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


if __name__ == "__main__":
    sys.exit(main())
