"""Cluster validation: benchmark-nccl (collective bandwidth, as nccl-tests) and stress-gpu (checked matmuls and a
memory pattern test, as gpu-burn)."""

from __future__ import annotations

import typer

from smolctl.cli.app import app
from smolctl.cli.common import quiet_on_other_ranks
from smolctl.cli.options import JsonOpt
from smolctl.console import (
    emit_json,
    escape,
    human_bytes,
    key_values,
    progress,
    show,
    styled,
    table,
)
from smolctl.errors import CheckFailed, UserError
from smolctl.launcher import rank_from_env
from smolctl.units import NCCL_HELP


@app.command(
    "benchmark-nccl",
    epilog="""[bold]Examples[/]

  torchrun --nproc_per_node 8 -m smolctl benchmark-nccl --expect-busbw all_reduce=350,all_to_all=40

  torchrun --nproc_per_node 2 -m smolctl benchmark-nccl --max-bytes 1M --iters 5 --warmup 1    (CPU, gloo)

  torchrun --nproc_per_node 8 -m smolctl benchmark-nccl --ops all_reduce,all_to_all --min-bytes 1M --max-bytes 8G

  sbatch --nodes 4 recipes/slurm/benchmark-nccl.sbatch    (multi-node: intra vs inter-node, slowest host and link)
""",
)
def benchmark_nccl_command(
    ops: str = typer.Option(
        "all_reduce,all_gather,reduce_scatter,all_to_all,broadcast,send_recv",
        "--ops",
        help="Comma-separated ops (or 'all').",
    ),
    min_bytes: str = typer.Option("8", "--min-bytes", help=f"Smallest message ({NCCL_HELP})."),
    max_bytes: str | None = typer.Option(
        None, "--max-bytes", help="Largest message (default: 8G with NCCL, 64M with gloo; same units as --min-bytes)."
    ),
    factor: float = typer.Option(2.0, "--factor", help="Size multiplier between steps (nccl-tests -f)."),
    dtype: str | None = typer.Option(
        None, "--dtype", help="bf16, fp16, fp32, fp64 or int32 (default: bf16 with NCCL, fp32 with gloo)."
    ),
    iters: int = typer.Option(20, "--iters", help="Timed calls per size."),
    warmup: int = typer.Option(5, "--warmup", help="Untimed calls per size before timing."),
    backend: str = typer.Option(
        "auto", "--backend", help="auto (nccl when GPUs are visible, else gloo), nccl or gloo."
    ),
    expect_busbw: str | None = typer.Option(
        None,
        "--expect-busbw",
        help="GB/s the busbw at the largest size must reach, per op (all_reduce=350,all_to_all=40) or one number for all; exit 1 below it.",
    ),
    json_out: JsonOpt = False,
) -> None:
    """Collective bandwidth like nccl-tests (time, algbw, busbw, #wrong per size) for every op, under torchrun."""
    from smolctl.infra.collective_runner import run_benchmark
    from smolctl.infra.collectives import build_config, launch_environment

    rank = rank_from_env()
    try:
        config = build_config(
            ops=ops,
            min_bytes=min_bytes,
            max_bytes=max_bytes,
            factor=factor,
            dtype=dtype,
            iters=iters,
            warmup=warmup,
            backend=backend,
            expect_busbw=expect_busbw,
        )
        launch_environment()
        with progress(rank == 0 and not json_out) as bar:
            task = bar.add_task("benchmark-nccl", total=None, rate="")
            report = run_benchmark(
                config,
                on_plan=lambda total: bar.update(task, total=total),
                on_size=lambda op, size: bar.update(task, advance=1, rate=f"{op} {human_bytes(size)}"),
            )
    except UserError as exc:
        quiet_on_other_ranks(exc)
    if rank == 0:
        emit_json(report.to_dict()) if json_out else _render_nccl(report)
    if not report.passed:
        quiet_on_other_ranks(CheckFailed(_nccl_failure(report)))


def _nccl_failure(report) -> str:
    problems = [f"{report.wrong} wrong element(s)"] if report.wrong else []
    problems += [
        f"{r.op} busbw {r.peak.busbw:.2f} GB/s < {report.expect_busbw[r.op]:g}" if r.peak else f"{r.op}: no size ran"
        for r in report.below_expectation()
    ]
    return "benchmark-nccl: " + "; ".join(problems)


