"""Scenarios for test_actor_mcore.py, run on every rank of ONE 2-rank gloo group by ``mcore_compat.launch.spawn``.

``run_all()`` runs every configuration (DP=2 / TP=2, distributed optimizer off / on) in one process group,
destroying Megatron's model-parallel state between them, and returns plain data (floats, bools, text); the
pytest side only asserts. For each configuration, next to the actor:

* a plain-PyTorch reference: an unwrapped copy of the model with the same initial weights and data, autograd
  gradients averaged over data-parallel ranks, L2 norm with tensor-parallel shards counted once;
* a frozen actor (lr = 0) and, at DP=2, an actor whose ``finalize_model_grads_func`` was removed.

Importable in the spawned children: ``examples/`` is on ``sys.path`` (multiprocessing hands it down).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import traceback
import warnings
from dataclasses import dataclass
from typing import Any

B, S = 4, 8  # samples per data-parallel rank, sequence length
LR = 1e-2
SEED = 1234


@dataclass(frozen=True)
class Case:
    """One configuration of the 2-rank group."""

    name: str
    tp: int
    distopt: bool
    agg: str  # loss aggregation mode used in this case (all three get exercised through Megatron)


CASES = (
    Case("dp2-plainopt", 1, False, "token-mean"),
    Case("dp2-distopt", 1, True, "seq-mean-token-mean"),
    Case("tp2-plainopt", 2, False, "seq-mean-token-sum"),
    Case("tp2-distopt", 2, True, "token-mean"),
)
CASE_NAMES = tuple(c.name for c in CASES)
#: Known, harmless warnings of torch's gloo collectives and Megatron's CPU fallbacks (kept out of the test log).
NOISE = (".*reduce_scatter_tensor.*", ".*all_gather_into_tensor.*", ".*is not a leaf Tensor.*",
         ".*requires_grad=True to a scalar.*", ".*Apex is not installed.*", ".*cuda_graph_scope.*")


def apply_patches() -> list[str]:
    """The CPU harness patches for the detected release; before megatron is imported."""
    from mcore_compat import patches

    patches.apply_for_device("cpu")
    return patches.applied()  # all of this process's (earlier work on the same ranks may have applied them)


def make_batch(vocab: int, dp_rank: int) -> dict[str, Any]:
    """``B`` sequences for data-parallel rank ``dp_rank``: prompts of different lengths (masked out), one
    right-padded sample, per-token advantages, and an empty ``multi_modal_inputs`` list."""
    import torch

    g = torch.Generator().manual_seed(1000 + 17 * dp_rank)
    seq = torch.randint(0, vocab, (B, S + 1), generator=g)
    mask = torch.zeros(B, S)
    for b in range(B):
        mask[b, 1 + b:] = 1.0  # prompt of 1 + b tokens
    mask[0, -2:] = 0.0  # right padding
    return {"input_ids": seq[:, :-1].contiguous(), "labels": seq[:, 1:].contiguous(), "loss_mask": mask,
            "advantages": torch.randn(B, S, generator=g), "noise": torch.randn(B, S, generator=g),
            "multi_modal_inputs": []}


def _masked_max_abs(a: Any, b: Any, mask: Any) -> float:
    return float(((a - b).abs() * mask).max())


def reference_step(twin: Any, batch: dict[str, Any], config: Any) -> dict[str, Any]:
    """Plain PyTorch on the unwrapped copy: loss per micro-batch / M, autograd, DP mean, TP-aware L2 norm."""
    import torch
    import torch.distributed as dist

    import mcore_compat as mc
    from ppo_actor import compute_ppo_loss, logprobs_and_entropy, split_micro_batches

    ps = mc.parallel_state
    twin.zero_grad(set_to_none=True)
    micro = split_micro_batches(batch, config.micro_batch_size)
    pg_losses = []
    for mb in micro:
        logits = twin(mb["input_ids"], mb["position_ids"], mb["attention_mask"])
        loss, metrics = compute_ppo_loss(logprobs_and_entropy(logits, mb["labels"]), mb, config.loss)
        (loss / len(micro)).backward()
        pg_losses.append(float(metrics["actor/pg_loss"]))
    dp_group, dp = ps.get_data_parallel_group(), ps.get_data_parallel_world_size()
    tp_rank = ps.get_tensor_model_parallel_rank()
    sq = torch.zeros((), dtype=torch.float64)
    for p in twin.parameters():
        g = p.grad.detach().double().clone()
        dist.all_reduce(g, group=dp_group)
        g /= dp
        if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:  # TP shards once, replicas once
            sq += g.square().sum()
    dist.all_reduce(sq, group=ps.get_tensor_model_parallel_group())
    twin.zero_grad(set_to_none=True)
    pg = torch.tensor(sum(pg_losses) / len(pg_losses))
    dist.all_reduce(pg, group=dp_group)
    return {"grad_norm": float(sq.sqrt()), "pg_loss": float(pg) / dp}


def _snapshot(module: Any) -> dict[str, Any]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _run_case(case: Case) -> dict[str, Any]:
    import torch

    import mcore_compat as mc
    from ppo_actor import ActorConfig, LossConfig, PPOActor, build_gpt, setup_parallel
    from ppo_actor.loss import kl_penalty, masked_mean
    from ppo_actor.model import copy_weights

    out: dict[str, Any] = {"status": "ok"}
    captured = io.StringIO()
    setup_parallel(case.tp, SEED)
    ps = mc.parallel_state
    loss = LossConfig(clip_ratio_c=3.0, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1,
                      kl_loss_type="k3", loss_agg_mode=case.agg)
    config = ActorConfig(tp=case.tp, use_distributed_optimizer=case.distopt, lr=LR, loss=loss)
    with contextlib.redirect_stdout(captured):
        actor = PPOActor(config)
    twin = build_gpt(config.model, case.tp)  # the plain reference: same initial weights, never stepped
    copy_weights(actor.module, twin)
    batch = make_batch(config.model.vocab_size, ps.get_data_parallel_rank())
    mask = batch["loss_mask"]

    with contextlib.redirect_stdout(captured), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        current = actor.compute_log_prob(batch)
        reference = actor.compute_log_prob(batch, model=twin)
        mm = [{"pixel_values": torch.randn(1, 3)} for _ in range(B)]
        with_mm = actor.compute_log_prob({**batch, "multi_modal_inputs": mm})
    out["mm_warnings"] = [str(w.message) for w in caught if "multi_modal_inputs" in str(w.message)]
    out["mm_same_log_probs"] = bool(torch.equal(with_mm["log_probs"], current["log_probs"]))
    out["kl_before_update"] = _masked_max_abs(current["log_probs"], reference["log_probs"], mask)

    if case.tp > 1:  # our gathered log-probs vs Megatron's own vocab-parallel cross entropy
        mb = {k: v[:2] for k, v in batch.items() if torch.is_tensor(v)}
        from ppo_actor.actor import split_micro_batches
        from ppo_actor.model import logprobs_and_entropy

        first = split_micro_batches(mb, 2)[0]
        with torch.no_grad():
            logits = twin(first["input_ids"], first["position_ids"], first["attention_mask"])
            ours = logprobs_and_entropy(logits, first["labels"])["log_probs"]
            ce = mc.tensor_parallel.vocab_parallel_cross_entropy(logits.float().clone(), first["labels"])
        out["tp_logprob_vs_megatron_ce"] = float((ours + ce).abs().max())

    batch["old_log_probs"] = current["log_probs"] + 0.3 * batch["noise"]  # ratios != 1: clipping happens
    batch["ref_log_probs"] = reference["log_probs"]
    ref = reference_step(twin, batch, config)
    out["reference"] = ref

    binding = actor.bind_params()
    out["binding_mode"] = binding.mode
    flat_before = [f.clone() for f in binding.flat_buffers()]
    before = _snapshot(actor.module)
    with contextlib.redirect_stdout(captured):
        metrics = actor.update_policy(batch)
    after = _snapshot(actor.module)
    out["metrics"] = metrics
    out["params_changed"] = sum(not torch.equal(before[n], after[n]) for n in before)
    out["params_total"] = len(before)
    out["flat_changed"] = [not torch.equal(a, b) for a, b in zip(flat_before, binding.flat_buffers(), strict=True)]
    views = binding.named_views()
    out["views_equal_params"] = all(torch.equal(views[n], after[n]) for n in views)
    try:
        binding.verify()
        out["binding_verified"] = True
    except Exception as exc:  # reported, asserted on the pytest side
        out["binding_verified"] = False
        out["binding_error"] = str(exc)

    with contextlib.redirect_stdout(captured):
        new = actor.compute_log_prob(batch)
    lp_new, lp_ref = new["log_probs"], reference["log_probs"]
    out["kl_after_update_k1_abs"] = _masked_max_abs(lp_new, lp_ref, mask)
    out["kl_after_update_k3"] = float(masked_mean(kl_penalty(lp_new, lp_ref, "k3"), mask))

    # frozen actor: lr = 0 from the same initial weights -> identical log-probs; then SFT through the same path
    with contextlib.redirect_stdout(captured):
        frozen = PPOActor(dataclasses.replace(config, lr=0.0), init_from=twin, verbose=False)
        frozen_metrics = frozen.update_policy(batch)
        frozen_lp = frozen.compute_log_prob(batch)["log_probs"]
        sft = frozen.update_policy({**batch, "loss_type": "sft"})
    out["frozen_grad_norm"] = frozen_metrics["actor/grad_norm"]
    out["frozen_kl"] = _masked_max_abs(frozen_lp, lp_ref, mask)
    out["sft_metrics"] = sft
    out["sft_reference"] = _sft_reference(lp_ref, mask, config)

    if ps.get_data_parallel_world_size() > 1:  # the finalize hook removed: no DP gradient reduction
        with contextlib.redirect_stdout(captured):
            nohook = PPOActor(config, init_from=twin, verbose=False)
            mc.get_model_config(nohook.model[0]).finalize_model_grads_func = None
            out["nohook_grad_norm"] = nohook.update_policy(batch, check_hooks=False)["actor/grad_norm"]
    out["stdout"] = captured.getvalue()
    return out


def _sft_reference(log_probs: Any, mask: Any, config: Any) -> float:
    """The SFT loss metric by hand: aggregated NLL per micro-batch, mean over micro-batches and DP ranks."""
    import torch
    import torch.distributed as dist

    import mcore_compat as mc
    from ppo_actor.loss import agg_loss

    m = config.micro_batch_size
    per_mb = [agg_loss(-log_probs[i:i + m], mask[i:i + m], config.loss.loss_agg_mode) for i in range(0, B, m)]
    value = torch.stack(per_mb).mean()
    dist.all_reduce(value, group=mc.parallel_state.get_data_parallel_group())
    return float(value) / mc.parallel_state.get_data_parallel_world_size()


def run_all() -> dict[str, Any]:
    """Every case on this rank: ``{"version", "patches", "rank", "cases": {name: result}}``."""
    import torch.distributed as dist

    applied = apply_patches()
    for pattern in NOISE:
        warnings.filterwarnings("ignore", message=pattern)
    import mcore_compat as mc
    from mcore_compat.launch import destroy_model_parallel_since, process_groups

    results: dict[str, Any] = {}
    for case in CASES:
        before = process_groups()
        try:
            results[case.name] = _run_case(case)
        except Exception:
            results[case.name] = {"status": "error", "error": traceback.format_exc()}
            dist.barrier()
            continue
        dist.barrier()  # every rank does one barrier per case (a failed one above)
        destroy_model_parallel_since(before)  # the case's Megatron groups: live gloo groups pile up otherwise
    mc.parallel_state.destroy_model_parallel()
    return {"version": str(mc.MCORE_VERSION), "patches": applied, "rank": dist.get_rank(), "cases": results}
