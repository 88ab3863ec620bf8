"""Checkpoints across releases, in every release session: the committed fixtures (tests/data/checkpoints/<A>/,
written by ``mcore_compat.save_checkpoint`` on each release A of :data:`SOURCES`; scripts/checkpoint_matrix.py
``--write-fixtures`` / ``--check``) loaded on the session's release B.

ONE module-scoped run on the session's 2 gloo ranks (tests/_checkpoint_cross_scenarios.py): each fixture loaded
into a fresh build (another seed) with the optimizer and weights only; every weight, main param, both Adam moments
and the step must equal the fixture's reference bit for bit, and a step must train after the load. A pair listed
in :data:`REFUSED` must be refused with exactly that error instead. On a release that wrote a fixture, the fixture
is written again and must be what is committed. ``mcore-compat checkpoint inspect --json`` reads every fixture.

The per-source outcome goes to ``$MCORE_COMPAT_CHECKPOINT_REPORT`` (when set) for the matrix
(``matrix/results.json``'s ``checkpoint_cross`` of the release, shown in ``matrix/README.md``).
"""

from __future__ import annotations

import json
import os
from typing import Any

import _checkpoint_cross_scenarios as X
import pytest
from conftest import case_results, run_scenarios
from packaging.version import Version

SOURCES = list(X.SOURCES)
#: (saved on A, loaded on B) -> the refusal of the optimizer's / the weights' load: none so far (every pair of
#: the 6 x 23 loads exactly). A pair that cannot load goes here with its exact error text.
REFUSED: dict[tuple[str, str], dict[str, str]] = {}


@pytest.fixture(scope="module")
def results(rank_group: Any) -> dict[str, Any]:
    out = run_scenarios(rank_group, X.load_fixtures, timeout=300)
    _report(out)
    return out


def _report(results: dict[str, Any]) -> None:
    """Rank 0's outcome per source release to ``$MCORE_COMPAT_CHECKPOINT_REPORT`` (when set)."""
    target = os.environ.get("MCORE_COMPAT_CHECKPOINT_REPORT")
    if not target:
        return
    loads: dict[str, dict[str, str]] = {}
    for src in SOURCES:
        per_rank = [r[f"from-{src}"] for r in results["ranks"]]
        if any(r["status"] != "ok" for r in per_rank):
            loads[src] = {"full": "error", "weights": "error"}
            continue
        loads[src] = {part: per_rank[0][part]["result"] if all(r[part] == per_rank[0][part] for r in per_rank)
                      else "ranks differ" for part in ("full", "weights")}
    with open(target, "w", encoding="utf-8") as fh:
        json.dump({"release": results["version"], "loads": loads}, fh, indent=1)


