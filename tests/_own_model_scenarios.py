"""Rank body for tests/test_selfcheck_real.py's own-model cases: ``check_training_step`` on a model built by
the caller (here: the self-check's tiny GPT, built and wrapped the way training code does), clean and with the
faults a real bug would cause inside the optimizer step (after ``finalize_model_grads``, before the update)."""

from __future__ import annotations

from typing import Any

#: case -> (pipeline size, dtype, reference copy)
CASES = {
    "good": (1, "fp32", True),
    # Megatron's default dropout (hidden and attention 0.1): the reference replays the step's random state
    "good-dropout": (1, "fp32", True),
    # the same, with the replay switched off: the reference draws other masks, so the gradients differ
    "dropout-no-replay": (1, "fp32", True),
    "good-bf16": (1, "bf16", True),
    # the update checked from a snapshot of the whole state instead of inside the step (MCORE_COMPAT_STREAM=0)
    "good-bf16-snapshot": (1, "bf16", True),
    "step-maximize-snapshot": (1, "fp32", False),
    "good-pp2": (2, "fp32", True),
    # finite_differences=True through a pipeline of 2 stages with tied embeddings: both of its checks PASS
    "fd-pp2": (2, "fp32", True),
    "good-no-reference": (1, "fp32", False),
    "no-hook": (1, "fp32", True),
    "rebind-after-bind": (1, "fp32", True),
    "step-negate-norm-grads": (1, "fp32", False),
    "step-scale-grads": (1, "fp32", False),
    "step-perturb-rank1": (1, "fp32", False),
    "step-group-lr": (1, "fp32", False),
    "step-zero-half-grad": (1, "fp32", False),
    "step-maximize": (1, "fp32", False),
    "step-swap-betas": (1, "bf16", False),
}


