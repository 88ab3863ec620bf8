"""The generated config-field data and the config builders against the ONE installed megatron-core (runs inside a
matrix session, on a rank of the session's group: tests/_config_fields_scenarios.py).

* ``mcore_compat/_translate/fields.py`` agrees with the installed release's real ``dataclasses.fields`` of
  ``TransformerConfig``, ``DistributedDataParallelConfig`` and ``OptimizerConfig`` (names and literal defaults), and
  with a wrong row injected the check names it;
* ``mcore_compat.transformer_config`` builds the installed class from the field names of any release: a renamed
  field under either name lands on the installed name; an absent field is dropped silently at its default, with one
  warning (rank 0) when harmless, and refused (``UnsupportedVersionError`` naming field and release) otherwise;
* ``ddp_config`` and ``optimizer_config`` build what the installed release takes.
"""

from __future__ import annotations

from typing import Any

import _config_fields_scenarios as SCENARIOS
import pytest

from mcore_compat._facts.ranges import in_range
from mcore_compat._translate.effects import harmless_if_missing
from mcore_compat._translate.names import fields_in

pytestmark = pytest.mark.mcore


@pytest.fixture(scope="module")
def ranks(rank_group: Any) -> list[dict[str, Any]]:
    return rank_group.run(SCENARIOS.check_configs, timeout=300)