def _render_nccl(report) -> None:

    topo = report.topology
    facts = [
        ("world size", topo["world_size"]),
        ("nodes", topo["nodes"]),
        ("GPUs per node" if topo["backend"] == "nccl" else "ranks per node", topo["ranks_per_node"]),
        ("hosts", ", ".join(topo["hosts"][:4]) + (" …" if len(topo["hosts"]) > 4 else "")),
        ("device", topo["device"]),
        ("backend", topo["backend"]),
        ("torch", topo["torch"]),
        ("NCCL", topo["nccl"] or "-"),
        ("NCCL_* env", "\n".join(f"{k}={v}" for k, v in topo["nccl_env"].items()) or "(none set)"),
    ]
    if topo["env_mismatch"]:
        facts.append((styled("[red]differs across ranks[/]"), ", ".join(topo["env_mismatch"])))
    show(key_values("benchmark-nccl", facts))
    # nccl-tests' own layout, so that its users read it at once (and plain text never gets truncated)
    head = f"{'size':>12} {'count':>12} {'type':>9} {'redop':>6} {'root':>5} {'time':>10} {'algbw':>8} {'busbw':>8} {'#wrong':>7}"
    units = f"{'(B)':>12} {'(elements)':>12} {'':>9} {'':>6} {'':>5} {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8} {'':>7}"
    for result in report.results:
        placement = "in-place" if result.op in ("all_reduce", "broadcast") else "out-of-place"
        lines = [
            f"# {result.op}: {topo['world_size']} ranks, {topo['backend']}, {placement}",
            "#" + head[1:],
            "#" + units[1:],
        ]
        lines += [
            f"{r.size:>12} {r.count:>12} {r.type:>9} {r.redop:>6} {r.root:>5} {r.time_us:>10.2f} "
            f"{r.algbw:>8.2f} {r.busbw:>8.2f} {r.wrong:>7}"
            for r in result.rows
        ]
        lines.append(f"# {result.op} avg bus bandwidth: {result.avg_busbw:.3f} GB/s\n")
        show("\n".join(lines), soft_wrap=True)
    if report.multinode:
        _render_multinode(report.multinode, topo)
    show(f"# Out of bounds values : {report.wrong} {'OK' if not report.wrong else 'FAILED'}")
    show(f"# Avg bus bandwidth    : {report.avg_busbw:.3f} GB/s (all ops, all sizes)")
    below = {r.op for r in report.below_expectation()}
    for result in report.results:
        if result.op in report.expect_busbw:
            verdict = "[red]FAIL[/]" if result.op in below else "[green]PASS[/]"
            peak = f"{result.peak.busbw:.2f} GB/s at {human_bytes(result.peak.size)}" if result.peak else "no size ran"
            show(styled(f"{verdict} {result.op}: busbw {peak} (expected ≥ {report.expect_busbw[result.op]:g})"))


def _render_multinode(split: dict, topo: dict) -> None:

    def gbps(value) -> str:
        return "-" if value is None else f"{value:.2f}"

    rows = [
        (
            name.replace("_", "-"),
            split[name]["groups"],
            split[name]["ranks_per_group"],
            gbps(split[name]["busbw_min"]),
            gbps(split[name]["busbw_median"]),
            f"{split[name]['slowest']['name']}" if split[name]["slowest"] else "-",
        )
        for name in ("intra_node", "inter_node")
    ]
    show(
        table(
            f"all_reduce at {human_bytes(split['size'])}: inside vs across nodes",
            ["scope", "groups", "ranks/group", "busbw min (GB/s)", "busbw median (GB/s)", "slowest"],
            rows,
        )
    )
    links = split["links"]
    if links:
        slow = links["slowest"]
        show(
            f"one-way transfers to the same local rank {', '.join(map(str, links['shifts']))} node(s) on "
            f"({links['count']} links, {human_bytes(split['size'])}): median send "
            f"{links['send_busbw_median']:.2f} GB/s, receive {links['recv_busbw_median']:.2f} GB/s; slowest "
            f"link rank {slow['from_rank']} ({slow['from_host']}) → rank {slow['to_rank']} "
            f"({slow['to_host']}) at {slow['busbw']:.2f} GB/s (send {slow['send_busbw']:.2f}, receive "
            f"{slow['recv_busbw']:.2f})",
            soft_wrap=True,
        )
        show(
            "hosts by their links' median busbw, slowest first: "
            + ", ".join(
                f"{h['host']} {h['busbw_median']:.2f} GB/s ({h['links']} links)" for h in links["slowest_hosts"]
            ),
            soft_wrap=True,
        )
    ranks: dict[str, list[int]] = {}
    for rank, host in enumerate(topo["rank_hosts"]):
        ranks.setdefault(host, []).append(rank)
    show("rank → host: " + "; ".join(f"{host} {_rank_ranges(found)}" for host, found in ranks.items()), soft_wrap=True)


def _rank_ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 3, 8] → '0-3,8'."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)


