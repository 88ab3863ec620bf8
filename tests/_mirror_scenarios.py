"""Rank body for tests/test_mirror_real.py: imports through the mirror (``mcore_compat.core``) next to the same
imports raw, on a rank of the session's group after the patches a CPU run needs. Returns plain data; the pytest
side asserts.

Each case is a Megatron path and a name; what it should give on the installed release comes from the data
(:func:`mcore_compat.surface.locate`): at the path (the mirror gives the raw object), moved (the raw import fails,
the mirror gives the object of the module it moved to), or absent (the mirror raises ``NameUnavailableError``
naming the releases that have it).
"""

from __future__ import annotations

import importlib
from typing import Any

TE_OLD = "megatron.core.transformer.custom_layers.transformer_engine"
TE_NEW = "megatron.core.extensions.transformer_engine"

#: Names clients import, at paths that exist on most releases.
COMMON: tuple[tuple[str, str], ...] = (
    ("megatron.core", "mpu"),
    ("megatron.core.parallel_state", "get_tensor_model_parallel_rank"),
    ("megatron.core.parallel_state", "initialize_model_parallel"),
    ("megatron.core.tensor_parallel", "ColumnParallelLinear"),
    ("megatron.core.transformer.transformer_config", "TransformerConfig"),
    ("megatron.core.transformer.module", "MegatronModule"),
    ("megatron.core.optimizer", "OptimizerConfig"),
    ("megatron.core.optimizer", "get_megatron_optimizer"),
    ("megatron.core.distributed", "DistributedDataParallel"),
    ("megatron.core.distributed", "DistributedDataParallelConfig"),
    ("megatron.core.distributed", "finalize_model_grads"),
    ("megatron.core.pipeline_parallel", "get_forward_backward_func"),
    ("megatron.core.models.gpt", "GPTModel"),
    ("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec"),
    ("megatron.core.utils", "get_model_config"),
    ("megatron.core.enums", "ModelType"),
    ("megatron.core.process_groups_config", "ProcessGroupCollection"),
    ("megatron.core.timers", "Timers"),
)

#: Names that moved in some release, imported from both places.
MOVED: tuple[tuple[str, str], ...] = (
    (TE_OLD, "TENorm"),
    (TE_NEW, "TENorm"),
    (TE_OLD, "TELayerNormColumnParallelLinear"),
    ("megatron.core.distributed.custom_fsdp", "FullyShardedDataParallel"),
    ("megatron.core.distributed.fsdp.mcore_fsdp_adapter", "FullyShardedDataParallel"),
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "apply_rotary_pos_emb"),
    ("megatron.core.models.common.embeddings.rope_utils", "apply_rotary_pos_emb"),
    ("megatron.core.utils", "is_float8tensor"),
    ("megatron.core.fp8_utils", "is_float8tensor"),
    ("megatron.core.parallel_state", "get_moe_layer_wise_logging_tracker"),
    ("megatron.core.transformer.moe.moe_utils", "get_moe_layer_wise_logging_tracker"),
    ("megatron.core.datasets.utils", "log_single_rank"),
    ("megatron.core.utils", "log_single_rank"),
    ("megatron.core.distributed.grad_buffer", "shard_buffer"),
    ("megatron.core.distributed.param_and_grad_buffer", "shard_buffer"),
    ("megatron.core.dist_checkpointing.serialization", "validate_sharding_integrity"),
    ("megatron.core.dist_checkpointing.validation", "validate_sharding_integrity"),
    ("megatron.core.datasets.blended_megatron_dataset_config", "GPTDatasetConfig"),
    ("megatron.core.datasets.gpt_dataset", "GPTDatasetConfig"),
    ("megatron.core.transformer.switch_mlp", "sinkhorn"),
    ("megatron.core.transformer.moe.moe_utils", "sinkhorn"),
)

#: Names some releases lack everywhere (each release lacks at least one).
ABSENT: tuple[tuple[str, str], ...] = (
    ("megatron.core.process_groups_config", "ProcessGroupCollection"),
    ("megatron.core.parallel_state", "get_data_modulo_expert_parallel_group"),
    ("megatron.core.optimizer", "LayerWiseDistributedOptimizer"),
    ("megatron.core.timers", "Timers"),
)

#: Modules some releases lack (a mirror module with nothing reachable on the release must not import).
ABSENT_MODULES: tuple[str, ...] = (
    "megatron.core.optimizer", "megatron.core.distributed.custom_fsdp", "megatron.core.process_groups_config",
    "megatron.core.tokenizers",
)


def _outcome(fn: Any) -> dict[str, Any]:
    try:
        value = fn()
    except Exception as exc:
        return {"ok": False, "error": type(exc).__name__, "message": str(exc)[:400],
                "import_error": isinstance(exc, ImportError),
                "compat_error": type(exc).__name__ == "NameUnavailableError",
                "releases": list(getattr(exc, "releases", ()) or ()),
                "symbol": getattr(exc, "symbol", None), "module": getattr(exc, "name", None)}
    return {"ok": True, "value": value}


def _raised(fn: Any) -> BaseException | None:
    try:
        fn()
    except BaseException as exc:
        return exc
    return None


def _from_import(module: str, name: str) -> Any:
    """``from <module> import <name>``, as a statement (what client code runs)."""
    scope: dict[str, Any] = {}
    exec(f"from {module} import {name} as _found", scope)
    return scope["_found"]