@pytest.fixture(scope="module")
def r0(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    return ranks[0]


def _ok(outcome: dict[str, Any]) -> Any:
    assert outcome["error"] is None, f"{outcome['error']}: {outcome['message']}\n{outcome['traceback']}"
    return outcome["value"]


@pytest.mark.parametrize("cls", SCENARIOS.CLASSES)
def test_generated_data_matches_the_installed_dataclass(r0: dict[str, Any], cls: str) -> None:
    assert r0["drift"][cls] == [], "\n".join(r0["drift"][cls])


def test_drift_check_names_an_injected_wrong_row(r0: dict[str, Any]) -> None:
    report = r0["injected"]
    assert len(report) == 2, report
    assert "TransformerConfig.num_layers" in report[0] and r0["version"] in report[0], report
    assert "TransformerConfig.hidden_size" in report[1] and "12345" in report[1], report
    assert all("scripts/gen_config_fields.py" in line for line in report), report


def test_transformer_config_builds_with_the_fusion_flags(r0: dict[str, Any]) -> None:
    """The issue's call: bias_activation_fusion (bias_gelu_fusion on 0.4) and apply_rope_fusion (absent on 0.4,
    False = its default: dropped silently) on every release."""
    fields = _ok(r0["brief"])
    installed = "bias_gelu_fusion" if "bias_gelu_fusion" in fields else "bias_activation_fusion"
    assert fields[installed] is False
    assert fields["num_layers"] == 1 and fields["hidden_size"] == 8 and fields["use_cpu_initialization"] is True
    assert ("apply_rope_fusion" in fields) == ("apply_rope_fusion" in r0["real_fields"]["TransformerConfig"])
    assert r0["brief"]["warnings"] == []


@pytest.mark.parametrize("given", ["new_name", "old_name"])
def test_a_renamed_field_lands_on_the_installed_name_under_either_name(r0: dict[str, Any], given: str) -> None:
    fields = _ok(r0[given])
    installed = "bias_gelu_fusion" if "bias_gelu_fusion" in r0["real_fields"]["TransformerConfig"] \
        else "bias_activation_fusion"
    assert fields[installed] is True
    assert {"bias_gelu_fusion", "bias_activation_fusion"} - {installed} - set(fields) == \
        {"bias_gelu_fusion", "bias_activation_fusion"} - {installed}


def test_both_names_with_different_values_and_unknown_names_are_refused(r0: dict[str, Any]) -> None:
    both, unknown = r0["both_names"], r0["unknown"]
    assert both["error"] == "InvalidArgumentError", both
    assert "bias_gelu_fusion" in both["message"] and "bias_activation_fusion" in both["message"]
    assert unknown["error"] == "InvalidArgumentError", unknown
    assert "'hiden_size'" in unknown["message"] and "'hidden_size'" in unknown["message"]


def test_every_declared_rename_translates_to_the_installed_name(r0: dict[str, Any]) -> None:
    """Each name of each declared rename (7: not a default) lands on the one the installed class has; where it
    has neither, the field is absent and handled as such."""
    for case in r0["renames"]:
        what = f"{case['cls']}.{case['given']} on {r0['version']}"
        assert len(case["installed"]) <= 1, what
        if case["installed"]:
            assert _ok(case["outcome"]) == {case["installed"][0]: 7}, what
        elif harmless_if_missing(case["cls"], case["given"]):
            assert _ok(case["outcome"]) == {}, what
        else:
            assert case["outcome"]["error"] == "UnsupportedVersionError", (what, case["outcome"])


def test_an_absent_field_that_changes_results_is_refused(r0: dict[str, Any]) -> None:
    harmful = r0["harmful"]
    assert harmful is not None, f"no absent, harmful field with a literal default on {r0['version']}"
    outcome = harmful["outcome"]
    assert outcome["error"] == "UnsupportedVersionError", outcome
    assert harmful["field"] in outcome["message"] and r0["version"] in outcome["message"], outcome["message"]
    at_default = _ok(harmful["at_default"])
    assert harmful["field"] not in at_default
    assert harmful["at_default"]["warnings"] == []


def test_an_absent_harmless_field_warns_once_on_rank_0_and_is_dropped(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        harmless = r["harmless"]
        assert harmless is not None, f"no absent, harmless field with a literal default on {r['version']}"
        first, again = _ok(harmless["first"]), _ok(harmless["again"])
        assert harmless["field"] not in first and harmless["field"] not in again
        if r["rank"] == 0:
            assert len(harmless["first"]["warnings"]) == 1, harmless["first"]["warnings"]
            message = harmless["first"]["warnings"][0]
            assert harmless["field"] in message and r["version"] in message, message
        else:
            assert harmless["first"]["warnings"] == []
        assert harmless["again"]["warnings"] == []


def test_ddp_config_builds_what_the_release_takes(r0: dict[str, Any]) -> None:
    built = _ok(r0["ddp"])
    if r0["real_fields"]["DistributedDataParallelConfig"] is None:
        assert built["type"] == "dict"
        assert built["fields"]["accumulate_allreduce_grads_in_fp32"] is True
    else:
        assert built["type"] == "DistributedDataParallelConfig"
        assert built["fields"]["grad_reduce_in_fp32"] is True
    assert built["fields"]["use_distributed_optimizer"] is True and built["fields"]["bucket_size"] == 1000


def test_optimizer_config_builds_what_the_release_takes(r0: dict[str, Any]) -> None:
    built = _ok(r0["optimizer"])
    has_class = r0["real_fields"]["OptimizerConfig"] is not None
    assert built["type"] == ("OptimizerConfig" if has_class else "OptimConfig")
    assert built["fields"]["lr"] == 1e-3 and built["fields"]["weight_decay"] == 0.05
    assert not any(name.startswith("muon") and "nesterov" in name and name not in
                   r0["real_fields"]["OptimizerConfig"] for name in built["fields"])


def test_a_non_default_optimizer_field_the_release_lacks_is_refused(r0: dict[str, Any]) -> None:
    """decoupled_weight_decay=False (Adam with L2 decay) exists from 0.15; before, ignoring it would train AdamW."""
    outcome = r0["decoupled_wd"]
    if "decoupled_weight_decay" in fields_in("OptimizerConfig", r0["version"]):
        assert _ok(outcome)["fields"]["decoupled_weight_decay"] is False
    else:
        assert outcome["error"] == "UnsupportedVersionError", outcome
        assert "decoupled_weight_decay" in outcome["message"] and r0["version"] in outcome["message"]
    assert in_range(r0["version"], ">=0.15") == ("decoupled_weight_decay" in fields_in("OptimizerConfig",
                                                                                       r0["version"]))
