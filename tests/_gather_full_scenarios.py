"""Scenarios for tests/test_gather_full.py, run on every rank of a warm gloo group (2 or 4 ranks).

Each case builds the self-check's GPT (:mod:`mcore_compat.selfcheck.models`) at one TP x PP x EP (+ VPP) layout,
trains one step with Megatron's schedule and optimizer, binds it, and compares ``gather_full`` / ``iter_full``
with the full weights assembled here independently: every rank sends each parameter tensor (all_gather_object)
with Megatron's own attributes, and this module puts them together with its own code (layer_number, the MoE
layer's local_expert_indices, torch.cat over TP ranks). It then corrupts the manifest (a wrong partition stride,
two experts swapped, an expert claimed by two EP ranks) and records what gather_full did. Plain data returns.
"""

from __future__ import annotations

import dataclasses
from typing import Any

#: The layouts, by world size (name -> SelfCheckOptions fields).
CONFIGS: dict[int, dict[str, dict[str, Any]]] = {
    2: {"tp2": dict(tp=2), "pp2": dict(pp=2), "ep2": dict(experts=4, ep=2)},
    4: {"tp2-ep2": dict(tp=2, experts=4, ep=2), "pp2-vpp2": dict(pp=2, vpp=2), "tp2-pp2": dict(tp=2, pp=2)},
}
#: Before 0.8 virtual stages need pipeline size > 2: the world-4 virtual-stage case runs at PP=4 there.
VPP_FALLBACK = {"pp2-vpp2": dict(pp=4, vpp=2)}


def fields_of(world: int, name: str) -> dict[str, Any]:
    """The layout ``name`` runs at on this release (PP=4 x VPP=2 where PP=2 x VPP=2 cannot run)."""
    from mcore_compat.selfcheck import models

    fields = CONFIGS[world][name]
    if name in VPP_FALLBACK and models.unsupported_reason(_options(world, fields)) is not None:
        return VPP_FALLBACK[name]
    return fields


def _options(world: int, fields: dict[str, Any]) -> Any:
    from mcore_compat.selfcheck import SelfCheckOptions

    return SelfCheckOptions(model="gpt", steps=1, nproc=world, device="cpu", clip_grad=0.0,
                            **fields).resolved()


def why_not(world: int, name: str) -> str | None:
    """The release limit that keeps this release from running the layout (``None``: it runs)."""
    from mcore_compat.capabilities import fact
    from mcore_compat.detect import detect
    from mcore_compat.selfcheck import models

    opts = _options(world, fields_of(world, name))
    reason = models.unsupported_reason(opts)
    if reason is None and opts.experts and fact("ddp_buffer_attrs")[1] is None:
        reason = (f"expert params in DDP buffers: needs megatron-core >=0.6 (installed {detect().version}); before, "
                  f"DDP's grad_buffers hold dense params only (distributed/distributed_data_parallel.py), so "
                  f"bind_params leaves expert params unbound and gather_full refuses")
    return reason


def _train(opts: Any) -> tuple[list[Any], Any]:
    """The self-check's GPT at ``opts``' layout after one training step, bound (``(chunks, binding)``)."""
    from mcore_compat import symbols, training
    from mcore_compat.binding import bind_params
    from mcore_compat.selfcheck import models

    models.init_parallel(opts)
    modules, _ = models.build_chunks(opts)
    chunks = training.wrap_ddp(modules, ddp_config=models.ddp_config(opts))
    optimizer = training.get_megatron_optimizer(models.optim_config(opts), chunks)
    training.install_training_hooks(chunks, optimizer)
    binding = bind_params(chunks)
    ps = symbols.resolve("parallel_state")
    if opts.vpp > 1 and models.MICROBATCHES % opts.pp:  # the interleaved schedule needs a multiple of PP
        return chunks, binding  # PP=4 x VPP=2 before 0.8: the initial weights (different on every rank)
    batches = models.make_batches(opts, ps.get_data_parallel_rank())
    training.zero_grad_buffer(chunks, optimizer)
    training.forward_backward(models.forward_step(opts), models.data_iterators(batches, chunks), chunks,
                              models.MICROBATCHES, seq_length=models.SEQ, micro_batch_size=models.MICRO_BATCH)
    training.optimizer_step(optimizer)
    training.finish_param_sync(chunks, optimizer, keep_overlap=False)
    return chunks, binding


