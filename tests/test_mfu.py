"""MFU: the formula, the spec-sheet table, and the measured GEMM peak that stands in for it on CPU."""

from __future__ import annotations

import json
import math

import pytest
import torch

import maskbench.train.mfu as mfu_module
from maskbench.train.mfu import (
    bench_peak_main,
    cached_gemm_peak,
    device_peak,
    matmul_precision,
    measure_gemm_peak,
    mfu,
    table_peak,
)


def test_mfu_is_model_flops_over_device_seconds_times_peak():
    # 8 H100s at 989 TFLOP/s for an hour reach 2.848e19 FLOPs at 100%; half of that is 50%.
    assert mfu(0.5 * 8 * 3600 * 989e12, 3600.0, 8, 989e12) == pytest.approx(0.5)
    assert mfu(1e12, 2.0, 1, 1e12) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="seconds > 0"):
        mfu(1e12, 0.0, 1, 1e12)


def test_table_matches_device_names_variant_first():
    assert table_peak("NVIDIA H100 80GB HBM3", "bf16") == 989e12          # SXM
    assert table_peak("NVIDIA H100 PCIe", "bf16") == 756e12
    assert table_peak("NVIDIA H200", "bf16") == 989e12
    assert table_peak("NVIDIA A100-SXM4-80GB", "bf16") == 312e12
    assert table_peak("NVIDIA A100-SXM4-80GB", "tf32") == 156e12
    assert table_peak("Tesla V100-SXM2-16GB", "bf16") is None             # no bf16 tensor cores
    assert table_peak("NVIDIA GeForce GT 710", "fp32") is None
    with pytest.raises(ValueError, match="precision must be one of"):
        table_peak("NVIDIA H100", "int8")


def test_precision_follows_autocast_then_tf32():
    cpu = torch.device("cpu")
    assert matmul_precision("bf16", cpu) == "bf16"
    assert matmul_precision("no", cpu) == "fp32"


def test_cpu_peak_is_measured_once_per_process(capsys):
    peak = measure_gemm_peak("cpu", "fp32", n=256, reps=3)
    assert math.isfinite(peak) and peak > 0         # its size is a benchmark figure (benchmarks/step_time.py)
    assert measure_gemm_peak("cpu", "fp32", n=256, reps=3) == peak  # cached, not re-measured
    figure, source = device_peak(torch.device("cpu"), "fp32")
    assert figure > 0 and source.startswith("measured:")
    assert bench_peak_main(["--device", "cpu", "--precision", "fp32"]) == 0
    assert "measured GEMM peak" in capsys.readouterr().out


def test_the_machine_peak_is_measured_once_and_then_read_from_its_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MASKBENCH_CACHE", str(tmp_path))
    first = cached_gemm_peak(torch.device("cpu"), "fp32")
    [entry] = json.loads((tmp_path / "gemm_peak.json").read_text()).values()
    assert entry["flops"] == first == max(entry["rounds"]) and entry["n"] == 2048

    def no_second_measurement(*args, **kwargs):
        raise AssertionError("measured again")
    monkeypatch.setattr(mfu_module, "measure_gemm_peak", no_second_measurement)
    assert cached_gemm_peak(torch.device("cpu"), "fp32") == first
    assert device_peak(torch.device("cpu"), "fp32") == (first, f"measured:{tmp_path / 'gemm_peak.json'}")


def test_remeasure_replaces_a_cached_peak_and_records_the_load(tmp_path, monkeypatch):
    monkeypatch.setenv("MASKBENCH_CACHE", str(tmp_path))
    figures = iter([1e9, 2e9, 3e9, 7e9, 8e9, 9e9])

    class Measure:  # what cached_gemm_peak calls: measure_gemm_peak.__wrapped__(device, precision, n=, reps=)
        __wrapped__ = staticmethod(lambda *args, **kwargs: next(figures))
    monkeypatch.setattr(mfu_module, "measure_gemm_peak", Measure)
    assert cached_gemm_peak(torch.device("cpu"), "fp32") == 3e9
    assert cached_gemm_peak(torch.device("cpu"), "fp32") == 3e9                       # cached
    assert cached_gemm_peak(torch.device("cpu"), "fp32", remeasure=True) == 9e9       # measured again
    [entry] = json.loads((tmp_path / "gemm_peak.json").read_text()).values()
    assert entry["rounds"] == [7e9, 8e9, 9e9] and entry["load_avg_1min"] >= 0


def test_a_cpu_is_named_by_its_model_so_rows_of_two_cpu_models_do_not_pair(tmp_path, monkeypatch):
    """/proc/cpuinfo's model name (the same code and seed round differently on another CPU model), else what
    `platform` knows; the peak cache keys on it too."""
    import builtins
    import platform

    from maskbench.results.summary import condition_mismatch
    from maskbench.train.checkpoint import device_name

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9654 96-Core Processor\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: real_open(cpuinfo if path == "/proc/cpuinfo" else path,
                                                                           *a, **k))
    cpu = torch.device("cpu")
    assert device_name(cpu) == "cpu:AMD EPYC 9654 96-Core Processor"
    assert mfu_module._machine_key(cpu, "fp32").startswith("cpu:AMD EPYC 9654 96-Core Processor|fp32|")
    row = {"device": device_name(cpu), "precision": "fp32", "draw_scheme": "crn-v3", "params": 1}
    assert condition_mismatch(row, dict(row, device="cpu:Intel(R) Xeon(R) Platinum 8480+")) != []
    cpuinfo.unlink()  # unreadable: platform's name
    monkeypatch.setattr(platform, "processor", lambda: "x86_64")
    assert device_name(cpu) == "cpu:x86_64"
