"""Scenarios for ``tests/test_layout.py``, run on every rank by :func:`mcore_compat.launch.spawn`.

One spawn builds real Megatron-Core ``DistributedDataParallel`` wrappers for every :data:`CASES` entry that applies
to the installed release, and returns, per case, what :func:`mcore_compat.layout.layout_of` read, what
:func:`mcore_compat.layout.compute_layout` computed from the same settings, and whether each param's ``main_grad``
(and ``.data`` with the distributed optimizer) really sits at the offset the layout gives. Nothing here imports
megatron at module level, so the test can read :data:`CASES` to parametrise itself.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from dataclasses import dataclass
from typing import Any, Union

from mcore_compat._facts.ranges import in_range
from mcore_compat.layout import DEFAULT_BUCKET_SIZE, ModelLayout, compute_layout, layout_fact, layout_of

BucketSizeArg = Union[int, None, type(DEFAULT_BUCKET_SIZE)]

#: (dotted name, shape, dtype name, flags). Flags: "frozen", "expert", "shared" (Megatron's shared_embedding),
#: "tie:<name>" (the same Parameter object as <name>, so it is listed once by named_parameters()).
ParamRow = tuple[str, tuple[int, ...], str, tuple[str, ...]]

#: The worked-example model ``C5`` of tests/test_layout.py (odd sizes, a frozen param, an fp32 param and an expert
#: param).
_C5: tuple[ParamRow, ...] = (
    ("embedding.weight", (50, 16), "bfloat16", ()),
    ("ln.weight", (16,), "bfloat16", ()),
    ("ln.bias", (16,), "bfloat16", ()),
    ("fc1.weight", (33, 16), "bfloat16", ()),
    ("fc1.bias", (33,), "bfloat16", ()),
    ("frozen.weight", (7,), "bfloat16", ("frozen",)),
    ("fc2.weight", (16, 33), "bfloat16", ()),
    ("fc2.bias", (16,), "bfloat16", ()),
    ("fp32.weight", (10,), "float32", ()),
    ("expert.weight", (6, 10), "bfloat16", ("expert",)),
    ("out.weight", (50, 16), "bfloat16", ()),
)


def _with_flags(rows: tuple[ParamRow, ...], **extra: tuple[str, ...]) -> tuple[ParamRow, ...]:
    return tuple((n, s, d, f + extra.get(n.replace(".", "_"), ())) for n, s, d, f in rows)


MODELS: dict[str, tuple[ParamRow, ...]] = {
    "c5": _C5,
    # all fp32, odd sizes, one expert param
    "fp32": (
        ("a.weight", (37, 5), "float32", ()),
        ("a.bias", (5,), "float32", ()),
        ("b.weight", (129,), "float32", ()),
        ("c.weight", (3, 7, 11), "float32", ()),
        ("moe.w1", (13, 3), "float32", ("expert",)),
        ("moe.w2", (3, 13), "float32", ("expert",)),
        ("head.weight", (9,), "float32", ()),
    ),
    # tied embedding on a PP stage: both ends flagged shared_embedding (out.weight is laid out first)
    "tied_both": _with_flags(_C5, embedding_weight=("shared",), out_weight=("shared",)),
    # only the embedding flagged: it is laid out last, after other params (0.6/0.7 assertion, 0.8-0.12 overlap)
    "tied_last": _with_flags(_C5, embedding_weight=("shared",)),
    # shared embedding laid out after a param ending at 164 -> start 192 (0.8+ alignment): 0.8-0.12 leave it
    # inside the previous bucket's padding [192, 256); 0.7 even yields an empty last bucket
    "tied_overlap": (
        ("emb.weight", (100,), "bfloat16", ("shared",)),
        ("a.weight", (100,), "bfloat16", ()),
        ("b.weight", (50,), "bfloat16", ()),
    ),
    # the same Parameter registered under two names in one module (listed once)
    "tied_module": (*_C5[:-1], ("out.weight", (50, 16), "bfloat16", ("tie:embedding.weight",))),
}

#: Parallel layouts used in a world of 2: (tensor parallel, expert parallel) -> (dp, expert dp).
PHASES: dict[str, dict[str, int]] = {
    "dp2": {"tp": 1, "ep": 1, "dp": 2, "edp": 2},
    "tp2": {"tp": 2, "ep": 1, "dp": 1, "edp": 1},
    "ep2": {"tp": 1, "ep": 2, "dp": 2, "edp": 1},
}


@dataclass(frozen=True)
class LayoutCase:
    """One DDP configuration.

    Attributes:
        name: test id.
        phase: key of :data:`PHASES`.
        model: key of :data:`MODELS`.
        distopt: ``use_distributed_optimizer``.
        overlap: ``overlap_grad_reduce`` (bucketing needs it).
        bucket_size: what is passed to Megatron (:data:`DEFAULT_BUCKET_SIZE`: nothing).
        grad_fp32: ``grad_reduce_in_fp32`` / ``accumulate_allreduce_grads_in_fp32``.
        busbw: ``pad_buckets_for_high_nccl_busbw``.
        disable_bucketing: the DDP argument.
        chunks: number of model chunks (chunks after the first get ``disable_bucketing=True``, as Megatron-LM does).
        versions: releases the case applies to.
    """

    name: str
    phase: str
    model: str
    distopt: bool
    overlap: bool = False
    bucket_size: BucketSizeArg = DEFAULT_BUCKET_SIZE
    grad_fp32: bool = False
    busbw: bool = False
    disable_bucketing: bool = False
    chunks: int = 1
    versions: str = ">=0.4"


def _cases() -> tuple[LayoutCase, ...]:
    cases = []
    for do in (False, True):
        d = "do" if do else "nodo"
        for fp32 in (False, True):
            g = "fp32grad" if fp32 else "native"
            cases += [
                LayoutCase(f"dp2-c5-{d}-{g}-1bucket", "dp2", "c5", do, grad_fp32=fp32),
                LayoutCase(f"dp2-c5-{d}-{g}-bs1000", "dp2", "c5", do, True, 1000, fp32),
                LayoutCase(f"dp2-c5-{d}-{g}-bs100", "dp2", "c5", do, True, 100, fp32),
            ]
        cases += [
            LayoutCase(f"dp2-fp32-{d}-bs200", "dp2", "fp32", do, True, 200),
            LayoutCase(f"tp2-c5-{d}-bs1000", "tp2", "c5", do, True, 1000, True),
            LayoutCase(f"tp2-fp32-{d}-1bucket", "tp2", "fp32", do),
            LayoutCase(f"ep2-fp32-{d}-bs100", "ep2", "fp32", do, True, 100),
            LayoutCase(f"ep2-c5-{d}-1bucket", "ep2", "c5", do),
            LayoutCase(f"dp2-tiedboth-{d}-bs1000", "dp2", "tied_both", do, True, 1000),
            LayoutCase(f"dp2-tiedlast-{d}-bs1000", "dp2", "tied_last", do, True, 1000),
            LayoutCase(f"tp2-tiedlast-{d}-1bucket", "tp2", "tied_last", do),
            LayoutCase(f"dp2-tiedoverlap-{d}-1bucket", "dp2", "tied_overlap", do),
            LayoutCase(f"tp2-tiedoverlap-{d}-bs1000", "tp2", "tied_overlap", do, True, 1000),
            LayoutCase(f"dp2-tiedmodule-{d}-bs500", "dp2", "tied_module", do, True, 500),
            LayoutCase(f"dp2-c5-{d}-default-bucket", "dp2", "c5", do, True),
            LayoutCase(f"dp2-c5-{d}-none-bucket", "dp2", "c5", do, True, None),
            LayoutCase(f"dp2-c5-{d}-disable-bucketing", "dp2", "c5", do, True, 100, disable_bucketing=True),
            LayoutCase(f"dp2-c5-{d}-2chunks", "dp2", "c5", do, True, 300, chunks=2),
            LayoutCase(f"dp2-c5-{d}-busbw", "dp2", "c5", do, True, 1000, busbw=True, versions=">=0.12"),
        ]
    return tuple(cases)


CASES: tuple[LayoutCase, ...] = _cases()

# --------------------------------------------------------------------------------------------------------------
# Inside a rank.
# --------------------------------------------------------------------------------------------------------------

#: How DDP is constructed (``DistributedDataParallel.__init__`` in
#: ``megatron/core/distributed/distributed_data_parallel.py``): positional flags (0.4-0.6), a DDP config plus explicit groups (0.7),
#: a DDP config with groups from parallel_state (0.8+).
_DDP_STYLE: tuple[tuple[str, str], ...] = ((">=0.4,<0.7", "flags"), (">=0.7,<0.8", "config_and_groups"),
                                           (">=0.8", "config"))


def _apply_cpu_patches() -> None:
    try:
        from mcore_compat import patches

        patches.apply_for_device("cpu")
    except ImportError:
        import torch

        torch.cuda.current_device = lambda: "cpu"  # all DDP construction needs on CPU


def _style(version: Any) -> str:
    return next(style for spec, style in _DDP_STYLE if in_range(version, spec))


def _build_module(rows: tuple[ParamRow, ...], seed: int) -> Any:
    import torch

    gen = torch.Generator().manual_seed(seed)
    root = torch.nn.Module()
    made: dict[str, torch.nn.Parameter] = {}
    for name, shape, dtype, flags in rows:
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        tie = next((f[4:] for f in flags if f.startswith("tie:")), None)
        if tie is not None:
            param = made[tie]
        else:
            data = torch.randn(shape, generator=gen).to(getattr(torch, dtype))
            param = torch.nn.Parameter(data, requires_grad="frozen" not in flags)
            if "expert" in flags:
                param.allreduce = False
            if "shared" in flags:
                param.shared_embedding = True
        owner.register_parameter(leaf, param)
        made[name] = param
    return root


def _filtered(fn: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    names = set(inspect.signature(fn).parameters)
    return {k: v for k, v in kwargs.items() if k in names}


def _make_ddp(case: LayoutCase, module: Any, version: Any, disable_bucketing: bool) -> Any:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    style = _style(version)
    dp_group = ps.get_data_parallel_group(with_context_parallel=True)
    bucket = {} if case.bucket_size is DEFAULT_BUCKET_SIZE else {"bucket_size": case.bucket_size}
    if style == "flags":
        kwargs = dict(config=config, module=module, data_parallel_group=dp_group,
                      accumulate_allreduce_grads_in_fp32=case.grad_fp32, overlap_grad_reduce=case.overlap,
                      use_distributed_optimizer=case.distopt, disable_bucketing=disable_bucketing,
                      expert_data_parallel_group=ps.get_data_modulo_expert_parallel_group(), **bucket)
        return DDP(**_filtered(DDP.__init__, kwargs))
    from megatron.core.distributed import DistributedDataParallelConfig

    fields = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    cfg_kwargs = dict(grad_reduce_in_fp32=case.grad_fp32, overlap_grad_reduce=case.overlap,
                      use_distributed_optimizer=case.distopt, **bucket)
    if case.busbw:
        cfg_kwargs["pad_buckets_for_high_nccl_busbw"] = True
    assert set(cfg_kwargs) <= fields, f"DistributedDataParallelConfig lacks {set(cfg_kwargs) - fields}"
    ddp_config = DistributedDataParallelConfig(**cfg_kwargs)
    kwargs = dict(config=config, ddp_config=ddp_config, module=module, disable_bucketing=disable_bucketing)
    if style == "config_and_groups":
        kwargs.update(data_parallel_group=dp_group,
                      expert_data_parallel_group=ps.get_data_modulo_expert_parallel_group())
    return DDP(**kwargs)


def _binding_problems(ddp: Any, version: Any) -> list[str]:
    """Where a param's ``main_grad`` / ``.data`` is not the view of its buffer that ``param_index_map`` says."""
    problems = []
    dense_attr, expert_attr = layout_fact("ddp_buffer_attrs", version)
    dense = getattr(ddp, dense_attr)
    buffers = list(dense.values()) if isinstance(dense, dict) else list(dense)
    buffers += list(getattr(ddp, expert_attr)) if expert_attr else []
    for buffer in buffers:
        grad = getattr(buffer, layout_fact("grad_data_attr", version))
        pdata = getattr(buffer, "param_data", None)
        for param, (start, end, _) in buffer.param_index_map.items():
            off = (param.main_grad.data_ptr() - grad.data_ptr()) // grad.element_size()
            if off != start or param.main_grad.numel() != end - start:
                problems.append(f"main_grad of a {tuple(param.shape)} param at {off}, index map says {start}")
            if pdata is not None:
                poff = (param.data.data_ptr() - pdata.data_ptr()) // pdata.element_size()
                if poff != start:
                    problems.append(f"data of a {tuple(param.shape)} param at {poff}, index map says {start}")
    return problems