def _names(core: Any) -> dict[str, str]:
    """This module's own single-rank names (not the binding's placement code)."""
    layers = core.decoder.layers
    experts: dict[str, list[int]] = {}
    for name, m in core.named_modules():
        if hasattr(m, "local_experts"):
            parent = dict(core.named_modules())[name.rsplit(".", 1)[0]]
            experts[name + ".local_experts."] = list(getattr(m, "local_expert_indices", None)
                                                     or parent.local_expert_indices)
    out = {}
    for name, _ in core.named_parameters():
        parts = name.split(".")
        for prefix, indices in experts.items():
            if name.startswith(prefix):
                at = len(prefix.split(".")) - 1
                parts[at] = str(indices[int(parts[at])])
        if parts[:2] == ["decoder", "layers"]:
            parts[2] = str(layers[int(parts[2])].layer_number - 1)
        out[name] = ".".join(parts)
    return out


def _reference(chunks: list[Any]) -> dict[str, Any]:
    """Full weights from per-tensor exchange of every parameter with its attributes."""
    import torch
    import torch.distributed as dist

    from mcore_compat import symbols
    from mcore_compat.layout.read import unwrap

    ps = symbols.resolve("parallel_state")
    tp_rank = ps.get_tensor_model_parallel_rank()
    mine = []
    for chunk in chunks:
        core = unwrap(chunk)
        names = _names(core)
        tied = core.share_embeddings_and_output_weights and not core.pre_process
        for name, p in core.named_parameters():
            if tied and name == "output_layer.weight":
                continue
            split = bool(getattr(p, "tensor_model_parallel", False))
            mine.append((names[name], tp_rank if split else 0, p.detach().clone(), split,
                         getattr(p, "partition_dim", -1), getattr(p, "partition_stride", 1)))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    shards: dict[str, dict[int, Any]] = {}
    for records in everyone:
        for name, r, t, split, dim, stride in records:
            shards.setdefault(name, {}).setdefault(r, (t, split, dim, stride))
    full = {}
    for name, by_rank in shards.items():
        t, split, dim, stride = by_rank[0]
        if not split:
            full[name] = t
            continue
        tp = len(by_rank)
        parts = [list(by_rank[r][0].chunk(stride, dim)) for r in range(tp)]
        full[name] = torch.cat([parts[r][j] for j in range(stride) for r in range(tp)], dim)
    return full


