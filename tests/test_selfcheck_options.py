"""The self-check's options refuse what cannot work, with one line naming the option to change."""

from __future__ import annotations

import pytest

from mcore_compat.selfcheck.options import FAULTS, SelfCheckOptions, UsageError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(offload_cycles=-1), "--offload-cycles must be >= 0, got -1"),
    (dict(offload_cycles=1, steps=1), "--offload-cycles needs --steps >= 2"),
    (dict(fault="reload_recreates_storage"), "fault reload_recreates_storage needs --offload-cycles >= 1"),
    (dict(fault="offload_misses_optimizer_state"), "needs --offload-cycles >= 1"),
    (dict(fault="offload_reallocates_host", offload_cycles=1), "needs --offload-cycles >= 2"),
])
def test_offload_options_are_refused_with_the_fix(overrides: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("+", r"\+")):
        SelfCheckOptions(nproc=2, device="cpu", **overrides).resolved()


def test_offload_options_that_fit_resolve() -> None:
    opts = SelfCheckOptions(nproc=2, device="cpu", offload_cycles=2, fault="offload_reallocates_host").resolved()
    assert opts.offload_cycles == 2 and opts.steps >= 2
    assert "offload_reallocates_host" in FAULTS and SelfCheckOptions().offload_cycles == 0


def test_offload_cycles_are_spread_over_the_gaps_between_steps() -> None:
    """Every cycle is followed by a verified step: none after the last step."""
    from mcore_compat.selfcheck.offload_cycle import OffloadCycles

    def gaps(cycles: int, steps: int) -> list[int]:
        return OffloadCycles([], None, [], cycles).gaps(steps)

    assert gaps(1, 3) == [1, 0, 0]
    assert gaps(3, 3) == [2, 1, 0]
    assert gaps(2, 2) == [2, 0]
    assert gaps(0, 3) == [0, 0, 0]


def test_the_json_report_says_which_mcore_compat_wrote_it_and_when() -> None:
    import datetime
    import json

    from mcore_compat._version import __version__
    from mcore_compat.selfcheck import Report
    from mcore_compat.selfcheck.report import Check

    report = Report(settings={"tp": 1}, environment={"megatron_core": "0.16.1"})
    report.checks.append(Check("grads_match_reference", True, "ok"))
    data = json.loads(report.to_json())
    assert data["mcore_compat"] == __version__ and data["environment"]["megatron_core"] == "0.16.1"
    written = datetime.datetime.fromisoformat(data["written"])
    assert written.tzinfo is not None
    assert abs((datetime.datetime.now(datetime.timezone.utc) - written).total_seconds()) < 60
