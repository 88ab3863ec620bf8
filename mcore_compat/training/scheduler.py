"""One learning-rate / weight-decay scheduler over every release: :func:`optimizer_param_scheduler`.

Megatron-Core has ``OptimizerParamScheduler`` from 0.9 (``megatron/core/optimizer_param_scheduler.py``; fact
``megatron_scheduler``); before that it lived in Megatron-LM only. :func:`optimizer_param_scheduler` returns
Megatron's class where the release has it and :class:`ParamScheduler` (our own code, the same constructor
signature, schedule formulas and ``state_dict`` keys) where it does not.

Per group the scheduler sets ``lr = schedule(group["max_lr"], group["min_lr"])`` times ``group["lr_mult"]`` where
the release multiplies (fact ``scheduler_ignores_lr_mult``: from 0.16 Megatron's scheduler does not, and
``get_megatron_optimizer`` then puts a scaled learning rate into ``max_lr``/``min_lr`` instead), and
``weight_decay = wd_schedule() * group["wd_mult"]``. A warmup from ``init_lr > 0`` rises from ``init_lr`` to the
group's scaled peak on every release (0.16's meaning; before 0.16 Megatron's scheduler scales ``init_lr`` too, so
:class:`ParamScheduler` serves such a schedule there). Together with ``get_megatron_optimizer`` (which sets the
same effective values at build time) every parameter gets the same (lr, weight decay) on every release.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ..capabilities import has
from ..errors import InvalidArgumentError
from ..rank0 import warn_once_rank_0
from ._common import installed_version, is_finite_real

__all__ = ["ParamScheduler", "optimizer_param_scheduler"]

_LR_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
_WSD_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
_WD_STYLES = ("constant", "linear", "cosine")


def set_group_lr(group: dict[str, Any], lr: float) -> None:
    """Set a param group's learning rate (a tensor learning rate - capturable optimizers - is filled in place)."""
    current: Any = group.get("lr")
    if current is not None and hasattr(current, "fill_"):
        current.fill_(lr)
    else:
        group["lr"] = lr


def _fill_group_bounds(optimizer: Any, max_lr: float, min_lr: float,
                       lr_mult_in_bounds: bool) -> list[tuple[int, str, float]]:
    """Give every param group without a ``max_lr`` / ``min_lr`` of its own (``None`` or missing) the scheduler's.

    A group's own bound wins (Megatron's rule: ``OptimConfig.lr`` / ``min_lr``, a decoupled learning rate, a
    ``config_overrides`` entry); a group built while ``OptimConfig.min_lr`` (or ``lr``) was ``None`` carries
    ``None`` there, on which Megatron's scheduler fails (0.6+: ``max_lr - min_lr`` with ``None``) or - mcore_compat's
    optimizer for 0.4/0.5 - would decay to 0. Megatron-LM passes one value to both the optimizer config and the
    scheduler, so the scheduler's value is the one meant. Where the release keeps a group's learning-rate scale
    in its bounds (``lr_mult_in_bounds``: 0.16+, fact ``scheduler_ignores_lr_mult``), the filled bound is scaled by
    the group's ``lr_mult`` like its own bounds are.

    Returns:
        What was filled: ``(group index, "max_lr" or "min_lr", scale)``; a filled bound follows the scheduler's
        value when ``load_state_dict`` restores another one.
    """
    filled = []
    for index, group in enumerate(optimizer.param_groups):
        scale = float(group.get("lr_mult", 1.0)) if lr_mult_in_bounds else 1.0
        for key, value in (("max_lr", max_lr), ("min_lr", min_lr)):
            if group.get(key) is None:
                group[key] = float(value) * scale
                filled.append((index, key, scale))
    return filled


