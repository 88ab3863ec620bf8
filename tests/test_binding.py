"""Parameter binding: ``bind_params``, ``verify``, views/manifest, ``gather_pipeline`` and
``gather_pipeline_flat``, ``unbind``.

ONE module-scoped ``run_all`` on the session's 2 gloo ranks (``rank_group``) runs every configuration (tests/_binding_scenarios.py) in one gloo group;
the tests below only assert. Unit tests (no megatron-core) cover the manifest and the error texts.
"""

from __future__ import annotations

import json
from typing import Any

import _binding_scenarios as SCENARIOS
import pytest
import torch
from conftest import case_results, run_scenarios

from mcore_compat._facts.ranges import in_range
from mcore_compat.binding import (
    BindingError,
    Manifest,
    ManifestBuffer,
    ManifestEntry,
    StageBuffers,
    bind_params,
    gather_pipeline_flat,
)
from mcore_compat.errors import McoreCompatError

BIND_STEP_CASES = [n for n in SCENARIOS.CASE_NAMES if n.startswith("bind-")]
FAULT_CASES = [n for n in SCENARIOS.CASE_NAMES if n.startswith("faults-")]
CHUNK_CASES = [n for n in SCENARIOS.CASE_NAMES if n.startswith("two-chunks-")]
#: Releases whose DistributedDataParallelConfig has reuse_grad_buf_for_mxfp8_param_ag.
MXFP8_FLAG_RELEASES = ">=0.13"
UNBIND_CASES = [n for n in SCENARIOS.CASE_NAMES if n.startswith("unbind-")]
PIPELINE_CASES = [n for n in SCENARIOS.CASE_NAMES if n.startswith("pipeline-")]
OWN_BUFFER_CASES = [n for n in SCENARIOS.CASE_NAMES if n.startswith("own-buffer-")]


# ---------------------------------------------------------------------------------------------------------------
# unit tests (no megatron-core needed)
# ---------------------------------------------------------------------------------------------------------------

def _manifest() -> Manifest:
    return Manifest(
        buffers=(ManifestBuffer(0, 0, "chunk0/bfloat16->float32/dense", "bfloat16", 40, True),
                 ManifestBuffer(1, 0, "chunk0/float32->float32/dense", "float32", 6, False)),
        params=(ManifestEntry("w", 0, 0, 8, (4, 8), "bfloat16"), ManifestEntry("b", 0, 0, 0, (4,), "bfloat16"),
                ManifestEntry("scale", 0, 1, 0, (2, 3), "float32")),
        version="0.16.1",
    )


@pytest.mark.unit
def test_manifest_json_round_trip() -> None:
    m = _manifest()
    text = m.to_json()
    assert json.loads(text)["params"][0]["shape"] == [4, 8]
    assert Manifest.from_json(text) == m
    assert Manifest.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    assert m.params[0].numel == 32 and m.buffers[0].torch_dtype is torch.bfloat16


