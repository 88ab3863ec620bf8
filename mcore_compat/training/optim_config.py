"""The optimizer's settings: :class:`OptimConfig`, and what the installed release builds from them.

:func:`optimizer_config_of` translates an :class:`OptimConfig` (or a mapping, or Megatron's config) into the
installed release's ``OptimizerConfig`` (0.6+); :func:`check_legacy_settings` checks one against what
mcore_compat's optimizer for 0.4/0.5 implements (:data:`_LEGACY_SETTINGS`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from packaging.version import Version

from .._translate.effects import harmless_if_missing
from .._translate.names import close_matches, existence_text, is_known
from .._translate.translate import drop_or_raise, translate_fields
from ..errors import InvalidArgumentError, UnsupportedVersionError
from ._common import config_items, installed_version, is_finite_real, is_integer, mcore

__all__ = ["OptimConfig", "check_legacy_settings", "check_optimizer_config", "optimizer_config_of"]


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


def _installed_fields() -> frozenset[str]:
    """The installed ``OptimizerConfig``'s fields (a release newer than the generated data may add some); none
    where the release has no ``megatron.core.optimizer`` (0.4/0.5) or none is installed."""
    try:
        return frozenset(f.name for f in dataclasses.fields(_megatron_optimizer_config_class()))
    except Exception:  # no Megatron, or no optimizer package (0.4/0.5): only the generated data counts
        return frozenset()


def _problems(cfg: OptimConfig) -> list[str]:
    """What is wrong with ``cfg``'s values, in words (empty when nothing is)."""
    problems: list[str] = []

    def number(name: str, low: float, *, optional: bool = False, strict: bool = False, below: float | None = None,
               ) -> bool:
        value = getattr(cfg, name)
        if value is None and optional:
            return False
        if not is_finite_real(value):
            problems.append(f"{name} must be a finite number (got {value!r})")
            return False
        if value < low or (strict and value == low) or (below is not None and value >= below):
            bound = f"{low} {'<' if strict else '<='} {name}" + (f" < {below}" if below is not None else "")
            problems.append(f"need {bound} (got {name}={value!r})")
            return False
        return True

    for name in ("lr", "min_lr", "decoupled_lr", "decoupled_min_lr"):
        number(name, 0.0, optional=True)
    for low, high in (("min_lr", "lr"), ("decoupled_min_lr", "decoupled_lr")):
        a, b = getattr(cfg, low), getattr(cfg, high)
        if is_finite_real(a) and is_finite_real(b) and 0.0 <= b < a:
            problems.append(f"need {low} <= {high} (got {low}={a!r}, {high}={b!r})")
    number("weight_decay", 0.0)
    number("clip_grad", 0.0)
    number("adam_beta1", 0.0, below=1.0)
    number("adam_beta2", 0.0, below=1.0)
    number("adam_eps", 0.0)
    number("sgd_momentum", 0.0)
    if cfg.fp16 and cfg.bf16:
        problems.append("fp16 and bf16 are both set; choose one")
    unknown = sorted(n for n in cfg.extra if not is_known("OptimizerConfig", n))
    installed = _installed_fields() if unknown else frozenset()  # read the installed class once, and only if needed
    for name in (n for n in unknown if n not in installed):
        hint = close_matches("OptimizerConfig", name)
        problems.append(f"extra field {name!r} is a field of no megatron-core release's OptimizerConfig"
                        + (f" (did you mean {' or '.join(map(repr, hint))}?)" if hint else ""))
    number("loss_scale", 0.0, optional=True, strict=True)
    if cfg.fp16 and cfg.loss_scale is None:  # the dynamic loss scaler's settings (Megatron asserts these)
        ok = number("initial_loss_scale", 0.0, strict=True) & number("min_loss_scale", 0.0, strict=True)
        if ok and cfg.min_loss_scale > cfg.initial_loss_scale:
            problems.append(f"need min_loss_scale <= initial_loss_scale (got {cfg.min_loss_scale!r}, "
                            f"{cfg.initial_loss_scale!r})")
        number("loss_scale_window", 0.0, strict=True)
        if not (is_integer(cfg.hysteresis) and cfg.hysteresis > 0):
            problems.append(f"hysteresis must be an integer > 0 (got {cfg.hysteresis!r})")
    return problems


def check_optimizer_config(config: Any) -> OptimConfig:
    """``config`` as an :class:`OptimConfig`, after refusing values no release can train with.

    Checked before anything is built, on every release alike: learning rates (``lr``, ``min_lr``,
    ``decoupled_lr``, ``decoupled_min_lr``) finite and ``>= 0`` where given, each floor at most its peak;
    ``weight_decay``, ``clip_grad`` (0 turns clipping off), ``adam_eps`` and ``sgd_momentum`` finite and ``>= 0``;
    Adam's betas in ``[0, 1)``; not both ``fp16`` and ``bf16``; a static ``loss_scale > 0``; for fp16's dynamic
    scaler ``0 < min_loss_scale <= initial_loss_scale``, ``loss_scale_window > 0`` and an integer
    ``hysteresis > 0``; an ``extra`` field that no release's ``OptimizerConfig`` has (a typo: the message names
    the nearest fields). A string such as ``"1e-5"`` (a config file's unparsed value) is refused, not converted.

    Args:
        config: :class:`OptimConfig`, a mapping of its fields, or Megatron's ``OptimizerConfig``.

    Returns:
        The settings as an :class:`OptimConfig` (a copy; ``config`` is not changed).

    Raises:
        InvalidArgumentError: one line naming every bad value and the range it needs.
    """
    cfg = OptimConfig.from_any(config)
    problems = _problems(cfg)
    if problems:
        raise InvalidArgumentError("optimizer settings: " + "; ".join(problems))
    return cfg


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
