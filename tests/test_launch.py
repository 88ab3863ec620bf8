"""The local launcher: results per rank, failures and hangs named by rank."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mcore_compat.launch import Group, RankFailure, RankTimeout, spawn


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


def _every_rank_raises() -> None:
    import torch.distributed as dist

    time.sleep(0.3 * dist.get_rank())  # rank 1 reports after rank 0 did
    raise OSError(f"cannot load the checkpoint on rank {dist.get_rank()}")


def test_a_failure_on_every_rank_names_every_rank() -> None:
    with pytest.raises(RankFailure) as err:
        spawn(_every_rank_raises, 2, timeout=120)
    assert list(err.value.failures) == [0, 1], err.value.failures
    assert err.value.summary.startswith("rank(s) 0, 1 failed: OSError: cannot load the checkpoint on rank 0")


def test_hang_ends_at_the_deadline_naming_the_rank() -> None:
    start = time.monotonic()
    with pytest.raises(RankTimeout) as err:
        # counted once the ranks are up: rank 1 only has to import this module and answer (a few seconds at most
        # on a loaded 2-core machine)
        spawn(_rank_zero_hangs, 2, timeout=10)
    assert err.value.ranks == [0]
    assert time.monotonic() - start < 90


def _hang_in_rank_zero_here() -> None:
    time.sleep(600)


def _hang_in_rank_one_here() -> None:
    time.sleep(600)


def _both_hang() -> None:
    import torch.distributed as dist

    (_hang_in_rank_zero_here if dist.get_rank() == 0 else _hang_in_rank_one_here)()


def _ready() -> int:
    return 1


def test_timeout_counts_once_the_ranks_are_up_and_returns_each_ranks_stacks_whole() -> None:
    """A 1 s limit is shorter than starting the ranks (importing torch, joining the group): it applies to the call
    only. Each hung rank's stacks come back on their own, labelled, not interleaved on a shared stderr."""
    with Group(2) as group:
        start = time.monotonic()
        assert group.run(int, timeout=1) == [0, 0]  # a builtin: nothing to import on the ranks for the call
        assert time.monotonic() - start > 1, "the ranks started in under 1 s: the test proves nothing"
        # this module (and pytest with it) imported on the ranks, untimed: under a loaded CI machine that import
        # alone took more than 1 s
        assert group.run(_ready, timeout=120) == [1, 1]
        with pytest.raises(RankTimeout) as err:
            group.run(_both_hang, timeout=2)
    exc = err.value
    assert exc.ranks == [0, 1] and not exc.starting
    assert sorted(exc.stacks) == [0, 1]
    assert "_hang_in_rank_zero_here" in exc.stacks[0] and "_hang_in_rank_one_here" not in exc.stacks[0]
    assert "_hang_in_rank_one_here" in exc.stacks[1] and "_hang_in_rank_zero_here" not in exc.stacks[1]
    for stack in exc.stacks.values():
        assert stack.count("Current thread") == 1, stack  # one whole dump per rank
    text = str(exc)
    assert text.index("--- rank 0: Python stacks when stopped ---") < text.index(
        "--- rank 1: Python stacks when stopped ---")
    assert "did not finish within 2 s" in text


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


# ------------------------------------------------------------------------------- Group: many runs in one group
_STATE: list[int] = []


def _pid_and_count() -> tuple[int, int]:
    """This rank's pid and how many times it ran this function (module state survives between runs)."""
    _STATE.append(1)
    return os.getpid(), len(_STATE)


def test_group_runs_many_functions_in_the_same_processes() -> None:
    with Group(2) as group:
        first = group.run(_pid_and_count, timeout=120)
        assert group.run(_all_reduce, timeout=60) == [3.0, 3.0]
        second = group.run(_pid_and_count, timeout=60)
        assert [pid for pid, _ in first] == [pid for pid, _ in second] == group.pids
        assert [n for _, n in first] == [1, 1] and [n for _, n in second] == [2, 2]
        assert group.starts == 1
    assert not group.started


