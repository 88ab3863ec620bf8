"""Data: every version-dependent fact about Megatron-Core that mcore-compat reads, one row format.

Each fact is a :class:`~mcore_compat._facts.rows.Fact`: a name, rows ``(version range -> value)`` covering 0.4.0 and
everything newer, a description, and a probe that returns the value observed in the installed release. The
adapters (``mcore_compat.training``, ``selfcheck``, ``layout``, ``binding``) read these rows through
:func:`mcore_compat.capabilities.fact` and :func:`~mcore_compat.capabilities.has`; nothing else in the package
compares versions.
``tests/test_surface_real.py`` asserts ``probe() == value`` for every fact in every matrix session, so a wrong row
fails in the session of the release it is wrong for.

Boolean facts (capabilities) are written with :func:`~mcore_compat._facts.rows.flag` (the range where they hold);
valued facts list their rows. Every range boundary is a release of the support matrix (0.4.0 ... 0.19.2), and each
description names the Megatron file (and the release) where the value changes.

Probes read the source with ``ast`` wherever importing the module needs apex or TransformerEngine on some
release (anything under ``megatron.core.optimizer``, the GPT layer specs) and use ``inspect.signature`` only for
modules that import on every release (DDP).
"""

from __future__ import annotations

from typing import Any

from .layout_probes import bucket_size_none, min_params_per_sized_bucket, shared_embedding_split
from .probes import (
    Probe,
    all_of,
    any_of,
    asserts_name,
    assigns_constant,
    assigns_name,
    assigns_self_attr,
    calls_with_constant,
    class_fields,
    def_has_param,
    def_params,
    defines,
    first_of,
    module_exists,
    module_level_call,
    negate,
    param_in_signature,
    reads_attr,
    reads_self_attr,
    top_level_import,
    uses_string,
)
from .rows import Fact, Row
from .rows import flag as F

__all__ = ["DDP_SETTINGS", "FACTS", "LAYOUT_FACT_NAMES", "SCHEDULE_BASE_PARAMS"]

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
_OPS = "megatron.core.optimizer_param_scheduler"
_TCFG = "megatron.core.transformer.transformer_config"
_GPT_SPECS = "megatron.core.models.gpt.gpt_layer_specs"
_TE_LAYERS = "megatron.core.transformer.custom_layers.transformer_engine"
_GPT = "megatron.core.models.gpt.gpt_model"

_DDP_INIT = "DistributedDataParallel.__init__"
_DDP_BCAST = "DistributedDataParallel.broadcast_params"
_DOPT_INIT = "DistributedOptimizer.__init__"
_NO_PIPE = "forward_backward_no_pipelining"


_ROWS_PACKAGE: tuple[Fact[bool], ...] = (
    F("core_optimizer", ">=0.6",
      "the megatron.core.optimizer package exists (0.4/0.5 have no optimizer in the pip package)",
      module_exists(_OPT)),
    F("timers", ">=0.5", "megatron.core.timers.Timers exists", module_exists("megatron.core.timers")),
    F("version_attr", ">=0.8", "megatron.core.__version__ is exported (else read megatron.core.package_info)",
      defines("megatron.core", "__version__")),
    F("megatron_training_in_wheel", ">=0.17", "the wheel ships megatron.training next to megatron.core",
      module_exists("megatron.training")),
    F("apex_hard_import", ">=0.6,<0.8",
      "importing megatron.core.optimizer imports apex unconditionally (needs apex or the apex_less patch)",
      top_level_import(_OPT, "apex")),
    F("core_import_needs_pkg_resources", ">=0.7,<0.9",
      "import megatron.core imports pkg_resources (tensor_parallel/random.py): needs setuptools<81",
      top_level_import("megatron.core.tensor_parallel.random", "pkg_resources")),
    F("core_import_builds_cuda_ext", ">=0.15,<0.16",
      "import megatron.core JIT-builds a CUDA extension (inference/unified_memory.py); on a CPU-only box "
      "TORCH_CUDA_ARCH_LIST must be set",
      module_level_call("megatron.core.inference.unified_memory", "load_inline")),
    F("dist_ckpt_torch_dist", ">=0.6",
      "megatron.core.dist_checkpointing reads the torch_dist backend (dist_checkpointing/strategies/torch.py)",
      module_exists("megatron.core.dist_checkpointing.strategies.torch")),
    F("dist_ckpt_imports_psutil", ">=0.6,<0.13",
      "the torch_dist strategy imports psutil unconditionally (dist_checkpointing/strategies/filesystem_async.py; "
      "0.13+ import it inside try)",
      top_level_import("megatron.core.dist_checkpointing.strategies.filesystem_async", "psutil")),
    F("gpt_needs_te", "<0.8",
      "the GPT layer specs (and so GPTModel) import transformer_engine unconditionally",
      all_of(top_level_import(_GPT_SPECS, _TE_LAYERS), top_level_import(_TE_LAYERS, "transformer_engine"))),
)

