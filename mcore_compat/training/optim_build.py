"""One ``get_megatron_optimizer`` signature over every release.

The call goes to Megatron's public or private builder (``mcore_compat/training/optim_core.py``) on 0.6+; releases
0.4/0.5 have no ``megatron.core.optimizer`` and are served by ``mcore_compat.legacy_optimizer.build_legacy_optimizer``
(the legacy path here). Every group then gets the (lr, weight decay) a constant schedule would give it.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from packaging.version import Version

from .._translate.translate import drop_or_raise
from ..capabilities import has
from ..errors import InvalidArgumentError, UnsupportedVersionError
from ._common import as_chunk_list, default_dp_group, installed_version, parallel_state, same_group
from .optim_config import OptimConfig, check_legacy_settings, check_optimizer_config, optimizer_config_of
from .optim_core import _private, _public
from .optim_groups import _apply_lr_and_weight_decay, _skip_embedding_no_weight_decay
from .param_sync import REQUEST_ATTR

__all__ = ["get_megatron_optimizer"]


# ----------------------------------------------------------------------------------------------------------------
# legacy (0.4/0.5)
# ----------------------------------------------------------------------------------------------------------------

def _check_legacy_tied_layout(config: Any, chunks: list[Any]) -> None:
    """0.4/0.5's DDP reduce-scatters the first and last pipeline stage's copies of a tied embedding over shards
    that do not line up (each stage's buffer has its own layout), and ``finalize_model_grads`` then all-reduces
    the whole embedding gradient between the stages, mixing reduced and unreduced parts: refuse that layout."""
    if not getattr(OptimConfig.from_any(config), "use_distributed_optimizer", False):
        return
    ps = parallel_state()
    if ps.get_pipeline_model_parallel_world_size() < 2 or ps.get_data_parallel_world_size() < 2:
        return
    for chunk in chunks:
        core = chunk
        while type(core).__name__ in ("DistributedDataParallel", "Float16Module") and hasattr(core, "module"):
            core = core.module
        if getattr(core, "share_embeddings_and_output_weights", False):
            raise UnsupportedVersionError(
                f"megatron-core {installed_version()}: the distributed optimizer with embeddings tied across "
                f"pipeline stages at data-parallel size {ps.get_data_parallel_world_size()} trains the embedding "
                f"with wrong gradients (this release's DDP shards the two stages' copies differently, and "
                f"finalize_model_grads sums them unaligned). Use use_distributed_optimizer=False, untie the "
                f"embeddings (share_embeddings_and_output_weights=False), or megatron-core >= 0.6.")


def _legacy(version: Version, config: Any, chunks: list[Any], a: dict[str, Any]) -> Any:
    _check_legacy_tied_layout(config, chunks)
    check_legacy_settings(config, version)
    try:
        legacy = importlib.import_module("mcore_compat.legacy_optimizer")
    except ImportError as exc:
        raise UnsupportedVersionError(
            f"megatron-core {version} has no megatron.core.optimizer and mcore_compat.legacy_optimizer is not "
            f"available: {exc}") from exc
    build = legacy.build_legacy_optimizer
    params = inspect.signature(build).parameters  # our own module; its keyword set is not versioned data
    takes_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    defaults = {"no_weight_decay_cond": None, "scale_lr_cond": None, "lr_mult": 1.0, "per_model_buffers": None,
                "data_parallel_group": None, "data_parallel_group_gloo": None, "data_parallel_group_idx": None,
                "distributed_optimizer_instance_id": None, "use_gloo_process_groups": True,
                "default_skip_embedding_weight_decay": False, "config_overrides": None, "pg_collection": None}
    kwargs = {}
    for name, default in defaults.items():
        value = a[name]
        if name in params or takes_var_kw:
            if value is not default:
                kwargs[name] = value
        else:
            drop_or_raise(name, value, default, version,
                          harmful=name not in ("use_gloo_process_groups", "default_skip_embedding_weight_decay",
                                               "data_parallel_group_gloo", "per_model_buffers"),
                          why="mcore_compat.legacy_optimizer does not take it")
    return build(OptimConfig.from_any(config), chunks, **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# the one entry point
# ----------------------------------------------------------------------------------------------------------------

def get_megatron_optimizer(
    config: Any,
    model_chunks: Any,
    *,
    no_weight_decay_cond: Callable[[str, Any], bool] | None = None,
    scale_lr_cond: Callable[[str, Any], bool] | None = None,
    lr_mult: float = 1.0,
    config_overrides: Any = None,
    per_model_buffers: Mapping[int, list[Any]] | None = None,
    data_parallel_group: Any = None,
    data_parallel_group_gloo: Any = None,
    data_parallel_group_idx: int | None = None,
    distributed_optimizer_instance_id: int | None = None,
    use_gloo_process_groups: bool = True,
    default_skip_embedding_weight_decay: bool = False,
    pg_collection: Any = None,
) -> Any:
    """Build Megatron's optimizer for DDP-wrapped ``model_chunks`` with one signature on every release.

    Args:
        config: :class:`OptimConfig`, a mapping of its fields, or Megatron's ``OptimizerConfig``.
        model_chunks: the DDP-wrapped chunks (a single module is accepted).
        no_weight_decay_cond, scale_lr_cond, lr_mult: the pre-0.16 parameter-group conditions
            (``cond(name, param) -> bool``); translated to ``config_overrides`` on 0.16+.
        config_overrides: 0.16+ ``{ParamKey: ParamGroupOverride}`` (raises before 0.16). As in Megatron they
            replace the standard overrides: biases and 1-D params decay unless an entry says ``wd_mult=0.0``, and
            ``decoupled_lr`` applies only through an entry (a one-time warning says so where no entry carries it).
        per_model_buffers: ``{chunk index: [buffers]}`` for the distributed optimizer (default: each chunk's
            ``buffers``); giving it selects Megatron's private builder.
        data_parallel_group, data_parallel_group_gloo, data_parallel_group_idx: explicit groups for the
            distributed optimizer (private builder); a group equal to parallel_state's counts as not given.
        distributed_optimizer_instance_id: 0.10+ (non-zero raises before).
        use_gloo_process_groups: 0.12+ (``False`` is warned about and ignored before).
        default_skip_embedding_weight_decay: no weight decay for embeddings either, when no
            ``no_weight_decay_cond`` is given (0.14/0.15's flag, applied on every release).
        pg_collection: 0.15+ ``ProcessGroupCollection``.

    Returns:
        Megatron's optimizer (``step() -> (update_successful, grad_norm, num_zeros_in_grad)``); on 0.4/0.5 the
        optimizer of ``mcore_compat.legacy_optimizer`` with the same interface.

    Raises:
        InvalidArgumentError: values no release can train with (see :func:`check_optimizer_config`), or
            ``config_overrides`` with ``default_skip_embedding_weight_decay``, before anything is built.
    """
    check_optimizer_config(config)
    if config_overrides is not None and default_skip_embedding_weight_decay:
        raise InvalidArgumentError(
            "get_megatron_optimizer: pass config_overrides or default_skip_embedding_weight_decay, not both: with "
            "config_overrides, add an entry {ParamKey(name='*embedding*'): {'wd_mult': 0.0}} instead")
    version = installed_version()
    chunks, _ = as_chunk_list(model_chunks)
    args = dict(no_weight_decay_cond=no_weight_decay_cond, scale_lr_cond=scale_lr_cond, lr_mult=lr_mult,
                config_overrides=config_overrides, per_model_buffers=per_model_buffers,
                data_parallel_group=data_parallel_group, data_parallel_group_gloo=data_parallel_group_gloo,
                data_parallel_group_idx=data_parallel_group_idx,
                distributed_optimizer_instance_id=distributed_optimizer_instance_id,
                use_gloo_process_groups=use_gloo_process_groups,
                default_skip_embedding_weight_decay=default_skip_embedding_weight_decay,
                pg_collection=pg_collection)
    # default_skip_embedding_weight_decay: one rule on every release (0.14/0.15's builder takes the flag, the others
    # a condition that says the same; as on 0.14/0.15 an explicit no_weight_decay_cond wins).
    if default_skip_embedding_weight_decay and no_weight_decay_cond is None:
        args["no_weight_decay_cond"] = _skip_embedding_no_weight_decay
    args["default_skip_embedding_weight_decay"] = False
    if not has("core_optimizer", version):
        optimizer = _legacy(version, config, chunks, args)
        settings = OptimConfig.from_any(config)
    else:
        settings = _with_param_gather_overlap(optimizer_config_of(config, version), chunks)
        needs_private = (per_model_buffers is not None or data_parallel_group_gloo is not None
                         or data_parallel_group_idx is not None or bool(distributed_optimizer_instance_id)
                         or (data_parallel_group is not None
                             and not same_group(data_parallel_group, default_dp_group())))
        build = _private if needs_private else _public
        optimizer = build(version, settings, chunks, args)
    # Megatron's builders only record lr_mult/wd_mult/max_lr (the scheduler applies them): without a scheduler
    # biases and norms would decay and decoupled/scaled groups would run at the base lr on 0.6+ only.
    _apply_lr_and_weight_decay(optimizer, settings.lr, settings.weight_decay, settings.lr, version)
    return optimizer


def _with_param_gather_overlap(cfg: Any, chunks: list[Any]) -> Any:
    """0.6-0.8: the optimizer owns the overlapped parameter all-gather; turn it on when the chunks were wrapped
    with ``overlap_param_gather`` (see ``wrap_ddp``). A copy: the caller's config is not changed."""
    if not any(getattr(c, REQUEST_ATTR, False) for c in chunks) or getattr(cfg, "overlap_param_gather", True):
        return cfg
    return dataclasses.replace(cfg, overlap_param_gather=True)
