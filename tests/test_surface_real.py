"""The tables against the ONE installed megatron-core (runs inside a matrix session).

* every capability row: what the table says for the detected version == what its probe finds in the code;
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

from mcore_compat._capability_table import CAPABILITIES
from mcore_compat._symbol_table import SYMBOLS

pytestmark = pytest.mark.mcore


@pytest.fixture(scope="module")
def surface(rank_group: Any) -> dict[str, Any]:
    r0, r1 = rank_group.run(SCENARIOS.check_surface, timeout=300)
    assert r0 == r1, "the two ranks disagree about the installed release's surface"
    return r0


@pytest.mark.parametrize("name", [c.name for c in CAPABILITIES])
def test_capability_row_matches_code(surface: dict[str, Any], name: str) -> None:
    row = surface["capabilities"][name]
    version = surface["version"]
    assert not isinstance(row["found"], str), f"capability {name!r}: the probe failed on {version}:\n{row['found']}"
    assert row["said"] == row["found"], (
        f"capability {name!r}: the table says it {'holds' if row['said'] else 'does not hold'} for megatron-core "
        f"{version} (range {row['versions']!r}), but the probe finds {row['found']} in {surface['path']}. Fix the "
        f"range in mcore_compat/_capability_table.py."
    )


@pytest.mark.parametrize("name", list(SYMBOLS))
def test_symbol_resolves(surface: dict[str, Any], name: str) -> None:
    problems = surface["symbols"][name]
    assert not problems, (f"{name} on megatron-core {surface['version']} (patches applied on the rank: "
                          f"{', '.join(surface['patches']) or 'none'}):\n" + "\n".join(problems))
