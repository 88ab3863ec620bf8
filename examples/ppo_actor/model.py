"""The actor's network: a tiny GPT from Megatron's local (TransformerEngine-free) layer spec, through mcore_compat.

Nothing here imports ``megatron`` directly: every Megatron symbol is resolved through ``mcore_compat`` (which
imports lazily), so importing this module is cheap and the CPU patches can still be applied afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import mcore_compat as mc

from .loss import entropy_from_logits, logprobs_from_logits

__all__ = [
    "TinyGPTSpec",
    "build_gpt",
    "causal_mask",
    "copy_weights",
    "logprobs_and_entropy",
    "position_ids",
    "setup_parallel",
    "transformer_config",
]


@dataclass(frozen=True)
class TinyGPTSpec:
    """Sizes of the tiny GPT (vocab must be divisible by the tensor-parallel size: no vocab padding here)."""

    vocab_size: int = 64
    hidden_size: int = 32
    ffn_hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    max_seq_len: int = 16


def setup_parallel(tp: int = 1, seed: int = 1234) -> None:
    """(Re)initialise Megatron's model-parallel groups with tensor-parallel size ``tp`` and seed the RNGs.

    ``torch.distributed`` must already be initialised (``mcore_compat.launch.spawn`` / ``init_from_env``).
    """
    ps = mc.parallel_state
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(seed)
    mc.model_parallel_cuda_manual_seed(seed)


def transformer_config(spec: TinyGPTSpec, tp: int = 1) -> Any:
    """A ``TransformerConfig`` for ``spec`` (fp32; fusions that need CUDA kernels or apex off; no dropout)."""
    cls = mc.TransformerConfig
    kwargs: dict[str, Any] = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads, tensor_model_parallel_size=tp,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        bias_activation_fusion=False, bias_gelu_fusion=False, apply_rope_fusion=False,
    )
    fields = set(getattr(cls, "__dataclass_fields__", {}))  # option names differ between releases
    return cls(**{k: v for k, v in kwargs.items() if k in fields})


def build_gpt(spec: TinyGPTSpec, tp: int = 1, device: str = "cpu") -> Any:
    """A ``GPTModel`` (local layer spec, untied output layer, vocab-parallel logits) on ``device``."""
    model = mc.GPTModel(
        config=transformer_config(spec, tp), transformer_layer_spec=mc.get_gpt_layer_local_spec(),
        vocab_size=spec.vocab_size, max_sequence_length=spec.max_seq_len, pre_process=True, post_process=True,
        share_embeddings_and_output_weights=False, parallel_output=True,
    )
    return model.to(device)


def copy_weights(src: Any, dst: Any) -> None:
    """Copy every parameter of ``src`` into ``dst`` by name (both unwrapped, same sharding)."""
    params = dict(src.named_parameters())
    with torch.no_grad():
        for name, p in dst.named_parameters():
            p.copy_(params[name])


def causal_mask(seq_len: int, device: Any = "cpu") -> torch.Tensor:
    """Megatron's attention mask: ``[1, 1, s, s]`` bool, ``True`` where attention is *not* allowed."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1).view(
        1, 1, seq_len, seq_len)


def position_ids(batch: int, seq_len: int, device: Any = "cpu") -> torch.Tensor:
    """``[batch, seq]`` positions 0 .. seq_len-1."""
    return torch.arange(seq_len, device=device).unsqueeze(0).expand(batch, seq_len).contiguous()


def logprobs_and_entropy(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Log-prob of each label token and the entropy per position, correct for vocab-parallel logits.

    ``logits`` ``[batch, seq, vocab / tp]`` is this rank's vocab shard (GPTModel with ``parallel_output=True``).
    With TP > 1 the shards are all-gathered over the tensor-parallel group first
    (``tensor_parallel.gather_from_tensor_model_parallel_region``, whose backward hands each rank the gradient
    of its own shard); the model is tiny, so the full ``[b, s, vocab]`` tensor is cheap. Then plain fp32
    log-softmax / entropy.
    """
    if mc.parallel_state.get_tensor_model_parallel_world_size() > 1:
        logits = mc.tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    return {"log_probs": logprobs_from_logits(logits, labels), "entropy": entropy_from_logits(logits)}
