"""Data: which config fields can be ignored where a release lacks them (hand-written, next to the generated
``fields.py``).

A field passed to :func:`mcore_compat.transformer_config` (or ``ddp_config``/``optimizer_config``, and the
``DDPConfig``/``OptimConfig`` adapters) that the installed release does not have is

* dropped silently when its value is the field's default (the release behaves as if it were not set);
* dropped with a one-time warning (rank 0) when it is listed here: ignoring it cannot change results -- a fused
  or alternative kernel for the same computation (rounding may differ), communication overlap, memory saving
  (offloading, recomputation), CUDA graphs, logging and checks;
* refused with :class:`~mcore_compat.errors.UnsupportedVersionError` otherwise: everything not listed here is
  taken to change the model or the training (architecture, numerics, parallel layout, optimizer rule).

``HARMLESS_IF_MISSING[cls][field]`` says why. Only fields that some release lacks matter, but a field may be listed
whatever its range; ``tests/test_config_fields.py`` checks that every entry names a field of that class in the
generated data.
"""

from __future__ import annotations

__all__ = ["HARMLESS_IF_MISSING", "harmless_if_missing"]

_FUSION = "a fused kernel for the same computation (rounding may differ)"
_OVERLAP = "overlaps communication with computation: speed only"
_MEMORY = "saves memory (offloading, recomputation, chunking): speed and memory only"
_GRAPH = "CUDA graphs: speed only"
_LOG = "logging or a check: does not change the computation"

#: Per config class: the fields whose absence cannot change results, and why.
HARMLESS_IF_MISSING: dict[str, dict[str, str]] = {
    "TransformerConfig": {
        # fused kernels
        "bias_activation_fusion": _FUSION,
        "bias_gelu_fusion": _FUSION,
        "bias_dropout_fusion": _FUSION,
        "masked_softmax_fusion": _FUSION,
        "apply_rope_fusion": _FUSION,
        "persist_layer_norm": _FUSION,
        "memory_efficient_layer_norm": _FUSION,
        "gradient_accumulation_fusion": _FUSION,
        "cross_entropy_loss_fusion": _FUSION,
        "cross_entropy_fusion_impl": _FUSION,
        "use_fused_weighted_squared_relu": _FUSION,
        "fused_single_qkv_rope": _FUSION,
        "fused_residual_rmsnorm": _FUSION,
        "moe_permute_fusion": _FUSION,
        "moe_router_fusion": _FUSION,
        "flash_decode": "an inference decoding kernel: speed only",
        # communication overlap
        "tp_comm_overlap": _OVERLAP,
        "tp_comm_overlap_ag": _OVERLAP,
        "tp_comm_overlap_rs": _OVERLAP,
        "tp_comm_overlap_rs_dgrad": _OVERLAP,
        "tp_comm_atomic_ag": _OVERLAP,
        "tp_comm_atomic_rs": _OVERLAP,
        "tp_comm_overlap_disable_qkv": _OVERLAP,
        "tp_comm_overlap_disable_fc1": _OVERLAP,
        "tp_comm_bootstrap_backend": _OVERLAP,
        "overlap_p2p_comm_warmup_flush": _OVERLAP,
        "defer_embedding_wgrad_compute": _OVERLAP,
        "wgrad_deferral_limit": _OVERLAP,
        "delay_wgrad_compute": _OVERLAP,
        "overlap_moe_expert_parallel_comm": _OVERLAP,
        "moe_shared_expert_overlap": _OVERLAP,
        "async_tensor_model_parallel_allreduce": _OVERLAP + " (0.16 documents it as ignored)",
        # memory
        "cpu_offloading": _MEMORY,
        "cpu_offloading_num_layers": _MEMORY,
        "cpu_offloading_activations": _MEMORY,
        "cpu_offloading_weights": _MEMORY,
        "cpu_offloading_double_buffering": _MEMORY,
        "cpu_offloading_retain_pinned_cpu_buffers": _MEMORY,
        "fine_grained_activation_offloading": _MEMORY,
        "offload_modules": _MEMORY,
        "min_offloaded_tensor_size": _MEMORY,
        "recompute_modules": _MEMORY,
        "moe_layer_recompute": _MEMORY,
        "mlp_chunks_for_training": _MEMORY,
        "disable_parameter_transpose_cache": _MEMORY,
        # CUDA graphs
        "enable_cuda_graph": _GRAPH,
        "cuda_graph_use_single_mempool": _GRAPH,
        "cuda_graph_retain_backward_graph": _GRAPH,
        "cuda_graph_warmup_steps": _GRAPH,
        "external_cuda_graph": _GRAPH,
        "cuda_graph_impl": _GRAPH,
        "cuda_graph_scope": _GRAPH,
        # logging
        "config_logger_dir": _LOG,
        "moe_per_layer_logging": _LOG,
        "log_max_attention_logit": _LOG,
    },
    "DistributedDataParallelConfig": {
        "check_for_nan_in_grad": _LOG,
        "check_for_large_grads": _LOG,
        "average_in_collective": "averages inside the collective instead of pre-dividing: the same value up to "
                                 "rounding",
        "overlap_param_gather": _OVERLAP,
        "align_param_gather": _OVERLAP,
        "num_buckets": "how gradients are bucketed for communication: speed only",
        "pad_buckets_for_high_nccl_busbw": "pads buckets for NCCL bandwidth: speed only",
        "nccl_ub": "NCCL user buffers: speed only",
        "disable_symmetric_registration": "NCCL symmetric memory registration: speed only",
        "delay_wgrad_compute": _OVERLAP,
    },
    "OptimizerConfig": {
        # DistributedDataParallelConfig's from 0.7 (optimizer_config.py kept copies until 0.9)
        "overlap_grad_reduce": _OVERLAP,
        "overlap_param_gather": _OVERLAP,
        "overlap_param_gather_with_optimizer_step": _OVERLAP,
        "log_num_zeros_in_grad": _LOG,
        "barrier_with_L1_time": "a barrier for timing: speed only",
        "config_logger_dir": _LOG,
        "optimizer_cuda_graph": _GRAPH,
        "optimizer_cpu_offload": _MEMORY,
        "optimizer_offload_fraction": _MEMORY,
        "overlap_cpu_optimizer_d2h_h2d": _MEMORY,
        "pin_cpu_grads": _MEMORY,
        "pin_cpu_params": _MEMORY,
        # not listed, so refused: decoupled_weight_decay (before 0.15 Adam is always AdamW, decoupled; Adam with
        # L2 weight decay cannot be expressed there)
    },
}


def harmless_if_missing(cls: str, field: str) -> bool:
    """Whether ignoring ``cls.field`` where a release lacks it cannot change results (see the module docstring)."""
    return field in HARMLESS_IF_MISSING.get(cls, {})
