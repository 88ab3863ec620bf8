"""Loss terms against hand-computed values on small tensors (no Megatron), and the micro-batch helpers."""

from __future__ import annotations

import math

import pytest
import torch

from ppo_actor import LossConfig, agg_loss, compute_ppo_loss, concat_multi_modal, kl_penalty, policy_loss
from ppo_actor.actor import split_micro_batches
from ppo_actor.loss import entropy_from_logits, logprobs_from_logits

pytestmark = pytest.mark.unit

# Ratios 1.5, 0.5, 1.0, 4.0 (old log-probs 0) with advantages 1, 1, -1, -2 and clip 0.2:
#   token 0: -A*r = -1.5, clipped -1.2 -> max -1.2 (clipped)   token 1: -0.5 vs -0.8 -> -0.5
#   token 2: 1 vs 1 -> 1                                        token 3: 8 vs 2.4 -> 8; dual clip (c=3): min(6, 8) = 6
RATIOS = [1.5, 0.5, 1.0, 4.0]
ADV = [1.0, 1.0, -1.0, -2.0]
VANILLA = [-1.2, -0.5, 1.0, 8.0]
DUAL = [-1.2, -0.5, 1.0, 6.0]


def _lp(ratios: list[float] = RATIOS) -> torch.Tensor:
    return torch.tensor([[math.log(r) for r in ratios]], requires_grad=True)


def _ppo_data(**extra: object) -> dict[str, object]:
    return {"old_log_probs": torch.zeros(1, 4), "advantages": torch.tensor([ADV]), "loss_mask": torch.ones(1, 4),
            **extra}


# ------------------------------------------------------------------------------------------------ aggregation
LOSS_MAT = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0], [5.0, 5.0, 5.0, 5.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])  # row 3: fully masked


@pytest.mark.parametrize(("mode", "expected"), [
    ("token-mean", (1 + 2 + 10 + 20 + 30 + 40) / 6),
    ("seq-mean-token-sum", (3 + 100) / 2),  # the fully masked sequence is left out
    ("seq-mean-token-mean", (1.5 + 25) / 2),
])
def test_aggregation_modes(mode: str, expected: float) -> None:
    assert agg_loss(LOSS_MAT, MASK, mode).item() == pytest.approx(expected)


def test_aggregation_of_nothing_is_zero_and_unknown_mode_raises() -> None:
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        assert agg_loss(LOSS_MAT, torch.zeros_like(MASK), mode).item() == 0.0
    with pytest.raises(ValueError, match="unknown loss_agg_mode"):
        agg_loss(LOSS_MAT, MASK, "sum")


# ------------------------------------------------------------------------------------------------ policy loss
def test_vanilla_clipped_policy_loss() -> None:
    out = policy_loss(_lp(), torch.zeros(1, 4), torch.tensor([ADV]), torch.ones(1, 4), LossConfig())
    assert out["pg_loss"].item() == pytest.approx(sum(VANILLA) / 4)
    assert out["pg_clipfrac"].item() == pytest.approx(1 / 4)  # token 0 only
    assert out["ppo_kl"].item() == pytest.approx(-math.log(1.5 * 0.5 * 1.0 * 4.0) / 4)
    assert out["pg_clipfrac_lower"].item() == 0.0


def test_dual_clip_bounds_negative_advantages() -> None:
    out = policy_loss(_lp(), torch.zeros(1, 4), torch.tensor([ADV]), torch.ones(1, 4), LossConfig(clip_ratio_c=3.0))
    assert out["pg_loss"].item() == pytest.approx(sum(DUAL) / 4)
    assert out["pg_clipfrac_lower"].item() == pytest.approx(1 / 4)  # token 3


def test_clipped_tokens_get_no_gradient() -> None:
    lp = _lp()
    loss, _ = compute_ppo_loss({"log_probs": lp}, _ppo_data(), LossConfig(clip_ratio_c=3.0))
    loss.backward()
    # d(-A r)/d(log p) = -A r, divided by 4 tokens; clipped tokens 0 (ratio clip) and 3 (dual clip) get 0
    assert lp.grad.tolist()[0] == pytest.approx([0.0, -0.5 / 4, 1.0 / 4, 0.0])


