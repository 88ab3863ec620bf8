"""The tables against the ONE installed megatron-core (runs inside a matrix session).

* every fact (capabilities and valued facts): what the table says for the detected version == what its probe finds
  in the code, and the drift check (``capabilities.drift``) is empty; with a wrong row injected it names the fact;
* every symbol: resolves to a real object where the table says it exists, and to an ``Unavailable``
  placeholder (whose use raises ``SymbolUnavailableError`` naming the symbol, the installed version and the
  versions that have it) where it does not.

The checks run on a rank of the session's group (tests/_surface_scenarios.py), after the patches a CPU run needs
(the apex stand-in on 0.4-0.9 and the TransformerEngine stand-in on 0.4-0.7 must precede ``import
megatron.core``). Nothing is skipped: a symbol that does not resolve is a failure, whatever the reason.
"""

from __future__ import annotations

from typing import Any

import _surface_scenarios as SCENARIOS
import pytest

from mcore_compat._facts.symbol_table import SYMBOLS
from mcore_compat._facts.table import FACTS

pytestmark = pytest.mark.mcore


@pytest.fixture(scope="module")
def surface(rank_group: Any) -> dict[str, Any]:
    r0, r1 = rank_group.run(SCENARIOS.check_surface, timeout=300)
    assert r0 == r1, "the two ranks disagree about the installed release's surface"
    return r0


@pytest.mark.parametrize("name", list(FACTS))
def test_fact_row_matches_code(surface: dict[str, Any], name: str) -> None:
    row = surface["facts"][name]
    version = surface["version"]
    assert row["error"] is None, f"fact {name!r}: the probe failed on {version}:\n{row['error']}"
    assert row["row"] is not None, f"fact {name!r}: no row covers megatron-core {version}"
    assert row["said"] == row["found"], (
        f"fact {name!r}: the table says {row['said']!r} for megatron-core {version} (row {row['row']!r}), but the "
        f"probe finds {row['found']!r} in {row['files']} under {surface['path']}. Fix the row in "
        f"mcore_compat/_facts/table.py."
    )


def test_drift_check_is_clean(surface: dict[str, Any]) -> None:
    assert surface["drift"] == [], "\n".join(surface["drift"])


def test_drift_check_names_an_injected_wrong_row(surface: dict[str, Any]) -> None:
    """ddp_ctor's row for the installed release replaced by "wrong": the drift check reports exactly that fact."""
    report = surface["injected_drift"]
    assert len(report) == 1, report
    assert "'ddp_ctor'" in report[0] and "'wrong'" in report[0] and surface["version"] in report[0], report[0]
    assert "distributed_data_parallel.py" in report[0], report[0]


@pytest.mark.parametrize("name", list(SYMBOLS))
def test_symbol_resolves(surface: dict[str, Any], name: str) -> None:
    problems = surface["symbols"][name]
    assert not problems, (f"{name} on megatron-core {surface['version']} (patches applied on the rank: "
                          f"{', '.join(surface['patches']) or 'none'}):\n" + "\n".join(problems))
