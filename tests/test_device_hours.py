"""Honest device-hours: `gpu_hours` is the training steps' time alone; waiting for data, compiling,
evaluating, checkpointing and resuming each have their own column."""

from __future__ import annotations

import contextlib
import functools
import io
import types

import pytest
import torch

import maskbench.runs.record as record
import maskbench.train.loop as loop
import maskbench.train.streams as streams
from maskbench.config import load_config
from maskbench.results.rows import read_rows
from maskbench.runs.launch import train
from tests.conftest import SMALL_EVAL, fresh_dynamo, tiny_overrides

DELAY = 1000.0  # fake seconds each batch takes to load
TICK = 1e-6      # fake seconds between two readings of the clock: every interval is positive, none depends on the machine


class SlowClock:
    """The trainer's clock, entirely fake: TICK per reading, plus DELAY for every batch the loader decodes (decoding
    runs in-process). No reading depends on how fast this machine is, so the columns below are exact."""

    def __init__(self) -> None:
        self.offset = 0.0

    def perf_counter(self) -> float:
        self.offset += TICK
        return self.offset

    monotonic = perf_counter


@pytest.fixture(scope="module")
def instrumented(tmp_path_factory, synth_root) -> tuple[dict, str]:
    """One compiled two-phase run (mask75_then0) whose loader is slow (on the fake clock), under a stand-in peak of
    1 FLOP/s: its row and its stderr. Each test below reads the part its column or warning is about."""
    tmp_path = tmp_path_factory.mktemp("device_hours")
    clock, batch, real_decoder = SlowClock(), 8, streams.loader_decoder

    def slow_decoder(data, model_cfg):
        decode = real_decoder(data, model_cfg)

        def slow(sample: dict) -> dict:
            clock.offset += DELAY / batch
            return decode(sample)
        return slow

    err = io.StringIO()
    # fresh_dynamo: a graph an earlier test in this worker compiled would be reused, and nothing would compile here
    with pytest.MonkeyPatch.context() as monkeypatch, contextlib.redirect_stderr(err), fresh_dynamo():
        monkeypatch.setattr(streams, "loader_decoder", slow_decoder)
        monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=clock.perf_counter,
                                                                monotonic=clock.monotonic))
        monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
        monkeypatch.setattr(record, "device_peak", lambda device, precision: (1.0, "measured:stand-in"))
        train(load_config(tiny_overrides(tmp_path, synth_root, "arm=mask75_then0", "eval.points=[1.0]",
                                         f"train.batch_size={batch}", "data.shuffle_buffer=8", "train.compile=true",
                                         "data.num_workers=0", *SMALL_EVAL)))  # decoded here, where the fake clock runs
    (row,) = read_rows([tmp_path / "leaderboard.csv"])
    return row, err.getvalue()


def test_a_slow_loader_shows_in_data_wait_and_not_in_gpu_hours(instrumented):
    row, _ = instrumented
    assert row["data_wait_s"] >= DELAY * row["step"]
    assert row["gpu_hours"] * 3600 < DELAY / 8  # the steps' own time: not one sample's loading in it


def test_compilation_has_its_own_column(instrumented):
    """The first step of each compiled graph (one per phase: mask75_then0's two) counts as compilation, not
    training."""
    row, _ = instrumented
    assert row["compile_s"] > 0 and row["gpu_hours"] > 0
    assert row["checkpoint_s"] > 0  # the final point's checkpoint was written before its row


def test_an_mfu_above_one_warns_that_the_peak_is_too_low(instrumented):
    """A peak measured while the machine was busy understates it; the run says so instead of printing a
    utilisation above 100% as if it were one."""
    _, err = instrumented
    assert "bench peak --remeasure" in err
