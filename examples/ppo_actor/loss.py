"""The actor's loss: one function for PPO and SFT, plain PyTorch (no Megatron), unit-testable on small tensors.

::

    out = {"log_probs": lp, "entropy": ent}                 # [batch, seq], from logprobs_and_entropy()
    data = {"loss_mask": m, "old_log_probs": old, "advantages": adv, "ref_log_probs": ref}
    loss, metrics = compute_ppo_loss(out, data, LossConfig(clip_ratio_c=3.0, use_kl_loss=True))
    loss, metrics = compute_ppo_loss(out, {"loss_mask": m, "loss_type": "sft"})   # masked NLL

The PPO loss is ``pg_loss - entropy_coeff * entropy + kl_loss_coef * kl_loss`` (each term accumulated with
``+=`` / ``-=`` onto one scalar); every term is aggregated over the masked tokens the same way
(:data:`LOSS_AGG_MODES`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "LOSS_TYPES",
    "LossConfig",
    "agg_loss",
    "compute_ppo_loss",
    "entropy_from_logits",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "policy_loss",
]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_TYPES = ("ppo", "sft")
#: The k3 estimator is clamped to this range (as verl does) so that one wild token cannot dominate.
K3_CLAMP = 10.0


@dataclass(frozen=True)
class LossConfig:
    """Settings of :func:`compute_ppo_loss`.

    Attributes:
        loss_type: ``"ppo"`` or ``"sft"`` (``data["loss_type"]`` overrides it per batch).
        clip_ratio_low, clip_ratio_high: the ratio is clipped to ``[1 - low, 1 + high]``.
        clip_ratio_c: dual-clip bound (> 1): for negative advantages the loss is at most ``-A * clip_ratio_c``;
            ``None`` = vanilla PPO clipping.
        entropy_coeff: weight of the entropy bonus (subtracted from the loss; 0 = entropy is only a metric).
        use_kl_loss: add ``kl_loss_coef * KL(actor || reference)`` (needs ``data["ref_log_probs"]``).
        kl_loss_coef: weight of the KL loss.
        kl_loss_type: KL estimator, one of :data:`KL_ESTIMATORS`.
        loss_agg_mode: one of :data:`LOSS_AGG_MODES`.
    """

    loss_type: str = "ppo"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = None
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 1e-3
    kl_loss_type: str = "k3"
    loss_agg_mode: str = "token-mean"

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {self.loss_agg_mode!r}")
        if self.kl_loss_type not in KL_ESTIMATORS:
            raise ValueError(f"kl_loss_type must be one of {KL_ESTIMATORS}, got {self.kl_loss_type!r}")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c (dual clip) must be > 1, got {self.clip_ratio_c}")


# --------------------------------------------------------------------------------------------------------------
# token-level helpers
# --------------------------------------------------------------------------------------------------------------

def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[..., label]`` in fp32 (logits over the *full* vocabulary, last dim)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` per position, in fp32 (logits over the full vocabulary)."""
    logits = logits.float()
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(dim=-1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the positions where ``mask`` is set (0 if none is)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Aggregate a ``[batch, seq]`` per-token loss over the masked tokens.

    * ``token-mean``: sum over all masked tokens / number of masked tokens.
    * ``seq-mean-token-sum``: per sequence the sum over its masked tokens, then the mean over sequences.
    * ``seq-mean-token-mean``: per sequence the mean over its masked tokens, then the mean over sequences.

    Sequences without any masked token are left out of the ``seq-mean-*`` means; with no masked token at all
    the result is 0 (still connected to the graph).
    """
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    token_sum = (loss_mat * mask).sum(dim=-1)
    count = mask.sum(dim=-1)
    if mode == "seq-mean-token-sum":
        per_seq = token_sum
    elif mode == "seq-mean-token-mean":
        per_seq = token_sum / count.clamp_min(1.0)
    else:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; use one of {LOSS_AGG_MODES}")
    valid = (count > 0).to(loss_mat.dtype)
    return (per_seq * valid).sum() / valid.sum().clamp_min(1.0)


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of ``KL(actor || reference)`` from log-probs of the sampled tokens.

    * ``k1``: ``log p - log q``
    * ``k2``: ``0.5 * (log p - log q)**2``
    * ``k3``: ``q/p - log(q/p) - 1`` (non-negative, low variance; clamped to +-:data:`K3_CLAMP`)
    """
    diff = log_probs - ref_log_probs
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff.square()
    if kind == "k3":
        log_ratio = -diff  # log(q / p)
        return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-K3_CLAMP, K3_CLAMP)
    raise ValueError(f"unknown KL estimator {kind!r}; use one of {KL_ESTIMATORS}")


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
) -> dict[str, torch.Tensor]:
    """The clipped PPO policy loss (vanilla or dual-clip) and its statistics.

    Returns:
        ``pg_loss`` (aggregated, with grad), ``pg_clipfrac`` (fraction of masked tokens where the clipped term
        is the larger loss), ``ppo_kl`` (masked mean of ``old - new`` log-prob), ``pg_clipfrac_lower`` (dual
        clip: fraction of masked tokens bounded by ``clip_ratio_c``; 0 for vanilla).
    """
    neg_approx_kl = log_probs - old_log_probs
    ratio = torch.exp(neg_approx_kl)
    ppo_kl = masked_mean(-neg_approx_kl, mask)
    losses1 = -advantages * ratio
    losses2 = -advantages * torch.clamp(ratio, 1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high)
    clipped = torch.maximum(losses1, losses2)
    clipfrac = masked_mean(torch.gt(losses2, losses1).float(), mask)
    if config.clip_ratio_c is None:
        per_token = clipped
        clipfrac_lower = torch.zeros((), dtype=clipped.dtype, device=clipped.device)
    else:
        losses3 = -advantages * config.clip_ratio_c
        dual = torch.minimum(losses3, clipped)
        negative = advantages < 0
        clipfrac_lower = masked_mean((torch.gt(clipped, losses3) & negative).float(), mask)
        per_token = torch.where(negative, dual, clipped)
    return {"pg_loss": agg_loss(per_token, mask, config.loss_agg_mode), "pg_clipfrac": clipfrac,
            "ppo_kl": ppo_kl, "pg_clipfrac_lower": clipfrac_lower}


