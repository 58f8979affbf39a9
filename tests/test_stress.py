"""stress-gpu on the CPU: the same code path a GPU runs, with faults injected into the real decision logic."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from smolctl.cli import main
from smolctl.errors import UserError
from smolctl.infra import stress
from smolctl.infra.stress import (DeviceReport, DeviceStress, PatternTest, StressConfig, build_config, judge,
                                  parse_duration, run_stress)


def small_config(devices=("cpu",), duration=1.0) -> StressConfig:
    return StressConfig(duration_s=duration, devices=devices, dtype="fp32", size=64, memory_fraction=0.5,
                        tolerance=0.10, sample_s=0.2)


@pytest.mark.parametrize("text, seconds", [("60", 60), ("30s", 30), ("5m", 300), ("1h", 3600), ("1.5m", 90),
                                           (" 2 min", 120)])
def test_durations_read_like_people_write_them(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["abc", "0", "-5", "5d", "", "1m30"])
def test_unreadable_durations_are_user_errors(text):
    with pytest.raises(UserError, match="--duration"):
        parse_duration(text)


@pytest.mark.parametrize("flags, flag", [
    ({"memory_fraction": 0.0}, "--memory-fraction"), ({"memory_fraction": 1.0}, "--memory-fraction"),
    ({"memory_fraction": 1.5}, "--memory-fraction"), ({"dtype": "fp8"}, "--dtype"), ({"devices": "7"}, "--devices"),
    ({"tolerance": 1.0}, "--tolerance"), ({"size": 8}, "--size"),
])
def test_bad_flags_name_the_flag(flags, flag):
    arguments = {"duration": "1s", "dtype": None, "size": None, "memory_fraction": 0.9, "tolerance": 0.1,
                 "devices": "cpu", **flags}
    with pytest.raises(UserError, match=flag):
        build_config(**arguments)


def test_cpu_defaults_are_float32_and_small():
    config = build_config(duration="30s", dtype=None, size=None, memory_fraction=0.9, tolerance=0.1, devices="cpu")
    assert (config.devices, config.dtype, config.size, config.duration_s) == (("cpu",), "fp32", 512, 30.0)


def test_judge_fails_errors_and_devices_slower_than_tolerance():
    def report(device, tflops, **faults):
        return DeviceReport(device, tflops=tflops, **faults)

    reports = judge([report("cuda:0", [100.0, 101.0, 99.0]),   # the best, median 100
                     report("cuda:1", [91.0, 92.0, 90.0]),     # 9% slower: within 10%
                     report("cuda:2", [88.0, 89.0, 60.0]),     # 12% slower
                     report("cuda:3", [100.0], mismatches=1),
                     report("cuda:4", [100.0], memory_errors=3),
                     report("cuda:5", [], error="RuntimeError: CUDA error: an illegal memory access")], 0.10)
    assert [r.verdict for r in reports] == ["OK", "OK", "FAULTY", "FAULTY", "FAULTY", "FAULTY"]
    assert "12% slower than the best device (cuda:0)" in reports[2].reasons[0]
    assert reports[3].reasons == ["1 mismatching result element(s)"]
    assert reports[5].reasons[-1] == "no matmul finished"


def test_pattern_test_counts_flipped_words():
    pattern = PatternTest(torch, torch.device("cpu"), 3 * stress.PATTERN_CHUNK // 2 * 4)  # crosses a chunk edge
    assert pattern.run(stress.PATTERN_SEEDS[0]) == 0
    pattern.write(stress.PATTERN_SEEDS[1])
    pattern.buffer[7] ^= 1 << 13  # one stuck bit
    pattern.buffer[stress.PATTERN_CHUNK + 5] = pattern.buffer[5]  # an address fault: a word from another chunk
    assert pattern.verify(stress.PATTERN_SEEDS[1]) == 2


def test_healthy_cpu_run_is_ok():
    [report] = run_stress(small_config())
    assert report.verdict == "OK", report.reasons
    assert report.mismatches == 0 and report.memory_errors == 0 and report.error is None
    assert report.matmuls >= len(report.tflops) >= 2 and report.tflops_min > 0
    assert report.pattern_passes >= 2 and report.memory_tested_bytes >= 2 * 8 * 2**20


def test_corrupted_results_are_caught(monkeypatch):
    original = DeviceStress.multiply
    calls = []

    def flaky(self):
        original(self)
        calls.append(1)
        if len(calls) == 3:  # the first call makes the reference; later ones must all match it
            self.out[5, 7] += 1.0
        if len(calls) == 5:
            self.out[0, 0] = math.nan

    monkeypatch.setattr(DeviceStress, "multiply", flaky)
    [report] = run_stress(small_config())
    assert report.mismatches == 2
    assert report.verdict == "FAULTY" and "2 mismatching result element(s)" in report.reasons


def test_a_wrong_reference_fails_the_float64_check(monkeypatch):
    original = DeviceStress.multiply

    def wrong_from_the_start(self):
        original(self)
        self.out[3, 3] *= 2

    monkeypatch.setattr(DeviceStress, "multiply", wrong_from_the_start)
    [report] = run_stress(small_config(duration=0.3))
    assert report.mismatches == 1 and report.verdict == "FAULTY"


def test_a_slowed_device_fails_against_the_best(monkeypatch):
    original = DeviceStress.multiply

    def slow_second_device(self):
        original(self)
        if self.index == 1:
            time.sleep(0.01)

    monkeypatch.setattr(DeviceStress, "multiply", slow_second_device)
    fast, slow = run_stress(small_config(devices=("cpu", "cpu")))
    assert fast.verdict == "OK", fast.reasons
    assert slow.verdict == "FAULTY" and "slower than the best device" in slow.reasons[0]
    assert slow.mismatches == 0


def run_cli(capsys, *args) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_cli_json_and_exit_codes(capsys, monkeypatch):
    code, out, _ = run_cli(capsys, "stress-gpu", "--duration", "1s", "--size", "64", "--json")
    result = json.loads(out)
    assert code == 0 and result["devices"][0]["verdict"] == "OK" and result["config"]["dtype"] == "fp32"

    monkeypatch.setattr(DeviceStress, "multiply", lambda self: self.out.copy_(torch.randn_like(self.out)))
    code, _, err = run_cli(capsys, "stress-gpu", "--duration", "0.5s", "--size", "64")
    assert code == 1 and "FAULTY" in err

    code, out, err = run_cli(capsys, "stress-gpu", "--memory-fraction", "1")
    assert code == 2 and out == "" and "error: --memory-fraction: 1.0 is outside (0, 1)" in err
