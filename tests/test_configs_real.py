"""The self-check's parallel configurations, trained through mcore_compat against the installed release.

Every configuration of ``tests/_config_scenarios.py`` (DP=2 with the distributed optimizer on/off in fp32/bf16,
TP=2 with sequence parallelism, PP=2 with tied embeddings, PP=2 with two virtual stages, overlapped grad reduce
and param gather, MoE with expert parallelism, and TP x PP, DP x PP, DP x TP at world size 4) trains
``STEPS`` steps of the self-check's tiny GPT (``mcore_compat.selfcheck.models``) through ``mcore_compat.training``.
All world-size-2 configurations run in ONE call on the session's 2 ranks (``rank_group``), the world-size-4 ones in
ONE call on a group of 4. Each test only asserts, or skips with the configuration's ``unsupported_reason`` (a
limit of the installed release, from the capability table).

What proves that the finalize hook ran (``finalize_model_grads`` through ``install_training_hooks``):

* DP > 1: the data-parallel ranks hold identical weights (dense weights; experts have their own groups);
* TP > 1 with sequence parallelism: the parameters that are not tensor-parallel (LayerNorms, position
  embeddings) are identical on the tensor-parallel ranks, though each rank saw other tokens;
* PP > 1 with tied embeddings: the first stage's input embedding equals the last stage's output-layer copy.

The ``no-finalize-*`` configurations are negative controls: the same runs with the hook left unset must show
each of those signs missing (so the checks can fail).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import pytest

from mcore_compat.launch import Group

SCENARIOS = pytest.importorskip("_config_scenarios")
CONFIGS = {c.name: c for c in SCENARIOS.configs()}
TIMEOUT = {2: 900, 4: 1200}


def _by_config(per_rank: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """``{config name: [rank 0 result, rank 1 result, ...]}``."""
    return {name: [r["results"][name] for r in per_rank] for name in per_rank[0]["results"]}


@pytest.fixture(scope="module")
def world2(rank_group: Group) -> dict[str, list[dict[str, Any]]]:
    return _by_config(rank_group.run(SCENARIOS.run_world, args=(2,), timeout=TIMEOUT[2]))


@pytest.fixture(scope="module")
def world4() -> dict[str, list[dict[str, Any]]]:
    with Group(4, device="cpu", destroy_subgroups=True) as group:
        return _by_config(group.run(SCENARIOS.run_world, args=(4,), timeout=TIMEOUT[4]))


def _ranks(request: pytest.FixtureRequest, name: str) -> list[dict[str, Any]]:
    """The ranks' results of configuration ``name``; fails on an error, skips with the release limit."""
    ranks = request.getfixturevalue(f"world{CONFIGS[name].world}")[name]
    errors = [f"--- rank {i} ---\n{r['error']}" for i, r in enumerate(ranks) if r["status"] == "error"]
    if errors:
        pytest.fail(f"{name} raised:\n" + "\n".join(errors), pytrace=False)
    reasons = {r.get("reason") for r in ranks if r["status"] == "unsupported"}
    if reasons:
        assert len(reasons) == 1 and all(r["status"] == "unsupported" for r in ranks), ranks
        pytest.skip(reasons.pop())
    return ranks


def _groups(ranks: list[dict[str, Any]], *keys: str) -> list[list[dict[str, Any]]]:
    """Ranks grouped by equal coordinates ``keys`` (e.g. ``"tp", "pp"`` groups the data-parallel peers)."""
    out: dict[tuple[int, ...], list[dict[str, Any]]] = defaultdict(list)
    for r in ranks:
        out[tuple(r["coords"][k] for k in keys)].append(r)
    return list(out.values())


def _differing(group: list[dict[str, Any]], names: set[str]) -> list[str]:
    """Parameters of ``names`` whose digests differ between the ranks of ``group``."""
    return sorted(n for n in names if len({r["digests"][n] for r in group}) > 1)


def _check_layer_numbers(name: str, ranks: list[dict[str, Any]]) -> None:
    """Each chunk holds its own slice of the layers: virtual stage ``i`` of pipeline rank ``r`` holds layers
    ``(i * pp + r) * L + 1 ...`` (Megatron's interleaved assignment; ``L`` layers per virtual stage)."""
    from mcore_compat.selfcheck.models import LAYERS_PER_STAGE

    opts = SCENARIOS.options_of(CONFIGS[name])
    per_stage = LAYERS_PER_STAGE // opts.vpp
    for r in ranks:
        pp_rank = r["coords"]["pp"]
        want = [[(i * opts.pp + pp_rank) * per_stage + k + 1 for k in range(per_stage)] for i in range(opts.vpp)]
        assert r["layer_numbers"] == want, (r["coords"], r["layer_numbers"], want)


