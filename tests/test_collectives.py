"""benchmark-nccl: the nccl-tests arithmetic by hand, the #wrong verification against an independent simulation
of each collective, and real 2-process torchrun runs on gloo (one node, and two 'nodes' on this host)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import torch

from smolctl.cli import main
from smolctl.errors import UserError
from smolctl.infra.collectives import (
    DTYPES,
    OPS,
    BenchReport,
    OpResult,
    PatternTiles,
    SizeResult,
    bandwidths,
    build_config,
    expected_segments,
    input_segments,
    message_sizes,
    pattern_tables,
)
from smolctl.infra.multinode import Link, link_schedule, ring_shifts, summarize

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "op, world, busbw",
    [
        ("all_reduce", 8, 175.0),  # 2·(8-1)/8 = 1.75
        ("all_reduce", 2, 100.0),  # 2·1/2 = 1
        ("all_gather", 4, 75.0),  # (4-1)/4
        ("reduce_scatter", 16, 93.75),
        ("all_to_all", 8, 87.5),
        ("broadcast", 8, 100.0),
        ("send_recv", 8, 100.0),
    ],
)
def test_busbw_uses_the_nccl_tests_factors(op, world, busbw):
    algbw, bus = bandwidths(op, 1_000_000_000, 0.01, world)  # 1 GB in 10 ms
    assert algbw == pytest.approx(100.0) and bus == pytest.approx(busbw)


def test_chunked_ops_round_to_whole_elements_per_rank():
    # all_gather over 4 ranks in fp32: 8 B is 2 elements (< 1 per rank, skipped), 16 B is one per rank
    assert message_sizes("all_gather", 8, 64, 2, 4, 4) == [(16, 4), (32, 8), (64, 16)]
    assert message_sizes("all_reduce", 8, 64, 2, 4, 4) == [(8, 2), (16, 4), (32, 8), (64, 16)]
    assert message_sizes("reduce_scatter", 24, 100, 2, 4, 3) == [(24, 6), (48, 12), (96, 24)]


@pytest.mark.parametrize(
    "flags, flag",
    [
        ({"ops": "all_reduce,allreduce"}, "--ops"),
        ({"dtype": "fp8"}, "--dtype"),
        ({"min_bytes": "2M", "max_bytes": "1M"}, "--min-bytes"),
        ({"max_bytes": "lots"}, "--max-bytes"),
        ({"factor": 1.0}, "--factor"),
        ({"backend": "mpi"}, "--backend"),
        ({"expect_busbw": 0.0}, "--expect-busbw"),
        ({"expect_busbw": "all_reduce=fast"}, "--expect-busbw"),
        ({"ops": "all_reduce", "expect_busbw": "broadcast=5"}, "--expect-busbw"),
        ({"iters": 0}, "--iters"),
        ({"warmup": -1}, "--warmup"),
    ],
)
def test_bad_flags_name_the_flag(flags, flag):
    arguments = {
        "ops": "all",
        "min_bytes": "8",
        "max_bytes": None,
        "factor": 2.0,
        "dtype": None,
        "iters": 2,
        "warmup": 1,
        "backend": "auto",
        "expect_busbw": None,
        **flags,
    }
    with pytest.raises(UserError, match=flag):
        build_config(**arguments)


def simulate(op: str, inputs: list[torch.Tensor], world: int, count: int) -> list[torch.Tensor]:
    """What each rank's output holds after the collective, computed the plain way."""
    chunk = count // world
    if op == "all_reduce":
        return [sum(inputs)] * world
    if op == "reduce_scatter":
        return [sum(inputs)[r * chunk : (r + 1) * chunk] for r in range(world)]
    if op == "all_gather":
        return [torch.cat(inputs)] * world
    if op == "all_to_all":
        return [torch.cat([inputs[j][r * chunk : (r + 1) * chunk] for j in range(world)]) for r in range(world)]
    if op == "broadcast":
        return [inputs[0]] * world
    return [inputs[(r - 1) % world] for r in range(world)]  # send_recv


def rank_tiles(world: int, dtype_name: str, chunk: int = 2**22) -> list[PatternTiles]:
    attr, _, limit = DTYPES[dtype_name]
    return [
        PatternTiles(pattern_tables(world, limit, rank), getattr(torch, attr), "cpu", chunk=chunk)
        for rank in range(world)
    ]


