"""The naming rule of the public namespace (README "One naming rule"), read statically (no Megatron import).

* ``mc.<Name>`` that Megatron-Core uses for a function or class is Megatron's own object: a row of the symbol
  table (``mcore_compat/_facts/symbol_table.py``) that resolves to Megatron's attribute of that name.
* Adapters (one signature on every release) are ``mcore_compat.training.<name>``; a top-level adapter under a
  Megatron name is only a deprecated alias (``mcore_compat._util.deprecated.DEPRECATED_TOP_LEVEL``) that keeps its meaning and
  warns once, naming the replacement.
* No name means both at one level: the symbol rows and mcore_compat's own top-level names are disjoint.
"""

from __future__ import annotations

import warnings

import pytest

import mcore_compat as mc
from mcore_compat import surface
from mcore_compat._facts.symbol_table import _ROWS
from mcore_compat._util import deprecated as _deprecated

pytestmark = pytest.mark.unit

#: Symbol rows whose name differs from Megatron's, each for a stated reason.
RENAMED_ROWS = {
    "mpu": "Megatron's own conventional alias of parallel_state (megatron.core imports it as mpu)",
    "get_megatron_optimizer_raw": "Megatron's get_megatron_optimizer, kept apart from the adapter's name",
    "ParamAndGradBuffer": "Megatron's _ParamAndGradBuffer (0.10+ made the class private)",
    "ParamAndGradBucketGroup": "Megatron's _ParamAndGradBucketGroup (private from its first release)",
}


#: mcore_compat's own top-level names that a Megatron module below the top level also uses, each for a reason.
NOT_AT_THE_SAME_LEVEL = {
    "checkpoint": "mcore_compat's checkpoint package (save/load); Megatron's is the activation-recomputation "
                  "function tensor_parallel.checkpoint, reached as mc.tensor_parallel.checkpoint (no mc. row, no "
                  "adapter of that name)",
}


def _megatron_functions_and_classes() -> dict[str, set[str]]:
    """Every function or class name of the Megatron modules the symbol table draws from -> those modules."""
    modules = {loc.module for row in _ROWS for loc in row.locations}
    modules |= {m.rsplit(".", 1)[0] for m in modules if m.count(".") > 1}  # the packages re-exporting them
    names: dict[str, set[str]] = {}
    for module in modules:
        for name, kind in surface.names(module).items():
            if kind in ("function", "class"):
                names.setdefault(name, set()).add(module)
    return names


def _own_top_level() -> set[str]:
    """mcore_compat's own top-level names: ``__all__``, its lazy submodules and re-exports."""
    return set(mc.__all__) | set(mc._LAZY_MODULE_ATTRS) | set(mc._LAZY_ATTRS)


def test_symbol_rows_are_megatrons_objects_under_megatrons_names() -> None:
    for row in _ROWS:
        for loc in row.locations:
            if loc.module.startswith("mcore_compat._facts.fallbacks"):  # a stand-in where the release lacks it
                assert loc.attr == row.name, (row.name, loc)
                continue
            megatron_name = loc.attr or loc.module.rsplit(".", 1)[-1]
            assert loc.module.startswith("megatron.core"), (row.name, loc)
            assert megatron_name == row.name or row.name in RENAMED_ROWS, (row.name, loc)


def test_an_adapter_never_takes_a_megatron_name_at_the_top_level() -> None:
    megatron = _megatron_functions_and_classes()
    assert {"get_megatron_optimizer", "finalize_model_grads", "get_forward_backward_func"} <= set(megatron)
    clashes = {name: sorted(megatron[name]) for name in _own_top_level() & set(megatron)
               if name not in NOT_AT_THE_SAME_LEVEL}
    assert set(clashes) == set(_deprecated.DEPRECATED_TOP_LEVEL), (
        f"mcore_compat.<name> that Megatron uses for a function or class must be Megatron's object (a row of "
        f"_facts/symbol_table.py) or a declared deprecated alias: {clashes}")


def test_the_symbol_rows_and_mcore_compats_own_names_are_disjoint() -> None:
    assert not {row.name for row in _ROWS} & _own_top_level()


def test_each_deprecated_top_level_alias_is_the_adapter_and_warns_once_naming_it() -> None:
    from mcore_compat import training

    for name in _deprecated.DEPRECATED_TOP_LEVEL:
        path = f"mcore_compat.{name}"
        assert path in _deprecated.DEPRECATED_NAMES
        assert name in training.__all__, f"{name}: the replacement must be an adapter of mcore_compat.training"
        _deprecated._WARNED.discard(path)
        with pytest.warns(DeprecationWarning, match=rf"{path} is deprecated; use mcore_compat\.training\.{name}") \
                as caught:
            value = getattr(mc, name)
        assert value is getattr(training, name)
        assert caught[0].filename == __file__  # points at the caller's line
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert getattr(mc, name) is value  # once per process


def test_the_readme_states_the_rule() -> None:
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    rule = readme.split("## One naming rule", 1)[1].split("\n## ", 1)[0]
    assert "mcore_compat.training" in rule and "mcore_compat.core" in rule and "deprecated" in rule
    assert "tests/test_naming.py" in rule
