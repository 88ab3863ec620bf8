"""Wrap model chunks in Megatron's own ``DistributedDataParallel`` on every release (0.4 ... 0.19).

One settings object (:class:`DDPConfig`, or a real ``DistributedDataParallelConfig``, or a dict) and optional
explicit data-parallel groups are translated into what the installed constructor takes (the fact ``ddp_ctor``, read from
``megatron/core/distributed/distributed_data_parallel.py``): keyword arguments and grad buffers (0.4/0.5),
keyword arguments with ``ParamAndGradBuffer`` (0.6), a ``DistributedDataParallelConfig`` plus explicit groups
(0.7), groups from ``parallel_state`` (0.8-0.12), ``GradCommProcessGroups``/``ModelCommProcessGroups``
(0.13/0.14), ``ProcessGroupCollection`` (0.15+).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from packaging.version import Version

from .._facts.table import DDP_SETTINGS
from .._translate.effects import harmless_if_missing
from .._translate.translate import drop_or_raise
from ..capabilities import fact, fact_row, has
from ..errors import InvalidArgumentError, UnsupportedVersionError
from ._common import (
    as_chunk_list,
    config_items,
    default_dp_group,
    default_expert_dp_group,
    installed_version,
    mcore,
    model_config,
    parallel_state,
    same_group,
)
from .broadcast import GROUPS_ATTR
from .param_sync import REQUEST_ATTR
from .tied_buckets import check_tied_buckets

__all__ = ["DDPConfig", "ddp_config_of", "wrap_ddp", "zero_grad_buffer"]

_BUCKET_SIZE_V4 = 40_000_000  # the 0.4-0.6 constructor default
_FIELD_ALIASES = {"accumulate_allreduce_grads_in_fp32": "grad_reduce_in_fp32"}

#: Where the DDP's data-parallel group comes from, per constructor style (fact ``ddp_ctor``):
#:  "ctor" = constructor argument (honoured); "parallel_state" = read from parallel_state, cannot be overridden
#:  (an explicit group must equal it); "comm_pgs" = GradCommProcessGroups/ModelCommProcessGroups (honoured);
#:  "pg_collection" = ProcessGroupCollection (honoured).
_GROUP_SOURCE: dict[str, str] = {
    "kwargs_v4": "ctor", "kwargs_v6": "ctor", "ddpcfg_group": "ctor", "ddpcfg": "parallel_state",
    "ddpcfg_pgs": "comm_pgs", "ddpcfg_pgc": "pg_collection",
}


@dataclass
class DDPConfig:
    """Data-parallel settings, mirroring ``DistributedDataParallelConfig`` of 0.7+ (translated for 0.4-0.6).

    Attributes:
        grad_reduce_in_fp32: keep ``main_grad`` and reduce gradients in fp32 (0.4-0.6:
            ``accumulate_allreduce_grads_in_fp32``).
        overlap_grad_reduce: launch bucket reductions from backward hooks (needs the hooks set by
            :func:`~mcore_compat.training.install_training_hooks`).
        use_distributed_optimizer: shard optimizer state over DP (gradients are reduce-scattered).
        check_for_nan_in_grad: check gradients for NaN before reducing (0.6+; ignored with a warning before).
        bucket_size: elements per bucket; ``None`` = Megatron's default.
        average_in_collective: average inside the collective instead of pre-scaling (0.8+; warned before).
        overlap_param_gather: overlap the distributed optimizer's parameter all-gather with forward (0.9+: a DDP
            setting; 0.6-0.8: passed on to the optimizer by :func:`~mcore_compat.training.get_megatron_optimizer`;
            0.4/0.5: ignored with a warning). Read the weights between steps after
            :func:`~mcore_compat.training.finish_param_sync`.
        align_param_gather: align the all-gathers of the pipeline stages (0.9+).
        num_distributed_optimizer_instances: > 1 needs 0.10+ (raises before).
        extra: any other field of the installed ``DistributedDataParallelConfig`` (passed through; an unknown
            field raises).
    """

    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    use_distributed_optimizer: bool = False
    check_for_nan_in_grad: bool = False
    bucket_size: int | None = None
    average_in_collective: bool = False
    overlap_param_gather: bool = False
    align_param_gather: bool = False
    num_distributed_optimizer_instances: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_any(cls, value: Any) -> DDPConfig:
        """A :class:`DDPConfig` from a ``DDPConfig``, a mapping, or any dataclass (e.g. Megatron's config).

        Fields that :class:`DDPConfig` does not name go to :attr:`extra`; for a Megatron config only fields that
        differ from that class's defaults are kept there.
        """
        if value is None:
            return cls()
        if isinstance(value, DDPConfig):
            return dataclasses.replace(value, extra=dict(value.extra))
        items, defaults = config_items(value, "a DDP config; pass an mcore_compat DDPConfig, a dict, or a "
                                              "DistributedDataParallelConfig")
        for old_name, new_name in _FIELD_ALIASES.items():  # the 0.4-0.6 constructor's keyword names
            if old_name in items:
                old_value = items.pop(old_name)
                if new_name in items and items[new_name] != old_value:
                    raise InvalidArgumentError(
                        f"ddp_config: {old_name}={old_value!r} and {new_name}={items[new_name]!r} name one setting "
                        f"({old_name} is the 0.4-0.6 name of {new_name}); pass one of them")
                items.setdefault(new_name, old_value)
        own = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in items.items() if k in own}
        extra = dict(items.pop("extra", {}) or {})
        extra.update({k: v for k, v in items.items()
                      if k not in own and k != "extra" and (k not in defaults or defaults[k] != v)})
        return cls(**kwargs, extra=extra)


def _megatron_ddp_config_class() -> Any:
    return mcore("distributed.distributed_data_parallel_config").DistributedDataParallelConfig


def _releases_with(setting: str) -> str:
    """The releases that honour DDP setting ``setting`` (for messages)."""

    def takes_it(names: tuple[str, ...]) -> bool:
        return setting in names

    return fact_row("ddp_settings").where(takes_it)


def _check_missing_fields(cfg: DDPConfig, version: Version) -> dict[str, Any]:
    """The DDPConfig fields the installed release has; the others are dropped, warned about or refused."""
    keep: dict[str, Any] = {}
    defaults = DDPConfig()
    honoured = fact("ddp_settings", version)
    for name in DDP_SETTINGS:
        value = getattr(cfg, name)
        if name in honoured:
            keep[name] = value
        else:
            drop_or_raise(name, value, getattr(defaults, name), version,
                          harmful=not harmless_if_missing("DistributedDataParallelConfig", name),
                          why=f"DistributedDataParallelConfig.{name} exists in {_releases_with(name)}")
    return keep


def _to_megatron_config(cfg: DDPConfig, version: Version) -> Any:
    """A fresh ``DistributedDataParallelConfig`` of the installed release (0.7+) from ``cfg``."""
    cls = _megatron_ddp_config_class()
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = _check_missing_fields(cfg, version)
    unknown = sorted(set(cfg.extra) - names)
    if unknown:
        raise UnsupportedVersionError(
            f"DistributedDataParallelConfig of megatron-core {version} has no field(s) {unknown}; remove them from "
            f"DDPConfig.extra"
        )
    kwargs.update(cfg.extra)
    return cls(**kwargs)


def ddp_config_of(ddp_config: Any, version: Version | None = None) -> Any:
    """What the installed DDP takes as settings: a ``DistributedDataParallelConfig`` (0.7+) or a keyword dict.

    A real ``DistributedDataParallelConfig`` of the installed release is copied (Megatron's DDP mutates
    ``bucket_size``), anything else goes through :class:`DDPConfig`.
    """
    version = version or installed_version()
    style = fact("ddp_ctor", version)
    if style.startswith("kwargs"):
        cfg = DDPConfig.from_any(ddp_config)
        if cfg.extra:
            drop_or_raise("DDPConfig.extra", cfg.extra, {}, version, harmful=True,
                          why="releases before 0.7 have no DistributedDataParallelConfig")
        keep = _check_missing_fields(cfg, version)
        out = {
            "accumulate_allreduce_grads_in_fp32": keep["grad_reduce_in_fp32"],
            "overlap_grad_reduce": keep["overlap_grad_reduce"],
            "use_distributed_optimizer": keep["use_distributed_optimizer"],
            "bucket_size": _BUCKET_SIZE_V4 if keep["bucket_size"] is None else keep["bucket_size"],
        }
        if style == "kwargs_v6":
            out["check_for_nan_in_grad"] = keep["check_for_nan_in_grad"]
        return out
    cls = _megatron_ddp_config_class()
    if isinstance(ddp_config, cls):
        return dataclasses.replace(ddp_config)
    return _to_megatron_config(DDPConfig.from_any(ddp_config), version)


def _explicit_groups(version: Version, dp_group: Any, expert_group: Any) -> tuple[Any, Any]:
    """Normalise explicit groups: a group equal to parallel_state's default counts as "not given"."""
    if dp_group is not None and same_group(dp_group, default_dp_group()):
        dp_group = None
    if expert_group is not None and same_group(expert_group, default_expert_dp_group()):
        expert_group = None
    return dp_group, expert_group


def _comm_pgs_kwargs(dp_group: Any, expert_group: Any, version: Version) -> dict[str, Any]:
    """``grad_comm_pgs``/``model_comm_pgs`` (0.13/0.14) with explicit data-parallel groups."""
    pgc = mcore("process_groups_config")
    ps = parallel_state()
    dp = dp_group if dp_group is not None else default_dp_group()
    grad = pgc.GradCommProcessGroups()
    grad.dp = dp
    grad.dp_cp = dp
    grad.intra_dp_cp = dp
    expt = expert_group if expert_group is not None else ps.get_expert_data_parallel_group()
    grad.expt_dp = expt
    grad.intra_expt_dp = expt
    model = pgc.ModelCommProcessGroups()
    model.pp = ps.get_pipeline_model_parallel_group()
    model.ep = ps.get_expert_model_parallel_group()
    model.tp = ps.get_tensor_model_parallel_group()
    return {"grad_comm_pgs": grad, "model_comm_pgs": model}


def _pg_collection_with(dp_group: Any, expert_group: Any) -> Any:
    """parallel_state's ``ProcessGroupCollection`` (0.15+) with the data-parallel groups replaced."""
    pgc = mcore("process_groups_config").ProcessGroupCollection.use_mpu_process_groups()
    if dp_group is not None:
        pgc.dp = dp_group
        pgc.dp_cp = dp_group
        pgc.intra_dp_cp = dp_group
    if expert_group is not None:
        pgc.expt_dp = expert_group
        pgc.intra_expt_dp = expert_group
    return pgc


def _group_kwargs(version: Version, dp_group: Any, expert_group: Any, pg_collection: Any,
                  num_instances: int) -> dict[str, Any]:
    style = fact("ddp_ctor", version)
    source = _GROUP_SOURCE[style]
    if pg_collection is not None:
        if source != "pg_collection":
            raise UnsupportedVersionError(f"`pg_collection` needs megatron-core 0.15+; installed {version}. Pass "
                                          f"data_parallel_group= instead.")
        if dp_group is not None or expert_group is not None:
            raise InvalidArgumentError("pass either pg_collection or explicit data-parallel groups, not both")
        return {"pg_collection": pg_collection}
    dp_group, expert_group = _explicit_groups(version, dp_group, expert_group)
    if source == "ctor":
        out = {"data_parallel_group": dp_group if dp_group is not None else default_dp_group()}
        if style == "kwargs_v4":
            if expert_group is not None:
                raise UnsupportedVersionError(
                    f"megatron-core {version} does not put expert parameters in DDP buffers (they are reduced by "
                    f"finalize_model_grads over parallel_state's data-modulo-expert group); an explicit "
                    f"expert_data_parallel_group cannot be honoured")
        else:
            out["expert_data_parallel_group"] = (expert_group if expert_group is not None
                                                 else default_expert_dp_group())
        return out
    if dp_group is None and expert_group is None:
        return {}
    if source == "parallel_state":
        raise UnsupportedVersionError(
            f"megatron-core {version}'s DistributedDataParallel always uses parallel_state's data-parallel group "
            f"(ranks {_ranks_text(default_dp_group())}); an explicit group (ranks "
            f"{_ranks_text(dp_group or expert_group)}) cannot be honoured, and ignoring it would reduce "
            f"gradients over other ranks. Initialise parallel_state so that its DP group is the one you want.")
    if num_instances > 1:
        raise UnsupportedVersionError("explicit data-parallel groups with num_distributed_optimizer_instances > 1 "
                                      "are not supported by mcore_compat; pass pg_collection instead")
    if source == "comm_pgs":
        return _comm_pgs_kwargs(dp_group, expert_group, version)
    return {"pg_collection": _pg_collection_with(dp_group, expert_group)}


def _ranks_text(group: Any) -> str:
    from ._common import group_ranks

    ranks = group_ranks(group)
    return "?" if ranks is None else ",".join(map(str, ranks))


def wrap_ddp(
    model: Any,
    config: Any = None,
    ddp_config: Any = None,
    *,
    data_parallel_group: Any = None,
    expert_data_parallel_group: Any = None,
    disable_bucketing: bool | Sequence[bool] = False,
    pg_collection: Any = None,
) -> Any:
    """Wrap a module or a list of model chunks in Megatron's ``DistributedDataParallel``.

    Args:
        model: a module or a list of model chunks (virtual pipeline stages).
        config: the ``TransformerConfig``/``ModelParallelConfig`` the model uses; default
            ``get_model_config(chunk)`` (the same object, so hooks set on it later reach the schedules).
        ddp_config: :class:`DDPConfig`, a mapping of its fields, or the installed
            ``DistributedDataParallelConfig``; default ``DDPConfig()``.
        data_parallel_group: reduce gradients over this group instead of parallel_state's DP x CP group.
            Honoured by 0.4-0.7 and 0.13+; on 0.8-0.12 a group other than parallel_state's raises
            :class:`~mcore_compat.errors.UnsupportedVersionError` (ignoring it would change the result).
        expert_data_parallel_group: the same for expert parameters (0.6+).
        disable_bucketing: one flag for all chunks, or one per chunk.
        pg_collection: a ``ProcessGroupCollection`` (0.15+) passed through as is.

    Returns:
        The wrapped module, or a list of wrapped chunks if ``model`` was a list/tuple.

    Raises:
        UnsupportedVersionError: with the distributed optimizer on 0.7-0.12, a tied embedding that the release
            would lay over two gradient buckets (:mod:`.tied_buckets`); raised before any chunk is wrapped.
    """
    version = installed_version()
    chunks, was_list = as_chunk_list(model)
    flags = ([bool(disable_bucketing)] * len(chunks) if isinstance(disable_bucketing, bool)
             else [bool(f) for f in disable_bucketing])
    if len(flags) != len(chunks):
        raise InvalidArgumentError(
            f"disable_bucketing has {len(flags)} entries for {len(chunks)} model chunks"
        )
    style = fact("ddp_ctor", version)
    cls = mcore("distributed.distributed_data_parallel").DistributedDataParallel
    ddp_config, optimizer_gathers = _param_gather_request(ddp_config, version)
    num_instances = int(getattr(ddp_config, "num_distributed_optimizer_instances", None)
                        or DDPConfig.from_any(ddp_config).num_distributed_optimizer_instances)
    groups = _group_kwargs(version, data_parallel_group, expert_data_parallel_group, pg_collection, num_instances)
    if not style.startswith("kwargs"):  # 0.7+: refuse a tied embedding over two buckets before building anything
        settings = ddp_config_of(ddp_config, version)
        for chunk, flag in zip(chunks, flags, strict=True):
            check_tied_buckets(chunk, settings, version, data_parallel_group=data_parallel_group,
                               disable_bucketing=flag)
    wrapped = []
    for chunk, flag in zip(chunks, flags, strict=True):
        cfg = config if config is not None else model_config(chunk)
        settings = ddp_config_of(ddp_config, version)
        if style.startswith("kwargs"):
            wrapped.append(cls(config=cfg, module=chunk, disable_bucketing=flag, **settings, **groups))
        else:
            wrapped.append(cls(config=cfg, ddp_config=settings, module=chunk, disable_bucketing=flag, **groups))
        if optimizer_gathers:
            setattr(wrapped[-1], REQUEST_ATTR, True)
        if "data_parallel_group" in groups:  # 0.4-0.7: the DDP object keeps no group of its own (broadcast_params)
            setattr(wrapped[-1], GROUPS_ATTR,
                    (groups["data_parallel_group"], groups.get("expert_data_parallel_group")))
    return wrapped if was_list else wrapped[0]


def _param_gather_request(ddp_config: Any, version: Version) -> tuple[Any, bool]:
    """``(settings for DDP, whether the optimizer must overlap the param gather)``.

    Where the distributed optimizer, not DDP, owns the parameter all-gather (0.6-0.8, the fact
    ``param_gather_owner``), ``overlap_param_gather`` is not a DDP setting: it is taken out of the DDP
    settings and remembered on the wrapped chunks, for :func:`~mcore_compat.training.get_megatron_optimizer` to
    set on the ``OptimizerConfig``.
    """
    if fact("param_gather_owner", version) != "optimizer":
        return ddp_config, False
    request = DDPConfig.from_any(ddp_config)
    if not (request.overlap_param_gather and request.use_distributed_optimizer):
        return ddp_config, False
    return dataclasses.replace(request, overlap_param_gather=False), True


def zero_grad_buffer(model_chunks: Any, optimizer: Any = None, *, set_to_none: bool = True) -> None:
    """Zero the DDP gradient buffers of every chunk (and the optimizer's grads) before a step.

    Hides ``zero_grad_buffer(zero_buffer)`` (0.4/0.5) vs ``zero_grad_buffer()`` (0.6+). Chunks that are not
    Megatron DDP (plain modules) get ``module.zero_grad()``.
    """
    version = installed_version()
    takes_arg = has("zero_grad_buffer_arg", version)
    chunks, _ = as_chunk_list(model_chunks)
    for chunk in chunks:
        if hasattr(chunk, "zero_grad_buffer"):
            if takes_arg:
                chunk.zero_grad_buffer(zero_buffer=True)
            else:
                chunk.zero_grad_buffer()
        else:
            chunk.zero_grad(set_to_none=set_to_none)
    if optimizer is not None:
        try:
            optimizer.zero_grad(set_to_none=set_to_none)
        except TypeError:  # optimizers whose zero_grad takes no argument
            optimizer.zero_grad()
