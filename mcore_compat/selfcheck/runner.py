"""Run the self-check: spawn local ranks (``--nproc``) or join a ``torchrun`` launch, and merge the verdicts."""

from __future__ import annotations

import functools
import importlib
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from typing import Any

from ..errors import McoreCompatError
from ..launch import Group, RankFailure, RankTimeout, check_not_bootstrapping, gather_objects, spawn
from ..preflight import require
from . import noise
from .options import SelfCheckOptions, UsageError
from .report import Check, Report, merge_rank_checks

__all__ = ["run", "run_sweep", "standard_sweep"]


class _SweepStopped(McoreCompatError):
    """A configuration of a sweep failed on this rank and the sweep cannot go on (a peer may wait in a collective
    this rank never joins); the rank ends, and the launcher reports it as a :class:`RankFailure`."""


def _under_torchrun(opts: SelfCheckOptions) -> bool:
    return opts.nproc is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _start_rank(device: str) -> None:
    """At a spawned rank's start-up (before the timeout counts): record warnings instead of printing them, apply
    the patches the device needs and import Megatron, so that ``--timeout`` measures the check itself."""
    from .. import patches

    noise.capture()
    patches.apply_for_device(device)
    importlib.import_module("megatron.core")


def _spawned_rank(opts: SelfCheckOptions) -> tuple[list[Check], dict[str, Any], list[tuple[str, str, str]]]:
    from .worker import run_rank

    checks, env = run_rank(opts)
    return checks, env, noise.drain()


def _failed(report: Report, exc: RankFailure | RankTimeout) -> None:
    """A run that did not finish: one line of error, the tracebacks (``--debug``) or the hung ranks' stacks."""
    report.error = exc.summary
    if isinstance(exc, RankFailure):
        report.tracebacks = {r: t for r, t in exc.failures.items() if "Traceback" in t}
    else:
        report.stacks = dict(exc.stacks)


def _watchdog(timeout: float) -> threading.Timer:
    """Under torchrun: end this rank after ``timeout`` seconds, naming it, so a hang cannot last forever."""

    def _expire() -> None:
        rank = os.environ.get("RANK", "?")
        print(f"self-check: FAIL (rank {rank} did not finish within {timeout:g} s; stopping)", flush=True)
        os._exit(124)

    timer = threading.Timer(timeout, _expire)
    timer.daemon = True
    timer.start()
    return timer


def run(options: SelfCheckOptions | None = None, **overrides: Any) -> Report:
    """Run the self-check and return its :class:`Report` (``report.ok`` tells the verdict).

    Args:
        options: the settings; keyword ``overrides`` build or replace them (``run(nproc=2, dtype="bf16")``).

    Raises:
        UsageError: the options cannot work together.
        UnusableEnvironmentError: megatron-core is missing, its version cannot be told, it is older than every
            supported release, or the environment breaks its limits (checked before any rank starts;
            :mod:`mcore_compat.preflight`).
    """
    check_not_bootstrapping()
    require(allow_untested=True)
    opts = replace(options or SelfCheckOptions(), **overrides) if overrides else (options or SelfCheckOptions())
    torchrun = _under_torchrun(opts)
    opts = opts.resolved()
    from . import models

    why = models.unsupported_reason(opts)
    if why is not None:
        from ..detect import detect

        raise UsageError(f"megatron-core {detect().version} cannot run {opts.label()}: {why}")
    settings = {k: v for k, v in opts.as_dict().items() if k not in ("timeout",)}
    settings["nproc"] = opts.world_size()  # under torchrun: its world size, not the unset --nproc
    report = Report(settings=settings)
    if torchrun:

        from ..launch import init_from_env
        from .worker import run_rank

        init_from_env(device=opts.device or "cpu", timeout_s=max(opts.timeout, 600.0))
        try:
            _start_rank(opts.device or "cpu")  # as a spawned rank's start-up: not counted by the watchdog
            timer = _watchdog(opts.timeout)
            try:
                checks, env = run_rank(opts)
                gathered = gather_objects((checks, noise.drain()))
            finally:
                timer.cancel()
        finally:
            noise.release()
        report.checks = merge_rank_checks([c for c, _ in gathered])
        report.warnings = noise.merge([w for _, w in gathered])
        report.environment = env
        return report
    device = opts.device or "cpu"
    try:
        per_rank = spawn(_spawned_rank, opts.nproc or 1, args=(opts,), device=device, timeout=opts.timeout,
                         init=functools.partial(_start_rank, device))
    except (RankFailure, RankTimeout) as exc:
        _failed(report, exc)
        return report
    report.checks = merge_rank_checks([checks for checks, _, _ in per_rank])
    report.warnings = noise.merge([w for _, _, w in per_rank])
    report.environment = per_rank[0][1]
    return report


#: How long a rank whose configuration raised waits for its peers before it ends the sweep.
_PEER_WAIT = timedelta(seconds=60)


