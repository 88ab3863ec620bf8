"""The ``matrix`` session: every job, a few at a time, one line per finished job and one summary line.

The bases are built first, in the background and all at once (3.12's torch is a large download: overlap it);
each job waits for its base, and fails with the base's error if that failed. Jobs then run ``jobs`` at a time on a
thread pool (each job is mostly a subprocess), their output going to ``.cache/logs/<name>.log``.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ci.jobs import LAUNCHER_TAG, run_docs, run_lint, run_release, run_unit
from ci.matrix_env import MatrixEnv, pytag
from ci.output import JobError, Out, console
from ci.results import TIMING_HEADER, JobResult, counts_text, cpu_record, summary_line, tail, timing_line

#: A job body: given its output, it returns its result.
Body = Callable[[Out], JobResult]
#: Expected costs relative to a release session (:attr:`Job.weight`): a session that also runs the launcher tests
#: takes about 15% longer, one that also runs the README and docs/ blocks (tag ``docs``: about 45 s of one core,
#: measured on 0.16.1 and 0.19.2) about 15% more; unit, whose launcher tests wait for hung ranks, about 20% more
#: than a release session (180 s against 140-155 s in a fresh-clone run on 2 cores), so that it starts among the
#: first instead of being the last job running; lint takes a fraction of one, and so does docs (the site:
#: ``mkdocs build --strict``, 7 s of one core, plus about 30 s of pip once for its venv), which goes last.
_LAUNCHER_WEIGHT, _DOCS_EXTRA_WEIGHT, _UNIT_WEIGHT, _LINT_WEIGHT, _SITE_WEIGHT = 1.15, 0.15, 1.2, 0.2, 0.1
#: The versions.toml tag of the sessions that also run the README and docs/ blocks (the root conftest.py).
_DOCS_TAG = "docs"


@dataclass(frozen=True)
class Job:
    """One job of the matrix.

    Attributes:
        name: its session name (and log file name).
        python: the base it needs.
        body: what it runs.
        weight: its expected cost relative to a release session (1); the matrix starts heavier jobs first and
            jobs lighter than 1 (lint) last, so that the last minutes are not one long session alone.
    """

    name: str
    python: str
    body: Body
    weight: float = 1.0


def start_order(jobs: Sequence[Job]) -> list[Job]:
    """The order in which :func:`run_jobs` starts ``jobs``: the jobs of weight >= 1 first, by base (in the order
    the bases first appear, so the first base's jobs run while a later base is still being built), heaviest first
    within a base; then the lighter jobs, heaviest first. Ties keep the order of ``jobs``."""
    bases = list(dict.fromkeys(j.python for j in jobs))
    return sorted(jobs, key=lambda j: (j.weight < 1, 0 if j.weight < 1 else bases.index(j.python), -j.weight))


@dataclass
class MatrixOptions:
    """The ``matrix`` session's options (after ``--``)."""

    jobs: int = 2
    tag: str | None = None
    record: bool = True


def parse_matrix_args(args: Sequence[str]) -> MatrixOptions:
    """Parse ``--jobs N``, ``--tag TAG`` and ``--no-record``.

    Raises:
        JobError: an unknown option or a missing value.
    """
    opts = MatrixOptions()
    it = iter(args)
    try:
        for arg in it:
            if arg == "--jobs":
                opts.jobs = max(1, int(next(it)))
            elif arg == "--tag":
                opts.tag = next(it)
            elif arg == "--no-record":
                opts.record = False
            else:
                raise JobError(f"unknown matrix option {arg!r} (have --jobs N, --tag TAG, --no-record)")
    except (StopIteration, ValueError) as exc:
        raise JobError(f"matrix options {' '.join(args)!r}: a value is missing or not a number") from exc
    return opts


def _job(log: Path, name: str, base: cf.Future[Path], body: Body) -> JobResult:
    out = Out(log)
    try:
        try:
            base.result()
        except Exception as exc:  # the base failed: every job on it fails with that reason
            return JobResult(name=name, errors=1, details=f"base environment failed: {exc}", log=out.log)
        return body(out)
    finally:
        out.close()


def run_jobs(env: MatrixEnv, jobs: Sequence[Job], parallel: int) -> list[JobResult]:
    """Run ``jobs``, ``parallel`` at a time (started in :func:`start_order`), after building their bases in the
    background.

    One line is printed per finished job (and the tail of its log if it failed).

    Returns:
        The results, in the order of ``jobs``.
    """
    logs = env.layout.logs
    logs.mkdir(parents=True, exist_ok=True)
    pythons = sorted({j.python for j in jobs})
    with cf.ThreadPoolExecutor(max(1, len(pythons))) as base_pool, cf.ThreadPoolExecutor(parallel) as pool:
        bases = {py: base_pool.submit(_build_base, env, py, logs / f"base-{pytag(py)}.log") for py in pythons}
        futures = {pool.submit(_job, logs / f"{j.name}.log", j.name, bases[j.python], j.body): j.name
                   for j in start_order(jobs)}
        return _collect(futures, [j.name for j in jobs])


def _build_base(env: MatrixEnv, python: str, log: Path) -> Path:
    out = Out(log)
    try:
        return env.ensure_base(python, out)
    finally:
        out.close()


def _collect(futures: dict[cf.Future[JobResult], str], order: list[str]) -> list[JobResult]:
    results: list[JobResult] = []
    for n, fut in enumerate(cf.as_completed(futures), 1):
        res = fut.result()
        results.append(res)
        mark = "ok  " if res.ok else "FAIL"
        console(f"[{n:>2}/{len(futures)}] {mark} {res.name:<14} {counts_text(res):<40} {res.seconds:7.1f}s")
        if not res.ok:
            console(f"      {res.details}\n      --- last lines of {res.log} ---\n{tail(res.log)}\n      ---")
    return sorted(results, key=lambda r: order.index(r.name))


def report(results: Sequence[JobResult], started: float, summary_file: Path) -> list[str]:
    """Print the timings, the failed jobs and the summary line (also written to ``summary_file``).

    Args:
        results: every job's result.
        started: ``time.monotonic()`` when the matrix started.
        summary_file: where the summary line goes (``.ci/run`` repeats it as its last line).

    Returns:
        The names of the failed jobs.
    """
    failed = [r for r in results if not r.ok]
    console("")
    console("where each session's time went (seconds; rank starts: ranks, s = spawned / f = forked from the warm "
            "server, wall (of which importing torch)):")
    console(TIMING_HEADER)
    for r in results:
        console(timing_line(r))
    console(f"sessions added up: {sum(r.seconds for r in results):.0f}s")
    if failed:
        console(f"FAILED sessions ({len(failed)}): " + ", ".join(r.name for r in failed))
        for r in failed:
            console(f"  {r.name}: {r.details} (log: {r.log})")
    line = summary_line(results, time.monotonic() - started)
    summary_file.parent.mkdir(parents=True, exist_ok=True)
    summary_file.write_text(line + "\n", encoding="utf-8")
    console(line)
    return [r.name for r in failed]


def run_matrix(env: MatrixEnv, args: Sequence[str], log: Callable[[str], None]) -> list[str]:
    """The ``matrix`` session: unit, lint, docs and every release (or those with ``--tag``), ``--jobs`` at a time.

    Records each release's CPU result into ``matrix/results.json`` (unless ``--no-record``), regenerates
    ``matrix/README.md`` and ends with the summary line.

    Args:
        env: the environments.
        args: the session's arguments (see :func:`parse_matrix_args`).
        log: where the session's own lines go (nox's ``session.log``).

    Returns:
        The names of the failed jobs.

    Raises:
        JobError: bad arguments.
    """
    started = time.monotonic()
    opts = parse_matrix_args(args)
    env.layout.summary_file.unlink(missing_ok=True)
    releases = [r for r in env.releases() if opts.tag is None or opts.tag in r.tags]
    jobs = [Job("unit", env.tools_python, functools.partial(run_unit, env), weight=_UNIT_WEIGHT),
            Job("lint", env.tools_python, functools.partial(run_lint, env), weight=_LINT_WEIGHT),
            Job("docs", env.tools_python, functools.partial(run_docs, env), weight=_SITE_WEIGHT)]
    jobs += [Job(r.session, r.python, functools.partial(run_release, env, r),
                 weight=(_LAUNCHER_WEIGHT if LAUNCHER_TAG in r.tags else 1.0)
                 + (_DOCS_EXTRA_WEIGHT if _DOCS_TAG in r.tags else 0.0)) for r in releases]
    pythons = sorted({j.python for j in jobs})
    log(f"matrix: unit, lint, docs and {len(releases)} releases on Python {', '.join(pythons)}, {opts.jobs} at a time; "
        f"logs in {env.layout.logs}")
    results = run_jobs(env, jobs, opts.jobs)
    by_name = {r.name: r for r in results}
    if opts.record:
        for rel in releases:
            env.matrix.record_result(rel.version, "cpu", cpu_record(rel.install, by_name[rel.session]))
    readme = env.matrix.write_readme()
    log(f"regenerated {readme.relative_to(env.layout.repo)}" + (" and recorded CPU results" if opts.record else ""))
    return report(results, started, env.layout.summary_file)
