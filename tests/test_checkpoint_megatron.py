"""Checkpoints Megatron-LM wrote (``megatron.core.dist_checkpointing``, torch_dist) loaded with
``mcore_compat.load_checkpoint``: weights bit-equal at the saved and at another TP size (Megatron reshards),
``iteration`` / ``checkpoint_version`` / scheduler restored, the optimizer and bad input refused with nothing loaded;
``checkpoint inspect`` describes such a directory.

ONE module-scoped ``run_all`` on the session's 2 gloo ranks (tests/_checkpoint_megatron_scenarios.py); the
checkpoints are committed (tests/data/megatron_checkpoints/, written by Megatron 0.16.1's dist_checkpointing.save).
Runs on 0.6-0.19; releases without the torch_dist backend (0.4, 0.5), and 0.6-0.12 where psutil is not installed
(their torch_dist strategy imports it), skip naming the reason.
"""

from __future__ import annotations

from typing import Any

import _checkpoint_megatron_scenarios as SCENARIOS
import pytest
from conftest import run_scenarios, supported_case

LOADS = [n for n in SCENARIOS.CASE_NAMES if "->" in n]


@pytest.fixture(scope="module")
def results(rank_group: Any) -> dict[str, Any]:
    return run_scenarios(rank_group, SCENARIOS.run_all, timeout=300)


def _case(results: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return supported_case(results, name)


@pytest.mark.mcore
@pytest.mark.parametrize("name", LOADS)
def test_megatron_checkpoint_loads_exactly(results: dict[str, Any], name: str) -> None:
    """Every weight equals the saved one bit for bit (saved TP shards joined along Megatron's partition_dim and
    cut for this TP rank: another TP size is resharded by Megatron's own load)."""
    for r in _case(results, name):
        assert r["differs_before"] > 0 and r["n"] >= 10, r  # the fresh build really started elsewhere
        assert r["diff"] == [], r["diff"]
        assert r["iteration"] == SCENARIOS.ITERATION and r["checkpoint_version"] == 3.0, r
        assert r["optimizer_loaded"] is False and r["rng_restored"] is False and r["manifest"] is None, r
        if name.startswith("tp1->tp1"):  # the checkpoint with Megatron-LM's opt_param_scheduler
            assert r["scheduler_loaded"] is True and r["scheduler_equal"] is True, r


BAD = {"truncated": ("CheckpointFormatError", "metadata.json"), "zarr": ("CheckpointFormatError", "'zarr'"),
       "missing_shard": ("CheckpointFormatError", "dist_checkpointing.load failed"),
       "optimizer": ("CheckpointError", "dp_reshardable"),
       "other_shapes": ("CheckpointMismatchError", "embedding.word_embeddings.weight")}


@pytest.mark.mcore
@pytest.mark.parametrize("tag", list(BAD))
def test_bad_megatron_checkpoint_refused_and_nothing_loaded(results: dict[str, Any], tag: str) -> None:
    kind, named = BAD[tag]
    for r in _case(results, "bad-input"):
        assert r[tag] is not None and r[tag].startswith(f"{kind}: ") and named in r[tag], r[tag]
        assert "\n" not in r[tag]
        assert r[f"{tag}_unchanged"] == [], r[f"{tag}_unchanged"]  # the model and optimizer as they were
    if tag == "optimizer":
        assert "optimizer=None" in r[tag], r[tag]


def test_inspect_megatron_checkpoint() -> None:
    """``checkpoint inspect --json`` (no Megatron): backend, iteration, checkpoint_version, the model tensors'
    global shapes, the optimizer's format, and what mcore_compat loads of it."""
    from mcore_compat.checkpoint import inspect_checkpoint
    from mcore_compat.checkpoint.inspect import render

    info = inspect_checkpoint(SCENARIOS.DATA / "tp2")
    assert info["format"] == "megatron dist_checkpointing" and info["metadata"]["sharded_backend"] == "torch_dist"
    assert info["iteration"] == SCENARIOS.ITERATION and info["checkpoint_version"] == 3.0
    assert info["model"]["embedding.word_embeddings.weight"]["shape"][1] > 0 and info["optimizer"] is None
    assert "args" in info["common"]
    full = inspect_checkpoint(SCENARIOS.DATA / "tp1")
    assert full["optimizer"] == "distributed optimizer, dp_reshardable" and full["scheduler"] is True
    assert "optimizer=None" in full["loadable"]["optimizer"]
    assert info["model"]["embedding.word_embeddings.weight"] == full["model"]["embedding.word_embeddings.weight"]
    text = render(full)
    assert "dp_reshardable" in text and "embedding.word_embeddings.weight" in text and "iteration 7" in text