def _differ(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    import torch

    if set(got) != set(want):
        return sorted(set(got) ^ set(want))[:5]
    return [n for n in want if not (got[n].shape == want[n].shape and torch.equal(got[n], want[n]))]


def _corrupt(binding: Any, change: Any) -> None:
    """Make ``binding.manifest()`` return a manifest with every entry passed through ``change``."""
    real = binding.manifest

    def manifest() -> Any:
        m = real()
        return dataclasses.replace(m, params=tuple(change(e) for e in m.params))

    binding.manifest = manifest
    binding._stage_manifests.clear()


def _restore(binding: Any) -> None:
    del binding.manifest
    binding._stage_manifests.clear()


def _attempt(binding: Any, want: dict[str, Any]) -> dict[str, Any]:
    from mcore_compat import BindingError, gather_full

    try:
        got = gather_full(binding)
    except BindingError as exc:
        return {"refused": str(exc).splitlines()[0], "differ": None}
    return {"refused": None, "differ": _differ(got, want)}


def _case(world: int, name: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from mcore_compat import gather_full, iter_full
    from mcore_compat.binding import Manifest
    from mcore_compat.selfcheck import models

    opts = _options(world, fields_of(world, name))
    chunks, binding = _train(opts)
    binding.verify()
    manifest = binding.manifest()
    want = _reference(chunks)
    got = gather_full(binding)
    to_rank0 = gather_full(binding, dst=0)
    small = list(iter_full(binding, bucket_bytes=4096))
    # reuse_output: the same tensor objects on the next call, overwritten with the weights of then (doubled here)
    kept = gather_full(binding, reuse_output=True, reuse_buffers=True)
    reuse_differ = _differ(kept, want)
    with torch.no_grad():
        for flat in binding.flat_buffers():
            flat.mul_(2)
        again = gather_full(binding, reuse_output=True, reuse_buffers=True)
        overwritten = _differ(kept, {n: 2 * t for n, t in want.items()})
        for flat in binding.flat_buffers():
            flat.div_(2)
    same_objects = sorted(kept) == sorted(again) and all(kept[n] is again[n] for n in kept)
    # every tensor taken as large: its pieces received straight into the output where they are one block of it
    # (duplicated, or split along dim 0 with stride 1), block copies from the staging tensor for the others
    from mcore_compat.binding import full as full_module

    small_numel, full_module._BLOCK_COPY_NUMEL = full_module._BLOCK_COPY_NUMEL, 1
    try:
        blocks = gather_full(binding, bucket_bytes=2**20 + 1)
        blocks_dst = gather_full(binding, bucket_bytes=2**20 + 1, dst=0)
    finally:
        full_module._BLOCK_COPY_NUMEL = small_numel
    (_, block_buckets), = [v for k, v in binding._full_plans.items() if k[1] == 2**20 + 1]
    # every bucket of several tensors stays within 4096 bytes of output and of received slices
    (_, buckets), = [v for k, v in binding._full_plans.items() if k[1] == 4096]
    over = [(b.total, b.staging) for b in buckets if len(b.outputs) > 1
            and max(b.total, b.staging) * b.dtype.itemsize > 4096]
    out: dict[str, Any] = {
        "status": "ok", "n": len(want), "differ": _differ(got, want),
        "dst_differ": _differ(to_rank0, want) if dist.get_rank() == 0 else sorted(to_rank0),
        "small_differ": _differ(dict(small), want), "small_chunks": len(small), "buckets_over": over,
        "buckets": len(buckets), "reuse_differ": reuse_differ, "reuse_overwritten_differ": overwritten,
        "reuse_same_objects": same_objects,
        "blocks_differ": _differ(blocks, want),
        "blocks_dst_differ": _differ(blocks_dst, want) if dist.get_rank() == 0 else sorted(blocks_dst),
        "blocks_directs": sum(len(b.directs) for b in block_buckets),
        "blocks_copies": sum(len(b.copies) for b in block_buckets),
        "round_trip": Manifest.from_json(manifest.to_json()) == manifest,
        "format_version": manifest.format_version, "mode": binding.mode, "unbound": list(binding.unbound),
        "vp_stages": sorted({e.vp_stage for e in manifest.params if e.vp_stage is not None}),
        "experts": sorted({e.expert for e in manifest.params if e.expert is not None}),
        "expert_buffers": sorted({e.buffer for e in manifest.params if e.expert is not None}),
        "dense_buffers": sorted({e.buffer for e in manifest.params if e.expert is None}),
        "split": sum(e.tp_split for e in manifest.params), "layout": opts.label(),
    }
    # a wrong stride (every rank alike, TP > 1): the pieces land in the wrong places
    target = next((e.full_name for e in manifest.params
                   if e.tp_split and e.tp_size > 1 and e.shape[e.partition_dim] % 2 == 0), None)
    if target is not None:
        _corrupt(binding, lambda e: dataclasses.replace(e, partition_stride=2) if e.full_name == target else e)
        out["wrong_stride"] = _attempt(binding, want)
        _restore(binding)
    # two local experts swapped on EP rank 0 (every layer), and an expert claimed by two EP ranks
    if out["experts"] and (opts.ep or 1) > 1:
        local = sorted({e.expert for e in manifest.params if e.expert is not None})[:2]

        def swap(e: Any) -> Any:
            if e.expert not in local or e.ep_rank != 0:
                return e
            other = local[1] if e.expert == local[0] else local[0]
            return dataclasses.replace(e, expert=other, full_name=e.full_name.replace(
                f"local_experts.{e.expert}.", f"local_experts.{other}."))

        _corrupt(binding, swap)
        out["swapped_expert"] = _attempt(binding, want)
        _restore(binding)
        lowest = min(out["experts"])

        def claim(e: Any) -> Any:
            if e.expert != lowest:
                return e
            shift = f"local_experts.{lowest}.", f"local_experts.{lowest - (opts.experts // opts.ep)}."
            return dataclasses.replace(e, expert=lowest - opts.experts // opts.ep,
                                       full_name=e.full_name.replace(*shift)) if lowest else e

        _corrupt(binding, claim)
        out["double_claim"] = _attempt(binding, want)
        _restore(binding)
    models.release_chunks(chunks)
    return out


def run_world(world: int) -> dict[str, Any]:
    """Every layout of ``world`` that the release runs, on this rank: ``{"version", "cases"}``."""
    from _case_groups import run_case
    from _training_scenarios import apply_patches

    apply_patches()

    from mcore_compat import symbols
    from mcore_compat.detect import detect

    results: dict[str, Any] = {}
    for name in CONFIGS[world]:
        reason = why_not(world, name)
        if reason is not None:
            results[name] = {"status": "skip", "reason": reason}
            continue
        results[name] = run_case(lambda: _case(world, name))  # noqa: B023 (called at once)
    ps = symbols.resolve("parallel_state")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    return {"version": str(detect().version), "cases": results}


def run_world2() -> dict[str, Any]:
    return run_world(2)


def run_world4() -> dict[str, Any]:
    return run_world(4)
