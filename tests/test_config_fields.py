"""The config-field data without Megatron: the generator's rules (scripts/gen_config_fields.py), the generated
data's consistency with the project's other tables, the hand-written classification
(mcore_compat/_translate/effects.py), and the translation rules of mcore_compat.configs on a release given by version.

What the data says about each release is checked against the real dataclasses in every release session
(tests/test_config_fields_real.py).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from packaging.version import Version

from mcore_compat._facts.ranges import in_range
from mcore_compat._facts.table import DDP_SETTINGS
from mcore_compat._translate import fields as DATA
from mcore_compat._translate.effects import HARMLESS_IF_MISSING, harmless_if_missing
from mcore_compat._translate.names import NO_DEFAULT, default_near, drift, existence_text, family, fields_in
from mcore_compat.configs import translate_fields
from mcore_compat.errors import InvalidArgumentError, UnsupportedVersionError
from mcore_compat.rank0 import reset_warn_once
from mcore_compat.training.ddp import DDPConfig
from mcore_compat.training.optimizer import _LEGACY_SETTINGS, OptimConfig, check_legacy_settings

pytestmark = pytest.mark.unit

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gen_config_fields.py"
V = Version


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config_fields", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


GEN = _script()


def _presence(cls: str, name: str) -> list[bool]:
    """Per listed release, whether the generated data says ``cls`` has ``name``."""
    return [name in fields_in(cls, r) for r in DATA.RELEASES]


# ---------------------------------------------------------------------------------------------------------------
# the hand-written classification
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("cls", "name"), [(c, n) for c, names in HARMLESS_IF_MISSING.items() for n in names])
def test_every_harmless_entry_is_a_field_of_its_class(cls: str, name: str) -> None:
    assert cls in DATA.FIELDS, f"{cls} is not a config class of the generated data"
    assert name in DATA.FIELDS[cls], f"{cls}.{name} is in no release (mcore_compat/_translate/effects.py)"


def test_the_adapters_settings_are_fields_of_the_generated_data() -> None:
    ddp = set(DATA.FIELDS["DistributedDataParallelConfig"])
    opt = set(DATA.FIELDS["OptimizerConfig"])
    assert {f.name for f in dataclasses.fields(DDPConfig)} - {"extra"} <= ddp
    assert set(DDP_SETTINGS) <= ddp
    assert {f.name for f in dataclasses.fields(OptimConfig)} - {"extra"} <= opt
    assert _LEGACY_SETTINGS <= opt


def test_the_adapters_classify_as_before() -> None:
    """What DDPConfig/OptimConfig did with an absent setting before the table was shared: "warn" stays harmless,
    "raise" stays refused."""
    before = {
        "DistributedDataParallelConfig": {"check_for_nan_in_grad": True, "average_in_collective": True,
                                          "overlap_param_gather": True, "align_param_gather": True,
                                          "num_distributed_optimizer_instances": False},
        "OptimizerConfig": {"overlap_grad_reduce": True, "overlap_param_gather": True,
                            "overlap_param_gather_with_optimizer_step": True, "decoupled_weight_decay": False,
                            "log_num_zeros_in_grad": True, "barrier_with_L1_time": True},
    }
    for cls, names in before.items():
        for name, harmless in names.items():
            assert harmless_if_missing(cls, name) is harmless, (cls, name)


# ---------------------------------------------------------------------------------------------------------------
# the generated data and the generator's rules
# ---------------------------------------------------------------------------------------------------------------

def test_the_generated_data_covers_the_releases_of_the_matrix() -> None:
    from mcore_compat import support

    assert list(DATA.RELEASES) == [str(r.version) for r in support.Matrix(SCRIPT.parents[1] / "matrix").releases()], \
        "matrix/versions.toml lists other releases: run scripts/gen_config_fields.py"


def test_the_generated_classes_agree_with_the_symbol_table() -> None:
    from mcore_compat._facts.symbol_table import SYMBOLS

    for cls, (module, ranges) in DATA.CLASSES.items():
        for release in DATA.RELEASES:
            loc = SYMBOLS[cls].location_for(V(release))
            exists = any(in_range(release, r) for r in ranges)
            assert (loc is not None) == exists, (cls, release)
            if loc is not None:
                assert (loc.module, loc.attr) == (module, cls), (cls, release)


def test_the_declared_renames_are_the_generated_ones_and_hold_in_the_data() -> None:
    declared: dict[str, list[tuple[str, str]]] = {}
    for r in GEN.RENAMES:
        declared.setdefault(r.cls, []).append((r.old, r.new))
        assert r.source.startswith("megatron/core/"), f"{r.old} -> {r.new}: cite the Megatron file"
    assert {c: list(p) for c, p in DATA.RENAMES.items() if p} == declared
    for cls, pairs in DATA.RENAMES.items():
        present = [any(in_range(r, s) for s in DATA.CLASSES[cls][1]) for r in DATA.RELEASES]
        for old, new in pairs:
            assert GEN.verify_rename(DATA.RELEASES, present, _presence(cls, old), _presence(cls, new)) == []


RELEASES = ("0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0")
T, F = True, False


@pytest.mark.parametrize(("old", "new", "problem"), [
    ((T, F, F, F, F), (F, T, T, T, T), None),
    ((F, T, T, F, F), (F, F, F, T, T), None),  # introduced, then renamed
    ((T, T, F, F, F), (F, T, T, T, T), "both names exist in 0.5.0"),
    ((T, F, F, F, F), (F, F, T, T, T), "does not appear where the old one ends (0.5.0)"),
    ((T, F, T, F, F), (F, T, F, T, T), "2 runs"),
    ((F, F, F, T, T), (T, T, T, F, F), "does not appear where the old one ends (no later release)"),
    ((T, T, T, T, T), (F, F, F, F, F), "the new name exists in no release"),
])
def test_a_rename_holds_only_where_the_old_name_ends_as_the_new_one_begins(
        old: tuple[bool, ...], new: tuple[bool, ...], problem: str | None) -> None:
    problems = GEN.verify_rename(RELEASES, [True] * 5, list(old), list(new))
    if problem is None:
        assert problems == []
    else:
        assert any(problem in p for p in problems), problems


def test_a_rename_is_judged_only_where_the_class_exists() -> None:
    class_present = [False, False, True, True, True]
    assert GEN.verify_rename(RELEASES, class_present, [T, T, T, F, F], [F, F, F, T, T]) == []


def test_ranges_are_written_in_the_tables_syntax() -> None:
    assert GEN.ranges_of(RELEASES, [T, T, T, T, T]) == (">=0.4",)
    assert GEN.ranges_of(RELEASES, [F, T, T, F, T]) == (">=0.5,<0.7", ">=0.8")
    assert GEN.ranges_of(("0.17.0", "0.17.1", "0.18.0"), [F, T, F]) == (">=0.17.1,<0.18",)


@pytest.mark.parametrize(("source", "text"), [
    ("x: bool = False", "False"),
    ("x: int = -1", "-1"),
    ("x: float = 2**32", "4294967296"),
    ("x: str = 'native'", "'native'"),
    ("x: tuple = ()", "()"),
    ("x: list = field(default_factory=list)", "[]"),
    ("x: int = field(default=3, metadata={})", "3"),
    ("x: object = torch.float32", None),
    ("x: object = field(default_factory=lambda: [1])", None),
    ("x: int", None),
])
def test_defaults_are_kept_where_they_are_literals(source: str, text: str | None) -> None:
    stmt = ast.parse(source).body[0]
    assert isinstance(stmt, ast.AnnAssign)
    assert GEN.default_text(stmt.value) == text


def test_fields_are_read_with_inherited_ones_first_and_without_class_variables(tmp_path: Path) -> None:
    core = tmp_path / "megatron" / "core"
    (core / "transformer").mkdir(parents=True)
    (core / "model_parallel_config.py").write_text(
        "@dataclass\nclass ModelParallelConfig:\n    tensor_model_parallel_size: int = 1\n    fp16: bool = False\n")
    (core / "transformer" / "transformer_config.py").write_text(
        "from typing import ClassVar\nfrom ..model_parallel_config import ModelParallelConfig\n\n"
        "@dataclass\nclass TransformerConfig(ModelParallelConfig):\n    registry: ClassVar[dict] = {}\n"
        "    num_layers: int = 0\n    fp16: bool = True\n")
    fields = GEN.class_fields(GEN.tree_reader(tmp_path), "megatron/core/transformer/transformer_config.py",
                              "TransformerConfig")
    assert fields == {"tensor_model_parallel_size": "1", "fp16": "True", "num_layers": "0"}
    assert list(fields) == ["tensor_model_parallel_size", "fp16", "num_layers"]
    assert GEN.class_fields(GEN.tree_reader(tmp_path), "megatron/core/optimizer/optimizer_config.py",
                            "OptimizerConfig") is None


# ---------------------------------------------------------------------------------------------------------------
# lookups
# ---------------------------------------------------------------------------------------------------------------

def test_a_renamed_field_has_all_its_names_oldest_first() -> None:
    assert family("TransformerConfig", "bias_gelu_fusion") == ("bias_gelu_fusion", "bias_activation_fusion")
    assert family("TransformerConfig", "bias_activation_fusion") == ("bias_gelu_fusion", "bias_activation_fusion")
    assert family("TransformerConfig", "num_layers") == ("num_layers",)


def test_the_default_of_an_absent_field_is_the_nearest_releases() -> None:
    # tp_comm_atomic_ag: True in 0.5, False from 0.6
    assert default_near("TransformerConfig", ("tp_comm_atomic_ag",), V("0.4.0")) is True
    # async_tensor_model_parallel_allreduce: False until 0.15.x, True in 0.16.x, gone from 0.17
    assert default_near("TransformerConfig", ("async_tensor_model_parallel_allreduce",), V("0.19.2")) is True
    assert default_near("TransformerConfig", ("async_tensor_model_parallel_allreduce",), V("0.17.0rc1")) is True
    assert default_near("TransformerConfig", ("attention_backend",), V("0.4.0")) is NO_DEFAULT


def test_where_a_field_exists_is_said_in_words() -> None:
    assert existence_text("TransformerConfig", ("apply_rope_fusion",)) == \
        "TransformerConfig has apply_rope_fusion in v >= 0.5"
    text = existence_text("TransformerConfig", ("first_pipeline_num_layers", "num_layers_in_first_pipeline_stage"))
    assert text == ("TransformerConfig has num_layers_in_first_pipeline_stage in v >= 0.11; "
                    "first_pipeline_num_layers in 0.9 <= v < 0.11")
    assert existence_text("TransformerConfig", ("tp_comm_atomic_ag",)) == \
        "TransformerConfig has tp_comm_atomic_ag in v >= 0.5"  # two rows (the default changed), one range


def _fake_class(cls: str, version: str) -> type:
    """A dataclass with the fields and literal defaults the data gives ``cls`` in ``version``."""
    spec = []
    for name in sorted(fields_in(cls, version)):
        text = next(t for s, t in DATA.FIELDS[cls][name] if in_range(version, s))
        default: Any = None if text is None else ast.literal_eval(text)
        if isinstance(default, (list, dict, set)):
            spec.append((name, Any, dataclasses.field(default_factory=type(default))))
        else:
            spec.append((name, Any, dataclasses.field(default=default)))
    return dataclasses.make_dataclass(cls, spec)


def test_the_drift_check_is_clean_on_a_class_as_the_data_describes_it_and_names_a_wrong_row() -> None:
    real = _fake_class("OptimizerConfig", "0.6.0")
    assert drift("OptimizerConfig", real, "0.6.0") == []
    assert drift("DistributedDataParallelConfig", None, "0.6.0") == []
    lr = DATA.FIELDS["OptimizerConfig"]["lr"]
    DATA.FIELDS["OptimizerConfig"]["lr"] = ((">=0.7", "None"),)
    try:
        report = drift("OptimizerConfig", real, "0.6.0")
    finally:
        DATA.FIELDS["OptimizerConfig"]["lr"] = lr
    assert len(report) == 1 and "OptimizerConfig.lr" in report[0] and "0.6.0" in report[0], report
    assert drift("DistributedDataParallelConfig", None, "0.7.0")[0].startswith("the data says megatron-core 0.7.0 "
                                                                              "has DistributedDataParallelConfig")


# ---------------------------------------------------------------------------------------------------------------
# translation (the release given by version; its fields from the data)
# ---------------------------------------------------------------------------------------------------------------

def test_a_renamed_field_is_passed_under_the_releases_name_whichever_was_given() -> None:
    for given in ("bias_gelu_fusion", "bias_activation_fusion"):
        assert translate_fields("TransformerConfig", {given: True}, V("0.4.0")) == {"bias_gelu_fusion": True}
        assert translate_fields("TransformerConfig", {given: True}, V("0.19.2")) == {"bias_activation_fusion": True}
    both = {"bias_gelu_fusion": True, "bias_activation_fusion": True}
    assert translate_fields("TransformerConfig", both, V("0.5.0")) == {"bias_activation_fusion": True}


def test_both_names_with_different_values_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"bias_gelu_fusion=True.*bias_activation_fusion=False"):
        translate_fields("TransformerConfig", {"bias_gelu_fusion": True, "bias_activation_fusion": False},
                         V("0.16.1"))


def test_a_name_no_release_has_is_refused_with_close_matches() -> None:
    with pytest.raises(InvalidArgumentError, match=r"no field 'num_layer' in any .*did you mean 'num_layers'"):
        translate_fields("TransformerConfig", {"num_layer": 2}, V("0.16.1"))
    # a field the installed class has but the data does not know (a release newer than the data) is passed on
    assert translate_fields("TransformerConfig", {"brand_new": 1}, V("0.20.0"), present={"brand_new"}) == \
        {"brand_new": 1}


def test_an_absent_field_that_changes_results_is_refused_unless_at_its_default() -> None:
    with pytest.raises(UnsupportedVersionError, match=r"`qk_layernorm=True` cannot be honoured by megatron-core "
                                                      r"0\.5\.0: TransformerConfig has qk_layernorm in v >= 0\.6"):
        translate_fields("TransformerConfig", {"qk_layernorm": True}, V("0.5.0"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert translate_fields("TransformerConfig", {"qk_layernorm": False, "num_layers": 2}, V("0.5.0")) == \
            {"num_layers": 2}
    with pytest.raises(UnsupportedVersionError, match="moe_extended_tp"):
        translate_fields("TransformerConfig", {"moe_extended_tp": True}, V("0.19.2"))


def test_an_absent_harmless_field_warns_once_and_is_dropped() -> None:
    reset_warn_once()
    with pytest.warns(UserWarning, match=r"`apply_rope_fusion=True` has no effect on megatron-core 0\.4\.0"):
        assert translate_fields("TransformerConfig", {"apply_rope_fusion": True}, V("0.4.0")) == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert translate_fields("TransformerConfig", {"apply_rope_fusion": True}, V("0.4.0")) == {}


def test_the_optimizer_of_releases_without_one_refuses_what_it_cannot_honour() -> None:
    with pytest.raises(UnsupportedVersionError, match="decoupled_weight_decay=False"):
        check_legacy_settings(OptimConfig(decoupled_weight_decay=False), V("0.4.0"))
    with pytest.raises(UnsupportedVersionError, match="use_precision_aware_optimizer"):
        check_legacy_settings(OptimConfig(extra={"use_precision_aware_optimizer": True}), V("0.5.0"))
    with pytest.raises(InvalidArgumentError, match="did you mean 'muon_momentum'"):
        check_legacy_settings(OptimConfig(extra={"muon_momentun": 0.9}), V("0.5.0"))
    reset_warn_once()
    with pytest.warns(UserWarning, match="barrier_with_L1_time"):
        cfg = check_legacy_settings(OptimConfig(lr=1e-3, barrier_with_L1_time=True), V("0.5.0"))
    assert cfg.lr == 1e-3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_legacy_settings(OptimConfig(lr=1e-3, bf16=True, clip_grad=0.5, use_distributed_optimizer=True,
                                          decoupled_lr=1e-4, decoupled_min_lr=1e-5), V("0.4.0"))
