"""Run functions on N local processes in one ``torch.distributed`` group, with a deadline.

:func:`spawn` runs one function on fresh processes; :class:`Group` keeps the processes (and their process group)
alive so that many functions run in them one after another: spawning and importing torch and Megatron cost
most of the time of a small run, so the test-suite pays it once per release, not once per test module. Both
report failures with the rank that failed and end a hang with a timeout that names the ranks that never
answered, with each one's Python stacks (collected per rank, not interleaved on a shared stderr). The timeout of a
call starts once the ranks are up (processes started, torch imported, the process group joined, the optional
``init`` run); the start-up has a limit of its own (``start_timeout``).

The ranks are fresh Python processes (multiprocessing's ``spawn`` start method), which import the caller's main
script again: a script must start ranks only under ``if __name__ == "__main__":``. A script that does not is
told so in one message (:class:`RankFailure`), instead of multiprocessing's bootstrap error.

A :class:`Group` made with ``warm=("module", ...)`` forks its ranks instead, from a fork server that imported those
modules once (multiprocessing's ``forkserver`` with a preload list): a test suite that starts ranks many times pays
the import of torch and Megatron once per process, not once per rank. CPU only (a process that touched CUDA
cannot be forked); the plain ``spawn`` path stays the default, and :func:`spawn` and the self-check use it.

Every start of ranks is recorded (:func:`start_log`): how many, how, how long, and how much of it the ranks spent
importing torch.

Under ``torchrun`` (``RANK``/``WORLD_SIZE`` in the environment) use :func:`init_from_env` instead, and end the
script with :func:`end_job`.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import random
import signal
import socket
import sys
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, TypeVar

from ._util.groups import destroy_model_parallel_since, destroy_process_groups_since, end_job, process_groups
from ._util.processes import PORT_FLOOR, dump_stacks, ephemeral_low, fork_server_context, stop_processes
from .errors import InvalidArgumentError, McoreCompatError

__all__ = ["Group", "RankFailure", "RankTimeout", "StartRecord", "check_not_bootstrapping", "default_backend",
           "destroy_model_parallel_since", "destroy_process_groups_since", "end_job", "free_port",
           "gather_objects", "init_from_env", "process_groups", "spawn", "start_log"]

T = TypeVar("T")


#: The exit status of a rank that found itself re-running the caller's main script (no ``__main__`` guard).
_NO_MAIN_GUARD_EXIT = 87
_NO_MAIN_GUARD = (
    "the ranks could not start: they are fresh Python processes (multiprocessing's 'spawn'), which import the "
    "main script again, and that script starts ranks at import time. Put the call (mcore_compat.selfcheck.run, "
    "mcore_compat.launch.spawn or Group) under `if __name__ == \"__main__\":`."
)


#: Seconds a group waits, after a rank's failure, for the other ranks' failures before it stops them (so that a
#: load error raised on every rank names every rank, not only the first to report).
_FAILURE_GRACE_S = 1.0


class RankFailure(McoreCompatError, RuntimeError):
    """One or more ranks raised or died. ``failures`` maps rank -> traceback text (or exit status).

    ``str()`` is the one-line :attr:`summary` followed by the first failing rank's traceback.
    """

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = dict(sorted(failures.items()))
        first = next(iter(self.failures))
        super().__init__(f"{self.summary}\n--- rank {first} ---\n{self.failures[first]}")

    @property
    def summary(self) -> str:
        """``rank(s) 0, 1 failed: <the last line of the first failing rank's traceback>``."""
        first = next(iter(self.failures))
        ranks = ", ".join(str(r) for r in self.failures)
        lines = [ln for ln in self.failures[first].strip().splitlines() if ln.strip()]
        cause = lines[-1].strip() if lines else "no details"
        return f"rank(s) {ranks} failed: {cause}"


