"""The GPT the step and memory benchmarks train: Megatron's ``GPTModel`` with the local (non-TE) layer spec.

Built either through mcore_compat's import surface (``shim``) or with raw ``megatron.core`` imports (``raw``);
both give the same modules and, for the same seed, the same weights. Fusions that need apex/TE kernels are off
(the self-check's flags), so it builds on a CPU-only torch and on CUDA without apex or TransformerEngine.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class GPTSpec:
    """Model and batch sizes."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    micro_batch: int
    microbatches: int
    dtype: str  # "bf16" or "fp32"
    device: str

    def as_dict(self) -> dict[str, Any]:
        """Plain data for the JSON result."""
        return asdict(self)


#: Defaults per device: a mid-size GPT on CUDA, a tiny one for CPU smoke runs.
DEFAULTS: dict[str, dict[str, Any]] = {
    "cuda": dict(layers=8, hidden=1024, heads=16, seq=512, vocab=32768, micro_batch=4, microbatches=2,
                 dtype="bf16"),
    "cpu": dict(layers=2, hidden=128, heads=4, seq=64, vocab=1024, micro_batch=2, microbatches=2, dtype="fp32"),
}


def add_args(p: argparse.ArgumentParser) -> None:
    """``--layers --hidden --heads --seq --vocab --micro-batch --microbatches --dtype`` (default: per device)."""
    for name in ("layers", "hidden", "heads", "seq", "vocab", "micro-batch", "microbatches"):
        p.add_argument(f"--{name}", type=int, default=None, help="default: per device (see _gpt.DEFAULTS)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on cuda, fp32 on cpu")


def spec_from_args(args: argparse.Namespace) -> GPTSpec:
    """The :class:`GPTSpec` the options select."""
    d = dict(DEFAULTS[args.device])
    for key in d:
        value = getattr(args, key, None)
        if value is not None:
            d[key] = value
    return GPTSpec(device=args.device, **d)


def _resolver(raw: bool) -> Any:
    if not raw:
        from mcore_compat import symbols

        return symbols.resolve
    import importlib

    where = {
        "TransformerConfig": "megatron.core.transformer.transformer_config",
        "GPTModel": "megatron.core.models.gpt.gpt_model",
        "get_gpt_layer_local_spec": "megatron.core.models.gpt.gpt_layer_specs",
        "Float16Module": "megatron.core.transformer.module",
        "model_parallel_cuda_manual_seed": "megatron.core.tensor_parallel.random",
    }
    return lambda name: getattr(importlib.import_module(where[name]), name)


def transformer_config(spec: GPTSpec, *, raw: bool = False) -> Any:
    """A fresh ``TransformerConfig`` (each model needs its own: the training hooks are set on it)."""
    import torch

    cls = _resolver(raw)("TransformerConfig")
    dtype = torch.bfloat16 if spec.dtype == "bf16" else torch.float32
    kwargs: dict[str, Any] = dict(
        num_layers=spec.layers, hidden_size=spec.hidden, ffn_hidden_size=4 * spec.hidden,
        num_attention_heads=spec.heads, use_cpu_initialization=spec.device == "cpu", params_dtype=dtype,
        pipeline_dtype=dtype, bf16=spec.dtype == "bf16", hidden_dropout=0.0, attention_dropout=0.0,
        masked_softmax_fusion=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, bias_activation_fusion=False, bias_gelu_fusion=False, apply_rope_fusion=False,
    )
    fields = set(getattr(cls, "__dataclass_fields__", {}))
    return cls(**{k: v for k, v in kwargs.items() if k in fields})


