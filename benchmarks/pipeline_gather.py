"""Gathering all pipeline stages' weights: ``gather_pipeline_flat`` / ``gather_pipeline`` vs per-tensor broadcasts
vs one flat broadcast.

Two ranks, pipeline-parallel size 2 (CUDA: NCCL, one GPU per rank; CPU: gloo, a smoke test only). Each stage
holds a ``MegatronModule`` of ``ColumnParallelLinear`` layers, wrapped with ``mcore_compat.training.wrap_ddp``
(distributed optimizer), its Megatron optimizer built, and bound with ``bind_params`` (zero-copy on DDP's
``param_data``). Two models:

* ``many_small``: ~2,000 parameter tensors in all (default 500 layers of 256x256 + bias per stage);
* ``few_large``: a few big tensors (CUDA default: 4 x 8192x8192 bf16 per stage = 1 GiB in all).

Measured side by side, interleaved, after warm-up (median of the per-repetition maximum over the ranks):

* ``gather_flat``: ``mcore_compat.binding.gather_pipeline_flat(binding, reuse_buffers=True)`` (every rank
  receives every stage's flat buffers, into receive buffers kept from the previous call, plus the cached
  manifests): the path an RL framework uses to hand weights to an inference engine;
* ``gather``: ``mcore_compat.binding.gather_pipeline(binding)`` (the same transfer into fresh buffers, then one
  named view per parameter of every stage);
* ``per_tensor``: what RL frameworks do today: every parameter broadcast from its stage, one collective each
  (the receiver allocates each tensor; shapes exchanged once beforehand, like gather's cached manifests);
* ``flat``: one ``torch.distributed.broadcast`` of one preallocated flat tensor of the same bytes (the
  bandwidth bound); ``flat_per_stage``: one preallocated flat tensor per stage, broadcast from that stage.

GB/s = bytes of all stages' weights / time. Goals (for ``gather_flat``): gather_flat/flat >= 0.9 and
gather_flat/per_tensor >= 20 (many_small). ``gather`` is reported alongside, without goals: with thousands of
small tensors building the named views costs more than moving the bytes.

JSON (``results.<model>``): ``layers_per_stage``, ``hidden``, ``bias``; ``tensors_per_stage``,
``total_tensors``, ``total_bytes``, ``flat_buffers_per_stage``, ``binding_mode``; ``same_content`` (gather_flat
and gather both equal the per-tensor reference on every rank); ``time_s`` (per method: median, mean, min, max,
stdev, n of the per-repetition max over ranks), ``raw_times_s`` (those values), ``GBps`` (per method, from the
median); ``gather_views_only_s`` (building every stage's named views alone, part of gather); ratios of GB/s:
``ratio_gather_flat_over_flat``, ``ratio_gather_flat_over_flat_per_stage``, ``ratio_gather_flat_over_per_tensor``,
``ratio_gather_over_flat``, ``ratio_gather_over_flat_per_stage``, ``ratio_gather_over_per_tensor``. Methods:
``gather_flat``, ``gather``, ``per_tensor``, ``flat``, ``flat_per_stage``.

    python3 benchmarks/pipeline_gather.py --device cuda
    python3 benchmarks/pipeline_gather.py --device cpu          # gloo, small sizes: a smoke test
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

NAME = "pipeline_gather"

#: Per device: (layers, hidden, bias) per stage of the two models, warm-up and timed repetitions.
MODELS = {
    "cuda": {"many_small": (500, 256, True), "few_large": (4, 8192, False)},
    "cpu": {"many_small": (500, 32, True), "few_large": (4, 512, False)},
}
REPS = {"cuda": (3, 10), "cpu": (2, 5)}
METHODS = ("gather_flat", "gather", "per_tensor", "flat", "flat_per_stage")


def _build_stage(layers: int, hidden: int, bias: bool, device: str, seed: int) -> tuple[Any, Any]:
    """This stage's DDP-wrapped chunk list and optimizer: ``layers`` ColumnParallelLinear(hidden, hidden)."""
    import torch

    import mcore_compat as mc
    from mcore_compat import training as mt

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg_cls = mc.TransformerConfig
    kwargs: dict[str, Any] = dict(
        num_layers=2, hidden_size=hidden, num_attention_heads=1, pipeline_model_parallel_size=2,
        use_cpu_initialization=device == "cpu", perform_initialization=False, params_dtype=dtype,
        pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, gradient_accumulation_fusion=False,
    )
    fields = set(getattr(cfg_cls, "__dataclass_fields__", {}))
    config = cfg_cls(**{k: v for k, v in kwargs.items() if k in fields})
    base, column = mc.MegatronModule, mc.ColumnParallelLinear

    class Stage(base):  # type: ignore[misc, valid-type]
        """``layers`` column-parallel linear layers (never run: only their weights move)."""

        def __init__(self) -> None:
            super().__init__(config=config)
            self.layers = torch.nn.ModuleList(
                column(hidden, hidden, config=config, init_method=torch.nn.init.zeros_, bias=bias,
                       gather_output=False) for _ in range(layers))

    module = Stage()
    if device == "cuda":
        module = module.cuda(torch.cuda.current_device())
    gen = torch.Generator(device=module.layers[0].weight.device).manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    chunks = mt.wrap_ddp([module], ddp_config=mt.DDPConfig(use_distributed_optimizer=True,
                                                           grad_reduce_in_fp32=dtype == torch.bfloat16))
    optimizer = mt.get_megatron_optimizer(mt.OptimConfig(
        optimizer="adam", lr=1e-4, bf16=dtype == torch.bfloat16, params_dtype=dtype,
        use_distributed_optimizer=True), chunks)
    return chunks, optimizer


