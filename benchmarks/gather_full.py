"""Full, unsharded weights from a TP=2 x PP=2 model: ``gather_full`` vs per-tensor gathering vs one flat broadcast.

Four ranks, tensor-parallel size 2 x pipeline-parallel size 2 (CPU: gloo; CUDA: NCCL, one GPU per rank). Each
rank holds a ``MegatronModule`` of ``ColumnParallelLinear`` layers (weight and bias split over TP along dim 0),
named per pipeline stage, wrapped with ``mcore_compat.training.wrap_ddp`` (distributed optimizer), its Megatron
optimizer built, and bound with ``bind_params``. Two models:

* ``many_small``: ~2,000 full tensors in all (default 500 layers + bias per stage);
* ``few_large``: a few big tensors.

Measured side by side, interleaved, after warm-up (median of the per-repetition maximum over the ranks); every
rank receives the whole model:

* ``gather_full``: ``mcore_compat.gather_full(binding, reuse_buffers=True)`` (one slice per source flat buffer
  into a receive tensor kept from the previous call, TP concatenation on the receiving side into new output
  tensors; the manifests and the transfer plan are made once and cached); ``gather_full_fresh``: the same with
  a fresh receive tensor per call (the default); ``gather_full_reuse_output``: ``reuse_buffers=True,
  reuse_output=True`` (the output tensors of the previous call refilled and returned again, so that, like
  ``flat``, it receives into memory kept between calls: no allocation, page faults or views per call);
* ``per_tensor``: what RL frameworks do today: every parameter shard broadcast from its rank, one collective
  each (the receiver allocates it), then the TP shards of each tensor concatenated (shapes exchanged once
  beforehand, like gather_full's cached manifests);
* ``flat``: one ``torch.distributed.broadcast`` of one preallocated flat tensor of the same bytes from rank 0
  (the bandwidth bound; it moves nothing into place).

GB/s = bytes of the full model / time. Goals (for ``gather_full``): gather_full/flat >= 0.8 and
gather_full/per_tensor >= 20 (many_small); the goal on the flat ratio is also shown for
``gather_full_reuse_output``, the like-for-like comparison with ``flat`` (both fill memory kept between calls;
``gather_full`` returns new tensors, 2,000 of them in ``many_small``).

JSON (``results.<model>``): ``layers_per_stage``, ``hidden``, ``full_tensors``, ``shards``, ``total_bytes``,
``same_content`` (gather_full equals the per-tensor result on every rank), ``time_s`` (per method: median, mean,
min, max, stdev, n), ``raw_times_s``, ``GBps``, ``ratio_gather_full_over_flat``,
``ratio_gather_full_over_per_tensor``, ``ratio_gather_full_fresh_over_flat``,
``ratio_gather_full_reuse_output_over_flat``, ``ratio_gather_full_reuse_output_over_per_tensor``;
``ratio_per_repetition`` (the spread: per ratio over flat, the ratio within each repetition, where the methods ran
side by side, as ``stats``).

    python3 benchmarks/gather_full.py --device cpu          # gloo, world 4
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

NAME = "gather_full"

#: Per device: (layers, hidden) per stage of the two models, warm-up and timed repetitions.
MODELS = {
    "cuda": {"many_small": (500, 256), "few_large": (4, 8192)},
    "cpu": {"many_small": (500, 32), "few_large": (4, 1024)},
}
REPS = {"cuda": (3, 10), "cpu": (2, 5)}
METHODS = ("gather_full", "gather_full_fresh", "gather_full_reuse_output", "per_tensor", "flat")
TP, PP = 2, 2


def _build(layers: int, hidden: int, device: str, seed: int, stage: int) -> Any:
    """This rank's DDP-wrapped chunk list: ``layers`` ColumnParallelLinear(hidden, hidden) with bias."""
    import torch

    import mcore_compat as mc
    from mcore_compat import training as mt

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg_cls = mc.TransformerConfig
    kwargs: dict[str, Any] = dict(
        num_layers=2, hidden_size=hidden, num_attention_heads=TP, tensor_model_parallel_size=TP,
        pipeline_model_parallel_size=PP, use_cpu_initialization=device == "cpu", perform_initialization=False,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, gradient_accumulation_fusion=False,
    )
    fields = set(getattr(cfg_cls, "__dataclass_fields__", {}))
    config = cfg_cls(**{k: v for k, v in kwargs.items() if k in fields})
    base, column = mc.MegatronModule, mc.ColumnParallelLinear

    class Stage(base):  # type: ignore[misc, valid-type]
        """``layers`` column-parallel linear layers under ``stage<s>`` (never run: only their weights move)."""

        def __init__(self) -> None:
            super().__init__(config=config)
            self.add_module(f"stage{stage}", torch.nn.ModuleList(
                column(hidden, hidden, config=config, init_method=torch.nn.init.zeros_, bias=True,
                       gather_output=False) for _ in range(layers)))

    module = Stage()
    if device == "cuda":
        module = module.cuda(torch.cuda.current_device())
    gen = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    chunks = mt.wrap_ddp([module], ddp_config=mt.DDPConfig(use_distributed_optimizer=True,
                                                           grad_reduce_in_fp32=dtype == torch.bfloat16))
    optimizer = mt.get_megatron_optimizer(mt.OptimConfig(
        optimizer="adam", lr=1e-4, bf16=dtype == torch.bfloat16, params_dtype=dtype,
        use_distributed_optimizer=True), chunks)
    return chunks, optimizer