@pytest.mark.parametrize("op, world", [(op, 3) for op in OPS] + [("all_reduce", 300), ("reduce_scatter", 300)])
def test_verification_counts_exactly_the_corrupted_elements(op, world):
    count, dtype = world * 11, torch.bfloat16
    tiles = rank_tiles(world, "bf16", chunk=4 if world < 8 else 1024)  # chunk edges inside
    inputs = []
    for rank in range(world):
        buffer = torch.zeros(count // world if op == "all_gather" else count, dtype=dtype)
        tiles[rank].fill(buffer, input_segments(op, rank, world, count))
        inputs.append(buffer)
    outputs = [out.clone() for out in simulate(op, [x.double() for x in inputs], world, count)]
    for rank in (0, 1, world - 1):
        wrong = tiles[rank].count_wrong(outputs[rank].to(dtype), expected_segments(op, rank, world, count))
        assert int(wrong) == 0, rank
    corrupted = outputs[1].to(dtype)
    corrupted[3] += 1
    corrupted[-1] = float("nan")
    assert int(tiles[1].count_wrong(corrupted, expected_segments(op, 1, world, count))) == 2
    if op in ("all_reduce", "reduce_scatter"):  # a rank's contribution lost or counted twice is wrong somewhere
        for change in (-1, 1):
            total = sum(inputs).double() + change * inputs[world // 2].double()
            chunk = count // world
            received = (total if op == "all_reduce" else total[chunk : 2 * chunk]).to(dtype)
            assert int(tiles[1].count_wrong(received, expected_segments(op, 1, world, count))) > 0


# world sizes from 2 to 16,384, around every boundary of the layout (bf16 holds integers up to 256, fp16 2048)
WORLDS = [2, 3, 8, 31, 64, 241, 242, 255, 256, 257, 300, 536, 1000, 1024, 2048, 2049, 4096, 9999, 16384]


@pytest.mark.parametrize("dtype_name", ["fp32", "bf16", "fp16"])
def test_reduction_patterns_are_exact_at_every_world_size(dtype_name):
    attr, _, limit = DTYPES[dtype_name]
    dtype = getattr(torch, attr)
    for world in WORLDS:
        tables = [pattern_tables(world, limit, rank) for rank in range(world)]
        summands = torch.from_numpy(numpy.array([t.tables["summand"] for t in tables], dtype=numpy.float64))
        want = torch.tensor(tables[0].tables["sum"], dtype=torch.float64)
        assert len({t.period for t in tables}) == 1 and bool((summands.sum(0) == want).all()), world
        assert want.max() <= limit and (summands > 0).any(1).all(), world  # every rank contributes somewhere
        assert len(set(want.tolist())) >= min(16, len(want)), world  # a misplaced chunk changes the sum
        # sum in the dtype, rounding after every addition: pairwise as a tree does, and rank by rank as a ring
        # does (up to 1024 ranks; beyond, the tree alone keeps the test fast): exact either way
        level = summands.to(dtype)
        while len(level) > 1:
            level = torch.cat([level[0::2][: len(level) // 2] + level[1::2], level[len(level) // 2 * 2 :]])
        assert bool((level[0].double() == want).all()), (world, dtype_name)
        if world <= 1024:
            running = torch.zeros(want.numel(), dtype=dtype)
            for row in summands.flip(0).to(dtype):
                running += row
            assert bool((running.double() == want).all()), (world, dtype_name)


def test_data_from_the_wrong_rank_is_wrong():
    world, count = 4, 4 * 8
    tiles = PatternTiles(pattern_tables(world, 2**24), torch.float32, "cpu")
    inputs = []
    for rank in range(world):
        buffer = torch.zeros(count // world)
        tiles.fill(buffer, input_segments("all_gather", rank, world, count))
        inputs.append(buffer)
    swapped = torch.cat([inputs[1], inputs[0], inputs[2], inputs[3]])
    assert int(tiles.count_wrong(swapped, expected_segments("all_gather", 0, world, count))) == 16


def report_of(peaks: dict[str, float], expect: str | None, ops=("all_reduce", "all_to_all")) -> BenchReport:
    config = build_config(
        ops=",".join(ops),
        min_bytes="8",
        max_bytes=None,
        factor=2.0,
        dtype=None,
        iters=1,
        warmup=0,
        backend="auto",
        expect_busbw=expect,
    )
    results = [OpResult(op, [SizeResult(2**30, 2**29, "bfloat16", "sum", -1, 1.0, 1.0, peaks[op], 0)]) for op in ops]
    return BenchReport({}, results, config.expect_busbw)


def test_busbw_thresholds_apply_per_op():
    report = report_of({"all_reduce": 360.0, "all_to_all": 45.0}, "all_reduce=350,all_to_all=40")
    assert report.expect_busbw == {"all_reduce": 350.0, "all_to_all": 40.0} and report.passed
    report = report_of({"all_reduce": 360.0, "all_to_all": 45.0}, "300")  # one number: every op
    assert [r.op for r in report.below_expectation()] == ["all_to_all"] and not report.passed
    report = report_of({"all_reduce": 340.0, "all_to_all": 10.0}, "all_reduce=350")  # unnamed ops: no floor
    assert [r.op for r in report.below_expectation()] == ["all_reduce"]
    assert report_of({"all_reduce": 1.0, "all_to_all": 1.0}, None).passed


@pytest.mark.parametrize("nodes", [2, 3, 4, 5, 7, 16, 33])
def test_link_schedule_covers_every_shifted_pair_with_no_node_busy_twice(nodes):
    for shift in ring_shifts(nodes):
        phases = link_schedule(nodes, shift)
        assert len(phases) <= 3
        assert sorted(pair for phase in phases for pair in phase) == [(a, (a + shift) % nodes) for a in range(nodes)]
        for phase in phases:
            busy = [node for pair in phase for node in pair]
            assert len(busy) == len(set(busy))
    met = {b for shift in ring_shifts(nodes) for a, b in [(0, shift % nodes), (0, -shift % nodes)]}
    assert len(met) >= min(nodes - 1, 6)  # every node meets several others, not just its ring neighbours


def test_multinode_report_names_the_planted_slow_host_and_link():
    hosts = ["gpu-a", "gpu-b", "gpu-c", "gpu-d"]
    rank_hosts = [host for host in hosts for _ in range(2)]  # 4 nodes × 2 ranks
    by_node = [[2 * n, 2 * n + 1] for n in range(4)]
    rails = [[0, 2, 4, 6], [1, 3, 5, 7]]
    size = 10**9
    links = []
    for shift in ring_shifts(4):
        for phase in link_schedule(4, shift):
            for a, b in phase:
                for j in range(2):
                    sender, receiver = by_node[a][j], by_node[b][j]
                    seconds = 0.02  # 50 GB/s
                    if "gpu-c" in (hosts[a], hosts[b]):
                        seconds *= 2  # a host whose NIC runs at half speed
                    if (a, b, j) == (0, 2, 1):
                        seconds = 0.2  # one bad cable: 5 GB/s
                    links.append(Link(shift, sender, receiver, seconds, seconds * 1.01))
    intra = (by_node, [0.01, 0.01, 0.03, 0.01])  # gpu-c's NVLink is slow too
    report = summarize(rank_hosts, intra, (rails, [0.05, 0.05]), links, size)
    assert report["intra_node"]["slowest"]["name"] == "gpu-c" and report["intra_node"]["groups"] == 4
    assert report["inter_node"]["groups"] == 2
    slow = report["links"]["slowest"]
    assert (slow["from_rank"], slow["from_host"], slow["to_rank"], slow["to_host"]) == (1, "gpu-a", 5, "gpu-c")
    assert slow["send_busbw"] == pytest.approx(5.0) and slow["recv_busbw"] == pytest.approx(5.0 / 1.01)
    assert report["links"]["slowest_hosts"][0]["host"] == "gpu-c"
    assert report["links"]["shifts"] == [1, 2] and report["links"]["count"] == 16


def run_cli(capsys, *args) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    return exit_info.value.code, capsys.readouterr().err


def test_without_torchrun_it_says_how_to_launch(capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    code, err = run_cli(capsys, "benchmark-nccl")
    assert code == 2 and "not started by torchrun" in err and "torchrun --nproc_per_node" in err
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    code, err = run_cli(capsys, "benchmark-nccl", "--max-bytes", "1K")
    assert code == 2 and "needs at least 2 ranks" in err and len(err.strip().splitlines()) == 1
    code, err = run_cli(capsys, "benchmark-nccl", "--expect-busbw")
    assert code == 2 and "'--expect-busbw' requires an argument" in err


def torchrun(*args: str, cwd: Path = ROOT) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


BENCH = ["-m", "smolctl", "benchmark-nccl", "--max-bytes", "64K", "--iters", "2", "--warmup", "1", "--json"]


@pytest.mark.slow
def test_two_processes_on_gloo_give_correct_results_and_nccl_tests_arithmetic():
    process = torchrun("--standalone", "--nproc_per_node", "2", *BENCH, "--min-bytes", "1K", "--expect-busbw", "1e6")
    out, err = process.communicate(timeout=120)
    reports = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(reports) == 1, err  # rank 0 alone speaks
    report = reports[0]
    assert report["topology"]["world_size"] == 2 and report["topology"]["backend"] == "gloo"
    assert report["wrong"] == 0 and [r["op"] for r in report["results"]] == list(OPS)
    factors = {
        "all_reduce": 1.0,
        "all_gather": 0.5,
        "reduce_scatter": 0.5,
        "all_to_all": 0.5,
        "broadcast": 1.0,
        "send_recv": 1.0,
    }  # at 2 ranks
    for result in report["results"]:
        assert [row["size"] for row in result["rows"]] == [1024 * 2**k for k in range(7)]
        for row in result["rows"]:
            assert row["wrong"] == 0 and row["algbw"] == pytest.approx(row["size"] / row["time_us"] / 1e3)
            assert row["busbw"] == pytest.approx(row["algbw"] * factors[result["op"]])
    # no cluster reaches 1e6 GB/s: the run fails, says so once (rank 1 stays quiet) and exits non-zero
    assert report["passed"] is False and process.returncode != 0
    assert err.count("failed: benchmark-nccl: all_reduce busbw") == 1


def _ranks_by_hand(args_by_rank: list[list[str]]) -> tuple[list[int], list[tuple[str, str]]]:
    """Each rank started as torchrun would start one process per node on a 2-node job, set by hand (two torch
    imports fewer than two torchrun agents would cost): (exit codes, (stdout, stderr) per rank)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    workers = []
    for node, args in enumerate(args_by_rank):
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "WORLD_SIZE": str(len(args_by_rank)),
            "RANK": str(node),
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "GROUP_RANK": str(node),
        }
        workers.append(
            subprocess.Popen(
                [sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outputs = [worker.communicate(timeout=120) for worker in workers]
    return [worker.returncode for worker in workers], outputs


@pytest.mark.slow
def test_ranks_started_with_different_options_are_refused_on_every_rank():
    """Rank 0 passed (0 wrong) and rank 1 crashed with a gloo transport error: their collectives differed."""
    codes, outputs = _ranks_by_hand(
        [[*BENCH, "--ops", "all_reduce"], [*BENCH[:4], "4K", *BENCH[5:], "--ops", "all_reduce"]]
    )
    assert codes == [2, 2], outputs
    assert outputs[0][1].strip() == (
        "error: benchmark-nccl: the 2 ranks were started with different max_bytes — "
        "launch every rank with the same command line"
    )
    assert outputs[1][1] == "" and outputs[0][0] == outputs[1][0] == ""


@pytest.mark.slow
def test_two_nodes_report_the_inter_node_split_and_the_slowest_link():
    codes, outputs = _ranks_by_hand([[*BENCH, "--ops", "all_reduce"]] * 2)
    assert codes == [0, 0], outputs[0][1][-2000:]
    assert outputs[1][0] == ""  # rank 1 prints nothing
    report = json.loads(outputs[0][0])
    assert report["topology"]["nodes"] == 2 and report["topology"]["ranks_per_node"] == 1
    split = report["multinode"]
    assert split["intra_node"]["groups"] == 0  # one rank per node: nothing to reduce inside a node
    assert split["inter_node"]["groups"] == 1 and split["inter_node"]["busbw_min"] > 0
    links = split["links"]
    assert links["shifts"] == [1] and links["count"] == 2  # 0 → 1 and 1 → 0, each timed on its own
    assert {links["slowest"]["from_rank"], links["slowest"]["to_rank"]} == {0, 1}
    assert links["slowest"]["send_busbw"] > 0 and links["slowest"]["recv_busbw"] > 0
    assert report["topology"]["rank_hosts"] == [socket.gethostname()] * 2
