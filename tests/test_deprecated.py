"""The capability names removed on 2026-12-01 (``mcore_compat._util.deprecated``) answer as they did.

* unit: for every release of the support matrix, ``has(old_name, release)`` (derived from today's facts) equals
  the old table's range; each name warns once (``DeprecationWarning``, naming its replacement); ``capability()``
  gives the old row; the current API is unchanged (no alias shadows a fact, ``capabilities()`` lists none of them,
  an unknown name still raises);
* the other public names removed since the README of 2026-12-01 (``DEPRECATED_NAMES``) answer with their old
  meaning and warn once naming the replacement;
* ``mcore`` (every release session): the old capability table's probe, re-run against the installed tree (its
  source read with ``ast``, nothing imported), equals ``has(old_name)`` and the old range.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest

from mcore_compat._facts.probes import calls_with_constant, def_has_param, defines, module_exists
from mcore_compat._facts.ranges import in_range
from mcore_compat._facts.table import FACTS
from mcore_compat._util import deprecated as _deprecated
from mcore_compat._util.deprecated import DEPRECATED_FLAGS, DEPRECATED_NAMES
from mcore_compat.capabilities import capabilities, capability, has, resolved
from mcore_compat.errors import UnknownFactError
from mcore_compat.support import releases

NAMES = sorted(DEPRECATED_FLAGS)
RELEASES = [str(r.version) for r in releases()]

# The old capability table's probes (mcore_compat/_capability_table.py until 2026-12-01); its signature probes
# (inspect.signature, which imports the module) read the ``def`` with ast instead, so nothing of Megatron is
# imported in the pytest process.
_DIST = "megatron.core.distributed"
_DDP = f"{_DIST}.distributed_data_parallel"
_DDPC = f"{_DIST}.distributed_data_parallel_config"
_BUF = f"{_DIST}.param_and_grad_buffer"
_FIN = f"{_DIST}.finalize_model_grads"
_OPT = "megatron.core.optimizer"
_LAYOUT = f"{_OPT}.param_layout"
_SCHED = "megatron.core.pipeline_parallel.schedules"
_DDP_INIT = "DistributedDataParallel.__init__"
_NO_PIPE = "forward_backward_no_pipelining"
_GMO = "get_megatron_optimizer"

OLD_PROBES: dict[str, Callable[[], bool]] = {
    "grad_buffer_legacy": module_exists(f"{_DIST}.grad_buffer"),
    "param_and_grad_buffer": module_exists(_BUF),
    "distributed_param_gather_in_ddp": defines(_DDP, "DistributedDataParallel.start_param_sync"),
    "optimizer_finish_param_sync": defines(f"{_OPT}.optimizer", "MegatronOptimizer.finish_param_sync"),
    "ddp_flat_kwargs": def_has_param(_DDP, _DDP_INIT, "accumulate_allreduce_grads_in_fp32"),
    "ddp_config": def_has_param(_DDP, _DDP_INIT, "ddp_config"),
    "ddp_explicit_dp_group": def_has_param(_DDP, _DDP_INIT, "data_parallel_group"),
    "ddp_expert_dp_group_arg": def_has_param(_DDP, _DDP_INIT, "expert_data_parallel_group"),
    "ddp_comm_pgs": def_has_param(_DDP, _DDP_INIT, "grad_comm_pgs"),
    "ddp_pg_collection": def_has_param(_DDP, _DDP_INIT, "pg_collection"),
    "ddp_average_in_collective": defines(_DDPC, "DistributedDataParallelConfig.average_in_collective"),
    "ddp_overlap_param_gather": defines(_DDPC, "DistributedDataParallelConfig.overlap_param_gather"),
    "ddp_num_distributed_optimizer_instances":
        defines(_DDPC, "DistributedDataParallelConfig.num_distributed_optimizer_instances"),
    "pad_buckets_high_nccl_busbw": defines(_DDPC, "DistributedDataParallelConfig.pad_buckets_for_high_nccl_busbw"),
    "bucket_pad_lcm_128": calls_with_constant((_BUF, _LAYOUT), ("lcm",), 128),
    "param_start_padding_64": calls_with_constant((_BUF, _LAYOUT), ("_pad", "pad_to_divisor"), 64),
    "finalize_num_tokens": def_has_param(_FIN, "finalize_model_grads", "num_tokens"),
    "finalize_grad_finalize_pgs": def_has_param(_FIN, "finalize_model_grads", "grad_finalize_pgs"),
    "finalize_pg_collection": def_has_param(_FIN, "finalize_model_grads", "pg_collection"),
    "finalize_force_all_reduce": def_has_param(_FIN, "finalize_model_grads", "force_all_reduce"),
    "get_forward_backward_func_takes_pp_size": def_has_param(_SCHED, "get_forward_backward_func", "pp_size"),
    "schedule_pg_collection_selector": def_has_param(_SCHED, "get_forward_backward_func", "schedule_pg_collection"),
    "schedule_first_val_step": def_has_param(_SCHED, _NO_PIPE, "first_val_step"),
    "schedule_adjust_tensor_shapes_fn": def_has_param(_SCHED, _NO_PIPE, "adjust_tensor_shapes_fn"),
    "schedule_grad_finalize_pgs": def_has_param(_SCHED, _NO_PIPE, "grad_finalize_pgs"),
    "schedule_pg_collection": def_has_param(_SCHED, _NO_PIPE, "pg_collection"),
    "get_megatron_optimizer_legacy_conds": def_has_param(_OPT, _GMO, "no_weight_decay_cond"),
    "get_megatron_optimizer_config_overrides": def_has_param(_OPT, _GMO, "config_overrides"),
    "use_gloo_process_groups": def_has_param(_OPT, _GMO, "use_gloo_process_groups"),
    "get_megatron_optimizer_comm_pgs": def_has_param(_OPT, _GMO, "grad_comm_pgs"),
    "get_megatron_optimizer_pg_collection": def_has_param(_OPT, _GMO, "pg_collection"),
    "default_skip_embedding_weight_decay": def_has_param(_OPT, _GMO, "default_skip_embedding_weight_decay"),
    "private_builder_model_chunks":
        def_has_param(_OPT, "_get_megatron_optimizer_based_on_param_groups", "model_chunks"),
}


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts as a fresh process would: no deprecated name has warned yet."""
    monkeypatch.setattr(_deprecated, "_WARNED", set())


