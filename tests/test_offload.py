"""Offload / reload (``mcore_compat.offload``, ``reload``, ``offloaded``): device memory freed in place, host
buffers reused, nothing lost or detached, training bit-identical to a twin that never offloaded.

ONE module-scoped ``run_all`` on the session's 2 gloo ranks (``rank_group``) runs every configuration
(tests/_offload_scenarios.py); the tests below only assert. The refusals run in this process on plain modules.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import _offload_scenarios as SCENARIOS
import pytest
import torch
from conftest import case_results, run_scenarios

CYCLE_CASES = [n for n in SCENARIOS.CASE_NAMES if n.startswith("cycles-")]
FAULT_CASES = [n for n in SCENARIOS.CASE_NAMES if n.startswith("fault-")]


@pytest.fixture(scope="module")
def results(rank_group: Any) -> dict[str, Any]:
    return run_scenarios(rank_group, SCENARIOS.run_all, timeout=300)


def _has_param_buffer(version: str) -> bool:
    """Whether DDP keeps the params in a buffer (param_data) with the distributed optimizer; without one (0.4/0.5)
    the optimizer writes through ``param.data``, so a rebound param keeps training."""
    from mcore_compat.layout import layout_fact

    return bool(layout_fact("param_data_with_distopt", version))


@pytest.mark.mcore
@pytest.mark.parametrize("name", CYCLE_CASES)
def test_offload_frees_every_piece(results: dict[str, Any], name: str) -> None:
    for r in case_results(results, name):
        assert r["update_successful"]
        assert r["not_freed"] == [], r["not_freed"]
        # params (2 chunks x 4, one frozen) and module buffers (2 x 2), main_grads, Adam state: all looked at and freed
        assert r["counted"]["params"] >= 12 and r["counted"]["grads"] >= 7 and r["counted"]["optimizer_state"] >= 7
        assert r["moved"]["params"] > 0 and r["moved"]["grads"] > 0 and r["moved"]["optimizer_state"] > 0
        assert r["reloaded"] == r["moved"]
        if name.endswith("-expert"):  # DDP's expert buffers (0.6+) were among what was freed
            assert (r["expert_buffers"] >= 1) == _has_expert_buffers(results["version"])


def _has_expert_buffers(version: str) -> bool:
    from mcore_compat.layout import layout_fact

    return bool(layout_fact("expert_buffers", version))


@pytest.mark.mcore
@pytest.mark.parametrize("name", CYCLE_CASES)
def test_reload_restores_in_place(results: dict[str, Any], name: str) -> None:
    for r in case_results(results, name):
        assert r["changed_by_cycle"] == [], r["changed_by_cycle"]  # params, grads, optimizer state bit for bit
        assert r["alias_problems"] == [], r["alias_problems"]  # same storages, main_grad in DDP's buffers
        assert r["verify_error"] is None, r["verify_error"]  # the binding holds without re-binding


@pytest.mark.mcore
@pytest.mark.parametrize("name", CYCLE_CASES)
def test_cycles_bit_identical_to_twin(results: dict[str, Any], name: str) -> None:
    for r in case_results(results, name):
        assert r["update_successful_cycles"]
        assert r["twin_differences"] == [], r["twin_differences"]
        assert r["twin_differences_after"] == [], r["twin_differences_after"]
        assert r["alias_problems_cycles"] == [] and r["verify_error_cycles"] is None
        frozen = [n for n in r["trained"] if n == "chunk1.fc2.bias"]
        assert frozen and not r["trained"]["chunk1.fc2.bias"]
        assert all(v for n, v in r["trained"].items() if n not in frozen), r["trained"]


@pytest.mark.mcore
@pytest.mark.parametrize("name", CYCLE_CASES)
def test_partial_offload_keeps_params(results: dict[str, Any], name: str) -> None:
    for r in case_results(results, name):
        assert len(r["partial"]) == SCENARIOS.CYCLES // 2
        assert all(p["params_resident"] and p["rest_freed"] for p in r["partial"]), r["partial"]


@pytest.mark.mcore
@pytest.mark.parametrize("name", CYCLE_CASES)
def test_host_buffers_reused(results: dict[str, Any], name: str) -> None:
    for r in case_results(results, name):
        assert r["host_buffers"] > 0
        assert r["host_ptrs_stable"]  # the same host buffers (data_ptr) in every cycle
        assert r["host_allocations"] == 1  # each allocated once
        assert r["host_bytes"] >= sum(r["moved"].values())


@pytest.mark.mcore
@pytest.mark.parametrize("name", FAULT_CASES)
def test_recreating_reload_is_caught(results: dict[str, Any], name: str) -> None:
    """A reload that puts the params' bytes into new storage and rebinds ``param.data`` fails the aliasing check
    (and, where DDP's param buffer holds the params, the binding's verify and the twin comparison: the optimizer
    updates the buffer, which the params no longer alias)."""
    for r in case_results(results, name):
        assert r["alias_problems"], "storage re-created on reload went unnoticed"
        if name.endswith("distopt"):
            assert r["verify_error"] is not None
        if name.endswith("distopt") and _has_param_buffer(results["version"]):
            assert any(n.startswith("params:") for n in r["twin_differences"]), "training matched the twin"


# ---------------------------------------------------------------------------------------------------------------
# refusals (this process, plain modules)
# ---------------------------------------------------------------------------------------------------------------

class _Quantized(torch.Tensor):
    """Stands for an FP8 tensor class (TransformerEngine's Float8Tensor & co.)."""


@pytest.mark.mcore
def test_refuses_quantized_params() -> None:
    from mcore_compat import OffloadError, offload

    module = torch.nn.Linear(2, 2)
    module.weight = torch.nn.Parameter(torch.zeros(2, 2).as_subclass(_Quantized))
    before = module.bias.untyped_storage().nbytes()
    with pytest.raises(OffloadError, match=r"FP8.*params=False"):
        offload([module])
    assert module.bias.untyped_storage().nbytes() == before  # nothing moved
    assert offload([module], params=False).total == 0  # nothing else to move here


@pytest.mark.mcore
def test_refuses_a_param_numpy_has_viewed_and_moves_nothing() -> None:
    """``param.numpy()`` (a user's checksum or log) marks the storage not resizable for good: offload refuses in
    one line saying so and what to do, before it frees anything."""
    from mcore_compat import OffloadError, offload

    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    module[1].weight.detach().numpy()
    before = [p.untyped_storage().nbytes() for p in module.parameters()]
    with pytest.raises(OffloadError, match=r"not resizable.*\.numpy\(\).*clone") as err:
        offload([module])
    assert "\n" not in str(err.value)
    assert [p.untyped_storage().nbytes() for p in module.parameters()] == before  # nothing freed


@pytest.mark.mcore
def test_refuses_precision_aware_optimizer_state() -> None:
    from mcore_compat import OffloadError, offload, reload

    module = torch.nn.Linear(2, 2)
    opt = SimpleNamespace(config=SimpleNamespace(use_precision_aware_optimizer=True), optimizer=None)
    with pytest.raises(OffloadError, match=r"precision-aware.*optimizer_state=False"):
        offload([module], opt)
    moved = offload([module], opt, optimizer_state=False)
    assert moved.params == 6 * 4 and module.weight.untyped_storage().nbytes() == 0
    assert reload([module], opt, optimizer_state=False).params == moved.params
    assert module.weight.untyped_storage().nbytes() == 16


@pytest.mark.mcore
def test_refuses_nccl_user_buffers() -> None:
    from mcore_compat import OffloadError, offload

    module = torch.nn.Linear(2, 2)
    module.ddp_config = SimpleNamespace(nccl_ub=True)  # type: ignore[assignment]
    with pytest.raises(OffloadError, match="nccl_ub"):
        offload([module])
    assert offload([module], params=False, grads=False).total == 0


@pytest.mark.mcore
def test_offloaded_context_reloads_on_error() -> None:
    from mcore_compat import offloaded

    module = torch.nn.Linear(3, 2)
    weight = module.weight
    expected = weight.detach().clone()
    with pytest.raises(KeyError), offloaded([module]) as moved:
        assert moved.params == (6 + 2) * 4 and weight.untyped_storage().nbytes() == 0
        raise KeyError("inside")
    assert module.weight is weight and torch.equal(weight.detach(), expected)


def _grads(module: torch.nn.Module) -> list[torch.Tensor]:
    grads = [p.grad for p in module.parameters()]
    assert all(g is not None for g in grads)
    return [g for g in grads if g is not None]


@pytest.mark.mcore
def test_grads_recreated_every_step_reuse_host_buffers() -> None:
    """A ``.grad`` replaced by new memory every step (a Float16Optimizer's main grads): each cycle offloads a new
    storage, whose host buffer is the spare one left by the last cycle's, so host memory stays bounded."""
    from mcore_compat.lifecycle import _host, host_bytes, offload, release_host_buffers, reload

    module = torch.nn.Linear(4, 3)
    release_host_buffers()
    counts, sizes = [], []
    for cycle in range(10):
        for p in module.parameters():
            p.grad = torch.full_like(p, float(cycle))  # new storage, the old one freed
        moved = offload([module], params=False)
        assert moved.grads == (12 + 3) * 4 and all(g.untyped_storage().nbytes() == 0 for g in _grads(module))
        counts.append(_host.allocations())
        sizes.append(host_bytes())
        reload([module], params=False)
        assert all(torch.equal(g, torch.full_like(g, float(cycle))) for g in _grads(module))
    assert len(set(counts)) == 1, counts  # no host allocation after the first cycle
    assert max(sizes) <= 2 * moved.grads  # bounded (at most the spares of one cycle besides the live ones)


@pytest.mark.mcore
def test_release_frees_the_buffers_of_storages_that_are_gone() -> None:
    """``release_host_buffers`` frees every buffer not in use, those of a model that no longer exists included
    (they were kept as spares): afterwards the process holds no host copy (the self-check found a process that
    kept 1.04x after an earlier model was gone)."""
    import gc

    from mcore_compat.lifecycle import host_bytes, offload, release_host_buffers, reload

    release_host_buffers()
    module = torch.nn.Linear(8, 4)
    moved = offload([module])
    reload([module])
    assert host_bytes() == moved.total == (32 + 4) * 4
    del module
    gc.collect()
    assert release_host_buffers() == moved.total
    assert host_bytes() == 0
