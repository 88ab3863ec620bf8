"""Run functions on N local processes in one ``torch.distributed`` group, with a deadline.

:func:`spawn` runs one function on fresh processes; :class:`Group` keeps the processes (and their process group)
alive so that many functions run in them one after another: spawning and importing torch and Megatron cost
most of the time of a small run, so the test-suite pays it once per release, not once per test module. Both
report failures with the rank that failed and end a hang with a timeout that names the ranks that never
answered (after asking them for their Python stacks).

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
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from .errors import InvalidArgumentError, McoreCompatError

__all__ = ["Group", "RankFailure", "RankTimeout", "default_backend", "destroy_process_groups_since", "free_port",
           "init_from_env", "process_groups", "spawn"]

T = TypeVar("T")


class RankFailure(McoreCompatError, RuntimeError):
    """One or more ranks raised or died. ``failures`` maps rank -> traceback text (or exit status)."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = dict(sorted(failures.items()))
        first = next(iter(self.failures))
        ranks = ", ".join(str(r) for r in self.failures)
        lines = [ln for ln in self.failures[first].strip().splitlines() if ln.strip()]
        cause = lines[-1].strip() if lines else "no details"
        super().__init__(f"rank(s) {ranks} failed: {cause}\n--- rank {first} ---\n{self.failures[first]}")


class RankTimeout(McoreCompatError, RuntimeError):
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
class _Setup:
    """What every rank of a group is started with."""

    backend: str
    device: str
    env: dict[str, str]
    pg_timeout_s: float
    destroy_subgroups: bool = False


def _flush_and_exit(results: Any, code: int) -> None:
    results.close()
    results.join_thread()  # the last message must leave before the process does
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def process_groups() -> set[Any]:
    """The process groups this process holds now (torch's registry; empty where a torch lacks it)."""
    from torch.distributed import distributed_c10d as c10d

    world = getattr(c10d, "_world", None)
    return set(getattr(world, "pg_map", {}))


def destroy_process_groups_since(before: set[Any]) -> None:
    """Destroy the process groups created since ``before`` (:func:`process_groups`) was taken, never the default
    group. Each gloo group keeps threads alive until destroyed: Megatron's ``initialize_model_parallel`` creates
    dozens, and ``destroy_model_parallel`` only drops its references."""
    import torch.distributed as dist

    gone = [pg for pg in process_groups() - before if pg is not dist.GroupMember.WORLD]
    for pg in gone:
        dist.destroy_process_group(pg)
    # The last reference runs each group's destructor, which joins its threads (~4 ms a group on a busy CPU):
    # drop them on a thread of their own, off the caller's path (the groups are out of torch's registry already).
    threading.Thread(target=gone.clear, name="mcore-compat-destroy-groups", daemon=True).start()