def _check_group_bounds(bounds: list[tuple[Any, Any]], where: str) -> None:
    """Refuse groups that would decay upwards: ``bounds`` is each group's ``(max_lr, min_lr)`` as the scheduler
    will use them (its own, or the scheduler's where it has none). Megatron's formulas run from ``max_lr`` to
    ``min_lr`` whatever their order, so a group's own peak below the scheduler's floor (``OptimConfig(lr=1e-5)``
    with ``min_lr=1e-4`` given here, or a ``config_overrides`` entry's ``max_lr`` below ``OptimConfig.min_lr``)
    would train with a learning rate that rises as it "decays"."""
    bad = sorted({f"max_lr={mx!r} with min_lr={mn!r}" for mx, mn in bounds
                  if is_finite_real(mx) and is_finite_real(mn) and mn > mx})
    if bad:
        raise InvalidArgumentError(
            f"{where}: param groups would decay upwards ({'; '.join(bad)}): a group's own max_lr (OptimConfig.lr, "
            f"decoupled_lr, a config_overrides entry) is below its min_lr (its own, or this scheduler's min_lr "
            f"where it has none); give a min_lr at most every group's max_lr")


def _bounds_after_fill(optimizer: Any, max_lr: float, min_lr: float, lr_mult_in_bounds: bool) -> list[tuple[Any, Any]]:
    """Each group's ``(max_lr, min_lr)`` once :func:`_fill_group_bounds` has run (nothing is changed)."""
    out = []
    for group in optimizer.param_groups:
        scale = float(group.get("lr_mult", 1.0)) if lr_mult_in_bounds else 1.0
        mx, mn = group.get("max_lr"), group.get("min_lr")
        out.append((float(max_lr) * scale if mx is None else mx, float(min_lr) * scale if mn is None else mn))
    return out


def _check(init_lr: Any, max_lr: Any, min_lr: Any, lr_warmup_steps: Any, lr_decay_steps: Any, lr_decay_style: Any,
           start_wd: Any, end_wd: Any, wd_incr_steps: Any, wd_incr_style: Any, use_checkpoint: bool | None,
           override: bool | None, wsd_decay_steps: Any, lr_wsd_decay_style: Any) -> None:
    """Refuse what Megatron's scheduler asserts or cannot compute, before anything is changed, with one line
    naming every bad setting: numbers that are not finite (a ``None`` ``min_lr``, a string), ``0 <= min_lr <=
    max_lr``, ``0 <= init_lr <= max_lr``, ``0 <= lr_warmup_steps < lr_decay_steps``, the styles, WSD's
    ``wsd_decay_steps >= 0``, ``0 <= start_wd <= end_wd`` (equal for ``constant``), ``wd_incr_steps >= 0``
    (``> 0`` for an increasing style: Megatron divides by it). Step counts may be floats, as Megatron's
    formulas allow (``0.9 * train_iters``)."""
    problems = []
    numbers = {"init_lr": init_lr, "max_lr": max_lr, "min_lr": min_lr, "start_wd": start_wd, "end_wd": end_wd,
               "lr_warmup_steps": lr_warmup_steps, "lr_decay_steps": lr_decay_steps, "wd_incr_steps": wd_incr_steps}
    if lr_decay_style == "WSD" and wsd_decay_steps is not None:
        numbers["wsd_decay_steps"] = wsd_decay_steps
    problems += [f"{k} must be a finite number (got {v!r})" for k, v in numbers.items() if not is_finite_real(v)]
    if all(is_finite_real(v) for v in (init_lr, max_lr, min_lr)):
        if not 0.0 <= min_lr <= max_lr:
            problems.append(f"need 0 <= min_lr <= max_lr (got min_lr={min_lr}, max_lr={max_lr})")
        if not 0.0 <= init_lr <= max_lr:
            problems.append(f"need 0 <= init_lr <= max_lr (got init_lr={init_lr}, max_lr={max_lr})")
    if (is_finite_real(lr_warmup_steps) and is_finite_real(lr_decay_steps)
            and not 0 <= lr_warmup_steps < lr_decay_steps):
        problems.append(f"need 0 <= lr_warmup_steps < lr_decay_steps (got lr_warmup_steps={lr_warmup_steps}, "
                        f"lr_decay_steps={lr_decay_steps})")
    if lr_decay_style not in _LR_STYLES:
        problems.append(f"lr_decay_style {lr_decay_style!r} is not one of {_LR_STYLES}")
    if lr_decay_style == "WSD":
        if wsd_decay_steps is None:
            problems.append("lr_decay_style 'WSD' needs wsd_decay_steps")
        elif is_finite_real(wsd_decay_steps) and wsd_decay_steps < 0:
            problems.append(f"need wsd_decay_steps >= 0 (got {wsd_decay_steps})")
        if lr_wsd_decay_style not in _WSD_STYLES:
            problems.append(f"lr_wsd_decay_style {lr_wsd_decay_style!r} is not one of {_WSD_STYLES} (WSD needs one)")
    if is_finite_real(start_wd) and is_finite_real(end_wd) and not 0.0 <= start_wd <= end_wd:
        problems.append(f"need 0 <= start_wd <= end_wd (got start_wd={start_wd}, end_wd={end_wd})")
    if wd_incr_style not in _WD_STYLES:
        problems.append(f"wd_incr_style {wd_incr_style!r} is not one of {_WD_STYLES}")
    elif wd_incr_style == "constant":
        if is_finite_real(start_wd) and is_finite_real(end_wd) and start_wd != end_wd:
            problems.append(f"wd_incr_style 'constant' needs start_wd == end_wd (got {start_wd}, {end_wd})")
        if is_finite_real(wd_incr_steps) and wd_incr_steps < 0:
            problems.append(f"need wd_incr_steps >= 0 (got {wd_incr_steps})")
    elif is_finite_real(wd_incr_steps) and wd_incr_steps <= 0:
        problems.append(f"wd_incr_style {wd_incr_style!r} needs wd_incr_steps > 0 (got {wd_incr_steps})")
    if override and use_checkpoint:
        problems.append("override_opt_param_scheduler and use_checkpoint_opt_param_scheduler are both set")
    if problems:
        raise InvalidArgumentError("optimizer_param_scheduler: " + "; ".join(problems))