@contextmanager
def _gloo_groups_reused() -> Iterator[set[Any]]:
    """While a sweep runs its configurations one after another in the same ranks: a gloo process group asked for
    again with the same ranks and settings is the one created the first time.

    Megatron's ``initialize_model_parallel`` creates about 30 groups per configuration (``new_group``, looked up
    on ``torch.distributed`` at each call in every release), and gloo builds each with a rendezvous through the
    store and three threads: measured on 0.12.3, 6 % of a CPU sweep. The groups the sweep keeps are yielded (the
    per-configuration clean-up leaves them); the sweep's end destroys them. Only without ``pg_options`` on a gloo
    world: NCCL groups (GPUs) are never shared. Every rank runs the same configurations in the same order, so the
    ranks find or create each group together, as ``new_group`` requires.
    """
    import torch.distributed as dist

    real = dist.new_group
    cache: dict[tuple[Any, ...], Any] = {}
    kept: set[Any] = set()

    def new_group(ranks: Any = None, timeout: Any = None, backend: Any = None, pg_options: Any = None,
                  **kwargs: Any) -> Any:
        extra = {k: v for k, v in kwargs.items() if k != "group_desc"}
        # Megatron destroys its explicitly-gloo groups (the *_GLOO data-parallel ones, backend="gloo") in
        # destroy_model_parallel (0.9+): only default-backend groups, which it never destroys, are shared.
        if backend is not None or pg_options is not None or dist.get_backend() != "gloo" or \
                any(v not in (None, False) for v in extra.values()):
            return real(ranks, timeout=timeout, backend=backend, pg_options=pg_options, **kwargs)
        key = (None if ranks is None else tuple(ranks), timeout)
        if key not in cache:
            group = real(ranks, timeout=timeout, **kwargs)
            cache[key] = group
            kept.add(group)
        return cache[key]

    dist.new_group = new_group  # type: ignore[assignment]
    try:
        yield kept
    finally:
        dist.new_group = real


def _spawned_sweep(configs: list[SelfCheckOptions]) -> tuple[list[tuple[list[Check], dict[str, Any], str | None]],
                                                              list[tuple[str, str, str]]]:
    from ..launch import destroy_process_groups_since, process_groups

    before = process_groups()
    try:
        with _gloo_groups_reused() as kept:
            return _sweep_configs(configs, kept)
    finally:
        destroy_process_groups_since(before)


def _sweep_configs(configs: list[SelfCheckOptions], kept: set[Any]
                   ) -> tuple[list[tuple[list[Check], dict[str, Any], str | None]], list[tuple[str, str, str]]]:
    import traceback

    import torch.distributed as dist

    from ..launch import destroy_process_groups_since, process_groups
    from . import progress
    from .worker import run_rank

    out: list[tuple[list[Check], dict[str, Any], str | None]] = []
    for index, opts in enumerate(configs):
        progress.note(f"configuration {index + 1}/{len(configs)}: {opts.label()}")
        before = process_groups()
        try:
            checks, env = run_rank(opts)
            out.append((checks, env, None))
            dist.barrier()
            destroy_process_groups_since(before | kept)  # the configuration's own groups (not the shared ones)
        except Exception as exc:
            out.append(([], {}, traceback.format_exc()))
            try:  # leave parallel_state clean for the next configuration
                from .. import symbols

                symbols.resolve("parallel_state").destroy_model_parallel()
            except Exception:
                pass
            # Did every rank get here? A peer may be stuck in a collective this rank never joined: then stop the
            # sweep now (the launcher ends the other ranks) instead of hanging until the timeout.
            if dist.get_backend() != "gloo":
                raise _SweepStopped(f"configuration {index} ({opts.as_dict()}) failed on this rank") from exc
            try:
                dist.monitored_barrier(timeout=_PEER_WAIT)
            except RuntimeError as stuck:
                raise _SweepStopped(f"configuration {index} ({opts.as_dict()}) failed on this rank and its peers "
                                    f"did not follow ({stuck})") from exc
            destroy_process_groups_since(before | kept)
    return out, noise.drain()


