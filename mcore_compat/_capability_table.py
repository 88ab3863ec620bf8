"""Data: named facts about Megatron-Core and the releases they hold for.

Every range was checked against all 23 releases of the support matrix (0.4.0 ... 0.19.2, including the patch
releases of a minor) by evaluating the row's probe in each unpacked wheel; ``tests/test_surface_real.py``
re-checks each row against the installed release in every matrix session. Ranges are open upwards where the
fact still holds in the newest release, so newer releases inherit it until a probe says otherwise.

Probes read the source with ``ast`` wherever importing the module needs apex or TransformerEngine on some
release (anything under ``megatron.core.optimizer``, the GPT layer specs) and use ``inspect.signature`` for
signatures of modules that import on every release (DDP, ``finalize_model_grads``, the schedules).
"""

from __future__ import annotations

from ._probes import (
    all_of,
    any_of,
    asserts_name,
    assigns_constant,
    assigns_self_attr,
    calls_with_constant,
    def_has_param,
    defines,
    module_exists,
    module_level_call,
    negate,
    param_in_signature,
    reads_self_attr,
    top_level_import,
)
from .capabilities import Capability as C

__all__ = ["CAPABILITIES"]

# Modules the probes look at.
_DIST = "megatron.core.distributed"
_DDP = "megatron.core.distributed.distributed_data_parallel"
_DDPC = "megatron.core.distributed.distributed_data_parallel_config"
_BUF = "megatron.core.distributed.param_and_grad_buffer"
_FIN = "megatron.core.distributed.finalize_model_grads"
_OPT = "megatron.core.optimizer"
_OPTIM = "megatron.core.optimizer.optimizer"
_OCFG = "megatron.core.optimizer.optimizer_config"
_DOPT = "megatron.core.optimizer.distrib_optimizer"
_LAYOUT = "megatron.core.optimizer.param_layout"
_SCHED = "megatron.core.pipeline_parallel.schedules"
_PS = "megatron.core.parallel_state"
_PGC = "megatron.core.process_groups_config"
_TCFG = "megatron.core.transformer.transformer_config"
_GPT_SPECS = "megatron.core.models.gpt.gpt_layer_specs"
_TE_LAYERS = "megatron.core.transformer.custom_layers.transformer_engine"
_GPT = "megatron.core.models.gpt.gpt_model"

_DDP_INIT = "DistributedDataParallel.__init__"
_DOPT_INIT = "DistributedOptimizer.__init__"
_NO_PIPE = "forward_backward_no_pipelining"


_ROWS_PACKAGE: tuple[C, ...] = (
    C("core_optimizer", ">=0.6",
      "the megatron.core.optimizer package exists (0.4/0.5 have no optimizer in the pip package)",
      module_exists(_OPT)),
    C("timers", ">=0.5", "megatron.core.timers.Timers exists", module_exists("megatron.core.timers")),
    C("version_attr", ">=0.8", "megatron.core.__version__ is exported (else read megatron.core.package_info)",
      defines("megatron.core", "__version__")),
    C("megatron_training_in_wheel", ">=0.17", "the wheel ships megatron.training next to megatron.core",
      module_exists("megatron.training")),
    C("apex_hard_import", ">=0.6,<0.8",
      "importing megatron.core.optimizer imports apex unconditionally (needs apex or the apex_less patch)",
      top_level_import(_OPT, "apex")),
    C("core_import_needs_pkg_resources", ">=0.7,<0.9",
      "import megatron.core imports pkg_resources (tensor_parallel/random.py): needs setuptools<81",
      top_level_import("megatron.core.tensor_parallel.random", "pkg_resources")),
    C("core_import_builds_cuda_ext", ">=0.15,<0.16",
      "import megatron.core JIT-builds a CUDA extension (inference/unified_memory.py); on a CPU-only box "
      "TORCH_CUDA_ARCH_LIST must be set",
      module_level_call("megatron.core.inference.unified_memory", "load_inline")),
    C("gpt_needs_te", "<0.8",
      "the GPT layer specs (and so GPTModel) import transformer_engine unconditionally",
      all_of(top_level_import(_GPT_SPECS, _TE_LAYERS), top_level_import(_TE_LAYERS, "transformer_engine"))),
)

