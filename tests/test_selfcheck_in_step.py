"""The optimizer step run part by part (mcore_compat.selfcheck.in_step): the same result as one call, every
param in exactly one part, the group's own counters as after one call, the optimizer left as it was."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from mcore_compat.selfcheck import in_step  # noqa: E402


def _params(seed: int = 0) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (64, 3), (1,), (33,), (4, 4, 4)]
    out = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=g))
        p.grad = torch.randn(shape, generator=g)
        out.append(p)
    return out


def _optimizer(params: list[Any], cls: Any = torch.optim.AdamW) -> Any:
    return cls([{"params": params[:3], "weight_decay": 0.1}, {"params": params[3:], "weight_decay": 0.0}], lr=1e-2)


class _GroupCounted(torch.optim.SGD):
    """SGD that also counts its calls in each param group (as apex's and TransformerEngine's FusedAdam do)."""

    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
        return super().step(closure)


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD])
def test_parts_give_the_same_step_as_one_call(cls: Any) -> None:
    plain, parted = _params(), _params()
    opt_plain, opt_parted = _optimizer(plain, cls), _optimizer(parted, cls)
    seen: list[list[int]] = []
    checks = InStepRecorder(seen)
    for _ in range(3):  # moments exist from the second step on
        opt_plain.step()
        with checks.steps.installed([opt_parted]):
            opt_parted.step()
    for a, b in zip(plain, parted, strict=True):
        assert torch.equal(a, b)
        for key, value in opt_plain.state[a].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(opt_parted.state[b][key]))
    # every param in exactly one part per step, in order; several parts
    ids = [id(p) for p in parted]
    steps = [[i for part in seen[k:k + checks.parts] for i in part] for k in range(0, len(seen), checks.parts)]
    assert len(steps) == 3 and all(step == ids for step in steps)
    assert checks.parts > 1
    # the gradients are back, the optimizer's own step is back
    assert all(p.grad is not None for p in parted)
    assert "step" not in vars(opt_parted)


class InStepRecorder:
    def __init__(self, seen: list[list[int]]) -> None:
        self.seen = seen
        self.parts = 0
        self.steps = in_step.InStep(self._before, self._snapshot, self._verify)

    def _before(self, inner: Any) -> None:
        self.parts = 0

    def _snapshot(self, inner: Any, part: list[Any]) -> list[Any]:
        # the part's params have their gradients; every other param is hidden only during the real step
        assert all(p.grad is not None for g in inner.param_groups for p in g["params"])
        return [p.detach().clone() for p in part]

    def _verify(self, inner: Any, part: list[Any], before: list[Any]) -> None:
        self.parts += 1
        self.seen.append([id(p) for p in part])
        assert any(not torch.equal(p, b) for p, b in zip(part, before, strict=True))


def test_a_per_group_counter_advances_once_per_step() -> None:
    params = _params()
    opt = _optimizer(params, _GroupCounted)
    recorder = InStepRecorder([])
    for _ in range(2):
        with recorder.steps.installed([opt]):
            opt.step()
    assert recorder.parts > 1
    assert [g["step"] for g in opt.param_groups] == [2, 2]


def test_an_instance_step_is_put_back() -> None:
    params = _params()
    opt = _optimizer(params)
    calls: list[int] = []
    real = opt.step

    def own(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    opt.step = own
    recorder = InStepRecorder([])
    with recorder.steps.installed([opt]):
        opt.step()
    assert opt.step is own and len(calls) == recorder.parts > 1


def test_partition_keeps_order_and_sizes() -> None:
    params = _params()
    parts = in_step.partition(params, 3)
    assert [p for part in parts for p in part] == params
    assert all(part for part in parts)


def test_only_elementwise_optimizers_stream() -> None:
    params = _params()
    assert in_step.not_streamable(_optimizer(params), None) is None

    class Lamb(torch.optim.Optimizer):
        pass

    lamb = Lamb(params, {"lr": 1.0})
    assert "not known to update each element" in str(in_step.not_streamable(lamb, None))

    class KeepsStep(torch.optim.AdamW):  # a stand-in with another signature, torch's step (patches/stubs.py)
        pass

    class OwnStep(torch.optim.AdamW):
        def step(self, closure: Any = None) -> Any:
            return super().step(closure)

    assert in_step.not_streamable(KeepsStep(params), None) is None
    assert in_step.not_streamable(OwnStep(params), None) is not None
