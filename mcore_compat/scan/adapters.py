"""The one table of Megatron names whose signature changes across releases and that mcore_compat adapts: the
name as a client imports it -> the mcore_compat call to use instead (see :mod:`mcore_compat.training` and
:mod:`mcore_compat.configs`)."""

from __future__ import annotations

__all__ = ["ADAPTERS", "adapter_for"]

#: ``name -> (module prefix, mcore_compat call)``: a use of ``name`` imported from a module under the prefix.
ADAPTERS: dict[str, tuple[str, str]] = {
    "get_megatron_optimizer": ("megatron.core.optimizer", "mcore_compat.training.get_megatron_optimizer(config, model_chunks)"),
    "OptimizerConfig": ("megatron.core.optimizer", "mcore_compat.optimizer_config(**fields)"),
    "MegatronOptimizer": ("megatron.core.optimizer", "mcore_compat.training.optimizer_step(optimizer)"),
    "ChainedOptimizer": ("megatron.core.optimizer", "mcore_compat.training.optimizer_step(optimizer)"),
    "DistributedOptimizer": ("megatron.core.optimizer", "mcore_compat.training.optimizer_step(optimizer)"),
    "OptimizerParamScheduler": ("megatron.core", "mcore_compat.training.optimizer_param_scheduler(...)"),
    "DistributedDataParallel": ("megatron.core.distributed", "mcore_compat.training.wrap_ddp(model_chunks, ddp_config)"),
    "DistributedDataParallelConfig": ("megatron.core.distributed", "mcore_compat.ddp_config(**fields)"),
    "finalize_model_grads": ("megatron.core.distributed",
                             "mcore_compat.training.finalize_model_grads(model, num_tokens)"),
    "get_forward_backward_func": ("megatron.core.pipeline_parallel", "mcore_compat.training.forward_backward(...)"),
    "forward_backward_no_pipelining": ("megatron.core.pipeline_parallel", "mcore_compat.training.forward_backward(...)"),
    "forward_backward_pipelining_without_interleaving": ("megatron.core.pipeline_parallel",
                                                         "mcore_compat.training.forward_backward(...)"),
    "forward_backward_pipelining_with_interleaving": ("megatron.core.pipeline_parallel",
                                                      "mcore_compat.training.forward_backward(...)"),
    "TransformerConfig": ("megatron.core.transformer", "mcore_compat.transformer_config(**fields)"),
}


def adapter_for(module: str, name: str) -> str | None:
    """The mcore_compat call that adapts ``name`` imported from ``module`` (``None``: none)."""
    row = ADAPTERS.get(name)
    if row is None or not (module == row[0] or module.startswith(row[0] + ".")):
        return None
    return row[1]