_ROWS_DDP: tuple[C, ...] = (
    C("grad_buffer_legacy", "<0.6", "DDP keeps grads in GradBuffer (distributed/grad_buffer.py, attr grad_buffers)",
      module_exists("megatron.core.distributed.grad_buffer")),
    C("param_and_grad_buffer", ">=0.6",
      "DDP keeps params/grads in ParamAndGradBuffer (attrs buffers, expert_parallel_buffers)",
      module_exists(_BUF)),
    C("param_buffer_public_name", ">=0.6,<0.10",
      "megatron.core.distributed exports the public name ParamAndGradBuffer (deprecated alias in 0.9)",
      all_of(defines(_BUF, "ParamAndGradBuffer"), defines(_DIST, "ParamAndGradBuffer"))),
    C("param_buffer_private_name", ">=0.9", "the buffer class is _ParamAndGradBuffer",
      defines(_BUF, "_ParamAndGradBuffer")),
    C("model_chunks_bucket_groups", ">=0.9",
      "buckets are grouped in _ParamAndGradBucketGroup (DDP attrs bucket_groups, expert_parallel_bucket_groups)",
      defines(_BUF, "_ParamAndGradBucketGroup")),
    C("distributed_param_gather_in_ddp", ">=0.9",
      "the param all-gather after the step is DDP's (start_param_sync), not the optimizer's",
      defines(_DDP, "DistributedDataParallel.start_param_sync")),
    C("ddp_base_data_parallel", ">=0.10", "DDP derives from _BaseDataParallel (distributed/data_parallel_base.py)",
      module_exists("megatron.core.distributed.data_parallel_base")),
    C("ddp_flat_kwargs", "<0.7",
      "DDP(config, module, data_parallel_group, accumulate_allreduce_grads_in_fp32, overlap_grad_reduce, "
      "use_distributed_optimizer, ...): settings are constructor arguments",
      param_in_signature(_DDP, _DDP_INIT, "accumulate_allreduce_grads_in_fp32")),
    C("ddp_config", ">=0.7", "DDP takes a DistributedDataParallelConfig (ddp_config)",
      param_in_signature(_DDP, _DDP_INIT, "ddp_config")),
    C("ddp_explicit_dp_group", "<0.8", "the DDP constructor takes data_parallel_group",
      param_in_signature(_DDP, _DDP_INIT, "data_parallel_group")),
    C("ddp_expert_dp_group_arg", ">=0.6,<0.8", "the DDP constructor takes expert_data_parallel_group",
      param_in_signature(_DDP, _DDP_INIT, "expert_data_parallel_group")),
    C("ddp_comm_pgs", ">=0.13,<0.15", "the DDP constructor takes grad_comm_pgs / model_comm_pgs",
      param_in_signature(_DDP, _DDP_INIT, "grad_comm_pgs")),
    C("ddp_pg_collection", ">=0.15", "the DDP constructor takes pg_collection",
      param_in_signature(_DDP, _DDP_INIT, "pg_collection")),
    C("ddp_full_param_layout", ">=0.18", "the DDP constructor takes full_param_layout",
      param_in_signature(_DDP, _DDP_INIT, "full_param_layout")),
    C("zero_grad_buffer_arg", "<0.6", "DDP.zero_grad_buffer(zero_buffer) takes an argument",
      param_in_signature(_DDP, "DistributedDataParallel.zero_grad_buffer", "zero_buffer")),
    C("finish_grad_sync_force_all_reduce", ">=0.16", "DDP.finish_grad_sync takes force_all_reduce",
      param_in_signature(_DDP, "DistributedDataParallel.finish_grad_sync", "force_all_reduce")),
    C("ddp_scale_gradients", ">=0.7", "DDP.scale_gradients exists (used for per-token loss scaling)",
      defines(_DDP, "DistributedDataParallel.scale_gradients")),
    C("ddp_broadcast_params_broken", ">=0.6,<0.8",
      "DDP.broadcast_params reads self.data_parallel_group, which the constructor never sets (AttributeError)",
      all_of(reads_self_attr(_DDP, "DistributedDataParallel.broadcast_params", "data_parallel_group"),
             negate(assigns_self_attr(_DDP, "DistributedDataParallel", "data_parallel_group")))),
    C("ddp_average_in_collective", ">=0.8", "DistributedDataParallelConfig.average_in_collective exists",
      defines(_DDPC, "DistributedDataParallelConfig.average_in_collective")),
    C("ddp_overlap_param_gather", ">=0.9", "DistributedDataParallelConfig.overlap_param_gather exists",
      defines(_DDPC, "DistributedDataParallelConfig.overlap_param_gather")),
    C("ddp_num_distributed_optimizer_instances", ">=0.10",
      "DistributedDataParallelConfig.num_distributed_optimizer_instances exists (partial DP groups)",
      defines(_DDPC, "DistributedDataParallelConfig.num_distributed_optimizer_instances")),
    C("pad_buckets_high_nccl_busbw", ">=0.12",
      "DistributedDataParallelConfig.pad_buckets_for_high_nccl_busbw exists (bucket end lcm(dp,128,2**16))",
      defines(_DDPC, "DistributedDataParallelConfig.pad_buckets_for_high_nccl_busbw")),
    C("bucket_pad_lcm_128", ">=0.7",
      "with the distributed optimizer, bucket ends are padded to lcm(dp, 128) (before: to a multiple of dp)",
      calls_with_constant((_BUF, _LAYOUT), ("lcm",), 128)),
    C("param_start_padding_64", ">=0.8",
      "with the distributed optimizer, every param starts at a multiple of 64 elements",
      calls_with_constant((_BUF, _LAYOUT), ("_pad", "pad_to_divisor"), 64)),
    C("buffer_params_with_names", ">=0.17", "_ParamAndGradBuffer takes params_with_names instead of params",
      def_has_param(_BUF, "_ParamAndGradBuffer.__init__", "params_with_names")),
    C("buffer_nvfp4_unpacked_index_map", ">=0.17.1,<0.18",
      "0.17.1 only: for NVFP4 params param_index_map holds packed (numel/2) offsets and "
      "_ParamAndGradBuffer.get_unpacked_index_map() the full-numel ones (absent in 0.17.0 and in 0.18+)",
      defines(_BUF, "_ParamAndGradBuffer.get_unpacked_index_map")),
    C("buffer_nvfp4_packed_index_map", ">=0.18",
      "for NVFP4 params param_index_map holds full-numel offsets and the buffer's "
      "nvfp4_packed_param_index_map the packed ones",
      assigns_self_attr(_BUF, "_ParamAndGradBuffer", "nvfp4_packed_param_index_map")),
    C("ddp_fp4_param_gather", ">=0.17.1",
      "DistributedDataParallelConfig.fp4_param_gather exists (new in the 0.17.1 patch release)",
      defines(_DDPC, "DistributedDataParallelConfig.fp4_param_gather")),
    C("optimizer_computes_layout", ">=0.18",
      "the buffer layout is computed outside the buffer (DistributedOptimizer.compute_full_param_layout, "
      "optimizer/param_layout.py)",
      defines(_DOPT, "DistributedOptimizer.compute_full_param_layout")),
)