_ROWS_DDP: tuple[Fact[bool], ...] = (
    F("param_buffer_public_name", ">=0.6,<0.10",
      "megatron.core.distributed exports the public name ParamAndGradBuffer (deprecated alias in 0.9)",
      all_of(defines(_BUF, "ParamAndGradBuffer"), defines(_DIST, "ParamAndGradBuffer"))),
    F("param_buffer_private_name", ">=0.9", "the buffer class is _ParamAndGradBuffer",
      defines(_BUF, "_ParamAndGradBuffer")),
    F("model_chunks_bucket_groups", ">=0.9",
      "buckets are grouped in _ParamAndGradBucketGroup (DDP attrs bucket_groups, expert_parallel_bucket_groups)",
      defines(_BUF, "_ParamAndGradBucketGroup")),
    F("ddp_base_data_parallel", ">=0.10", "DDP derives from _BaseDataParallel (distributed/data_parallel_base.py)",
      module_exists("megatron.core.distributed.data_parallel_base")),
    F("ddp_full_param_layout", ">=0.18", "the DDP constructor takes full_param_layout",
      param_in_signature(_DDP, _DDP_INIT, "full_param_layout")),
    F("zero_grad_buffer_arg", "<0.6", "DDP.zero_grad_buffer(zero_buffer) takes an argument",
      param_in_signature(_DDP, "DistributedDataParallel.zero_grad_buffer", "zero_buffer")),
    F("finish_grad_sync_force_all_reduce", ">=0.16", "DDP.finish_grad_sync takes force_all_reduce",
      param_in_signature(_DDP, "DistributedDataParallel.finish_grad_sync", "force_all_reduce")),
    F("ddp_scale_gradients", ">=0.7", "DDP.scale_gradients exists (used for per-token loss scaling)",
      defines(_DDP, "DistributedDataParallel.scale_gradients")),
    F("ddp_broadcast_params_broken", ">=0.6,<0.8",
      "DDP.broadcast_params reads self.data_parallel_group, which the constructor never sets (AttributeError)",
      all_of(reads_self_attr(_DDP, _DDP_BCAST, "data_parallel_group"),
             negate(assigns_self_attr(_DDP, "DistributedDataParallel", "data_parallel_group")))),
    F("ddp_broadcast_params_single_group", "<0.6",
      "DDP.broadcast_params broadcasts every parameter, expert ones (allreduce=False) too, over parallel_state's "
      "data-parallel x context-parallel group: not over the data_parallel_group the constructor took, nor expert "
      "params over the data-modulo-expert group their grads are reduced over (0.6: a group per parameter)",
      all_of(reads_attr(_DDP, _DDP_BCAST, "parallel_state", "get_data_parallel_group"),
             negate(calls_with_constant((_DDP,), ("getattr",), "allreduce", within=_DDP_BCAST)))),
    F("buffer_params_with_names", ">=0.17", "_ParamAndGradBuffer takes params_with_names instead of params",
      def_has_param(_BUF, "_ParamAndGradBuffer.__init__", "params_with_names")),
    F("buffer_nvfp4_unpacked_index_map", ">=0.17.1,<0.18",
      "0.17.1 only: for NVFP4 params param_index_map holds packed (numel/2) offsets and "
      "_ParamAndGradBuffer.get_unpacked_index_map() the full-numel ones (absent in 0.17.0 and in 0.18+)",
      defines(_BUF, "_ParamAndGradBuffer.get_unpacked_index_map")),
    F("buffer_nvfp4_packed_index_map", ">=0.18",
      "for NVFP4 params param_index_map holds full-numel offsets and the buffer's "
      "nvfp4_packed_param_index_map the packed ones",
      assigns_self_attr(_BUF, "_ParamAndGradBuffer", "nvfp4_packed_param_index_map")),
    F("ddp_fp4_param_gather", ">=0.17.1",
      "DistributedDataParallelConfig.fp4_param_gather exists (new in the 0.17.1 patch release)",
      defines(_DDPC, "DistributedDataParallelConfig.fp4_param_gather")),
    F("optimizer_computes_layout", ">=0.18",
      "the buffer layout is computed outside the buffer (DistributedOptimizer.compute_full_param_layout, "
      "optimizer/param_layout.py)",
      defines(_DOPT, "DistributedOptimizer.compute_full_param_layout")),
)

_ROWS_FINALIZE: tuple[Fact[bool], ...] = (
    F("finalize_expert_grads_allreduce", "<0.6",
      "finalize_model_grads all-reduces expert grads itself (experts are not in DDP buffers)",
      defines(_FIN, "_allreduce_expert_grads")),
    F("calculate_per_token_loss", ">=0.7",
      "TransformerConfig.calculate_per_token_loss exists (loss_func may return (loss, num_tokens, dict))",
      defines(_TCFG, "TransformerConfig.calculate_per_token_loss")),
)

