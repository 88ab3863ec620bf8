"""The support matrix: which Megatron-Core releases mcore-compat supports, on what, and how they fared.

The data lives in ``matrix/versions.toml`` (the single source of truth of supported releases) and
``matrix/results.json`` (the recorded CPU/GPU results); both are installed as package data of
``mcore_compat.matrix``. ``matrix/README.md`` is generated from them by :func:`render_table`::

    python -m mcore_compat.support render            # regenerate matrix/README.md in the source tree
    python -m mcore_compat.support render --check    # exit 1 if matrix/README.md is stale
    python -m mcore_compat.support status 0.16.0rc1  # is this release supported?
    python -m mcore_compat.support list              # the releases, with their tags

The modules: :mod:`.errors` (:class:`MatrixFileError`, :class:`MatrixNotFoundError` and the general errors of
:mod:`mcore_compat.errors` it raises), :mod:`.model` (:class:`Release`, :class:`SupportStatus`), :mod:`.files` (where ``matrix/`` is),
:mod:`.parse` (reading ``versions.toml``), :mod:`.fit` (an environment against a release's limits, and the pip
command that repairs it), :mod:`.matrix` (:class:`Matrix` and the module-level functions),
:mod:`.render` (the generated README), :mod:`.cli` (the command line).

This package needs only the standard library and ``packaging`` (plus ``tomli`` on Python 3.10), and imports nothing
else from ``mcore_compat`` (only relative imports inside the package): ``noxfile.py`` loads it straight from the
source files, as a package of its own name.
"""

from __future__ import annotations

from .cli import main
from .errors import MatrixFileError, MatrixNotFoundError
from .fit import Fit, Misfit, fit, installed_versions, newest_for_python, pip_command
from .matrix import Matrix, base_requirements, record_result, releases, render_table, results, status
from .model import INSTALL_KINDS, RESULT_KINDS, Release, SupportStatus

__all__ = [
    "INSTALL_KINDS",
    "RESULT_KINDS",
    "Fit",
    "Matrix",
    "MatrixFileError",
    "MatrixNotFoundError",
    "Misfit",
    "Release",
    "SupportStatus",
    "base_requirements",
    "fit",
    "installed_versions",
    "main",
    "newest_for_python",
    "pip_command",
    "record_result",
    "releases",
    "render_table",
    "results",
    "status",
]
