"""``forward_backward`` with several model chunks (virtual pipeline stages): the checks and the config field set
for the 0.13+ interleaved schedule (no megatron-core needed: parallel_state and the config are stand-ins)."""

from __future__ import annotations

import types
from typing import Any

import pytest
from packaging.version import Version

from mcore_compat.training import schedules


class _Config:
    def __init__(self, vpp: int | None) -> None:
        self.virtual_pipeline_model_parallel_size = vpp


@pytest.fixture
def fake_state(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    state: dict[str, Any] = {"vpp": 2, "config": _Config(None)}
    ps = types.SimpleNamespace(get_virtual_pipeline_model_parallel_world_size=lambda: state["vpp"])
    monkeypatch.setattr(schedules, "mcore", lambda name: ps)
    monkeypatch.setattr(schedules, "model_config", lambda chunk: state["config"])
    return state


@pytest.mark.unit
@pytest.mark.parametrize(("version", "set_it"), [("0.12.3", False), ("0.13.0", True), ("0.19.2", True)])
def test_config_gets_the_number_of_virtual_stages_where_the_schedule_reads_it(
        fake_state: dict[str, Any], version: str, set_it: bool) -> None:
    schedules._check_virtual_stages(["c0", "c1"], [iter(()), iter(())], None, Version(version))
    assert fake_state["config"].virtual_pipeline_model_parallel_size == (2 if set_it else None)


@pytest.mark.unit
def test_one_iterator_per_chunk_and_matching_stage_counts(fake_state: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="list of 2 data iterators"):
        schedules._check_virtual_stages(["c0", "c1"], iter(()), None, Version("0.16.1"))
    with pytest.raises(ValueError, match="list of 2 data iterators"):
        schedules._check_virtual_stages(["c0", "c1"], [iter(())], None, Version("0.16.1"))
    fake_state["vpp"] = None
    with pytest.raises(ValueError, match="2 model chunks but None virtual pipeline stages"):
        schedules._check_virtual_stages(["c0", "c1"], [iter(()), iter(())], None, Version("0.16.1"))
    fake_state["vpp"], fake_state["config"] = 2, _Config(3)
    with pytest.raises(ValueError, match="virtual_pipeline_model_parallel_size = 3"):
        schedules._check_virtual_stages(["c0", "c1"], [iter(()), iter(())], None, Version("0.16.1"))