def _expected(case: LayoutCase, version: Any, rows: tuple[ParamRow, ...], module: Any, chunk: int,
              disable_bucketing: bool) -> ModelLayout:
    dims = PHASES[case.phase]
    return compute_layout(
        module.named_parameters(), version=version, dp_size=dims["dp"], expert_dp_size=dims["edp"],
        use_distributed_optimizer=case.distopt, overlap_grad_reduce=case.overlap, bucket_size=case.bucket_size,
        grad_reduce_in_fp32=case.grad_fp32, pad_buckets_for_high_nccl_busbw=case.busbw,
        disable_bucketing=disable_bucketing, chunk=chunk,
    )


def _run_case(case: LayoutCase, version: Any) -> dict[str, Any]:
    result: dict[str, Any] = {"name": case.name, "actual": None, "expected": None, "actual_error": None,
                              "expected_error": None, "binding_problems": []}
    rows = MODELS[case.model]
    chunks = [_build_module(rows, seed=c) for c in range(case.chunks)]
    flags = [case.disable_bucketing or c > 0 for c in range(case.chunks)]
    try:
        expected = [_expected(case, version, rows, m, c, f) for c, (m, f) in enumerate(zip(chunks, flags, strict=True))]
        result["expected"] = ModelLayout.combine(*expected)
    except Exception as exc:
        result["expected_error"] = f"{type(exc).__name__}: {exc}"
    try:
        ddps = [_make_ddp(case, m, version, f) for m, f in zip(chunks, flags, strict=True)]
        result["actual"] = layout_of(ddps, version=version)
        result["binding_problems"] = [p for d in ddps for p in _binding_problems(d, version)]
    except Exception as exc:
        result["actual_error"] = f"{type(exc).__name__}: {exc}"
    return result


def run_layout_cases(names: list[str] | None = None) -> dict[str, Any]:
    """Run every applicable case (or those in ``names``) on this rank; returns the version and per-case results."""
    _apply_cpu_patches()
    from megatron.core import parallel_state as ps

    from mcore_compat.detect import detect

    version = detect().version
    wanted = [c for c in CASES if in_range(version, c.versions) and (names is None or c.name in names)]
    results: dict[str, dict[str, Any]] = {}
    for phase, dims in PHASES.items():
        todo = [c for c in wanted if c.phase == phase]
        if not todo:
            continue
        ps.initialize_model_parallel(tensor_model_parallel_size=dims["tp"], expert_model_parallel_size=dims["ep"])
        try:
            for case in todo:
                results[case.name] = _run_case(case, version)
        finally:
            ps.destroy_model_parallel()
    return {"version": str(version), "rank": int(os.environ.get("RANK", "0")), "results": results}
