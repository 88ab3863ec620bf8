"""Shared pytest configuration.

Tests marked ``mcore`` need a real megatron-core on ``sys.path``; they run inside a nox matrix session (one per
release). Outside such a session (no megatron-core importable) they are skipped with the reason.

``rank_group``: ONE group of 2 gloo ranks for the whole pytest session (a :class:`mcore_compat.launch.Group`):
every module's multi-rank scenarios run in it one after another, so a release session starts processes and
imports torch and Megatron there once instead of once per module. It is registered as a plugin so that the
example suites (examples/*/tests, whose conftest calls :func:`pytest_configure` too) share the same group.
"""

from __future__ import annotations

import importlib.util
import os
import types
from collections.abc import Iterator
from typing import Any

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


_GROUP_PLUGIN = "mcore-compat-rank-group"


def _rank_group() -> Iterator[Any]:
    """2 gloo ranks shared by every module (started on first use, stopped at the end of the session)."""
    from mcore_compat.launch import Group

    with Group(2, device="cpu", destroy_subgroups=True) as group:
        yield group


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin(_GROUP_PLUGIN):
        plugin = types.ModuleType(_GROUP_PLUGIN)
        plugin.rank_group = pytest.fixture(scope="session", name="rank_group")(_rank_group)  # type: ignore[attr-defined]
        config.pluginmanager.register(plugin, _GROUP_PLUGIN)
