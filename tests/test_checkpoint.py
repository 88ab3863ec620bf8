"""Checkpoints (``mcore_compat.save_checkpoint`` / ``load_checkpoint``): exact resume in every release session,
resharding over data-parallel size, refusals that leave the model and optimizer untouched.

ONE module-scoped ``run_all`` on the session's 2 gloo ranks (tests/_checkpoint_scenarios.py); the tests assert.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _checkpoint_scenarios as SCENARIOS
import pytest
from conftest import run_scenarios, supported_case

RESUME = [n for n in SCENARIOS.CASE_NAMES if n.startswith("resume-")]


@pytest.fixture(scope="module")
def keep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoint-keep")


@pytest.fixture(scope="module")
def one_rank() -> Iterator[Any]:
    """ONE gloo rank for the loads at DP=1 / PP=1 of the 2-rank checkpoints, started once for this module."""
    from conftest import WARM_CPU

    from mcore_compat.launch import Group

    with Group(1, device="cpu", destroy_subgroups=True, warm=WARM_CPU) as group:
        yield group


@pytest.fixture(scope="module")
def results(rank_group: Any, keep: Path) -> dict[str, Any]:
    return run_scenarios(rank_group, functools.partial(SCENARIOS.run_all, keep=str(keep)), timeout=600)


def _case(results: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return supported_case(results, name)


@pytest.mark.mcore
@pytest.mark.parametrize("name", RESUME)
def test_resume_is_exact(results: dict[str, Any], name: str) -> None:
    for r in _case(results, name):
        assert r["differs_before"] > 0  # the fresh build really started elsewhere
        assert r["after_load"] == [], r["after_load"]  # weights, main params, both moments, step: as saved
        assert r["n_state"] >= 3  # Adam's exp_avg, exp_avg_sq and step were among the values compared
        assert r["fresh_tail"] == r["tail"], (r["fresh_tail"], r["tail"])  # the loss curve, bit for bit
        assert r["final_diff"] == [], r["final_diff"]  # and everything after M more steps
        assert r["iteration"] == SCENARIOS.K and r["extra"] == {"seen": SCENARIOS.K} and r["rng_restored"]


@pytest.mark.mcore
def test_a_dropped_moment_is_caught(results: dict[str, Any]) -> None:
    """The resume comparison can fail: a loader that drops exp_avg is named by it (every main param's exp_avg)."""
    for r in _case(results, "fault-dropped-moment"):
        assert r["after_load"] and all(k.startswith("state:") and k.endswith(".exp_avg") for k in r["after_load"]), \
            r["after_load"]


@pytest.mark.mcore
def test_reshard_distributed_optimizer_on_off(results: dict[str, Any]) -> None:
    for r in _case(results, "reshard"):
        assert r["dp2-distopt-bf16->dp2-plain-fp32"] == [], r["dp2-distopt-bf16->dp2-plain-fp32"]
        assert r["dp2-plain-fp32->dp2-distopt-bf16"] == [], r["dp2-plain-fp32->dp2-distopt-bf16"]
        assert r["tp_refusal"] and r["tp_refusal"].startswith("CheckpointReshardError") \
            and "TP 1 -> 2" in r["tp_refusal"] and "mcore_compat.torch" in r["tp_refusal"], r["tp_refusal"]
        assert r["tp_unchanged"] == [], r["tp_unchanged"]


@pytest.mark.mcore
def test_reshard_dp2_to_dp1(results: dict[str, Any], keep: Path, one_rank: Any) -> None:
    """Saved at DP=2 with the distributed optimizer, loaded on one rank (DP=1) with and without it: every weight,
    main param, moment and step as saved; the RNG states are not restored (another layout), and it trains on."""
    _case(results, "reshard")
    (out,) = one_rank.run(functools.partial(SCENARIOS.load_at_dp1, str(keep)), timeout=300)
    for mode, r in out.items():
        assert r["diff"] == [] and not r["rng_restored"] and r["trains"], (mode, r)


BAD = {"truncated": "CheckpointFormatError", "corrupt": "CheckpointFormatError", "foreign": "CheckpointFormatError",
       "in_progress": "CheckpointInProgressError", "missing_shard": "CheckpointFormatError",
       "other_model": "CheckpointMismatchError", "other_dtype": "CheckpointMismatchError"}


@pytest.mark.mcore
@pytest.mark.parametrize("tag", list(BAD))
def test_bad_checkpoint_refused_and_nothing_loaded(results: dict[str, Any], tag: str) -> None:
    for r in _case(results, "bad-input"):
        assert r[tag] is not None and r[tag].startswith(BAD[tag]), r[tag]
        assert "\n" not in r[tag]
        unchanged = r["unchanged"] if tag not in ("other_model", "other_dtype") else r[f"{tag}_unchanged"]
        assert unchanged == [], unchanged


def _shard_values(ckpt: Path, tp: int) -> dict[str, Any]:
    """TP rank ``tp``'s values read straight from the checkpoint's rank files: each model tensor, and per param
    the main param, both moments (flattened ranges of the data-parallel ranks concatenated) and the step."""
    import json

    import torch

    manifest = json.loads((ckpt / "mcore_compat_checkpoint.json").read_text())
    files = [torch.load(ckpt / f["name"], weights_only=True) for f in manifest["files"] if f["coords"]["tp"] == tp]
    out: dict[str, Any] = {f"model:0.{k}": v.float() for k, v in files[0]["model"][0].items()
                           if isinstance(v, torch.Tensor)}
    records: dict[str, list[dict[str, Any]]] = {}
    for f in files:
        for r in f["optimizer"]["params"]:
            records.setdefault(r["key"], []).append(r)
    for key, rs in records.items():
        rs = sorted({r["start"] or 0: r for r in rs}.values(), key=lambda r: r["start"] or 0)  # DP replicas once
        out[f"main:{key}"] = torch.cat([r["main"].reshape(-1) for r in rs]).float()
        for what in ("exp_avg", "exp_avg_sq"):
            out[f"{what}:{key}"] = torch.cat([r["state"][what].reshape(-1) for r in rs]).float()
        out[f"step:{key}"] = float(rs[0]["state"]["step"])
    return out


def _cat_tp(per_rank: list[dict[str, Any]], attrs: dict[str, list[Any]]) -> dict[str, Any]:
    """The TP=1 values of TP shards ``per_rank``: torch.cat along Megatron's partition_dim (``attrs``: dim, stride,
    shard shape per param, read from the live TP=2 params); duplicated tensors from TP rank 0."""
    import torch

    out: dict[str, Any] = {}
    for k, v in per_rank[0].items():
        what, _, name = k.partition(":")
        dim, stride, shape = attrs.get(name, [-1, 1, None])
        assert stride == 1, (name, stride)  # the test model has no strided (gated) layout
        if dim < 0 or not isinstance(v, torch.Tensor) or what == "step":
            out[k] = v
        else:
            out[k] = torch.cat([r[k].reshape(shape) for r in per_rank], dim)
            if what != "model":
                out[k] = out[k].reshape(-1)
    return out


def _differ(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The keys whose values are not bit-equal (a step as a float: ``_full_state`` keeps it in a tensor's first
    element)."""
    import torch

    a, b = ({k: float(v.reshape(-1)[0]) if k.startswith("step:") and isinstance(v, torch.Tensor) else v
             for k, v in d.items()} for d in (a, b))
    keys = sorted(set(a) | set(b))
    return [k for k in keys if k not in a or k not in b
            or not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else float(a[k]) == float(b[k]))]


@pytest.mark.mcore
def test_reshard_tp(results: dict[str, Any], keep: Path) -> None:
    """TP=2 -> TP=1 and TP=1 -> TP=2 (2 steps trained, distributed optimizer, sequence parallel at TP=2, biases):
    weights, main params, both moments and step after the load equal the saved shards joined with torch.cat along
    Megatron's partition_dim (or the saved whole cut the same way), bit for bit; the RNG states are not restored;
    step 3 from the loaded state computes the saved run's step-3 loss (also for a gated MLP, Megatron's
    partition_stride 2 layout). A TP=1 model with another vocabulary size is refused naming the embedding, unchanged."""
    import torch

    per_rank = _case(results, "reshard-tp")
    for tag in ("tp2-tp1", "tp1-tp2", "gated-tp2-tp1"):  # DP rank 0 (global rank 0) computes step 3's loss on the same batch with the
        r = per_rank[0][tag]            # same weights at either TP size: equal up to the reduction order
        assert abs(r["loss"] - r["next_loss"]) <= 1e-5 * abs(r["next_loss"]), r
    for r in per_rank:
        for tag in ("tp2-tp1", "tp1-tp2"):
            assert r[tag]["rng_restored"] is False and r[tag]["iteration"] == 2, r[tag]
        assert r["vocab_refusal"] and r["vocab_refusal"].startswith("CheckpointReshardError") \
            and "embedding.word_embeddings.weight" in r["vocab_refusal"] and "vocabulary" in r["vocab_refusal"] \
            and "TP=2" in r["vocab_refusal"] and "\n" not in r["vocab_refusal"], r["vocab_refusal"]
        assert r["vocab_unchanged"] == [], r["vocab_unchanged"]

    def dump(tag: str, kind: str, rank: int) -> dict[str, Any]:
        return torch.load(keep / f"{tag}.{kind}.rank{rank}.pt", weights_only=True)

    # TP=2 -> TP=1: the shards in the checkpoint's files, joined, are what both TP=1 (DP) ranks hold
    attrs2 = dump("tp2-tp1", "saved", 0)["attrs"]
    joined = _cat_tp([_shard_values(keep / "tp2-tp1", t) for t in (0, 1)], attrs2)
    for rank in (0, 1):
        loaded = dump("tp2-tp1", "loaded", rank)["values"]
        assert _differ(loaded, joined) == [], _differ(loaded, joined)
    # and the checkpoint's files hold what the TP=2 ranks had at save
    for t in (0, 1):
        saved = dump("tp2-tp1", "saved", t)["values"]
        assert _differ(_shard_values(keep / "tp2-tp1", t), saved) == []
    # TP=1 -> TP=2: the two TP=2 ranks' loaded shards, joined, are the TP=1 checkpoint's values
    attrs2 = dump("tp1-tp2", "loaded", 0)["attrs"]
    joined = _cat_tp([dump("tp1-tp2", "loaded", t)["values"] for t in (0, 1)], attrs2)
    whole = _shard_values(keep / "tp1-tp2", 0)
    assert _differ(joined, whole) == [], _differ(joined, whole)
    assert sum(1 for k in whole if k.startswith("exp_avg_sq:")) >= 8


def _restage(values: dict[str, Any], offset: int) -> dict[str, Any]:
    """A pipeline stage's dumped values under PP=1 names: its local layer ``decoder.layers.<i>`` is global layer
    ``offset + i`` (the test model has 2 layers on each of the 2 stages)."""
    import re

    return {re.sub(r"(0\.decoder\.layers\.)(\d+)\.", lambda m: f"{m[1]}{int(m[2]) + offset}.", k): v
            for k, v in values.items()}


_TIED = ("embedding.word_embeddings.weight", "output_layer.weight")


def _join_stages(first: dict[str, Any], last: dict[str, Any]) -> dict[str, Any]:
    """The PP=1 values of a PP=2 model's two stages: the last stage's layers renumbered; its tied output layer copy
    (weight, main param, both moments, step) checked equal to the first stage's embedding and left out."""
    embedding, output = _TIED
    copies = {k: v for k, v in last.items() if k.endswith(f":0.{output}")}
    assert len(copies) == 5, sorted(copies)  # the model weight, and the optimizer's main param, moments, step
    for k, v in copies.items():
        twin = k.replace(output, embedding)
        assert _differ({k: first[twin]}, {k: v}) == [], k
    rest = _restage({k: v for k, v in last.items() if k not in copies}, 2)
    assert not set(first) & set(rest), sorted(set(first) & set(rest))
    return {**first, **rest}


def _tamper_tied(src: Path, dst: Path) -> None:
    """A copy of the PP=2 checkpoint ``src`` whose last stage's tied output weight no longer equals the embedding
    (one element changed; the manifest's byte count updated, the checksums removed: as if written before them,
    else the load refuses the changed shard by its checksum first)."""
    import json
    import shutil

    import torch

    shutil.copytree(src, dst, dirs_exist_ok=True)
    manifest = json.loads((dst / "mcore_compat_checkpoint.json").read_text())
    (last,) = [f for f in manifest["files"] if f["coords"]["pp"] == 1]
    shard = torch.load(dst / last["name"], weights_only=True)
    shard["model"][0]["output_layer.weight"].view(-1)[0] += 1
    torch.save(shard, dst / last["name"])
    last["bytes"] = (dst / last["name"]).stat().st_size
    (dst / "mcore_compat_checkpoint.json").write_text(json.dumps(manifest))
    (dst / "mcore_compat_checksums.json").unlink()


@pytest.mark.mcore
def test_reshard_pp(results: dict[str, Any], keep: Path, one_rank: Any) -> None:
    """PP=2 -> PP=1 (on the 2 ranks as DP=2, and on one rank) and PP=1 (DP=2) -> PP=2 (2 steps trained, tied
    embeddings, biases, bf16 with fp32 main params, distributed optimizer): weights, main params, both moments and
    step after the load equal the saved run's values, the stages joined in the test (stage 1's layers renumbered,
    its tied output layer equal to the embedding), bit for bit; the layer numbers recorded at save are Megatron's;
    step 3 from the loaded state computes the saved run's step-3 loss on the same batch; a model with another
    layer count is refused, unchanged, and so are a checkpoint without the pipeline record and one whose tied output
    weight differs from the embedding."""
    import json

    import torch
    from packaging.version import Version

    from mcore_compat.training.tied_buckets import can_straddle

    per_rank = _case(results, "reshard-pp")
    # the builds use the distributed optimizer, except on a release that lays this model's tied embedding over two
    # gradient buckets with it (0.7) and refuses to build it (mcore_compat.training.tied_buckets)
    distopt = (True, False) if can_straddle(Version(results["version"])) else (True,)
    for r in per_rank:
        for tag in ("pp2-pp1", "pp1-pp2"):
            t = r[tag]
            assert abs(t["loss"] - t["next_loss"]) <= 1e-5 * abs(t["next_loss"]), t
            assert t["rng_restored"] is False and t["iteration"] == 2, t
            assert all(d in distopt for d in t["distopt"]), t  # [saved run, loading run]
        assert r["layers_refusal"] and r["layers_refusal"].startswith("CheckpointMismatchError") \
            and "4 transformer layers" in r["layers_refusal"] and "\n" not in r["layers_refusal"], r["layers_refusal"]
        assert r["layers_unchanged"] == [], r["layers_unchanged"]
        assert r["record_refusal"] and r["record_refusal"].startswith("CheckpointReshardError") \
            and "PP 2 -> 1" in r["record_refusal"] and "layer numbers" in r["record_refusal"] \
            and "\n" not in r["record_refusal"], r["record_refusal"]
        assert r["record_unchanged"] == [], r["record_unchanged"]
    record = json.loads((keep / "pp2-pp1" / "mcore_compat_pipeline.json").read_text())
    assert [sorted(record[f"pp{s}"][0]["layers"].values()) for s in (0, 1)] == [[1, 2], [3, 4]], record
    assert [record[f"pp{s}"][0]["tied"] for s in (0, 1)] == list(_TIED), record

    def dump(tag: str, kind: str, rank: int) -> dict[str, Any]:
        return torch.load(keep / f"{tag}.{kind}.rank{rank}.pt", weights_only=True)

    # PP=2 -> PP=1: the two stages' values at save, joined, are what each PP=1 rank holds after the load
    joined = _join_stages(dump("pp2-pp1", "saved", 0), dump("pp2-pp1", "saved", 1))
    assert sum(1 for k in joined if k.startswith("exp_avg_sq:")) >= 20 and any(".bias" in k for k in joined)
    for rank in (0, 1):
        loaded = dump("pp2-pp1", "loaded", rank)
        assert _differ(loaded, joined) == [], _differ(loaded, joined)
    _tamper_tied(keep / "pp2-pp1", keep / "pp2-pp1-tampered")
    (one,) = one_rank.run(functools.partial(SCENARIOS.load_pp_at_1rank, str(keep)), timeout=300)
    next_loss = per_rank[0]["pp2-pp1"]["next_loss"]
    for mode in (True, False):
        r = one[f"distopt={mode}"]
        values = torch.load(keep / f"pp2-pp1.loaded.1rank.distopt={mode}.pt", weights_only=True)
        assert _differ(values, joined) == [], (mode, _differ(values, joined))
        assert not r["rng_restored"] and r["iteration"] == 2 and r["distopt"] in (distopt if mode else (False,)), r
        assert abs(r["loss"] - next_loss) <= 1e-5 * abs(next_loss), (mode, r["loss"], next_loss)
    assert one["tied_refusal"] and one["tied_refusal"].startswith("CheckpointReshardError") \
        and "output_layer.weight on saved PP stage 1" in one["tied_refusal"] and "PP=2" in one["tied_refusal"] \
        and "\n" not in one["tied_refusal"], one["tied_refusal"]
    assert one["tied_unchanged"] == [], one["tied_unchanged"]
    # PP=1 -> PP=2: the two stages' loaded values, joined, are the PP=1 run's values at save
    joined = _join_stages(dump("pp1-pp2", "loaded", 0), dump("pp1-pp2", "loaded", 1))
    saved = dump("pp1-pp2", "saved", 0)
    assert _differ(joined, saved) == [], _differ(joined, saved)