def test_the_33_removed_names_are_back() -> None:
    assert len(DEPRECATED_FLAGS) == 33
    assert set(OLD_PROBES) == set(DEPRECATED_FLAGS)
    assert not set(DEPRECATED_FLAGS) & set(FACTS), "an alias must not shadow a current fact"
    for row in DEPRECATED_FLAGS.values():
        assert row.fact in FACTS, f"{row.name}: its replacement fact {row.fact!r} is not in the fact table"
        assert row.fact in row.replacement


@pytest.mark.parametrize("name", NAMES)
def test_alias_keeps_its_old_value_on_every_release(name: str) -> None:
    row = DEPRECATED_FLAGS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        got = {v: has(name, v) for v in RELEASES}
    want = {v: in_range(v, row.was) for v in RELEASES}
    assert got == want, f"has({name!r}) differs from the old range {row.was!r} on " + ", ".join(
        v for v in RELEASES if got[v] != want[v])


def test_warns_once_naming_the_replacement() -> None:
    with pytest.warns(DeprecationWarning, match=r"has\('finalize_num_tokens'\).*'num_tokens' in "
                                                r"fact\('finalize_params'\)") as record:
        assert has("finalize_num_tokens", "0.8.0") is True
    assert record[0].filename == __file__, "the warning points at the caller's line"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert has("finalize_num_tokens", "0.6.0") is False  # no second warning
    with pytest.warns(DeprecationWarning, match=r"ddp_config.*fact\('ddp_ctor'\)"):
        assert has("ddp_config", "0.16.1") is True  # another name warns on its own


