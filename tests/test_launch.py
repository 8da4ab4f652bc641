"""trex launch: torchrun's own flags and launcher, with exit codes that say why the job ended."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch.distributed as dist

from trex.cli import main
from trex.launch import SHUTDOWN_TIMEOUT_S, first_failure, torchrun_args


def test_the_first_positional_is_the_trex_command_and_flags_are_torchruns(monkeypatch):
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    args = torchrun_args(["--nproc-per-node", "2", "--master-port", "29511", "train", "r.toml", "--set", "a.b=1"])
    assert (args.module, args.training_script, args.training_script_args) == (
        True, "trex", ["train", "r.toml", "--set", "a.b=1"])
    assert args.nproc_per_node == "2" and args.master_port == 29511
    assert args.shutdown_timeout == SHUTDOWN_TIMEOUT_S  # a rank stopped mid-save may finish it
    assert torchrun_args(["--shutdown-timeout", "7", "train"]).shutdown_timeout == 7
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "9")
    assert torchrun_args(["train"]).shutdown_timeout is None  # torch reads its own variable


def _failure(code, at):
    return SimpleNamespace(exitcode=code, timestamp=at)


def test_the_failure_that_explains_the_job_wins_over_earlier_collateral_ones():
    # rank 1 was SIGKILLed by the launcher after rank 0 reported it lost (exit 4) in the same second
    assert first_failure({0: _failure(4, 100), 1: _failure(-9, 100)})[0] == 0
    assert first_failure({0: _failure(-9, 99), 1: _failure(4, 100)})[0] == 1
    # no trex code: torch's earliest failure (a killed rank, before the peer that lost it)
    assert first_failure({0: _failure(1, 101), 1: _failure(-9, 100)})[0] == 1
    # rank 1 was killed; the launcher then stopped rank 0 with SIGTERM, in the same second
    assert first_failure({0: _failure(-15, 100), 1: _failure(-9, 100)})[0] == 1
    assert first_failure({0: _failure(-15, 100), 1: _failure(-15, 100)})[0] == 0


def test_an_unknown_command_is_refused_before_torchrun_starts(monkeypatch, capsys):
    import torch.distributed.run

    started = []
    monkeypatch.setattr(torch.distributed.run, "run", lambda args: started.append(args))
    assert main(["launch", "--nproc-per-node", "1", "bogus"]) == 2
    err = capsys.readouterr().err
    assert "'bogus' is not a trex command" in err and "train" in err and len(err.strip().splitlines()) == 1
    assert main(["launch", "--nproc-per-node", "1", "launch", "train"]) == 2  # no launch inside a launch
    assert started == []
    assert main(["launch", "--nproc-per-node", "1", "train", "r.toml"]) == 0 and len(started) == 1


def test_each_restart_meets_in_its_own_part_of_torchruns_shared_store(monkeypatch):
    """torchrun's agent keeps one TCPStore across --max-restarts and env:// adds no per-attempt prefix:
    the restarted group read the failed group's keys (gloo: a dead rank's address, "connectFullMesh
    failed ... Connection refused", or a wait that never ended). Each attempt's group has its own."""
    from trex import device
    from trex.parallel import mesh

    class Joined(Exception):
        pass

    def init_process_group(**kwargs):
        groups.append(kwargs)
        raise Joined  # the mesh after it needs a real group

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the agent's
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port), "RANK": "0", "WORLD_SIZE": "2",
                       "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(mesh.dist, "init_process_group", init_process_group)
    groups: list[dict] = []
    for attempt in ("0", "1"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        with pytest.raises(Joined):
            mesh.init_parallel(1, -1, 1, 60, device.detect("cpu"), world_size=2)
    failed, restarted = groups
    failed["store"].set("rank_0", "127.0.0.1:45444")  # what the failed group left: its rank 0's address
    assert not restarted["store"].check(["rank_0"])
    assert (restarted["rank"], restarted["world_size"]) == (0, 2)