class RankTimeout(McoreCompatError, RuntimeError):
    """Ranks did not finish within the deadline.

    Attributes:
        ranks: those that never answered.
        stacks: rank -> its Python stacks (every thread) when it was stopped, for the ranks that wrote them.
        starting: the ranks were still starting (the start-up limit ran out, not the call's).
    """

    def __init__(self, ranks: Sequence[int], timeout: float, stacks: dict[int, str] | None = None,
                 starting: bool = False) -> None:
        self.ranks = list(ranks)
        self.stacks = dict(sorted((stacks or {}).items()))
        self.starting = starting
        what = "did not start" if starting else "did not finish"
        hint = "Raise start_timeout" if starting else "Raise --timeout (seconds once the ranks are up)"
        self.summary = (f"rank(s) {', '.join(map(str, self.ranks))} {what} within {timeout:g} s (hung or too "
                        f"slow); all ranks were stopped. {hint} if the run is merely slow.")
        text = self.summary
        for rank, stack in self.stacks.items():
            text += f"\n--- rank {rank}: Python stacks when stopped ---\n{stack.rstrip()}"
        super().__init__(text)


def check_not_bootstrapping() -> None:
    """Refuse to start ranks from a process that is itself still being started by multiprocessing's ``spawn``
    (the caller's main script, imported again in a rank, starting ranks at import time).

    In such a process this exits at once with a status the parent recognises (:class:`RankFailure` then says to
    use ``if __name__ == "__main__":``), instead of multiprocessing's bootstrap error in every rank.
    """
    if getattr(mp.current_process(), "_inheriting", False):
        raise SystemExit(_NO_MAIN_GUARD_EXIT)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, outside the kernel's ephemeral range where the kernel tells it.

    The port cannot be reserved: the caller binds it later (a rendezvous store, rank 0's process group). A port
    the kernel handed out for ``bind(port 0)`` is an ephemeral one, which any outgoing connection of any process
    (gloo's, another job's) may be given meanwhile; below the ephemeral range (Linux:
    ``/proc/sys/net/ipv4/ip_local_port_range``) only an explicit bind can take it. Falls back to the kernel's
    choice where the range cannot be read or nothing below it is free."""
    low = ephemeral_low()
    if low is not None and low > PORT_FLOOR + 1000:
        rng = random.Random()  # not the caller's seeded global stream: two jobs must not draw the same ports
        for _ in range(64):
            port = rng.randrange(PORT_FLOOR, low)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """``torch.distributed.all_gather_object`` of ``obj`` over ``group`` (default: the world), as a list by group
    rank; ``[obj]`` without a process group, and a group of one answers without a collective (NCCL's object gather
    syncs the host several times even then). The process group's own errors (a rank that died) propagate."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    size = dist.get_world_size(group)
    if size == 1:
        return [obj]
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


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
    init: Callable[[], Any] | None = None
    stack_dir: str | None = None


@dataclass(frozen=True)
class StartRecord:
    """One start of a group's ranks (:func:`start_log`).

    Attributes:
        nprocs: ranks started.
        method: ``"spawn"`` (fresh interpreters) or ``"forkserver"`` (forked from a warm server).
        seconds: from the first process start until every rank had joined the process group and run ``init``.
        import_seconds: the longest time a rank spent importing torch and ``torch.distributed`` (near 0 for a
            forked rank, which has them already).
        init_seconds: the longest time a rank spent in the group's ``init`` function (0 without one).
    """

    nprocs: int
    method: str
    seconds: float
    import_seconds: float
    init_seconds: float


_STARTS: list[StartRecord] = []


def start_log() -> list[StartRecord]:
    """Every start of ranks by a :class:`Group` (or :func:`spawn`) of this process, oldest first."""
    return list(_STARTS)


def _flush_and_exit(results: Any, code: int) -> None:
    quiet = sys.modules.get("mcore_compat.quiet")
    if quiet is not None:  # os._exit below runs no atexit handler: the folded warnings' line is said here
        quiet._summary()
    results.close()
    results.join_thread()  # the last message must leave before the process does
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


#: This rank's file for its Python stacks (kept open: ``faulthandler`` writes to its descriptor).
_STACK_FILE: Any = None


def _child(rank: int, world: int, port: int, setup: _Setup, inbox: Any, results: Any) -> None:
    """One rank: join the process group, then run the jobs of ``inbox`` until it says ``None``."""
    os.environ.update(setup.env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if hasattr(signal, "SIGUSR1"):  # the parent asks a hung rank for its Python stacks before stopping it
        global _STACK_FILE
        if setup.stack_dir:  # one file per rank: stacks written to a shared stderr interleave
            _STACK_FILE = open(os.path.join(setup.stack_dir, f"rank{rank}.txt"), "w")
        faulthandler.register(signal.SIGUSR1, file=_STACK_FILE or sys.stderr, all_threads=True)
    try:
        started = time.monotonic()
        import torch.distributed  # noqa: F401  (timed apart: the start log tells imports from the rest)

        imported = time.monotonic()
        init_from_env(setup.backend, setup.device, setup.pg_timeout_s)
        joined = time.monotonic()
        if setup.init is not None:
            setup.init()
        timing = {"import_seconds": imported - started, "init_seconds": time.monotonic() - joined}
    except BaseException:
        results.put((rank, 0, "error", traceback.format_exc()))
        _flush_and_exit(results, 1)
    results.put((rank, 0, "ok", pickle.dumps(timing)))
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
        init: a picklable function every rank runs once at start-up, after joining the process group (e.g. import
            Megatron): part of the start, not of any :meth:`run`'s timeout.
        start_timeout: seconds the ranks may take to start (processes, torch, process group, ``init``).
        warm: modules to import ONCE in a fork server from which the ranks are then forked (CPU only), instead of
            starting every rank as a fresh interpreter that imports them again. Importing a module there must
            not start threads or touch CUDA. Every warm Group of a process shares one server (same modules). The
            modules are imported before ``env`` applies: they must not read it at import.
        destroy_subgroups: after every run, destroy the process groups the run created. Megatron creates dozens
            per ``initialize_model_parallel`` and ``destroy_model_parallel`` only forgets them; gloo keeps three
            threads for each, so a long-lived group of ranks collects thousands of threads. The run must not
            leave anything that uses them (end it with ``destroy_model_parallel``).
    """

    def __init__(self, nprocs: int, *, device: str = "cpu", backend: str | None = None,
                 env: dict[str, str] | None = None, pg_timeout: float = 600.0,
                 destroy_subgroups: bool = False, init: Callable[[], Any] | None = None,
                 start_timeout: float = 600.0, warm: Sequence[str] = ()) -> None:
        if nprocs < 1:
            raise InvalidArgumentError(f"nprocs must be >= 1, got {nprocs}")
        if warm and device == "cuda":
            raise InvalidArgumentError("warm ranks are forked, and a process cannot be forked once CUDA is in use: "
                                       "use warm=() with device='cuda'")
        self._warm = tuple(warm)
        self.nprocs = nprocs
        self.start_timeout = start_timeout
        self._setup = _Setup(backend or default_backend(device), device, dict(env or {}), pg_timeout,
                             destroy_subgroups, init)
        self._procs: list[Any] = []
        self._inboxes: list[Any] = []
        self._results: Any = None
        self._seq = 0
        self._finalizer: Any = None
        self._stack_dir: str | None = None
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

    def start(self, timeout: float | None = None) -> None:
        """Start the ranks and wait until all joined the process group and ran ``init`` (a no-op when running).

        Args:
            timeout: seconds for the start (default: ``start_timeout``).

        Raises:
            RankFailure: a rank failed to start (or the caller's script lacks its ``__main__`` guard).
            RankTimeout: the ranks did not start in time (``starting`` is set; their stacks are included).
        """
        check_not_bootstrapping()
        timeout = self.start_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        for attempt in range(_PORT_ATTEMPTS):
            if self.started:
                return
            began = time.monotonic()
            self._launch(free_port())
            try:
                timings = self._collect(0, deadline, timeout)
                self.starts += 1
                _STARTS.append(StartRecord(
                    self.nprocs, "forkserver" if self._warm else "spawn", time.monotonic() - began,
                    max(t["import_seconds"] for t in timings), max(t["init_seconds"] for t in timings)))
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
            timeout: seconds for this call, counted once the ranks are up (a start they need first has its own
                limit, ``start_timeout``).

        Raises:
            RankFailure: a rank raised (its traceback is included) or exited abnormally; the group is stopped.
            RankTimeout: ranks were still running at the deadline (their Python stacks, per rank, are included);
                the group is stopped.
        """
        message = pickle.dumps((self._seq + 1, fn, tuple(args), dict(kwargs or {})))  # unpicklable: raises here
        self.start()
        deadline = time.monotonic() + timeout
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
        ctx = fork_server_context(self._warm) if self._warm else mp.get_context("spawn")
        stack_dir = tempfile.mkdtemp(prefix="mcore-compat-stacks-")
        setup = replace(self._setup, stack_dir=stack_dir)
        results = ctx.Queue()
        inboxes = [ctx.Queue() for _ in range(self.nprocs)]
        procs = [ctx.Process(target=_child, args=(r, self.nprocs, port, setup, inboxes[r], results), daemon=False)
                 for r in range(self.nprocs)]
        started = []
        try:
            for p in procs:
                p.start()
                started.append(p)
        except BaseException:
            stop_processes(started, [*inboxes, results], stack_dir)  # never join a process that did not start
            raise
        self._procs, self._inboxes, self._results, self._stack_dir = procs, inboxes, results, stack_dir
        # Stops the ranks if the owner forgets close() (at garbage collection or interpreter exit).
        self._finalizer = weakref.finalize(self, stop_processes, list(procs), [*inboxes, results], stack_dir)

    def _teardown(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # runs stop_processes once
        self._procs, self._inboxes, self._results, self._finalizer = [], [], None, None
        self._stack_dir = None

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
                    stacks = dump_stacks({r: procs[r] for r in pending()}, self._stack_dir)
                    raise RankTimeout(pending(), timeout, stacks, starting=seq == 0)
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
                            code = procs[r].exitcode
                            failures[r] = _NO_MAIN_GUARD if code == _NO_MAIN_GUARD_EXIT else (
                                f"process exited with status {code} without reporting a result")
            # the others may be failing too (a load error raised on every rank): their reports, if they come
            # within a short grace, are named with the first; a rank still waiting in a collective is not
            grace = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
            while failures and pending() and time.monotonic() < grace:
                try:
                    take(self._results.get(timeout=max(0.01, min(grace - time.monotonic(), 0.2))))
                except queue.Empty:
                    pass
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
    init: Callable[[], Any] | None = None,
    start_timeout: float = 600.0,
) -> list[T]:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` fresh processes forming one process group (a :class:`Group`
    used once).

    Args:
        fn: a picklable (module-level) function; its return value must be picklable.
        nprocs: world size.
        device: ``"cpu"`` (gloo) or ``"cuda"`` (nccl, one GPU per rank).
        backend: overrides the backend chosen from ``device``.
        timeout: seconds for ``fn``, counted once the ranks are up; ranks still running then are killed (their
            Python stacks, per rank, are in the :class:`RankTimeout`).
        env: extra environment variables for the children (set before anything is imported there).
        init: run once in every rank at start-up, before ``fn`` (see :class:`Group`).
        start_timeout: seconds the ranks may take to start.

    Returns:
        The per-rank return values, index = rank.

    Raises:
        RankFailure: a rank raised (its traceback is included) or exited abnormally.
        RankTimeout: ranks were still running at the deadline.
    """
    with Group(nprocs, device=device, backend=backend, env=env, pg_timeout=max(timeout, start_timeout), init=init,
               start_timeout=start_timeout) as group:
        return group.run(fn, args=args, kwargs=kwargs, timeout=timeout)