_ROWS_PG: tuple[Fact[bool], ...] = (
    F("comm_pgs_classes", ">=0.12,<0.15",
      "process_groups_config defines ModelCommProcessGroups / GradCommProcessGroups",
      defines(_PGC, "GradCommProcessGroups")),
    F("pg_collection", ">=0.15", "process_groups_config.ProcessGroupCollection exists",
      defines(_PGC, "ProcessGroupCollection")),
    F("ps_distributed_timeout_minutes", ">=0.6", "initialize_model_parallel takes distributed_timeout_minutes",
      def_has_param(_PS, "initialize_model_parallel", "distributed_timeout_minutes")),
    F("ps_order", ">=0.7", "initialize_model_parallel takes order",
      def_has_param(_PS, "initialize_model_parallel", "order")),
    F("ps_pipeline_split_rank", "<0.14", "initialize_model_parallel takes pipeline_model_parallel_split_rank",
      def_has_param(_PS, "initialize_model_parallel", "pipeline_model_parallel_split_rank")),
    F("ps_num_distributed_optimizer_instances", ">=0.10",
      "initialize_model_parallel takes num_distributed_optimizer_instances",
      def_has_param(_PS, "initialize_model_parallel", "num_distributed_optimizer_instances")),
    F("ps_create_gloo_process_groups", ">=0.12", "initialize_model_parallel takes create_gloo_process_groups",
      def_has_param(_PS, "initialize_model_parallel", "create_gloo_process_groups")),
    F("ps_gtp_remat", ">=0.19",
      "initialize_model_parallel takes gtp_remat_size before num_distributed_optimizer_instances (pass "
      "everything by keyword)",
      def_has_param(_PS, "initialize_model_parallel", "gtp_remat_size")),
    F("ps_dp_group_partial", ">=0.10", "get_data_parallel_group takes partial_data_parallel",
      def_has_param(_PS, "get_data_parallel_group", "partial_data_parallel")),
    F("ps_data_modulo_expert_group", "<0.17", "parallel_state.get_data_modulo_expert_parallel_group exists",
      defines(_PS, "get_data_modulo_expert_parallel_group")),
    F("ps_expert_data_parallel_group", ">=0.10", "parallel_state.get_expert_data_parallel_group exists",
      defines(_PS, "get_expert_data_parallel_group")),
    F("ps_intra_distopt_instance_group", ">=0.13",
      "parallel_state.get_intra_distributed_optimizer_instance_group exists",
      defines(_PS, "get_intra_distributed_optimizer_instance_group")),
)

_ROWS_OPTIMIZER: tuple[Fact[bool], ...] = (
    F("distopt_requires_apex_or_te", ">=0.8,<0.10",
      "DistributedOptimizer asserts apex or TransformerEngine is installed",
      asserts_name(_DOPT, _DOPT_INIT, "HAVE_APEX_OR_TE")),
    F("distopt_model_chunks", ">=0.9", "DistributedOptimizer.__init__ takes model_chunks",
      def_has_param(_DOPT, _DOPT_INIT, "model_chunks")),
    F("distopt_instance_id", ">=0.10", "DistributedOptimizer.__init__ takes distributed_optimizer_instance_id",
      def_has_param(_DOPT, _DOPT_INIT, "distributed_optimizer_instance_id")),
    F("optimizer_config_overlap_flags", ">=0.6,<0.10",
      "OptimizerConfig has overlap_grad_reduce (later only in DistributedDataParallelConfig)",
      defines(_OCFG, "OptimizerConfig.overlap_grad_reduce")),
    F("optimizer_prepare_grads", ">=0.8",
      "MegatronOptimizer.step() = prepare_grads() + step_with_ready_grads()",
      defines(_OPTIM, "MegatronOptimizer.prepare_grads")),
    F("optimizer_grad_stats_group", ">=0.10",
      "MegatronOptimizer.get_grad_stats_parallel_group (was get_model_parallel_group)",
      defines(_OPTIM, "MegatronOptimizer.get_grad_stats_parallel_group")),
    F("grads_for_grad_norm_renamed", ">=0.19",
      "MegatronOptimizer.get_grads_for_grad_norm (was get_main_grads_for_grad_norm)",
      defines(_OPTIM, "MegatronOptimizer.get_grads_for_grad_norm")),
    F("fp32_optimizer_instantiable", ">=0.7",
      "FP32Optimizer implements sharded_state_dict (0.6.0: abstract, the class cannot be instantiated)",
      defines(_OPTIM, "FP32Optimizer.sharded_state_dict")),
    F("fp32_optimizer_main_grad_optional", ">=0.10",
      "FP32Optimizer copies param.main_grad to .grad only if it exists (before: AttributeError without it)",
      calls_with_constant((_OPTIM,), ("hasattr",), "main_grad", within="FP32Optimizer")),
    F("grad_norm_zero_when_unclipped", ">=0.11",
      "mixed-precision step() returns grad_norm 0.0 (not None) when clip_grad is 0",
      assigns_constant(_OPTIM, "MixedPrecisionOptimizer.step", "grad_norm", 0.0)),
)

_ROWS_MODELS: tuple[Fact[bool], ...] = (
    F("interleaved_needs_pp_over_2", "<0.8",
      "initialize_model_parallel refuses virtual pipeline stages unless the pipeline size is > 2 "
      "(parallel_state.py; > 1 from 0.8)",
      calls_with_constant((_PS,), ("RuntimeError",),
                          "pipeline-model-parallel size should be greater than 2 with interleaved schedule",
                          within="initialize_model_parallel")),
    F("gpt_vp_stage", ">=0.13",
      "GPTModel takes vp_stage (models/gpt/gpt_model.py; TransformerBlock derives its layers from it); before, "
      "the virtual stage is parallel_state's virtual rank while the chunk is built",
      def_has_param(_GPT, "GPTModel.__init__", "vp_stage")),
    F("chained_optimizer_global_clip", ">=0.8",
      "ChainedOptimizer (dense and expert params of a MoE model) clips every sub-optimizer by the global gradient "
      "norm (optimizer/optimizer.py ChainedOptimizer.prepare_grads/step_with_ready_grads, 0.8); 0.6/0.7 step "
      "each sub-optimizer with its own norm, so dense and expert params are clipped by different coefficients",
      defines(_OPTIM, "ChainedOptimizer.prepare_grads")),
    F("moe_local_spec", ">=0.5",
      "the local GPT layer spec builds MoE layers (get_gpt_layer_local_spec(num_experts=...), "
      "transformer/moe/; 0.4 has only the TransformerEngine SwitchMLP spec)",
      any_of(def_has_param(_GPT_SPECS, "get_gpt_layer_local_spec", "num_experts"),
             def_has_param(_GPT_SPECS, "get_gpt_layer_local_submodules", "num_experts"))),
)