@pytest.mark.unit
def test_manifest_module_stands_alone_without_a_process_group() -> None:
    """``mcore_compat.binding.manifest`` is plain data: a fresh interpreter imports it, round-trips a manifest
    through JSON and reads views of buffers laid out by it, with no process group and no Megatron."""
    import subprocess
    import sys

    code = (
        "import json, sys, torch\n"
        "from mcore_compat.binding.manifest import MANIFEST_FORMAT, Manifest, ManifestBuffer, ManifestEntry\n"
        "m = Manifest((ManifestBuffer(0, 0, 'k', 'float32', 6, False),),\n"
        "             (ManifestEntry('w', 0, 0, 0, (2, 2), 'float32'), ManifestEntry('b', 0, 0, 4, (2,), 'float32')),\n"
        "             '0.9.0')\n"
        "back = Manifest.from_json(m.to_json())\n"
        "assert back == m and back.format_version == MANIFEST_FORMAT, back\n"
        "views = back.views([torch.arange(6, dtype=torch.float32)])\n"
        "assert views['b'].tolist() == [4.0, 5.0] and views['w'].shape == (2, 2)\n"
        "assert not (torch.distributed.is_available() and torch.distributed.is_initialized())\n"
        "assert not any(n == 'megatron' or n.startswith('megatron.') for n in sys.modules), 'megatron imported'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.unit
def test_the_readme_consumer_reads_what_the_manifest_says() -> None:
    """docs/binding.md documents the manifest's keys with a plain-torch consumer; that code (run as written) must read
    every parameter exactly where ``Manifest.views`` does (the real bindings run it too, in every release)."""
    from _binding_scenarios import _readme_consumer

    m = _manifest()
    flats = [torch.arange(40, dtype=torch.bfloat16), torch.arange(6, dtype=torch.float32)]
    weights = _readme_consumer(m.to_json(), flats)
    views = m.views(flats)
    assert list(weights) == list(views)
    assert all(torch.equal(weights[n], views[n]) and weights[n].dtype == views[n].dtype for n in views)


@pytest.mark.unit
def test_manifest_views_slice_buffers_and_check_them() -> None:
    m = _manifest()
    flats = [torch.arange(40, dtype=torch.bfloat16), torch.arange(6, dtype=torch.float32)]
    views = m.views(flats)
    assert list(views) == ["w", "b", "scale"]
    assert views["b"].tolist() == [0, 1, 2, 3] and views["w"].shape == (4, 8) and views["w"][0, 0] == 8
    assert views["scale"].data_ptr() == flats[1].data_ptr()
    with pytest.raises(BindingError, match="expected 6 x float32"):
        m.views([flats[0], torch.zeros(7)])
    with pytest.raises(BindingError, match="2 flat buffer"):
        m.views(flats[:1])


@pytest.mark.unit
def test_manifest_views_alias_the_buffers_with_every_shape() -> None:
    """Views are written through to the flat buffer (and back), for matrices, vectors, a scalar and empty params,
    on contiguous buffers, a buffer with a storage offset, and a strided 1-D buffer."""
    m = Manifest(
        buffers=(ManifestBuffer(0, 0, "chunk0/float32->float32/dense", "float32", 20, False),),
        params=(ManifestEntry("w", 0, 0, 8, (3, 4), "float32"), ManifestEntry("b", 0, 0, 4, (4,), "float32"),
                ManifestEntry("scale", 0, 0, 2, (), "float32"), ManifestEntry("empty", 0, 0, 3, (0, 5), "float32")),
    )
    storage = torch.zeros(25)
    for flat in (torch.zeros(20), storage[5:], torch.zeros(40)[::2]):
        views = m.views([flat])
        assert {n: tuple(v.shape) for n, v in views.items()} == {"w": (3, 4), "b": (4,), "scale": (),
                                                                 "empty": (0, 5)}
        assert all(v.is_contiguous() for v in views.values()) == flat.is_contiguous()
        views["w"][1, 2] = 7.0
        views["b"].fill_(2.0)
        views["scale"].fill_(-1.0)
        assert flat[8 + 1 * 4 + 2] == 7.0 and flat[4:8].tolist() == [2.0] * 4 and flat[2] == -1.0
        assert flat.sum() == 7.0 + 8.0 - 1.0
        flat[19] = 5.0
        assert views["w"][2, 3] == 5.0
        assert views["w"].data_ptr() == flat[8:].data_ptr() and views["scale"].data_ptr() == flat[2:].data_ptr()
    assert storage[5 + 2] == -1.0 and storage[:5].sum() == 0


@pytest.mark.unit
def test_stage_buffers_views_and_exports() -> None:
    import mcore_compat
    from mcore_compat import binding

    m = _manifest()
    flats = [torch.arange(40, dtype=torch.bfloat16), torch.arange(6, dtype=torch.float32)]
    sb = StageBuffers(1, m, flats)
    assert list(sb.views()) == ["w", "b", "scale"] and sb.views()["scale"].data_ptr() == flats[1].data_ptr()
    with pytest.raises(AttributeError):
        sb.stage = 0  # type: ignore[misc]
    assert {"StageBuffers", "gather_pipeline_flat"} <= set(binding.__all__)
    assert mcore_compat.gather_pipeline_flat is gather_pipeline_flat and mcore_compat.StageBuffers is StageBuffers


@pytest.mark.unit
def test_manifest_rejects_other_formats_and_malformed_data() -> None:
    data = _manifest().to_dict()
    assert set(data) == {"format_version", "version", "buffers", "params"} and data["format_version"] == 2
    with pytest.raises(BindingError, match="format_version 99"):
        Manifest.from_dict({**data, "format_version": 99})
    older = {k: v for k, v in data.items() if k != "format_version"}
    assert Manifest.from_dict({**older, "format": 2}) == Manifest.from_dict(data)  # written before the rename
    with pytest.raises(BindingError, match="malformed"):
        Manifest.from_dict({**data, "params": [{"name": "x"}]})
    with pytest.raises(BindingError, match="without full_name"):
        Manifest.from_dict({**data, "params": [{k: v for k, v in p.items() if k != "full_name"}
                                               for p in data["params"]]})


@pytest.mark.unit
def test_manifest_version_1_is_still_read() -> None:
    """A version 1 manifest (written before the single-rank placement fields) reads with them unset; it still
    gives views, and gather_full refuses it naming format_version 2."""
    from mcore_compat.binding.full import plan

    v1_fields = ("name", "chunk", "buffer", "offset", "shape", "dtype")
    data = _manifest().to_dict()
    v1 = {**data, "format_version": 1, "params": [{k: p[k] for k in v1_fields} for p in data["params"]]}
    m = Manifest.from_dict(v1)
    assert m.format_version == 1 and all(e.full_name is None and not e.tp_split for e in m.params)
    assert [(e.name, e.offset, e.shape) for e in m.params] == [(e.name, e.offset, e.shape) for e in _manifest().params]
    assert set(m.views([torch.zeros(40, dtype=torch.bfloat16), torch.zeros(6)])) == {"w", "b", "scale"}
    with pytest.raises(BindingError, match="format-2 fields"):
        Manifest.from_dict({**data, "format_version": 1})
    with pytest.raises(BindingError, match="needs format_version 2"):
        plan([m])


@pytest.mark.unit
def test_manifest_v2_placement_round_trips_and_plans_the_full_tensors() -> None:
    """Format 2 fields survive JSON; plan() joins TP shards, skips tied copies and refuses inconsistencies."""
    import dataclasses

    from mcore_compat.binding.full import plan
    from mcore_compat.binding.placement import place_shard, shard, unshard

    def entry(tp_rank: int, **kw: Any) -> ManifestEntry:
        return ManifestEntry("fc1.weight", 0, 0, 0, (4, 3), "float32", full_name="decoder.layers.3.fc1.weight",
                             tp_split=True, partition_dim=0, partition_stride=2, tp_rank=tp_rank, tp_size=2, **kw)

    def manifest(*params: ManifestEntry) -> Manifest:
        return Manifest((ManifestBuffer(0, 0, "k", "float32", 12, True),), params, "0.16.1")

    m0, m1 = manifest(entry(0)), manifest(entry(1))
    assert Manifest.from_json(m0.to_json()) == m0
    (full,) = plan([m0, m1])
    assert full.shape == (8, 3) and {p: r for p, (r, _) in full.pieces.items()} == {0: 0, 1: 1}
    tied = dataclasses.replace(entry(1), name="out", full_name="output_layer.weight", tied_to="emb")
    assert [f.name for f in plan([m0, manifest(entry(1), tied)])] == ["decoder.layers.3.fc1.weight"]
    with pytest.raises(BindingError, match=r"disagree: decoder\.layers\.3\.fc1\.weight: partition_stride"):
        plan([m0, manifest(dataclasses.replace(entry(1), partition_stride=1))])
    with pytest.raises(BindingError, match=r"TP shards \[0\] held, \[0, 1\] needed"):
        plan([m0])
    with pytest.raises(BindingError, match=r"held by pipeline stage 0 .* and 1"):  # same names on two stages
        plan([m0, manifest(entry(1)), manifest(dataclasses.replace(entry(0), pp_rank=1))])
    x = torch.arange(24.0).view(8, 3)
    shards = [shard(x, 0, 2, r, 2) for r in range(2)]
    assert torch.equal(unshard(shards, 0, 2), x)
    out = torch.empty(8, 3)
    for r in range(2):
        place_shard(out, shards[r], 0, 2, r, 2)
    assert torch.equal(out, x)


@pytest.mark.unit
def test_unwrapped_model_is_refused_with_what_to_do() -> None:
    with pytest.raises(BindingError, match="not wrapped in Megatron-Core's DistributedDataParallel") as info:
        bind_params([torch.nn.Linear(2, 2)])
    assert "wrap_ddp" in str(info.value)
    assert isinstance(info.value, McoreCompatError)
    with pytest.raises(BindingError, match="at least one"):
        bind_params([])


def _slots(params: list[torch.Tensor], zero_copy: bool = False) -> tuple[list[Any], list[bool]]:
    from mcore_compat.binding.param_binding import Slot

    slots = [Slot(f"p{i}", f"p{i}", 0, p, 0, 0, tuple(p.shape), i) for i, p in enumerate(params)]  # type: ignore[arg-type]
    return slots, [zero_copy]


@pytest.mark.unit
def test_own_storage_check_names_views_and_spares_the_legitimate() -> None:
    """Views into a larger storage or at a nonzero offset are refused, all named; own storage, the same Parameter
    twice (tied), zero-element views and parameters of zero-copy buffers are not."""
    from mcore_compat.binding.ownership import check_own_storage, storage_problem

    mine = torch.zeros(30)
    own = torch.nn.Parameter(torch.ones(3, 4))
    params = [own, own, torch.nn.Parameter(torch.zeros(0)), mine[7:7], torch.ones(2).t()]
    check_own_storage(*_slots(params))
    assert storage_problem(own) is None and storage_problem(mine[4:4].view(0, 2)) is None
    assert storage_problem(mine[0:6]) == "a view at element 0 of a 120-byte storage (the parameter has 24 bytes)"
    assert storage_problem(mine[6:30]) == "a view at element 6 of a 120-byte storage (the parameter has 96 bytes)"
    check_own_storage(*_slots([mine[0:6], mine[6:30]], zero_copy=True))  # zero-copy: checked elsewhere
    views = [mine[i:i + 1].view(()) for i in range(25)]
    with pytest.raises(BindingError) as info:
        check_own_storage(*_slots([own, mine[0:6], *views]))
    text = str(info.value)
    assert "26 parameter(s) do not own their storage" in text and "\n  p0:" not in text
    assert "\n  p1: a view at element 0 of a 120-byte storage" in text and "\n  p20: a view at element 18 " in text
    assert "\n  p21:" not in text and "... and 6 more" in text
    assert "Nothing was changed" in text and "unbind()" in text and "flat_buffers()" in text


# ---------------------------------------------------------------------------------------------------------------
# against the installed release: one run on the session's ranks for everything
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def results(rank_group: Any) -> dict[str, Any]:
    return run_scenarios(rank_group, SCENARIOS.run_all, timeout=300)


def _has_param_buffer(version: str) -> bool:
    from mcore_compat.layout import layout_fact

    return bool(layout_fact("param_data_with_distopt", version))


@pytest.mark.mcore
def test_raw_rebind_after_optimizer_loses_every_update(results: dict[str, Any]) -> None:
    """The bug, reproduced with raw Megatron (0.6+, distributed optimizer, DP=2): after an outside rebind of
    param.data the step goes into DDP's param buffer and no parameter seen through the model changes."""
    per_rank = case_results(results, "raw-rebind-distopt")
    if not _has_param_buffer(results["version"]):
        assert all(r["status"] == "n/a" for r in per_rank)
        pytest.skip(f"release limit: megatron-core {results['version']} has no DDP param buffer (the bug cannot "
                    f"arise)")
    for r in per_rank:
        assert r["update_successful"] and r["param_data_changed"]
        assert sum(r["changed"].values()) == 0, r["changed"]


@pytest.mark.mcore
@pytest.mark.parametrize("name", BIND_STEP_CASES)
def test_bound_params_train_and_buffers_show_them(results: dict[str, Any], name: str) -> None:
    per_rank = case_results(results, name)
    expected_mode = "zero_copy" if "distopt" in name and _has_param_buffer(results["version"]) else "allocated"
    for r in per_rank:
        assert r["mode"] == expected_mode
        assert r["update_successful"]
        assert all(r["changed"].values()), f"parameters that did not move: {r['changed']}"
        assert r["buffer_matches_model"]
        assert r["verify_error"] is None, r["verify_error"]
    assert per_rank[0]["params"] == per_rank[1]["params"], "DP ranks disagree"


@pytest.mark.mcore
@pytest.mark.parametrize("name", FAULT_CASES)
def test_verify_names_each_broken_parameter(results: dict[str, Any], name: str) -> None:
    for r in case_results(results, name):
        assert r["clean"] is None and r["restored"] is None
        assert "fc1.bias: rebound outside" in r["outside"] and "1 of 4" in r["outside"]
        assert "fc2.bias: at offset" in r["moved"] and "1 of 4" in r["moved"]
        swapped = r["swapped"]
        assert "2 of 4" in swapped
        assert "fc1.weight: at offset" in swapped and "the place of fc2.weight" in swapped
        assert "fc2.weight: at offset" in swapped and "the place of fc1.weight" in swapped
        assert "fc1.bias: replaced by a new Parameter" in r["replaced"]


@pytest.mark.mcore
@pytest.mark.parametrize("name", UNBIND_CASES)
def test_unbind_preserves_weights_and_state_dict(results: dict[str, Any], name: str) -> None:
    for r in case_results(results, name):
        assert r["trained"] and not r["bound_after_exit"]
        assert r["weights_preserved"] and not r["moved_by_unbind"]
        assert r["state_dict_diff"] == [] and r["state_dict_round_trip_diff"] == []
        assert r["bound_load_verify"] is None and r["bound_load_diff"] == []
        assert r["after_unbind_error"] is not None and "unbound" in r["after_unbind_error"]
        assert r["trains_after_unbind"]
        if r["mode"] == "allocated":
            assert r["private_storage"] and r["still_in_flat_buffers"] == []
        else:  # zero-copy: nothing was rebound, the params stay in Megatron's param_data
            assert r["mode"] == "zero_copy" and len(r["still_in_flat_buffers"]) == 4


@pytest.mark.mcore
def test_refusals(results: dict[str, Any]) -> None:
    for r in case_results(results, "refusals"):
        assert r["not_wrapped"] is not None and "wrap_ddp" in r["not_wrapped"]
        if in_range(results["version"], MXFP8_FLAG_RELEASES):
            assert r["mxfp8"] is not None and "reuse_grad_buf_for_mxfp8_param_ag" in r["mxfp8"]


@pytest.mark.mcore
@pytest.mark.parametrize("name", PIPELINE_CASES)
def test_gather_pipeline_returns_every_stage_with_one_collective_per_buffer(results: dict[str, Any],
                                                                            name: str) -> None:
    per_rank = case_results(results, name)
    assert sorted(r["stage"] for r in per_rank) == [0, 1]
    n_buffers = sum(per_rank[0]["flats_per_stage"])
    for r in per_rank:
        assert all(r["changed"].values()), r["changed"]
        assert r["all_equal"] and r["again_equal"], (r["keys"], r["expected_keys"])
        assert r["keys"] == r["expected_keys"]
        assert r["bad_dst"] is not None and "dst=2" in r["bad_dst"]
        assert r["calls_all"] == {"all_gather_object": 1, "broadcast": n_buffers}
        assert r["calls_again"] == {"broadcast": n_buffers}, "the manifest exchange must be cached"
        mine = r["flats_per_stage"][r["stage"]]
        other = n_buffers - mine
        if r["stage"] == 0:  # dst=0
            assert r["dst_keys"] == r["expected_keys"] and r["dst_equal"]
            assert r["calls_dst"] == {"recv": other}
        else:
            assert r["dst_keys"] == [] and r["dst_equal"] is None
            assert r["calls_dst"] == {"send": mine}


def _assert_flat_stages(check: dict[str, Any], stages: list[int]) -> None:
    assert check["stages"] == stages and check["types_ok"]
    assert all(check["manifests_equal"]) and len(check["manifests_equal"]) == len(stages)
    assert all(check["buffers_equal"]) and len(check["buffers_equal"]) == len(stages)
    assert check["own_is_live"] and check["views_match"]


@pytest.mark.mcore
@pytest.mark.parametrize("name", PIPELINE_CASES)
def test_gather_pipeline_flat_returns_every_stage_manifest_and_buffers(results: dict[str, Any], name: str) -> None:
    per_rank = case_results(results, name)
    n_buffers = sum(per_rank[0]["flats_per_stage"])
    for r in per_rank:
        _assert_flat_stages(r["flat"], [0, 1])
        assert r["calls_flat"] == {"broadcast": n_buffers}, "one broadcast per flat buffer, manifests cached"
        mine = r["flats_per_stage"][r["stage"]]
        if r["stage"] == 0:  # dst=0
            _assert_flat_stages(r["flat_dst"], [0, 1])
            assert r["calls_flat_dst"] == {"recv": n_buffers - mine}
        else:
            assert r["flat_dst"]["stages"] == []
            assert r["calls_flat_dst"] == {"send": mine}


@pytest.mark.mcore
@pytest.mark.parametrize("name", PIPELINE_CASES)
def test_gather_pipeline_flat_reuses_receive_buffers(results: dict[str, Any], name: str) -> None:
    for r in case_results(results, name):
        reuse = r["reuse"]
        assert reuse["n_other_buffers"] > 0
        _assert_flat_stages(reuse["after_step"], [0, 1])  # the second call holds the weights after the step
        assert reuse["same_objects"], "reuse_buffers=True must receive into the same tensors"
        assert reuse["first_overwritten"], "the first call's tensors are the ones overwritten"
        assert reuse["fresh_is_new"], "reuse_buffers=False allocates fresh receive buffers"


@pytest.mark.mcore
@pytest.mark.parametrize("name", CHUNK_CASES)
def test_several_chunks_frozen_params_and_dtype_filter(results: dict[str, Any], name: str) -> None:
    expected_mode = "zero_copy" if "distopt" in name and _has_param_buffer(results["version"]) else "allocated"
    per_rank = case_results(results, name)
    for r in per_rank:
        assert r["mode"] == expected_mode and r["update_successful"]
        assert r["names"] == [f"chunk{c}.{n}" for c in (0, 1) for n in ("fc1.weight", "fc1.bias", "fc2.weight",
                                                                        "fc2.bias") if (c, n) != (1, "fc2.bias")]
        assert r["unbound"] == ["chunk1.fc2.bias"]
        assert r["changed"] == {n: n != "chunk1.fc2.bias" for n in r["changed"]}
        assert r["views_match"] and r["verify_error"] is None
        assert sorted(set(r["buffer_chunks"])) == [0, 1]
        assert r["bf16_only"] == 0 and r["bf16_only_unbound"] == 8 and r["bf16_only_mode"] == "empty"


@pytest.mark.mcore
@pytest.mark.parametrize("name", OWN_BUFFER_CASES)
def test_params_pointed_into_a_buffer_of_yours_are_refused_with_nothing_changed(results: dict[str, Any],
                                                                                name: str) -> None:
    """On every release and in both modes: params pointed into the user's own flat buffer are refused, named,
    nothing is changed and the user's buffer still aliases them; a clean model (one tied param) binds; a second
    allocated binding of params an earlier one still holds is refused until that one is unbound."""
    zero_copy = "distopt" in name and _has_param_buffer(results["version"])
    names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    for r in case_results(results, name):
        text = r["refused"]
        assert text is not None, "bind_params took over the user's buffer"
        for n in names:
            assert (f"\n  {n}: " in text) == (n in SCENARIOS.OWN_BUFFER_PARAMS), (n, text)
        if zero_copy:  # the zero-copy refusal: not in DDP's param_data
            assert "param_data" in text and "rebound outside flat buffer" in text
        else:
            assert "2 parameter(s) do not own their storage" in text and "Nothing was changed" in text
            assert "a view at element 0 of a" in text and "unbind()" in text
        assert list(r["ptrs_unchanged"]) == names and all(r["ptrs_unchanged"].values()), r["ptrs_unchanged"]
        assert list(r["values_unchanged"]) == names and all(r["values_unchanged"].values()), r["values_unchanged"]
        assert r["user_buffer_aliases"]
        # the tied fc1.weight is bound once, under its first name in named_parameters() (the module's own first)
        clean_names = ["tied", "fc1.bias", "fc2.weight", "fc2.bias"]
        assert r["clean_mode"] == ("zero_copy" if zero_copy else "allocated") and r["clean_names"] == clean_names
        if zero_copy:  # nothing is moved: bindings coexist
            assert r["second"] is None
        else:
            assert r["second"] is not None and "4 parameter(s) do not own their storage" in r["second"]
            assert all(f"\n  {n}: already bound by an earlier bind_params; call unbind()" in r["second"]
                       for n in clean_names), r["second"]
        assert r["second_ptrs_unchanged"] and r["first_verify"] is None
        assert r["after_unbind_mode"] == r["clean_mode"] and r["after_unbind_verify"] is None
