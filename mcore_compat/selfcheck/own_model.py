"""The self-check's proof on the caller's own model: one real training step at start-up, verified.

Training code calls it on every rank after building DDP, the optimizer and the hooks (and, optionally, the
binding), inside its own process groups::

    from mcore_compat.selfcheck import check_training_step

    report = check_training_step(chunks, optimizer, forward_step, iter(batches), num_microbatches=4,
                                 seq_length=1024, micro_batch_size=2, binding=binding)
    if not report.ok:
        raise SystemExit(report.render())

The step is a real one (the model has trained one step afterwards) and is proven without a hand-written
reference (:mod:`~mcore_compat.selfcheck.verify`): the finalized gradients equal those of a plain-autograd copy
of the model on the same micro-batches, reduced by hand; each main param's update equals the optimizer's own
rule recomputed in float64 from the pre-step state; the reported gradient norm equals the one recomputed here;
model params equal the main params cast to the model dtype; replicated params are bit-identical over their
groups; and the hooks, DDP's param buffer and the binding are intact. With dropout, the reference's forwards
replay the random state each real forward started from (the same masks), and the random state after the check is
the one the step left, as without the check.

What its gradient reference can and cannot see: the copy runs the caller's own layer code (the same modules,
the same kernels) on the same inputs, without DDP, the schedule, ``finalize_model_grads`` or mcore_compat's
adapters. It proves the distributed and optimizer path (what gradients DDP keeps and reduces, what the optimizer
reads and how it updates), not the layers: a fault inside them (a stale weight in a linear layer's forward, a
missing tensor-parallel reduction, wrong rows of a weight gradient) acts on the copy too. Only the self-check's
own model is also compared with a model written independently from the math (``independent_reference_matches``,
:mod:`.independent`); here that check is N/A, saying so.

Cost: the reference shares the model's weights (one step only), so it adds a gradient and a bound per parameter
while it runs, and one more forward and backward. The update is checked inside the optimizer step, part by part
(:mod:`.in_step`: about a quarter of the main params and their state copied at a time), where the inner optimizer
updates each element on its own (torch's, apex's and TransformerEngine's Adam and SGD); fp32 finalized gradients
are copied once (the optimizer clips them in place). Otherwise the whole pre-step state is snapshotted (about
four fp32 copies of this rank's main params; on CUDA partly in pinned host memory when the device is short). The
report's settings say which (``update_checked``) and how many bytes (``reference_bytes``, ``snapshot_bytes``,
``snapshot_host_bytes``). ``reference=False`` skips the reference (the rule, the norm, the model params and the
replicas are still proven).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

from .._util.gc import gc_paused
from ..errors import InvalidArgumentError
from .report import Check, Report, merge_rank_checks

__all__ = ["check_training_step"]


def _materialize(data_iterator: Any, n_chunks: int, num_microbatches: int) -> list[list[Any] | None]:
    """Per chunk, the micro-batches its iterator yields in one step (``None`` where the stage reads none)."""
    iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator] * n_chunks
    if isinstance(data_iterator, list) and len(iterators) != n_chunks:
        raise InvalidArgumentError(f"data_iterator: {len(iterators)} iterators for {n_chunks} model chunks")
    out: list[list[Any] | None] = []
    taken: dict[int, list[Any]] = {}
    for it in iterators:
        if it is None:
            out.append(None)
        elif id(it) in taken:  # the same iterator for every chunk (no virtual pipelining)
            out.append(taken[id(it)])
        else:
            batch = list(itertools.islice(it, num_microbatches))
            taken[id(it)] = batch
            out.append(batch)
    return out


def _iterators(batches: list[list[Any] | None], as_list: bool) -> Any:
    its = [None if b is None else iter(b) for b in batches]
    return its if as_list else its[0]


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
    reference: bool = True,
    finite_differences: bool = False,
    **schedule_kwargs: Any,
) -> Report:
    """Run one training step of the caller's model through mcore_compat and prove it (collective: every rank).

    The gradient reference (``grads_match_reference``) is a plain-autograd copy of the caller's modules: it
    reuses the caller's layer code, so it proves the distributed and optimizer path (DDP's buffers and
    reductions, ``finalize_model_grads``, the optimizer's inputs and update), not the layers themselves; a fault
    inside them acts on the copy alike. ``independent_reference_matches`` (a float64 model written from the
    math, :mod:`.independent`) exists for the self-check's own model only and is N/A here.

    Args:
        model_chunks: the DDP-wrapped chunks (a list, or one chunk).
        optimizer: the optimizer built for them (:func:`mcore_compat.training.get_megatron_optimizer`).
        forward_step_func, data_iterator, num_microbatches, seq_length, micro_batch_size, schedule_kwargs: as
            for :func:`mcore_compat.training.forward_backward`. ``num_microbatches`` micro-batches are taken
            from each iterator first (the reference sees the same ones).
        binding: a :class:`~mcore_compat.binding.ParamBinding` of these chunks, to check it too.
        reference: build the plain-autograd copy for the gradient check (one more model in memory).
        finite_differences: also check the gradients against the forward alone (:mod:`.directional`:
            ``grads_match_directional_derivatives``, ``loss_matches_float64``): a float64 copy of the model's
            backward against the central differences of its loss (faults inside the layers' own backward, at
            about 1e-4 of the gradient's norm whatever the model's dtype), the finalized gradients against that
            copy's (at the model dtype's resolution), and each loss against the copy's (a forward reading stale
            weights). It costs a float64 copy of the params and their gradients, one float64 backward and
            ``1 + 4 x DIRECTIONS`` float64 forwards of the step: run it once per run (e.g. the first step after
            a warm-up step). Off: both checks are N/A, saying so.

    Returns:
        The merged report of all ranks (a check fails if it failed on any rank; ``Check.ranks`` names them).
    """
    import torch.distributed as dist

    from .. import symbols, training
    from ..launch import gather_objects
    from . import in_step
    from .verify import StepVerifier
    from .worker import _binding_checks, _buffer_alias_check, _pipeline_gather_check

    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    ps = symbols.resolve("parallel_state")
    checks: list[Check] = []
    hooks_ok = True
    try:
        training.check_training_hooks(chunks)
        checks.append(Check("training_hooks_installed", True, "finalize_model_grads_func set on the config the "
                                                              "model uses"))
    except training.MissingTrainingHookError as exc:
        hooks_ok = False
        checks.append(Check("training_hooks_installed", False, str(exc)))
    config = symbols.resolve("get_model_config")(chunks[0])
    batches = _materialize(data_iterator, len(chunks), num_microbatches)
    as_list = isinstance(data_iterator, list)
    with gc_paused():  # the checks make thousands of short-lived tensors and dicts (see gc_paused)
        verifier = StepVerifier(chunks, optimizer, reference=reference, continuity=False, one_step=True,
                                stream=True, per_token_loss=bool(getattr(config, "calculate_per_token_loss", False)))
        verifier.before_step()
        training.zero_grad_buffer(chunks, optimizer)
        model = chunks if len(chunks) > 1 else chunks[0]
        stored = training.forward_backward(verifier.recording(forward_step_func), _iterators(batches, as_list),
                                           model, num_microbatches,
                                           seq_length=seq_length, micro_batch_size=micro_batch_size,
                                           check_hooks=False, **schedule_kwargs)
        verifier.after_backward(forward_step_func, batches, num_microbatches, stored, last=True)
        if finite_differences:  # before the optimizer step reads (unscales, clips) the finalized gradients
            from .directional import FiniteDifferences

            fd_checks = FiniteDifferences(chunks, verifier.view, verifier.groups, verifier.names,
                                          per_token_loss=bool(getattr(config, "calculate_per_token_loss", False))
                                          ).run(forward_step_func, batches, num_microbatches, stored or [],
                                                verifier.loss_scale_now, verifier.rng, verifier.routing)
        else:
            from .directional import not_requested

            fd_checks = not_requested()
        with verifier.stepping():
            ok, norm, _ = training.optimizer_step(optimizer)
        verifier.after_step(ok, norm)
        training.finish_param_sync(chunks, optimizer)  # the overlapped all-gather of the updated params, if any
        verifier.final_replicas()
    checks.extend(verifier.checks())
    checks.extend(fd_checks)
    checks.append(Check.not_applicable(
        "independent_reference_matches", "the caller's own model: there is no independent model of its layers; "
        "grads_match_reference reuses the caller's layer code, so it proves the distributed and optimizer path, "
        "not the layers"))
    alias = _buffer_alias_check(chunks)
    if alias is not None:
        checks.append(alias)
    if binding is not None:
        checks.extend(_binding_checks(binding, chunks))
        if ps.get_pipeline_model_parallel_world_size() > 1:
            checks.append(_pipeline_gather_check(binding, ps))
    gathered = gather_objects(checks)
    report = Report(settings={"world_size": dist.get_world_size(), "chunks": len(chunks),
                              "num_microbatches": num_microbatches, "bind": binding is not None,
                              "reference": reference, "hooks_installed": hooks_ok,
                              "finite_differences": finite_differences,
                              "reference_bytes": verifier.reference_bytes,
                              "snapshot_bytes": verifier.snapshot_bytes,
                              "snapshot_host_bytes": verifier.snapshot_host_bytes,
                              "update_checked": f"inside the optimizer step, in {in_step.PARTS} parts" if verifier.stream
                              else f"from a snapshot of the whole state ({verifier.stream_reason})"})
    report.checks = merge_rank_checks(gathered)
    return report
