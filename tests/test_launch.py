"""The local launcher: results per rank, failures and hangs named by rank."""

from __future__ import annotations

import os
import time

import pytest

from mcore_compat.launch import RankFailure, RankTimeout, spawn


def _all_reduce() -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return float(t)


def _rank_one_raises() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    time.sleep(60)


def _rank_zero_hangs() -> int:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        time.sleep(600)
    return 1


def _rank_one_dies() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(7)
    time.sleep(60)


def test_results_per_rank() -> None:
    assert spawn(_all_reduce, 2, timeout=120) == [3.0, 3.0]


def test_failure_names_the_rank_and_carries_its_traceback() -> None:
    with pytest.raises(RankFailure) as err:
        spawn(_rank_one_raises, 2, timeout=120)
    assert list(err.value.failures) == [1]
    assert "boom on purpose" in str(err.value)


def test_hang_ends_at_the_deadline_naming_the_rank() -> None:
    start = time.monotonic()
    with pytest.raises(RankTimeout) as err:
        spawn(_rank_zero_hangs, 2, timeout=45)  # generous: rank 1 must start torch even on a loaded machine
    assert err.value.ranks == [0]
    assert time.monotonic() - start < 90


def test_dead_rank_is_reported_with_its_exit_status() -> None:
    with pytest.raises(RankFailure) as err:
        spawn(_rank_one_dies, 2, timeout=120)
    assert "status 7" in err.value.failures[1]


def test_bad_world_size() -> None:
    with pytest.raises(ValueError, match="nprocs"):
        spawn(_all_reduce, 0)


def _return_tensor() -> object:
    import torch

    return {"t": torch.arange(4.0) * (1 + __import__("torch.distributed").distributed.get_rank())}


def test_tensors_come_back_by_value() -> None:
    out = spawn(_return_tensor, 2, timeout=120)
    assert [o["t"].tolist() for o in out] == [[0.0, 1.0, 2.0, 3.0], [0.0, 2.0, 4.0, 6.0]]


def test_a_taken_rendezvous_port_is_retried_with_another(monkeypatch: pytest.MonkeyPatch) -> None:
    """free_port() cannot reserve its port; when another process listens on it first, spawn picks a new one."""
    import socket

    from mcore_compat import launch

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        ports = iter([busy.getsockname()[1]])
        real = launch.free_port
        monkeypatch.setattr(launch, "free_port", lambda: next(ports, None) or real())
        assert spawn(_all_reduce, 2, timeout=120) == [3.0, 3.0]
