"""The local ranks' processes as :mod:`mcore_compat.launch` manages them: the warm fork server (one per process),
the Python stacks of hung ranks (one file per rank), stopping a group's processes and queues, and the ports
:func:`~mcore_compat.launch.free_port` draws from."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import time
from collections.abc import Sequence
from typing import Any

from ..errors import InvalidArgumentError

#: The modules the fork server of this process preloads (``None``: not started by a warm group yet).
_FORK_SERVER_MODULES: tuple[str, ...] | None = None


def fork_server_context(modules: tuple[str, ...]) -> Any:
    """multiprocessing's ``forkserver`` context, its server preloading ``modules`` (one server per process)."""
    global _FORK_SERVER_MODULES
    ctx = mp.get_context("forkserver")
    if _FORK_SERVER_MODULES is None:
        ctx.set_forkserver_preload(list(modules))
        _FORK_SERVER_MODULES = modules
    elif _FORK_SERVER_MODULES != modules:
        raise InvalidArgumentError(
            f"this process already has a fork server warmed with {list(_FORK_SERVER_MODULES)}; a Group asks for "
            f"{list(modules)} (one fork server per process: give every warm Group the same modules)")
    return ctx


def dump_stacks(procs: dict[int, Any], stack_dir: str | None) -> dict[int, str]:
    """Ask hung ranks for their Python stacks (``faulthandler`` on SIGUSR1) before they are killed; returns rank ->
    stacks, read from each rank's own file."""
    if not hasattr(signal, "SIGUSR1"):
        return {}
    asked = []
    for rank, p in procs.items():
        if p.is_alive() and p.pid:
            try:
                os.kill(p.pid, signal.SIGUSR1)
                asked.append(rank)
            except OSError:
                pass
    if not stack_dir:
        time.sleep(1.0)
        return {}
    stacks: dict[int, str] = {}
    sizes: dict[int, int] = {}
    end = time.monotonic() + 3.0
    while time.monotonic() < end:  # until every file has stopped growing
        time.sleep(0.2)
        now = {r: _size(os.path.join(stack_dir, f"rank{r}.txt")) for r in asked}
        if now == sizes and all(now.values()):
            break
        sizes = now
    for r in asked:
        try:
            with open(os.path.join(stack_dir, f"rank{r}.txt"), encoding="utf-8", errors="replace") as fh:
                text = fh.read()
        except OSError:
            continue
        if text.strip():
            stacks[r] = text
    return stacks


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def stop_processes(procs: Sequence[Any], queues: Sequence[Any], stack_dir: str | None = None) -> None:
    """Stop ``procs`` (terminate, then kill), close ``queues`` and remove ``stack_dir``; safe to call twice."""
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
    if stack_dir:
        shutil.rmtree(stack_dir, ignore_errors=True)


#: The lowest port :func:`free_port` draws (above the registered services most hosts run).
PORT_FLOOR = 20000


def ephemeral_low() -> int | None:
    """The first port of the kernel's ephemeral range, or ``None`` where it cannot be read (not Linux)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