def test_the_fixtures_are_committed() -> None:
    """One fixture per release of scripts/checkpoint_matrix.py (which writes them), each small (the rank files
    hold 4 RNG states of 5 KB each)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("checkpoint_matrix", X.FIXTURES.parents[2] / "scripts" /
                                                  "checkpoint_matrix.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    found = sorted((p.name for p in X.FIXTURES.iterdir() if p.is_dir()), key=Version)
    assert found == SOURCES == script.RELEASES and script.FIXTURES == X.FIXTURES
    for src in SOURCES:
        size = sum(f.stat().st_size for f in (X.FIXTURES / src).rglob("*") if f.is_file())
        assert size < 120_000, (src, size)


@pytest.mark.mcore
@pytest.mark.parametrize("src", SOURCES)
def test_load_fixture(results: dict[str, Any], src: str) -> None:
    release = results["version"]
    refused = REFUSED.get((src, release), {})
    for r in case_results(results, f"from-{src}"):
        for part in ("full", "weights"):
            got = r[part]
            if part in refused:
                assert got["result"] == f"refused: {refused[part]}", got
                continue
            assert got["differs_before"] > 0, got  # the fresh build really started elsewhere
            assert got["result"] == "exact", (src, release, part, got["result"])
            assert got["step_after_load"] == "ok", got
    if src == release:  # the release that wrote the fixture still writes the same values and manifest
        for r in case_results(results, "regenerate")[:1]:  # compared on rank 0
            assert r["diff"] == [], f"megatron-core {release} now writes another fixture: {r['diff'][:40]} (run " \
                f"scripts/checkpoint_matrix.py --write-fixtures --releases {release}, and commit)"


@pytest.mark.mcore
@pytest.mark.parametrize("src", SOURCES)
def test_inspect_fixture(src: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``mcore-compat checkpoint inspect --json``: the writing release, the DP=2 layout, the optimizer."""
    from mcore_compat.cli import main

    assert main(["checkpoint", "inspect", str(X.FIXTURES / src / "checkpoint"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    m = info["manifest"]
    assert info["written_by"]["megatron_core"] == m["megatron_core"] == src
    assert m["format"] == "mcore_compat.torch" and m["format_version"] == 1
    assert m["layout"] == {"world": 2, "tp": 1, "pp": 1, "dp": 2, "ep": 1, "vpp": 1}
    assert m["distributed_optimizer"] and m["has_optimizer"] and not m["has_scheduler"]
    assert m["iteration"] == X.STEPS and [f["name"] for f in m["files"]] == ["rank_00000.pt", "rank_00001.pt"]
    assert info["model"][0]["embedding.word_embeddings.weight"] == {"shape": [16, 8], "dtype": "bfloat16"}
    assert {tuple(r["state"]) for r in info["optimizer"]} == {("exp_avg", "exp_avg_sq", "step")}
    assert set(info["loadable"]) == {"weights", "optimizer"}


def test_fixture_diff_names_what_changed(tmp_path: Any) -> None:
    """What ``--check`` and the writing release's session compare: equal to itself (the writers' mcore_compat and
    torch versions and the shard sizes aside); a changed value of a shard or of the reference, a manifest field,
    a missing file are named."""
    import shutil

    import torch

    src = X.FIXTURES / SOURCES[0]
    assert X.fixture_diff(src, src) == []
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    manifest = copy / "checkpoint" / "mcore_compat_checkpoint.json"
    data = json.loads(manifest.read_text())
    data.update(mcore_compat="9.9.9", torch="0.0.1")
    data["files"][0]["bytes"] += 1
    manifest.write_text(json.dumps(data))
    assert X.fixture_diff(src, copy) == []
    data["iteration"] = 3
    manifest.write_text(json.dumps(data))
    shard = torch.load(copy / "checkpoint" / "rank_00001.pt", weights_only=True)
    shard["optimizer"]["params"][0]["state"]["exp_avg"][0] += 1
    torch.save(shard, copy / "checkpoint" / "rank_00001.pt")
    ref = torch.load(copy / "reference.pt", weights_only=True)
    ref["flat"][-1] += 1
    torch.save(ref, copy / "reference.pt")
    (copy / "checkpoint" / "mcore_compat_tensor_parallel.json").unlink()
    (copy / "checkpoint" / "mcore_compat_tensor_parallel.json").write_text("{}")
    diff = [d.split(" (")[0] for d in X.fixture_diff(src, copy)]  # a floating value's entry ends "(N ulp)"
    assert "manifest.iteration" in diff and "reference.pt.flat" in diff, diff
    assert "checkpoint/rank_00001.pt.optimizer.params[0].state.exp_avg" in diff, diff
    assert any(d.startswith("tp_record.") for d in diff), diff
    (copy / "reference.pt").unlink()
    assert X.fixture_diff(src, copy)[0].startswith("files ")


def test_floating_values_compare_within_a_few_ulp_at_the_tensor_scale() -> None:
    """The regenerated fixture's floats may carry the last-place spread of another CPU's kernels (FLOAT_ULPS at
    the tensor's largest magnitude); a real change of value, a NaN, a dtype, a shape or an integer may not."""
    import torch

    a = torch.tensor([0.5, -0.25, 1e-6, 0.0], dtype=torch.float32)
    eps = torch.finfo(torch.float32).eps
    near = a.clone()
    near[0] += 2 * eps * 0.5  # 2 ulp of the largest element (0.5 lies in [2^-1, 2^0))
    near[2] += eps * 0.5  # an element near 0 is judged at the tensor's scale: 1 ulp of 0.5
    assert X.ulp_distance(a, near) == 2.0 and X._values_diff(a, near, "t") == []
    assert X._values_diff(a, a * (1 + 1e-4), "t") == ["t (839 ulp)"]  # a relative change of 1e-4
    nan = a.clone()
    nan[3] = float("nan")
    assert X._values_diff(a, nan, "t") == ["t (inf ulp)"]
    assert X._values_diff(a, a.double(), "t") == ["t"] and X._values_diff(a, a[:3], "t") == ["t"]
    assert X._values_diff(torch.tensor([1, 2]), torch.tensor([1, 3]), "i") == ["i (inf ulp)"]
    assert X._values_diff(a.bfloat16(), a.bfloat16(), "b") == []