@app.command(
    "stress-gpu",
    epilog="""[bold]Examples[/]

  smolctl stress-gpu                                   60 s on every GPU: bf16 8192² matmuls, all results checked

  smolctl stress-gpu --duration 10m --expect-tflops 600 --json     H100: also fail a GPU below 600 TFLOPS

  smolctl stress-gpu --duration 3s --devices cpu       the tool itself on the CPU (fp32 512²), no GPU needed
""",
)
def stress_gpu_command(
    duration: str = typer.Option("60", "--duration", help="Seconds, or 30s, 5m, 1h."),
    dtype: str | None = typer.Option(None, "--dtype", help="bf16, fp16 or fp32 (default: bf16 on GPUs, fp32 on CPU)."),
    size: int | None = typer.Option(None, "--size", help="n of the n×n matmuls (default: 8192 on GPUs, 512 on CPU)."),
    memory_fraction: float = typer.Option(
        0.9, "--memory-fraction", help="Share of each GPU's memory to fill and pattern-test, in (0, 1)."
    ),
    tolerance: float = typer.Option(
        0.10, "--tolerance", help="A device more than this fraction slower than the best fails."
    ),
    expect_tflops: float | None = typer.Option(
        None, "--expect-tflops", help="Fail a device whose median TFLOPS is below this."
    ),
    expect_gpus: int | None = typer.Option(
        None,
        "--expect-gpus",
        help="Fail when torch sees fewer GPUs (default with --devices all: what nvidia-smi lists).",
    ),
    devices: str = typer.Option(
        "all", "--devices", help="all (fails when torch sees no GPU), GPU indices like 0,1, or cpu."
    ),
    launch: str = typer.Option("auto", "--launch", help="process per device, thread, or auto (processes for GPUs)."),
    json_out: JsonOpt = False,
) -> None:
    """Burn every GPU with checked matmuls and a memory pattern test; OK/FAULTY per device like gpu-burn."""
    from smolctl.infra.stress import StressRun, build_config, node_failure, run_stress

    try:
        config = build_config(
            duration=duration,
            dtype=dtype,
            size=size,
            memory_fraction=memory_fraction,
            tolerance=tolerance,
            devices=devices,
            expect_tflops=expect_tflops,
            expect_gpus=expect_gpus,
            launch=launch,
        )
    except CheckFailed as exc:  # the node failed before a device ran: --json still prints its verdict
        if json_out:
            emit_json(node_failure(exc))
        raise

    def tick(elapsed: float, reports) -> None:
        latest = " · ".join(f"{r.device} {r.tflops[-1]:.3g}" for r in reports if r.tflops)
        bar.update(task, completed=min(elapsed, config.duration_s), rate=f"TFLOPS {latest}" if latest else "setting up")

    with progress(not json_out) as bar:
        task = bar.add_task(f"stress {config.dtype} {config.size}²", total=config.duration_s, rate="")
        found = StressRun(config, run_stress(config, on_tick=tick))
    if json_out:
        emit_json(found.to_dict())
    else:
        _render_stress(found)
    faulty = [r for r in found.devices if r.verdict != "OK"]
    if faulty:
        raise CheckFailed("stress-gpu: " + "; ".join(f"{r.device} FAULTY ({', '.join(r.reasons)})" for r in faulty))


def _render_stress(found) -> None:
    config, reports = found.config, found.devices

    def number(value, fmt: str = ".3g") -> str:
        return "-" if value is None else format(value, fmt)

    rows = [
        (
            r.device,
            f"{number(r.tflops_min)} / {number(r.tflops_median)}",
            r.mismatches,
            (r.result_hash or "-")[:12],
            r.memory_errors,
            number(r.telemetry.get("max_temp_c"), "d"),
            ", ".join(r.telemetry.get("throttle") or []) or "-",
            styled("[green]OK[/]" if r.verdict == "OK" else "[red]FAULTY[/]"),
        )
        for r in reports
    ]
    names = ", ".join(dict.fromkeys(r.name for r in reports if r.name)) or "?"
    show(
        table(
            f"stress-gpu: {names}, {config.dtype} {config.size}² matmuls, {config.duration_s:g}s",
            [
                "device",
                "TFLOPS min / median",
                "mismatches",
                "product sha256",
                "memory errors",
                "max °C",
                "throttling",
                "result",
            ],
            rows,
        )
    )
    for r in reports:
        show(
            styled(
                f"{r.device}: {r.matmuls} matmuls checked, {human_bytes(r.memory_tested_bytes)} pattern-tested "
                f"in {r.pattern_passes} passes"
                + (f" — [red]{escape('; '.join(r.reasons))}[/]" if r.reasons else "")
                + (f" [yellow]warning: {escape('; '.join(r.warnings))}[/]" if r.warnings else "")
            ),
            soft_wrap=True,
        )
    ok = sum(r.verdict == "OK" for r in reports)
    floor = f", below --expect-tflops {config.expect_tflops:g}" if config.expect_tflops else ""
    show(
        f"{ok}/{len(reports)} device(s) OK (FAULTY: any mismatch, a product differing from the other "
        f"devices', a memory error, hardware throttling, row remapping, ECC or Xid errors, a degraded "
        f"PCIe link, or median TFLOPS more than {config.tolerance:.0%} below the best device{floor})",
        soft_wrap=True,
    )
    if unchecked := [r.device for r in reports if "missing" in r.telemetry]:
        show(
            styled(
                f"[yellow]telemetry missing on {escape(', '.join(unchecked))}:[/] "
                f"{escape(str(reports[0].telemetry.get('missing', '')))}"
                " — throttling, ECC, row remapping, Xid and PCIe were not checked"
            ),
            soft_wrap=True,
        )
