"""Every bad input is refused with one line and exit code 2, before any data is made or run directory written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from maskbench.cli import main
from maskbench.config import load_config, to_dict
from maskbench.data.sources import sa1b
from maskbench.errors import ConfigError
from maskbench.train.streams import stream_layout
from tests.fixtures_real import make_brushdata, make_sa1b

BAD_OVERRIDES = {
    "train.batch_size=0": "train.batch_size must be at least 1",
    "train.batch_size=-4": "train.batch_size must be at least 1",
    "eval.n_samples=-1": "eval.n_samples must be at least 2",
    "model.depth=0": "model.depth must be at least 1",
    "train.ema_decay=1.5": "train.ema_decay must be in [0, 1)",
    "eval.sampler_steps=0": "eval.sampler_steps must be at least 1",
    "train.caption_dropout=2": "train.caption_dropout must be in [0, 1]",
    "train.downscale_factor=3": "does nothing without train.downscale_window",
    "model.width=130": "must be divisible by 4",
    "model.patch_size=3": "model.patch_size=3 does not divide the 32-pixel input",
    "model.heads=5": "model.width=128 is not divisible by model.heads=5",
    "eval.val_t=[0.5,1.0]": "eval.val_t must be times in (0, 1)",
    "train.lr=0": "train.lr and train.grad_clip must be positive",
    "train.data_streams=3": "train.data_streams must be at least 1 and divide train.batch_size 64, got 3",
    "arm.charge_source=true": "arm.charge_source charges the training of the run this one starts from: set init_from",
}
BAD_ARM_FILES = {
    "name: only_a_name\n": "has no `phases` list",
    "phases: [{mask_ratio: 0.5, fraction: 1.0}\n": "is not valid YAML",
    "phases: [{mask_ratio: 0.5, fraction: 1.0}]\nphase_typo: 1\n": "phase_typo",
    "phases: [{mask: 0.5, fraction: 1.0}]\n": "mask",
    "arm:\n  name: x\nmodel:\n  long_skip: concat\n": "has no `phases` list",
    "- just a list\n": "must be a mapping",
}


def refused(tmp_path: Path, capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    """Run the CLI; assert exit 2, a single stderr line, and nothing written; return that line."""
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "data").exists()
    return err


def paths(tmp_path: Path) -> list[str]:
    return [f"paths.runs={tmp_path / 'runs'}", f"paths.data={tmp_path / 'data'}",
            f"paths.leaderboard={tmp_path / 'lb.csv'}"]


@pytest.mark.parametrize("override", BAD_OVERRIDES)
def test_a_bad_override_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture, override: str) -> None:
    assert BAD_OVERRIDES[override] in refused(tmp_path, capsys, ["run", override, *paths(tmp_path)])


@pytest.mark.parametrize("text", BAD_ARM_FILES)
def test_a_bad_arm_file_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture, text: str) -> None:
    arm = tmp_path / "my_arm.yaml"
    arm.write_text(text)
    assert BAD_ARM_FILES[text] in refused(tmp_path, capsys, ["run", f"arm={arm}", *paths(tmp_path)])


def test_data_streams_and_grad_accum_together_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """train.data_streams derives the micro-batches from the process count: a grad_accum beside it would say
    two things about one number."""
    err = refused(tmp_path, capsys, ["run", "train.data_streams=2", "train.grad_accum=2", *paths(tmp_path)])
    assert "train.data_streams=2 sets the micro-batches (data_streams / processes): leave train.grad_accum at 1" in err


def test_a_process_count_that_does_not_divide_the_streams_is_refused() -> None:
    """Each process runs an equal share of the streams; without data_streams the streams follow the processes."""
    streams = load_config(["train.data_streams=4"]).train
    assert [stream_layout(streams, n) for n in (1, 2, 4)] == [(4, 4), (4, 2), (4, 1)]
    with pytest.raises(ConfigError, match="train.data_streams=4 must be divisible by the 3 processes"):
        stream_layout(streams, 3)
    assert stream_layout(load_config(["train.grad_accum=2"]).train, 3) == (6, 2)


def test_a_bad_patch_size_on_latent_data_is_refused_once_its_size_is_known(
        tmp_path: Path, capsys: pytest.CaptureFixture, synth_root: Path) -> None:
    """The size of data.path shards is read from their manifest; 32 px synth shards here."""
    err = refused(tmp_path, capsys, ["run", f"data.path={synth_root}", "model.patch_size=5", *paths(tmp_path)])
    assert "model.patch_size=5 does not divide the 32-pixel input" in err


def test_eval_refuses_an_unknown_key_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_dir = tmp_path / "some_run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(load_config(paths(tmp_path)))))
    err = refused(tmp_path, capsys, ["eval", str(run_dir), "eval.no_such_key=1"])
    assert "no_such_key" in err


def test_pack_refuses_a_file_as_its_output_folder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    make_brushdata(tmp_path / "raw", shards=1, per_shard=2)
    (tmp_path / "out").write_text("not a folder")
    err = refused(tmp_path, capsys, ["data", "pack", "brushdata", str(tmp_path / "raw"), "--out", str(tmp_path / "out"),
                                     "--no-progress"])
    assert "is a file; give a folder" in err


def test_pack_refuses_an_unreadable_captions_file(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    tars, captions, _ = make_sa1b(tmp_path / "raw")

    def denied(path, *args, **kwargs):  # root reads through chmod 000, so the refusal is made here
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(sa1b, "open", denied, raising=False)
    err = refused(tmp_path, capsys, ["data", "pack", "sa1b", str(tars), "--captions", str(captions),
                                     "--out", str(tmp_path / "out"), "--no-progress"])
    assert "cannot read" in err and "Permission denied" in err


# ------------------------------------------------------------------------ every command, bad input files
BINARY = b"\xff\xfe\x00binary\xdf\x00\x89PNG"
CSV_TEXT = b"run_id,arm,seed\nmask0-synth-tiny-s0-1234abcd,mask0,0\n"  # text, but no config, manifest, arm or tar
KINDS = {"not_its_input": CSV_TEXT, "empty": b"", "binary": BINARY}  # and "incomplete", each command's own


def write(path: Path, content: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def run_dir_case(command: list[str], incomplete: str):
    """A run directory holding only its config.yaml: a real one (a run killed while being created), or a
    file that is not a config."""
    def case(tmp_path: Path, kind: str) -> tuple[list[str], str]:
        config = yaml.safe_dump(to_dict(load_config(paths(tmp_path)))).encode() if kind == "incomplete" else KINDS[kind]
        run = write(tmp_path / "run" / "config.yaml", config).parent
        return [*command, str(run)], incomplete if kind == "incomplete" else "config.yaml"
    return case


def leaderboard_case(tmp_path: Path, kind: str) -> tuple[list[str], str]:
    from maskbench.results.rows import COLUMNS
    content = {"incomplete": ",".join(COLUMNS).encode() + b"\n", "not_its_input": b"arm: mask0\nseed: 0\n"}
    board = write(tmp_path / "board.csv", content.get(kind, KINDS.get(kind)))
    return ["leaderboard", str(board)], {"incomplete": "no leaderboard rows", "not_its_input": "not a leaderboard CSV",
                                         "empty": "no leaderboard rows", "binary": "not a text CSV"}[kind]


def sweep_case(tmp_path: Path, kind: str) -> tuple[list[str], str]:
    study = write(tmp_path / "study.yaml", b"description: no grid yet\n" if kind == "incomplete" else KINDS[kind])
    return ["sweep", f"study={study}", *paths(tmp_path), "--dry-run"], \
        "is not valid YAML" if kind == "binary" else "needs `grid:`"


def synth_case(tmp_path: Path, kind: str) -> tuple[list[str], str]:
    argv = ["data", "synth", *paths(tmp_path), "data.n_train=8", "data.n_val=8"]
    if kind == "not_its_input":  # a file where the datasets' folder goes
        return [*argv, f"paths.data={write(tmp_path / 'datasets', CSV_TEXT)}"], "is not a folder"
    arm = write(tmp_path / "arm.yaml", b"name: half\n" if kind == "incomplete" else KINDS[kind])
    return [*argv, f"arm={arm}"], "is not valid YAML" if kind == "binary" else "has no `phases` list"


def pack_case(tmp_path: Path, kind: str) -> tuple[list[str], str]:
    if kind == "incomplete":  # a download that has not started: no archive yet
        write(tmp_path / "raw" / "README.txt", b"BrushData shards go here\n")
    else:
        write(tmp_path / "raw" / "00000.tar", KINDS[kind])
    return (["data", "pack", "brushdata", str(tmp_path / "raw"), "--out", str(tmp_path / "canon"), "--no-progress"],
            "no *.tar inputs" if kind == "incomplete" else "opens as a tar archive")


def shards_dir(tmp_path: Path, kind: str) -> Path:
    """Shards whose manifest.json is missing (a pack killed before its last step) or is not a manifest."""
    write(tmp_path / "shards" / "shard-000000.tar", b"")
    if kind != "incomplete":
        write(tmp_path / "shards" / "manifest.json", KINDS[kind])
    return tmp_path / "shards"


def verify_case(tmp_path: Path, kind: str) -> tuple[list[str], str]:
    return (["data", "verify", str(shards_dir(tmp_path, kind))],
            "no shard manifest" if kind == "incomplete" else "is not a maskbench-shards-v1 manifest")


def encode_case(tmp_path: Path, kind: str) -> tuple[list[str], str]:
    from maskbench.data.shards import build_manifest
    argv = ["--vae", str(tmp_path / "vae"), "--text-weights", str(tmp_path / "clip.bin"), "--no-progress"]
    if kind == "not_its_input":  # latent shards: encoded already
        latent = write(tmp_path / "latent" / "manifest.json", json.dumps(build_manifest(
            {"source": "sa1b", "packer_version": 1, "filters": {}, "latent": {"size": 32}}, [], {})).encode()).parent
        return ["data", "encode", str(latent), str(tmp_path / "out"), *argv], "holds latent shards already"
    return (["data", "encode", str(shards_dir(tmp_path, kind)), str(tmp_path / "out"), *argv],
            "no shard manifest" if kind == "incomplete" else "is not a maskbench-shards-v1 manifest")


def bench_case(tmp_path: Path, kind: str) -> tuple[list[str], str]:
    write(tmp_path / "cache" / "gemm_peak.json", b"[1, 2]" if kind == "not_its_input" else KINDS[kind])
    return ["bench", "peak", "--device", "cpu"], "is not a GEMM peak cache"


def weights_case(tmp_path: Path, kind: str) -> tuple[list[str], str]:
    return ["weights", "check", str(write(tmp_path / "weights", KINDS[kind]))], "is not a folder"


ALL = ("incomplete", *KINDS)
COMMANDS = {  # command: (the kinds of bad input it reads, the case builder)
    "eval": (ALL, run_dir_case(["eval"], "has no env.json")),
    "repro": (ALL, run_dir_case(["repro"], "has no eval-point checkpoint")),
    "probe": (ALL, run_dir_case(["probe", "gradfid"], "has no checkpoint yet")),
    "leaderboard": (ALL, leaderboard_case),
    "sweep": (ALL, sweep_case),
    "data synth": (ALL, synth_case),
    "data pack": (ALL, pack_case),
    "data verify": (ALL, verify_case),
    "data encode": (ALL, encode_case),
    "bench": (tuple(KINDS), bench_case),     # its input is its cache of measured peaks
    "weights": (tuple(KINDS), weights_case),  # a folder missing files is `check`'s report, not bad input
}


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under root, with a file's bytes: what a refusal must leave as it was."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize(("command", "kind"), [(c, k) for c, (kinds, _) in COMMANDS.items() for k in kinds],
                         ids=lambda value: value.replace(" ", "-"))
def test_every_command_refuses_a_bad_input_in_one_line_writing_nothing(
        command: str, kind: str, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """An incomplete run directory or shard folder, a file that is not what the command reads, an empty and a
    binary file: one line on stderr, exit 2, no file written (here or under ./), no input changed."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MASKBENCH_CACHE", str(tmp_path / "cache"))
    argv, message = COMMANDS[command][1](tmp_path, kind)
    before = tree(tmp_path)
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert tree(tmp_path) == before
