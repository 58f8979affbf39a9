"""The launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) read in one place: a value set by
hand or by a broken launch script is one line naming the variable, not a ValueError or a rendezvous that hangs."""

from __future__ import annotations

import pytest
from conftest import run_cli

from smolctl.errors import UserError
from smolctl.launcher import check_rendezvous_env, local_rank_from_env, rank_from_env, world_size_from_env


@pytest.mark.parametrize(
    "env,read,message",
    [
        ({"WORLD_SIZE": "abc"}, world_size_from_env, "WORLD_SIZE: is 'abc', not a whole number"),
        ({"WORLD_SIZE": "0"}, world_size_from_env, "WORLD_SIZE: is 0, below 1"),
        ({"RANK": "x"}, rank_from_env, "RANK: is 'x', not a whole number"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, rank_from_env, "RANK: is 2, outside a world of 2 processes"),
        ({"RANK": "3"}, rank_from_env, "RANK: is 3, outside a world of 1 process "),
        ({"LOCAL_RANK": "-1"}, local_rank_from_env, "LOCAL_RANK: is -1, below 0"),
        ({"WORLD_SIZE": "2", "MASTER_PORT": "1"}, check_rendezvous_env, "MASTER_ADDR: is not set"),
    ],
)
def test_a_bad_launcher_variable_is_named(monkeypatch, env, read, message):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError) as info:
        read()
    assert str(info.value).startswith(message), info.value


def test_a_launch_without_its_variables_reads_as_one_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert (rank_from_env(), world_size_from_env(), local_rank_from_env()) == (0, 1, 0)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert (rank_from_env(), world_size_from_env()) == (1, 2)


@pytest.mark.parametrize(
    "argv", [["pretrain", "recipes/smollm3.toml", "--dry-run"], ["benchmark-nccl"]], ids=["pretrain", "nccl"]
)
def test_the_commands_refuse_a_bad_world_size_in_one_line(argv):
    result = run_cli(*argv, env={"RANK": "0", "WORLD_SIZE": "two"})
    assert result.returncode == 2 and result.stderr.startswith("error: WORLD_SIZE: is 'two'"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_bad_command_line_is_said_by_rank_zero_alone(monkeypatch, capsys):
    """Every rank of a launch gets the same command line: a mistake in it was printed once per rank."""
    import smolctl.cli
    from smolctl.cli import main

    monkeypatch.setattr(smolctl.cli, "QUIET_RANK_GRACE_S", 0.0)
    for rank, said in (("1", ""), ("0", "error: smolctl benchmark-nccl: argument 3 (after --ops) is empty")):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        for argv in (["benchmark-nccl", "--ops", ""], ["benchmark-nccl", "--opz", "x"]):
            with pytest.raises(SystemExit) as info:
                main(argv)
            assert info.value.code == 2
            err = capsys.readouterr().err
            assert (said in err) if rank == "0" and argv[-1] == "" else (bool(err) == (rank == "0")), err
