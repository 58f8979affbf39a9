"""stress-gpu on the CPU: the same code path a GPU runs, with faults injected into the real decision logic."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from smolctl.cli import main
from smolctl.errors import CheckFailed, UserError
from smolctl.infra import stress, telemetry
from smolctl.infra.stress import (
    DeviceReport,
    DeviceStress,
    PatternTest,
    StressConfig,
    build_config,
    judge,
    parse_duration,
    run_stress,
)
from smolctl.infra.telemetry import NvmlTelemetry, health_findings, open_telemetry


def small_config(devices=("cpu",), duration=1.0) -> StressConfig:
    return StressConfig(
        duration_s=duration, devices=devices, dtype="fp32", size=64, memory_fraction=0.5, tolerance=0.10, sample_s=0.2
    )


@pytest.mark.parametrize(
    "text, seconds", [("60", 60), ("30s", 30), ("5m", 300), ("1h", 3600), ("1.5m", 90), (" 2 min", 120)]
)
def test_durations_read_like_people_write_them(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["abc", "0", "-5", "5d", "", "1m30"])
def test_unreadable_durations_are_user_errors(text):
    with pytest.raises(UserError, match="--duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    "flags, flag",
    [
        ({"memory_fraction": 0.0}, "--memory-fraction"),
        ({"memory_fraction": 1.0}, "--memory-fraction"),
        ({"memory_fraction": 1.5}, "--memory-fraction"),
        ({"dtype": "fp8"}, "--dtype"),
        ({"devices": "7"}, "--devices"),
        ({"tolerance": 1.0}, "--tolerance"),
        ({"size": 8}, "--size"),
        ({"expect_tflops": 0.0}, "--expect-tflops"),
        ({"expect_gpus": 0}, "--expect-gpus"),
        ({"launch": "mpi"}, "--launch"),
    ],
)
def test_bad_flags_name_the_flag(flags, flag):
    arguments = {
        "duration": "1s",
        "dtype": None,
        "size": None,
        "memory_fraction": 0.9,
        "tolerance": 0.1,
        "devices": "cpu",
        **flags,
    }
    with pytest.raises(UserError, match=flag):
        build_config(**arguments)


def test_cpu_defaults_are_float32_and_small():
    config = build_config(duration="30s", dtype=None, size=None, memory_fraction=0.9, tolerance=0.1, devices="cpu")
    assert (config.devices, config.dtype, config.size, config.duration_s) == (("cpu",), "fp32", 512, 30.0)


def test_judge_fails_errors_and_devices_slower_than_tolerance():
    def report(device, tflops, **faults):
        return DeviceReport(device, tflops=tflops, **faults)

    reports = judge(
        [
            report("cuda:0", [100.0, 101.0, 99.0]),  # the best, median 100
            report("cuda:1", [91.0, 92.0, 90.0]),  # 9% slower: within 10%
            report("cuda:2", [88.0, 89.0, 60.0]),  # 12% slower
            report("cuda:3", [100.0], mismatches=1),
            report("cuda:4", [100.0], memory_errors=3),
            report("cuda:5", [], error="RuntimeError: CUDA error: an illegal memory access"),
        ],
        0.10,
    )
    assert [r.verdict for r in reports] == ["OK", "OK", "FAULTY", "FAULTY", "FAULTY", "FAULTY"]
    assert "12% slower than the best device (cuda:0)" in reports[2].reasons[0]
    assert reports[3].reasons == ["1 mismatching result element(s)"]
    assert reports[5].reasons[-1] == "no matmul finished"


def test_a_node_of_equally_slow_devices_fails_an_absolute_floor():
    reports = judge([DeviceReport(f"cuda:{i}", tflops=[400.0, 401.0]) for i in range(2)], 0.10, expect_tflops=600)
    assert [r.verdict for r in reports] == ["FAULTY", "FAULTY"]
    assert reports[0].reasons == ["median 400.5 TFLOPS < --expect-tflops 600"]
    assert judge([DeviceReport("cuda:0", tflops=[650.0])], 0.10, expect_tflops=600)[0].verdict == "OK"


def hashed(device: str, digest: str, name: str = "NVIDIA H100 80GB HBM3") -> DeviceReport:
    return DeviceReport(device, name=name, tflops=[700.0], result_hash=digest)


def test_a_product_that_differs_from_the_other_devices_is_faulty():
    reports = judge(
        [hashed("cuda:0", "aa"), hashed("cuda:1", "aa"), hashed("cuda:2", "bb"), hashed("cuda:3", "aa")], 0.10
    )
    assert [r.verdict for r in reports] == ["OK", "OK", "FAULTY", "OK"]
    assert reports[2].reasons == [
        "product differs bit-wise from 3 of the 4 NVIDIA H100 80GB HBM3 devices (same inputs, same kernel)"
    ]
    # two devices that disagree: no way to tell which one is right, so neither passes
    pair = judge([hashed("cuda:0", "aa"), hashed("cuda:1", "bb")], 0.10)
    assert [r.verdict for r in pair] == ["FAULTY", "FAULTY"] and "no majority" in pair[0].reasons[0]
    # different GPU models may use different kernels: they are not compared with each other
    mixed = judge([hashed("cuda:0", "aa"), hashed("cuda:1", "bb", name="NVIDIA A100-SXM4-80GB")], 0.10)
    assert [r.verdict for r in mixed] == ["OK", "OK"]


class StubNvml:
    """The parts of pynvml that NvmlTelemetry calls, with a planted state per GPU."""

    class Timeout(Exception):
        pass

    def __init__(self, *, reasons=0, remap=(0, 0, 0, 0), ecc=(0, 0), xids=(), link=((5, 16), (5, 16)), xid_ok=True):
        self.reasons, self.remap, self.ecc, self.link = reasons, remap, list(ecc), link
        self.pending, self.xid_ok = list(xids), xid_ok

    def nvmlInit(self):
        pass

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return 71

    def nvmlDeviceGetPowerUsage(self, handle):
        return 690_000

    def nvmlDeviceGetClockInfo(self, handle, clock):
        return 1980

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return self.reasons

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle):
        return self.link[0][0]

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle):
        return self.link[0][1]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle):
        return self.link[1][0]

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle):
        return self.link[1][1]

    def nvmlDeviceGetTotalEccErrors(self, handle, error_type, counter):
        assert (error_type, counter) == (1, 0)  # uncorrected, volatile
        return self.ecc.pop(0)

    def nvmlDeviceGetRemappedRows(self, handle):
        return self.remap

    def nvmlEventSetCreate(self):
        return "events"

    def nvmlDeviceRegisterEvents(self, handle, types, events):
        if not self.xid_ok:
            raise RuntimeError("Not Supported")

    def nvmlEventSetWait(self, events, timeout_ms):
        if not self.pending:
            raise self.Timeout()
        return type("Event", (), {"eventType": 0x8, "eventData": self.pending.pop(0)})()

    def nvmlEventSetFree(self, events):
        pass


def telemetry_of(nvml: StubNvml) -> dict:
    probe = NvmlTelemetry(nvml, handle="gpu0")
    for _ in range(3):
        probe.sample()
    return probe.close()


@pytest.mark.parametrize(
    "planted, fault",
    [
        (dict(reasons=0x8), "throttled by hw_slowdown"),
        (dict(reasons=0x40 | 0x4), "throttled by hw_thermal"),
        (dict(reasons=0x80), "throttled by hw_power_brake"),
        (dict(remap=(0, 2, 1, 0)), "row remapping pending (reset the GPU to apply it before using the node)"),
        (dict(remap=(0, 2, 0, 1)), "row remapping failed"),
        (dict(ecc=(3, 5)), "2 new uncorrectable ECC error(s)"),
        (dict(xids=(79, 48, 79)), "Xid error(s) during the run: 48, 79"),
        (dict(link=((4, 16), (5, 16))), "PCIe link gen4 x16, below its maximum gen5 x16"),
        (dict(link=((5, 8), (5, 16))), "PCIe link gen5 x8, below its maximum gen5 x16"),
    ],
)
def test_nvml_findings_fail_the_device(planted, fault):
    seen = telemetry_of(StubNvml(**planted))
    faults, _ = health_findings(seen)
    assert faults == [fault]
    [report] = judge([DeviceReport("cuda:0", tflops=[700.0], telemetry=seen)], 0.10)
    assert report.verdict == "FAULTY" and report.reasons == [fault]


def test_power_capping_and_missing_counters_only_warn():
    seen = telemetry_of(StubNvml(reasons=0x4, xid_ok=False))
    [report] = judge([DeviceReport("cuda:0", tflops=[700.0], telemetry=seen)], 0.10)
    assert report.verdict == "OK" and report.reasons == []
    assert report.warnings == ["held at its power limit (sw_power_cap)", "Xid events not available from NVML here"]
    healthy = telemetry_of(StubNvml())
    assert health_findings(healthy) == ([], []) and healthy["max_temp_c"] == 71 and healthy["xid"] == []


def test_a_gpu_without_nvml_says_its_telemetry_is_missing():
    class Broken:
        def nvmlInit(self):
            raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    seen = open_telemetry(torch.device("cuda", 0), nvml=Broken()).close()
    [report] = judge([DeviceReport("cuda:0", tflops=[700.0], telemetry=seen)], 0.10)
    assert "libnvidia-ml.so.1" in report.warnings[0] and "were not checked" in report.warnings[0]
    assert open_telemetry(torch.device("cpu")).close() == {}


def test_fewer_gpus_than_expected_fail_the_node(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 7)
    with pytest.raises(CheckFailed, match=r"torch sees 7 GPU\(s\), 8 expected \(--expect-gpus\)"):
        build_config(
            duration="1s", dtype=None, size=None, memory_fraction=0.9, tolerance=0.1, devices="all", expect_gpus=8
        )
    monkeypatch.setattr(telemetry, "_nvidia_smi_listing", lambda: (0, "\n".join(f"GPU {i}: H100" for i in range(8))))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(CheckFailed, match=r"8 expected \(nvidia-smi"):
        build_config(duration="1s", dtype=None, size=None, memory_fraction=0.9, tolerance=0.1, devices="all")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6")  # a job given 7 of the node's GPUs
    assert (
        len(
            build_config(
                duration="1s", dtype=None, size=None, memory_fraction=0.9, tolerance=0.1, devices="all"
            ).devices
        )
        == 7
    )


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
        if len(calls) == 3:  # the first call makes the reference; later ones must all match it bit for bit
            self.out[5, 7] = torch.nextafter(self.out[5, 7], torch.tensor(math.inf))  # one unit in the last place
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
    assert slow.mismatches == 0 and slow.result_hash == fast.result_hash


@pytest.mark.slow
def test_one_process_per_device_reports_back_to_the_parent():
    config = StressConfig(
        duration_s=1.0,
        devices=("cpu", "cpu"),
        dtype="fp32",
        size=64,
        memory_fraction=0.5,
        tolerance=0.99,
        sample_s=0.2,
        launch="process",
    )
    ticks = []
    first, second = run_stress(config, on_tick=lambda elapsed, reports: ticks.append(sum(r.matmuls for r in reports)))
    for report in (first, second):
        assert report.error is None and report.mismatches == 0 and report.matmuls > 0 and report.pattern_passes >= 2
    assert first.result_hash == second.result_hash
    # two processes on a shared 2-core machine start and burn at different times, so only speed may differ
    assert all("slower than the best device" in reason for reason in first.reasons + second.reasons)
    assert ticks[-1] == first.matmuls + second.matmuls and any(0 < t < ticks[-1] for t in ticks)  # progress seen


def run_cli(capsys, *args) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_no_visible_gpu_fails_unless_the_cpu_is_asked_for(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(
        telemetry,
        "_nvidia_smi_listing",
        lambda: (9, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."),
    )
    code, out, err = run_cli(capsys, "stress-gpu", "--duration", "1s")
    assert code == 1 and out == "" and "torch sees no GPU" in err and "--devices cpu" in err
    assert "nvidia-smi fails: NVIDIA-SMI has failed because it couldn't communicate" in " ".join(err.split())
    # --json still prints the node's verdict, as `srun ... stress-gpu --json` collects one line per node
    code, out, err = run_cli(capsys, "stress-gpu", "--duration", "1s", "--json")
    found = json.loads(out)
    assert code == 1 and found["verdict"] == "FAULTY" and found["devices"] == []
    assert "torch sees no GPU" in found["reasons"][0]
    code, out, err = run_cli(capsys, "stress-gpu", "--devices", "cpu", "--expect-gpus", "8")
    assert code == 2 and "--expect-gpus: counts GPUs, and --devices cpu runs on none" in err


def test_cli_json_and_exit_codes(capsys, monkeypatch):
    code, out, _ = run_cli(capsys, "stress-gpu", "--duration", "1s", "--size", "64", "--devices", "cpu", "--json")
    result = json.loads(out)
    assert (
        code == 0
        and result["verdict"] == result["devices"][0]["verdict"] == "OK"
        and result["config"]["dtype"] == "fp32"
    )
    assert len(result["devices"][0]["result_hash"]) == 64

    monkeypatch.setattr(DeviceStress, "multiply", lambda self: self.out.copy_(torch.randn_like(self.out)))
    code, _, err = run_cli(capsys, "stress-gpu", "--duration", "0.5s", "--size", "64", "--devices", "cpu")
    assert code == 1 and "FAULTY" in err

    code, out, err = run_cli(capsys, "stress-gpu", "--memory-fraction", "1")
    assert code == 2 and out == "" and "error: --memory-fraction: 1.0 is outside (0, 1)" in err
