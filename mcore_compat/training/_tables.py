"""Data: how the training-step API of Megatron-Core changed, release by release.

Every row is ``(version range, value)``; :func:`lookup` returns the value of the row whose range contains the
installed release. The facts come from the released sources (``/work/shared/research/api-drift.md`` sections B,
E, F, H, re-checked by AST against every unpacked release 0.4.0 ... 0.19.2). Nothing outside this module compares
versions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from packaging.version import Version

from .._ranges import in_range
from ..errors import UnsupportedVersionError

T = TypeVar("T")


@dataclass(frozen=True)
class Row(Generic[T]):
    """``value`` holds for releases in ``versions`` (a PEP 440 range)."""

    versions: str
    value: T


#: ``(id(table), version) -> (table, value)``: tables are module constants, looked up on every training step.
_LOOKUP_CACHE: dict[tuple[int, Version], tuple[Any, Any]] = {}


def lookup(table: tuple[Row[T], ...], version: Version, what: str) -> T:
    """The value of the row of ``table`` whose range contains ``version``.

    Raises:
        UnsupportedVersionError: no row covers ``version`` (``what`` names the table in the message).
    """
    key = (id(table), version)
    hit = _LOOKUP_CACHE.get(key)
    if hit is not None and hit[0] is table:
        return hit[1]
    for row in table:
        if in_range(version, row.versions):
            _LOOKUP_CACHE[key] = (table, row.value)
            return row.value
    raise UnsupportedVersionError(f"{what}: megatron-core {version} is not covered by mcore_compat's tables")


def covered(table: tuple[Row[T], ...], version: Version) -> bool:
    """Whether some row of ``table`` covers ``version``."""
    return any(in_range(version, row.versions) for row in table)


# --------------------------------------------------------------------------------------------------------------
# DistributedDataParallel.__init__ (api-drift B.3)
# --------------------------------------------------------------------------------------------------------------

#: How the DDP constructor takes its settings and groups.
#:  "kwargs_v4":   (config, module, data_parallel_group, accumulate_allreduce_grads_in_fp32, overlap_grad_reduce,
#:                  use_distributed_optimizer, disable_bucketing, bucket_size)
#:  "kwargs_v6":   the above + expert_data_parallel_group, check_for_nan_in_grad
#:  "ddpcfg_group": (config, ddp_config, module, data_parallel_group, expert_data_parallel_group, disable_bucketing)
#:  "ddpcfg":      (config, ddp_config, module, disable_bucketing); groups from parallel_state
#:  "ddpcfg_pgs":  + grad_comm_pgs, model_comm_pgs (GradCommProcessGroups / ModelCommProcessGroups)
#:  "ddpcfg_pgc":  + pg_collection (ProcessGroupCollection)
DDP_CTOR: tuple[Row[str], ...] = (
    Row(">=0.4,<0.6", "kwargs_v4"),
    Row(">=0.6,<0.7", "kwargs_v6"),
    Row(">=0.7,<0.8", "ddpcfg_group"),
    Row(">=0.8,<0.13", "ddpcfg"),
    Row(">=0.13,<0.15", "ddpcfg_pgs"),
    Row(">=0.15", "ddpcfg_pgc"),
)

#: Fields of DistributedDataParallelConfig and the first release that has each (api-drift H). Fields of
#: :class:`~mcore_compat.training.DDPConfig` that the installed release lacks are handled by
#: :data:`DDP_FIELD_IF_MISSING`.
DDP_FIELD_SINCE: dict[str, str] = {
    "grad_reduce_in_fp32": "0.4",  # 0.4-0.6: accumulate_allreduce_grads_in_fp32 ctor argument
    "overlap_grad_reduce": "0.4",
    "use_distributed_optimizer": "0.4",
    "bucket_size": "0.4",
    "check_for_nan_in_grad": "0.6",
    "average_in_collective": "0.8",
    "overlap_param_gather": "0.9",
    "align_param_gather": "0.9",
    "num_distributed_optimizer_instances": "0.10",
}

#: What to do with a non-default DDPConfig field the installed release does not have:
#: "warn" = only speed/overlap or float rounding differ, "raise" = ignoring it would change results.
DDP_FIELD_IF_MISSING: dict[str, str] = {
    "check_for_nan_in_grad": "warn",
    "average_in_collective": "warn",  # AVG in the collective vs pre-division: same value up to rounding
    "overlap_param_gather": "warn",
    "align_param_gather": "warn",
    "num_distributed_optimizer_instances": "raise",
}

#: Where the DDP's data-parallel group comes from when the caller passes one explicitly:
#:  "ctor"      = constructor argument (honoured);
#:  "parallel_state" = read from parallel_state, cannot be overridden (an explicit group must equal it);
#:  "comm_pgs"  = GradCommProcessGroups/ModelCommProcessGroups (honoured);
#:  "pg_collection" = ProcessGroupCollection (honoured).
DDP_GROUP_SOURCE: tuple[Row[str], ...] = (
    Row(">=0.4,<0.8", "ctor"),
    Row(">=0.8,<0.13", "parallel_state"),
    Row(">=0.13,<0.15", "comm_pgs"),
    Row(">=0.15", "pg_collection"),
)

#: ``DistributedDataParallel.zero_grad_buffer`` takes ``zero_buffer`` (0.4-0.5) or nothing (0.6+) (B.8).
ZERO_GRAD_BUFFER_TAKES_ARG: tuple[Row[bool], ...] = (Row(">=0.4,<0.6", True), Row(">=0.6", False))

#: Who owns the distributed optimizer's parameter all-gather and overlaps it with the next forward
#: (``overlap_param_gather``; api-drift F.25):
#:  "none":      no Megatron distributed optimizer (0.4/0.5; mcore_compat.legacy_optimizer gathers synchronously);
#:  "optimizer": ``OptimizerConfig.overlap_param_gather``; DistributedOptimizer registers a process-wide module
#:               forward pre-hook, dispatches in ``zero_grad`` (optimizer/distrib_optimizer.py, 0.6-0.8);
#:               ``disable_pre_hook()`` removes it after a synchronous gather;
#:  "ddp":       ``DistributedDataParallelConfig.overlap_param_gather``; DDP's per-module forward pre-hooks and
#:               ``start_param_sync(force_sync=True)`` (distributed/distributed_data_parallel.py, 0.9+).
PARAM_GATHER_OVERLAP: tuple[Row[str], ...] = (
    Row(">=0.4,<0.6", "none"), Row(">=0.6,<0.9", "optimizer"), Row(">=0.9", "ddp"),
)

# --------------------------------------------------------------------------------------------------------------
# finalize_model_grads (B.5) and the schedules (B.7, E)
# --------------------------------------------------------------------------------------------------------------

#: Keyword arguments Megatron's ``finalize_model_grads`` accepts after ``model``.
FINALIZE_PARAMS: tuple[Row[tuple[str, ...]], ...] = (
    Row(">=0.4,<0.7", ()),
    Row(">=0.7,<0.14", ("num_tokens",)),
    Row(">=0.14,<0.15", ("num_tokens", "grad_finalize_pgs")),
    Row(">=0.15,<0.16", ("num_tokens", "pg_collection")),
    Row(">=0.16", ("num_tokens", "pg_collection", "force_all_reduce")),
)

#: ``get_forward_backward_func`` parameters (B.7).
GET_FWD_BWD_PARAMS: tuple[Row[tuple[str, ...]], ...] = (
    Row(">=0.4,<0.16", ()),
    Row(">=0.16,<0.19", ("pp_size", "vp_size")),
    Row(">=0.19", ("pp_size", "vp_size", "schedule_pg_collection")),
)

#: Keyword arguments every schedule accepts (beyond forward_step_func, data_iterator, model, num_microbatches,
#: seq_length, micro_batch_size, decoder_seq_length, forward_only, collect_non_loss_data).
SCHEDULE_EXTRA_PARAMS: tuple[Row[tuple[str, ...]], ...] = (
    Row(">=0.4,<0.5", ()),
    Row(">=0.5,<0.13", ("first_val_step",)),
    Row(">=0.13,<0.14", ("first_val_step", "adjust_tensor_shapes_fn")),
    Row(">=0.14,<0.15", ("first_val_step", "adjust_tensor_shapes_fn", "grad_finalize_pgs")),
    Row(">=0.15,<0.16", ("first_val_step", "adjust_tensor_shapes_fn", "pg_collection")),
    Row(">=0.16", ("first_val_step", "adjust_tensor_shapes_fn", "p2p_communicator", "pg_collection",
                   "force_all_reduce")),
)

#: The interleaved schedule (virtual pipeline stages) reads the number of virtual stages from
#: ``config.virtual_pipeline_model_parallel_size`` (pipeline_parallel/schedules.py, 0.13+: ``curr_vp_stage =
#: config.virtual_pipeline_model_parallel_size - 1``); before, from parallel_state only.
INTERLEAVED_READS_CONFIG_VPP: tuple[Row[bool], ...] = (Row(">=0.4,<0.13", False), Row(">=0.13", True))

#: Whether ``loss_func`` may return ``(loss, num_tokens, dict)`` and ``config.calculate_per_token_loss`` exists.
PER_TOKEN_LOSS: tuple[Row[bool], ...] = (Row(">=0.4,<0.7", False), Row(">=0.7", True))

# --------------------------------------------------------------------------------------------------------------
# Optimizer (B.1, B.2, B.9, H)
# --------------------------------------------------------------------------------------------------------------

#: Where ``get_megatron_optimizer`` comes from: "legacy" = no megatron.core.optimizer (0.4/0.5, served by
#: mcore_compat.legacy_optimizer), "core" = megatron.core.optimizer.
OPTIMIZER_SOURCE: tuple[Row[str], ...] = (Row(">=0.4,<0.6", "legacy"), Row(">=0.6", "core"))

#: Parameters of the public ``get_megatron_optimizer`` after ``(config, model_chunks)``.
PUBLIC_BUILDER_PARAMS: tuple[Row[tuple[str, ...]], ...] = (
    Row(">=0.6,<0.12", ("no_weight_decay_cond", "scale_lr_cond", "lr_mult")),
    Row(">=0.12,<0.14", ("no_weight_decay_cond", "scale_lr_cond", "lr_mult", "use_gloo_process_groups")),
    Row(">=0.14,<0.15", ("no_weight_decay_cond", "scale_lr_cond", "lr_mult", "use_gloo_process_groups",
                         "default_skip_embedding_weight_decay", "grad_comm_pgs", "model_comm_pgs")),
    Row(">=0.15,<0.16", ("no_weight_decay_cond", "scale_lr_cond", "lr_mult", "use_gloo_process_groups",
                         "default_skip_embedding_weight_decay", "pg_collection")),
    Row(">=0.16", ("config_overrides", "use_gloo_process_groups", "pg_collection",
                   "dump_param_to_param_group_map")),
)

#: Parameters of the private ``_get_megatron_optimizer_based_on_param_groups`` (all positional-or-keyword; we
#: always pass keywords).
PRIVATE_BUILDER_PARAMS: tuple[Row[tuple[str, ...]], ...] = (
    Row(">=0.6,<0.8", ("config", "param_groups", "per_model_buffers", "data_parallel_group",
                       "data_parallel_group_gloo", "data_parallel_group_idx")),
    Row(">=0.8,<0.9", ("config", "param_groups", "per_model_buffers", "model_parallel_group", "data_parallel_group",
                       "data_parallel_group_gloo", "data_parallel_group_idx")),
    Row(">=0.9,<0.10", ("config", "model_chunks", "param_groups", "per_model_buffers", "model_parallel_group",
                        "data_parallel_group", "data_parallel_group_gloo", "data_parallel_group_idx")),
    Row(">=0.10,<0.15", ("config", "model_chunks", "param_groups", "per_model_buffers", "model_parallel_group",
                         "data_parallel_group", "data_parallel_group_gloo", "data_parallel_group_idx",
                         "distributed_optimizer_instance_id")),
    Row(">=0.15,<0.16", ("config", "model_chunks", "param_groups", "per_model_buffers", "model_parallel_group",
                         "data_parallel_group", "data_parallel_group_gloo", "data_parallel_group_idx",
                         "intra_dist_opt_group", "distributed_optimizer_instance_id")),
    Row(">=0.16,<0.18", ("config", "model_chunks", "param_groups", "per_model_buffers", "model_parallel_group",
                         "data_parallel_group", "data_parallel_group_gloo", "data_parallel_group_idx",
                         "intra_dist_opt_group", "distributed_optimizer_instance_id", "pg_collection")),
    Row(">=0.18", ("config", "model_chunks", "param_groups", "per_model_buffers", "model_parallel_group",
                   "data_parallel_group", "data_parallel_group_gloo", "data_parallel_group_idx",
                   "intra_dist_opt_group", "distributed_optimizer_instance_id", "pg_collection",
                   "skip_megatron_wrapping")),
)

#: How the private path builds parameter groups:
#:  "v6":  _get_param_groups(model_chunks, no_wd, scale_lr, lr_mult, use_decoupled_learning_rate)
#:         then _update_min_and_max_lr_in_param_groups(groups, lr, min_lr, decoupled_lr, decoupled_min_lr)
#:  "v9":  _get_param_groups(model_chunks, no_wd, scale_lr, lr_mult, lr, min_lr, decoupled_lr, decoupled_min_lr
#:         [, default_skip_embedding_weight_decay 0.14-0.15])
#:  "v16": _get_param_groups(model_chunks, config, config_overrides)
PARAM_GROUPS_STYLE: tuple[Row[str], ...] = (
    Row(">=0.6,<0.9", "v6"),
    Row(">=0.9,<0.16", "v9"),
    Row(">=0.16", "v16"),
)

#: ``_get_param_groups`` takes ``default_skip_embedding_weight_decay`` (0.14-0.15 only).
PARAM_GROUPS_SKIP_EMBEDDING_WD: tuple[Row[bool], ...] = (
    Row(">=0.6,<0.14", False), Row(">=0.14,<0.16", True), Row(">=0.16", False),
)

#: The gradient-statistics (norm, zeros) group of the DistributedOptimizer can be passed to the private builder
#: (``intra_dist_opt_group``) from 0.15; before it is the whole world (0.6-0.12) or parallel_state's
#: intra-instance group (0.13-0.14).
DISTOPT_GRAD_STATS_GROUP_PARAM: tuple[Row[bool], ...] = (Row(">=0.6,<0.15", False), Row(">=0.15", True))

#: Fields of OptimizerConfig that moved or vanished, with what to do when a caller sets them to a non-default
#: value in a release that lacks them ("warn": no effect on the result of a step; "raise": it would change it).
OPT_FIELD_IF_MISSING: dict[str, str] = {
    "overlap_grad_reduce": "warn",  # lives in DistributedDataParallelConfig from 0.10 (0.7)
    "overlap_param_gather": "warn",  # idem (absent 0.10-0.13)
    "overlap_param_gather_with_optimizer_step": "warn",
    "decoupled_weight_decay": "raise",  # < 0.15: always AdamW (decoupled); Adam-with-L2 cannot be expressed
    "log_num_zeros_in_grad": "warn",
    "barrier_with_L1_time": "warn",
}

#: Tables that describe megatron.core.optimizer and so start at 0.6 (0.4/0.5 are served by legacy_optimizer).
CORE_OPTIMIZER_ONLY: tuple[str, ...] = (
    "PUBLIC_BUILDER_PARAMS", "PRIVATE_BUILDER_PARAMS", "PARAM_GROUPS_STYLE", "PARAM_GROUPS_SKIP_EMBEDDING_WD",
    "DISTOPT_GRAD_STATS_GROUP_PARAM",
)

#: OptimizerConfig fields of 0.6 that every core release (0.6+) has.
OPT_BASE_FIELDS: tuple[str, ...] = (
    "optimizer", "lr", "min_lr", "decoupled_lr", "decoupled_min_lr", "weight_decay", "fp16", "bf16",
    "params_dtype", "loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis",
    "adam_beta1", "adam_beta2", "adam_eps", "sgd_momentum", "use_distributed_optimizer", "clip_grad",
    "log_num_zeros_in_grad", "barrier_with_L1_time",
)