# --------------------------------------------------------------------------------------------------------------
# Valued facts the training adapters read (mcore_compat/training/)
# --------------------------------------------------------------------------------------------------------------

#: The DDP settings mcore_compat's ``DDPConfig`` knows, in the order they are passed on. Which of them a release
#: honours is the fact ``ddp_settings``.
DDP_SETTINGS: tuple[str, ...] = (
    "grad_reduce_in_fp32", "overlap_grad_reduce", "use_distributed_optimizer", "bucket_size",
    "check_for_nan_in_grad", "average_in_collective", "overlap_param_gather", "align_param_gather",
    "num_distributed_optimizer_instances",
)

#: Parameters every forward/backward schedule takes in every release (megatron/core/pipeline_parallel/
#: schedules.py); the fact ``schedule_extra_params`` lists the ones after them.
SCHEDULE_BASE_PARAMS: tuple[str, ...] = (
    "forward_step_func", "data_iterator", "model", "num_microbatches", "seq_length", "micro_batch_size",
    "decoder_seq_length", "forward_only", "collect_non_loss_data",
)

_SCHEDULES = (_NO_PIPE, "forward_backward_pipelining_without_interleaving",
              "forward_backward_pipelining_with_interleaving")
_CTOR_ARG_NAMES = {"accumulate_allreduce_grads_in_fp32": "grad_reduce_in_fp32"}  # DDP.__init__ of 0.4-0.6


def _ddp_settings() -> tuple[str, ...]:
    """The :data:`DDP_SETTINGS` the installed release takes: DistributedDataParallelConfig fields (0.7+), else
    keyword arguments of ``DistributedDataParallel.__init__``."""
    names = class_fields(_DDPC, "DistributedDataParallelConfig")()
    if names is None:
        names = tuple(_CTOR_ARG_NAMES.get(p, p) for p in def_params(_DDP, _DDP_INIT, drop=1)() or ())
    return tuple(n for n in DDP_SETTINGS if n in names)


def _schedule_extra_params() -> tuple[str, ...]:
    """Parameters after :data:`SCHEDULE_BASE_PARAMS` that all three schedules take (in the first one's order)."""
    per_schedule = [def_params(_SCHED, name)() or () for name in _SCHEDULES]
    return tuple(p for p in per_schedule[0]
                 if p not in SCHEDULE_BASE_PARAMS and all(p in other for other in per_schedule[1:]))


_HAS_DDP_CONFIG = param_in_signature(_DDP, _DDP_INIT, "ddp_config")

_VALUED_DDP: tuple[Fact[Any], ...] = (
    Fact("ddp_ctor", (
        Row(">=0.4,<0.6", "kwargs_v4"),
        Row(">=0.6,<0.7", "kwargs_v6"),
        Row(">=0.7,<0.8", "ddpcfg_group"),
        Row(">=0.8,<0.13", "ddpcfg"),
        Row(">=0.13,<0.15", "ddpcfg_pgs"),
        Row(">=0.15", "ddpcfg_pgc"),
    ), "how DistributedDataParallel.__init__ takes its settings and groups: "
       "kwargs_v4 = (config, module, data_parallel_group, accumulate_allreduce_grads_in_fp32, overlap_grad_reduce, "
       "use_distributed_optimizer, disable_bucketing, bucket_size); kwargs_v6 = + expert_data_parallel_group, "
       "check_for_nan_in_grad (0.6); ddpcfg_group = (config, ddp_config, module, data_parallel_group, "
       "expert_data_parallel_group, disable_bucketing) (0.7); ddpcfg = groups from parallel_state (0.8); "
       "ddpcfg_pgs = + grad_comm_pgs, model_comm_pgs (0.13); ddpcfg_pgc = + pg_collection (0.15)",
       first_of((("ddpcfg_pgc", param_in_signature(_DDP, _DDP_INIT, "pg_collection")),
                 ("ddpcfg_pgs", param_in_signature(_DDP, _DDP_INIT, "grad_comm_pgs")),
                 ("ddpcfg_group", all_of(_HAS_DDP_CONFIG, param_in_signature(_DDP, _DDP_INIT, "data_parallel_group"))),
                 ("ddpcfg", _HAS_DDP_CONFIG),
                 ("kwargs_v6", param_in_signature(_DDP, _DDP_INIT, "expert_data_parallel_group"))),
                default="kwargs_v4")),
    Fact("ddp_settings", (
        Row(">=0.4,<0.6", DDP_SETTINGS[:4]),
        Row(">=0.6,<0.8", DDP_SETTINGS[:5]),
        Row(">=0.8,<0.9", DDP_SETTINGS[:6]),
        Row(">=0.9,<0.10", DDP_SETTINGS[:8]),
        Row(">=0.10", DDP_SETTINGS),
    ), "the DDPConfig settings the release honours: DistributedDataParallel.__init__ keywords before 0.7 "
       "(check_for_nan_in_grad from 0.6), DistributedDataParallelConfig fields from 0.7 "
       "(distributed/distributed_data_parallel_config.py: average_in_collective 0.8, overlap_param_gather and "
       "align_param_gather 0.9, num_distributed_optimizer_instances 0.10)",
       Probe(_ddp_settings, (_DDPC, _DDP))),
    Fact("param_gather_owner", (
        Row(">=0.4,<0.6", "none"),
        Row(">=0.6,<0.9", "optimizer"),
        Row(">=0.9", "ddp"),
    ), "who all-gathers the distributed optimizer's params after the step and overlaps it with the next forward: "
       "none = no Megatron distributed optimizer (0.4/0.5; mcore_compat.legacy_optimizer gathers synchronously); "
       "optimizer = MegatronOptimizer.finish_param_sync and a forward pre-hook of the DistributedOptimizer "
       "(optimizer/optimizer.py, distrib_optimizer.py, 0.6-0.8); ddp = DistributedDataParallel.start_param_sync "
       "and per-module forward pre-hooks (distributed/distributed_data_parallel.py, 0.9+)",
       first_of((("ddp", defines(_DDP, "DistributedDataParallel.start_param_sync")),
                 ("optimizer", defines(_OPTIM, "MegatronOptimizer.finish_param_sync"))), default="none")),
)