_ROWS_FINALIZE: tuple[C, ...] = (
    C("finalize_expert_grads_allreduce", "<0.6",
      "finalize_model_grads all-reduces expert grads itself (experts are not in DDP buffers)",
      defines(_FIN, "_allreduce_expert_grads")),
    C("finalize_num_tokens", ">=0.7", "finalize_model_grads(model, num_tokens=None)",
      param_in_signature(_FIN, "finalize_model_grads", "num_tokens")),
    C("finalize_grad_finalize_pgs", ">=0.14,<0.15", "finalize_model_grads takes grad_finalize_pgs",
      param_in_signature(_FIN, "finalize_model_grads", "grad_finalize_pgs")),
    C("finalize_pg_collection", ">=0.15", "finalize_model_grads takes pg_collection",
      param_in_signature(_FIN, "finalize_model_grads", "pg_collection")),
    C("finalize_force_all_reduce", ">=0.16",
      "finalize_model_grads takes force_all_reduce (and the schedules pass it as a keyword)",
      param_in_signature(_FIN, "finalize_model_grads", "force_all_reduce")),
    C("calculate_per_token_loss", ">=0.7",
      "TransformerConfig.calculate_per_token_loss exists (loss_func may return (loss, num_tokens, dict))",
      defines(_TCFG, "TransformerConfig.calculate_per_token_loss")),
)

