"""Scenarios for tests/test_checkpoint_megatron.py: checkpoints written the way Megatron-LM writes them
(``megatron.core.dist_checkpointing.save({"model": chunk.sharded_state_dict(), "iteration": ..., ...}, dir)``)
loaded with ``mcore_compat.load_checkpoint`` on the session's 2 gloo ranks.

The checkpoints are committed (``tests/data/megatron_checkpoints/``; :func:`write_fixtures` writes them, run by
``scripts/megatron_checkpoint_fixtures.py`` on 0.16.1): the GPT of tests/_checkpoint_scenarios.py (fp32, biases,
distributed optimizer) after one step at TP=1 x DP=2 with Megatron's distributed-optimizer state
(``dp_reshardable``) and the scheduler, and at TP=2 (sequence parallel), model only. Next to each: ``reference.pt``,
every TP rank's ``state_dict`` at save and Megatron's TP attributes of each param. Megatron's own writer does not
run on every release with this torch (0.8-0.12 fail inside it), so each session loads the committed ones.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import _checkpoint_scenarios as BASE
from _training_scenarios import apply_patches

DATA = Path(__file__).parent / "data" / "megatron_checkpoints"
FIXTURES = ("tp1", "tp2", "pp2-vpp2")
ITERATION = 7


def _opts(tp: int, **over: Any) -> Any:
    return BASE._tp_opts(tp, **over)


def _fixture_opts(name: str, **over: Any) -> Any:
    """The GPT of fixture ``name``: TP=1 x DP=2, TP=2, or PP=2 with 2 virtual stages (chunks) per rank."""
    if name == "pp2-vpp2":
        return BASE._opts("tp2-sp-bf16", tp=1, dp=1, pp=2, vpp=2, dtype="fp32", dropout=0.0, bias=True,
                          sequence_parallel=False, distributed_optimizer=False, **over)
    return _opts(2 if name == "tp2" else 1, **over)


def _local(run: Any) -> dict[str, Any]:
    """This rank's model tensors (each chunk's ``state_dict``; keys ``<chunk>.<name>`` past the first chunk),
    detached copies."""
    from mcore_compat.layout.read import unwrap

    return {(k if i == 0 else f"{i}.{k}"): v.detach().clone() for i, c in enumerate(run.chunks)
            for k, v in unwrap(c).state_dict().items() if hasattr(v, "detach")}


def _attrs(run: Any) -> dict[str, list[int]]:
    """Megatron's TP split of each param as set on the live param (tensor_parallel/layers.py): [dim, stride];
    dim -1: not split."""
    from mcore_compat.layout.read import unwrap

    return {n: [int(getattr(p, "partition_dim", -1)) if getattr(p, "tensor_model_parallel", False) else -1,
                int(getattr(p, "partition_stride", 1))] for n, p in unwrap(run.chunks[0]).named_parameters()}


def write_fixtures(root: str) -> str:
    """On 2 ranks: write each fixture under ``root`` with Megatron's ``dist_checkpointing.save``, as Megatron-LM's
    trainer lays out its state dict, and its ``reference.pt``. Returns the writing release."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from mcore_compat.detect import detect
    from mcore_compat.layout.read import unwrap
    from mcore_compat.training._common import parallel_state

    apply_patches()
    for name in FIXTURES:
        opts = _fixture_opts(name)
        tp = opts.tp
        path = os.path.join(root, name)
        run = BASE.Run(opts, scheduler=name == "tp1")
        run.step()
        ps = parallel_state()
        state: dict[str, Any] = {"iteration": ITERATION, "checkpoint_version": 3.0,
                                 "args": argparse.Namespace(tensor_model_parallel_size=tp, iteration=ITERATION)}
        for i, chunk in enumerate(run.chunks):  # as Megatron-LM: model, or model0, model1 with virtual stages
            if len(run.chunks) > 1:
                ps.set_virtual_pipeline_model_parallel_rank(i)
            state["model" if len(run.chunks) == 1 else f"model{i}"] = unwrap(chunk).sharded_state_dict()
        if len(run.chunks) > 1:
            ps.set_virtual_pipeline_model_parallel_rank(0)
        model = state.get("model")
        if name == "tp1":  # Megatron-LM's default format on 0.15+ (optimizer/distrib_optimizer.py)
            state["optimizer"] = run.optimizer.sharded_state_dict(
                model, metadata={"distrib_optim_sharding_type": "dp_reshardable"})
            state["opt_param_scheduler"] = run.scheduler.state_dict()
        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(state, path)
        refs: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(refs, {"tp": ps.get_tensor_model_parallel_rank(), "values": _local(run),
                                      "attrs": _attrs(run), "pp": ps.get_pipeline_model_parallel_rank()})
        if dist.get_rank() == 0:
            by_tp = {r["tp"]: r for r in refs}
            torch.save({"tp": tp, "values": [by_tp[t]["values"] for t in range(tp)], "attrs": by_tp[0]["attrs"],
                        "by_pp": {r["pp"]: r["values"] for r in refs} if opts.pp > 1 else None,
                        "scheduler": state.get("opt_param_scheduler")}, os.path.join(path, "reference.pt"))
        dist.barrier()
        run.release()
    import multiprocessing

    for child in multiprocessing.active_children():  # the writer's result-queue manager (filesystem_async.py)
        child.terminate()
    return str(detect().version)