_VALUED_STEP: tuple[Fact[Any], ...] = (
    Fact("finalize_params", (
        Row(">=0.4,<0.7", ()),
        Row(">=0.7,<0.14", ("num_tokens",)),
        Row(">=0.14,<0.15", ("num_tokens", "grad_finalize_pgs")),
        Row(">=0.15,<0.16", ("num_tokens", "pg_collection")),
        Row(">=0.16", ("num_tokens", "pg_collection", "force_all_reduce")),
    ), "parameters of finalize_model_grads after model (distributed/finalize_model_grads.py: num_tokens 0.7, "
       "grad_finalize_pgs 0.14 only, pg_collection 0.15, force_all_reduce 0.16)",
       def_params(_FIN, "finalize_model_grads", drop=1)),
    Fact("get_fwd_bwd_params", (
        Row(">=0.4,<0.16", ()),
        Row(">=0.16,<0.19", ("pp_size", "vp_size")),
        Row(">=0.19", ("pp_size", "vp_size", "schedule_pg_collection")),
    ), "parameters of get_forward_backward_func (pipeline_parallel/schedules.py: pp_size, vp_size 0.16; "
       "schedule_pg_collection 0.19)",
       def_params(_SCHED, "get_forward_backward_func")),
    Fact("schedule_extra_params", (
        Row(">=0.4,<0.5", ()),
        Row(">=0.5,<0.13", ("first_val_step",)),
        Row(">=0.13,<0.14", ("first_val_step", "adjust_tensor_shapes_fn")),
        Row(">=0.14,<0.15", ("first_val_step", "adjust_tensor_shapes_fn", "grad_finalize_pgs")),
        Row(">=0.15,<0.16", ("first_val_step", "adjust_tensor_shapes_fn", "pg_collection")),
        Row(">=0.16", ("first_val_step", "adjust_tensor_shapes_fn", "p2p_communicator", "pg_collection",
                       "force_all_reduce")),
    ), "keyword arguments all three forward/backward schedules take beyond the nine every release has "
       "(pipeline_parallel/schedules.py: first_val_step 0.5, adjust_tensor_shapes_fn 0.13, grad_finalize_pgs 0.14 "
       "only, pg_collection 0.15, p2p_communicator and force_all_reduce 0.16)",
       Probe(_schedule_extra_params, (_SCHED,))),
    F("interleaved_reads_config_vpp", ">=0.13",
      "the interleaved schedule reads the number of virtual stages from config.virtual_pipeline_model_parallel_size "
      "(pipeline_parallel/schedules.py, 0.13); before, from parallel_state only",
      reads_attr(_SCHED, "forward_backward_pipelining_with_interleaving", "config",
                 "virtual_pipeline_model_parallel_size")),
)

