"""``forward_backward``: Megatron's forward/backward schedules with one argument list on every release.

The argument lists drift in ``megatron/core/pipeline_parallel/schedules.py`` (facts ``get_fwd_bwd_params``,
``schedule_extra_params``, ``interleaved_reads_config_vpp``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ..capabilities import fact, has
from ..errors import InvalidArgumentError, UnsupportedVersionError
from ..rank0 import warn_once_rank_0
from ._common import as_chunk_list, installed_version, mcore, model_config

__all__ = ["forward_backward", "get_forward_backward_func"]

#: Arguments that only tune speed/caching: dropped with a warning where the release lacks them.
_HARMLESS = {"first_val_step", "adjust_tensor_shapes_fn"}


def _check_virtual_stages(chunks: list[Any], data_iterator: Any, vp_size: int | None, version: Any) -> None:
    """Model chunks = virtual pipeline stages: what the interleaved schedule of every release needs, checked with
    a clear message (Megatron asserts or fails deep inside the schedule), and the config field that 0.13+ read
    set where it is missing."""
    n = len(chunks)
    if not isinstance(data_iterator, list) or len(data_iterator) != n:
        got = f"a list of {len(data_iterator)}" if isinstance(data_iterator, list) else type(data_iterator).__name__
        raise InvalidArgumentError(
            f"{n} model chunks (virtual pipeline stages) need a list of {n} data iterators, one per "
            f"chunk (each yields every micro-batch); got {got}"
        )
    ps = mcore("parallel_state")
    stages = vp_size or ps.get_virtual_pipeline_model_parallel_world_size()
    if stages != n:
        raise InvalidArgumentError(
            f"{n} model chunks but {stages} virtual pipeline stages (initialize_model_parallel("
            f"virtual_pipeline_model_parallel_size=...) or vp_size=); they must be equal"
        )
    for cfg in {id(c): c for c in (model_config(chunk) for chunk in chunks)}.values():
        current = getattr(cfg, "virtual_pipeline_model_parallel_size", None)
        if current is None and has("interleaved_reads_config_vpp", version):
            cfg.virtual_pipeline_model_parallel_size = n
        elif current is not None and current != n:
            raise InvalidArgumentError(
                f"config.virtual_pipeline_model_parallel_size = {current} but there are {n} model "
                f"chunks"
            )


def _unbatched_p2p_at_two_stages(chunks: list[Any], pp_size: int | None) -> list[tuple[Any, bool, bool]]:
    """Switch the interleaved schedule at a pipeline size of 2 from Megatron-Core's default batched P2P
    (``batch_p2p_comm=True, overlap_p2p_comm=False``) to ``batch_p2p_comm=False, overlap_p2p_comm=True``, what
    Megatron-LM's arguments give the interleaved schedule. With two stages the previous and the next stage are
    one peer, and ``_batched_p2p_ops`` (``megatron/core/pipeline_parallel/p2p_communication.py``, 0.8-0.19 and
    main) posts ``[send_prev, recv_prev, send_next, recv_next]`` to it in one tagless batch: both ranks post the
    same order with opposite roles, so an activation lands where a gradient is expected and vice versa (same
    shape: no error; measured on gloo: losses wrong from the third micro-batch, gradients off by 30-300x
    norm-wise). ``overlap_p2p_comm`` splits the forward and backward exchanges of the steady state, and the
    unbatched path gives the two directions separate communicators at a group size of 2.

    Returns:
        ``(config, batch_p2p_comm, overlap_p2p_comm)`` of each config switched, to restore after the schedule.
    """
    size = pp_size or mcore("parallel_state").get_pipeline_model_parallel_world_size()
    if len(chunks) < 2 or size != 2:
        return []
    switched = []
    for cfg in {id(c): c for c in (model_config(chunk) for chunk in chunks)}.values():
        if getattr(cfg, "batch_p2p_comm", False) and not getattr(cfg, "overlap_p2p_comm", False):
            switched.append((cfg, cfg.batch_p2p_comm, cfg.overlap_p2p_comm))
            cfg.batch_p2p_comm, cfg.overlap_p2p_comm = False, True
    if switched:
        warn_once_rank_0(
            "forward_backward: virtual pipeline stages at a pipeline size of 2 run with batch_p2p_comm=False, "
            "overlap_p2p_comm=True (Megatron-Core's default batch_p2p_comm=True swaps activations and gradients "
            "between the two stages there); set them so in the config to silence this")
    return switched


def get_forward_backward_func(pp_size: int | None = None, vp_size: int | None = None) -> Callable[..., Any]:
    """Megatron's schedule for the given (default: parallel_state's) pipeline / virtual-pipeline sizes."""
    version = installed_version()
    accepted = fact("get_fwd_bwd_params", version)
    fn = mcore("pipeline_parallel.schedules").get_forward_backward_func
    if "pp_size" in accepted:
        return fn(pp_size=pp_size, vp_size=vp_size)
    ps = mcore("parallel_state")
    if pp_size is not None and pp_size != ps.get_pipeline_model_parallel_world_size():
        raise UnsupportedVersionError(f"get_forward_backward_func(pp_size=...) needs megatron-core 0.16+; on "
                                      f"{version} the schedule follows parallel_state's pipeline size")
    if vp_size is not None and vp_size != ps.get_virtual_pipeline_model_parallel_world_size():
        raise UnsupportedVersionError("get_forward_backward_func(vp_size=...) needs megatron-core 0.16+")
    return fn()


def forward_backward(
    forward_step_func: Callable[..., Any],
    data_iterator: Iterator[Any] | list[Iterator[Any]] | None,
    model: Any,
    num_microbatches: int,
    *,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    decoder_seq_length: int | None = None,
    hidden_size: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    pp_size: int | None = None,
    vp_size: int | None = None,
    check_hooks: bool = True,
    **schedule_kwargs: Any,
) -> list[Any]:
    """Run Megatron's forward/backward schedule over ``num_microbatches`` microbatches.

    ``forward_step_func(data_iterator, model) -> (output_tensor, loss_func)``; ``loss_func(output)`` returns
    ``(loss, {name: value})`` (or ``(loss, num_tokens, {...})`` on 0.7+ with ``calculate_per_token_loss``).
    Put copies in the dict (``loss.detach().clone()``): 0.7+ divide the returned loss tensor by
    ``num_microbatches`` in place, so a plain ``loss.detach()`` (same storage) reads 1/num_microbatches of the
    loss there, but the full loss on 0.4-0.6.

    With several model chunks (virtual pipeline stages, the interleaved schedule) ``data_iterator`` is a list
    with one iterator per chunk; their number must equal parallel_state's virtual pipeline size, and
    ``config.virtual_pipeline_model_parallel_size`` (read by the 0.13+ schedule) is set to it where unset. At a
    pipeline size of 2 the interleaved schedule runs with ``batch_p2p_comm=False, overlap_p2p_comm=True`` (once
    warned where the config asks for Megatron-Core's default batched P2P, which swaps activations and gradients
    between the two stages: :func:`_unbatched_p2p_at_two_stages`).

    Args:
        seq_length, micro_batch_size, decoder_seq_length: needed (for the P2P tensor shapes) only when pipelining;
            without pipelining they are unused by every release and default to 0.
        hidden_size: the P2P tensor width; the schedules read ``config.hidden_size``, so a value given here
            must agree with it (or is set on a config that has none).
        forward_only, collect_non_loss_data: as in Megatron.
        first_val_step: 0.5+ (ignored with a warning on 0.4; it only affects fp8 weight caching).
        pp_size, vp_size: schedule selection (0.16+; must match parallel_state before).
        check_hooks: refuse to train (``forward_only=False``) when ``finalize_model_grads_func`` is not set
            (see :func:`~mcore_compat.training.check_training_hooks`).
        **schedule_kwargs: release-specific extras (``adjust_tensor_shapes_fn``, ``pg_collection``,
            ``grad_finalize_pgs``, ``force_all_reduce``, ``p2p_communicator``) passed where the release takes
            them.

    Returns:
        The per-microbatch outputs of ``loss_func`` on the last pipeline stage (``forward_data_store``).
    """
    version = installed_version()
    chunks, was_list = as_chunk_list(model)
    if check_hooks and not forward_only:
        from .finalize import check_training_hooks

        check_training_hooks(chunks)
    if len(chunks) > 1:
        _check_virtual_stages(chunks, data_iterator, vp_size, version)
    pipelined = mcore("parallel_state").get_pipeline_model_parallel_world_size() > 1 or (pp_size or 1) > 1
    if pipelined and (seq_length is None or micro_batch_size is None):
        raise InvalidArgumentError("seq_length and micro_batch_size are required with pipeline parallelism")
    if hidden_size is not None:
        cfg = model_config(chunks[0])
        current = getattr(cfg, "hidden_size", None)
        if current is None:
            cfg.hidden_size = hidden_size
        elif current != hidden_size:
            raise InvalidArgumentError(
                f"hidden_size={hidden_size} disagrees with the model config's hidden_size={current}"
            )
    kwargs: dict[str, Any] = dict(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=chunks if (was_list or len(chunks) > 1) else chunks[0],
        num_microbatches=num_microbatches,
        seq_length=0 if seq_length is None else seq_length,
        micro_batch_size=0 if micro_batch_size is None else micro_batch_size,
        decoder_seq_length=decoder_seq_length,
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
    )
    extras = set(fact("schedule_extra_params", version))
    if first_val_step is not None:
        schedule_kwargs["first_val_step"] = first_val_step
    for name, value in schedule_kwargs.items():
        if name == "grad_finalize_pgs" and "pg_collection" in extras:
            name = "pg_collection"
        elif name == "pg_collection" and "grad_finalize_pgs" in extras:
            name = "grad_finalize_pgs"
        if name in extras:
            kwargs[name] = value
        elif value is None or value is False:
            continue
        elif name in _HARMLESS:
            warn_once_rank_0(f"mcore_compat: `{name}` is not taken by the schedules of megatron-core {version}; "
                             f"ignored (it does not change results).")
        else:
            raise UnsupportedVersionError(f"`{name}` is not taken by the schedules of megatron-core {version}")
    fn = get_forward_backward_func(pp_size, vp_size)
    switched = _unbatched_p2p_at_two_stages(chunks, pp_size)
    try:
        return fn(**kwargs)
    finally:
        for cfg, batch, overlap in switched:
            cfg.batch_p2p_comm, cfg.overlap_p2p_comm = batch, overlap

