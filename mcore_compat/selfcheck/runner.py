"""Run the self-check: spawn local ranks (``--nproc``) or join a ``torchrun`` launch, and merge the verdicts."""

from __future__ import annotations

import os
import threading
from typing import Any

from ..launch import RankFailure, RankTimeout, spawn
from .options import SelfCheckOptions
from .report import Check, Report, merge_rank_checks

__all__ = ["run"]


def _under_torchrun(opts: SelfCheckOptions) -> bool:
    return opts.nproc is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _spawned_rank(opts: SelfCheckOptions) -> tuple[list[Check], dict[str, Any]]:
    from .worker import run_rank

    return run_rank(opts)


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
    """
    from dataclasses import replace

    opts = replace(options or SelfCheckOptions(), **overrides) if overrides else (options or SelfCheckOptions())
    torchrun = _under_torchrun(opts)
    opts = opts.resolved()
    report = Report(settings={k: v for k, v in opts.as_dict().items() if k not in ("timeout",)})
    if torchrun:
        import torch.distributed as dist

        from ..launch import init_from_env
        from .worker import run_rank

        timer = _watchdog(opts.timeout)
        try:
            init_from_env(device=opts.device or "cpu", timeout_s=opts.timeout)
            checks, env = run_rank(opts)
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, checks)
        finally:
            timer.cancel()
        report.checks = merge_rank_checks(gathered)
        report.environment = env
        return report
    try:
        per_rank = spawn(_spawned_rank, opts.nproc or 1, args=(opts,), device=opts.device or "cpu",
                         timeout=opts.timeout)
    except (RankFailure, RankTimeout) as exc:
        report.error = str(exc)
        return report
    report.checks = merge_rank_checks([checks for checks, _ in per_rank])
    report.environment = per_rank[0][1]
    return report
