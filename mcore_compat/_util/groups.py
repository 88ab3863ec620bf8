"""A job's process groups: the groups this process holds, destroying those a run created, and the end of a
``torchrun`` rank (:func:`end_job`). Re-exported by :mod:`mcore_compat.launch`, where they are documented."""

from __future__ import annotations

import os
import sys
import threading
from datetime import timedelta
from typing import Any, NoReturn


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
    # Not a daemon: the interpreter waits for it before it finalizes. A daemon thread still inside a destructor
    # then (it runs without the GIL, and takes it back at the end) is ended by Python through the C++ frames, and
    # the process aborts: "terminate called without an active exception", SIGABRT, in every rank of a job whose
    # last act was this call (tests/test_launch.py).
    threading.Thread(target=gone.clear, name="mcore-compat-destroy-groups", daemon=False).start()


def destroy_model_parallel_since(before: set[Any]) -> None:
    """Undo ``initialize_model_parallel`` and every group created since ``before`` (:func:`process_groups`): for
    code that builds models with different layouts one after another in the same processes (tests, a sweep, an RL
    job switching between training and generation layouts). Call it on every rank, after a barrier.

    Megatron's ``destroy_model_parallel`` runs first: 0.9.0 destroys its gloo data-parallel group there without
    checking that it still exists (``parallel_state.py``), so it must run while that group does; it only forgets the
    other groups, which :func:`destroy_process_groups_since` then destroys (their threads would pile up otherwise).
    """
    from .. import symbols

    symbols.resolve("parallel_state").destroy_model_parallel()
    destroy_process_groups_since(before)


def end_job(code: int = 0, *, timeout_s: float = 300.0) -> NoReturn:
    """End this rank of a ``torchrun`` job: the last call of the script, on every rank.

    With ``code`` 0 the rank first waits for every other rank (a barrier; on gloo torch's ``monitored_barrier``,
    which names the ranks that did not arrive within ``timeout_s``, and the rank then exits 1), then destroys
    Megatron's model parallelism and every process group. With another ``code`` (this rank failed; its peers may be
    stuck in a collective) it skips both. Then the threads the interpreter would wait for are joined, the
    ``atexit`` handlers run, standard output and error are flushed, and the process exits with ``code`` without
    the interpreter's finalization.

    Why not just return: torch's gloo backend releases a collective's tensors on its own worker thread, after the
    caller has seen the collective finish. When that happens after the interpreter began to finalize, the worker
    thread is ended by Python while inside torch's C++ frames and the process aborts ("terminate called without an
    active exception", SIGABRT, with rank 0's results already printed); torchrun then reports the job failed.
    Measured on 2 torchrun agents of 1 rank on a loaded 2-core machine: 6 jobs of 95 ending with
    ``torch.distributed.destroy_process_group()`` aborted (the groups Megatron and the model hold outlive it), 0
    of 120 ending with this (docs/launch.md). Not for a Ray actor, which Ray ends itself.
    """
    import atexit

    rank = os.environ.get("RANK", "?")
    try:
        import torch.distributed as dist

        if code == 0 and dist.is_available() and dist.is_initialized():
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=timedelta(seconds=timeout_s))
            else:
                dist.barrier()
            if "megatron.core" in sys.modules:  # (a job that never imported Megatron does not import it now)
                from .. import symbols

                symbols.resolve("parallel_state").destroy_model_parallel()
            dist.destroy_process_group()
    except Exception as exc:  # a peer gone or late: say so, and end non-zero
        first = (str(exc).splitlines() or [""])[0]
        print(f"rank {rank}: the job's end failed: {type(exc).__name__}: {first}", file=sys.stderr, flush=True)
        code = code or 1
    for thread in threading.enumerate():  # what the interpreter would join before its atexit handlers
        if thread not in (threading.current_thread(), threading.main_thread()) and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