_VALUED_OPTIMIZER: tuple[Fact[Any], ...] = (
    Fact("public_builder_params", (
        Row(">=0.4,<0.6", None),
        Row(">=0.6,<0.12", ("no_weight_decay_cond", "scale_lr_cond", "lr_mult")),
        Row(">=0.12,<0.14", ("no_weight_decay_cond", "scale_lr_cond", "lr_mult", "use_gloo_process_groups")),
        Row(">=0.14,<0.15", ("no_weight_decay_cond", "scale_lr_cond", "lr_mult", "use_gloo_process_groups",
                             "default_skip_embedding_weight_decay", "grad_comm_pgs", "model_comm_pgs")),
        Row(">=0.15,<0.16", ("no_weight_decay_cond", "scale_lr_cond", "lr_mult", "use_gloo_process_groups",
                             "default_skip_embedding_weight_decay", "pg_collection")),
        Row(">=0.16", ("config_overrides", "use_gloo_process_groups", "pg_collection",
                       "dump_param_to_param_group_map")),
    ), "parameters of get_megatron_optimizer after (config, model_chunks); None = no megatron.core.optimizer "
       "(optimizer/__init__.py: use_gloo_process_groups 0.12; default_skip_embedding_weight_decay 0.14-0.15; "
       "grad_comm_pgs/model_comm_pgs 0.14 only; pg_collection 0.15; config_overrides replaces the conds 0.16)",
       def_params(_OPT, "get_megatron_optimizer", drop=2)),
    Fact("private_builder_params", (
        Row(">=0.4,<0.6", None),
        Row(">=0.6,<0.8", ("config", "param_groups", "per_model_buffers", "data_parallel_group",
                           "data_parallel_group_gloo", "data_parallel_group_idx")),
        Row(">=0.8,<0.9", ("config", "param_groups", "per_model_buffers", "model_parallel_group",
                           "data_parallel_group", "data_parallel_group_gloo", "data_parallel_group_idx")),
        Row(">=0.9,<0.10", ("config", "model_chunks", "param_groups", "per_model_buffers", "model_parallel_group",
                            "data_parallel_group", "data_parallel_group_gloo", "data_parallel_group_idx")),
        Row(">=0.10,<0.15", ("config", "model_chunks", "param_groups", "per_model_buffers", "model_parallel_group",
                             "data_parallel_group", "data_parallel_group_gloo", "data_parallel_group_idx",
                             "distributed_optimizer_instance_id")),
        Row(">=0.15,<0.16", ("config", "model_chunks", "param_groups", "per_model_buffers", "model_parallel_group",
                             "data_parallel_group", "data_parallel_group_gloo", "data_parallel_group_idx",
                             "intra_dist_opt_group", "distributed_optimizer_instance_id")),
        Row(">=0.16,<0.18", ("config", "model_chunks", "param_groups", "per_model_buffers", "model_parallel_group",
                             "data_parallel_group", "data_parallel_group_gloo", "data_parallel_group_idx",
                             "intra_dist_opt_group", "distributed_optimizer_instance_id", "pg_collection")),
        Row(">=0.18", ("config", "model_chunks", "param_groups", "per_model_buffers", "model_parallel_group",
                       "data_parallel_group", "data_parallel_group_gloo", "data_parallel_group_idx",
                       "intra_dist_opt_group", "distributed_optimizer_instance_id", "pg_collection",
                       "skip_megatron_wrapping")),
    ), "parameters of _get_megatron_optimizer_based_on_param_groups (optimizer/__init__.py: model_parallel_group "
       "0.8, model_chunks 0.9, distributed_optimizer_instance_id 0.10, intra_dist_opt_group - the grad-stats group "
       "of the distributed optimizer - 0.15, pg_collection 0.16, skip_megatron_wrapping 0.18); None = no "
       "megatron.core.optimizer",
       def_params(_OPT, "_get_megatron_optimizer_based_on_param_groups")),
    Fact("param_groups_style", (
        Row(">=0.4,<0.6", None),
        Row(">=0.6,<0.9", "v6"),
        Row(">=0.9,<0.16", "v9"),
        Row(">=0.16", "v16"),
    ), "how _get_param_groups (optimizer/__init__.py) builds parameter groups: v6 = (model_chunks, no_wd, "
       "scale_lr, lr_mult, use_decoupled_learning_rate) then _update_min_and_max_lr_in_param_groups; v9 = "
       "(model_chunks, no_wd, scale_lr, lr_mult, lr, min_lr, decoupled_lr, decoupled_min_lr) (0.9); v16 = "
       "(model_chunks, config, config_overrides) (0.16); None = no megatron.core.optimizer",
       first_of((("v16", def_has_param(_OPT, "_get_param_groups", "config_overrides")),
                 ("v9", def_has_param(_OPT, "_get_param_groups", "min_lr")),
                 ("v6", defines(_OPT, "_get_param_groups"))), default=None)),
    F("param_groups_skip_embedding_wd", ">=0.14,<0.16",
      "_get_param_groups takes default_skip_embedding_weight_decay (optimizer/__init__.py, 0.14-0.15)",
      def_has_param(_OPT, "_get_param_groups", "default_skip_embedding_weight_decay")),
    F("param_groups_lr_mult_shadowed", ">=0.6,<0.8",
      "_get_param_groups rebinds its own lr_mult argument inside the loop (optimizer/__init__.py, fixed in 0.8 by "
      "naming the per-param value _lr_mult): after the first param outside scale_lr_cond every scaled param gets "
      "lr_mult 1.0",
      all_of(def_has_param(_OPT, "_get_param_groups", "lr_mult"), assigns_name(_OPT, "_get_param_groups", "lr_mult"))),
    F("megatron_scheduler", ">=0.9",
      "megatron.core.optimizer_param_scheduler.OptimizerParamScheduler exists (optimizer_param_scheduler.py, 0.9); "
      "before it mcore_compat.training.scheduler serves the same signature",
      defines(_OPS, "OptimizerParamScheduler.step")),
    F("scheduler_wsd_minus_sqrt", ">=0.13",
      "OptimizerParamScheduler.get_lr knows the WSD anneal style 'minus_sqrt' (optimizer_param_scheduler.py, 0.13); "
      "0.9-0.12 leave its coefficient unset and fail inside get_lr (UnboundLocalError), so "
      "mcore_compat.training.scheduler serves it there",
      uses_string(_OPS, "OptimizerParamScheduler.get_lr", "minus_sqrt")),
    F("scheduler_ignores_lr_mult", ">=0.16",
      "OptimizerParamScheduler.step sets a group's lr from its max_lr/min_lr alone, without the group's lr_mult "
      "(optimizer_param_scheduler.py, 0.16: per-group lr lives in max_lr/min_lr, config_overrides); before 0.16 "
      "lr = schedule(max_lr, min_lr) * lr_mult, init_lr included (mcore_compat's own scheduler too, but for a warmup "
      "from init_lr, which rises to max_lr * lr_mult as on 0.16+)",
      all_of(defines(_OPS, "OptimizerParamScheduler.step"),
             negate(uses_string(_OPS, "OptimizerParamScheduler.step", "lr_mult")))),
)