@pytest.mark.mcore
@pytest.mark.parametrize("name", list(CONFIGS))
def test_configuration_trains(request: pytest.FixtureRequest, name: str) -> None:
    ranks = _ranks(request, name)
    assert all(r["second_build_identical"] for r in ranks), "build_chunks twice gave different weights"
    _check_layer_numbers(name, ranks)
    last = [r for r in ranks if r["last_stage"]]
    assert last and all(len(r["losses"]) == SCENARIOS.STEPS for r in last), [r["losses"] for r in ranks]
    assert all(r["finite"] for r in last), [r["losses"] for r in last]
    assert all(math.isfinite(n) for r in ranks for n in r["grad_norms"] if n is not None)
    unchanged = {i: r["unchanged"] for i, r in enumerate(ranks) if r["unchanged"]}
    assert not unchanged, f"parameters unchanged after {SCENARIOS.STEPS} steps (rank: names): {unchanged}"


def _finalize_evidence(name: str, ranks: list[dict[str, Any]]) -> dict[str, list[str]]:
    """``{check: what differs}`` for each sign of ``finalize_model_grads`` that applies to the configuration
    (an empty list: the sign is there)."""
    opts = SCENARIOS.options_of(CONFIGS[name])
    out: dict[str, list[str]] = {}
    if opts.dp > 1:  # data-parallel peers: dense weights identical
        out["dp_identical"] = [n for g in _groups(ranks, "tp", "pp")
                               for n in _differing(g, set(g[0]["digests"]) - set(g[0]["expert"]))]
    if opts.tp > 1:  # tensor-parallel peers: the replicated (not tensor-parallel) weights identical
        out["tp_replicated_identical"] = [n for g in _groups(ranks, "pp", "dp")
                                          for n in _differing(g, set(g[0]["tp_replicated"]))]
    if opts.pp > 1 and opts.tie_embeddings:  # first stage's embedding == last stage's output-layer copy
        diff = []
        for g in _groups(ranks, "tp", "dp"):
            first = [r["tied"]["embedding"] for r in g if "embedding" in r["tied"]]
            last = [r["tied"]["output"] for r in g if "output" in r["tied"]]
            assert len(first) == 1 and len(last) == 1, [r["tied"] for r in g]
            diff += [] if first == last else [f"embedding vs output_layer (tp {g[0]['coords']['tp']})"]
        out["tied_embeddings_equal"] = diff
    return out


@pytest.mark.mcore
@pytest.mark.parametrize("name", list(CONFIGS))
def test_finalize_hook_effects(request: pytest.FixtureRequest, name: str) -> None:
    ranks = _ranks(request, name)
    opts = SCENARIOS.options_of(CONFIGS[name])
    evidence = _finalize_evidence(name, ranks)
    assert evidence or opts.experts, f"{name}: no sign of the finalize hook applies"
    if opts.tp > 1 and opts.sequence_parallel:
        assert any("layernorm" in n for n in ranks[0]["tp_replicated"]), ranks[0]["tp_replicated"]
    if opts.experts:
        assert all(r["expert"] for r in ranks), "no expert parameters found"
    if opts.overlap and opts.distributed_optimizer:
        assert all(r["param_gather_overlapped"] for r in ranks), "overlap_param_gather did not take effect"
    if CONFIGS[name].finalize:
        failed = {check: diff for check, diff in evidence.items() if diff}
        assert not failed, f"ranks differ where finalize_model_grads makes them equal: {failed}"
    else:  # negative control: the checks above must see the missing hook
        assert all(evidence.values()), f"a check did not notice that finalize_model_grads never ran: {evidence}"


@pytest.mark.unit
def test_configurations_are_valid_and_named_once() -> None:
    from mcore_compat.selfcheck.models import SEQ

    assert len(CONFIGS) == len(SCENARIOS.configs())
    for config in CONFIGS.values():
        opts = SCENARIOS.options_of(config)
        assert opts.tp * opts.pp * opts.dp == config.world
        if opts.sequence_parallel:
            assert SEQ % opts.tp == 0


@pytest.mark.unit
def test_every_release_limit_names_a_capability() -> None:
    from mcore_compat.capabilities import capability
    from mcore_compat.selfcheck.models import REQUIREMENTS

    for req in REQUIREMENTS:
        assert capability(req.capability).versions, req
