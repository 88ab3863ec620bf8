"""Shared pytest configuration.

Tests marked ``mcore`` need a real megatron-core on ``sys.path``; they run inside a nox matrix session (one per
release). Outside such a session (no megatron-core importable) they are skipped with the reason.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _megatron_available() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _megatron_available():
        return
    skip = pytest.mark.skip(reason="needs megatron-core on sys.path (run it in a nox matrix session: nox -l)")
    for item in items:
        if "mcore" in item.keywords:
            item.add_marker(skip)