def _measure_model(layers: int, hidden: int, bias: bool, device: str, seed: int, warmup: int,
                   reps: int) -> dict[str, Any]:
    """Build this stage, bind, run every method ``warmup + reps`` times; this rank's numbers."""
    import time

    import torch
    import torch.distributed as dist

    import mcore_compat as mc
    from mcore_compat.binding import bind_params, gather_pipeline, gather_pipeline_flat

    ps = mc.parallel_state
    group = ps.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank(group)
    chunks, _optimizer = _build_stage(layers, hidden, bias, device, seed + 1000 * me)
    binding = bind_params(chunks)
    module = chunks[0].module
    named = list(module.named_parameters())
    dev = named[0][1].device
    metas: list[Any] = [None] * len(ranks)
    dist.all_gather_object(metas, [(n, tuple(p.shape), p.dtype) for n, p in named], group=group)
    stage_numel = [sum(int(torch.Size(shape).numel()) for _, shape, _ in m) for m in metas]
    dtype = named[0][1].dtype
    total_bytes = sum(stage_numel) * torch.tensor([], dtype=dtype).element_size()
    flat_all = torch.empty(sum(stage_numel), dtype=dtype, device=dev)
    flat_stages = [torch.empty(n, dtype=dtype, device=dev) for n in stage_numel]

    def per_tensor() -> dict[str, Any]:
        out = {}
        for stage, (src, meta) in enumerate(zip(ranks, metas, strict=True)):
            if stage == me:
                for n, p in named:
                    dist.broadcast(p.data, src=src, group=group)
                    out[f"stage{stage}.{n}"] = p.data
            else:
                for n, shape, dt in meta:
                    t = torch.empty(shape, dtype=dt, device=dev)
                    dist.broadcast(t, src=src, group=group)
                    out[f"stage{stage}.{n}"] = t
        return out

    def flat() -> None:
        dist.broadcast(flat_all, src=ranks[0], group=group)

    def flat_per_stage() -> None:
        for src, t in zip(ranks, flat_stages, strict=True):
            dist.broadcast(t, src=src, group=group)

    fns = {"gather_flat": lambda: gather_pipeline_flat(binding, group=group, reuse_buffers=True),
           "gather": lambda: gather_pipeline(binding, group=group), "per_tensor": per_tensor, "flat": flat,
           "flat_per_stage": flat_per_stage}

    barrier_kwargs = {"device_ids": [torch.cuda.current_device()]} if device == "cuda" else {}

    def timed(fn: Any) -> float:
        C.sync(device)
        dist.barrier(group=group, **barrier_kwargs)
        C.sync(device)
        t0 = time.perf_counter()
        fn()
        C.sync(device)
        return time.perf_counter() - t0

    for _ in range(warmup):
        for m in METHODS:
            timed(fns[m])
    # Same content every way (a check that each moves every stage's weights).
    ref = per_tensor()
    got = gather_pipeline(binding, group=group)
    got_flat = {f"stage{sb.stage}.{n}": t for sb in gather_pipeline_flat(binding, group=group, reuse_buffers=True)
                for n, t in sb.views().items()}
    same = all(sorted(g) == sorted(ref) and all(torch.equal(g[k], ref[k]) for k in ref) for g in (got, got_flat))
    del got, got_flat, ref
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for r in range(reps):
        order = METHODS[r % len(METHODS):] + METHODS[:r % len(METHODS)]  # rotate: no method always first
        for m in order:
            times[m].append(timed(fns[m]))
    # The cost of building the named views alone (part of gather), for the record.
    manifests = binding._manifests_over(group)
    flats = [[torch.empty(b.numel, dtype=b.torch_dtype, device=dev) for b in mf.buffers] for mf in manifests]
    t0 = time.perf_counter()
    for _ in range(reps):
        for mf, fl in zip(manifests, flats, strict=True):
            mf.views(fl)
    views_s = (time.perf_counter() - t0) / reps
    result = {"times": times, "views_only_s": views_s, "same_content": same, "total_bytes": total_bytes,
              "stage_numel": stage_numel, "tensors_per_stage": [len(m) for m in metas],
              "flat_buffers_per_stage": len(binding.flat_buffers()), "binding_mode": binding.mode}
    return result