_ROWS_PG: tuple[C, ...] = (
    C("comm_pgs_classes", ">=0.12,<0.15",
      "process_groups_config defines ModelCommProcessGroups / GradCommProcessGroups",
      defines(_PGC, "GradCommProcessGroups")),
    C("pg_collection", ">=0.15", "process_groups_config.ProcessGroupCollection exists",
      defines(_PGC, "ProcessGroupCollection")),
    C("ps_distributed_timeout_minutes", ">=0.6", "initialize_model_parallel takes distributed_timeout_minutes",
      def_has_param(_PS, "initialize_model_parallel", "distributed_timeout_minutes")),
    C("ps_order", ">=0.7", "initialize_model_parallel takes order",
      def_has_param(_PS, "initialize_model_parallel", "order")),
    C("ps_pipeline_split_rank", "<0.14", "initialize_model_parallel takes pipeline_model_parallel_split_rank",
      def_has_param(_PS, "initialize_model_parallel", "pipeline_model_parallel_split_rank")),
    C("ps_num_distributed_optimizer_instances", ">=0.10",
      "initialize_model_parallel takes num_distributed_optimizer_instances",
      def_has_param(_PS, "initialize_model_parallel", "num_distributed_optimizer_instances")),
    C("ps_create_gloo_process_groups", ">=0.12", "initialize_model_parallel takes create_gloo_process_groups",
      def_has_param(_PS, "initialize_model_parallel", "create_gloo_process_groups")),
    C("ps_gtp_remat", ">=0.19",
      "initialize_model_parallel takes gtp_remat_size before num_distributed_optimizer_instances (pass "
      "everything by keyword)",
      def_has_param(_PS, "initialize_model_parallel", "gtp_remat_size")),
    C("ps_dp_group_partial", ">=0.10", "get_data_parallel_group takes partial_data_parallel",
      def_has_param(_PS, "get_data_parallel_group", "partial_data_parallel")),
    C("ps_data_modulo_expert_group", "<0.17", "parallel_state.get_data_modulo_expert_parallel_group exists",
      defines(_PS, "get_data_modulo_expert_parallel_group")),
    C("ps_expert_data_parallel_group", ">=0.10", "parallel_state.get_expert_data_parallel_group exists",
      defines(_PS, "get_expert_data_parallel_group")),
    C("ps_intra_distopt_instance_group", ">=0.13",
      "parallel_state.get_intra_distributed_optimizer_instance_group exists",
      defines(_PS, "get_intra_distributed_optimizer_instance_group")),
)

_ROWS_OPTIMIZER: tuple[C, ...] = (
    C("distopt_requires_apex_or_te", ">=0.8,<0.10",
      "DistributedOptimizer asserts apex or TransformerEngine is installed",
      asserts_name(_DOPT, _DOPT_INIT, "HAVE_APEX_OR_TE")),
    C("get_megatron_optimizer_legacy_conds", ">=0.6,<0.16",
      "get_megatron_optimizer takes no_weight_decay_cond / scale_lr_cond / lr_mult",
      def_has_param(_OPT, "get_megatron_optimizer", "no_weight_decay_cond")),
    C("get_megatron_optimizer_config_overrides", ">=0.16",
      "get_megatron_optimizer takes config_overrides (ParamKey -> ParamGroupOverride)",
      def_has_param(_OPT, "get_megatron_optimizer", "config_overrides")),
    C("use_gloo_process_groups", ">=0.12", "get_megatron_optimizer takes use_gloo_process_groups",
      def_has_param(_OPT, "get_megatron_optimizer", "use_gloo_process_groups")),
    C("get_megatron_optimizer_comm_pgs", ">=0.14,<0.15",
      "get_megatron_optimizer takes grad_comm_pgs / model_comm_pgs",
      def_has_param(_OPT, "get_megatron_optimizer", "grad_comm_pgs")),
    C("get_megatron_optimizer_pg_collection", ">=0.15", "get_megatron_optimizer takes pg_collection",
      def_has_param(_OPT, "get_megatron_optimizer", "pg_collection")),
    C("default_skip_embedding_weight_decay", ">=0.14,<0.16",
      "get_megatron_optimizer takes default_skip_embedding_weight_decay",
      def_has_param(_OPT, "get_megatron_optimizer", "default_skip_embedding_weight_decay")),
    C("private_builder_model_chunks", ">=0.9",
      "_get_megatron_optimizer_based_on_param_groups takes model_chunks (2nd positional)",
      def_has_param(_OPT, "_get_megatron_optimizer_based_on_param_groups", "model_chunks")),
    C("distopt_model_chunks", ">=0.9", "DistributedOptimizer.__init__ takes model_chunks",
      def_has_param(_DOPT, _DOPT_INIT, "model_chunks")),
    C("distopt_instance_id", ">=0.10", "DistributedOptimizer.__init__ takes distributed_optimizer_instance_id",
      def_has_param(_DOPT, _DOPT_INIT, "distributed_optimizer_instance_id")),
    C("optimizer_config_overlap_flags", ">=0.6,<0.10",
      "OptimizerConfig has overlap_grad_reduce (later only in DistributedDataParallelConfig)",
      defines(_OCFG, "OptimizerConfig.overlap_grad_reduce")),
    C("optimizer_prepare_grads", ">=0.8",
      "MegatronOptimizer.step() = prepare_grads() + step_with_ready_grads()",
      defines(_OPTIM, "MegatronOptimizer.prepare_grads")),
    C("optimizer_finish_param_sync", ">=0.6,<0.9",
      "MegatronOptimizer.finish_param_sync exists (the optimizer all-gathers params)",
      defines(_OPTIM, "MegatronOptimizer.finish_param_sync")),
    C("optimizer_grad_stats_group", ">=0.10",
      "MegatronOptimizer.get_grad_stats_parallel_group (was get_model_parallel_group)",
      defines(_OPTIM, "MegatronOptimizer.get_grad_stats_parallel_group")),
    C("grads_for_grad_norm_renamed", ">=0.19",
      "MegatronOptimizer.get_grads_for_grad_norm (was get_main_grads_for_grad_norm)",
      defines(_OPTIM, "MegatronOptimizer.get_grads_for_grad_norm")),
    C("fp32_optimizer_instantiable", ">=0.7",
      "FP32Optimizer implements sharded_state_dict (0.6.0: abstract, the class cannot be instantiated)",
      defines(_OPTIM, "FP32Optimizer.sharded_state_dict")),
    C("fp32_optimizer_main_grad_optional", ">=0.10",
      "FP32Optimizer copies param.main_grad to .grad only if it exists (before: AttributeError without it)",
      calls_with_constant((_OPTIM,), ("hasattr",), "main_grad", within="FP32Optimizer")),
    C("grad_norm_zero_when_unclipped", ">=0.11",
      "mixed-precision step() returns grad_norm 0.0 (not None) when clip_grad is 0",
      assigns_constant(_OPTIM, "MixedPrecisionOptimizer.step", "grad_norm", 0.0)),
)

