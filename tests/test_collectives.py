"""benchmark-nccl: the nccl-tests arithmetic by hand, the #wrong verification against an independent simulation
of each collective, and real 2-process torchrun runs on gloo (one node, and two 'nodes' on this host)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from smolctl.cli import main
from smolctl.errors import UserError
from smolctl.infra.collectives import (DTYPES, OPS, PatternTiles, bandwidths, build_config, expected_segments,
                                       input_segments, message_sizes, parse_bytes, pattern_tables)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("op, world, busbw", [
    ("all_reduce", 8, 175.0),     # 2·(8-1)/8 = 1.75
    ("all_reduce", 2, 100.0),     # 2·1/2 = 1
    ("all_gather", 4, 75.0),      # (4-1)/4
    ("reduce_scatter", 16, 93.75),
    ("all_to_all", 8, 87.5),
    ("broadcast", 8, 100.0),
    ("send_recv", 8, 100.0),
])
def test_busbw_uses_the_nccl_tests_factors(op, world, busbw):
    algbw, bus = bandwidths(op, 1_000_000_000, 0.01, world)  # 1 GB in 10 ms
    assert algbw == pytest.approx(100.0) and bus == pytest.approx(busbw)


@pytest.mark.parametrize("text, size", [("8", 8), ("1K", 1024), ("64k", 65536), ("1M", 2**20), ("8G", 8 * 2**30),
                                        ("1MiB", 2**20), ("512KB", 512 * 1024), ("0.5G", 2**29)])
def test_sizes_are_powers_of_1024_like_nccl_tests(text, size):
    assert parse_bytes(text, "--max-bytes") == size


def test_chunked_ops_round_to_whole_elements_per_rank():
    # all_gather over 4 ranks in fp32: 8 B is 2 elements (< 1 per rank, skipped), 16 B is one per rank
    assert message_sizes("all_gather", 8, 64, 2, 4, 4) == [(16, 4), (32, 8), (64, 16)]
    assert message_sizes("all_reduce", 8, 64, 2, 4, 4) == [(8, 2), (16, 4), (32, 8), (64, 16)]
    assert message_sizes("reduce_scatter", 24, 100, 2, 4, 3) == [(24, 6), (48, 12), (96, 24)]


@pytest.mark.parametrize("flags, flag", [
    ({"ops": "all_reduce,allreduce"}, "--ops"), ({"dtype": "fp8"}, "--dtype"),
    ({"min_bytes": "2M", "max_bytes": "1M"}, "--min-bytes"), ({"max_bytes": "lots"}, "--max-bytes"),
    ({"factor": 1.0}, "--factor"), ({"backend": "mpi"}, "--backend"), ({"expect_busbw": 0.0}, "--expect-busbw"),
    ({"iters": 0}, "--iters"), ({"warmup": -1}, "--warmup"),
])
def test_bad_flags_name_the_flag(flags, flag):
    arguments = {"ops": "all", "min_bytes": "8", "max_bytes": None, "factor": 2.0, "dtype": None, "iters": 2,
                 "warmup": 1, "backend": "auto", "expect_busbw": None, **flags}
    with pytest.raises(UserError, match=flag):
        build_config(**arguments)


def simulate(op: str, inputs: list[torch.Tensor], world: int, count: int) -> list[torch.Tensor]:
    """What each rank's output holds after the collective, computed the plain way."""
    chunk = count // world
    if op == "all_reduce":
        return [sum(inputs)] * world
    if op == "reduce_scatter":
        return [sum(inputs)[r * chunk:(r + 1) * chunk] for r in range(world)]
    if op == "all_gather":
        return [torch.cat(inputs)] * world
    if op == "all_to_all":
        return [torch.cat([inputs[j][r * chunk:(r + 1) * chunk] for j in range(world)]) for r in range(world)]
    if op == "broadcast":
        return [inputs[0]] * world
    return [inputs[(r - 1) % world] for r in range(world)]  # send_recv


@pytest.mark.parametrize("op", OPS)
def test_verification_counts_exactly_the_corrupted_elements(op):
    world, count, dtype = 3, 3 * 11, torch.bfloat16
    tiles = PatternTiles(pattern_tables(world, DTYPES["bf16"][2]), dtype, "cpu", chunk=4)  # chunk edges inside
    inputs = []
    for rank in range(world):
        buffer = torch.zeros(count // world if op == "all_gather" else count, dtype=dtype)
        tiles.fill(buffer, input_segments(op, rank, world, count))
        inputs.append(buffer)
    outputs = [out.clone() for out in simulate(op, [x.double() for x in inputs], world, count)]
    for rank, out in enumerate(outputs):
        assert int(tiles.count_wrong(out.to(dtype), expected_segments(op, rank, world, count))) == 0, rank
    corrupted = outputs[1].to(dtype)
    corrupted[3] += 1
    corrupted[-1] = float("nan")
    assert int(tiles.count_wrong(corrupted, expected_segments(op, 1, world, count))) == 2


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


@pytest.mark.parametrize("world", [2, 8, 16, 64, 300])
def test_reduction_patterns_stay_exact_in_bf16(world):
    limit = DTYPES["bf16"][2]
    tables = pattern_tables(world, limit)
    if world <= limit:
        assert max(tables["sum"]) <= limit  # so the sum over ranks is an exact bf16 integer, needing no tolerance
    assert len(set(tables["summand"])) >= 2


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
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


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
    factors = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "all_to_all": 0.5, "broadcast": 1.0,
               "send_recv": 1.0}  # at 2 ranks
    for result in report["results"]:
        assert [row["size"] for row in result["rows"]] == [1024 * 2**k for k in range(7)]
        for row in result["rows"]:
            assert row["wrong"] == 0 and row["algbw"] == pytest.approx(row["size"] / row["time_us"] / 1e3)
            assert row["busbw"] == pytest.approx(row["algbw"] * factors[result["op"]])
    # no cluster reaches 1e6 GB/s: the run fails, says so once (rank 1 stays quiet) and exits non-zero
    assert report["passed"] is False and process.returncode != 0
    assert err.count("failed: benchmark-nccl: all_reduce busbw") == 1


@pytest.mark.slow
def test_two_nodes_report_the_inter_node_split_and_the_slowest_pair():
    # the environment torchrun gives each worker on a 2-node job with one process per node, set by hand: two
    # torch imports fewer than two torchrun agents would cost
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    workers = []
    for node in (0, 1):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "WORLD_SIZE": "2", "RANK": str(node), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
               "GROUP_RANK": str(node)}
        workers.append(subprocess.Popen([sys.executable, *BENCH, "--ops", "all_reduce"], cwd=ROOT, env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [worker.communicate(timeout=120) for worker in workers]
    assert [worker.returncode for worker in workers] == [0, 0], outputs[0][1][-2000:]
    assert outputs[1][0] == ""  # rank 1 prints nothing
    report = json.loads(outputs[0][0])
    assert report["topology"]["nodes"] == 2 and report["topology"]["ranks_per_node"] == 1
    split = report["multinode"]
    assert split["intra_node"]["groups"] == 0  # one rank per node: nothing to reduce inside a node
    assert split["inter_node"]["groups"] == 1 and split["inter_node"]["busbw_min"] > 0
    assert {split["send_recv"]["slowest"]["rank"], split["send_recv"]["slowest"]["peer"]} == {0, 1}