def test_group_restarts_fresh_processes_after_a_failure() -> None:
    with Group(2) as group:
        before = group.run(_pid_and_count, timeout=120)
        with pytest.raises(RankFailure) as err:
            group.run(_rank_one_raises, timeout=60)
        assert list(err.value.failures) == [1] and not group.started
        after = group.run(_pid_and_count, timeout=120)
        assert {pid for pid, _ in after}.isdisjoint(pid for pid, _ in before)
        assert [n for _, n in after] == [1, 1]  # fresh processes: no state from before the failure
        assert group.starts == 2


def test_group_hang_stops_the_group_at_the_deadline() -> None:
    with Group(2) as group:
        group.start(timeout=120)
        with pytest.raises(RankTimeout) as err:
            group.run(_rank_zero_hangs, timeout=10)
        assert err.value.ranks == [0] and not group.started


def test_group_refuses_an_unpicklable_function_before_sending_it() -> None:
    group = Group(1)
    with pytest.raises((AttributeError, TypeError, pickle.PicklingError)):
        group.run(lambda: 1, timeout=60)
    assert not group.started  # refused before any process was started


def _count_groups() -> int:
    from torch.distributed import distributed_c10d as c10d

    return len(c10d._world.pg_map)


def _make_two_groups() -> int:
    import torch.distributed as dist

    dist.new_group([0, 1])
    dist.new_group([0, 1], backend="gloo")
    return _count_groups()


@pytest.mark.parametrize("destroy", [True, False])
def test_group_destroys_the_subgroups_a_run_created(destroy: bool) -> None:
    """Megatron creates dozens of groups per initialisation; a long-lived group of ranks must be able to drop them."""
    with Group(2, destroy_subgroups=destroy) as group:
        base = group.run(_count_groups, timeout=120)
        assert group.run(_make_two_groups, timeout=60) == [b + 2 for b in base]
        assert group.run(_count_groups, timeout=60) == (base if destroy else [b + 2 for b in base])


_ENDS_WITH_DESTROY = """
import torch, torch.distributed as dist
from mcore_compat.launch import destroy_process_groups_since, process_groups
dist.init_process_group("gloo")
before = process_groups()
groups = [dist.new_group([0, 1]) for _ in range(30)]  # as many as Megatron's initialize_model_parallel makes
for g in groups:
    dist.all_reduce(torch.ones(4), group=g)
del groups
dist.barrier()
destroy_process_groups_since(before)
print("ended", dist.get_rank(), flush=True)
"""