def _reference(name: str, tp: int, tp_rank: int) -> dict[str, Any]:
    """The values fixture ``name`` holds for TP rank ``tp_rank`` of a model at TP size ``tp``: the saved TP
    shards joined with torch.cat along Megatron's partition_dim, cut with torch.chunk along it."""
    import torch

    ref = torch.load(DATA / name / "reference.pt", weights_only=True)
    if name == "pp2-vpp2":  # loaded at its own layout: this pipeline rank's chunks as saved
        from mcore_compat.training._common import parallel_state

        return dict(ref["by_pp"][parallel_state().get_pipeline_model_parallel_rank()])
    out: dict[str, Any] = {}
    for key, first in ref["values"][0].items():
        dim, stride = ref["attrs"].get(key, [-1, 1])
        assert stride == 1, (key, stride)
        whole = torch.cat([v[key] for v in ref["values"]], dim) if dim >= 0 else first
        out[key] = torch.chunk(whole, tp, dim)[tp_rank] if dim >= 0 else whole
    return out


def _diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Keys whose tensors differ (dtype, shape or any bit), or that one side lacks."""
    import torch

    return sorted(set(a) ^ set(b)) + [k for k in sorted(set(a) & set(b))
                                      if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]


def _refusal(path: Path, run: Any, optimizer: bool = False, **kw: Any) -> tuple[str | None, list[str]]:
    """Load ``path`` into ``run``: the refusal (``"<type>: <message>"`` or ``None``) and what it changed of the
    model and optimizer (``[]``: nothing)."""
    import mcore_compat as mc

    before = run.state()
    try:
        mc.load_checkpoint(path, run.chunks, run.optimizer if optimizer else None, **kw)
    except mc.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}", BASE._diff(run.state(), before)
    return None, BASE._diff(run.state(), before)


def case_load(name: str, tp: int) -> dict[str, Any]:
    """A fresh build (other seed) at TP size ``tp`` loads fixture ``name`` (weights, and the scheduler where it
    has one): its values against the reference."""
    import mcore_compat as mc
    from mcore_compat.training._common import parallel_state

    run = BASE.Run(_fixture_opts(name, seed=99) if name == "pp2-vpp2" else _opts(tp, seed=99),
                   scheduler=name == "tp1")
    tp_rank = parallel_state().get_tensor_model_parallel_rank()
    ref = _reference(name, tp, tp_rank)
    differs_before = len(_diff(_local(run), ref))
    loaded = mc.load_checkpoint(DATA / name, run.chunks, scheduler=run.scheduler)
    out = {"status": "ok", "differs_before": differs_before, "diff": _diff(_local(run), ref), "n": len(ref),
           "iteration": loaded.iteration, "checkpoint_version": getattr(loaded, "checkpoint_version", None),
           "optimizer_loaded": loaded.optimizer_loaded, "rng_restored": loaded.rng_restored,
           "scheduler_loaded": getattr(loaded, "scheduler_loaded", None), "manifest": loaded.manifest}
    if run.scheduler is not None:
        import torch

        saved = torch.load(DATA / name / "reference.pt", weights_only=True)["scheduler"]
        out["scheduler_equal"] = {k: v for k, v in run.scheduler.state_dict().items() if k in saved} == saved
    run.release()
    return out


def case_bad_input() -> dict[str, Any]:
    """Refused with one line and nothing loaded: a truncated metadata.json, a zarr-backend directory, a missing
    shard file (Megatron's load itself fails), the optimizer asked for (Megatron's optimizer format), a model of
    other shapes (another vocabulary size)."""
    import shutil

    import torch.distributed as dist

    from mcore_compat.selfcheck import models

    out: dict[str, Any] = {"status": "ok"}
    rank = dist.get_rank()

    def variant(tag: str, text: str | None) -> Path:
        """A copy of fixture tp1 with ``text`` as its metadata.json (``None``: without a shard file instead)."""
        path = Path(BASE._shared_dir(f"megatron-{tag}"))
        if rank == 0:
            shutil.copytree(DATA / "tp1", path)
            if text is None:
                (path / "__0_1.distcp").unlink()
            else:
                (path / "metadata.json").write_text(text)
        dist.barrier()
        return path

    run = BASE.Run(_opts(1, seed=5))
    run.step()
    truncated = variant("truncated", (DATA / "tp1" / "metadata.json").read_text()[:20])
    out["truncated"], out["truncated_unchanged"] = _refusal(truncated, run)
    zarr = variant("zarr", '{"sharded_backend": "zarr", "sharded_backend_version": 1}')
    out["zarr"], out["zarr_unchanged"] = _refusal(zarr, run)
    # Megatron's own load fails on reading: it read into fresh tensors, so the model is unchanged
    out["missing_shard"], out["missing_shard_unchanged"] = _refusal(variant("missing", None), run)
    out["optimizer"], out["optimizer_unchanged"] = _refusal(DATA / "tp1", run, optimizer=True)
    run.release()
    vocab, models.VOCAB = models.VOCAB, models.VOCAB + 2
    try:
        other = BASE.Run(_opts(1, seed=6))
    finally:
        models.VOCAB = vocab
    out["other_shapes"], out["other_shapes_unchanged"] = _refusal(DATA / "tp1", other)
    other.release()
    return out


def unsupported() -> str | None:
    from mcore_compat.checkpoint.megatron import unsupported_reason

    return unsupported_reason() or BASE._tp_unsupported()


def cases() -> dict[str, Any]:
    return {"tp1->tp1": lambda: case_load("tp1", 1), "tp2->tp1": lambda: case_load("tp2", 1),
            "tp1->tp2": lambda: case_load("tp1", 2), "tp2->tp2": lambda: case_load("tp2", 2),
            "pp2-vpp2->pp2-vpp2": lambda: case_load("pp2-vpp2", 1), "bad-input": case_bad_input}


CASE_NAMES = list(cases())


def run_all() -> dict[str, Any]:
    """Every case on this rank: ``{"version": str, "cases": {name: result}}``."""
    import shutil

    import torch.distributed as dist
    from _case_groups import run_case

    from mcore_compat.detect import detect
    from mcore_compat.training._common import parallel_state

    apply_patches()
    version = str(detect().version)
    why = unsupported()
    results: dict[str, Any] = {}
    for name, fn in cases().items():
        reason = why
        if reason is None and name.startswith("pp2-vpp2"):  # 0.6/0.7: virtual stages need PP > 2
            from mcore_compat.selfcheck.models import unsupported_reason

            reason = unsupported_reason(_fixture_opts("pp2-vpp2"))
        results[name] = {"status": "unsupported", "reason": reason} if reason else run_case(fn)
    if why is None:
        parallel_state().destroy_model_parallel()
        root = os.path.dirname(BASE._shared_dir("done"))
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
    return {"version": version, "cases": results}