# --------------------------------------------------------------------------------------------------------------
# The flat grad/param buffers of DDP (read by mcore_compat.layout and mcore_compat.binding). The layout is
# computed in distributed/grad_buffer.py (GradBuffer, 0.4/0.5), distributed/param_and_grad_buffer.py
# (ParamAndGradBuffer 0.6-0.8, _ParamAndGradBuffer 0.9+) and, from 0.18, optimizer/param_layout.py and
# optimizer/distrib_optimizer.py (DistributedOptimizer._compute_per_buffer_param_layout).

_GB = "megatron.core.distributed.grad_buffer"
_DDP_CLASS = "DistributedDataParallel"
_PAD_HIGH_NCCL = "DistributedDataParallelConfig.pad_buckets_for_high_nccl_busbw"


def _buffer_assigns(attr: str) -> Probe[bool]:
    """The buffer class of the release (GradBuffer, ParamAndGradBuffer or _ParamAndGradBuffer) sets ``attr``."""
    return any_of(assigns_self_attr(_GB, "GradBuffer", attr), assigns_self_attr(_BUF, "ParamAndGradBuffer", attr),
                  assigns_self_attr(_BUF, "_ParamAndGradBuffer", attr))


def _bucket_assigns(attr: str) -> Probe[bool]:
    """The bucket class of the release (Bucket, or _ParamAndGradBucket from 0.9) sets ``attr``."""
    return any_of(assigns_self_attr(_GB, "Bucket", attr), assigns_self_attr(_BUF, "Bucket", attr),
                  assigns_self_attr(_BUF, "_ParamAndGradBucket", attr))


