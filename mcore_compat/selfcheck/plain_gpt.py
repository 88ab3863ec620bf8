"""The self-check's two models written from the math in plain PyTorch (float64, no Megatron code): the tiny GPT of
Megatron's local layer spec and the tensor-parallel MLP, on FULL (unsharded) weights keyed by Megatron's parameter
names (a transformer layer's index replaced by its global ``layer_number``: ``decoder.layers.<n>.<rest>``).

The GPT, as ``GPTModel`` with the local spec computes it in every release 0.4 ... 0.19 (the settings that change
the math are read from the ``TransformerConfig``; :func:`unmodelled` names those this module does not model):

* input: word embedding + learned absolute position embedding (``position_embedding_type="learned_absolute"``,
  models/common/embeddings/language_model_embedding.py), [b, s, h] -> [s, b, h];
* each layer: pre-LayerNorm (``layernorm_epsilon``; ``layernorm_zero_centered_gamma``: weight + 1) -> fused QKV
  projection -> per query group ``[q (np/ng heads), k, v]`` (transformer/attention.py
  ``get_query_key_value_tensors``: ``[s, b, ng, (np/ng + 2) * hn]``, the same in 0.4.0 ... 0.19.2) -> scores
  ``q k^T * softmax_scale`` (``1/sqrt(kv_channels)`` unless ``softmax_scale`` is set;
  ``apply_query_key_layer_scaling`` divides by the layer number before the softmax and multiplies after: the
  same value) -> masked positions (the mask's ``True``) set to -10000 (``attention_mask_func``) -> softmax ->
  ``probs v`` -> output projection -> residual add; pre-LayerNorm -> fc1 -> GELU -> fc2 -> residual add; linear
  biases where the model has them;
* final LayerNorm, output layer (the word embedding when tied), per-token cross-entropy, mean.

The MLP (:func:`~.models.build_chunks` with ``model="mlp"``): ``fc2(gelu(fc1(x)))``, loss mean squared error.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["MASK_FILL", "attention_settings", "gpt_loss", "gpt_token_losses", "mlp_loss", "mlp_squared_errors",
           "unmodelled"]

#: What Megatron's ``attention_mask_func`` writes into masked attention scores (transformer/utils.py).
MASK_FILL = -10000.0

#: TransformerConfig settings that change the math, with the value this module models (a field the release does not
#: have is taken as that value).
_MODELLED: dict[str, Any] = {
    "normalization": "LayerNorm", "gated_linear_unit": False, "qk_layernorm": False, "qk_l2_norm": False,
    "apply_residual_connection_post_layernorm": False, "multi_latent_attention": False,
    "attention_output_gate": False, "use_mup": False, "window_size": None, "softmax_type": "vanilla",
    "linear_attention_freq": None, "activation_func_clamp_value": None, "mtp_num_layers": None,
    "num_moe_experts": None, "hidden_dropout": 0.0, "attention_dropout": 0.0,
}


def unmodelled(config: Any, core: Any) -> str | None:
    """Why the float64 model cannot stand for ``core`` (a GPTModel of ``config``), or ``None``."""
    import torch

    for name, value in _MODELLED.items():
        have = getattr(config, name, value)
        if have != value and not (value is None and have in (0, None)):
            return f"the reference does not model {name}={have!r}"
    if getattr(config, "activation_func", torch.nn.functional.gelu) is not torch.nn.functional.gelu:
        return f"the reference models GELU, the config has activation_func={config.activation_func!r}"
    position = getattr(core, "position_embedding_type", "learned_absolute")
    if position != "learned_absolute":
        return f"the reference models learned absolute position embeddings, the model has {position!r}"
    return None


def _norm(x: Any, w: dict[str, Any], prefix: str, cfg: dict[str, Any]) -> Any:
    import torch

    weight = w[f"{prefix}.weight"]
    if cfg["zero_centered_gamma"]:
        weight = weight + 1.0
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, w.get(f"{prefix}.bias"), cfg["eps"])


def _linear(x: Any, w: dict[str, Any], prefix: str) -> Any:
    y = x @ w[f"{prefix}.weight"].t()
    bias = w.get(f"{prefix}.bias")
    return y if bias is None else y + bias


def _attention(x: Any, w: dict[str, Any], prefix: str, mask: Any, cfg: dict[str, Any]) -> Any:
    import torch

    s, b, _ = x.shape
    heads, groups, hn = cfg["heads"], cfg["groups"], cfg["head_dim"]
    per = heads // groups
    qkv = _linear(x, w, f"{prefix}.linear_qkv").view(s, b, groups, (per + 2) * hn)
    q, k, v = torch.split(qkv, [per * hn, hn, hn], dim=3)
    q = q.reshape(s, b, heads, hn)
    k = k.repeat_interleave(per, dim=2)  # each query head reads its group's key and value
    v = v.repeat_interleave(per, dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) * cfg["scale"]  # [b, np, sq, sk]
    scores = scores.masked_fill(mask, MASK_FILL)
    probs = torch.softmax(scores, dim=-1)
    context = torch.einsum("bnst,tbnd->sbnd", probs, v).reshape(s, b, heads * hn)
    return _linear(context, w, f"{prefix}.linear_proj")


def gpt_loss(w: dict[str, Any], cfg: dict[str, Any], tokens: Any, labels: Any, position_ids: Any,
             mask: Any) -> Any:
    """The mean per-token cross-entropy of one micro-batch (see :func:`gpt_token_losses`)."""
    return gpt_token_losses(w, cfg, tokens, labels, position_ids, mask).mean()


def gpt_token_losses(w: dict[str, Any], cfg: dict[str, Any], tokens: Any, labels: Any, position_ids: Any,
                     mask: Any) -> Any:
    """The per-token cross-entropy [b, s] of ``tokens``/``labels``/``position_ids`` [b, s] (``mask`` [1, 1, s, s]
    with ``True`` = masked) under the full weights ``w``; samples are independent, so micro-batches can be
    stacked along b.

    ``cfg``: ``heads``, ``groups`` (query groups), ``head_dim``, ``scale``, ``eps``, ``zero_centered_gamma``,
    ``layers`` (the global layer numbers in order) and ``tied`` (the output layer is the word embedding).
    """
    import torch

    h = w["embedding.word_embeddings.weight"][tokens]
    if "embedding.position_embeddings.weight" in w:
        h = h + w["embedding.position_embeddings.weight"][position_ids]
    h = h.transpose(0, 1)  # [s, b, h]
    for n in cfg["layers"]:
        p = f"decoder.layers.{n}"
        h = h + _attention(_norm(h, w, f"{p}.input_layernorm", cfg), w, f"{p}.self_attention", mask, cfg)
        x = _norm(h, w, f"{p}.pre_mlp_layernorm", cfg)
        h = h + _linear(torch.nn.functional.gelu(_linear(x, w, f"{p}.mlp.linear_fc1")), w, f"{p}.mlp.linear_fc2")
    h = _norm(h, w, "decoder.final_layernorm", cfg)
    out = w["embedding.word_embeddings.weight"] if cfg["tied"] else w["output_layer.weight"]
    logits = h @ out.t()  # [s, b, vocab]
    target = labels.transpose(0, 1)
    ce = torch.logsumexp(logits, dim=-1) - logits.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return ce.transpose(0, 1)  # [b, s], as GPTModel returns it


def mlp_loss(w: dict[str, Any], x: Any, target: Any) -> Any:
    """The MLP's mean squared error on one micro-batch (``x``, ``target`` [s, b, h])."""
    return mlp_squared_errors(w, x, target).mean()


def mlp_squared_errors(w: dict[str, Any], x: Any, target: Any) -> Any:
    """The MLP's squared error per element [s, b, h] (samples independent: micro-batches stack along b)."""
    import torch

    y = _linear(torch.nn.functional.gelu(_linear(x, w, "fc1")), w, "fc2")
    return (y - target) ** 2


def attention_settings(config: Any) -> dict[str, Any]:
    """``heads``, ``groups``, ``head_dim``, ``scale``, ``eps``, ``zero_centered_gamma`` of ``config``."""
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "kv_channels", None) or config.hidden_size // heads)
    scale = getattr(config, "softmax_scale", None)
    return {"heads": heads, "groups": int(getattr(config, "num_query_groups", None) or heads), "head_dim": head_dim,
            "scale": float(scale) if scale is not None else 1.0 / math.sqrt(head_dim),
            "eps": float(getattr(config, "layernorm_epsilon", 1e-5)),
            "zero_centered_gamma": bool(getattr(config, "layernorm_zero_centered_gamma", False))}
