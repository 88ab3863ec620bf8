"""nox sessions of mcore-compat, generated from ``matrix/versions.toml`` (the single source of truth of releases).

Sessions (``nox -l`` lists them):

* ``mcore-<V>``, one per supported release (tags ``cpu``, ``min``/``latest``, ``oldest``/``newest``, ``py311``/
  ``py312``): start-up check, ``pytest tests -m mcore`` against exactly megatron-core ``V``, then the CPU
  self-check (through the CLI in the ``launcher`` sessions, inside pytest's warm ranks in the others). ``nox -t py311``, ``nox -t latest`` select groups; extra arguments go to pytest
  (``nox -s mcore-0.16.1 -- -x``, which skips the self-check).
* ``unit``: the tests that need no megatron-core (``pytest -m "not mcore"``).
* ``lint``: ``ruff check .``, ``mypy`` over ``mcore_compat``, ``patches`` and ``ci``, and the public API's
  breaking-change check (``scripts/gen_api.py --check``, griffe against ``api/mcore_compat.json``).
* ``matrix``: unit + lint + docs + every release session, 2 at a time, records each release's CPU result into
  ``matrix/results.json``, regenerates ``matrix/README.md`` and ends with one pytest-style summary line.
  Options after ``--``: ``--jobs N``, ``--tag TAG`` (only releases with that tag), ``--no-record``.
* ``base-3.11``, ``base-3.12``: build the shared base venv of that Python (the others require theirs).
* ``docs``: the documentation site (``mkdocs build --strict``: a warning or a broken link fails it) into
  ``.cache/site``; ``matrix`` runs it too.

No test session creates its own virtualenv (``venv_backend="none"``): torch is too large for one venv per session.
``docs`` needs neither torch nor mcore-compat installed (mkdocstrings reads the source statically), only
:data:`ci.matrix_env.DOCS_TOOLS` in a small venv of its own, ``.cache/docs-venv``.
Each Python has one shared base venv in ``.cache/base-py3xx``, each release a ``pip install --target`` tree in
``.cache/mc/<V>``, and this repository is installed (non-editable) into ``.cache/mcc/py3xx``; a test run puts both
on ``PYTHONPATH``. The machinery is the ``ci`` package (``ci/matrix_env.py`` documents the layout); logs go to
``.cache/logs``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import nox

REPO = Path(__file__).resolve().parent
if str(REPO) not in sys.path:  # the ``nox`` script does not put the noxfile's directory on sys.path
    sys.path.insert(0, str(REPO))

from ci import jobs, matrix_env, results, scheduler  # noqa: E402
from ci.output import JobError, Out  # noqa: E402

nox.needs_version = ">=2025.2.9"
nox.options.sessions = ["unit", "lint"]

ENV = matrix_env.MatrixEnv.for_repo(REPO)
RELEASES = ENV.releases()
PYTHONS = sorted({ENV.tools_python, *(r.python for r in RELEASES)})


def _finish(session: nox.Session, result: results.JobResult) -> None:
    """Fail the session with the job's details, or log its counts."""
    if not result.ok:
        session.error(f"{result.name} failed: {result.details}")
    session.log(f"{result.name}: {results.counts_text(result)} in {result.seconds:.1f}s")


def _declare(name: str, body: Callable[[nox.Session], None], doc: str, **kwargs: object) -> None:
    """Register ``body`` as the session ``name`` (no venv of its own)."""
    body.__doc__ = doc
    body.__name__ = body.__qualname__ = name.replace("-", "_").replace(".", "_")
    nox.session(body, name=name, venv_backend="none", **kwargs)


def _base_session(python: str) -> Callable[[nox.Session], None]:
    def body(session: nox.Session) -> None:
        try:
            session.log(f"base {ENV.ensure_base(python, Out())} is ready")
        except JobError as exc:
            session.error(str(exc))

    return body


def _release_session(release: matrix_env.Release) -> Callable[[nox.Session], None]:
    def body(session: nox.Session) -> None:
        _finish(session, jobs.run_release(ENV, release, Out(), session.posargs))

    return body


for _python in PYTHONS:
    _declare(f"base-{_python}", _base_session(_python), f"the shared base venv of Python {_python}", default=False)

for _release in RELEASES:
    _declare(_release.session, _release_session(_release), f"megatron-core {_release.version} on Python "
             f"{_release.python}", tags=list(_release.tags), default=False, requires=[f"base-{_release.python}"])


@nox.session(venv_backend="none", tags=["cpu"], requires=[f"base-{ENV.tools_python}"])
def unit(session: nox.Session) -> None:
    """Tests that need no megatron-core (pytest -m "not mcore"), against the installed mcore-compat."""
    _finish(session, jobs.run_unit(ENV, Out(), session.posargs))


@nox.session(venv_backend="none", requires=[f"base-{ENV.tools_python}"])
def lint(session: nox.Session) -> None:
    """ruff check ., mypy (mcore_compat, patches, ci) and the API breaking-change check (scripts/gen_api.py)."""
    _finish(session, jobs.run_lint(ENV, Out(), session.posargs))


@nox.session(venv_backend="none", default=False)
def docs(session: nox.Session) -> None:
    """The documentation site: mkdocs build --strict (warnings and broken links fail) into .cache/site."""
    _finish(session, jobs.run_docs(ENV, Out(), session.posargs))


@nox.session(venv_backend="none", default=False)
def matrix(session: nox.Session) -> None:
    """unit + lint + docs + every release session, 2 at a time; records CPU results and regenerates matrix/README.md."""
    try:
        failed = scheduler.run_matrix(ENV, session.posargs, session.log)
    except JobError as exc:  # bad options
        session.error(str(exc))
    if failed:
        session.error(f"{len(failed)} session(s) failed: {', '.join(failed)}")
