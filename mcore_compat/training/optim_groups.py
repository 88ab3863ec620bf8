"""The optimizer's parameter-group rules and the (lr, weight decay) each group gets.

The no-weight-decay and decoupled-lr rules, the pre-0.16 ``no_weight_decay_cond/scale_lr_cond/lr_mult`` as 0.16+
``config_overrides``, 0.6/0.7's ``_get_param_groups`` without its ``lr_mult`` bug, the groups handed to Megatron's
private builder, and the per-group learning rate and weight decay a constant schedule gives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from packaging.version import Version

from ..capabilities import fact, has
from ..errors import UnsupportedVersionError
from ..rank0 import warn_once_rank_0
from ._common import mcore
from .scheduler import set_group_lr

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
    ``scheduler_ignores_lr_mult``), so the scaled learning rate has to live in ``max_lr``/``min_lr``. The scaled
    groups also record ``lr_mult`` (which that scheduler does not read): a bound left ``None`` (no ``min_lr`` in
    the config) is filled from the scheduler's and scaled by it (``scheduler._fill_group_bounds``). The keys are
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
                                                    "min_lr": _scaled(config.min_lr, lr_mult), "lr_mult": lr_mult}
        if decoupled:
            overrides[key("mcore_compat_decoupled_scaled_lr", lambda n, p: scaled(n, p) and _is_decoupled(n, p))] = {
                "max_lr": dlr * lr_mult, "min_lr": _scaled(dmin, lr_mult), "lr_mult": lr_mult}
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


def _warn_unapplied_decoupled_lr(config: Any, overrides: Mapping[Any, Any]) -> None:
    """Say (once, rank 0) that ``decoupled_lr`` is not applied: megatron-core 0.16+ applies it only through
    ``get_standard_config_overrides(config)``, which a user's ``config_overrides`` replace
    (``megatron/core/optimizer/__init__.py``, ``_get_param_groups``); silent unless no entry carries that
    learning rate as its ``max_lr``."""
    decoupled = getattr(config, "decoupled_lr", None)
    if decoupled is None or any(isinstance(v, Mapping) and v.get("max_lr") == decoupled for v in overrides.values()):
        return
    warn_once_rank_0(
        f"get_megatron_optimizer: decoupled_lr={decoupled} is not applied with config_overrides (megatron-core "
        f"applies it only through get_standard_config_overrides(config), which config_overrides replace): add "
        f"{{ParamKey(attr='is_embedding_or_output_parameter'): {{'max_lr': {decoupled}}}}} or start from "
        f"get_standard_config_overrides(config)")


# ----------------------------------------------------------------------------------------------------------------
# the param groups handed to Megatron's private builder
# ----------------------------------------------------------------------------------------------------------------

def _param_groups(version: Version, config: Any, chunks: list[Any], a: dict[str, Any]) -> list[dict]:
    opt = mcore("optimizer")
    style = fact("param_groups_style", version)
    if style == "v16":
        overrides = a["config_overrides"]
        if overrides is not None:
            _warn_unapplied_decoupled_lr(config, overrides)
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
