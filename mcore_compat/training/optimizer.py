"""One ``get_megatron_optimizer`` signature over every release, and ``optimizer_step``: the names, re-exported.

What used to be this one module lives by job in:

* ``optim_config``: :class:`OptimConfig`, :func:`optimizer_config_of` (the installed ``OptimizerConfig``),
  :func:`check_legacy_settings` and :data:`_LEGACY_SETTINGS` (what the 0.4/0.5 optimizer implements);
* ``optim_groups``: the parameter-group rules and the (lr, weight decay) each group gets;
* ``optim_core``: the public and the private builder of ``megatron.core.optimizer`` (0.6+);
* ``optim_build``: :func:`get_megatron_optimizer`, the one entry point (and the 0.4/0.5 path);
* ``optim_step``: :func:`optimizer_step` and :func:`set_lr_and_weight_decay`.
"""

from __future__ import annotations

from .optim_build import get_megatron_optimizer
from .optim_config import _LEGACY_SETTINGS as _LEGACY_SETTINGS  # not in __all__, as before; tests import it
from .optim_config import OptimConfig, optimizer_config_of
from .optim_config import check_legacy_settings as check_legacy_settings  # not in __all__, as before
from .optim_step import optimizer_step, set_lr_and_weight_decay

__all__ = ["OptimConfig", "get_megatron_optimizer", "optimizer_config_of", "optimizer_step", "set_lr_and_weight_decay"]
