"""Buffer layouts: computed (``compute_layout``) against hand-checked examples, and against real Megatron DDP.

Unit tests check the arithmetic of Megatron's buffer construction (``_ParamAndGradBuffer.__init__`` in
``megatron/core/distributed/param_and_grad_buffer.py``; ``ParamAndGradBuffer`` there in 0.6-0.8, ``GradBuffer`` in
``megatron/core/distributed/grad_buffer.py`` in 0.4/0.5): worked examples (``C5``, offsets recorded from real runs)
and small hand-computed models for each rule (bucket-end divisor, param-start alignment, ordering, bucketing).
Tests marked ``mcore`` build real Megatron-Core DDP wrappers for many configurations inside ONE run on the
session's 2 gloo ranks (``rank_group``) (see ``_layout_scenarios.py``) and assert that what Megatron built
(``layout_of``) equals what ``compute_layout`` predicts.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from _layout_scenarios import CASES, run_layout_cases
from packaging.version import Version

from mcore_compat._facts.ranges import in_range
from mcore_compat.errors import UnsupportedVersionError
from mcore_compat.layout import (
    DEFAULT_BUCKET_SIZE,
    LAYOUT_FACTS,
    BucketLayout,
    BufferKey,
    LayoutError,
    ModelLayout,
    ParamSpec,
    compute_layout,
    layout_fact,
)
from mcore_compat.support import releases

BF16, FP32 = torch.bfloat16, torch.float32

#: The supported releases (matrix/versions.toml).
RELEASES = [str(r.version) for r in releases()]

#: The worked-example model (odd sizes, a frozen param, an fp32 param, an expert param), in named_parameters()
#: order.
C5 = (
    ParamSpec("embedding.weight", (800,), BF16),
    ParamSpec("ln.weight", (16,), BF16),
    ParamSpec("ln.bias", (16,), BF16),
    ParamSpec("fc1.weight", (528,), BF16),
    ParamSpec("fc1.bias", (33,), BF16),
    ParamSpec("frozen", (7,), BF16, requires_grad=False),
    ParamSpec("fc2.weight", (528,), BF16),
    ParamSpec("fc2.bias", (16,), BF16),
    ParamSpec("fp32_param", (10,), FP32),
    ParamSpec("expert.weight", (60,), BF16, expert=True),
    ParamSpec("out.weight", (800,), BF16),
)


def _offsets(layout: ModelLayout, index: int = 0) -> str:
    return ", ".join(f"{p.name}:{p.start}-{p.end}" for p in layout.buffers[index].params)


def _c5(version: str, dp: int, fp32_grads: bool, bucket_size: int | None) -> ModelLayout:
    bucketing: dict[str, Any] = {"overlap_grad_reduce": True, "bucket_size": bucket_size} if bucket_size else {}
    return compute_layout(C5, version=version, dp_size=dp, use_distributed_optimizer=True,
                          grad_reduce_in_fp32=fp32_grads, **bucketing)


# ---- C5 worked examples (offsets recorded from real runs) -----------------------------------------------------

C5_TAIL = ("fc2.bias:832-848, fc2.weight:896-1424, fc1.bias:1472-1505, fc1.weight:1536-2064, ln.bias:2112-2128, "
           "ln.weight:2176-2192, embedding.weight:2240-3040")
C5_EXAMPLES = [
    ("0.5.0", 2, True, None, 2748, [(0, 2748)],
     "out.weight:0-800, fp32_param:800-810, fc2.bias:810-826, fc2.weight:826-1354, fc1.bias:1354-1387, "
     "fc1.weight:1387-1915, ln.bias:1915-1931, ln.weight:1931-1947, embedding.weight:1947-2747"),
    ("0.6.0", 3, True, None, 2739, [(0, 2739)],
     "out.weight:0-800, fc2.bias:800-816, fc2.weight:816-1344, fc1.bias:1344-1377, fc1.weight:1377-1905, "
     "ln.bias:1905-1921, ln.weight:1921-1937, embedding.weight:1937-2737"),
    ("0.7.0", 3, False, 1000, 3072, [(0, 1536), (1536, 3072)],
     "out.weight:0-800, fc2.bias:800-816, fc2.weight:816-1344, fc1.bias:1536-1569, fc1.weight:1569-2097, "
     "ln.bias:2097-2113, ln.weight:2113-2129, embedding.weight:2129-2929"),
    *[(v, 2, True, None, 3072, [(0, 3072)], "out.weight:0-800, " + C5_TAIL) for v in ("0.8.0", "0.13.1", "0.19.2")],
    *[(v, 3, False, 1000, 3456, [(0, 1536), (1536, 3456)],
       "out.weight:0-800, fc2.bias:832-848, fc2.weight:896-1424, fc1.bias:1536-1569, fc1.weight:1600-2128, "
       "ln.bias:2176-2192, ln.weight:2240-2256, embedding.weight:2304-3104") for v in ("0.8.0", "0.13.1", "0.19.2")],
]


@pytest.mark.unit
@pytest.mark.parametrize(("version", "dp", "fp32_grads", "bucket_size", "numel", "buckets", "offsets"), C5_EXAMPLES,
                         ids=[f"{e[0]}-dp{e[1]}-bs{e[3]}" for e in C5_EXAMPLES])
def test_c5_worked_examples(version: str, dp: int, fp32_grads: bool, bucket_size: int | None, numel: int,
                            buckets: list[tuple[int, int]], offsets: str) -> None:
    layout = _c5(version, dp, fp32_grads, bucket_size)
    dense = layout.buffers[0]
    assert dense.key.param_dtype in (BF16, None) and not dense.key.is_expert_parallel
    assert dense.numel == numel
    assert [(k.start, k.end) for k in dense.buckets] == buckets
    assert _offsets(layout) == offsets


@pytest.mark.unit
@pytest.mark.parametrize("version", RELEASES)
def test_without_distributed_optimizer_every_release_packs_unpadded(version: str) -> None:
    layout = compute_layout(C5, version=version, dp_size=3)
    dense = layout.buffers[0]
    assert _offsets(layout).startswith("out.weight:0-800, ")
    assert dense.numel == sum(p.numel for p in dense.params) and dense.padding == 0
    assert not dense.has_param_data


@pytest.mark.unit
def test_buffer_grouping_per_release() -> None:
    # 0.4/0.5: grouped by grad dtype only; expert params get a private main_grad (no buffer).
    old = compute_layout(C5, version="0.5.0", dp_size=2, grad_reduce_in_fp32=True)
    assert [b.key for b in old.buffers] == [BufferKey(0, None, FP32)]
    assert old.unbuffered == ((0, "expert.weight"),)
    old_native = compute_layout(C5, version="0.4.0", dp_size=2)
    assert [b.key for b in old_native.buffers] == [BufferKey(0, None, BF16), BufferKey(0, None, FP32)]
    assert old_native.buffers[0].buckets[0].numel_unpadded is None  # 0.4 buckets have no numel_unpadded
    # 0.6+: (param dtype, grad dtype), dense buffers then expert buffers.
    for version in ("0.6.0", "0.17.1", "0.19.2"):
        new = compute_layout(C5, version=version, dp_size=2, grad_reduce_in_fp32=True)
        assert [b.key for b in new.buffers] == [BufferKey(0, BF16, FP32), BufferKey(0, FP32, FP32),
                                                BufferKey(0, BF16, FP32, is_expert_parallel=True)]
        assert new.unbuffered == ()


@pytest.mark.unit
def test_layer_wise_flag_is_a_buffer_key_from_018() -> None:
    specs = [ParamSpec("a", (10,), BF16, layer_wise=True), ParamSpec("b", (10,), BF16)]
    assert len(compute_layout(specs, version="0.17.1", dp_size=1).buffers) == 1
    keys = [b.key for b in compute_layout(specs, version="0.18.0", dp_size=1).buffers]
    assert keys == [BufferKey(0, BF16, BF16, False, True), BufferKey(0, BF16, BF16, False, False)]


@pytest.mark.unit
def test_expert_buffers_pad_for_the_expert_group() -> None:
    layout = compute_layout(C5, version="0.13.1", dp_size=2, expert_dp_size=3, use_distributed_optimizer=True)
    expert = layout.buffers[-1]
    assert expert.key.is_expert_parallel and expert.dp_size == 3
    assert expert.numel == 384  # lcm(3, 128)


# ---- the offset rules on small hand-checked models ------------------------------------------------------------


def _buckets(layout: ModelLayout) -> list[tuple[int, int, int | None]]:
    return [(k.start, k.end, k.numel_unpadded) for k in layout.buffers[0].buckets]


@pytest.mark.unit
def test_bucket_end_divisor_and_param_start_alignment() -> None:
    specs = [ParamSpec("a", (100,), BF16), ParamSpec("b", (30,), BF16)]
    # laid out b, a. 0.6: pad to dp; 0.7: lcm(dp, 128); 0.8: + starts aligned to 64; 0.12: lcm(dp, 128, 2**16).
    assert _offsets(lay := compute_layout(specs, version="0.6.0", dp_size=3, use_distributed_optimizer=True)) == \
        "b:0-30, a:30-130"
    assert lay.buffers[0].numel == 132
    assert compute_layout(specs, version="0.7.0", dp_size=3, use_distributed_optimizer=True).buffers[0].numel == 384
    lay = compute_layout(specs, version="0.8.0", dp_size=3, use_distributed_optimizer=True)
    assert _offsets(lay) == "b:0-30, a:64-164" and lay.buffers[0].numel == 384 and lay.buffers[0].padding == 254
    lay = compute_layout(specs, version="0.12.0", dp_size=3, use_distributed_optimizer=True,
                         pad_buckets_for_high_nccl_busbw=True)
    assert lay.buffers[0].numel == 3 * 2**16 and _buckets(lay) == [(0, 3 * 2**16, 164)]


@pytest.mark.unit
def test_high_nccl_busbw_option_needs_012() -> None:
    with pytest.raises(LayoutError, match=r"0\.12"):
        compute_layout(C5, version="0.11.0", dp_size=2, pad_buckets_for_high_nccl_busbw=True)


@pytest.mark.unit
def test_old_releases_never_close_a_bucket_after_a_single_param() -> None:
    specs = [ParamSpec("x", (10,), FP32), ParamSpec("y", (2000,), FP32)]  # laid out y, x
    kw: dict[str, Any] = {"dp_size": 1, "overlap_grad_reduce": True, "bucket_size": 100}
    assert _buckets(compute_layout(specs, version="0.5.0", **kw)) == [(0, 2010, 2010)]
    assert _buckets(compute_layout(specs, version="0.6.0", **kw)) == [(0, 2000, 2000), (2000, 2010, 10)]


# Model for the shared-embedding rules: registration order emb (shared), a, b -> laid out b, a, emb.
def _tied(a: int) -> list[ParamSpec]:
    return [ParamSpec("emb", (100,), BF16, shared_embedding=True), ParamSpec("a", (a,), BF16),
            ParamSpec("b", (50,), BF16)]


SHARED_EMBEDDING_EXAMPLES = [
    # version, dp, size of a, offsets, buckets (start, end, numel_unpadded)
    ("0.5.0", 2, 30, "b:0-50, a:50-80, emb:80-180", [(0, 180, 180)]),  # no special case before 0.6
    ("0.6.0", 2, 30, "b:0-50, a:50-80, emb:80-180", [(0, 80, 80), (80, 180, 100)]),
    ("0.7.0", 2, 30, "b:0-50, a:50-80, emb:80-180", [(0, 128, 80), (128, 256, 52)]),  # emb overlaps padding
    # 0.7: the param ends inside the previous bucket's padding -> an empty last bucket, numel_unpadded < 0 (real)
    ("0.7.0", 2, 100, "b:0-50, a:50-150, emb:150-250", [(0, 256, 150), (256, 256, -6)]),
    ("0.8.0", 2, 30, "b:0-50, a:64-94, emb:128-228", [(0, 128, 128), (128, 256, 100)]),
    ("0.8.0", 2, 100, "b:0-50, a:64-164, emb:192-292", [(0, 256, 192), (256, 384, 36)]),  # overlap
    ("0.12.3", 2, 100, "b:0-50, a:64-164, emb:192-292", [(0, 256, 192), (256, 384, 36)]),  # overlap
    ("0.12.3", 3, 30, "b:0-50, a:64-94, emb:384-484", [(0, 384, 384), (384, 768, 100)]),  # start % dp -> padded
    ("0.13.0", 2, 100, "b:0-50, a:64-164, emb:256-356", [(0, 256, 192), (256, 384, 100)]),  # fixed
    ("0.19.2", 3, 30, "b:0-50, a:64-94, emb:384-484", [(0, 384, 128), (384, 768, 100)]),
]


@pytest.mark.unit
@pytest.mark.parametrize(("version", "dp", "a", "offsets", "buckets"), SHARED_EMBEDDING_EXAMPLES,
                         ids=[f"{e[0]}-dp{e[1]}-a{e[2]}" for e in SHARED_EMBEDDING_EXAMPLES])
def test_shared_embedding_gets_its_own_bucket(version: str, dp: int, a: int, offsets: str,
                                              buckets: list[tuple[int, int, int]]) -> None:
    layout = compute_layout(_tied(a), version=version, dp_size=dp, use_distributed_optimizer=True)
    assert _offsets(layout) == offsets
    assert _buckets(layout) == buckets


@pytest.mark.unit
@pytest.mark.parametrize(("version", "dp"), [("0.6.0", 3), ("0.7.0", 3), ("0.8.0", 3)])
def test_shared_embedding_assertion_of_06_to_08_is_reported(version: str, dp: int) -> None:
    with pytest.raises(LayoutError, match="AssertionError"):
        compute_layout(_tied(30), version=version, dp_size=dp, use_distributed_optimizer=True)


@pytest.mark.unit
def test_shared_embedding_without_distributed_optimizer_is_ordinary() -> None:
    layout = compute_layout(_tied(30), version="0.13.0", dp_size=2)
    assert _buckets(layout) == [(0, 180, 180)]


# ---- bucket sizing (the default bucket size of DistributedDataParallel.__init__ in
# megatron/core/distributed/distributed_data_parallel.py: a 40M argument to 0.6, max(40M, 1M * dp) from 0.7) --

BIG = [ParamSpec("a", (30_000_000,), BF16), ParamSpec("b", (30_000_000,), BF16), ParamSpec("c", (30_000_000,), BF16)]


@pytest.mark.unit
@pytest.mark.parametrize(("version", "dp", "bucket_size", "n_buckets"), [
    ("0.6.0", 64, DEFAULT_BUCKET_SIZE, 2),  # fixed 40M
    ("0.7.0", 2, DEFAULT_BUCKET_SIZE, 2),  # max(40M, 1M*2)
    ("0.7.0", 64, DEFAULT_BUCKET_SIZE, 1),  # max(40M, 64M)
    ("0.19.2", 64, None, 1),  # ddp_config.bucket_size=None is the default
    ("0.6.0", 2, None, 1),  # the 0.4-0.6 DDP argument None is one bucket
    ("0.16.1", 2, 10_000_000, 3),
])
def test_bucket_size_defaults(version: str, dp: int, bucket_size: Any, n_buckets: int) -> None:
    layout = compute_layout(BIG, version=version, dp_size=dp, overlap_grad_reduce=True, bucket_size=bucket_size)
    assert len(layout.buffers[0].buckets) == n_buckets


@pytest.mark.unit
@pytest.mark.parametrize("kwargs", [{"overlap_grad_reduce": False}, {"disable_bucketing": True},
                                    {"pipeline_rank": 1}])
def test_one_bucket_without_overlap_when_disabled_or_later_stage(kwargs: dict[str, Any]) -> None:
    settings = {"overlap_grad_reduce": True, "bucket_size": 100, **kwargs}
    assert len(compute_layout(BIG, version="0.16.1", dp_size=2, **settings).buffers[0].buckets) == 1


# ---- the data model -------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_equality_diff_and_pickling() -> None:
    a = _c5("0.13.1", 2, True, 1000)
    b = _c5("0.19.2", 2, True, 1000)
    assert a == b and a.diff(b) == "" and a.version != b.version
    c = _c5("0.7.0", 2, True, 1000)
    assert a != c
    text = a.diff(c)
    assert "param fc2.bias: left [832, 848)" in text and "right [800, 816)" in text
    assert pickle.loads(pickle.dumps(a)) == a
    assert pickle.loads(pickle.dumps(DEFAULT_BUCKET_SIZE)) is DEFAULT_BUCKET_SIZE
    assert "bucket 0" in a.describe()
    buffer, param = a.locate("fc1.weight")
    assert buffer.key == BufferKey(0, BF16, FP32) and param.bucket == 1 and param.numel == 528
    with pytest.raises(KeyError):
        a.locate("frozen")


@pytest.mark.unit
def test_named_parameters_input_and_shared_params() -> None:
    module = torch.nn.Module()
    module.emb = torch.nn.Embedding(5, 3)
    module.head = torch.nn.Linear(3, 5, bias=True)
    module.head.weight = module.emb.weight  # tied: listed once, under its first name
    layout = compute_layout(module.named_parameters(), version="0.16.1", dp_size=1)
    assert _offsets(layout) == "head.bias:0-5, emb.weight:5-20"
    pairs = [(p, n) for n, p in module.named_parameters()]
    assert compute_layout(pairs, version="0.16.1", dp_size=1) == layout


@pytest.mark.unit
def test_bucket_padding_property() -> None:
    assert BucketLayout(0, 0, 128, 100).padding == 28 and BucketLayout(0, 0, 128, None).padding is None


@pytest.mark.unit
def test_fact_table_covers_every_release_once() -> None:
    for name, entry in LAYOUT_FACTS.items():
        for release in [*RELEASES, "0.20.0rc1"]:
            matches = [row.versions for row in entry.rows if in_range(release, row.versions)]
            assert len(matches) == 1, (name, release, matches)
        layout_fact(name, Version("0.19.2"))
    with pytest.raises(UnsupportedVersionError):
        layout_fact("grad_data_attr", "0.3.0")
    with pytest.raises(KeyError, match="known"):
        layout_fact("ddp_ctor", "0.16.1")  # a fact of the table, but no buffer-layout fact
    with pytest.raises(UnsupportedVersionError):
        compute_layout(C5, version="0.3.0", dp_size=1)


# ---- real Megatron-Core -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def megatron_results(rank_group: Any) -> list[dict[str, Any]]:
    return rank_group.run(run_layout_cases, timeout=400)


@pytest.mark.mcore
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_layout_of_equals_compute_layout(case: Any, megatron_results: list[dict[str, Any]]) -> None:
    version = megatron_results[0]["version"]
    if not in_range(version, case.versions):
        pytest.skip(f"release limit: megatron-core {version} cannot build this case (it needs {case.versions})")
    per_rank = [r["results"][case.name] for r in megatron_results]
    result = per_rank[0]
    if result["expected_error"] or result["actual_error"]:
        # Megatron rejects the model exactly when compute_layout says it would (0.6-0.8 shared-embedding assert).
        assert result["expected_error"] and result["actual_error"], (result["expected_error"], result["actual_error"])
        assert "AssertionError" in result["actual_error"] and "AssertionError" in result["expected_error"]
        return
    actual, expected = result["actual"], result["expected"]
    assert actual == expected, f"megatron-core {version}, {case.name}:\n{actual.diff(expected)}"
    assert not result["binding_problems"], result["binding_problems"]
    assert all(r["actual"] == actual for r in per_rank[1:]), "ranks disagree on the layout"
