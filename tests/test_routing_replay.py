"""The MoE routing replay of the finite-difference check (:mod:`mcore_compat.selfcheck.routing_replay`) without
Megatron (its MoE layers are exercised by the own-model fixtures of tests/_megatron_faults.py): a router's
``topk`` choices recorded in the real forward are what a copy's router gets, whatever scores the copy computes,
with the values taken from the copy's own scores; a call the record lacks is counted, never silently answered."""

from __future__ import annotations

import copy
from typing import Any

import torch

from mcore_compat.selfcheck.routing_replay import RoutingReplay, routers


class TopKRouter(torch.nn.Module):
    """The shape of Megatron's router: scores by a linear map, the experts by ``torch.topk`` (and a second
    selection by ``Tensor.topk``, as group-limited routing does)."""

    def __init__(self, k: int = 2) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(6, 4))
        self.k = k

    def forward(self, x: Any) -> Any:
        scores = x @ self.weight.t()
        probs, idx = torch.topk(scores, k=self.k, dim=1)
        _, first = scores.topk(1, dim=-1)
        return probs, idx, first


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = TopKRouter()

    def forward(self, x: Any) -> Any:
        return self.router(x)


def _recorded(model: Any, batches: list[Any]) -> tuple[RoutingReplay, list[Any]]:
    replay = RoutingReplay([model])
    replay.start_step()
    seen: list[Any] = []

    def forward_step(data_iterator: Any, m: Any) -> Any:
        out = m(next(data_iterator))
        seen.append(out)
        return out

    step = replay.recording(forward_step)
    data = iter(batches)
    for _ in batches:
        step(data, model)
    return replay, seen


def test_the_copy_routes_as_the_real_forward_did_with_its_own_values() -> None:
    torch.manual_seed(0)
    model = Layer()
    batches = [torch.randn(8, 4), torch.randn(8, 4)]
    replay, seen = _recorded(model, batches)
    assert [len(replay.choices[(0, mb)]) for mb in range(2)] == [2, 2]
    dup = copy.deepcopy(model).double()
    with torch.no_grad():
        dup.router.weight.mul_(-1.0)  # the copy's scores would choose other experts
    for mb, x in enumerate(batches):
        free = dup(x.double())
        with replay.replaying(dup, 0, mb):
            probs, idx, first = dup(x.double())
        assert torch.equal(idx, seen[mb][1]) and torch.equal(first, seen[mb][2])
        assert not torch.equal(free[1], idx)  # without the replay it routes elsewhere
        scores = x.double() @ dup.router.weight.t()
        assert torch.equal(probs, scores.gather(1, idx)) and probs.dtype == torch.float64
    assert replay.missed == []
    assert routers(dup) == [dup.router]


def test_calls_the_record_lacks_or_shapes_that_differ_are_counted() -> None:
    torch.manual_seed(1)
    model = Layer()
    replay, _ = _recorded(model, [torch.randn(8, 4)])
    other = Layer()
    other.router.k = 3  # another top-k: the record cannot answer it
    with replay.replaying(other, 0, 0):
        other(torch.randn(8, 4))
    assert any("shape" in m for m in replay.missed)
    replay.missed.clear()
    with replay.replaying(model, 0, 1):  # a micro-batch the real step never ran
        model(torch.randn(8, 4))
    assert len(replay.missed) == 2 and all("did not make" in m for m in replay.missed)


def test_topk_is_only_replaced_inside_a_router_forward() -> None:
    torch.manual_seed(2)
    model = Layer()
    real = torch.topk
    replay, _ = _recorded(model, [torch.randn(8, 4)])
    assert torch.topk is real and torch.Tensor.topk is torch._C.TensorBase.topk
    with replay.replaying(model, 0, 0):
        assert torch.topk is real  # outside the router's forward
        _, idx = torch.topk(torch.tensor([3.0, 1.0, 2.0]), 2)
        assert idx.tolist() == [0, 2]
    assert torch.topk is real and torch.Tensor.topk is torch._C.TensorBase.topk  # put back
    # the router never ran in the copy: the real step's two choices were not asked for, and that is said
    assert replay.missed == ["chunk 0, micro-batch 0: 2 router topk call(s) of the real step not made"]


def test_a_model_without_routers_records_nothing() -> None:
    model = torch.nn.Linear(4, 4)
    replay = RoutingReplay([model])
    assert replay.active is False

    def forward_step(data_iterator: Any, m: Any) -> Any:
        return m(next(data_iterator))

    assert replay.recording(forward_step) is forward_step
