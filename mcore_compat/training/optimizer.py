"""One ``get_megatron_optimizer`` signature over every release, and ``optimizer_step``.

The call is mapped onto the installed public builder (fact ``public_builder_params``, read from
``megatron/core/optimizer/__init__.py``) or, when the public builder cannot express it (``per_model_buffers``,
explicit data-parallel groups, an instance id), onto the private ``_get_megatron_optimizer_based_on_param_groups``
(fact ``private_builder_params``: its arguments drift at 0.8, 0.9, 0.10, 0.15, 0.16, 0.18).
Releases 0.4/0.5 have no ``megatron.core.optimizer``; they are served by
``mcore_compat.legacy_optimizer.build_legacy_optimizer``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from packaging.version import Version

from .._config_effects import harmless_if_missing
from .._config_names import existence_text
from .._config_translate import drop_or_raise, translate_fields
from ..capabilities import fact, has
from ..errors import InvalidArgumentError, UnsupportedVersionError
from ..rank0 import warn_once_rank_0
from ._common import (
    as_chunk_list,
    config_items,
    default_dp_group,
    group_ranks,
    installed_version,
    mcore,
    parallel_state,
    same_group,
)
from .param_sync import REQUEST_ATTR
from .scheduler import set_group_lr

__all__ = ["OptimConfig", "get_megatron_optimizer", "optimizer_config_of", "optimizer_step", "set_lr_and_weight_decay"]


@dataclass
class OptimConfig:
    """Optimizer settings with the field names of Megatron's ``OptimizerConfig`` (0.6 baseline + later fields).

    Translated to the installed ``OptimizerConfig`` by :func:`optimizer_config_of`: fields the release lacks are
    dropped when at their default, warned about when they cannot change a step's result, refused otherwise.
    ``params_dtype`` defaults to ``torch.float32`` (``None`` here so that importing needs no torch).
    ``extra`` holds any other field of the installed ``OptimizerConfig`` (passed through; unknown ones raise).
    """

    optimizer: str = "adam"
    lr: float | None = None
    min_lr: float | None = None
    decoupled_lr: float | None = None
    decoupled_min_lr: float | None = None
    weight_decay: float = 0.01
    fp16: bool = False
    bf16: bool = False
    params_dtype: Any = None
    loss_scale: float | None = None
    initial_loss_scale: float = 2**32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-08
    sgd_momentum: float = 0.9
    use_distributed_optimizer: bool = False
    clip_grad: float = 1.0
    log_num_zeros_in_grad: bool = False
    barrier_with_L1_time: bool = False
    decoupled_weight_decay: bool = True
    overlap_param_gather_with_optimizer_step: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_any(cls, value: Any) -> OptimConfig:
        """An :class:`OptimConfig` from an ``OptimConfig``, a mapping, or any dataclass (Megatron's config)."""
        if isinstance(value, OptimConfig):
            return dataclasses.replace(value, extra=dict(value.extra))
        items, defaults = config_items(value, "an optimizer config; pass an mcore_compat OptimConfig, a dict, "
                                              "or Megatron's OptimizerConfig")
        own = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        extra = dict(items.pop("extra", {}) or {})
        extra.update({k: v for k, v in items.items()
                      if k not in own and (k not in defaults or defaults[k] != v)})
        # Megatron-internal bookkeeping fields (timers, set in __post_init__ ...) are not settings.
        extra.pop("timers", None)
        return cls(**{k: v for k, v in items.items() if k in own}, extra=extra)


def _core_params(name: str, version: Version) -> tuple[str, ...]:
    """The parameter list fact ``name`` of megatron.core.optimizer (``None`` in its rows where there is none)."""
    params = fact(name, version)
    if params is None:
        raise UnsupportedVersionError(f"megatron-core {version} has no megatron.core.optimizer ({name})")
    return tuple(params)


def _megatron_optimizer_config_class() -> Any:
    return mcore("optimizer.optimizer_config").OptimizerConfig


def optimizer_config_of(config: Any, version: Version | None = None) -> Any:
    """The installed release's ``OptimizerConfig`` for ``config`` (0.6+).

    An instance of the installed class is returned unchanged.
    """
    version = version or installed_version()
    cls = _megatron_optimizer_config_class()
    if isinstance(config, cls):
        return config
    cfg = OptimConfig.from_any(config)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    defaults = OptimConfig()
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(OptimConfig):
        if f.name == "extra":
            continue
        value = getattr(cfg, f.name)
        if f.name == "params_dtype" and value is None:
            continue
        if f.name in names:
            kwargs[f.name] = value
        else:
            drop_or_raise(f.name, value, getattr(defaults, f.name), version,
                          harmful=not harmless_if_missing("OptimizerConfig", f.name),
                          why=existence_text("OptimizerConfig", (f.name,)))
    unknown = sorted(set(cfg.extra) - names)
    if unknown:
        raise UnsupportedVersionError(
            f"OptimizerConfig of megatron-core {version} has no field(s) {unknown}; remove them from "
            f"OptimConfig.extra")
    kwargs.update(cfg.extra)
    return cls(**kwargs)


# ----------------------------------------------------------------------------------------------------------------
# parameter-group conditions -> 0.16+ config_overrides
# ----------------------------------------------------------------------------------------------------------------

def _default_no_weight_decay(name: str, param: Any) -> bool:
    """Megatron's default no-decay rule (optimizer/__init__.py ``_get_param_groups``): biases and 1-D params."""
    return name.endswith(".bias") or len(param.shape) == 1


def _skip_embedding_no_weight_decay(name: str, param: Any) -> bool:
    """The default rule plus embeddings (0.14/0.15's ``default_skip_embedding_weight_decay``)."""
    return _default_no_weight_decay(name, param) or "embedding" in name


def _is_decoupled(name: str, param: Any) -> bool:
    return bool(getattr(param, "is_embedding_or_output_parameter", False))


def _scaled(value: float | None, mult: float) -> float | None:
    return None if value is None else value * mult


def _conds_to_overrides(config: Any, no_weight_decay_cond: Callable | None, scale_lr_cond: Callable | None,
                        lr_mult: float) -> Any:
    """Translate the pre-0.16 ``no_weight_decay_cond/scale_lr_cond/lr_mult`` into 0.16+ ``config_overrides``.

    Same effective values as the pre-0.16 ``_get_param_groups`` with its scheduler: ``wd_mult=0`` where
    ``no_weight_decay_cond(name, param)`` (default: biases and 1-D params); decoupled LR for embedding/output
    params when ``config.decoupled_lr`` is set; and, where ``scale_lr_cond(name, param)``, the group's
    ``max_lr``/``min_lr`` times ``lr_mult`` - from 0.16 the scheduler ignores ``lr_mult`` (fact
    ``scheduler_ignores_lr_mult``), so the scaled learning rate has to live in ``max_lr``/``min_lr``. The keys are
    disjoint (0.16 refuses two overrides that set ``max_lr`` differently for one param).
    """
    opt = mcore("optimizer")
    occ = mcore("optimizer.optimizer_config")

    def key(name: str, cond: Callable[[str, Any], bool]) -> Any:
        pred = occ.ParamWithNamePredicate(name=name, fn=lambda param, pname: bool(cond(pname, param)))
        return occ.ParamKey(with_name_predicate=pred)

    standard = dict(opt.get_standard_config_overrides(config))
    # The standard no-decay key (it honours apply_wd_to_qk_layernorm) unless the caller gave a condition.
    overrides = {k: v for k, v in standard.items() if "wd_mult" in v and no_weight_decay_cond is None}
    if no_weight_decay_cond is not None:
        overrides[key("mcore_compat_no_weight_decay_cond", no_weight_decay_cond)] = {"wd_mult": 0.0}
    scale = scale_lr_cond if scale_lr_cond is not None and lr_mult != 1.0 else None
    decoupled = config.decoupled_lr is not None
    dlr = config.decoupled_lr
    dmin = config.decoupled_min_lr if config.decoupled_min_lr is not None else config.min_lr

    def scaled(n: str, p: Any) -> bool:
        return scale is not None and bool(scale(n, p))

    if decoupled:
        overrides[key("mcore_compat_decoupled_lr", lambda n, p: _is_decoupled(n, p) and not scaled(n, p))] = {
            "max_lr": dlr, "min_lr": dmin}
    if scale is not None:
        overrides[key("mcore_compat_scale_lr_cond", lambda n, p: scaled(n, p) and not (
            decoupled and _is_decoupled(n, p)))] = {"max_lr": config.lr * lr_mult,
                                                    "min_lr": _scaled(config.min_lr, lr_mult)}
        if decoupled:
            overrides[key("mcore_compat_decoupled_scaled_lr", lambda n, p: scaled(n, p) and _is_decoupled(n, p))] = {
                "max_lr": dlr * lr_mult, "min_lr": _scaled(dmin, lr_mult)}
    return overrides


def _v6_param_groups(model_chunks: list[Any], no_weight_decay_cond: Callable | None,
                     scale_lr_cond: Callable | None, lr_mult: float,
                     use_decoupled_learning_rate: bool) -> list[dict[str, Any]]:
    """0.6/0.7's ``_get_param_groups`` (same signature and group keys) without its bug: it rebinds its own
    ``lr_mult`` argument in the loop, so params of ``scale_lr_cond`` visited after any other param get
    ``lr_mult=1.0`` (fact ``param_groups_lr_mult_shadowed``)."""
    # one grouping loop for both; imported here because legacy_optimizer imports torch
    from ..legacy_optimizer import _param_groups

    return _param_groups(model_chunks, no_weight_decay_cond, scale_lr_cond, lr_mult, use_decoupled_learning_rate,
                         is_decoupled=_is_decoupled)


@contextlib.contextmanager
def _unshadowed_lr_mult(version: Version, a: dict[str, Any]) -> Iterator[None]:
    """While Megatron's public builder runs on a release with ``param_groups_lr_mult_shadowed``, and only when a
    ``scale_lr_cond`` with ``lr_mult != 1`` is given, its module-level ``_get_param_groups`` is
    :func:`_v6_param_groups` (restored afterwards)."""
    if not (has("param_groups_lr_mult_shadowed", version) and a["scale_lr_cond"] is not None
            and a["lr_mult"] != 1.0):
        yield
        return
    module = mcore("optimizer")
    original = module._get_param_groups
    module._get_param_groups = _v6_param_groups
    try:
        yield
    finally:
        module._get_param_groups = original


def _apply_lr_and_weight_decay(optimizer: Any, lr: float | None, weight_decay: float, base_lr: float | None,
                               version: Version) -> None:
    """Give every group the (lr, weight decay) the release's scheduler would give it for a constant schedule at
    ``lr``: ``max_lr / base_lr * lr`` (decoupled and, on 0.16+, scaled groups keep their ratio) times
    ``lr_mult`` where the scheduler multiplies by it, and ``weight_decay * wd_mult``."""
    mult = not has("scheduler_ignores_lr_mult", version)
    for group in optimizer.param_groups:
        if lr is not None:
            peak = group.get("max_lr")
            ratio = peak / base_lr if peak is not None and base_lr else 1.0
            set_group_lr(group, lr * ratio * (float(group.get("lr_mult", 1.0)) if mult else 1.0))
        group["weight_decay"] = weight_decay * float(group.get("wd_mult", 1.0))


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

def _param_groups(version: Version, config: Any, chunks: list[Any], a: dict[str, Any]) -> list[dict]:
    opt = mcore("optimizer")
    style = fact("param_groups_style", version)
    if style == "v16":
        overrides = a["config_overrides"]
        if overrides is None and (a["no_weight_decay_cond"] is not None or a["scale_lr_cond"] is not None):
            overrides = _conds_to_overrides(config, a["no_weight_decay_cond"], a["scale_lr_cond"], a["lr_mult"])
        if overrides is None:
            # The public builder's default. 0.16/0.17's _get_param_groups applies it for None too, 0.18+'s does not
            # (optimizer/__init__.py), which would decay biases and norms: pass it explicitly on every release.
            overrides = opt.get_standard_config_overrides(config)
        return opt._get_param_groups(chunks, config, overrides)
    if a["config_overrides"] is not None:
        raise UnsupportedVersionError(f"config_overrides needs megatron-core 0.16+; installed {version}")
    conds = (a["no_weight_decay_cond"], a["scale_lr_cond"], a["lr_mult"])
    if style == "v6":
        build = _v6_param_groups if has("param_groups_lr_mult_shadowed", version) else opt._get_param_groups
        groups = build(chunks, *conds, use_decoupled_learning_rate=config.decoupled_lr is not None)
        return opt._update_min_and_max_lr_in_param_groups(
            groups, lr=config.lr, min_lr=config.min_lr, decoupled_lr=config.decoupled_lr,
            decoupled_min_lr=config.decoupled_min_lr)
    return opt._get_param_groups(chunks, *conds, lr=config.lr, min_lr=config.min_lr,
                                 decoupled_lr=config.decoupled_lr, decoupled_min_lr=config.decoupled_min_lr)


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


#: The OptimConfig settings mcore_compat's optimizer for 0.4/0.5 (``mcore_compat/legacy_optimizer.py``) implements
#: (``params_dtype`` is the model's: it optimizes the params as they are). Another setting, or an ``extra`` field, is
#: a field that optimizer lacks: dropped at its default, warned about when harmless, refused otherwise.
_LEGACY_SETTINGS = frozenset({
    "optimizer", "lr", "min_lr", "weight_decay", "fp16", "bf16", "params_dtype", "loss_scale", "initial_loss_scale",
    "min_loss_scale", "loss_scale_window", "hysteresis", "adam_beta1", "adam_beta2", "adam_eps", "sgd_momentum",
    "use_distributed_optimizer", "clip_grad", "log_num_zeros_in_grad", "decoupled_lr", "decoupled_min_lr",
})


def check_legacy_settings(config: Any, version: Version) -> OptimConfig:
    """``config`` as an :class:`OptimConfig` for mcore_compat's optimizer of 0.4/0.5, after refusing what it cannot
    honour (a non-default setting outside :data:`_LEGACY_SETTINGS` whose absence would change results, e.g.
    ``decoupled_weight_decay=False``) and warning about what it ignores harmlessly.

    Raises:
        UnsupportedVersionError: a setting it cannot honour would change results.
        InvalidArgumentError: an ``extra`` field that no release's ``OptimizerConfig`` has.
    """
    cfg = OptimConfig.from_any(config)
    defaults = OptimConfig()
    unread = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(OptimConfig)
              if f.name != "extra" and f.name not in _LEGACY_SETTINGS
              and getattr(cfg, f.name) != getattr(defaults, f.name)}
    translate_fields("OptimizerConfig", {**unread, **cfg.extra}, version, present=frozenset())
    return cfg


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
        config_overrides: 0.16+ ``{ParamKey: ParamGroupOverride}`` (raises before 0.16).
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
    """
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


class _NullTimers:
    """Stand-in for Megatron-LM's ``Timers`` for optimizers whose ``step`` wants one (0.4/0.5 tree)."""

    def __call__(self, *args: Any, **kwargs: Any) -> _NullTimers:
        return self

    def start(self, *args: Any, **kwargs: Any) -> None:
        return None

    def stop(self, *args: Any, **kwargs: Any) -> None:
        return None


