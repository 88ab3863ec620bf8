"""The random-state replay of the gradient reference (:mod:`mcore_compat.selfcheck.rng_replay`) without
Megatron: snapshots are copies, replay restores the recorded state per (chunk, micro-batch), and attention
dropout inside TransformerEngine is reported as not replayable."""

from __future__ import annotations

from typing import Any

import torch

from mcore_compat.selfcheck.rng_replay import RngReplay, capture, restore, unreplayable_reason


def test_capture_is_a_copy_and_restore_reproduces_the_draws() -> None:
    torch.manual_seed(3)
    state = capture()
    first = torch.rand(5)
    torch.rand(7)
    assert not capture().same_as(state)
    restore(state)
    assert torch.equal(torch.rand(5), first)
    restore(state)  # usable again
    assert torch.equal(torch.rand(5), first)


def test_replay_restores_the_state_each_recorded_forward_started_from() -> None:
    model = torch.nn.Dropout(0.5)
    replay = RngReplay([model])
    masks: list[Any] = []

    def forward_step(data_iterator: Any, m: Any) -> Any:
        out = m(next(data_iterator))
        masks.append(out)
        return out

    replay.start_step()
    step = replay.recording(forward_step)
    data = iter([torch.ones(16), torch.ones(16)])
    step(data, model)
    step(data, model)
    assert set(replay.states) == {(0, 0), (0, 1)}
    for mb in (1, 0):  # any order: each forward gets its own micro-batch's state
        assert replay.replay(0, mb)
        assert torch.equal(model(torch.ones(16)), masks[mb])
    assert not replay.replay(0, 2)
    replay.start_step()
    assert not replay.states


def _te_attention(p: float) -> Any:
    config = type("Config", (), {"attention_dropout": p})()
    cls = type("TEDotProductAttention", (torch.nn.Module,),
               {"__module__": "megatron.core.extensions.transformer_engine"})
    module = cls()
    module.config = config
    return module


def test_transformer_engine_attention_dropout_is_not_replayable() -> None:
    chunk = torch.nn.Sequential(torch.nn.Linear(2, 2), _te_attention(0.1))
    reason = unreplayable_reason([chunk])
    assert reason is not None and "TEDotProductAttention" in reason and "0.1" in reason
    assert unreplayable_reason([torch.nn.Sequential(_te_attention(0.0))]) is None
    assert unreplayable_reason([torch.nn.Sequential(torch.nn.Dropout(0.1))]) is None
