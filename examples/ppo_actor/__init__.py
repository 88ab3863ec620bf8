"""A small Megatron PPO actor written only against ``mcore_compat`` (an example client, not library API).

Importing it imports no ``megatron`` module (mcore_compat resolves Megatron symbols lazily), so CPU patches can
still be applied afterwards. See README.md in this folder.
"""

from __future__ import annotations

from .actor import ActorConfig, PPOActor, concat_multi_modal, split_micro_batches
from .loss import LossConfig, agg_loss, compute_ppo_loss, kl_penalty, policy_loss
from .model import TinyGPTSpec, build_gpt, logprobs_and_entropy, setup_parallel

__all__ = [
    "ActorConfig",
    "LossConfig",
    "PPOActor",
    "TinyGPTSpec",
    "agg_loss",
    "build_gpt",
    "compute_ppo_loss",
    "concat_multi_modal",
    "kl_penalty",
    "logprobs_and_entropy",
    "policy_loss",
    "setup_parallel",
    "split_micro_batches",
]