#: The settings a scheduler's ``state_dict`` holds (Megatron's keys), with the older names Megatron-LM wrote.
_LR_STATE = {"max_lr": ("start_lr",), "min_lr": (), "lr_warmup_steps": ("warmup_iter", "warmup_steps"),
             "lr_decay_steps": ("end_iter", "decay_steps"), "lr_decay_style": ("decay_style",)}
_WD_STATE = ("start_wd", "end_wd", "wd_incr_steps", "wd_incr_style")


class _ResumeRules:
    """``load_state_dict`` with one meaning on every release, for :class:`ParamScheduler` and for Megatron's
    ``OptimizerParamScheduler`` (0.9+; :func:`optimizer_param_scheduler` returns a subclass of it that only adds
    this method, made by :func:`_with_resume_rules`).

    Megatron's rules (``OptimizerParamScheduler.load_state_dict`` of ``megatron/core/optimizer_param_scheduler.py``,
    the same from 0.9 to 0.19): with ``override_opt_param_scheduler`` the constructor's settings win, with
    ``use_checkpoint_opt_param_scheduler`` (the default) the checkpoint's, with neither they must be equal; then
    the step count is restored. Where Megatron's differs, this one:

    * refuses unequal settings with an ``InvalidArgumentError`` line naming each (Megatron: an
      ``AssertionError`` on the first);
    * refuses a restored combination the scheduler cannot run (the checkpoint's ``lr_decay_steps`` with this
      constructor's ``wsd_decay_steps``, ...) before anything changes;
    * sets the groups from the restored settings at once (Megatron sets them before it restores the weight-decay
      settings, so the first step after a resume used the constructor's weight decay: said in a one-time warning
      where that differs);
    * gives a group that took its ``max_lr``/``min_lr`` from the scheduler (see :func:`_fill_group_bounds`) the
      restored value.
    """

    optimizer: Any
    num_steps: float
    use_checkpoint_opt_param_scheduler: bool | None
    override_opt_param_scheduler: bool | None
    _filled_bounds: list[tuple[int, str, float]] = []

    if TYPE_CHECKING:
        def step(self, increment: int) -> None: ...  # both schedulers define it (Megatron's after this class)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a ``state_dict`` of this scheduler or of Megatron's (also with Megatron-LM's older key names)
        and set every group from it."""
        sd = dict(state_dict)
        for new, olds in _LR_STATE.items():
            for old in olds:
                if new not in sd and old in sd:
                    sd[new] = sd[old]
        if "num_steps" not in sd and "num_iters" in sd:
            sd["num_steps"] = sd["num_iters"]
        names = [*_LR_STATE, *(_WD_STATE if "start_wd" in sd else ())]
        missing = [n for n in [*names, "num_steps"] if n not in sd]
        if missing:
            raise InvalidArgumentError(f"optimizer_param_scheduler.load_state_dict: the state dict lacks "
                                       f"{', '.join(missing)}; pass a scheduler's state_dict()")
        differ = [n for n in names if getattr(self, n) != sd[n]]
        if self.override_opt_param_scheduler:
            restored = {n: getattr(self, n) for n in names}
        elif differ and not self.use_checkpoint_opt_param_scheduler:
            raise InvalidArgumentError(
                "optimizer_param_scheduler.load_state_dict: " + ", ".join(
                    f"{n} is {getattr(self, n)!r} here and {sd[n]!r} in the checkpoint" for n in differ)
                + "; pass use_checkpoint_opt_param_scheduler=True (the checkpoint's) or "
                  "override_opt_param_scheduler=True (these)")
        else:
            restored = {n: sd[n] for n in names}
        merged = {n: getattr(self, n, None) for n in (*_LR_STATE, *_WD_STATE, "init_lr", "wsd_decay_steps",
                                                      "lr_wsd_decay_style")}
        merged.update(restored)
        try:
            _check(**merged, use_checkpoint=self.use_checkpoint_opt_param_scheduler,
                   override=self.override_opt_param_scheduler)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{exc} (the checkpoint's settings with this scheduler's)") from None
        groups = self.optimizer.param_groups
        bounds = [(g.get("max_lr"), g.get("min_lr")) for g in groups]
        for index, key, scale in self._filled_bounds:
            bounds[index] = ((float(restored["max_lr"]) * scale, bounds[index][1]) if key == "max_lr"
                             else (bounds[index][0], float(restored["min_lr"]) * scale))
        _check_group_bounds(bounds, "optimizer_param_scheduler.load_state_dict")
        wd_changed = [n for n in _WD_STATE if n in restored and restored[n] != getattr(self, n)]
        if wd_changed and type(self).__name__ != "ParamScheduler":
            warn_once_rank_0(
                f"optimizer_param_scheduler.load_state_dict: the checkpoint's {', '.join(wd_changed)} set the "
                f"groups' weight decay at the resumed step already; megatron-core's own scheduler applies them "
                f"from the next step")
        for name, value in restored.items():
            setattr(self, name, value)
        for index, key, scale in self._filled_bounds:
            groups[index][key] = float(getattr(self, key)) * scale
        self.step(increment=sd["num_steps"])


def _with_resume_rules(cls: type) -> type:
    """Megatron's scheduler class ``cls`` with :class:`_ResumeRules`' ``load_state_dict`` (cached per class)."""
    made = _RESUMABLE.get(cls)
    if made is None:
        made = _RESUMABLE[cls] = type(cls.__name__, (_ResumeRules, cls), {
            "__module__": __name__, "__doc__": f"{cls.__module__}.{cls.__qualname__} with mcore_compat's "
                                               f"load_state_dict (see _ResumeRules)."})
    return made


_RESUMABLE: dict[type, type] = {}


class ParamScheduler(_ResumeRules):
    """Learning-rate warmup/decay and weight-decay increment for releases without Megatron's scheduler.

    The constructor, :meth:`step`, :meth:`state_dict` and :meth:`load_state_dict` have the signature and meaning
    of Megatron-Core's ``OptimizerParamScheduler`` (0.9-0.15): warmup from ``init_lr`` to the group's ``max_lr``
    over ``lr_warmup_steps``, then ``lr_decay_style`` down to the group's ``min_lr`` at ``lr_decay_steps``;
    weight decay from ``start_wd`` to ``end_wd`` over ``wd_incr_steps``.

    Raises:
        InvalidArgumentError: an unknown style or inconsistent bounds (what Megatron asserts).
    """

    def __init__(self, optimizer: Any, init_lr: float, max_lr: float, min_lr: float, lr_warmup_steps: int,
                 lr_decay_steps: int, lr_decay_style: str, start_wd: float, end_wd: float, wd_incr_steps: int,
                 wd_incr_style: str, use_checkpoint_opt_param_scheduler: bool | None = True,
                 override_opt_param_scheduler: bool | None = False, wsd_decay_steps: int | None = None,
                 lr_wsd_decay_style: str | None = None) -> None:
        self.optimizer = optimizer
        self.init_lr, self.max_lr, self.min_lr = init_lr, float(max_lr), min_lr
        self.lr_warmup_steps, self.lr_decay_steps, self.lr_decay_style = lr_warmup_steps, lr_decay_steps, \
            lr_decay_style
        self.wsd_decay_steps, self.lr_wsd_decay_style = wsd_decay_steps, lr_wsd_decay_style
        self.start_wd, self.end_wd, self.wd_incr_steps, self.wd_incr_style = start_wd, end_wd, wd_incr_steps, \
            wd_incr_style
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.num_steps = 0
        _check(init_lr, max_lr, min_lr, lr_warmup_steps, lr_decay_steps, lr_decay_style, start_wd, end_wd,
               wd_incr_steps, wd_incr_style, use_checkpoint_opt_param_scheduler, override_opt_param_scheduler,
               wsd_decay_steps, lr_wsd_decay_style)
        # it multiplies by lr_mult itself
        _check_group_bounds(_bounds_after_fill(optimizer, max_lr, min_lr, False), "optimizer_param_scheduler")
        self._filled_bounds = _fill_group_bounds(optimizer, max_lr, min_lr, lr_mult_in_bounds=False)
        self.step(0)

    def get_wd(self) -> float:
        """The weight decay at the current step (before each group's ``wd_mult``)."""
        if self.num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        ratio = float(self.num_steps) / float(self.wd_incr_steps)
        coeff = ratio if self.wd_incr_style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def get_lr(self, param_group: dict[str, Any]) -> float:
        """The learning rate of ``param_group`` at the current step (before its ``lr_mult``)."""
        max_lr = param_group.get("max_lr", self.max_lr)
        min_lr = param_group.get("min_lr", self.min_lr)
        if self._warming_up():
            return self._warmup_lr(max_lr)
        if self.lr_decay_style == "constant":
            return max_lr
        if self.num_steps > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            lr = max_lr * max(self.lr_warmup_steps, 1) ** 0.5 / max(self.num_steps, 1) ** 0.5
            return max(min_lr, lr)
        ratio = float(self.num_steps - self.lr_warmup_steps) / float(self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD: constant, then anneal over the last wsd_decay_steps
            assert self.wsd_decay_steps is not None
            anneal_start = self.lr_decay_steps - self.wsd_decay_steps
            if self.num_steps <= anneal_start:
                coeff = 1.0
            else:
                r = float(self.num_steps - anneal_start) / float(self.wsd_decay_steps)
                coeff = {"linear": 1.0 - r, "cosine": 0.5 * (math.cos(math.pi * r) + 1.0),
                         "exponential": 2.0 * math.pow(0.5, r) - 1.0,
                         "minus_sqrt": 1.0 - math.sqrt(r)}[str(self.lr_wsd_decay_style)]
        return min_lr + coeff * (max_lr - min_lr)

    def group_lr(self, param_group: dict[str, Any]) -> float:
        """The learning rate :meth:`step` gives ``param_group``: :meth:`get_lr` times its ``lr_mult``, except that
        a warmup starts at ``init_lr`` in every group and rises to the group's scaled peak (``max_lr * lr_mult``),
        as Megatron's scheduler does from 0.16 (where the scale lives in the group's bounds); 0.9-0.15's would
        start a scaled group at ``init_lr * lr_mult``."""
        mult = float(param_group.get("lr_mult", 1.0))
        if mult != 1.0 and self._warming_up():
            return self._warmup_lr(param_group.get("max_lr", self.max_lr) * mult)
        return self.get_lr(param_group) * mult

    def _warming_up(self) -> bool:
        return self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps

    def _warmup_lr(self, peak: float) -> float:
        """The warmup's learning rate, from ``init_lr`` to ``peak``."""
        return self.init_lr + (peak - self.init_lr) * float(self.num_steps) / float(self.lr_warmup_steps)

    def step(self, increment: int) -> None:
        """Advance ``increment`` steps and set every group's ``lr`` (:meth:`group_lr`) and ``weight_decay``."""
        self.num_steps += increment
        wd = self.get_wd()
        for group in self.optimizer.param_groups:
            set_group_lr(group, self.group_lr(group))
            group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    def state_dict(self) -> dict[str, Any]:
        """The schedule's settings and step count (the keys of Megatron's scheduler)."""
        return {"max_lr": self.max_lr, "lr_warmup_steps": self.lr_warmup_steps, "num_steps": self.num_steps,
                "lr_decay_style": self.lr_decay_style, "lr_decay_steps": self.lr_decay_steps,
                "min_lr": self.min_lr, "start_wd": self.start_wd, "end_wd": self.end_wd,
                "wd_incr_style": self.wd_incr_style, "wd_incr_steps": self.wd_incr_steps}


def optimizer_param_scheduler(optimizer: Any, init_lr: float, max_lr: float, min_lr: float, lr_warmup_steps: int,
                              lr_decay_steps: int, lr_decay_style: str, start_wd: float, end_wd: float,
                              wd_incr_steps: int, wd_incr_style: str,
                              use_checkpoint_opt_param_scheduler: bool | None = True,
                              override_opt_param_scheduler: bool | None = False,
                              wsd_decay_steps: int | None = None, lr_wsd_decay_style: str | None = None) -> Any:
    """The learning-rate / weight-decay scheduler for ``optimizer``, with one signature on every release.

    Args:
        optimizer: the optimizer from :func:`~mcore_compat.training.get_megatron_optimizer`.
        init_lr, max_lr, min_lr: warmup start, peak and floor. A group's own ``max_lr``/``min_lr`` takes
            precedence, as in Megatron: ``OptimConfig.lr``/``min_lr`` (all groups), ``decoupled_lr``/
            ``decoupled_min_lr`` (embedding and output weights), a ``config_overrides`` entry; so a
            ``min_lr`` given to both ``OptimConfig`` and here uses ``OptimConfig``'s. A group without one
            (``OptimConfig.min_lr=None``, the default) gets this ``min_lr`` (and ``max_lr``), scaled by its
            ``lr_mult`` on 0.16+ as its own bounds are: see :func:`_fill_group_bounds`. Raw Megatron fails on
            such a group at the first decay step (0.6+) or decays it to 0 (0.4/0.5 through mcore_compat's
            optimizer before this rule).
        lr_warmup_steps, lr_decay_steps, lr_decay_style: ``constant``, ``linear``, ``cosine``,
            ``inverse-square-root`` or ``WSD`` (with ``wsd_decay_steps`` and ``lr_wsd_decay_style``).
        start_wd, end_wd, wd_incr_steps, wd_incr_style: weight decay from ``start_wd`` to ``end_wd``
            (``constant``, ``linear`` or ``cosine``); each group's ``wd_mult`` applies.
        use_checkpoint_opt_param_scheduler, override_opt_param_scheduler: which values win in
            ``load_state_dict``: the checkpoint's (the default), this call's, or - neither - they must be equal
            (else an ``InvalidArgumentError`` line names each). Megatron's rules, with the differences of
            :class:`_ResumeRules`: the groups get the restored settings at the resumed step already, and a
            group that took its bound from the scheduler takes the restored one.

    A warmup from ``init_lr > 0`` has one meaning on every release, 0.16+'s: every group starts at ``init_lr`` and
    rises to its own (scaled) peak. Before 0.16 Megatron's scheduler starts a ``scale_lr_cond`` group at
    ``init_lr * lr_mult``; there :class:`ParamScheduler` serves such a schedule, with a one-time warning.

    Returns:
        Megatron-Core's ``OptimizerParamScheduler`` where the release has one (0.9+) that knows the styles
        asked for (an instance of a subclass that only replaces ``load_state_dict``), else a
        :class:`ParamScheduler` (also for WSD's ``minus_sqrt`` on 0.9-0.12, and for ``init_lr > 0`` with scaled
        groups on 0.9-0.15); both already applied step 0 to the groups.

    Raises:
        InvalidArgumentError: settings Megatron's scheduler asserts against or cannot compute (bounds out of
            order, a negative learning rate or step count, an unknown style, a ``None`` bound), or a group whose
            own ``max_lr`` is below its ``min_lr`` (it would decay upwards): one line naming each, before any
            group is changed.
    """
    args = (optimizer, init_lr, max_lr, min_lr, lr_warmup_steps, lr_decay_steps, lr_decay_style, start_wd,
            end_wd, wd_incr_steps, wd_incr_style, use_checkpoint_opt_param_scheduler, override_opt_param_scheduler,
            wsd_decay_steps, lr_wsd_decay_style)
    _check(init_lr, max_lr, min_lr, lr_warmup_steps, lr_decay_steps, lr_decay_style, start_wd, end_wd, wd_incr_steps,
           wd_incr_style, use_checkpoint_opt_param_scheduler, override_opt_param_scheduler, wsd_decay_steps,
           lr_wsd_decay_style)
    version = installed_version()
    in_bounds = has("scheduler_ignores_lr_mult", version)
    _check_group_bounds(_bounds_after_fill(optimizer, max_lr, min_lr, in_bounds), "optimizer_param_scheduler")
    filled = _fill_group_bounds(optimizer, max_lr, min_lr, in_bounds)
    # 0.9-0.12's scheduler lacks the WSD style 'minus_sqrt' (fact scheduler_wsd_minus_sqrt): ours serves it there.
    megatron_lacks_style = (lr_decay_style == "WSD" and lr_wsd_decay_style == "minus_sqrt"
                            and not has("scheduler_wsd_minus_sqrt", version))
    scaled_warmup = _scaled_warmup(optimizer, init_lr, version)
    if has("megatron_scheduler", version) and not megatron_lacks_style and not scaled_warmup:
        from .. import symbols

        scheduler = _with_resume_rules(symbols.resolve("OptimizerParamScheduler"))(*args)
        scheduler._filled_bounds = filled
        return scheduler
    if has("megatron_scheduler", version) and scaled_warmup and lr_warmup_steps > 0:
        warn_once_rank_0(
            f"optimizer_param_scheduler: init_lr={init_lr} with scaled groups (lr_mult "
            f"{', '.join(scaled_warmup)}): every group warms up from init_lr to its scaled peak, as megatron-core "
            f"0.16+ does; megatron-core {version}'s own scheduler would start a scaled group at init_lr * lr_mult, "
            f"so mcore_compat's scheduler (same state_dict) serves this one")
    scheduler = ParamScheduler(*args)
    scheduler._filled_bounds = filled
    return scheduler


def _scaled_warmup(optimizer: Any, init_lr: float, version: Any) -> list[str]:
    """The ``lr_mult`` values (other than 1) of the groups whose warmup from ``init_lr > 0`` would differ from
    0.16+'s meaning on this release (before 0.16 the release's scheduler multiplies the whole schedule, ``init_lr``
    included, by ``lr_mult``: fact ``scheduler_ignores_lr_mult``); empty where it would not. Asked whatever the
    warmup steps: a ``load_state_dict`` may restore a warmup the constructor did not have."""
    if has("scheduler_ignores_lr_mult", version) or not init_lr > 0:
        return []
    return sorted({f"{float(g.get('lr_mult', 1.0)):g}" for g in optimizer.param_groups
                   if float(g.get("lr_mult", 1.0)) != 1.0})
