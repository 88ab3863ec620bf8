"""The gradient-finalisation hook and the other ``config.*_func`` hooks the schedules call.

Megatron-Core never sets these hooks itself (Megatron-LM's ``training.py`` does); when
``config.finalize_model_grads_func`` is ``None`` the schedules silently skip the data-parallel gradient
reduction (``megatron/core/pipeline_parallel/schedules.py``, every release). :func:`install_training_hooks` sets them on the config object the model
really uses and :func:`check_training_hooks` refuses to train without them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..capabilities import fact
from ..errors import InvalidArgumentError, InvalidTypeError, McoreCompatError, UnsupportedVersionError
from ._common import as_chunk_list, installed_version, mcore, model_config, unique
from .param_sync import overlaps_param_gather

__all__ = [
    "MissingTrainingHookError",
    "check_training_hooks",
    "finalize_model_grads",
    "install_training_hooks",
]

#: The process-group argument of finalize_model_grads went grad_finalize_pgs (0.14) -> pg_collection (0.15+).
_PG_ALIASES = ("grad_finalize_pgs", "pg_collection")


class MissingTrainingHookError(McoreCompatError):
    """A hook the schedules need (``finalize_model_grads_func``) is not set on the model's config."""


def finalize_model_grads(model: Any, num_tokens: Any = None, **kwargs: Any) -> None:
    """Megatron's ``finalize_model_grads`` callable the same way on every release.

    Usable directly and as ``config.finalize_model_grads_func`` (the schedules call it with whatever arguments
    their release passes: ``(model)``, ``(model, num_tokens)``, ``grad_finalize_pgs=``, ``pg_collection=``,
    ``force_all_reduce=``).

    Args:
        model: list of model chunks (a single module is accepted too).
        num_tokens: total tokens for per-token loss normalisation (0.7+; a non-``None`` value raises on 0.4-0.6
            where gradients cannot be rescaled by Megatron).
        **kwargs: ``pg_collection`` / ``grad_finalize_pgs`` (either name; passed under the installed name),
            ``force_all_reduce`` (0.16+). Values the release cannot take raise if not their default.
    """
    version = installed_version()
    accepted = fact("finalize_params", version)
    chunks, _ = as_chunk_list(model)
    call: dict[str, Any] = {}
    if num_tokens is not None:
        if "num_tokens" not in accepted:
            raise UnsupportedVersionError(
                f"finalize_model_grads of megatron-core {version} has no num_tokens (per-token loss normalisation "
                f"exists from 0.7)")
        call["num_tokens"] = num_tokens
    pgs = [kwargs.pop(name) for name in _PG_ALIASES if name in kwargs]
    pgs = [p for p in pgs if p is not None]
    if pgs:
        target = next((n for n in _PG_ALIASES if n in accepted), None)
        if target is None:
            raise UnsupportedVersionError(
                f"finalize_model_grads of megatron-core {version} takes no process-group collection; it uses "
                f"parallel_state's groups")
        call[target] = pgs[0]
    force = kwargs.pop("force_all_reduce", False)
    if force:
        if "force_all_reduce" not in accepted:
            raise UnsupportedVersionError(f"force_all_reduce needs megatron-core 0.16+; installed {version}")
        call["force_all_reduce"] = force
    if kwargs:
        raise InvalidTypeError(f"finalize_model_grads got unexpected argument(s) {sorted(kwargs)}")
    fn = mcore("distributed.finalize_model_grads").finalize_model_grads
    if "num_tokens" in call:  # positional in every release that has it
        nt = call.pop("num_tokens")
        fn(chunks, nt, **call)
    else:
        fn(chunks, **call)


def _configs(model_chunks: Sequence[Any]) -> list[Any]:
    return unique([model_config(chunk) for chunk in model_chunks])


def _ddp_config(chunk: Any) -> Any:
    """The DDP settings of a Megatron DDP chunk as an object with attributes (None if not DDP-wrapped)."""
    cfg = getattr(chunk, "ddp_config", None)
    if cfg is not None:
        return cfg
    if hasattr(chunk, "overlap_grad_reduce"):  # 0.4-0.6 keep the flags on the DDP object itself
        return chunk
    return None


