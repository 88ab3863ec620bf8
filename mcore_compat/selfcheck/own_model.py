"""The self-check's checks on the caller's own model: one real training step at start-up, verified.

Training code calls it on every rank after building DDP, the optimizer and the hooks (and, optionally, the
binding), inside its own process groups::

    from mcore_compat.selfcheck import check_training_step

    report = check_training_step(chunks, optimizer, forward_step, iter(batches), num_microbatches=4,
                                 seq_length=1024, micro_batch_size=2, binding=binding)
    if not report.ok:
        raise SystemExit(report.render())

There is no plain-PyTorch reference for an arbitrary model, so the checks are those that need none: hooks
installed on the config the model uses, every trainable parameter changed by the step, data-parallel ranks
identical after it, parameters still in DDP's param buffer (0.6+ distributed optimizer), and with a binding: it
verifies, its flat buffers hold the new weights, and (PP > 1) ``gather_pipeline`` equals every stage's weights.
The step is a real one: the model has trained one step afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from .report import Check, Report, merge_rank_checks

__all__ = ["check_training_step"]


def check_training_step(
    model_chunks: Any,
    optimizer: Any,
    forward_step_func: Callable[..., Any],
    data_iterator: Iterator[Any] | list[Iterator[Any]] | None,
    *,
    num_microbatches: int,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    binding: Any = None,
    **schedule_kwargs: Any,
) -> Report:
    """Run one training step of the caller's model through mcore_compat and check it (collective: every rank).

    Args:
        model_chunks: the DDP-wrapped chunks (a list, or one chunk).
        optimizer: the optimizer built for them (:func:`mcore_compat.training.get_megatron_optimizer`).
        forward_step_func, data_iterator, num_microbatches, seq_length, micro_batch_size, schedule_kwargs: as
            for :func:`mcore_compat.training.forward_backward`.
        binding: a :class:`~mcore_compat.binding.ParamBinding` of these chunks, to check it too.

    Returns:
        The merged report of all ranks (a check fails if it failed on any rank; ``failed_ranks`` names them).
    """
    import torch
    import torch.distributed as dist

    from .. import symbols, training
    from .worker import _binding_checks, _buffer_alias_check, _core, _dp_consistency, _pipeline_gather_check

    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    ps = symbols.resolve("parallel_state")
    checks: list[Check] = []
    try:
        training.check_training_hooks(chunks)
        checks.append(Check("training_hooks_installed", True, "finalize_model_grads_func set on the config the "
                                                              "model uses"))
    except training.MissingTrainingHookError as exc:
        checks.append(Check("training_hooks_installed", False, str(exc)))

    before = {f"{i}.{n}": p.detach().float().clone() for i, c in enumerate(chunks)
              for n, p in _core(c).named_parameters() if p.requires_grad}
    training.zero_grad_buffer(chunks, optimizer)
    training.forward_backward(forward_step_func, data_iterator, chunks if len(chunks) > 1 else chunks[0],
                              num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
                              check_hooks=False, **schedule_kwargs)
    ok, norm, _ = training.optimizer_step(optimizer)
    after = {f"{i}.{n}": p.detach().float() for i, c in enumerate(chunks) for n, p in _core(c).named_parameters()
             if p.requires_grad}
    unchanged = [n for n in before if torch.equal(before[n], after[n])]
    checks.append(Check("all_params_changed", bool(ok) and not unchanged,
                        f"{len(before) - len(unchanged)}/{len(before)} trainable parameters changed "
                        f"(step successful: {bool(ok)}, grad norm {norm})" +
                        (f"; unchanged: {', '.join(unchanged[:5])}" if unchanged else ""),
                        {"unchanged": unchanged, "grad_norm": None if norm is None else float(norm)}))
    for chunk in chunks:
        checks.append(_dp_consistency(chunk, ps))
    alias = _buffer_alias_check(chunks)
    if alias is not None:
        checks.append(alias)
    if binding is not None:
        if len(chunks) == 1:
            single = {n.split(".", 1)[1]: t for n, t in before.items()}
            checks.extend(_binding_checks(binding, chunks[0], single))
        if ps.get_pipeline_model_parallel_world_size() > 1:
            checks.append(_pipeline_gather_check(binding, ps))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, checks)
    report = Report(settings={"world_size": dist.get_world_size(), "chunks": len(chunks),
                              "num_microbatches": num_microbatches, "bind": binding is not None})
    report.checks = merge_rank_checks(gathered)
    return report