def test_asymmetric_clip_range() -> None:
    out = policy_loss(_lp(), torch.zeros(1, 4), torch.tensor([ADV]), torch.ones(1, 4),
                      LossConfig(clip_ratio_low=0.2, clip_ratio_high=0.6))
    assert out["pg_loss"].item() == pytest.approx((-1.5 - 0.5 + 1.0 + 8.0) / 4)  # 1.5 < 1.6: unclipped
    assert out["pg_clipfrac"].item() == 0.0


# ------------------------------------------------------------------------------------------------ KL
@pytest.mark.parametrize(("kind", "expected"), [
    ("k1", [-math.log(2), math.log(2)]),
    ("k2", [0.5 * math.log(2) ** 2, 0.5 * math.log(2) ** 2]),
    ("k3", [1 - math.log(2), math.log(2) - 0.5]),  # q/p - log(q/p) - 1 with q/p = 2 and 1/2
])
def test_kl_estimators(kind: str, expected: list[float]) -> None:
    lp = torch.tensor([0.0, math.log(2)])
    ref = torch.tensor([math.log(2), 0.0])
    assert kl_penalty(lp, ref, kind).tolist() == pytest.approx(expected)


def test_kl_of_identical_policies_is_zero() -> None:
    lp = torch.randn(3, 5)
    for kind in ("k1", "k2", "k3"):
        assert kl_penalty(lp, lp.clone(), kind).abs().max().item() == 0.0


# ------------------------------------------------------------------------------------------------ whole loss
def test_ppo_loss_sums_its_terms_token_mean() -> None:
    lp = _lp()
    entropy = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    config = LossConfig(entropy_coeff=0.1, use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k1")
    loss, metrics = compute_ppo_loss({"log_probs": lp, "entropy": entropy},
                                     _ppo_data(ref_log_probs=lp.detach() - 0.1), config)
    # pg 1.825, entropy 2.5 (token mean) -> -0.25, KL 0.1 -> +0.05
    assert loss.item() == pytest.approx(1.825 - 0.25 + 0.05)
    assert metrics["actor/pg_loss"].item() == pytest.approx(1.825)
    assert metrics["actor/entropy"].item() == pytest.approx(2.5)
    assert metrics["actor/kl_loss"].item() == pytest.approx(0.1)
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(0.25)
    assert set(metrics) == {"actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl",
                            "actor/entropy", "actor/kl_loss"}
    assert loss.requires_grad and not any(m.requires_grad for m in metrics.values())


@pytest.mark.parametrize(("mode", "pg", "ent", "kl"), [
    # masked tokens: row 0 tokens 0, 1; row 1 tokens 0..3 (values below)
    ("token-mean", (-1.2 - 0.5 + (-1.2 - 0.5 + 1.0 + 8.0)) / 6, (1 + 2 + 1 + 2 + 3 + 4) / 6, 0.1),
    ("seq-mean-token-sum", ((-1.2 - 0.5) + 7.3) / 2, (3 + 10) / 2, (0.2 + 0.4) / 2),
    ("seq-mean-token-mean", ((-1.7 / 2) + 7.3 / 4) / 2, (1.5 + 2.5) / 2, 0.1),
])
def test_ppo_loss_aggregation_modes(mode: str, pg: float, ent: float, kl: float) -> None:
    lp = torch.tensor([[math.log(r) for r in RATIOS]] * 2, requires_grad=True)
    data = {"old_log_probs": torch.zeros(2, 4), "advantages": torch.tensor([ADV, ADV]),
            "loss_mask": torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]),
            "ref_log_probs": lp.detach() - 0.1}
    entropy = torch.tensor([[1.0, 2.0, 3.0, 4.0]] * 2)
    config = LossConfig(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.2, kl_loss_type="k1",
                        loss_agg_mode=mode)
    loss, metrics = compute_ppo_loss({"log_probs": lp, "entropy": entropy}, data, config)
    assert metrics["actor/pg_loss"].item() == pytest.approx(pg)
    assert metrics["actor/entropy"].item() == pytest.approx(ent)
    assert metrics["actor/kl_loss"].item() == pytest.approx(kl)
    assert loss.item() == pytest.approx(pg - 0.01 * ent + 0.2 * kl)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_sft_is_masked_nll_through_the_same_function(mode: str) -> None:
    lp = torch.log(torch.tensor([[0.5, 0.25, 0.1, 1.0], [0.5, 0.5, 0.5, 0.5]]))
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    nll = -lp
    expected = {"token-mean": float((nll * mask).sum() / 6),
                "seq-mean-token-sum": float((nll * mask).sum(-1).mean()),
                "seq-mean-token-mean": float(((nll * mask).sum(-1) / mask.sum(-1)).mean())}[mode]
    by_data, m1 = compute_ppo_loss({"log_probs": lp}, {"loss_mask": mask, "loss_type": "sft"},
                                   LossConfig(loss_agg_mode=mode))
    by_config, m2 = compute_ppo_loss({"log_probs": lp}, {"loss_mask": mask},
                                     LossConfig(loss_type="sft", loss_agg_mode=mode))
    assert by_data.item() == pytest.approx(expected) and by_config.item() == pytest.approx(expected)
    assert set(m1) == set(m2) == {"actor/sft_loss"}


