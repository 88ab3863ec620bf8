"""The small models the self-check trains: a tensor-parallel MLP and a tiny GPT from Megatron's local layer spec.

:func:`init_parallel` sets up ``parallel_state`` for a :class:`~.options.SelfCheckOptions` (TP, PP, virtual
stages, expert parallelism), :func:`build_chunks` builds this rank's model chunks (one per virtual pipeline
stage), :func:`forward_step` is the ``forward_step_func`` of Megatron's schedules and :func:`unsupported_reason`
says, from the capability table, whether the installed release can run a configuration on a CPU at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .._translate.names import fields_in
from ..capabilities import capability, has
from ..detect import detect
from .options import SelfCheckOptions

__all__ = [
    "Batch",
    "batches",
    "build_chunks",
    "build_model",
    "data_iterators",
    "ddp_config",
    "forward_step",
    "init_parallel",
    "make_batches",
    "optim_config",
    "release_chunks",
    "transformer_config",
    "unsupported_reason",
]

HIDDEN, FFN, HEADS, VOCAB, SEQ, MICRO_BATCH, MICROBATCHES = 32, 64, 4, 64, 8, 2, 2
LAYERS_PER_STAGE = 2  # transformer layers per pipeline rank (split over its virtual stages)
MOE_TOPK = 2  # experts per token (at most the number of experts)


@dataclass
class Batch:
    """One micro-batch (tensors on the run's device)."""

    tokens: Any
    labels: Any
    position_ids: Any
    attention_mask: Any
    x: Any  # MLP input [seq, batch, hidden]
    target: Any  # MLP target


def _symbols() -> Any:
    from .. import symbols

    return symbols


# ---------------------------------------------------------------------------------------------------------------
# what a configuration needs from the release
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Requirement:
    """A configuration feature and the capability (a boolean fact of ``mcore_compat._facts.table``) it needs."""

    feature: str
    applies: Callable[[SelfCheckOptions], bool]
    capability: str
    holds: bool  # the capability must hold (True) or must not hold (False)
    why: str  # the release limit, naming Megatron's file


#: Every release limit a self-check configuration can hit on a CPU. The version ranges live in the capability
#: table (each row cites the Megatron file that changed and is checked against its probe in every release).
REQUIREMENTS: tuple[_Requirement, ...] = (
    _Requirement("MoE experts", lambda o: o.experts > 0, "moe_local_spec", True,
                 "the local layer spec has no MoE experts (transformer/moe/ and "
                 "get_gpt_layer_local_spec(num_experts=...) arrive in 0.5)"),
    _Requirement("virtual pipeline stages at pipeline size 2", lambda o: (o.vpp or 1) > 1 and (o.pp or 1) <= 2,
                 "interleaved_needs_pp_over_2", False,
                 "parallel_state.initialize_model_parallel raises 'pipeline-model-parallel size should be "
                 "greater than 2 with interleaved schedule' (> 1 from 0.8)"),
    _Requirement("MoE with gradient clipping on Megatron's optimizer",
                 lambda o: o.experts > 0 and o.clip_grad > 0 and has("core_optimizer"),
                 "chained_optimizer_global_clip", True,
                 "0.6/0.7's ChainedOptimizer clips dense and expert params by separate norms, not by the global "
                 "norm (optimizer/optimizer.py ChainedOptimizer.step), which the self-check reports as a wrong update"),
    _Requirement("tied embeddings across pipeline stages with the distributed optimizer at DP > 1",
                 lambda o: o.tie_embeddings and (o.pp or 1) > 1 and (o.dp or 1) > 1 and o.distributed_optimizer,
                 "core_optimizer", True,
                 "0.4/0.5's DDP reduce-scatters the first and last stage's copies of the tied weight over shards that "
                 "do not line up, so the embedding all-reduce of finalize_model_grads mixes reduced and unreduced "
                 "gradients (distributed/distributed_data_parallel.py, finalize_model_grads.py); mcore_compat's "
                 "optimizer for 0.4/0.5 refuses this layout"),
    _Requirement("the overlapped parameter all-gather (overlap with the distributed optimizer)",
                 lambda o: o.overlap and o.distributed_optimizer, "core_optimizer", True,
                 "it is a feature of Megatron's DistributedOptimizer (megatron/core/optimizer/, 0.6+); the "
                 "optimizer mcore_compat provides for 0.4/0.5 gathers synchronously"),
)


def unsupported_reason(opts: SelfCheckOptions) -> str | None:
    """``None`` if the installed release can run ``opts`` on a CPU, else one line naming the release limit."""
    for req in REQUIREMENTS:
        if req.applies(opts) and has(req.capability) != req.holds:
            versions = capability(req.capability).versions
            where = f"needs megatron-core {versions}" if req.holds else f"fails on megatron-core {versions}"
            return f"{req.feature}: {where} (installed {detect().version}); {req.why}"
    if not opts.decoupled_weight_decay and "decoupled_weight_decay" not in fields_in("OptimizerConfig",
                                                                                      detect().version):
        adam = ("Megatron's Adam is torch AdamW or FusedAdam in AdamW mode (optimizer/__init__.py)"
                if has("core_optimizer") else "mcore_compat's optimizer for 0.4/0.5 is torch AdamW")
        return (f"Adam with L2 (coupled) weight decay: megatron-core {detect().version} has no "
                f"OptimizerConfig.decoupled_weight_decay (0.15+); {adam}, always decoupled")
    return None


# ---------------------------------------------------------------------------------------------------------------
# parallel state
# ---------------------------------------------------------------------------------------------------------------

def _seed(opts: SelfCheckOptions) -> None:
    import torch

    torch.manual_seed(opts.seed)
    _symbols().resolve("model_parallel_cuda_manual_seed")(opts.seed)


def init_parallel(opts: SelfCheckOptions) -> None:
    """Destroy any previous model-parallel state, initialise ``parallel_state`` for ``opts`` (tp, pp, virtual
    stages when ``vpp > 1``, expert parallelism when ``ep > 1``) and seed torch and Megatron's RNG tracker.

    The four keyword names are the same in every release 0.4 ... 0.19 (``initialize_model_parallel``).
    """
    ps = _symbols().resolve("parallel_state")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    kwargs: dict[str, Any] = {"tensor_model_parallel_size": opts.tp or 1,
                              "pipeline_model_parallel_size": opts.pp or 1}
    if (opts.vpp or 1) > 1:
        kwargs["virtual_pipeline_model_parallel_size"] = opts.vpp
    if (opts.ep or 1) > 1:
        kwargs["expert_model_parallel_size"] = opts.ep
    ps.initialize_model_parallel(**kwargs)
    _seed(opts)


# ---------------------------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------------------------

def _moe_fields(opts: SelfCheckOptions) -> dict[str, Any]:
    """MoE settings that run on a CPU with gloo: SequentialMLP experts (no grouped GEMM), the all-gather token
    dispatcher (its collectives are gloo-capable), no load-balancing loss (top-k routing still trains the router
    through the routing probabilities)."""
    if not opts.experts:
        return {}
    return {"num_moe_experts": opts.experts, "expert_model_parallel_size": opts.ep or 1,
            "moe_router_topk": min(MOE_TOPK, opts.experts), "moe_router_load_balancing_type": "none",
            "moe_grouped_gemm": False, "moe_token_dispatcher_type": "allgather", "moe_aux_loss_coeff": 0.0}


def transformer_config(opts: SelfCheckOptions) -> Any:
    """The TransformerConfig of ``opts`` (fusions off: they need CUDA kernels or apex). Fields the installed
    release does not have are left out; the capability table says which releases run what.

    Linear biases only with ``opts.bias``. With them, the stretch of parameters before a stage's tied input
    embedding can end off a multiple of 128 elements; with the distributed optimizer, 0.7-0.12 then lay the
    embedding over two buckets (distributed/param_and_grad_buffer.py; fixed in 0.13) and ``wrap_ddp`` refuses
    the model before building it (:mod:`mcore_compat.training.tied_buckets`). The self-check's two layers per
    stage end on a multiple of 128 elements with biases too, so every release trains them.
    """
    import torch

    dtype = torch.bfloat16 if opts.dtype == "bf16" else torch.float32
    cls = _symbols().resolve("TransformerConfig")
    vpp = opts.vpp or 1
    kwargs: dict[str, Any] = dict(
        num_layers=LAYERS_PER_STAGE * (opts.pp or 1), hidden_size=HIDDEN, ffn_hidden_size=FFN,
        num_attention_heads=HEADS, tensor_model_parallel_size=opts.tp or 1,
        pipeline_model_parallel_size=opts.pp or 1,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        sequence_parallel=bool(opts.sequence_parallel) and opts.model == "gpt",
        use_cpu_initialization=True, params_dtype=dtype, pipeline_dtype=dtype, bf16=opts.dtype == "bf16",
        add_bias_linear=opts.bias, hidden_dropout=opts.dropout, attention_dropout=opts.dropout,
        masked_softmax_fusion=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        bias_activation_fusion=False, bias_gelu_fusion=False, apply_rope_fusion=False,
        **_moe_fields(opts),
    )
    if vpp > 1:  # Megatron-LM's P2P settings for the interleaved schedule (forward_backward needs them at PP=2)
        kwargs.update(batch_p2p_comm=False, overlap_p2p_comm=True)
    fields = set(getattr(cls, "__dataclass_fields__", {}))
    return cls(**{k: v for k, v in kwargs.items() if k in fields})


def _mlp(config: Any) -> Any:
    import torch

    sym = _symbols()
    base, column, row = sym.resolve("MegatronModule"), sym.resolve("ColumnParallelLinear"), \
        sym.resolve("RowParallelLinear")
    model_type = importlib.import_module("megatron.core.enums").ModelType.encoder_or_decoder

    class SelfCheckMLP(base):  # type: ignore[misc, valid-type]
        """Column- then row-parallel linear layers with GELU between."""

        def __init__(self) -> None:
            super().__init__(config=config)
            self.model_type = model_type
            init = config.init_method
            self.fc1 = column(HIDDEN, FFN, config=config, init_method=init, bias=True, gather_output=False)
            self.fc2 = row(FFN, HIDDEN, config=config, init_method=init, bias=True, input_is_parallel=True,
                           skip_bias_add=False)

        def set_input_tensor(self, tensor: Any) -> None:
            self.input_tensor = tensor

        def forward(self, x: Any) -> Any:
            h, _ = self.fc1(x)
            y, _ = self.fc2(torch.nn.functional.gelu(h))
            return y

    return SelfCheckMLP()


#: Megatron's torch fallbacks for LayerNorm, chosen by the local spec when apex is missing (0.8+); both refuse
#: ``sequence_parallel`` (transformer/torch_layer_norm.py 0.8-0.9, transformer/torch_norm.py 0.10+).
_TORCH_NORM_MODULES = ("megatron.core.transformer.torch_layer_norm", "megatron.core.transformer.torch_norm")


def _sequence_parallel_norm() -> type:
    """A torch LayerNorm built like Megatron's norms (``config, hidden_size, eps``) whose parameters carry
    ``sequence_parallel`` as apex's FusedLayerNorm and TransformerEngine's norms set it, so that
    ``finalize_model_grads`` all-reduces their gradients over the tensor-parallel group."""
    import torch

    class SequenceParallelLayerNorm(torch.nn.LayerNorm):
        def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
            super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
            for p in self.parameters():
                setattr(p, "sequence_parallel", bool(config.sequence_parallel))  # Megatron's parameter flag

    return SequenceParallelLayerNorm


def _layer_spec(opts: SelfCheckOptions) -> Any:
    """Megatron's local GPT layer spec; with sequence parallelism where its LayerNorm is Megatron's torch fallback
    (no apex), a block spec whose norms are :func:`_sequence_parallel_norm` (the rest stays Megatron's)."""
    fn = _symbols().resolve("get_gpt_layer_local_spec")
    spec = fn(num_experts=opts.experts, moe_grouped_gemm=False) if opts.experts else fn()
    norm = getattr(spec.submodules, "input_layernorm", None)
    if not opts.sequence_parallel or getattr(norm, "__module__", None) not in _TORCH_NORM_MODULES:
        return spec
    sp_norm = _sequence_parallel_norm()
    layer = type(spec)(module=spec.module, params=spec.params, submodules=dataclasses.replace(
        spec.submodules, input_layernorm=sp_norm, pre_mlp_layernorm=sp_norm))
    block = importlib.import_module("megatron.core.transformer.transformer_block").TransformerBlockSubmodules
    return block(layer_specs=[layer] * (LAYERS_PER_STAGE // (opts.vpp or 1)), layer_norm=sp_norm)


def _gpt(config: Any, opts: SelfCheckOptions, *, pre_process: bool, post_process: bool, tie: bool,
         vp_stage: int | None = None) -> Any:
    kwargs: dict[str, Any] = {}
    if vp_stage is not None:
        kwargs["vp_stage"] = vp_stage
    return _symbols().resolve("GPTModel")(
        config=config, transformer_layer_spec=_layer_spec(opts), vocab_size=VOCAB, max_sequence_length=SEQ,
        pre_process=pre_process, post_process=post_process, share_embeddings_and_output_weights=tie,
        parallel_output=True, **kwargs)


@contextlib.contextmanager
def _virtual_rank(ps: Any, stage: int | None) -> Iterator[None]:
    """Releases whose GPT reads the virtual stage from ``parallel_state`` while it is built (layer offset,
    first/last stage): set it for the duration of one chunk's construction."""
    if stage is None:
        yield
        return
    ps.set_virtual_pipeline_model_parallel_rank(stage)
    try:
        yield
    finally:
        ps.set_virtual_pipeline_model_parallel_rank(0)


def _finish(module: Any, config: Any, opts: SelfCheckOptions) -> Any:
    import torch

    if opts.device == "cuda":
        module = module.cuda(torch.cuda.current_device())
    if opts.dtype == "bf16":
        module = _symbols().resolve("Float16Module")(config, module)
    return module


def build_chunks(opts: SelfCheckOptions) -> tuple[list[Any], Any]:
    """``(chunks, config)``: this rank's model chunks (``vpp`` of them for a GPT, one for the MLP) and their
    shared TransformerConfig; bf16 chunks are wrapped in ``Float16Module``.

    Call after :func:`init_parallel`. The weights depend only on ``opts.seed`` and the rank's place in the
    parallel layout (the RNG is re-seeded here), so a second call builds an identical copy. Sequence parallelism
    applies to the GPT (the MLP's input is not split along the sequence). Each chunk gets its
    pre/post-processing (embedding on the first virtual stage of the first pipeline rank, output layer on the
    last of the last) and its layer offset: through ``GPTModel(vp_stage=i)`` where the release has it
    (``gpt_vp_stage``), else through ``parallel_state``'s virtual rank set while the chunk is built.
    """
    ps = _symbols().resolve("parallel_state")
    _seed(opts)
    config = transformer_config(opts)
    if opts.model != "gpt":
        return [_finish(_mlp(config), config, opts)], config
    vpp = opts.vpp or 1
    pp_rank, pp = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    by_argument = has("gpt_vp_stage")
    chunks = []
    for i in range(vpp):
        stage = i if vpp > 1 else None
        with _virtual_rank(ps, None if by_argument else stage):
            module = _gpt(config, opts, pre_process=pp_rank == 0 and i == 0,
                          post_process=pp_rank == pp - 1 and i == vpp - 1, tie=opts.tie_embeddings,
                          vp_stage=stage if by_argument else None)
        chunks.append(_finish(module, config, opts))
    return chunks, config


def build_model(opts: SelfCheckOptions) -> tuple[Any, Any]:
    """``(module, config)``: the model of the current worker for this rank's pipeline stage (no virtual stages,
    no sequence parallelism, untied embeddings; bf16: wrapped in Float16Module)."""
    ps = _symbols().resolve("parallel_state")
    opts = dataclasses.replace(opts, sequence_parallel=False, vpp=1)
    config = transformer_config(opts)
    if opts.model == "gpt":
        module = _gpt(config, opts, pre_process=ps.is_pipeline_first_stage(),
                      post_process=ps.is_pipeline_last_stage(), tie=False)
    else:
        module = _mlp(config)
    return _finish(module, config, opts), config


def forward_step(opts: SelfCheckOptions) -> Callable[[Any, Any], Any]:
    """The ``forward_step_func`` of Megatron's schedules for ``opts``: works on every pipeline stage and virtual
    stage (the model ignores the tokens where it has no embedding, and the loss function is called on the last
    stage only). Loss: the mean token cross-entropy (GPT) or mean squared error (MLP); the dict holds a copy."""

    def step(data_iterator: Any, model: Any) -> Any:
        b = next(data_iterator)
        if opts.model == "gpt":
            out = model(b.tokens, b.position_ids, b.attention_mask, labels=b.labels)
        else:
            out = model(b.x)

        def loss_func(output: Any) -> Any:
            loss = output.float().mean() if opts.model == "gpt" else ((output.float() - b.target) ** 2).mean()
            return loss, {"loss": loss.detach().clone()}

        return out, loss_func

    return step


def ddp_config(opts: SelfCheckOptions, *, bucket_size: int | None = None) -> Any:
    """The :class:`~mcore_compat.training.DDPConfig` of ``opts`` (overlapped param gather only with the
    distributed optimizer, as Megatron requires)."""
    from ..training import DDPConfig

    return DDPConfig(use_distributed_optimizer=opts.distributed_optimizer,
                     grad_reduce_in_fp32=bool(opts.grad_reduce_in_fp32), overlap_grad_reduce=opts.overlap,
                     overlap_param_gather=opts.overlap and opts.distributed_optimizer, bucket_size=bucket_size)


def optim_config(opts: SelfCheckOptions) -> Any:
    """The :class:`~mcore_compat.training.OptimConfig` of ``opts`` (Adam)."""
    import torch

    from ..training import OptimConfig

    return OptimConfig(optimizer="adam", lr=opts.lr, weight_decay=opts.weight_decay, clip_grad=opts.clip_grad,
                       bf16=opts.dtype == "bf16",
                       params_dtype=torch.bfloat16 if opts.dtype == "bf16" else torch.float32,
                       use_distributed_optimizer=opts.distributed_optimizer,
                       decoupled_weight_decay=opts.decoupled_weight_decay, loss_scale=opts.loss_scale)


def make_batches(opts: SelfCheckOptions, dp_rank: int) -> list[Batch]:
    """The micro-batches of one step for data-parallel rank ``dp_rank`` (the same every step)."""
    import torch

    device = "cuda" if opts.device == "cuda" else "cpu"
    out = []
    for m in range(MICROBATCHES):
        g = torch.Generator().manual_seed(opts.seed * 1000 + 17 * dp_rank + m)
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g)
        mask = torch.tril(torch.ones(SEQ, SEQ)).view(1, 1, SEQ, SEQ) < 0.5
        pos = torch.arange(SEQ).unsqueeze(0).expand(MICRO_BATCH, SEQ).contiguous()
        x = torch.randn(SEQ, MICRO_BATCH, HIDDEN, generator=g)
        target = torch.randn(SEQ, MICRO_BATCH, HIDDEN, generator=g)
        out.append(Batch(*(t.to(device) for t in (tokens, labels, pos, mask, x, target))))
    return out


def release_chunks(chunks: list[Any]) -> None:
    """Let a finished run's model (and the process groups its layers, DDP and optimizer hold) be freed.

    Megatron's DDP hangs its backward hooks on the params' autograd accumulator nodes, and those hooks refer back
    to the DDP object: a cycle through C++ objects that Python's garbage collector cannot break, so every run in
    a long-lived process would keep its model and its gloo groups (~50 threads) alive. Emptying the DDP objects
    leaves the cycle holding only the params and the hook closures. The chunks are unusable afterwards.
    """
    for chunk in chunks:
        chunk.__dict__.clear()


#: The micro-batches of one step (:func:`make_batches`).
batches = make_batches


def data_iterators(step_batches: list[Batch], chunks: list[Any]) -> Any:
    """What ``forward_backward`` takes for ``chunks``: one iterator over ``step_batches``, or with several chunks
    (virtual pipeline stages) one iterator per chunk, each over every micro-batch."""
    if len(chunks) > 1:
        return [iter(step_batches) for _ in chunks]
    return iter(step_batches)
