"""The gradient reference's weight-sharing copy of a model (selfcheck.reference._shared_copy): reused by the
next one-step check while it still views the model's weights, made anew when they moved, and never keeping the
model alive."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from mcore_compat.selfcheck import reference  # noqa: E402


@dataclasses.dataclass
class _Config:
    hidden: int = 4
    finalize_model_grads_func: Callable[..., Any] | None = None


class _Block(torch.nn.Module):
    def __init__(self, config: _Config) -> None:
        super().__init__()
        self.config = config
        self.linear = torch.nn.Linear(config.hidden, config.hidden)
        self.register_buffer("scale", torch.ones(config.hidden))

    def forward(self, x: Any) -> Any:
        return self.linear(x) * self.scale


def _model() -> _Block:
    config = _Config()
    model = _Block(config)
    config.finalize_model_grads_func = lambda *a: model  # a schedule hook reaching the model, as Megatron's does
    return model


def test_the_copy_is_reused_while_it_views_the_weights_and_sees_the_current_buffers() -> None:
    model = _model()
    first = reference._shared_copy(model)
    assert first.linear.weight.data_ptr() == model.linear.weight.data_ptr()
    assert first.config.finalize_model_grads_func is None and model.config.finalize_model_grads_func is not None
    model.scale.fill_(3.0)
    model.eval()
    again = reference._shared_copy(model)
    assert again is first and torch.equal(again.scale, model.scale) and not again.training
    x = torch.randn(2, 4)
    assert torch.equal(again(x), model(x))
    model.linear.weight = torch.nn.Parameter(model.linear.weight.detach().clone())  # the weights moved
    fresh = reference._shared_copy(model)
    assert fresh is not first and fresh.linear.weight.data_ptr() == model.linear.weight.data_ptr()


def test_the_kept_copy_does_not_keep_the_model_alive() -> None:
    model = _model()
    reference._shared_copy(model)
    assert model in reference._SHARED
    gone = [False]
    import weakref

    weakref.finalize(model, lambda: gone.__setitem__(0, True))
    del model
    gc.collect()
    assert gone[0]