def install_training_hooks(
    model_chunks: Any,
    optimizer: Any = None,
    *,
    finalize: bool = True,
    align_grad_reduce: bool = True,
    align_param_gather: bool | None = None,
) -> Any:
    """Set the schedule hooks on the config every chunk really uses, like Megatron-LM's ``training.py``.

    Sets ``finalize_model_grads_func`` (to :func:`finalize_model_grads`), ``grad_scale_func``
    (``optimizer.scale_loss``), and for DDP chunks with ``overlap_grad_reduce`` ``no_sync_func`` and (if
    ``align_grad_reduce``) ``grad_sync_func``; with ``overlap_param_gather`` and ``align_param_gather``
    (default: the DDP config's) ``param_sync_func`` (DDP's ``start_param_sync`` on 0.9+, the optimizer's
    ``finish_param_sync`` before).

    Returns:
        The (first) config object the hooks were set on.
    """
    version = installed_version()
    chunks, _ = as_chunk_list(model_chunks)
    if not chunks:
        raise InvalidArgumentError("install_training_hooks needs at least one model chunk")
    ddp_cfgs = [_ddp_config(c) for c in chunks]
    overlap_grad = any(bool(getattr(d, "overlap_grad_reduce", False)) for d in ddp_cfgs if d is not None)
    overlap_param = any(overlaps_param_gather(c) for c in chunks)
    if align_param_gather is None:
        align_param_gather = any(bool(getattr(d, "align_param_gather", False)) for d in ddp_cfgs if d is not None)

    def one_or_list(fns: list[Any]) -> Any:
        return fns[0] if len(fns) == 1 else fns

    configs = _configs(chunks)
    for cfg in configs:
        if finalize:
            cfg.finalize_model_grads_func = finalize_model_grads
        if optimizer is not None and hasattr(optimizer, "scale_loss"):
            cfg.grad_scale_func = optimizer.scale_loss
        if overlap_grad:
            cfg.no_sync_func = one_or_list([c.no_sync for c in chunks])
            if align_grad_reduce:
                cfg.grad_sync_func = one_or_list([c.start_grad_sync for c in chunks])
        if overlap_param and align_param_gather:
            if fact("param_gather_owner", version) == "ddp":
                cfg.param_sync_func = one_or_list([c.start_param_sync for c in chunks])
            elif optimizer is not None and hasattr(optimizer, "finish_param_sync"):
                cfg.param_sync_func = one_or_list(
                    [(lambda x, i=i: optimizer.finish_param_sync(i, x)) for i in range(len(chunks))])
    return configs[0]


def check_training_hooks(model_chunks: Any) -> None:
    """Raise :class:`MissingTrainingHookError` if the schedules would silently skip gradient finalisation.

    Checks the config each chunk really uses (``get_model_config``): ``finalize_model_grads_func`` must be set
    (without it no data-parallel gradient reduction happens, the grad norm and the update are wrong at DP > 1),
    and DDP chunks with ``overlap_grad_reduce`` need ``no_sync_func``.
    """
    chunks, _ = as_chunk_list(model_chunks)
    for i, chunk in enumerate(chunks):
        cfg = model_config(chunk)
        if getattr(cfg, "finalize_model_grads_func", None) is None:
            raise MissingTrainingHookError(
                f"model chunk {i}: config.finalize_model_grads_func is not set, so Megatron's schedules would skip "
                f"the data-parallel gradient reduction (and the layernorm/embedding all-reduces) without any error; "
                f"gradients, grad norm and the update would be wrong. Call "
                f"mcore_compat.training.install_training_hooks(model_chunks, optimizer) before training.")
        ddp = _ddp_config(chunk)
        if ddp is not None and getattr(ddp, "overlap_grad_reduce", False) and cfg.no_sync_func is None:
            raise MissingTrainingHookError(
                f"model chunk {i}: overlap_grad_reduce is on but config.no_sync_func is not set, so a bucket "
                f"reduction would be launched for every microbatch. Call install_training_hooks(...).")