def _measure(layers: int, hidden: int, device: str, seed: int, warmup: int, reps: int) -> dict[str, Any]:
    import time

    import torch
    import torch.distributed as dist

    import mcore_compat as mc

    ps = mc.parallel_state
    me, world = dist.get_rank(), dist.get_world_size()
    tp_rank = ps.get_tensor_model_parallel_rank()
    chunks, _optimizer = _build(layers, hidden, device, seed + 1000 * me, ps.get_pipeline_model_parallel_rank())
    binding = mc.bind_params(chunks)
    named = list(chunks[0].module.named_parameters())
    dev = named[0][1].device
    metas: list[Any] = [None] * world
    dist.all_gather_object(metas, [(n, tuple(p.shape), p.dtype, tp_rank) for n, p in named])
    dtype = named[0][1].dtype
    total_numel = sum(int(torch.Size(shape).numel()) for m in metas for _, shape, _, _ in m)
    total_bytes = total_numel * torch.tensor([], dtype=dtype).element_size()
    flat_all = torch.empty(total_numel, dtype=dtype, device=dev)

    def per_tensor() -> dict[str, Any]:
        shards: dict[str, dict[int, Any]] = {}
        for src, meta in enumerate(metas):
            for (n, shape, dt, r), (_, p) in zip(meta, named if src == me else [(None, None)] * len(meta),
                                                   strict=True):
                t = p.data if src == me else torch.empty(shape, dtype=dt, device=dev)
                dist.broadcast(t, src=src)
                shards.setdefault(n, {})[r] = t
        return {n: torch.cat([by[r] for r in sorted(by)], 0) for n, by in shards.items()}

    def flat() -> None:
        dist.broadcast(flat_all, src=0)

    fns = {"gather_full": lambda: mc.gather_full(binding, reuse_buffers=True),
           "gather_full_fresh": lambda: mc.gather_full(binding),
           "gather_full_reuse_output": lambda: mc.gather_full(binding, reuse_buffers=True, reuse_output=True),
           "per_tensor": per_tensor, "flat": flat}
    barrier_kwargs = {"device_ids": [torch.cuda.current_device()]} if device == "cuda" else {}

    def timed(fn: Any) -> float:
        C.sync(device)
        dist.barrier(**barrier_kwargs)
        C.sync(device)
        t0 = time.perf_counter()
        fn()
        C.sync(device)
        return time.perf_counter() - t0

    for _ in range(warmup):
        for m in METHODS:
            timed(fns[m])
    ref, got = per_tensor(), mc.gather_full(binding)
    kept = mc.gather_full(binding, reuse_buffers=True, reuse_output=True)
    same = all(sorted(ref) == sorted(g) and all(torch.equal(ref[k], g[k]) for k in ref) for g in (got, kept))
    n_full = len(got)
    del ref, got, kept
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for r in range(reps):
        order = METHODS[r % len(METHODS):] + METHODS[:r % len(METHODS)]
        for m in order:
            times[m].append(timed(fns[m]))
    return {"times": times, "same_content": same, "total_bytes": total_bytes, "full_tensors": n_full,
            "shards": sum(len(m) for m in metas), "binding_mode": binding.mode}


def _rank(device: str, seed: int, models: list[str], warmup: int, reps: int,
          sizes: dict[str, tuple[int, int]]) -> dict[str, Any]:
    C.quiet()
    patches = C.prepare_megatron(device)
    import gc

    import mcore_compat as mc

    ps = mc.parallel_state
    ps.initialize_model_parallel(tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP)
    out = {}
    for m in models:
        out[m] = _measure(*sizes[m], device, seed, warmup, reps)
        gc.collect()
    ps.destroy_model_parallel()
    return {"models": out, "environment": C.environment(device), "patches": patches}