def _wrap_step(optimizer: Any, chunks: list[Any], case: str, dp_rank: int) -> None:
    """Make ``optimizer.step`` corrupt the finalized gradients / a group before the real update runs."""
    import torch

    from mcore_compat.selfcheck.wrappers import core_module

    real = optimizer.step
    named = [(n, p) for c in chunks for n, p in core_module(c).named_parameters()]

    def faulty(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            if case == "step-negate-norm-grads":
                for n, p in named:
                    if "norm" in n:
                        p.main_grad.neg_()
            elif case == "step-scale-grads":
                for _, p in named:
                    p.main_grad.mul_(3.0)
            elif case == "step-perturb-rank1" and dp_rank == 1:
                g = torch.Generator().manual_seed(3)
                for _, p in named:
                    p.main_grad.add_(1e-3 * torch.randn(p.main_grad.shape, generator=g).to(p.main_grad))
            elif case == "step-group-lr":
                optimizer.param_groups[0]["lr"] *= 10.0
            elif case == "step-zero-half-grad":
                _, p = next((n, p) for n, p in named if p.dim() == 2)
                p.main_grad.view(-1)[: p.numel() // 2].zero_()
            elif case.startswith("step-maximize"):  # every update up the gradient
                for group in optimizer.param_groups:
                    group["maximize"] = True
            elif case == "step-swap-betas":
                for group in optimizer.param_groups:
                    group["betas"] = tuple(reversed(group["betas"]))
        return real(*args, **kwargs)

    optimizer.step = faulty


#: The dropout of the dropout cases (Megatron's ``TransformerConfig`` default for both).
DROPOUT = 0.1


def _no_replay() -> Any:
    """Switch the reference's replay of the step's random state off (restored by calling the result)."""
    from mcore_compat.selfcheck.rng_replay import RngReplay

    real = RngReplay.replay
    RngReplay.replay = lambda self, chunk, microbatch: False  # type: ignore[method-assign]

    def undo() -> None:
        RngReplay.replay = real  # type: ignore[method-assign]

    return undo


def _rng_after_unchecked(chunks: list[Any], optimizer: Any, opts: Any, before: Any, batches: list[Any]) -> Any:
    """The random state a plain step (``forward_backward``, nothing checked) leaves when it starts from
    ``before``: what the random streams must be after ``check_training_step`` too."""
    from mcore_compat import training
    from mcore_compat.selfcheck import models
    from mcore_compat.selfcheck.rng_replay import capture, restore

    restore(before)
    training.zero_grad_buffer(chunks, optimizer)
    training.forward_backward(models.forward_step(opts), iter(batches), chunks[0], models.MICROBATCHES,
                              seq_length=models.SEQ, micro_batch_size=models.MICRO_BATCH, check_hooks=False)
    return capture()


def run_case(case: str) -> dict[str, Any]:
    """One case on this rank; returns the merged report's verdicts ``{check name: status}`` and ``ok``."""
    from mcore_compat import patches

    patches.apply_for_device("cpu")
    from mcore_compat import symbols, training
    from mcore_compat.binding import bind_params
    from mcore_compat.selfcheck import SelfCheckOptions, check_training_step, models
    from mcore_compat.selfcheck.worker import _rebind_outside, no_decay

    pp, dtype, reference = CASES[case]
    opts = SelfCheckOptions(nproc=2, tp=1, pp=pp, dp=2 // pp, device="cpu", model="gpt", dtype=dtype,
                            seed=7, dropout=DROPOUT if "dropout" in case else 0.0).resolved()
    ps = symbols.resolve("parallel_state")
    models.init_parallel(opts)
    import torch

    modules, _ = models.build_chunks(opts)
    chunks = training.wrap_ddp(modules, ddp_config=training.DDPConfig(use_distributed_optimizer=True,
                                                                      grad_reduce_in_fp32=dtype == "bf16"))
    optimizer = training.get_megatron_optimizer(
        training.OptimConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, use_distributed_optimizer=True,
                             bf16=dtype == "bf16",
                             params_dtype=torch.bfloat16 if dtype == "bf16" else torch.float32),
        chunks, no_weight_decay_cond=no_decay)
    training.set_lr_and_weight_decay(optimizer, 1e-2, 0.1)
    training.install_training_hooks(chunks, optimizer)
    binding = bind_params(chunks)
    if case == "no-hook":
        symbols.resolve("get_model_config")(chunks[0]).finalize_model_grads_func = None
    if case == "rebind-after-bind":
        _rebind_outside(chunks[0])
    if case.startswith("step-"):
        _wrap_step(optimizer, chunks, case, ps.get_data_parallel_rank())
    batches = models.make_batches(opts, ps.get_data_parallel_rank())
    from mcore_compat.selfcheck.rng_replay import capture

    undo = _no_replay() if case == "dropout-no-replay" else None
    before = capture()
    import os

    if case.endswith("-snapshot"):
        os.environ["MCORE_COMPAT_STREAM"] = "0"
    try:
        report = check_training_step(chunks, optimizer, models.forward_step(opts), iter(batches),
                                     num_microbatches=models.MICROBATCHES, seq_length=models.SEQ,
                                     micro_batch_size=models.MICRO_BATCH, binding=binding, reference=reference,
                                     finite_differences=case.startswith("fd-"))
    finally:
        os.environ.pop("MCORE_COMPAT_STREAM", None)
        if undo is not None:
            undo()
    after = capture()
    rng_as_unchecked = None
    if case == "good-dropout":
        rng_as_unchecked = after.same_as(_rng_after_unchecked(chunks, optimizer, opts, before, batches))
    models.release_chunks(chunks)
    ps.destroy_model_parallel()
    return {"ok": report.ok, "checks": {c.name: c.status for c in report.checks}, "text": report.render(),
            "settings": report.settings, "rng_as_unchecked": rng_as_unchecked,
            "rng_moved": not after.same_as(before)}


def run_all(only: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """Every case (or those in ``only``) in one process group (each case's process groups destroyed after it)."""
    from _case_groups import case_end, case_start

    out = {}
    for case in [c for c in CASES if not only or c in only]:
        before = case_start()
        out[case] = run_case(case)
        case_end(before)
    return out


def legacy_tied_refusal() -> str | None:
    """World size 4 (DP=2 x PP=2), tied embeddings, the distributed optimizer: on the releases served by
    mcore_compat's own optimizer (0.4/0.5) building it must refuse; returns the error's text (``None``: built)."""
    from mcore_compat import patches

    patches.apply_for_device("cpu")
    from mcore_compat import symbols, training
    from mcore_compat.errors import UnsupportedVersionError
    from mcore_compat.selfcheck import SelfCheckOptions, models

    opts = SelfCheckOptions(nproc=4, tp=1, pp=2, device="cpu", model="gpt", tie_embeddings=True).resolved()
    models.init_parallel(opts)
    modules, _ = models.build_chunks(opts)
    chunks = training.wrap_ddp(modules, ddp_config=models.ddp_config(opts))
    try:
        training.get_megatron_optimizer(models.optim_config(opts), chunks)
        message = None
    except UnsupportedVersionError as exc:
        message = str(exc)
    models.release_chunks(chunks)
    symbols.resolve("parallel_state").destroy_model_parallel()
    return message


def tied_bias_buckets() -> dict[str, Any]:
    """PP=2, tied embeddings, linear biases, the distributed optimizer (the model a user hit an AssertionError
    inside Megatron with on 0.12.3): ``wrap_ddp`` either refuses on every stage before building anything, or DDP
    and the optimizer build. Returns ``{"refused": text or None, "rebound": whether any param became a view of a
    DDP buffer, "optimizer": built}``."""
    import dataclasses

    from mcore_compat import patches

    patches.apply_for_device("cpu")
    from mcore_compat import symbols, training
    from mcore_compat.errors import UnsupportedVersionError
    from mcore_compat.selfcheck import SelfCheckOptions, models

    opts = SelfCheckOptions(nproc=2, tp=1, pp=2, device="cpu", model="gpt", tie_embeddings=True,
                            distributed_optimizer=True).resolved()
    models.init_parallel(opts)
    ps = symbols.resolve("parallel_state")
    # one layer per stage: its params (with biases) then end on an odd number of 64-element blocks
    config = dataclasses.replace(models.transformer_config(opts), add_bias_linear=True, num_layers=2)
    module = models._gpt(config, opts, pre_process=ps.is_pipeline_first_stage(),
                         post_process=ps.is_pipeline_last_stage(), tie=True, vp_stage=None)
    storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
    out: dict[str, Any] = {"refused": None, "optimizer": False}
    chunks: list[Any] = []
    try:
        chunks = training.wrap_ddp([module], ddp_config=models.ddp_config(opts))
        training.get_megatron_optimizer(models.optim_config(opts), chunks)
        out["optimizer"] = True
    except UnsupportedVersionError as exc:
        out["refused"] = str(exc)
    out["rebound"] = any(p.untyped_storage().data_ptr() not in storages for p in module.parameters())
    out["biases"] = sum(name.endswith(".bias") for name, _ in module.named_parameters())
    if out["refused"]:  # what the refusal prevents: the same build without the check, inside Megatron
        from mcore_compat.training import ddp as ddp_module

        check, ddp_module.check_tied_buckets = ddp_module.check_tied_buckets, lambda *a, **k: None
        try:
            chunks = training.wrap_ddp([module], ddp_config=models.ddp_config(opts))
            training.get_megatron_optimizer(models.optim_config(opts), chunks)
            out["unchecked"] = "built"
        except AssertionError as exc:
            out["unchecked"] = f"AssertionError: {exc}"
        finally:
            ddp_module.check_tied_buckets = check
    if chunks:
        models.release_chunks(chunks)
    ps.destroy_model_parallel()
    return out


def fd_step(opts: Any) -> dict[str, Any]:
    """``check_training_step(..., finite_differences=True)`` on this rank for the resolved ``opts`` (world size
    2), after one unchecked warm-up step (Adam's moments set, the params moved once: a weight cached at the first
    forward is stale in the checked step). Returns ``{"checks": [Check], "error": None, "seconds": float}``."""
    import time

    from mcore_compat import patches

    patches.apply_for_device("cpu")
    from mcore_compat import symbols
    from mcore_compat.selfcheck import check_training_step, models

    start = time.perf_counter()
    ps = symbols.resolve("parallel_state")
    chunks, optimizer = build_user_model(opts)
    batches = train_step(opts, chunks, optimizer)
    report = check_training_step(chunks, optimizer, models.forward_step(opts), iter(batches),
                                 num_microbatches=models.MICROBATCHES, finite_differences=True,
                                 seq_length=models.SEQ, micro_batch_size=models.MICRO_BATCH)
    models.release_chunks(chunks)
    ps.destroy_model_parallel()
    return {"checks": report.checks, "error": None, "seconds": round(time.perf_counter() - start, 2),
            "settings": report.settings}


def build_user_model(opts: Any) -> tuple[list[Any], Any]:
    """The user's model of these fixtures, on this rank for the resolved ``opts``: the self-check's tiny GPT
    built as training code does (model-parallel state, DDP, Megatron's optimizer with the no-decay groups, the
    configured lr and weight decay, the training hooks). Returns ``(chunks, optimizer)``."""
    from mcore_compat import training
    from mcore_compat.selfcheck import models
    from mcore_compat.selfcheck.worker import no_decay

    models.init_parallel(opts)
    modules, _ = models.build_chunks(opts)
    chunks = training.wrap_ddp(modules, ddp_config=models.ddp_config(opts))
    optimizer = training.get_megatron_optimizer(models.optim_config(opts), chunks, no_weight_decay_cond=no_decay)
    training.set_lr_and_weight_decay(optimizer, opts.lr, opts.weight_decay)
    training.install_training_hooks(chunks, optimizer)
    return chunks, optimizer


def train_step(opts: Any, chunks: list[Any], optimizer: Any) -> list[Any]:
    """One plain training step of :func:`build_user_model`'s model on this rank's batches (returned)."""
    from mcore_compat import symbols, training
    from mcore_compat.selfcheck import models

    batches = models.make_batches(opts, symbols.resolve("parallel_state").get_data_parallel_rank())
    training.zero_grad_buffer(chunks, optimizer)
    training.forward_backward(models.forward_step(opts), iter(batches), chunks[0], models.MICROBATCHES,
                              check_hooks=False, seq_length=models.SEQ, micro_batch_size=models.MICRO_BATCH)
    training.optimizer_step(optimizer)
    training.finish_param_sync(chunks, optimizer)
    return batches