_ROWS_SCHEDULES: tuple[C, ...] = (
    C("get_forward_backward_func_takes_pp_size", ">=0.16", "get_forward_backward_func(pp_size, vp_size)",
      param_in_signature(_SCHED, "get_forward_backward_func", "pp_size")),
    C("schedule_pg_collection_selector", ">=0.19", "get_forward_backward_func takes schedule_pg_collection",
      param_in_signature(_SCHED, "get_forward_backward_func", "schedule_pg_collection")),
    C("schedule_first_val_step", ">=0.5", "the forward/backward functions take first_val_step",
      param_in_signature(_SCHED, _NO_PIPE, "first_val_step")),
    C("schedule_adjust_tensor_shapes_fn", ">=0.13", "the forward/backward functions take adjust_tensor_shapes_fn",
      param_in_signature(_SCHED, _NO_PIPE, "adjust_tensor_shapes_fn")),
    C("schedule_grad_finalize_pgs", ">=0.14,<0.15", "the forward/backward functions take grad_finalize_pgs",
      param_in_signature(_SCHED, _NO_PIPE, "grad_finalize_pgs")),
    C("schedule_pg_collection", ">=0.15", "the forward/backward functions take pg_collection",
      param_in_signature(_SCHED, _NO_PIPE, "pg_collection")),
)

_ROWS_MODELS: tuple[C, ...] = (
    C("interleaved_needs_pp_over_2", "<0.8",
      "initialize_model_parallel refuses virtual pipeline stages unless the pipeline size is > 2 "
      "(parallel_state.py; > 1 from 0.8)",
      calls_with_constant((_PS,), ("RuntimeError",),
                          "pipeline-model-parallel size should be greater than 2 with interleaved schedule",
                          within="initialize_model_parallel")),
    C("gpt_vp_stage", ">=0.13",
      "GPTModel takes vp_stage (models/gpt/gpt_model.py; TransformerBlock derives its layers from it); before, "
      "the virtual stage is parallel_state's virtual rank while the chunk is built",
      def_has_param(_GPT, "GPTModel.__init__", "vp_stage")),
    C("chained_optimizer_global_clip", ">=0.8",
      "ChainedOptimizer (dense and expert params of a MoE model) clips every sub-optimizer by the global gradient "
      "norm (optimizer/optimizer.py ChainedOptimizer.prepare_grads/step_with_ready_grads, 0.8); 0.6/0.7 step "
      "each sub-optimizer with its own norm, so dense and expert params are clipped by different coefficients",
      defines(_OPTIM, "ChainedOptimizer.prepare_grads")),
    C("moe_local_spec", ">=0.5",
      "the local GPT layer spec builds MoE layers (get_gpt_layer_local_spec(num_experts=...), "
      "transformer/moe/; 0.4 has only the TransformerEngine SwitchMLP spec)",
      any_of(def_has_param(_GPT_SPECS, "get_gpt_layer_local_spec", "num_experts"),
             def_has_param(_GPT_SPECS, "get_gpt_layer_local_submodules", "num_experts"))),
)

CAPABILITIES: tuple[C, ...] = (
    _ROWS_PACKAGE + _ROWS_DDP + _ROWS_FINALIZE + _ROWS_PG + _ROWS_OPTIMIZER + _ROWS_SCHEDULES + _ROWS_MODELS
)
