"""The mirror of Megatron's layout (``mcore_compat.core``) against the ONE installed megatron-core (runs inside a
matrix session; the imports run on a rank of the session's group: tests/_mirror_scenarios.py).

* a name at its path: ``from mcore_compat.core.<path> import X`` is Megatron's own object (``is``);
* a name that moved: where the raw import fails, the mirror gives the object of the module it moved to;
* a name the release lacks everywhere: ``NameUnavailableError``, an ``ImportError`` and a ``McoreCompatError``,
  naming the releases that have it, so ``try: ... except ImportError:`` answers as with the raw import;
* a mirror module with nothing reachable on the release does not import; the others do, even where the
  release lacks the path, when a name of it moved;
* ``import mcore_compat.core.<path>`` imports nothing of Megatron, nor torch (a fresh interpreter; the first use
  of a name imports it: every case above);
* an attribute read of a missing name raises ``SymbolUnavailableError`` (an ``AttributeError``: ``hasattr`` is
  ``False``, as on the raw module), a ``from ... import`` of it ``NameUnavailableError``; a star import gives
  Megatron's names;
* a submodule read through the mirror is the mirror's module; assignments go to Megatron's module.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import _mirror_scenarios as SCENARIOS
import pytest

pytestmark = pytest.mark.mcore


@pytest.fixture(scope="module")
def mirror(rank_group: Any) -> dict[str, Any]:
    return rank_group.run(SCENARIOS.check_mirror, timeout=300)[0]


def _cases(kind: tuple[tuple[str, str], ...]) -> list[str]:
    return list(dict.fromkeys(f"{m}:{n}" for m, n in kind))


def _needs_missing_dependency(case: dict[str, Any]) -> bool:
    """The module that has the name does not import on this CPU install (e.g. TransformerEngine, which the CPU
    patches stand in for only on 0.4-0.7): the raw import there fails too, and the mirror must say the same."""
    return case.get("target_ok") is False


@pytest.mark.parametrize("key", _cases(SCENARIOS.COMMON + SCENARIOS.MOVED + SCENARIOS.ABSENT))
def test_the_mirror_gives_what_the_data_says(mirror: dict[str, Any], key: str) -> None:
    case, release = mirror["cases"][key], mirror["release"]
    where = case["where"]
    if where is None:  # absent on this release, at the path and along its moves
        error = case["mirror_error"]
        assert not case["raw_ok"], f"{key}: the data says absent in {release}, but the raw import works"
        assert error and error["compat_error"] and error["import_error"], case
        assert release in error["message"], error
        if error["symbol"] is None:  # the module (or a package above it) has nothing reachable on this release
            from mcore_compat._facts.mirror import real_path

            assert error["releases"] == case["module_having"][real_path(error["module"])], error
        else:
            assert error["releases"] == case["having"], error
            if case["having"]:
                assert case["summary"] in error["message"], error
        assert case["feature_check_found"] is False, case
        return
    if _needs_missing_dependency(case):
        assert not case["mirror_ok"] and case["mirror_error"]["import_error"], case
        assert case["feature_check_found"] is False
        return
    assert case["mirror_ok"], f"{key} on {release}: {case['mirror_error']}"
    assert case["identical"], f"{key} on {release}: the mirror's object is not {where[0]}.{key.split(':')[1]}"
    module, moved = where
    if moved:
        assert not case["raw_ok"], f"{key}: the data says moved to {module} in {release}, but the raw path works"
    else:
        assert case["raw_ok"] and case["identical_to_raw"], case
    assert case["feature_check_found"] is True


def test_every_release_has_moved_names_that_resolve_where_the_raw_path_fails(mirror: dict[str, Any]) -> None:
    moved = [k for k in _cases(SCENARIOS.MOVED)
             if mirror["cases"][k]["where"] and mirror["cases"][k]["where"][1] and mirror["cases"][k]["mirror_ok"]
             and not mirror["cases"][k]["raw_ok"]]
    assert len(moved) >= 3, (mirror["release"], moved)


def test_every_release_lacks_a_name_and_says_which_releases_have_it(mirror: dict[str, Any]) -> None:
    absent = [k for k in _cases(SCENARIOS.ABSENT) if mirror["cases"][k]["where"] is None]
    assert absent, mirror["release"]


@pytest.mark.parametrize("module", SCENARIOS.ABSENT_MODULES)
def test_a_mirror_module_imports_where_something_of_it_is_reachable(mirror: dict[str, Any], module: str) -> None:
    case = mirror["modules"][module]
    if case["reachable"]:
        assert case["ok"], case
    else:
        assert not case["ok"] and case["compat_error"] and case["import_error"], case
        assert mirror["release"] in case["message"], case


def test_submodules_are_mirrors_and_assignments_reach_megatron(mirror: dict[str, Any]) -> None:
    assert mirror["attributes"] == {"submodule_is_mirror": True, "function_is_real": True,
                                    "hasattr_missing_is_false": True, "attribute_error_is_symbol_unavailable": True,
                                    "from_import_missing": ("NameUnavailableError", True), "star_import": True,
                                    "assignment_forwarded": True, "later_change_seen": True,
                                    "moved_assignment_forwarded": True}


LAZY = """
import sys
import mcore_compat.core.parallel_state
import mcore_compat.core.transformer.transformer_config
from mcore_compat.core import tensor_parallel
from mcore_compat.core.models import gpt
loaded = sorted(m for m in sys.modules if m == "megatron.core" or m.startswith("megatron.core."))
print("LOADED", loaded, "torch" in sys.modules)
"""


def test_importing_mirror_modules_imports_nothing_of_megatron() -> None:
    proc = subprocess.run([sys.executable, "-c", LAZY], capture_output=True, text=True, env=dict(os.environ),
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LOADED [] False" in proc.stdout, proc.stdout  # nor torch