def _rank(device: str, seed: int, models: list[str], warmup: int, reps: int,
          sizes: dict[str, tuple[int, int, bool]]) -> dict[str, Any]:
    """One rank: PP=2, every model measured; returns this rank's numbers and (rank 0) the environment."""
    C.quiet()
    patches = C.prepare_megatron(device)
    import mcore_compat as mc

    ps = mc.parallel_state
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    import gc

    import torch

    out = {}
    for m in models:
        out[m] = _measure_model(*sizes[m], device, seed, warmup, reps)
        gc.collect()  # this model's buffers go before the next one is built
        if device == "cuda":
            torch.cuda.empty_cache()
    ps.destroy_model_parallel()
    return {"models": out, "environment": C.environment(device), "patches": patches}


def main() -> int:
    p = C.parser(__doc__)
    p.add_argument("--models", nargs="+", choices=("many_small", "few_large"), default=["many_small", "few_large"])
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--small", type=int, nargs=2, metavar=("LAYERS", "HIDDEN"), default=None,
                   help="many_small: layers and hidden per stage")
    p.add_argument("--large", type=int, nargs=2, metavar=("LAYERS", "HIDDEN"), default=None,
                   help="few_large: layers and hidden per stage")
    p.add_argument("--timeout", type=float, default=480.0)
    args = p.parse_args()
    from mcore_compat import launch

    sizes = dict(MODELS[args.device])
    if args.small:
        sizes["many_small"] = (args.small[0], args.small[1], True)
    if args.large:
        sizes["few_large"] = (args.large[0], args.large[1], False)
    warmup, reps = REPS[args.device]
    warmup = args.warmup if args.warmup is not None else warmup
    reps = args.reps if args.reps is not None else reps
    env = dict(C.NCCL_ENV) if args.device == "cuda" else {}
    env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    per_rank = launch.spawn(_rank, 2, args=(args.device, args.seed, args.models, warmup, reps, sizes),
                            device=args.device, timeout=args.timeout, env=env)

    results: dict[str, Any] = {}
    headline = []
    for m in args.models:
        r0 = per_rank[0]["models"][m]
        total = r0["total_bytes"]
        times = {k: [max(pr["models"][m]["times"][k][i] for pr in per_rank) for i in range(reps)]
                 for k in METHODS}
        st = {k: C.stats(v) for k, v in times.items()}
        gbps = {k: total / st[k]["median"] / 1e9 for k in METHODS}
        results[m] = {
            "layers_per_stage": sizes[m][0], "hidden": sizes[m][1], "bias": sizes[m][2],
            "tensors_per_stage": r0["tensors_per_stage"], "total_tensors": sum(r0["tensors_per_stage"]),
            "total_bytes": total, "flat_buffers_per_stage": r0["flat_buffers_per_stage"],
            "binding_mode": r0["binding_mode"], "same_content": all(pr["models"][m]["same_content"]
                                                                     for pr in per_rank),
            "time_s": st, "raw_times_s": times, "GBps": gbps,
            "gather_views_only_s": max(pr["models"][m]["views_only_s"] for pr in per_rank),
            "ratio_gather_flat_over_flat": gbps["gather_flat"] / gbps["flat"],
            "ratio_gather_flat_over_flat_per_stage": gbps["gather_flat"] / gbps["flat_per_stage"],
            "ratio_gather_flat_over_per_tensor": gbps["gather_flat"] / gbps["per_tensor"],
            "ratio_gather_over_flat": gbps["gather"] / gbps["flat"],
            "ratio_gather_over_flat_per_stage": gbps["gather"] / gbps["flat_per_stage"],
            "ratio_gather_over_per_tensor": gbps["gather"] / gbps["per_tensor"],
        }
        label = f"{m} ({sum(r0['tensors_per_stage'])} tensors, {C.fmt_bytes(total)})"
        headline += [
            C.metric(f"{label}: gather_pipeline_flat (reused buffers)", gbps["gather_flat"], "GB/s"),
            C.metric(f"{label}: gather_pipeline (named views)", gbps["gather"], "GB/s"),
            C.metric(f"{label}: per-tensor broadcast", gbps["per_tensor"], "GB/s"),
            C.metric(f"{label}: one flat broadcast", gbps["flat"], "GB/s"),
            C.metric(f"{label}: gather_flat / flat", results[m]["ratio_gather_flat_over_flat"], "x", goal=">= 0.9"),
            C.metric(f"{label}: gather_flat / per-tensor", results[m]["ratio_gather_flat_over_per_tensor"], "x",
                     goal=">= 20" if m == "many_small" else None),
            C.metric(f"{label}: gather / flat", results[m]["ratio_gather_over_flat"], "x"),
            C.metric(f"{label}: gather / per-tensor", results[m]["ratio_gather_over_per_tensor"], "x"),
            C.metric(f"{label}: same content every way", float(results[m]["same_content"]), "", goal="== 1"),
        ]
    config = {"world_size": 2, "pipeline_model_parallel_size": 2, "warmup": warmup, "reps": reps,
              "backend": launch.default_backend(args.device), "models": {m: sizes[m] for m in args.models},
              "patches": per_rank[0]["patches"],
              "timing": "per repetition: sync, barrier, sync, run, sync; max over ranks; median over repetitions"}
    C.write_result(NAME, args.device, args.out, config=config, results=results, headline=headline,
                   environment_=per_rank[0]["environment"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
