"""Megatron's config objects from one set of field names, on every release.

::

    import mcore_compat as mc

    config = mc.transformer_config(num_layers=2, hidden_size=64, num_attention_heads=4,
                                   bias_activation_fusion=True, apply_rope_fusion=False)
    ddp_config = mc.ddp_config(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    opt_config = mc.optimizer_config(lr=1e-4, bf16=True, use_distributed_optimizer=True)

Every field name of every release is accepted (``mcore_compat/_translate/fields.py``, generated from the release
wheels by ``scripts/gen_config_fields.py``):

* a renamed field is passed under the name the installed release uses, whichever name was given
  (``bias_gelu_fusion`` on 0.4 = ``bias_activation_fusion`` from 0.5);
* a field the installed release lacks is dropped silently when its value is the field's default, dropped with a
  one-time warning (rank 0) when ignoring it cannot change results (``mcore_compat/_translate/effects.py``: fused
  kernels, overlap, offloading, CUDA graphs, logging), and refused with
  :class:`~mcore_compat.errors.UnsupportedVersionError` otherwise;
* a name that no release has raises :class:`~mcore_compat.errors.InvalidArgumentError` naming close matches.

The translation itself (:func:`translate_fields`, re-exported here) lives in ``mcore_compat/_translate/translate.py``,
below ``mcore_compat/training/``, which uses it too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from packaging.version import Version

from ._translate.translate import translate_fields

__all__ = ["ddp_config", "optimizer_config", "transformer_config", "translate_fields"]

_TRANSFORMER = "TransformerConfig"
_DDP = "DistributedDataParallelConfig"
_OPTIMIZER = "OptimizerConfig"


def _installed(cls: str) -> Any:
    """The installed release's class ``cls`` (a falsy placeholder where the release has none)."""
    from .symbols import resolve

    return resolve(cls)


def _field_names(cls: Any) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls)) if cls else frozenset()


def _version() -> Version:
    from .detect import detect

    return detect().version


def transformer_config(**fields: Any) -> Any:
    """The installed release's ``TransformerConfig`` from fields named as in any release.

    Args:
        **fields: ``TransformerConfig`` (and ``ModelParallelConfig``) fields of any release 0.4 ... 0.19, e.g.
            ``num_layers=2, hidden_size=64, num_attention_heads=4, bias_activation_fusion=True``.

    Returns:
        ``megatron.core.transformer.transformer_config.TransformerConfig`` of the installed release.

    Raises:
        InvalidArgumentError: a field no release has (close matches are named), or the old and the new name of a
            renamed field with different values.
        UnsupportedVersionError: a field the installed release lacks, with a non-default value that would change
            results (a harmless one is dropped with a one-time warning on rank 0).
    """
    cls = _installed(_TRANSFORMER)
    return cls(**translate_fields(_TRANSFORMER, fields, _version(), _field_names(cls)))


def ddp_config(**fields: Any) -> Any:
    """What the installed ``DistributedDataParallel`` takes as settings, from fields named as in any release.

    The settings of :class:`~mcore_compat.training.DDPConfig` go through
    :func:`~mcore_compat.training.ddp_config_of` (which knows what 0.4-0.6 take as constructor arguments); the
    other ``DistributedDataParallelConfig`` fields are translated as in :func:`transformer_config`. Pass the
    result to :func:`~mcore_compat.training.wrap_ddp` or to Megatron's own constructor. (For
    ``overlap_param_gather`` on 0.6-0.8, which mcore_compat hands to the optimizer, pass a ``DDPConfig`` to
    ``wrap_ddp`` instead.)

    Args:
        **fields: ``DistributedDataParallelConfig`` fields of any release (0.4-0.6: also
            ``accumulate_allreduce_grads_in_fp32``).

    Returns:
        ``DistributedDataParallelConfig`` of the installed release (0.7+), or the keyword arguments of
        ``DistributedDataParallel.__init__`` (0.4-0.6).

    Raises:
        InvalidArgumentError: a field no release has, or two names of one renamed field with different values.
        UnsupportedVersionError: a field the release cannot honour with a value that would change results.
    """
    from .training.ddp import _FIELD_ALIASES, DDPConfig, ddp_config_of

    version = _version()
    own = {f.name for f in dataclasses.fields(DDPConfig)} - {"extra"} | set(_FIELD_ALIASES)
    settings = {k: v for k, v in fields.items() if k in own}
    others = {k: v for k, v in fields.items() if k not in own}
    extra = translate_fields(_DDP, others, version, _field_names(_installed(_DDP)))
    return ddp_config_of(DDPConfig.from_any({**settings, "extra": extra}), version)


def optimizer_config(**fields: Any) -> Any:
    """The installed release's ``OptimizerConfig`` from fields named as in any release.

    Fields are translated as in :func:`transformer_config`, then built by
    :func:`~mcore_compat.training.optimizer_config_of` (fields not given take
    :class:`~mcore_compat.training.OptimConfig`'s defaults).

    Args:
        **fields: ``OptimizerConfig`` fields of any release 0.6 ... 0.19.

    Returns:
        ``OptimizerConfig`` of the installed release (0.6+); on 0.4/0.5, which have none, an
        :class:`~mcore_compat.training.OptimConfig` (what :func:`~mcore_compat.training.get_megatron_optimizer`
        builds mcore_compat's optimizer for those releases from; a setting that optimizer does not implement is
        handled as a field the release lacks).

    Raises:
        InvalidArgumentError: a field no release has, or two names of one renamed field with different values.
        UnsupportedVersionError: a field the release lacks, with a non-default value that would change results.
    """
    from .training.optim_config import OptimConfig, check_legacy_settings, optimizer_config_of

    version = _version()
    cls = _installed(_OPTIMIZER)
    if cls:
        return optimizer_config_of(translate_fields(_OPTIMIZER, fields, version, _field_names(cls)), version)
    own = {f.name for f in dataclasses.fields(OptimConfig)} - {"extra"}
    extra = {k: v for k, v in fields.items() if k not in own}
    return check_legacy_settings(OptimConfig.from_any({**{k: fields[k] for k in fields if k in own},
                                                       "extra": extra}), version)
