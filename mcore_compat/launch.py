"""Run a function on N local processes in one ``torch.distributed`` group, with a deadline.

This is what ``mcore-compat self-check --nproc N`` and the test-suite use: one spawn per group of
configurations (spawning and importing torch cost most of the time), failures reported with the rank that
failed, and a hang ended by a timeout that names the ranks that never answered.

Under ``torchrun`` (``RANK``/``WORLD_SIZE`` in the environment) use :func:`init_from_env` instead.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

__all__ = ["RankFailure", "RankTimeout", "default_backend", "free_port", "init_from_env", "spawn"]

T = TypeVar("T")


class RankFailure(RuntimeError):
    """One or more ranks raised or died. ``failures`` maps rank -> traceback text (or exit status)."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = dict(sorted(failures.items()))
        first = next(iter(self.failures))
        ranks = ", ".join(str(r) for r in self.failures)
        lines = [ln for ln in self.failures[first].strip().splitlines() if ln.strip()]
        cause = lines[-1].strip() if lines else "no details"
        super().__init__(f"rank(s) {ranks} failed: {cause}\n--- rank {first} ---\n{self.failures[first]}")


class RankTimeout(RuntimeError):
    """Ranks did not finish within the deadline. ``ranks`` lists those that never answered."""

    def __init__(self, ranks: Sequence[int], timeout: float) -> None:
        self.ranks = list(ranks)
        super().__init__(
            f"rank(s) {', '.join(map(str, self.ranks))} did not finish within {timeout:g} s (hung or too slow); "
            f"all ranks were stopped (their Python stacks are on stderr). Raise --timeout if the run is merely slow."
        )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def default_backend(device: str) -> str:
    """``"nccl"`` for CUDA, ``"gloo"`` for CPU."""
    return "nccl" if device == "cuda" else "gloo"


def init_from_env(backend: str | None = None, device: str = "cpu", timeout_s: float = 600.0) -> tuple[int, int]:
    """Initialise the default process group from the usual environment (``torchrun``, or :func:`spawn`).

    Returns:
        ``(rank, world_size)``. A process with no launcher environment becomes a group of one on a free port.
    """
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % max(torch.cuda.device_count(), 1))
    if not dist.is_initialized():
        dist.init_process_group(backend or default_backend(device), rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
    return rank, world


@dataclass(frozen=True)
class _Job:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    backend: str
    device: str
    env: dict[str, str]
    timeout_s: float


def _child(rank: int, world: int, port: int, job: _Job, results: Any) -> None:
    os.environ.update(job.env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if hasattr(signal, "SIGUSR1"):  # the parent asks a hung rank for its Python stacks before stopping it
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        init_from_env(job.backend, job.device, job.timeout_s)
        value = job.fn(*job.args, **job.kwargs)
        # Plain pickle (not torch's ForkingPickler): tensors travel by value, not as shared-memory handles that
        # vanish when this process exits.
        results.put((rank, "ok", pickle.dumps(value)))
        results.close()
        results.join_thread()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        results.close()
        results.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    sys.stdout.flush()
    sys.stderr.flush()


def _dump_stacks(procs: Sequence[Any]) -> None:
    """Make hung ranks print their Python stacks to stderr (``faulthandler`` on SIGUSR1) before they are killed."""
    if not hasattr(signal, "SIGUSR1"):
        return
    for p in procs:
        if p.is_alive() and p.pid:
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except OSError:
                pass
    time.sleep(1.0)


def spawn(
    fn: Callable[..., T],
    nprocs: int,
    *,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    device: str = "cpu",
    backend: str | None = None,
    timeout: float = 600.0,
    env: dict[str, str] | None = None,
) -> list[T]:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` fresh processes forming one process group.

    Args:
        fn: a picklable (module-level) function; its return value must be picklable.
        nprocs: world size.
        device: ``"cpu"`` (gloo) or ``"cuda"`` (nccl, one GPU per rank).
        backend: overrides the backend chosen from ``device``.
        timeout: seconds for the whole run; ranks still running then are killed.
        env: extra environment variables for the children (set before anything is imported there).

    Returns:
        The per-rank return values, index = rank.

    Raises:
        RankFailure: a rank raised (its traceback is included) or exited abnormally.
        RankTimeout: ranks were still running at the deadline.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    job = _Job(fn, tuple(args), dict(kwargs or {}), backend or default_backend(device), device,
               dict(env or {}), timeout)
    for attempt in range(_PORT_ATTEMPTS):
        try:
            return _run_group(job, nprocs, free_port())
        except RankFailure as exc:
            # free_port() cannot reserve the port: another process may take it before rank 0 listens on it.
            taken = any("EADDRINUSE" in tb and "init_process_group" in tb for tb in exc.failures.values())
            if not taken or attempt == _PORT_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


#: Tries with a fresh rendezvous port when the chosen one was taken in the meantime.
_PORT_ATTEMPTS = 3


def _run_group(job: _Job, nprocs: int, port: int) -> list[Any]:
    timeout = job.timeout_s
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(r, nprocs, port, job, results), daemon=False)
             for r in range(nprocs)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}

    def _take(item: tuple[int, str, Any]) -> None:
        rank, status, payload = item
        if status == "ok":
            values[rank] = pickle.loads(payload)
        else:
            failures[rank] = payload

    try:
        while len(values) + len(failures) < nprocs and not failures:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                _dump_stacks([p for r, p in enumerate(procs) if r not in values and r not in failures])
                raise RankTimeout([r for r in range(nprocs) if r not in values and r not in failures], timeout)
            try:
                _take(results.get(timeout=min(remaining, 0.5)))
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(procs) if r not in values and r not in failures and not p.is_alive()]
            if dead:
                try:  # a rank that exited may still have its message in flight
                    _take(results.get(timeout=1.0))
                except queue.Empty:
                    for r in dead:
                        failures[r] = f"process exited with status {procs[r].exitcode} without reporting a result"
        if failures:
            raise RankFailure(failures)
        return [values[r] for r in range(nprocs)]
    finally:
        for p in procs:
            if p.is_alive() and (failures or len(values) < nprocs):
                p.terminate()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
