"""Data: mcore-compat's deprecated public names, one table. Each still answers as it did, warns once, and names
its replacement.

The capability names below were rows of the capability table until 2026-12-01, when capabilities and the
training tables became one fact table (:mod:`mcore_compat._facts.table`) and a group of flags became one valued
fact (``ddp_config``, ``ddp_flat_kwargs``, ... became the value of ``fact("ddp_ctor")``). Code written against
the README of that day calls ``has("ddp_config")``; :func:`mcore_compat.capabilities.has` answers it from the fact
that replaces it (:attr:`DeprecatedFlag.value`) and emits one :class:`DeprecationWarning` per name per process
naming the replacement.

Each row keeps the old range (``was``), the release range where the flag held in the removed table (whose
probes were checked against all 23 releases): ``tests/test_deprecated.py`` asserts, for every release of the
support matrix, that the flag derived from today's fact equals that range, and in every release session that
it equals the old probe re-run against the installed tree.

The other public names removed since then (:data:`DEPRECATED_NAMES`) are answered by their own modules, and
``scripts/gen_api.py --check`` (lint) accepts a removed name or parameter only when it is declared here.

This module is a leaf (it imports only :mod:`mcore_compat.errors`, a leaf), so :mod:`mcore_compat.capabilities` reads it at top
level.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import InvalidArgumentError

__all__ = ["DEPRECATED_FLAGS", "DEPRECATED_NAMES", "DEPRECATED_PARAMS", "DEPRECATED_TOP_LEVEL", "DeprecatedFlag",
           "renamed_params",
           "warn_deprecated", "warn_deprecated_name"]

#: When the capability names were removed (the fact table of 2026-12-01) and answered again.
_REMOVED = "2026-12-01"


@dataclass(frozen=True)
class DeprecatedFlag:
    """A removed capability name answered from the fact that replaced it.

    Attributes:
        name: the old name (``has(name)``).
        fact: the fact it is read from now.
        value: the old flag from that fact's value (``None`` rows included).
        replacement: the expression to write instead (shown in the warning and the README).
        was: the range where the flag held in the removed capability table.
        since: when it was deprecated.
    """

    name: str
    fact: str
    value: Callable[[Any], bool]
    replacement: str
    was: str
    since: str = _REMOVED


#: Facts with ``None`` rows (no ``megatron.core.optimizer`` on 0.4/0.5).
_MAY_BE_NONE = ("public_builder_params", "private_builder_params")


def _member(name: str, fact: str, item: object, was: str) -> DeprecatedFlag:
    """The flag ``item in fact(...)``; a fact that is ``None`` (no such function in the release) holds nothing."""
    def value(v: Any) -> bool:
        return v is not None and item in v

    text = f"{item!r} in (fact({fact!r}) or ())" if fact in _MAY_BE_NONE else f"{item!r} in fact({fact!r})"
    return DeprecatedFlag(name, fact, value, text, was)


def _one_of(name: str, fact: str, values: tuple[Any, ...], was: str) -> DeprecatedFlag:
    """The flag ``fact(...) in values`` (``==`` for one value)."""
    def value(v: Any) -> bool:
        return v in values

    text = f"fact({fact!r}) == {values[0]!r}" if len(values) == 1 else f"fact({fact!r}) in {values!r}"
    return DeprecatedFlag(name, fact, value, text, was)


_KWARGS = ("kwargs_v4", "kwargs_v6")
_DDPCFG = ("ddpcfg_group", "ddpcfg", "ddpcfg_pgs", "ddpcfg_pgc")

_ROWS: tuple[DeprecatedFlag, ...] = (
    # DistributedDataParallel (distributed/distributed_data_parallel.py and its config)
    _one_of("ddp_flat_kwargs", "ddp_ctor", _KWARGS, "<0.7"),
    _one_of("ddp_config", "ddp_ctor", _DDPCFG, ">=0.7"),
    _one_of("ddp_explicit_dp_group", "ddp_ctor", (*_KWARGS, "ddpcfg_group"), "<0.8"),
    _one_of("ddp_expert_dp_group_arg", "ddp_ctor", ("kwargs_v6", "ddpcfg_group"), ">=0.6,<0.8"),
    _one_of("ddp_comm_pgs", "ddp_ctor", ("ddpcfg_pgs",), ">=0.13,<0.15"),
    _one_of("ddp_pg_collection", "ddp_ctor", ("ddpcfg_pgc",), ">=0.15"),
    _member("ddp_average_in_collective", "ddp_settings", "average_in_collective", ">=0.8"),
    _member("ddp_overlap_param_gather", "ddp_settings", "overlap_param_gather", ">=0.9"),
    _member("ddp_num_distributed_optimizer_instances", "ddp_settings", "num_distributed_optimizer_instances",
            ">=0.10"),
    _one_of("distributed_param_gather_in_ddp", "param_gather_owner", ("ddp",), ">=0.9"),
    _one_of("optimizer_finish_param_sync", "param_gather_owner", ("optimizer",), ">=0.6,<0.9"),
    # the DDP's buffers (distributed/grad_buffer.py, distributed/param_and_grad_buffer.py)
    _one_of("grad_buffer_legacy", "ddp_buffer_attrs", (("grad_buffers", None),), "<0.6"),
    _one_of("param_and_grad_buffer", "ddp_buffer_attrs", (("buffers", "expert_parallel_buffers"),), ">=0.6"),
    _member("bucket_pad_lcm_128", "bucket_end_factors", 128, ">=0.7"),
    DeprecatedFlag("pad_buckets_high_nccl_busbw", "high_nccl_busbw_factor", lambda v: v is not None,
                   "fact('high_nccl_busbw_factor') is not None", ">=0.12"),
    _one_of("param_start_padding_64", "param_start_alignment", (64,), ">=0.8"),
    # finalize_model_grads (distributed/finalize_model_grads.py)
    _member("finalize_num_tokens", "finalize_params", "num_tokens", ">=0.7"),
    _member("finalize_grad_finalize_pgs", "finalize_params", "grad_finalize_pgs", ">=0.14,<0.15"),
    _member("finalize_pg_collection", "finalize_params", "pg_collection", ">=0.15"),
    _member("finalize_force_all_reduce", "finalize_params", "force_all_reduce", ">=0.16"),
    # the schedules (pipeline_parallel/schedules.py)
    _member("get_forward_backward_func_takes_pp_size", "get_fwd_bwd_params", "pp_size", ">=0.16"),
    _member("schedule_pg_collection_selector", "get_fwd_bwd_params", "schedule_pg_collection", ">=0.19"),
    _member("schedule_first_val_step", "schedule_extra_params", "first_val_step", ">=0.5"),
    _member("schedule_adjust_tensor_shapes_fn", "schedule_extra_params", "adjust_tensor_shapes_fn", ">=0.13"),
    _member("schedule_grad_finalize_pgs", "schedule_extra_params", "grad_finalize_pgs", ">=0.14,<0.15"),
    _member("schedule_pg_collection", "schedule_extra_params", "pg_collection", ">=0.15"),
    # get_megatron_optimizer and its private builder (optimizer/__init__.py)
    _member("get_megatron_optimizer_legacy_conds", "public_builder_params", "no_weight_decay_cond", ">=0.6,<0.16"),
    _member("get_megatron_optimizer_config_overrides", "public_builder_params", "config_overrides", ">=0.16"),
    _member("use_gloo_process_groups", "public_builder_params", "use_gloo_process_groups", ">=0.12"),
    _member("get_megatron_optimizer_comm_pgs", "public_builder_params", "grad_comm_pgs", ">=0.14,<0.15"),
    _member("get_megatron_optimizer_pg_collection", "public_builder_params", "pg_collection", ">=0.15"),
    _member("default_skip_embedding_weight_decay", "public_builder_params", "default_skip_embedding_weight_decay",
            ">=0.14,<0.16"),
    _member("private_builder_model_chunks", "private_builder_params", "model_chunks", ">=0.9"),
)

#: ``{old capability name: row}``: the 33 names removed from the capability table on 2026-12-01.
DEPRECATED_FLAGS: dict[str, DeprecatedFlag] = {row.name: row for row in _ROWS}

#: Other public names removed since the README of 2026-12-01, each answered again by its module (a module
#: ``__getattr__`` or a property) with a warning: ``{path: what to use instead}``.
DEPRECATED_NAMES: dict[str, str] = {
    "mcore_compat.capabilities.Capability": "mcore_compat.capabilities.capability(name), which returns the fact's "
                                            "row (a Fact: value_for(version), rows, description, probe)",
    "mcore_compat.layout.version.MIN_VERSION": "mcore_compat.layout.version.resolve_version(version), which raises "
                                               "UnsupportedVersionError below the oldest release the facts cover",
    "mcore_compat.binding.manifest.Manifest.format": "Manifest.format_version",
    "mcore_compat.selfcheck.oracle.unsupported_group": "the self-check's configured rule "
                                                       "(mcore_compat.selfcheck.configured)",
    # The naming rule (README "One naming rule"): `mc.<Megatron name>` is Megatron's own object, adapters live in
    # mcore_compat.training. These top-level names were adapters under a Megatron name; they keep that meaning.
    "mcore_compat.get_megatron_optimizer": "mcore_compat.training.get_megatron_optimizer (the adapter, the same "
                                           "object); Megatron's own is mcore_compat.get_megatron_optimizer_raw or "
                                           "mcore_compat.core.optimizer.get_megatron_optimizer",
}

#: Top-level names of ``mcore_compat`` that are deprecated aliases (keys of :data:`DEPRECATED_NAMES` under
#: ``mcore_compat.``), answered by ``mcore_compat.__getattr__`` with one warning per process.
DEPRECATED_TOP_LEVEL: tuple[str, ...] = ("get_megatron_optimizer",)

#: Parameters removed or renamed since then and accepted again: ``{"module.function(param)": what to pass
#: instead}``; where that is the new parameter's name, decorating the function with :func:`renamed_params`
#: accepts the old keyword.
DEPRECATED_PARAMS: dict[str, str] = {}

_WARNED: set[str] = set()


def warn_deprecated_name(path: str, stacklevel: int = 3) -> None:
    """Warn once that the name at ``path`` (a key of :data:`DEPRECATED_NAMES`) is deprecated."""
    warn_deprecated(path, f"{path} is deprecated; use {DEPRECATED_NAMES[path]}", stacklevel=stacklevel + 1)


def warn_deprecated(key: str, message: str, stacklevel: int = 3) -> None:
    """Emit ``message`` as a :class:`DeprecationWarning` the first time ``key`` is used in this process."""
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(message, DeprecationWarning, stacklevel=stacklevel)


F = TypeVar("F", bound=Callable[..., Any])


def renamed_params(fn: F) -> F:
    """Accept the old keywords :data:`DEPRECATED_PARAMS` lists for ``fn`` (``"module.qualname(old)": "new"``),
    passed on as the new ones, each warning once.

    Raises:
        InvalidArgumentError: (at call time) both the old and the new keyword are given.
    """
    path = f"{fn.__module__}.{fn.__qualname__}"
    renames = {key[len(path) + 1:-1]: new for key, new in DEPRECATED_PARAMS.items()
               if key.startswith(f"{path}(") and new.isidentifier()}
    if not renames:
        return fn

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        for old, new in renames.items():
            if old in kwargs:
                if new in kwargs:
                    raise InvalidArgumentError(f"{path}: pass {new!r} only ({old!r} is its deprecated name)")
                warn_deprecated(f"{path}({old})", f"{path}: the parameter {old!r} is deprecated; pass {new!r}")
                kwargs[new] = kwargs.pop(old)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