def _child(rank: int, world: int, port: int, setup: _Setup, inbox: Any, results: Any) -> None:
    """One rank: join the process group, then run the jobs of ``inbox`` until it says ``None``."""
    os.environ.update(setup.env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if hasattr(signal, "SIGUSR1"):  # the parent asks a hung rank for its Python stacks before stopping it
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        init_from_env(setup.backend, setup.device, setup.pg_timeout_s)
    except BaseException:
        results.put((rank, 0, "error", traceback.format_exc()))
        _flush_and_exit(results, 1)
    results.put((rank, 0, "ok", pickle.dumps(None)))
    while True:
        message = inbox.get()
        if message is None:
            break
        seq = -1
        try:
            seq, fn, args, kwargs = pickle.loads(message)
            before = process_groups() if setup.destroy_subgroups else set()
            value = fn(*args, **kwargs)
            if setup.destroy_subgroups:
                destroy_process_groups_since(before)
            # Plain pickle (not torch's ForkingPickler): tensors travel by value, not as shared-memory handles
            # that vanish when this process exits.
            results.put((rank, seq, "ok", pickle.dumps(value)))
        except BaseException:
            results.put((rank, seq, "error", traceback.format_exc()))
            _flush_and_exit(results, 1)  # peers may be stuck in a collective: the parent stops the group
    # Leave without tearing down the process group and Python: destroying the hundreds of subgroups Megatron
    # creates over many runs took seconds, and every rank is going away together anyway.
    _flush_and_exit(results, 0)


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


def _stop(procs: Sequence[Any], queues: Sequence[Any]) -> None:
    """Stop ``procs`` (terminate, then kill) and close ``queues``; safe to call twice."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    for q in queues:
        q.cancel_join_thread()  # a job nobody will read must not block this process's exit
        q.close()


#: Tries with a fresh rendezvous port when the chosen one was taken in the meantime.
_PORT_ATTEMPTS = 3


class Group:
    """``nprocs`` local processes forming one ``torch.distributed`` group that run functions one after another.

    The processes start on the first :meth:`run` (or :meth:`start`) and stay until :meth:`close`; every call
    runs its function on all ranks and returns the per-rank values. A rank that raises, dies or hangs stops the
    whole group (its peers may be stuck in a collective) and the call raises :class:`RankFailure` or
    :class:`RankTimeout`; the next call starts fresh processes. A function that leaves state behind (applied
    patches, Megatron's ``parallel_state``) leaves it for the next one: clean up what must not carry over.

    Example::

        with Group(2, device="cpu") as group:
            a = group.run(scenario_a)          # [rank 0 value, rank 1 value]
            b = group.run(scenario_b, args=(3,), timeout=120)

    Args:
        nprocs: world size.
        device: ``"cpu"`` (gloo) or ``"cuda"`` (nccl, one GPU per rank).
        backend: overrides the backend chosen from ``device``.
        env: extra environment variables for the ranks (set before anything is imported there).
        pg_timeout: the process group's own timeout for collectives, in seconds.
        destroy_subgroups: after every run, destroy the process groups the run created. Megatron creates dozens
            per ``initialize_model_parallel`` and ``destroy_model_parallel`` only forgets them; gloo keeps three
            threads for each, so a long-lived group of ranks collects thousands of threads. The run must not
            leave anything that uses them (end it with ``destroy_model_parallel``).
    """

    def __init__(self, nprocs: int, *, device: str = "cpu", backend: str | None = None,
                 env: dict[str, str] | None = None, pg_timeout: float = 600.0,
                 destroy_subgroups: bool = False) -> None:
        if nprocs < 1:
            raise InvalidArgumentError(f"nprocs must be >= 1, got {nprocs}")
        self.nprocs = nprocs
        self._setup = _Setup(backend or default_backend(device), device, dict(env or {}), pg_timeout,
                             destroy_subgroups)
        self._procs: list[Any] = []
        self._inboxes: list[Any] = []
        self._results: Any = None
        self._seq = 0
        self._finalizer: Any = None
        #: How many times processes were started (1 for a group that never failed).
        self.starts = 0

    @property
    def device(self) -> str:
        """``"cpu"`` or ``"cuda"``, as given."""
        return self._setup.device

    @property
    def started(self) -> bool:
        """Whether the ranks are running."""
        return bool(self._procs)

    @property
    def pids(self) -> list[int]:
        """Process ids of the ranks (empty before the start)."""
        return [p.pid for p in self._procs]

    def start(self, timeout: float = 600.0) -> None:
        """Start the ranks and wait until all joined the process group (a no-op when running)."""
        deadline = time.monotonic() + timeout
        for attempt in range(_PORT_ATTEMPTS):
            if self.started:
                return
            self._launch(free_port())
            try:
                self._collect(0, deadline, timeout)
                self.starts += 1
                return
            except RankFailure as exc:
                # free_port() cannot reserve the port: another process may take it before rank 0 listens on it.
                taken = any("EADDRINUSE" in tb and "init_process_group" in tb for tb in exc.failures.values())
                if not taken or attempt == _PORT_ATTEMPTS - 1:
                    raise

    def run(self, fn: Callable[..., T], *, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
            timeout: float = 600.0) -> list[T]:
        """Run ``fn(*args, **kwargs)`` on every rank; returns the values, index = rank.

        Args:
            fn: a picklable (module-level) function; its return value must be picklable.
            timeout: seconds for this call, including the start of the ranks if they are not running.

        Raises:
            RankFailure: a rank raised (its traceback is included) or exited abnormally; the group is stopped.
            RankTimeout: ranks were still running at the deadline; the group is stopped.
        """
        deadline = time.monotonic() + timeout
        message = pickle.dumps((self._seq + 1, fn, tuple(args), dict(kwargs or {})))  # unpicklable: raises here
        self.start(timeout)
        self._seq += 1
        for inbox in self._inboxes:
            inbox.put(message)
        return self._collect(self._seq, deadline, timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Ask the ranks to leave the process group and exit; stop those that do not within ``timeout``."""
        if not self.started:
            return
        for inbox in self._inboxes:
            inbox.put(None)
        end = time.monotonic() + timeout
        for p in self._procs:
            p.join(timeout=max(0.1, end - time.monotonic()))
        self._teardown()

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------ internals
    def _launch(self, port: int) -> None:
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(self.nprocs)]
        self._procs = [ctx.Process(target=_child, args=(r, self.nprocs, port, self._setup, self._inboxes[r],
                                                        self._results), daemon=False)
                       for r in range(self.nprocs)]
        for p in self._procs:
            p.start()
        # Stops the ranks if the owner forgets close() (at garbage collection or interpreter exit).
        self._finalizer = weakref.finalize(self, _stop, list(self._procs), [*self._inboxes, self._results])

    def _teardown(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # runs _stop once
        self._procs, self._inboxes, self._results, self._finalizer = [], [], None, None

    def _collect(self, seq: int, deadline: float, timeout: float) -> list[Any]:
        """Wait for every rank's answer to message ``seq``; on a failure or at the deadline stop the group."""
        values: dict[int, Any] = {}
        failures: dict[int, str] = {}
        procs = self._procs

        def take(item: tuple[int, int, str, Any]) -> None:
            rank, got, status, payload = item
            if status == "ok" and got == seq:
                values[rank] = pickle.loads(payload)
            elif status != "ok":
                failures[rank] = payload

        def pending() -> list[int]:
            return [r for r in range(self.nprocs) if r not in values and r not in failures]

        try:
            while pending() and not failures:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    _dump_stacks([procs[r] for r in pending()])
                    raise RankTimeout(pending(), timeout)
                try:
                    take(self._results.get(timeout=min(remaining, 0.5)))
                    continue
                except queue.Empty:
                    pass
                dead = [r for r in pending() if not procs[r].is_alive()]
                if dead:
                    try:  # a rank that exited may still have its message in flight
                        take(self._results.get(timeout=1.0))
                    except queue.Empty:
                        for r in dead:
                            failures[r] = f"process exited with status {procs[r].exitcode} without reporting a result"
        except BaseException:
            self._teardown()
            raise
        if failures:
            self._teardown()
            raise RankFailure(failures)
        return [values[r] for r in range(self.nprocs)]


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
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` fresh processes forming one process group (a :class:`Group`
    used once).

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
    with Group(nprocs, device=device, backend=backend, env=env, pg_timeout=timeout) as group:
        return group.run(fn, args=args, kwargs=kwargs, timeout=timeout)
