"""The small models the self-check trains: tensor-parallel MLP and a tiny GPT from Megatron's local layer spec."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from .options import SelfCheckOptions

__all__ = ["Batch", "build_model", "make_batches"]

HIDDEN, FFN, HEADS, VOCAB, SEQ, MICRO_BATCH, MICROBATCHES = 32, 64, 4, 64, 8, 2, 2


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


def transformer_config(opts: SelfCheckOptions) -> Any:
    """The TransformerConfig both models use (fusions off: they need CUDA kernels or apex)."""
    import torch

    dtype = torch.bfloat16 if opts.dtype == "bf16" else torch.float32
    cls = _symbols().resolve("TransformerConfig")
    kwargs: dict[str, Any] = dict(
        num_layers=2 * (opts.pp or 1), hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        tensor_model_parallel_size=opts.tp or 1, pipeline_model_parallel_size=opts.pp or 1,
        use_cpu_initialization=True, params_dtype=dtype, pipeline_dtype=dtype, bf16=opts.dtype == "bf16",
        hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
    )
    fields = set(getattr(cls, "__dataclass_fields__", {}))
    for optional in ("bias_activation_fusion", "bias_gelu_fusion", "apply_rope_fusion"):
        if optional in fields:
            kwargs[optional] = False
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


def _gpt(config: Any) -> Any:
    sym = _symbols()
    ps = sym.resolve("parallel_state")
    spec = sym.resolve("get_gpt_layer_local_spec")()
    return sym.resolve("GPTModel")(
        config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False, parallel_output=True,
    )


def build_model(opts: SelfCheckOptions) -> tuple[Any, Any]:
    """``(module, config)``: the model for this rank's pipeline stage (bf16: wrapped in Float16Module)."""
    import torch

    config = transformer_config(opts)
    module = _gpt(config) if opts.model == "gpt" else _mlp(config)
    if opts.device == "cuda":
        module = module.cuda(torch.cuda.current_device())
    if opts.dtype == "bf16":
        module = _symbols().resolve("Float16Module")(config, module)
    return module, config


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


def init_parallel(opts: SelfCheckOptions) -> None:
    """Initialise Megatron's model-parallel state for ``opts`` (destroying any previous one) and seed."""
    import torch

    ps = _symbols().resolve("parallel_state")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=opts.tp or 1, pipeline_model_parallel_size=opts.pp or 1)
    torch.manual_seed(opts.seed)
    _symbols().resolve("model_parallel_cuda_manual_seed")(opts.seed)


def build_chunks(opts: SelfCheckOptions) -> tuple[list[Any], Any]:
    """This rank's model chunks and their config."""
    module, config = build_model(opts)
    return [module], config


def forward_step(opts: SelfCheckOptions) -> Any:
    """The ``forward_step_func`` the schedules call: the model's output and a mean-loss function."""
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


def unsupported_reason(opts: SelfCheckOptions) -> str | None:
    """``None`` if the installed release can run ``opts`` on its device, else the release limit in one line."""
    if opts.sequence_parallel or (opts.vpp or 1) > 1 or opts.overlap or opts.experts:
        return "not built yet by this self-check"
    return None