def test_capability_gives_the_old_row() -> None:
    with pytest.warns(DeprecationWarning, match="param_and_grad_buffer"):
        row = capability("param_and_grad_buffer")
    assert row.name == "param_and_grad_buffer" and row.is_flag
    assert row.value_for("0.5.0") is False and row.value_for("0.6.0") is True
    assert "ddp_buffer_attrs" in row.description and "distributed_data_parallel.py" in row.files()


def test_current_api_unchanged() -> None:
    listed = {c.name for c in capabilities()}
    assert not listed & set(DEPRECATED_FLAGS)
    assert not set(resolved("0.16.1")) & set(DEPRECATED_FLAGS)
    with pytest.raises(UnknownFactError, match="no_such_capability"):
        has("no_such_capability", "0.16.1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert has("core_optimizer", "0.16.1") is True  # a current name never warns


def _old_name(path: str) -> object:
    """``path`` looked up as a client would: import the module, then the attribute chain."""
    import importlib

    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise AssertionError(f"{path}: no module")


def test_other_removed_names_answer_with_their_old_meaning() -> None:
    from packaging.version import Version

    from mcore_compat import training
    from mcore_compat._facts.rows import Fact
    from mcore_compat.binding.manifest import Manifest
    from mcore_compat.selfcheck.oracle import Rule

    manifest = Manifest((), (), "0.16.1")
    old = {"mcore_compat.capabilities.Capability": lambda: _old_name("mcore_compat.capabilities.Capability") is Fact,
           "mcore_compat.layout.version.MIN_VERSION":
               lambda: _old_name("mcore_compat.layout.version.MIN_VERSION") == Version("0.4.0"),
           "mcore_compat.binding.manifest.Manifest.format": lambda: manifest.format == manifest.format_version,
           "mcore_compat.selfcheck.oracle.unsupported_group":
               lambda: [_old_name("mcore_compat.selfcheck.oracle.unsupported_group")(g, Rule("adam", True))
                        for g in ({"lr": 1e-3}, {"amsgrad": True}, {"maximize": True})] == [None, "amsgrad", "maximize"],
           "mcore_compat.get_megatron_optimizer":  # the naming rule: the adapter, now mcore_compat.training's
               lambda: _old_name("mcore_compat.get_megatron_optimizer") is training.get_megatron_optimizer}
    assert set(old) == set(DEPRECATED_NAMES)
    for path, answers in old.items():
        with pytest.warns(DeprecationWarning, match=path.rpartition(".")[2]) as record:
            assert answers(), path
        assert DEPRECATED_NAMES[path].split()[0] in str(record[0].message)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            answers()  # once per process


def test_a_renamed_parameter_is_accepted_under_its_old_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from mcore_compat.errors import InvalidArgumentError

    def scale(x: float, factor: float = 1.0) -> float:
        return x * factor

    monkeypatch.setitem(_deprecated.DEPRECATED_PARAMS, f"{__name__}.{scale.__qualname__}(mult)", "factor")
    wrapped = _deprecated.renamed_params(scale)
    assert _deprecated.renamed_params(_old_name) is _old_name  # nothing declared: the function itself
    with pytest.warns(DeprecationWarning, match=r"'mult' is deprecated; pass 'factor'"):
        assert wrapped(2.0, mult=3.0) == 6.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert wrapped(2.0, factor=4.0) == wrapped(2.0, mult=4.0) == 8.0  # once per process
    with pytest.raises(InvalidArgumentError, match="pass 'factor' only"):
        wrapped(2.0, mult=3.0, factor=3.0)


@pytest.mark.mcore
@pytest.mark.parametrize("name", NAMES)
def test_alias_equals_old_probe_on_installed_release(name: str) -> None:
    from mcore_compat.detect import detect

    version = detect().version
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        said = has(name)
    assert said == in_range(version, DEPRECATED_FLAGS[name].was)
    found = OLD_PROBES[name]()
    assert said == found, (f"has({name!r}) is {said} on megatron-core {version}, the old capability table's probe "
                           f"finds {found}; fix the row in mcore_compat/_util/deprecated.py")
