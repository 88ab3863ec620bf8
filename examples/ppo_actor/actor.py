"""A Megatron PPO actor written only against ``mcore_compat``: DDP, optimizer, hooks, schedule, weight binding.

::

    setup_parallel(tp=2)
    actor = PPOActor(ActorConfig(tp=2, use_distributed_optimizer=True, loss=LossConfig(clip_ratio_c=3.0)))
    batch["old_log_probs"] = actor.compute_log_prob(batch)["log_probs"]
    metrics = actor.update_policy(batch)     # {"actor/pg_loss": ..., "actor/grad_norm": ..., ...}
    binding = actor.bind_params()            # flat buffers + manifest for handing the weights to a rollout engine

A batch is a dict of ``[batch, seq]`` tensors: ``input_ids``, ``labels`` (the token predicted at each
position), ``loss_mask`` and, for PPO, ``old_log_probs``, ``advantages`` (``ref_log_probs`` with the KL loss);
``position_ids`` is optional. Attention is causal (right padding is fine: mask it out with ``loss_mask``).
Non-tensor entries (e.g. ``loss_type="sft"``) reach the loss of every micro-batch unchanged.

``multi_modal_inputs`` (optional): a list with one ``{name: tensor}`` dict per sample. An empty list is ignored;
a non-empty one is concatenated per micro-batch along dim 0 (:func:`concat_multi_modal`) and handed to the
forward step, where this text-only model ignores it with a one-time warning on rank 0.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import mcore_compat as mc
from mcore_compat import training as mt

from .loss import LossConfig, compute_ppo_loss
from .model import TinyGPTSpec, build_gpt, causal_mask, copy_weights, logprobs_and_entropy, position_ids

__all__ = ["ActorConfig", "PPOActor", "concat_multi_modal", "split_micro_batches"]

Batch = Mapping[str, Any]


@dataclass
class ActorConfig:
    """Settings of :class:`PPOActor` (fp32 parameters, Adam, no pipeline parallelism).

    Attributes:
        tp: tensor-parallel size; must match ``parallel_state`` (see :func:`~ppo_actor.model.setup_parallel`).
        use_distributed_optimizer: shard the optimizer state over data-parallel ranks.
        lr, weight_decay, clip_grad: Adam settings (``clip_grad`` = max global grad norm, 0 = off).
        micro_batch_size: samples per micro-batch of the forward/backward schedule.
        device: ``"cpu"`` or ``"cuda"``.
        model: sizes of the tiny GPT.
        loss: the loss settings (:class:`~ppo_actor.loss.LossConfig`).
    """

    tp: int = 1
    use_distributed_optimizer: bool = False
    lr: float = 1e-2
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    micro_batch_size: int = 2
    device: str = "cpu"
    model: TinyGPTSpec = field(default_factory=TinyGPTSpec)
    loss: LossConfig = field(default_factory=LossConfig)


# --------------------------------------------------------------------------------------------------------------
# micro-batches
# --------------------------------------------------------------------------------------------------------------

def concat_multi_modal(mm_inputs: Sequence[Mapping[str, torch.Tensor]] | None, start: int,
                       end: int) -> dict[str, torch.Tensor] | None:
    """The multi-modal inputs of samples ``start:end``, concatenated per key along dim 0.

    ``None`` when there are none: no list, an empty list (text-only batch), or only empty dicts in the range.
    Never concatenates an empty list.
    """
    if not mm_inputs:
        return None
    items = [d for d in mm_inputs[start:end] if d]
    if not items:
        return None
    keys = list(dict.fromkeys(k for d in items for k in d))
    return {k: torch.cat([d[k] for d in items if k in d], dim=0) for k in keys}


def split_micro_batches(batch: Batch, micro_batch_size: int, device: Any = "cpu") -> list[dict[str, Any]]:
    """Cut a batch into micro-batches: tensors along dim 0, other values copied, ``multi_modal_inputs``
    concatenated per micro-batch (:func:`concat_multi_modal`); adds ``position_ids`` and ``attention_mask``."""
    input_ids = batch["input_ids"]
    size, seq = input_ids.shape
    if size % micro_batch_size:
        raise ValueError(f"batch size {size} is not a multiple of micro_batch_size {micro_batch_size}")
    mm = batch.get("multi_modal_inputs")
    if mm and len(mm) != size:
        raise ValueError(f"multi_modal_inputs has {len(mm)} entries for {size} samples")
    mask = causal_mask(seq, device)
    out = []
    for start in range(0, size, micro_batch_size):
        end = start + micro_batch_size
        mb: dict[str, Any] = {}
        for key, value in batch.items():
            if key == "multi_modal_inputs":
                continue
            mb[key] = value[start:end].to(device) if torch.is_tensor(value) and value.dim() > 0 else value
        mb.setdefault("position_ids", position_ids(end - start, seq, device))
        mb["attention_mask"] = mask
        mb["multi_modal_inputs"] = concat_multi_modal(mm, start, end)
        out.append(mb)
    return out


# --------------------------------------------------------------------------------------------------------------
# the actor
# --------------------------------------------------------------------------------------------------------------

class PPOActor:
    """A tiny GPT trained with PPO/SFT through Megatron's DDP, optimizer and schedules (via ``mcore_compat``).

    ``parallel_state`` must be initialised with tensor-parallel size ``config.tp`` before construction.
    """

    def __init__(self, config: ActorConfig, *, init_from: Any = None, verbose: bool = True) -> None:
        """Build the model, wrap it in DDP, build the optimizer and install the training hooks.

        Args:
            config: the settings.
            init_from: an unwrapped model of the same shape whose weights are copied in before DDP and the
                optimizer are built (default: Megatron's random init from the seeded RNG).
            verbose: print the config and one line per update (rank 0 only).
        """
        self.config = config
        self.verbose = verbose
        self.module = build_gpt(config.model, config.tp, config.device)
        if init_from is not None:
            copy_weights(init_from, self.module)
        self.model: list[Any] = mt.wrap_ddp(
            [self.module], ddp_config=mt.DDPConfig(use_distributed_optimizer=config.use_distributed_optimizer))
        self.optimizer = mt.get_megatron_optimizer(
            mt.OptimConfig(optimizer="adam", lr=config.lr, weight_decay=config.weight_decay,
                           clip_grad=config.clip_grad, params_dtype=torch.float32,
                           use_distributed_optimizer=config.use_distributed_optimizer),
            self.model)
        mt.install_training_hooks(self.model, self.optimizer)  # finalize_model_grads_func on the real config
        self._binding: Any = None
        self.updates = 0
        if verbose:
            mc.print_rank_0(f"PPOActor on megatron-core {mc.MCORE_VERSION}:")
            mc.print_rank_0(config)

    # ---------------------------------------------------------------------------------------------- helpers
    def make_reference(self) -> Any:
        """A frozen, unwrapped copy of the current weights (for ``ref_log_probs`` / KL)."""
        ref = build_gpt(self.config.model, self.config.tp, self.config.device)
        copy_weights(self.module, ref)
        ref.requires_grad_(False)
        return ref

    def bind_params(self) -> Any:
        """The actor's weights bound to flat buffers (``mcore_compat.bind_params``; made once, then cached).

        Zero-copy on Megatron's own parameter buffer with the distributed optimizer (0.6+), else flat buffers
        in DDP's layout that every ``param.data`` points into. Hand ``binding.flat_buffers()`` and
        ``binding.manifest()`` to the rollout engine; ``binding.verify()`` checks nothing was rebound.
        """
        if self._binding is None:
            self._binding = mc.bind_params(self.model)
        return self._binding

    def _micro_batches(self, batch: Batch) -> list[dict[str, Any]]:
        return split_micro_batches(batch, self.config.micro_batch_size, self.config.device)

    @staticmethod
    def _forward(model: Any, mb: Mapping[str, Any]) -> torch.Tensor:
        if mb.get("multi_modal_inputs") is not None:
            mc.warn_once_rank_0("ppo_actor: the tiny GPT is text-only; multi_modal_inputs are ignored")
        return model(mb["input_ids"], mb["position_ids"], mb["attention_mask"])

    def _schedule(self, forward_step: Any, micro: list[dict[str, Any]], model: list[Any], **kwargs: Any) -> list:
        return mt.forward_backward(forward_step, iter(micro), model, len(micro),
                                   seq_length=micro[0]["input_ids"].shape[1],
                                   micro_batch_size=self.config.micro_batch_size, **kwargs)

    # ---------------------------------------------------------------------------------------------- forward
    @torch.no_grad()
    def compute_log_prob(self, batch: Batch, model: Any = None) -> dict[str, torch.Tensor]:
        """``{"log_probs", "entropy"}`` ``[batch, seq]`` of the actor (or of ``model``, e.g. a reference)."""
        micro = self._micro_batches(batch)

        def forward_step(data_iterator: Iterator[dict[str, Any]], chunk: Any) -> Any:
            mb = next(data_iterator)
            logits = self._forward(chunk, mb)

            def loss_func(output: torch.Tensor) -> Any:
                out = logprobs_and_entropy(output, mb["labels"])
                return torch.zeros((), device=output.device), {k: v.detach().clone() for k, v in out.items()}

            return logits, loss_func

        stored = self._schedule(forward_step, micro, self.model if model is None else [model], forward_only=True)
        return {k: torch.cat([d[k] for d in stored]) for k in ("log_probs", "entropy")}

    # ---------------------------------------------------------------------------------------------- update
    def update_policy(self, batch: Batch, *, check_hooks: bool = True) -> dict[str, float]:
        """One optimizer step on ``batch`` (all micro-batches through Megatron's forward/backward schedule).

        Args:
            batch: see the module docstring; ``batch["loss_type"] = "sft"`` trains on the masked NLL instead.
            check_hooks: refuse to run without ``finalize_model_grads_func`` (only tests turn this off).

        Returns:
            The loss metrics averaged over micro-batches and data-parallel ranks, plus ``actor/grad_norm``
            (the global norm before clipping, from the optimizer step) and ``actor/update_successful``.
        """
        micro = self._micro_batches(batch)
        loss_config = self.config.loss

        def forward_step(data_iterator: Iterator[dict[str, Any]], chunk: Any) -> Any:
            mb = next(data_iterator)
            logits = self._forward(chunk, mb)

            def loss_func(output: torch.Tensor) -> Any:
                return compute_ppo_loss(logprobs_and_entropy(output, mb["labels"]), mb, loss_config)

            return logits, loss_func

        mt.zero_grad_buffer(self.model, self.optimizer)
        stored = self._schedule(forward_step, micro, self.model, check_hooks=check_hooks)
        ok, grad_norm, _ = mt.optimizer_step(self.optimizer)
        metrics = self._reduce(stored)
        metrics["actor/grad_norm"] = float("nan") if grad_norm is None else grad_norm
        metrics["actor/update_successful"] = float(ok)
        self.updates += 1
        if self.verbose:
            mc.print_rank_0(f"update {self.updates}: " + " ".join(f"{k}={v:.6g}" for k, v in metrics.items()))
        mc.log_rank_0("ppo_actor update %d: %s", self.updates, metrics)
        return metrics

    @staticmethod
    def _reduce(stored: list[Mapping[str, torch.Tensor]]) -> dict[str, float]:
        """Mean of every metric over micro-batches, then over the data-parallel group (same on every rank)."""
        import torch.distributed as dist

        keys = sorted(stored[0])
        values = torch.stack([torch.stack([d[k].float() for d in stored]).mean() for k in keys])
        group = mc.parallel_state.get_data_parallel_group()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(values, group=group)
            values /= dist.get_world_size(group)
        return {k: float(v) for k, v in zip(keys, values.tolist(), strict=True)}