def run_sweep(configs: list[SelfCheckOptions], nproc: int, *, device: str | None = None,
              timeout: float = 900.0, group: Group | None = None) -> list[Report]:
    """Run several self-check configurations inside ONE group of ``nproc`` spawned ranks.

    Spawning processes and importing torch/Megatron dominate a small self-check, so the test matrix checks all
    its configurations this way. Every configuration must fit the world size (``tp*pp*dp == nproc``).

    ``group``: run in these already running ranks (a :class:`mcore_compat.launch.Group` of ``nproc`` ranks on
    ``device``) instead of fresh ones; the patches the self-check applies stay applied there.

    Returns:
        One :class:`Report` per configuration, in order. A configuration that raised on some rank gets
        ``report.error`` set; a rank that dies or hangs fails every report of the sweep (named ranks). The ranks'
        warnings are in the first report (``report.warnings``).

    Raises:
        UsageError: ``group`` does not match ``nproc`` and the device.
        UnusableEnvironmentError: see :func:`run` (checked before any rank starts).
    """
    check_not_bootstrapping()
    require(allow_untested=True)
    resolved = [replace(c, nproc=nproc, device=device or c.device).resolved() for c in configs]
    reports = [Report(settings={k: v for k, v in c.as_dict().items() if k != "timeout"}) for c in resolved]
    run_on = resolved[0].device or "cpu"
    if group is not None and (group.nprocs != nproc or group.device != run_on):
        raise UsageError(f"run_sweep: the group has {group.nprocs} rank(s) on {group.device!r}, the sweep asks for "
                         f"{nproc} on {run_on!r}; pass a Group(nproc, device=...) that matches, or no group")
    try:
        if group is not None:
            answers = group.run(_spawned_sweep, args=(resolved,), timeout=timeout)
        else:
            answers = spawn(_spawned_sweep, nproc, args=(resolved,), device=run_on, timeout=timeout,
                            init=functools.partial(_start_rank, run_on))
    except (RankFailure, RankTimeout) as exc:
        for r in reports:
            _failed(r, exc)
        return reports
    per_rank = [results for results, _ in answers]
    if reports:
        reports[0].warnings = noise.merge([w for _, w in answers])
    for i, report in enumerate(reports):
        errors = [(rank, res[i][2]) for rank, res in enumerate(per_rank) if res[i][2]]
        if errors:
            rank, tb = errors[0]
            last = [ln for ln in (tb or "").strip().splitlines() if ln.strip()]
            report.error = f"rank {rank}: {last[-1] if last else 'error'}"
            report.tracebacks = {r: t for r, t in errors if t}
            continue
        report.checks = merge_rank_checks([res[i][0] for res in per_rank])
        report.environment = per_rank[0][i][1]
    return reports


def standard_sweep(nproc: int = 2, *, with_skipped: bool = False, **common: Any) -> Any:
    """The configurations the matrix checks on every release, for ``nproc`` ranks (``common`` sets the rest,
    e.g. ``dtype="bf16"``; ``bind=True`` and two offload/reload cycles between the first two steps,
    a full one and one that keeps the params, ``offload_cycles=2``, unless it says otherwise):

    data parallel with the distributed optimizer on and off; tensor parallel with sequence parallelism, without
    and with dropout (0.1 hidden and attention, at most 2 steps: the reference replays the step's dropout masks);
    pipeline parallel with tied embeddings (binding + pipeline gather), with linear biases where the release lays
    a tied embedding out in one bucket whatever the sizes (0.13+, and 0.4/0.5 that have no such bucket; on
    0.6-0.12 some sizes are refused before building, :mod:`mcore_compat.training.tied_buckets`, which a test proves);
    pipeline parallel with two virtual stages per rank; data parallel with overlapped gradient reduction and parameter gather; MoE with expert
    parallelism. Configurations the installed release cannot run (:func:`~.models.unsupported_reason`) are left
    out; with ``with_skipped=True`` the result is ``(configs, [(label, reason), ...])``.
    """
    from ..detect import detect
    from ..training.tied_buckets import can_straddle
    from . import models

    common = {"bind": True, "offload_cycles": 2, **common}
    biased = not can_straddle(detect().version)
    candidates = [SelfCheckOptions(tp=1, pp=1, distributed_optimizer=True, **common),
                  SelfCheckOptions(tp=1, pp=1, distributed_optimizer=False, **common)]
    if nproc > 1:
        candidates += [
            SelfCheckOptions(tp=nproc, pp=1, distributed_optimizer=True, sequence_parallel=True, **common),
            SelfCheckOptions(tp=nproc, pp=1, distributed_optimizer=True, sequence_parallel=True,
                             **{**common, "dropout": 0.1, "steps": min(2, common.get("steps", 2))}),
            SelfCheckOptions(tp=1, pp=nproc, distributed_optimizer=True, **{**common, "bias": biased}),
            SelfCheckOptions(tp=1, pp=nproc, vpp=2, distributed_optimizer=True, **common),
            SelfCheckOptions(tp=1, pp=1, distributed_optimizer=True, overlap=True, **common),
            SelfCheckOptions(tp=1, pp=1, distributed_optimizer=True, experts=nproc, ep=nproc, **common),
        ]
    configs, skipped = [], []
    for c in candidates:
        why = models.unsupported_reason(replace(c, nproc=nproc, device="cpu").resolved())  # no GPU count check
        if why is None:
            configs.append(c)
            continue
        unclipped = replace(c, clip_grad=0.0)
        if c.experts and c.clip_grad and models.unsupported_reason(
                replace(unclipped, nproc=nproc, device="cpu").resolved()) is None:
            configs.append(unclipped)  # the expert path still proven, without the clipping the release gets wrong
            skipped.append((c.label() + " with clipping", f"run with clip_grad=0 instead: {why}"))
        else:
            skipped.append((c.label(), why))
    return (configs, skipped) if with_skipped else configs