def _parents(module: str) -> list[str]:
    """``megatron.core.a.b`` -> ``["megatron.core.a", "megatron.core.a.b"]``."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(3, len(parts) + 1)]


def _case(module: str, name: str, release: str) -> dict[str, Any]:
    from mcore_compat import surface
    from mcore_compat._facts.mirror import mirror_path

    where = surface.locate(module, name, release)
    mirror = _outcome(lambda: _from_import(mirror_path(module), name))
    raw = _outcome(lambda: _from_import(module, name))
    out: dict[str, Any] = {
        "where": None if where is None else (where.module, where.moved),
        "having": list(surface.releases_having(module, name)),
        "summary": surface.range_summary(surface.releases_having(module, name)),
        "module_having": {m: list(surface.releases_having_module(m)) for m in _parents(module)},
        "raw_ok": raw["ok"], "raw_error": raw.get("error"),
        "mirror_ok": mirror["ok"],
        "mirror_error": {k: v for k, v in mirror.items() if k not in ("ok", "value")} if not mirror["ok"] else None,
    }
    if where is not None:
        target = _outcome(lambda: getattr(importlib.import_module(where.module), name))
        out["target_ok"] = target["ok"]
        out["target_error"] = target.get("error")
        out["identical"] = bool(mirror["ok"] and target["ok"] and mirror["value"] is target["value"])
    if raw["ok"] and mirror["ok"]:
        out["identical_to_raw"] = mirror["value"] is raw["value"]
    # the client's feature check, unchanged but for the module path
    code = (f"try:\n    from {mirror_path(module)} import {name}\n    found = True\n"
            f"except ImportError:\n    found = False\n")
    scope: dict[str, Any] = {}
    out["feature_check"] = _outcome(lambda: exec(code, scope) or scope["found"])
    out["feature_check"].pop("value", None)
    out["feature_check_found"] = scope.get("found")
    return out


def _module_case(module: str, release: str) -> dict[str, Any]:
    from mcore_compat import surface
    from mcore_compat._facts.mirror import mirror_path

    below = [m for m in surface.modules() if m == module or m.startswith(module + ".")]
    reachable = any(surface.has_module(m, release) or any(surface.locate(m, n, release) for n in surface.moved_names(m))
                    for m in below)
    got = _outcome(lambda: importlib.import_module(mirror_path(module)))
    got.pop("value", None)
    return {"reachable": reachable, "having": list(surface.releases_having_module(module)), **got}


def check_mirror() -> dict[str, Any]:
    """Every case of this module on the installed release, on this rank."""
    from mcore_compat import patches

    patches.apply_for_device("cpu")
    from mcore_compat._facts.mirror import installed_release

    release = installed_release()
    cases = {f"{m}:{n}": _case(m, n, release) for m, n in dict.fromkeys(COMMON + MOVED + ABSENT)}
    # a mirror module's names read through: a submodule is the mirror's, the rest Megatron's objects
    import mcore_compat.core.parallel_state as ps

    from mcore_compat import core

    real_ps = importlib.import_module("megatron.core.parallel_state")
    attributes = {
        "submodule_is_mirror": type(core.parallel_state).__name__ == "MirrorModule" and core.parallel_state is ps,
        "function_is_real": ps.get_tensor_model_parallel_rank is real_ps.get_tensor_model_parallel_rank,
    }
    # an attribute read of a missing name answers as the raw module does (AttributeError: hasattr is False), a
    # from-import raises NameUnavailableError; a star import gives Megatron's names
    from mcore_compat.errors import SymbolUnavailableError

    attributes["hasattr_missing_is_false"] = not hasattr(ps, "not_a_megatron_name") and \
        getattr(ps, "not_a_megatron_name", None) is None and hasattr(ps, "get_tensor_model_parallel_rank")
    attributes["attribute_error_is_symbol_unavailable"] = isinstance(
        _raised(lambda: ps.not_a_megatron_name), SymbolUnavailableError)
    missing = _outcome(lambda: _from_import("mcore_compat.core.parallel_state", "not_a_megatron_name"))
    attributes["from_import_missing"] = (missing.get("error"), missing.get("import_error"))
    star: dict[str, Any] = {}
    exec("from mcore_compat.core.enums import *", star)
    attributes["star_import"] = star.get("ModelType") is importlib.import_module("megatron.core.enums").ModelType
    # an assignment through the mirror lands on Megatron's module, and a later one in Megatron's module is seen
    original = real_ps.get_tensor_model_parallel_rank
    try:
        ps.get_tensor_model_parallel_rank = len
        attributes["assignment_forwarded"] = real_ps.get_tensor_model_parallel_rank is len
        real_ps.get_tensor_model_parallel_rank = abs
        attributes["later_change_seen"] = ps.get_tensor_model_parallel_rank is abs
    finally:
        real_ps.get_tensor_model_parallel_rank = original
    attributes["moved_assignment_forwarded"] = _patch_through_a_moved_path(release)
    return {"release": release, "cases": cases, "attributes": attributes,
            "modules": {m: _module_case(m, release) for m in ABSENT_MODULES}}


def _patch_through_a_moved_path(release: str) -> bool:
    """A client's monkeypatch ``rope_utils.apply_rotary_pos_emb = patched`` through the mirror lands on the
    Megatron module the name is read from: ``rope_utils`` itself (0.10+), or ``rotary_pos_embedding`` where the
    release reaches the path by a move (0.4-0.9: no ``rope_utils`` module); reads through the mirror see it."""
    from mcore_compat import surface

    path = "megatron.core.models.common.embeddings.rope_utils"
    where = surface.locate(path, "apply_rotary_pos_emb", release)
    assert where is not None
    owner = importlib.import_module(where.module)
    original = owner.apply_rotary_pos_emb
    mirror = importlib.import_module("mcore_compat.core.models.common.embeddings.rope_utils")

    def patched(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    try:
        mirror.apply_rotary_pos_emb = patched
        return owner.apply_rotary_pos_emb is patched and mirror.apply_rotary_pos_emb is patched
    finally:
        owner.apply_rotary_pos_emb = original
