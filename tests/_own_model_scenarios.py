"""Rank body for tests/test_selfcheck_real.py's own-model cases: ``check_training_step`` on a model built by
the caller (here: the self-check's tiny GPT, built and wrapped the way training code does)."""

from __future__ import annotations

from typing import Any

CASES = ("good", "good-pp2", "no-hook", "rebind-after-bind")


def run_case(case: str) -> dict[str, Any]:
    """One case on this rank; returns the merged report's verdicts ``{check name: passed}`` and ``ok``."""
    from mcore_compat import patches

    patches.apply_for_device("cpu")
    import torch

    from mcore_compat import symbols, training
    from mcore_compat.binding import bind_params
    from mcore_compat.selfcheck import SelfCheckOptions, check_training_step
    from mcore_compat.selfcheck.models import MICRO_BATCH, MICROBATCHES, SEQ, build_model, make_batches
    from mcore_compat.selfcheck.worker import _forward_step, _rebind_outside

    pp = 2 if case == "good-pp2" else 1
    opts = SelfCheckOptions(nproc=2, tp=1, pp=pp, dp=2 // pp, device="cpu", model="gpt")
    ps = symbols.resolve("parallel_state")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=pp)
    torch.manual_seed(7)
    symbols.resolve("model_parallel_cuda_manual_seed")(7)
    module, _ = build_model(opts)
    chunks = training.wrap_ddp([module], ddp_config=training.DDPConfig(use_distributed_optimizer=True))
    optimizer = training.get_megatron_optimizer(
        training.OptimConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True), chunks)
    training.install_training_hooks(chunks, optimizer)
    binding = bind_params(chunks)
    if case == "no-hook":
        symbols.resolve("get_model_config")(chunks[0]).finalize_model_grads_func = None
    if case == "rebind-after-bind":
        _rebind_outside(chunks[0])
    batches = make_batches(opts, ps.get_data_parallel_rank())
    report = check_training_step(chunks, optimizer, _forward_step(opts), iter(batches),
                                 num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=MICRO_BATCH,
                                 binding=binding)
    ps.destroy_model_parallel()
    return {"ok": report.ok, "checks": {c.name: c.passed for c in report.checks}, "text": report.render()}


def run_all() -> dict[str, dict[str, Any]]:
    """Every case in one process group."""
    return {case: run_case(case) for case in CASES}
