"""The machinery behind ``noxfile.py``: environments, jobs, results and the matrix scheduler.

Why it exists: torch is ~1 GB on Python 3.11 and ~4.7 GB on 3.12, so the 23 release sessions cannot each have a
venv. Every Python gets one shared base venv; each release is a ``pip install --target`` tree put on
``PYTHONPATH`` next to a non-editable install of this repository. nox only declares the sessions.

Modules:

* :mod:`ci.output`: where a job's output goes, and running its commands.
* :mod:`ci.matrix_env`: interpreters, file locks, base venvs, the wheel cache, release trees, the self-install.
* :mod:`ci.jobs`: the session bodies (unit, lint, one release: start-up check, pytest, self-check).
* :mod:`ci.results`: a job's result, JUnit counts, the summary line, the recorded CPU result.
* :mod:`ci.scheduler`: the ``matrix`` session (two jobs at a time, one summary line).
* ``ci/probe.py`` and ``ci/startup_check.py``: scripts run by a base interpreter.

The package is imported by the nox interpreter, which has none of mcore-compat's dependencies: only the standard
library (and ``packaging``, through ``mcore_compat/support/``).
"""
