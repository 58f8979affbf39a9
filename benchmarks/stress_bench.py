"""Does stress-gpu report the TFLOPS the device gives? A plain torch.matmul loop and stress-gpu, side by side,
and stress-gpu with one process per GPU against one thread per GPU.

    .venv/bin/python benchmarks/stress_bench.py --seconds 20      # cuda:0 (bf16 8192²), or the CPU (fp32 512²)
    .venv/bin/python benchmarks/stress_bench.py --seconds 20 --all-gpus    # also every GPU: processes vs threads

Both time the same n×n matmul in windows of the same length and report the median window; stress-gpu also
checks every result and pattern-tests memory between windows, which must cost it no TFLOPS. With --all-gpus,
stress-gpu runs on every visible GPU twice, in processes (its default) and in threads sharing one GIL: if the
threads' median TFLOPS fall measurably below the processes', the GIL slows the launches.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from smolctl.console import show, table
from smolctl.infra.stress import StressConfig, run_stress


def plain_loop(device: torch.device, dtype: torch.dtype, n: int, seconds: float, window: float) -> list[float]:
    """TFLOPS per window of a bare matmul loop: what the device reaches with no checks at all."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        torch.matmul(a, b, out=out)
    sync()
    samples, deadline, iters = [], time.perf_counter() + seconds, 1
    while time.perf_counter() < deadline:
        began = time.perf_counter()
        for _ in range(iters):
            torch.matmul(a, b, out=out)
        sync()
        elapsed = time.perf_counter() - began
        samples.append(iters * 2 * n**3 / elapsed / 1e12)
        iters = max(1, min(4 * iters, int(window / (elapsed / iters))))
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--all-gpus", action="store_true", help="also compare processes and threads on every GPU")
    args = parser.parse_args()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    dtype_name, n = ("bf16", 8192) if on_gpu else ("fp32", 512)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    window = min(2.0, max(0.25, args.seconds / 30))
    # in a thread, as stress-gpu drives each device: on a CPU, OpenMP runs a thread's matmuls differently from
    # the main thread's (on a busy 2-core machine up to 4× slower there), which would skew the ratio
    plain: list[float] = []
    worker = threading.Thread(target=lambda: plain.extend(plain_loop(device, dtype, n, args.seconds, window)))
    worker.start()
    worker.join()
    config = StressConfig(
        duration_s=args.seconds,
        devices=(str(device),),
        dtype=dtype_name,
        size=n,
        memory_fraction=0.9,
        tolerance=0.1,
        sample_s=window,
        launch="process" if on_gpu else "thread",
    )
    [report] = run_stress(config)
    name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
    baseline = statistics.median(plain)
    rows = [
        ("plain torch.matmul loop", f"{baseline:.4g}", f"{min(plain):.4g}", len(plain), "1.00", "-"),
        (
            "smolctl stress-gpu",
            f"{report.tflops_median:.4g}",
            f"{report.tflops_min:.4g}",
            len(report.tflops),
            f"{report.tflops_median / baseline:.2f}",
            f"{report.verdict} ({report.mismatches} mismatches)",
        ),
    ]
    show(
        table(
            f"{name}: {dtype_name} {n}² matmuls, {args.seconds:g}s each",
            ["run", "TFLOPS median", "TFLOPS min", "windows", "ratio", "result"],
            rows,
        )
    )
    if args.all_gpus and on_gpu:
        compare_launches(args.seconds, window, n, dtype_name)


def compare_launches(seconds: float, window: float, n: int, dtype_name: str) -> None:
    """Every GPU at once, in processes and then in threads: the median over devices of each device's median."""
    devices = tuple(f"cuda:{i}" for i in range(torch.cuda.device_count()))
    rows, medians = [], {}
    for launch in ("process", "thread"):
        config = StressConfig(
            duration_s=seconds,
            devices=devices,
            dtype=dtype_name,
            size=n,
            memory_fraction=0.5,
            tolerance=0.1,
            sample_s=window,
            launch=launch,
        )
        reports = run_stress(config)
        medians[launch] = statistics.median(r.tflops_median or 0.0 for r in reports)
        rows.append(
            (
                launch,
                len(devices),
                f"{medians[launch]:.4g}",
                f"{min(r.tflops_median or 0.0 for r in reports):.4g}",
                f"{medians[launch] / medians['process']:.3f}",
                " ".join(r.verdict for r in reports),
            )
        )
    show(
        table(
            f"stress-gpu on {len(devices)} GPU(s): one process vs one thread per GPU",
            ["launch", "GPUs", "TFLOPS median of medians", "slowest device", "ratio to processes", "verdicts"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
