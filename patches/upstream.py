"""Patches of purpose ``"upstream_bug"``: Megatron-Core bugs that are not specific to CPU (they hit GPU users
without TransformerEngine as well). Both patch a Megatron module when it is imported (or at once, if it is), so
they may be applied before ``import megatron.core`` together with the stubs.
"""

from __future__ import annotations

import types
from typing import Any

from ..errors import UnsupportedFeatureError
from ._registry import Patch, register
from ._tools import Changes, Undo, skipped, when_imported_checked


# ------------------------------------------------------------------------------------------ fp32opt_abstract
def _fp32_sharded_state_dict(self: Any, *args: Any, **kwargs: Any) -> Any:
    raise UnsupportedFeatureError(
        "megatron-core 0.6.0's FP32Optimizer has no sharded_state_dict (upstream bug, fixed in 0.7.0); "
        "mcore-compat made the class instantiable, but distributed checkpointing of it is not available"
    )


def _patch_fp32_optimizer(module: types.ModuleType) -> Undo:
    cls = getattr(module, "FP32Optimizer", None)
    if cls is None:
        return skipped("fp32opt_abstract", f"{module.__name__} has no FP32Optimizer")
    abstract = frozenset(getattr(cls, "__abstractmethods__", frozenset()))
    if "sharded_state_dict" not in abstract:
        return skipped("fp32opt_abstract", "FP32Optimizer.sharded_state_dict is not abstract (already fixed?)")
    changes = Changes()
    changes.setattr(cls, "sharded_state_dict", _fp32_sharded_state_dict)
    changes.setattr(cls, "__abstractmethods__", abstract - {"sharded_state_dict"})
    return changes.undo


def _apply_fp32opt_abstract() -> Undo:
    return when_imported_checked("fp32opt_abstract", "megatron.core.optimizer.optimizer", _patch_fp32_optimizer)


register(
    Patch(
        name="fp32opt_abstract",
        versions=">=0.6,<0.7",
        purposes=("upstream_bug", "cpu"),
        description=(
            "0.6.0: FP32Optimizer does not implement the abstract MegatronOptimizer.sharded_state_dict, so "
            "get_megatron_optimizer with fp32 params and use_distributed_optimizer=False raises "
            "\"TypeError: Can't instantiate abstract class FP32Optimizer ...\". Gives it a sharded_state_dict "
            "that raises NotImplementedError (fixed upstream in 0.7.0)."
        ),
        apply_fn=_apply_fp32opt_abstract,
        targets=("megatron.core.optimizer.optimizer:FP32Optimizer",
                 "megatron.core.optimizer.optimizer:MegatronOptimizer.sharded_state_dict"),
    )
)


# ------------------------------------------------------------------------------------------------- fp8_noop
def _patch_fp8_utils(module: types.ModuleType) -> Undo:
    impl = getattr(module, "_quantize_param_shard_impl", None)
    if impl is None:
        return skipped("fp8_noop", f"{module.__name__} has no _quantize_param_shard_impl")

    def _quantize_param_shard_impl(model_params: Any, *args: Any, **kwargs: Any) -> Any:
        if len(model_params) == 0:
            return None
        return impl(model_params, *args, **kwargs)

    changes = Changes()
    changes.setattr(module, "_quantize_param_shard_impl", _quantize_param_shard_impl)
    return changes.undo


def _apply_fp8_noop() -> Undo:
    return when_imported_checked("fp8_noop", "megatron.core.fp8_utils", _patch_fp8_utils)


def _te_missing() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("transformer_engine") is None
    except (ImportError, ValueError):
        return True


register(
    Patch(
        name="fp8_noop",
        versions=">=0.12,<0.13",
        purposes=("upstream_bug", "cpu"),
        description=(
            "0.12.x without TransformerEngine: DistributedOptimizer.step() always calls "
            "fp8_utils.quantize_param_shard, whose no-TE fallback raises 'RuntimeError: Invalid Transformer "
            "Engine version for FP8 distributed optimizer' even for an empty list of FP8 params. Makes the "
            "empty call a no-op (what 0.13 does)."
        ),
        apply_fn=_apply_fp8_noop,
        needed_when=_te_missing,
        targets=("megatron.core.fp8_utils:_quantize_param_shard_impl", "megatron.core.fp8_utils:quantize_param_shard"),
    )
)


# ------------------------------------------------------------------------------------- stale_embedding_ranks
_STALE_RANK_GLOBALS = ("_EMBEDDING_GLOBAL_RANKS", "_POSITION_EMBEDDING_GLOBAL_RANKS")


def _patch_parallel_state(module: types.ModuleType) -> Undo:
    destroy = getattr(module, "destroy_model_parallel", None)
    initialize = getattr(module, "initialize_model_parallel", None)
    present = [name for name in _STALE_RANK_GLOBALS if hasattr(module, name)]
    if destroy is None or initialize is None or not present:
        return skipped("stale_embedding_ranks", f"{module.__name__} has no destroy/initialize_model_parallel or "
                                                f"embedding rank globals")

    def _not_a_member() -> None:
        # [] rather than None: 0.4-0.8's is_rank_in_*_embedding_group() evaluate `rank in <global>` unguarded.
        for name in present:
            if getattr(module, name) is None:
                setattr(module, name, [])

    def destroy_model_parallel(*args: Any, **kwargs: Any) -> Any:
        result = destroy(*args, **kwargs)
        for name in present:
            setattr(module, name, [])
        return result

    def initialize_model_parallel(*args: Any, **kwargs: Any) -> Any:
        result = initialize(*args, **kwargs)
        _not_a_member()
        return result

    destroy_model_parallel.__doc__ = destroy.__doc__
    initialize_model_parallel.__doc__ = initialize.__doc__
    changes = Changes()
    changes.setattr(module, "destroy_model_parallel", destroy_model_parallel)
    changes.setattr(module, "initialize_model_parallel", initialize_model_parallel)
    return changes.undo


def _apply_stale_embedding_ranks() -> Undo:
    return when_imported_checked("stale_embedding_ranks", "megatron.core.parallel_state", _patch_parallel_state)


register(
    Patch(
        name="stale_embedding_ranks",
        versions=">=0.4,<0.13",
        purposes=("upstream_bug",),
        description=(
            "0.4-0.12.x: parallel_state.destroy_model_parallel() leaves _EMBEDDING_GLOBAL_RANKS and "
            "_POSITION_EMBEDDING_GLOBAL_RANKS set, so after a re-initialisation with another pipeline layout "
            "is_rank_in_position_embedding_group() answers for the old layout and finalize_model_grads fails "
            "with 'position embedding group is not initialized' (or all-reduces in a stale group); and on "
            "0.4-0.8 a rank outside those groups gets a TypeError from `rank in None`. destroy resets both "
            "(what 0.13 does) and both mean 'not a member' as an empty list."
        ),
        apply_fn=_apply_stale_embedding_ranks,
        targets=tuple(f"megatron.core.parallel_state:{name}" for name in (
            "destroy_model_parallel", "initialize_model_parallel", "is_rank_in_embedding_group",
            "is_rank_in_position_embedding_group")),
    )
)
