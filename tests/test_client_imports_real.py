"""Real clients through the mirror on the installed release: every import line of verl, ms-swift, mbridge and
Megatron-Bridge after ``mcore-compat scan --fix`` (the (module, name) pairs recorded by
``scripts/measure_clients.py``; no client code in the repository) imports through ``mcore_compat.core`` wherever the
raw ``megatron.core`` import works (100 %), and the names that moved import through it where the raw path fails."""

from __future__ import annotations

from typing import Any

import _client_imports_scenarios as SCENARIOS
import pytest

pytestmark = pytest.mark.mcore


@pytest.fixture(scope="module")
def clients(rank_group: Any) -> dict[str, Any]:
    return rank_group.run(SCENARIOS.check_clients, timeout=300)[0]


@pytest.mark.parametrize("client", list(SCENARIOS.load()))
def test_every_raw_import_of_the_fixed_client_imports_through_the_mirror(clients: dict[str, Any],
                                                                         client: str) -> None:
    row = clients["clients"][client]
    assert row["raw_ok"] > 0, f"{client}: no import of the client works raw on {clients['release']}"
    assert row["mirror_failed"] == [], f"{client} on {clients['release']}: raw works, mirror fails"
    assert row["moved_failed"] == [], f"{client} on {clients['release']}: moved names the mirror misses"
    # the scan's 'raw' verdict (the surface data: public, private, dunder and imported names) is the real import's
    assert row["verdicts_wrong"] == [], f"{client} on {clients['release']}: {row['verdicts_wrong'][:5]}"