# --------------------------------------------------------------------------------------------------------------
# the one loss function
# --------------------------------------------------------------------------------------------------------------

def _mask_of(data: Mapping[str, Any], like: torch.Tensor) -> torch.Tensor:
    mask = data.get("loss_mask", data.get("response_mask"))
    if mask is None:
        return torch.ones_like(like)
    return mask.to(device=like.device, dtype=like.dtype)


def compute_ppo_loss(
    model_output: Mapping[str, torch.Tensor],
    data: Mapping[str, Any],
    config: LossConfig | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The actor loss of one micro-batch: PPO (clipped policy loss, entropy bonus, KL loss) or SFT (masked NLL).

    Args:
        model_output: ``log_probs`` ``[batch, seq]`` (log-prob of each label token, with grad) and optionally
            ``entropy`` ``[batch, seq]`` (needed for PPO with ``entropy_coeff != 0``; otherwise only a metric).
        data: ``loss_mask`` (or ``response_mask``; default all ones); for PPO ``old_log_probs`` and
            ``advantages``, with ``use_kl_loss`` ``ref_log_probs``; optional ``loss_type`` (``"ppo"``/``"sft"``)
            overriding ``config.loss_type``.
        config: the loss settings (default :class:`LossConfig()`).

    Returns:
        ``(loss, metrics)``: a scalar loss with grad and detached scalar metrics. PPO: ``actor/pg_loss``,
        ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower``, ``actor/ppo_kl``, ``actor/entropy`` (if given),
        ``actor/kl_loss`` (with ``use_kl_loss``). SFT: ``actor/sft_loss``, ``actor/entropy`` (if given).
    """
    config = config or LossConfig()
    loss_type = data.get("loss_type", config.loss_type)
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    log_probs = model_output["log_probs"]
    entropy = model_output.get("entropy")
    mask = _mask_of(data, log_probs)
    mode = config.loss_agg_mode
    metrics: dict[str, torch.Tensor] = {}

    loss = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    if loss_type == "sft":
        nll = agg_loss(-log_probs, mask, mode)
        loss += nll
        metrics["actor/sft_loss"] = nll
    else:
        pg = policy_loss(log_probs, data["old_log_probs"].to(log_probs), data["advantages"].to(log_probs),
                         mask, config)
        loss += pg["pg_loss"]
        metrics.update({f"actor/{k}": v for k, v in pg.items()})
        if config.entropy_coeff != 0.0:
            if entropy is None:
                raise ValueError("entropy_coeff != 0 needs model_output['entropy']")
            loss -= config.entropy_coeff * agg_loss(entropy, mask, mode)
        if config.use_kl_loss:
            if "ref_log_probs" not in data:
                raise ValueError("use_kl_loss needs data['ref_log_probs']")
            kl = agg_loss(kl_penalty(log_probs, data["ref_log_probs"].to(log_probs), config.kl_loss_type),
                          mask, mode)
            loss += config.kl_loss_coef * kl
            metrics["actor/kl_loss"] = kl
    if entropy is not None:
        metrics["actor/entropy"] = agg_loss(entropy.detach(), mask, mode)
    return loss, {k: v.detach().clone() for k, v in metrics.items()}