_VALUED_LAYOUT: tuple[Fact[Any], ...] = (
    Fact("ddp_buffer_attrs", (
        Row(">=0.4,<0.6", ("grad_buffers", None)),
        Row(">=0.6", ("buffers", "expert_parallel_buffers")),
    ), "DDP attributes holding the buffers, (dense, expert): 0.4/0.5 a dict {grad dtype: GradBuffer} "
       "(distributed/grad_buffer.py) and expert params in no buffer; lists of ParamAndGradBuffer from 0.6 "
       "(distributed/distributed_data_parallel.py)",
       first_of(((("buffers", "expert_parallel_buffers"),
                  all_of(assigns_self_attr(_DDP, _DDP_CLASS, "buffers"),
                         assigns_self_attr(_DDP, _DDP_CLASS, "expert_parallel_buffers"))),
                 (("grad_buffers", None), assigns_self_attr(_DDP, _DDP_CLASS, "grad_buffers"))), default=None)),
    Fact("grad_data_attr", (
        Row(">=0.4,<0.6", "data"),
        Row(">=0.6", "grad_data"),
    ), "attribute of a buffer holding the flat gradient tensor (GradBuffer.data in distributed/grad_buffer.py; "
       "grad_data in distributed/param_and_grad_buffer.py, 0.6)",
       first_of((("grad_data", _buffer_assigns("grad_data")), ("data", _buffer_assigns("data"))), default=None)),
    Fact("buffer_grouping", (
        Row(">=0.4,<0.6", "grad_dtype"),
        Row(">=0.6,<0.18", "param_and_grad_dtype"),
        Row(">=0.18", "buffer_key"),
    ), "what separates params into buffers: grad_dtype = the grad dtype only (0.4/0.5, one GradBuffer per "
       "dtype); param_and_grad_dtype = (param dtype, grad dtype) per dense/expert list (0.6, the buffer takes "
       "param_dtype); buffer_key = BufferKey(param dtype, grad dtype, expert, managed by the layer-wise optimizer) "
       "(optimizer/param_layout.py, 0.18)",
       first_of((("buffer_key", defines(_LAYOUT, "BufferKey")),
                 ("param_and_grad_dtype", any_of(def_has_param(_BUF, "ParamAndGradBuffer.__init__", "param_dtype"),
                                                 def_has_param(_BUF, "_ParamAndGradBuffer.__init__", "param_dtype")))),
                default="grad_dtype")),
    Fact("expert_buffers", (
        Row(">=0.4,<0.6", False),
        Row(">=0.6", True),
    ), "expert params (param.allreduce == False) get buffers of their own (DDP.expert_parallel_buffers, "
       "distributed/distributed_data_parallel.py, 0.6); before, a private main_grad outside any buffer",
       assigns_self_attr(_DDP, _DDP_CLASS, "expert_parallel_buffers")),
    Fact("bucket_end_factors", (
        Row(">=0.4,<0.7", ()),
        Row(">=0.7", (128,)),
    ), "with the distributed optimizer, bucket ends are padded to lcm(dp, *factors): math.lcm(dp, 128) in "
       "distributed/param_and_grad_buffer.py (0.7) and optimizer/param_layout.py (0.18); before, to a multiple "
       "of dp",
       first_of((((128,), calls_with_constant((_BUF, _LAYOUT), ("lcm",), 128)),), default=())),
    Fact("high_nccl_busbw_factor", (
        Row(">=0.4,<0.12", None),
        Row(">=0.12", 2**16),
    ), "extra lcm factor of the bucket end with DistributedDataParallelConfig.pad_buckets_for_high_nccl_busbw "
       "(distributed/distributed_data_parallel_config.py, 0.12: math.lcm(dp, 128, 2**16)); None = no such "
       "option",
       first_of(((2**16, all_of(defines(_DDPC, _PAD_HIGH_NCCL),
                                calls_with_constant((_BUF, _LAYOUT), ("lcm",), 2**16))),), default=None)),
    Fact("param_start_alignment", (
        Row(">=0.4,<0.8", 1),
        Row(">=0.8", 64),
    ), "with the distributed optimizer, every param starts at a multiple of this many elements (_pad(start, 64) "
       "in distributed/param_and_grad_buffer.py, 0.8; pad_to_divisor in optimizer/param_layout.py, 0.18)",
       first_of(((64, calls_with_constant((_BUF, _LAYOUT), ("_pad", "pad_to_divisor"), 64)),), default=1)),
    Fact("shared_embedding_split", (
        Row(">=0.4,<0.6", "none"),
        Row(">=0.6,<0.9", "close_at_start"),
        Row(">=0.9,<0.13", "dp_align_then_close"),
        Row(">=0.13", "start_after_close"),
    ), "how a shared_embedding param gets a bucket of its own with the distributed optimizer "
       "(_does_param_require_new_bucket in distributed/param_and_grad_buffer.py, from 0.18 in "
       "optimizer/distrib_optimizer.py): none = no special case (0.4/0.5); close_at_start = close the running "
       "bucket at the param's start, which stays (Megatron asserts start % dp == 0; 0.6); dp_align_then_close = "
       "pad the start to a bucket end if it is not a multiple of dp, close the running bucket there, the param "
       "stays at that start (0.9); start_after_close = close the running bucket, the param starts at its padded "
       "end (0.13)",
       shared_embedding_split()),
    Fact("min_params_per_sized_bucket", (
        Row(">=0.4,<0.6", 2),
        Row(">=0.6", 1),
    ), "a bucket is closed by size only once it holds at least this many params (distributed/grad_buffer.py "
       "0.4/0.5: `>= bucket_size and len(bucket_params) > 1`; distributed/param_and_grad_buffer.py 0.6: no "
       "minimum)",
       min_params_per_sized_bucket()),
    Fact("bucket_numel_unpadded", (
        Row(">=0.4,<0.5", False),
        Row(">=0.5", True),
    ), "buckets record numel_unpadded (Bucket in distributed/grad_buffer.py, 0.5)",
       _bucket_assigns("numel_unpadded")),
    Fact("buffer_numel_unpadded", (
        Row(">=0.4,<0.7", False),
        Row(">=0.7", True),
    ), "buffers record numel_unpadded, the sum over their buckets (ParamAndGradBuffer in "
       "distributed/param_and_grad_buffer.py, 0.7)",
       _buffer_assigns("numel_unpadded")),
    Fact("param_data_with_distopt", (
        Row(">=0.4,<0.6", False),
        Row(">=0.6", True),
    ), "with the distributed optimizer, buffers hold a flat param_data tensor the params are views of "
       "(distributed/param_and_grad_buffer.py, 0.6)",
       _buffer_assigns("param_data")),
    Fact("default_bucket_size", (
        Row(">=0.4,<0.7", "fixed"),
        Row(">=0.7", "scaled"),
    ), "default bucket size: fixed = 40_000_000 (the DDP argument's default, 0.4-0.6); scaled = "
       "max(40_000_000, 1_000_000 * dp) computed in DistributedDataParallel.__init__ "
       "(distributed/distributed_data_parallel.py, 0.7)",
       first_of((("scaled", calls_with_constant((_DDP,), ("max",), 40000000, within=_DDP_INIT)),),
                default="fixed")),
    Fact("bucket_size_none", (
        Row(">=0.4,<0.7", "single_bucket"),
        Row(">=0.7", "default"),
    ), "what an explicit bucket_size=None means: the DDP argument (0.4-0.6) -> one bucket; ddp_config.bucket_size "
       "(distributed/distributed_data_parallel.py, 0.7) -> the default",
       bucket_size_none()),
)

#: The names of the buffer-layout facts (``mcore_compat.layout.LAYOUT_FACTS`` is this part of the table).
LAYOUT_FACT_NAMES: tuple[str, ...] = tuple(f.name for f in _VALUED_LAYOUT)

FACTS: dict[str, Fact[Any]] = {
    f.name: f for f in (
        _ROWS_PACKAGE + _ROWS_DDP + _VALUED_DDP + _ROWS_FINALIZE + _VALUED_STEP + _ROWS_PG + _ROWS_OPTIMIZER
        + _VALUED_OPTIMIZER + _ROWS_MODELS + _VALUED_LAYOUT
    )
}
