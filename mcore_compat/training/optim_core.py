"""``get_megatron_optimizer``'s two paths onto ``megatron.core.optimizer`` (0.6+).

The public builder (fact ``public_builder_params``, read from ``megatron/core/optimizer/__init__.py``) and, when
the public builder cannot express the call (``per_model_buffers``, explicit data-parallel groups, an instance id),
the private ``_get_megatron_optimizer_based_on_param_groups`` (fact ``private_builder_params``: its arguments drift
at 0.8, 0.9, 0.10, 0.15, 0.16, 0.18).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from packaging.version import Version

from .._translate.translate import drop_or_raise
from ..capabilities import fact
from ..errors import InvalidArgumentError, UnsupportedVersionError
from ..rank0 import warn_once_rank_0
from ._common import default_dp_group, group_ranks, mcore, parallel_state, same_group
from .optim_groups import (
    _conds_to_overrides,
    _param_groups,
    _unshadowed_lr_mult,
    _warn_unapplied_decoupled_lr,
)


def _core_params(name: str, version: Version) -> tuple[str, ...]:
    """The parameter list fact ``name`` of megatron.core.optimizer (``None`` in its rows where there is none)."""
    params = fact(name, version)
    if params is None:
        raise UnsupportedVersionError(f"megatron-core {version} has no megatron.core.optimizer ({name})")
    return tuple(params)


# ----------------------------------------------------------------------------------------------------------------
# public builder
# ----------------------------------------------------------------------------------------------------------------

def _public(version: Version, config: Any, chunks: list[Any], a: dict[str, Any]) -> Any:
    accepted = _core_params("public_builder_params", version)
    kwargs: dict[str, Any] = {}
    if "no_weight_decay_cond" in accepted:
        if a["config_overrides"] is not None:
            raise UnsupportedVersionError(f"config_overrides needs megatron-core 0.16+; installed {version}. Use "
                                          f"no_weight_decay_cond/scale_lr_cond/lr_mult.")
        kwargs.update(no_weight_decay_cond=a["no_weight_decay_cond"], scale_lr_cond=a["scale_lr_cond"],
                      lr_mult=a["lr_mult"])
    else:
        if a["config_overrides"] is not None:
            if a["no_weight_decay_cond"] is not None or a["scale_lr_cond"] is not None:
                raise InvalidArgumentError(
                    "pass config_overrides or no_weight_decay_cond/scale_lr_cond, not both"
                )
            kwargs["config_overrides"] = a["config_overrides"]
            _warn_unapplied_decoupled_lr(config, a["config_overrides"])
        elif a["no_weight_decay_cond"] is not None or a["scale_lr_cond"] is not None:
            kwargs["config_overrides"] = _conds_to_overrides(config, a["no_weight_decay_cond"],
                                                             a["scale_lr_cond"], a["lr_mult"])
    if "use_gloo_process_groups" in accepted:
        kwargs["use_gloo_process_groups"] = a["use_gloo_process_groups"]
    else:
        drop_or_raise("use_gloo_process_groups", a["use_gloo_process_groups"], True, version, harmful=False,
                      why="gloo groups are created by parallel_state and only used for checkpointing")
    if a["pg_collection"] is not None:
        if "pg_collection" not in accepted:
            raise UnsupportedVersionError(f"pg_collection needs megatron-core 0.15+; installed {version}")
        kwargs["pg_collection"] = a["pg_collection"]
    fn = mcore("optimizer").get_megatron_optimizer
    with _unshadowed_lr_mult(version, a):
        return fn(config, chunks, **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# private builder
# ----------------------------------------------------------------------------------------------------------------

def _private(version: Version, config: Any, chunks: list[Any], a: dict[str, Any]) -> Any:
    import torch.distributed as dist

    ps = parallel_state()
    accepted = set(_core_params("private_builder_params", version))
    groups = _param_groups(version, config, chunks, a)
    if any(g["is_expert_parallel"] and g["params"] for g in groups):
        raise UnsupportedVersionError(
            "mcore_compat's explicit-group/per_model_buffers path handles dense parameters only; this model has "
            "expert-parallel parameters. Call without per_model_buffers/explicit groups to use Megatron's builder.")
    groups = [g for g in groups if not g["is_expert_parallel"]]
    buffers = a["per_model_buffers"]
    if buffers is None:
        buffers = {i: c.buffers for i, c in enumerate(chunks) if hasattr(c, "buffers")}
    mp_group = ps.get_model_parallel_group()
    explicit_dp = a["data_parallel_group"] is not None and not same_group(a["data_parallel_group"],
                                                                          default_dp_group())
    dp_group = a["data_parallel_group"] if a["data_parallel_group"] is not None else default_dp_group()
    gloo = a["data_parallel_group_gloo"]
    if gloo is None and a["use_gloo_process_groups"]:
        if explicit_dp:
            warn_once_rank_0("mcore_compat: explicit data_parallel_group without data_parallel_group_gloo: the "
                             "distributed optimizer gets no gloo group (only its parameter-state checkpointing "
                             "needs it).")
        else:
            gloo = default_dp_group(gloo=True)
    idx = a["data_parallel_group_idx"]
    if idx is None:
        idx = dist.get_rank(mp_group)
    kwargs: dict[str, Any] = {
        "config": config, "model_chunks": chunks, "param_groups": groups, "per_model_buffers": buffers,
        "model_parallel_group": mp_group, "data_parallel_group": dp_group, "data_parallel_group_gloo": gloo,
        "data_parallel_group_idx": idx,
    }
    inst = a["distributed_optimizer_instance_id"]
    if "distributed_optimizer_instance_id" in accepted:
        kwargs["distributed_optimizer_instance_id"] = 0 if inst is None else inst
    else:
        drop_or_raise("distributed_optimizer_instance_id", inst or 0, 0, version, harmful=True,
                      why="several distributed-optimizer instances exist from 0.10")
    if config.use_distributed_optimizer:
        kwargs.update(_grad_stats_group(version, dp_group, mp_group, explicit_dp, accepted))
        _check_buffer_groups(buffers, dp_group)
    if a["pg_collection"] is not None:
        if "pg_collection" not in accepted:
            raise UnsupportedVersionError(f"pg_collection is not taken by the optimizer builder of {version}")
        kwargs["pg_collection"] = a["pg_collection"]
    kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    return mcore("optimizer")._get_megatron_optimizer_based_on_param_groups(**kwargs)


def _grad_stats_group(version: Version, dp_group: Any, mp_group: Any, explicit_dp: bool,
                      accepted: set[str]) -> dict[str, Any]:
    """The DistributedOptimizer's grad-norm/num-zeros group: every rank holding a shard of one model replica."""
    import torch.distributed as dist

    ps = parallel_state()
    # The grad-stats group can be passed to the private builder (intra_dist_opt_group) from 0.15; before it is
    # the whole world (0.6-0.12) or parallel_state's intra-instance group (0.13-0.14).
    passable = "intra_dist_opt_group" in accepted
    if not explicit_dp:
        if passable:
            return {"intra_dist_opt_group": ps.get_intra_distributed_optimizer_instance_group()}
        return {}
    dp_size, mp_size = dist.get_world_size(dp_group), dist.get_world_size(mp_group)
    if dp_size * mp_size == dist.get_world_size():
        return {"intra_dist_opt_group": None} if passable else {}
    if mp_size == 1 and passable:
        return {"intra_dist_opt_group": dp_group}
    raise UnsupportedVersionError(
        f"distributed optimizer over an explicit data-parallel group of {dp_size} rank(s) (ranks "
        f"{group_ranks(dp_group)}) x model-parallel size {mp_size} != world size {dist.get_world_size()}: "
        f"megatron-core {version} reduces the grad norm over the whole world (its grad-stats group can be passed "
        f"from 0.15, and only for model-parallel size 1 here), which would give a wrong norm and clipping.")


def _check_buffer_groups(buffers: Mapping[int, Any], dp_group: Any) -> None:
    for chunk_buffers in buffers.values():
        for buf in chunk_buffers:
            group = getattr(buf, "data_parallel_group", None)
            if group is not None and not same_group(group, dp_group):
                raise InvalidArgumentError(
                    f"the DDP buffers are sharded over ranks {group_ranks(group)} but the optimizer was given "
                    f"data_parallel_group ranks {group_ranks(dp_group)}; they must be the same group"
                )