def main() -> int:
    p = C.parser(__doc__)
    p.add_argument("--models", nargs="+", choices=("many_small", "few_large"), default=["many_small", "few_large"])
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--timeout", type=float, default=480.0)
    args = p.parse_args()
    from mcore_compat import launch

    sizes = dict(MODELS[args.device])
    warmup, reps = REPS[args.device]
    warmup = args.warmup if args.warmup is not None else warmup
    reps = args.reps if args.reps is not None else reps
    env = dict(C.NCCL_ENV) if args.device == "cuda" else {}
    env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    per_rank = launch.spawn(_rank, TP * PP, args=(args.device, args.seed, args.models, warmup, reps, sizes),
                            device=args.device, timeout=args.timeout, env=env)
    results: dict[str, Any] = {}
    headline = []
    for m in args.models:
        r0 = per_rank[0]["models"][m]
        total = r0["total_bytes"]
        times = {k: [max(pr["models"][m]["times"][k][i] for pr in per_rank) for i in range(reps)] for k in METHODS}
        st = {k: C.stats(v) for k, v in times.items()}
        gbps = {k: total / st[k]["median"] / 1e9 for k in METHODS}
        results[m] = {
            "layers_per_stage": sizes[m][0], "hidden": sizes[m][1], "full_tensors": r0["full_tensors"],
            "shards": r0["shards"], "total_bytes": total, "binding_mode": r0["binding_mode"],
            "same_content": all(pr["models"][m]["same_content"] for pr in per_rank),
            "time_s": st, "raw_times_s": times, "GBps": gbps,
            "ratio_gather_full_over_flat": gbps["gather_full"] / gbps["flat"],
            "ratio_gather_full_over_per_tensor": gbps["gather_full"] / gbps["per_tensor"],
            "ratio_gather_full_fresh_over_flat": gbps["gather_full_fresh"] / gbps["flat"],
            "ratio_gather_full_reuse_output_over_flat": gbps["gather_full_reuse_output"] / gbps["flat"],
            "ratio_gather_full_reuse_output_over_per_tensor": gbps["gather_full_reuse_output"] / gbps["per_tensor"],
            "ratio_per_repetition": {f"{k}_over_flat": C.stats([f / g for f, g in zip(times["flat"], times[k],
                                                                                         strict=True)])
                                     for k in ("gather_full", "gather_full_fresh", "gather_full_reuse_output")},
        }
        label = f"{m} ({r0['full_tensors']} full tensors, {r0['shards']} shards, {C.fmt_bytes(total)})"
        headline += [
            C.metric(f"{label}: gather_full (reused receive buffer)", gbps["gather_full"], "GB/s"),
            C.metric(f"{label}: gather_full (fresh receive buffer)", gbps["gather_full_fresh"], "GB/s"),
            C.metric(f"{label}: gather_full (reused receive buffer and output)", gbps["gather_full_reuse_output"],
                     "GB/s"),
            C.metric(f"{label}: per-tensor broadcast + TP concat", gbps["per_tensor"], "GB/s"),
            C.metric(f"{label}: one flat broadcast", gbps["flat"], "GB/s"),
            C.metric(f"{label}: gather_full / flat", results[m]["ratio_gather_full_over_flat"], "x", goal=">= 0.8"),
            C.metric(f"{label}: gather_full / per-tensor", results[m]["ratio_gather_full_over_per_tensor"], "x",
                     goal=">= 20" if m == "many_small" else None),
            C.metric(f"{label}: gather_full (fresh) / flat", results[m]["ratio_gather_full_fresh_over_flat"], "x"),
            C.metric(f"{label}: gather_full (reused output) / flat",
                     results[m]["ratio_gather_full_reuse_output_over_flat"], "x", goal=">= 0.8"),
            C.metric(f"{label}: gather_full (reused output) / per-tensor",
                     results[m]["ratio_gather_full_reuse_output_over_per_tensor"], "x"),
            C.metric(f"{label}: same content", float(results[m]["same_content"]), "", goal="== 1"),
        ]
    config = {"world_size": TP * PP, "tensor_model_parallel_size": TP, "pipeline_model_parallel_size": PP,
              "warmup": warmup, "reps": reps, "backend": launch.default_backend(args.device),
              "models": {m: sizes[m] for m in args.models}, "patches": per_rank[0]["patches"],
              "timing": "per repetition: sync, barrier, sync, run, sync; max over ranks; median over repetitions"}
    C.write_result(NAME, args.device, args.out, config=config, results=results, headline=headline,
                   environment_=per_rank[0]["environment"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
