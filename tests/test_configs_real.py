"""The self-check's model in its parallel configurations, built on the installed release: what the self-check's
proofs (tests/test_selfcheck_real.py) take for granted about its construction.

* virtual stage ``i`` of pipeline rank ``r`` holds layers ``(i * pp + r) * L + 1 ...`` (Megatron's interleaved
  assignment; ``L`` layers per virtual stage);
* with tied embeddings the first stage holds the input embedding and the last stage the output-layer copy;
* under sequence parallelism the norms (the params every tensor-parallel rank holds whole) are marked
  ``sequence_parallel`` (``finalize_model_grads`` all-reduces exactly those over TP);
* MoE experts are marked expert-parallel (``allreduce=False``).

All configurations are built in ONE call on the session's 2 ranks (``rank_group``); a configuration the release
cannot run is skipped with its ``unsupported_reason``.
"""

from __future__ import annotations

from typing import Any

import _config_scenarios as SCENARIOS
import pytest

from mcore_compat.launch import Group

CONFIGS = {c.name: c for c in SCENARIOS.configs()}


@pytest.fixture(scope="module")
def world2(rank_group: Group) -> list[dict[str, Any]]:
    return rank_group.run(SCENARIOS.build_world, args=(2,), timeout=600)


def _ranks(world2: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    ranks = [r[name] for r in world2]
    if any(r["status"] == "unsupported" for r in ranks):
        pytest.skip(ranks[0]["reason"])
    return ranks


@pytest.mark.mcore
@pytest.mark.parametrize("name", list(CONFIGS))
def test_chunks_are_built_as_configured(world2: list[dict[str, Any]], name: str) -> None:
    from mcore_compat.selfcheck.models import LAYERS_PER_STAGE

    opts = SCENARIOS.options_of(CONFIGS[name])
    per_stage = LAYERS_PER_STAGE // opts.vpp
    for r in _ranks(world2, name):
        want = [[(i * opts.pp + r["pp_rank"]) * per_stage + k + 1 for k in range(per_stage)]
                for i in range(opts.vpp)]
        assert r["layer_numbers"] == want, (r["pp_rank"], r["layer_numbers"], want)
        if opts.pp > 1 and opts.tie_embeddings:
            first, last = r["pp_rank"] == 0, r["pp_rank"] == opts.pp - 1
            assert ("chunk0.embedding.word_embeddings.weight" in r["names"]) is first
            assert (f"chunk{opts.vpp - 1}.output_layer.weight" in r["names"]) is last
            assert r["tied"] == (["chunk0"] if first else []) + ([f"chunk{opts.vpp - 1}"] if last else [])
        if opts.sequence_parallel:
            norms = [n for n in r["tp_replicated"] if "layernorm" in n or "final_norm" in n]
            assert norms and set(norms) <= set(r["sequence_parallel"]), (norms, r["sequence_parallel"])
        if opts.experts:
            assert r["expert"] and all("experts" in n for n in r["expert"]), r["expert"]


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
