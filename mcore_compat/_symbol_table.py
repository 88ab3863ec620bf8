"""Data: where each symbol of the import surface lives, per Megatron-Core release.

Each row was checked against the released wheels (0.4.0 ... 0.19.2); ``tests/test_surface_real.py`` re-checks
every row against the installed release in every matrix session. Ranges are open-ended upwards on the newest
location so that releases newer than the matrix resolve to the newest known place.
"""

from __future__ import annotations

from .symbols import Location as L
from .symbols import Symbol as S

_ALL = ">=0.4"

_ROWS: tuple[S, ...] = (
    S("parallel_state", (L(_ALL, "megatron.core.parallel_state"),), "model/data parallel groups"),
    S("mpu", (L(_ALL, "megatron.core.parallel_state"),), "alias of parallel_state"),
    S("tensor_parallel", (L(_ALL, "megatron.core.tensor_parallel"),), "tensor-parallel layers, RNG tracker"),
    S("DistributedDataParallel",
      (L(_ALL, "megatron.core.distributed.distributed_data_parallel", "DistributedDataParallel"),),
      "Megatron's DDP wrapper"),
    S("DistributedDataParallelConfig",
      (L(">=0.7", "megatron.core.distributed.distributed_data_parallel_config", "DistributedDataParallelConfig"),),
      "DDP settings (0.7+; use mcore_compat.wrap_ddp on older releases)"),
    S("OptimizerConfig", (L(">=0.6", "megatron.core.optimizer.optimizer_config", "OptimizerConfig"),),
      "optimizer settings", needs="apex in 0.6-0.7 (or the apex_less patch)"),
    S("finalize_model_grads",
      (L(_ALL, "megatron.core.distributed.finalize_model_grads", "finalize_model_grads"),),
      "the grad finalisation hook (DP reduce, layernorm/embedding all-reduce)"),
    S("get_forward_backward_func",
      (L(_ALL, "megatron.core.pipeline_parallel.schedules", "get_forward_backward_func"),),
      "forward/backward schedule selector"),
    S("get_model_config", (L(_ALL, "megatron.core.utils", "get_model_config"),), "the config a model uses"),
    S("get_attr_wrapped_model", (L(_ALL, "megatron.core.utils", "get_attr_wrapped_model"),),
      "attribute lookup through wrappers"),
    S("ModelParallelConfig", (L(_ALL, "megatron.core.model_parallel_config", "ModelParallelConfig"),),
      "parallelism settings"),
    S("TransformerConfig", (L(_ALL, "megatron.core.transformer.transformer_config", "TransformerConfig"),),
      "transformer settings"),
    S("MegatronModule", (L(_ALL, "megatron.core.transformer.module", "MegatronModule"),), "base module"),
    S("Float16Module", (L(_ALL, "megatron.core.transformer.module", "Float16Module"),),
      "bf16/fp16 wrapper"),
    S("GPTModel", (L(_ALL, "megatron.core.models.gpt.gpt_model", "GPTModel"),), "GPT model",
      needs="transformer_engine in 0.4-0.7 (or the te_stub patch)"),
    S("get_gpt_layer_local_spec",
      (L(_ALL, "megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec"),),
      "the GPT layer spec without TransformerEngine",
      needs="transformer_engine in 0.4-0.7 (or the te_stub patch)"),
    S("dist_checkpointing", (L(_ALL, "megatron.core.dist_checkpointing"),), "distributed checkpointing"),
    S("Timers", (L(">=0.5", "megatron.core.timers", "Timers"),), "timers (0.5+)"),
    S("unwrap_model", (L(">=0.8", "megatron.core.utils", "unwrap_model"),),
      "strip DDP/Float16Module wrappers (see mcore_compat.unwrap for every release)"),
    S("model_parallel_cuda_manual_seed",
      (L(_ALL, "megatron.core.tensor_parallel.random", "model_parallel_cuda_manual_seed"),),
      "seed the tensor-parallel RNG tracker"),
    S("ColumnParallelLinear", (L(_ALL, "megatron.core.tensor_parallel.layers", "ColumnParallelLinear"),),
      "column-parallel linear layer"),
    S("RowParallelLinear", (L(_ALL, "megatron.core.tensor_parallel.layers", "RowParallelLinear"),),
      "row-parallel linear layer"),
    S("get_megatron_optimizer_raw", (L(">=0.6", "megatron.core.optimizer", "get_megatron_optimizer"),),
      "Megatron's own get_megatron_optimizer (signature drifts; prefer mcore_compat.get_megatron_optimizer)",
      needs="apex in 0.6-0.7 (or the apex_less patch)"),
    S("MegatronOptimizer", (L(">=0.6", "megatron.core.optimizer.optimizer", "MegatronOptimizer"),),
      "optimizer base class", needs="apex in 0.6-0.7 (or the apex_less patch)"),
    S("DistributedOptimizer", (L(">=0.6", "megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer"),),
      "the distributed optimizer", needs="apex in 0.6-0.7 (or the apex_less patch)"),
    S("ParamAndGradBuffer",
      (L(">=0.6,<0.9", "megatron.core.distributed.param_and_grad_buffer", "ParamAndGradBuffer"),
       L(">=0.9", "megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBuffer")),
      "DDP's flat parameter/gradient buffer (GradBuffer before 0.6)"),
    S("GradBuffer", (L(">=0.4,<0.6", "megatron.core.distributed.grad_buffer", "GradBuffer"),),
      "DDP's flat gradient buffer (0.4-0.5)"),
    S("ProcessGroupCollection",
      (L(">=0.15", "megatron.core.process_groups_config", "ProcessGroupCollection"),),
      "process groups passed explicitly (0.15+)"),
    S("package_info", (L(_ALL, "megatron.core.package_info"),), "Megatron-Core's version constants"),
)

SYMBOLS: dict[str, S] = {row.name: row for row in _ROWS}