def build_gpt(spec: GPTSpec, seed: int, *, raw: bool = False) -> Any:
    """``GPTModel`` on ``spec.device`` (bf16: inside ``Float16Module``), weights from ``seed``.

    Needs ``parallel_state.initialize_model_parallel`` to have run.
    """
    import torch

    resolve = _resolver(raw)
    torch.manual_seed(seed)
    resolve("model_parallel_cuda_manual_seed")(seed)
    config = transformer_config(spec, raw=raw)
    model = resolve("GPTModel")(
        config=config, transformer_layer_spec=resolve("get_gpt_layer_local_spec")(), vocab_size=spec.vocab,
        max_sequence_length=spec.seq, pre_process=True, post_process=True,
        share_embeddings_and_output_weights=False, parallel_output=True,
    )
    if spec.device == "cuda":
        model = model.cuda(torch.cuda.current_device())
    if spec.dtype == "bf16":
        model = resolve("Float16Module")(config, model)
    return model


def copy_weights(src: Any, dst: Any) -> None:
    """Make ``dst``'s parameters equal to ``src``'s (same architecture; exact copies)."""
    import torch

    theirs = dict(src.named_parameters())
    with torch.no_grad():
        for name, p in dst.named_parameters():
            p.copy_(theirs[name])


def make_batches(spec: GPTSpec, seed: int, count: int) -> list[dict[str, Any]]:
    """``count`` micro-batches (tokens, labels, position ids, causal mask) on the device, from ``seed``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    mask = (torch.tril(torch.ones(spec.seq, spec.seq)).view(1, 1, spec.seq, spec.seq) < 0.5)
    pos = torch.arange(spec.seq).unsqueeze(0).expand(spec.micro_batch, spec.seq).contiguous()
    out = []
    for _ in range(count):
        tokens = torch.randint(0, spec.vocab, (spec.micro_batch, spec.seq), generator=g)
        labels = torch.randint(0, spec.vocab, (spec.micro_batch, spec.seq), generator=g)
        out.append({k: v.to(spec.device) for k, v in
                    dict(tokens=tokens, labels=labels, position_ids=pos, attention_mask=mask).items()})
    return out


def forward_step(data_iterator: Any, model: Any) -> tuple[Any, Any]:
    """Megatron's ``forward_step_func``: the GPT's per-token loss, averaged."""
    b = next(data_iterator)
    output = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])

    def loss_func(out: Any) -> tuple[Any, dict[str, Any]]:
        loss = out.float().mean()
        return loss, {"loss": loss.detach().clone()}

    return output, loss_func


def train_setup(spec: GPTSpec, seed: int, *, lr: float, weight_decay: float = 0.1,
                clip_grad: float = 1.0) -> tuple[Any, list[Any], Any]:
    """The benchmark GPT set up as RL/SFT runs train it, through mcore_compat: DDP (fp32 gradients for bf16), Adam
    with the distributed optimizer, weight decay on the weights only (biases and norms none), clipping, the
    training hooks. Returns ``(module, chunks, optimizer)``."""
    import torch

    from mcore_compat import training as mt

    bf16 = spec.dtype == "bf16"
    module = build_gpt(spec, seed)
    chunks = mt.wrap_ddp([module], ddp_config=mt.DDPConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=bf16))
    optimizer = mt.get_megatron_optimizer(mt.OptimConfig(
        optimizer="adam", lr=lr, weight_decay=weight_decay, clip_grad=clip_grad, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32, use_distributed_optimizer=True),
        chunks, no_weight_decay_cond=lambda n, p: n.endswith(".bias") or p.dim() == 1)
    mt.set_lr_and_weight_decay(optimizer, lr, weight_decay)
    mt.install_training_hooks(chunks, optimizer)
    return module, chunks, optimizer


def train_step(spec: GPTSpec, chunks: list[Any], optimizer: Any, batches: list[dict[str, Any]]) -> float:
    """One training step on ``batches`` (one micro-batch each); returns the mean micro-batch loss."""
    from mcore_compat import training as mt

    mt.zero_grad_buffer(chunks, optimizer)
    stored = mt.forward_backward(forward_step, iter(batches), chunks, len(batches), seq_length=spec.seq,
                                 micro_batch_size=spec.micro_batch)
    mt.optimizer_step(optimizer)
    return float(sum(float(s["loss"]) for s in stored) / len(stored)) if stored else float("nan")


def param_bytes(model: Any) -> int:
    """Bytes of all parameters (numel x element size)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