def _torchrun_two_ranks(source: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``source`` written to a script and run by torchrun on 2 local ranks (no restart), with ``args``."""
    script = tmp_path / "job.py"
    script.write_text(source, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--max-restarts", "0", str(script), *args], capture_output=True, text=True, timeout=300,
                          env=env, check=False)


def test_a_torchrun_job_may_end_right_after_destroying_its_groups(tmp_path: Path) -> None:
    """The groups' destructors run on a thread of their own; the interpreter must wait for it. A daemon thread
    there aborted every rank at exit (SIGABRT, "terminate called without an active exception": 5 jobs of 5)."""
    proc = _torchrun_two_ranks(_ENDS_WITH_DESTROY, tmp_path)
    assert proc.returncode == 0 and "terminate called" not in proc.stderr, proc.stderr[-3000:]
    assert sorted(proc.stdout.split()) == ["0", "1", "ended", "ended"], proc.stdout


_ENDS_WITH_END_JOB = """
import atexit, sys, threading, time
import torch.distributed as dist
from mcore_compat.launch import end_job, init_from_env
mode, out = sys.argv[1], sys.argv[2]
rank, world = init_from_env()
got = [None] * world
dist.all_gather_object(got, rank)
atexit.register(lambda: open(f"{out}.atexit.{rank}", "w").close())  # a file each: a shared stdout interleaves
threading.Thread(target=lambda: (time.sleep(1), open(f"{out}.{rank}", "w").close())).start()
if mode == "late" and rank == 1:
    time.sleep(20)  # never reaches end_job in time
    sys.exit(0)
end_job(3 if mode == "failed" else 0, timeout_s=4 if mode == "late" else 120)  # 4 s: to wait out the late rank
"""


@pytest.mark.parametrize("mode", ["ok", "failed", "late"])
def test_end_job_ends_a_torchrun_rank_as_the_interpreter_would_and_names_a_late_peer(tmp_path: Path,
                                                                                     mode: str) -> None:
    """``end_job``: the exit status given (0, or 3 for a rank that failed), the atexit handlers run and the
    non-daemon threads joined first; a peer that does not arrive within the timeout is named, and the rank exits
    1 (on gloo)."""
    proc = _torchrun_two_ranks(_ENDS_WITH_END_JOB, tmp_path, mode, str(tmp_path / "thread"))
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
    written = {p.name for p in tmp_path.glob("thread.*")}
    rank0 = {"thread.0", "thread.atexit.0"}  # rank 0's thread joined and its atexit handler run before it exited
    if mode == "ok":
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert written == rank0 | {"thread.1", "thread.atexit.1"}, written
    elif mode == "failed":
        assert proc.returncode != 0 and "exitcode  : 3" in proc.stderr, proc.stderr[-3000:]
        assert rank0 <= written, written
    else:
        assert proc.returncode != 0 and "exitcode  : 1" in proc.stderr, proc.stderr[-3000:]
        (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("rank 0: the job's end failed")]
        assert "Rank 1 failed to pass monitoredBarrier" in line, line  # the late rank is named (torch's words)
        assert rank0 <= written, written


# ------------------------------------------------------------------------------- warm groups: ranks forked
def _warm_state() -> tuple[int, int, bool, float]:
    import sys

    import torch
    import torch.distributed as dist

    from mcore_compat._util import warm_cpu as _warm_cpu

    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return _warm_cpu.SERVER_PID, os.getpid(), "torch" in sys.modules, float(t)


def test_warm_group_forks_its_ranks_from_one_server_that_imported_the_modules() -> None:
    """The warm module is imported once, in the fork server, and not again in any rank (its SERVER_PID is the
    server's); two groups share the server; the starts are recorded as fork-server starts that imported nothing."""
    from conftest import WARM_CPU

    from mcore_compat.launch import start_log

    before = len(start_log())
    with Group(2, warm=WARM_CPU) as group:
        got = group.run(_warm_state, timeout=120)
    with Group(2, warm=WARM_CPU) as group:
        again = group.run(_warm_state, timeout=120)
    servers = {server for server, _, _, _ in got + again}
    ranks = {pid for _, pid, _, _ in got + again}
    assert len(servers) == 1 and len(ranks) == 4 and servers.isdisjoint(ranks) and os.getpid() not in servers
    assert [s for _, _, _, s in got] == [3.0, 3.0]
    records = start_log()[before:]
    assert [(r.nprocs, r.method) for r in records] == [(2, "forkserver"), (2, "forkserver")]
    assert all(r.import_seconds < 0.5 for r in records), records  # torch came with the fork


def test_warm_group_refuses_cuda_and_a_second_set_of_modules() -> None:
    from conftest import WARM_CPU

    from mcore_compat.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="cannot be forked once CUDA"):
        Group(2, device="cuda", warm=WARM_CPU)
    with Group(1, warm=WARM_CPU) as group:
        group.start(timeout=120)
    with pytest.raises(InvalidArgumentError, match="one fork server per process"):
        Group(1, warm=("json",)).start(timeout=120)


def test_spawned_start_is_recorded_with_its_import_time() -> None:
    from mcore_compat.launch import start_log

    before = len(start_log())
    assert spawn(_all_reduce, 2, timeout=120) == [3.0, 3.0]
    (record,) = start_log()[before:]
    assert record.nprocs == 2 and record.method == "spawn" and 0 < record.import_seconds < record.seconds