def test_missing_inputs_and_bad_settings_raise() -> None:
    with pytest.raises(ValueError, match="ref_log_probs"):
        compute_ppo_loss({"log_probs": _lp()}, _ppo_data(), LossConfig(use_kl_loss=True))
    with pytest.raises(ValueError, match="entropy"):
        compute_ppo_loss({"log_probs": _lp()}, _ppo_data(), LossConfig(entropy_coeff=0.1))
    with pytest.raises(ValueError, match="loss_type"):
        compute_ppo_loss({"log_probs": _lp()}, _ppo_data(loss_type="dpo"))
    for bad in ({"loss_agg_mode": "sum"}, {"kl_loss_type": "k4"}, {"clip_ratio_c": 0.5}, {"loss_type": "x"}):
        with pytest.raises(ValueError):
            LossConfig(**bad)  # type: ignore[arg-type]


def test_logprobs_and_entropy_from_logits_match_torch_distributions() -> None:
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 7, (2, 3), generator=torch.Generator().manual_seed(1))
    dist = torch.distributions.Categorical(logits=logits)
    assert torch.allclose(logprobs_from_logits(logits, labels), dist.log_prob(labels), atol=1e-6)
    assert torch.allclose(entropy_from_logits(logits), dist.entropy(), atol=1e-6)


# ------------------------------------------------------------------------------------------------ micro-batches
def _batch(mm: object) -> dict[str, object]:
    return {"input_ids": torch.arange(24).view(4, 6), "labels": torch.arange(24).view(4, 6),
            "loss_mask": torch.ones(4, 6), "loss_type": "sft", "multi_modal_inputs": mm}


def test_empty_multi_modal_list_is_ignored() -> None:
    assert concat_multi_modal([], 0, 2) is None and concat_multi_modal(None, 0, 2) is None
    micro = split_micro_batches(_batch([]), 2)
    assert len(micro) == 2 and all(mb["multi_modal_inputs"] is None for mb in micro)
    assert micro[1]["input_ids"].tolist() == torch.arange(12, 24).view(2, 6).tolist()
    assert micro[0]["loss_type"] == "sft" and micro[0]["position_ids"].shape == (2, 6)
    assert micro[0]["attention_mask"].shape == (1, 1, 6, 6) and bool(micro[0]["attention_mask"][0, 0, 0, 1])


def test_multi_modal_inputs_are_concatenated_per_micro_batch() -> None:
    mm = [{"pixel_values": torch.full((i + 1, 3), float(i))} for i in range(4)]
    mm[1] = {}  # a text-only sample in a multi-modal batch
    micro = split_micro_batches(_batch(mm), 2)
    assert micro[0]["multi_modal_inputs"]["pixel_values"].tolist() == [[0.0] * 3]
    assert micro[1]["multi_modal_inputs"]["pixel_values"].shape == (3 + 4, 3)
    with pytest.raises(ValueError, match="3 entries for 4 samples"):
        split_micro_batches(_batch(mm[:3]), 2)