_STEP_TAKES_ARGS_TIMERS: dict[type, bool] = {}


def _wants_args_timers(optimizer: Any) -> bool:
    """Whether ``optimizer.step`` is Megatron-LM 0.4/0.5's ``step(args, timers)`` (cached per class)."""
    cls = type(optimizer)
    if cls not in _STEP_TAKES_ARGS_TIMERS:
        required = [p.name for p in inspect.signature(optimizer.step).parameters.values()
                    if p.default is inspect.Parameter.empty
                    and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        _STEP_TAKES_ARGS_TIMERS[cls] = required == ["args", "timers"]
    return _STEP_TAKES_ARGS_TIMERS[cls]


def optimizer_step(optimizer: Any) -> tuple[bool, float | None, int | None]:
    """Run one optimizer step and return ``(update_successful, grad_norm, num_zeros_in_grad)``.

    Hides ``step(args, timers)`` (Megatron-LM 0.4/0.5 tree optimizers) vs ``step()`` (0.6+ and
    mcore_compat's legacy optimizer). The grad norm is a Python float (or ``None`` when the release does not
    compute it, e.g. ``clip_grad == 0`` on 0.6-0.11).
    """
    if _wants_args_timers(optimizer):
        result = optimizer.step(None, _NullTimers())
    else:
        result = optimizer.step()
    if not isinstance(result, tuple):
        result = (bool(result), None, None)
    ok, norm, zeros = (*result, None, None, None)[:3]
    if norm is not None and hasattr(norm, "item"):
        norm = norm.item()
    if zeros is not None and hasattr(zeros, "item"):
        zeros = zeros.item()
    return bool(ok), (None if norm is None else float(norm)), zeros


def _base_lr(optimizer: Any) -> float | None:
    """The configured (undecoupled, unscaled) learning rate the optimizer was built with."""
    for opt in (optimizer, *getattr(optimizer, "chained_optimizers", ())):
        config = getattr(opt, "config", None)
        lr = config.get("lr") if isinstance(config, dict) else getattr(config, "lr", None)
        if lr is not None:
            return float(lr)
    return None


def set_lr_and_weight_decay(optimizer: Any, lr: float, weight_decay: float) -> None:
    """Set every param group's effective learning rate and weight decay, as a constant schedule would.

    What ``get_megatron_optimizer`` does at build time, for new values: a group gets ``lr`` times its ratio to
    the configured learning rate (decoupled-lr groups, and ``scale_lr_cond`` groups on 0.16+, keep theirs)
    times its ``lr_mult`` where the release's scheduler applies it, and ``weight_decay * wd_mult``. The same
    effective (lr, weight decay) per parameter on every release.
    """
    _apply_lr_and_weight_decay(optimizer, lr, weight_decay, _base_lr(optimizer), installed_version())
