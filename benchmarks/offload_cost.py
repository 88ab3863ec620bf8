"""Offload + reload of a trained GPT's params, grads and Adam state, against the pinned-copy limit.

One rank builds the benchmark GPT (``_gpt.py``; bf16 params, fp32 grads, distributed optimizer, Adam), trains one
step so that the optimizer state exists, then times, interleaved round by round in one process:

* ``mcore_compat``: ``mc.offload(chunks, optimizer)`` and ``mc.reload(chunks, optimizer)`` (host buffers pinned
  and reused from the second cycle on; the first cycle, which allocates them, is reported apart);
* ``reallocating``: the same, but the host buffers released before every cycle (what an offload that allocates
  pinned memory per cycle costs);
* ``pageable``: what hand-written offload code often does: every cycle, each storage copied into newly allocated
  pageable host memory (``.to("cpu")``), freed in place, and copied back from it on reload;
* ``pinned limit``: one device tensor of the same bytes copied into a preallocated pinned host tensor and back;

and, after those rounds, Megatron-Core's own RL path where the release has it (``optimizer.offload_to_cpu()`` per
chained optimizer and ``offload_to_cpu()`` per DDP buffer, then ``restore_from_cpu()`` / ``reload_from_cpu()``).
Reported: effective bandwidth (offloaded bytes / time) per direction and its ratio to the pinned limit (goal
>= 0.85), the speed-up over Megatron's path, device memory before/after offload, and a training step after the
last reload (loss finite, weights moved).

    python3 benchmarks/offload_cost.py --device cuda --layers 16 --hidden 2048   # ~0.94 B params, ~16 GiB
    python3 benchmarks/offload_cost.py --device cpu                              # tiny GPT (smoke)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C
import _gpt as G

NAME = "offload_cost"
LR = 1e-5


def _megatron_path(chunks: list[Any], optimizer: Any) -> tuple[Any, Any] | None:
    """Megatron's own offload/restore callables, or ``None`` where the release has none."""
    opts = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    buffers = [b for c in chunks for name in ("buffers", "expert_parallel_buffers")
               for b in (getattr(c, name, None) or []) if isinstance(getattr(c, name, None), list)]
    if not all(hasattr(o, "offload_to_cpu") for o in opts) or not all(hasattr(b, "offload_to_cpu") for b in buffers):
        return None

    def off() -> None:
        for o in opts:
            o.offload_to_cpu()
        for b in buffers:
            b.offload_to_cpu()

    def on() -> None:
        for o in opts:
            o.restore_from_cpu()
        for b in buffers:
            b.reload_from_cpu()

    return off, on


def _pageable_path(chunks: list[Any], optimizer: Any) -> tuple[Any, Any]:
    """(offload, reload) that allocate pageable host copies every cycle (the same storages as mcore_compat's)."""
    from mcore_compat.lifecycle._collect import PIECES, collect
    from mcore_compat.lifecycle._storage import _bytes as as_bytes

    storages = [g.tensors[0].untyped_storage() for g in collect(chunks, optimizer, PIECES)]
    saved: list[tuple[Any, Any]] = []

    def off() -> None:
        saved[:] = [(st, as_bytes(st).to("cpu", copy=True)) for st in storages]
        for st, _host in saved:
            st.resize_(0)

    def on() -> None:
        for st, host in saved:
            st.resize_(host.numel())
            as_bytes(st).copy_(host)
        saved.clear()

    return off, on


def main(argv: list[str] | None = None) -> int:
    p = C.parser(__doc__)
    G.add_args(p)
    p.add_argument("--reps", type=int, default=None, help="rounds (default: 4 on cuda, 2 on cpu)")
    args = p.parse_args(argv)
    spec = G.spec_from_args(args)
    reps = args.reps or (4 if args.device == "cuda" else 2)
    patches, _ps = C.single_rank_megatron(args.device)
    import torch

    import mcore_compat as mc

    _module, chunks, optimizer = G.train_setup(spec, args.seed, lr=LR)
    batches = G.make_batches(spec, args.seed, spec.microbatches)

    def step() -> float:
        return G.train_step(spec, chunks, optimizer, batches)

    step()
    cuda = args.device == "cuda"
    mem = (lambda: torch.cuda.memory_allocated()) if cuda else (lambda: 0)
    before = mem()
    t_first_off, moved = C.timed(lambda: mc.offload(chunks, optimizer), args.device)
    after_off = mem()
    t_first_on, _ = C.timed(lambda: mc.reload(chunks, optimizer), args.device)
    total = moved.total
    limit = {"host": torch.empty(total, dtype=torch.uint8, pin_memory=cuda),
             "dev": torch.empty(total, dtype=torch.uint8, device=args.device)}

    times: dict[str, dict[str, list[float]]] = {k: {"offload": [], "reload": []}
                                                for k in ("mcore_compat", "reallocating", "pageable",
                                                          "pinned_limit", "megatron")}
    pageable_off, pageable_on = _pageable_path(chunks, optimizer)
    for _ in range(reps):
        t, _m = C.timed(lambda: mc.offload(chunks, optimizer), args.device)
        times["mcore_compat"]["offload"].append(t)
        t, _m = C.timed(lambda: mc.reload(chunks, optimizer), args.device)
        times["mcore_compat"]["reload"].append(t)
        mc.release_host_buffers()
        t, _m = C.timed(lambda: mc.offload(chunks, optimizer), args.device)
        times["reallocating"]["offload"].append(t)
        t, _m = C.timed(lambda: mc.reload(chunks, optimizer), args.device)
        times["reallocating"]["reload"].append(t)
        t, _m = C.timed(pageable_off, args.device)
        times["pageable"]["offload"].append(t)
        t, _m = C.timed(pageable_on, args.device)
        times["pageable"]["reload"].append(t)
        t, _m = C.timed(lambda: limit["host"].copy_(limit["dev"], non_blocking=True), args.device)
        times["pinned_limit"]["offload"].append(t)
        t, _m = C.timed(lambda: limit["dev"].copy_(limit["host"], non_blocking=True), args.device)
        times["pinned_limit"]["reload"].append(t)
    limit.clear()  # free the limit's copies before Megatron's path and the last step
    loss_after = step()
    megatron = _megatron_path(chunks, optimizer) if cuda else None  # it pins memory: CUDA only
    megatron_freed = None
    if megatron is not None:
        off, on = megatron
        for _ in range(reps):
            m0 = mem()
            t, _m = C.timed(off, args.device)
            megatron_freed = m0 - mem()
            times["megatron"]["offload"].append(t)
            t, _m = C.timed(on, args.device)
            times["megatron"]["reload"].append(t)
    else:
        del times["megatron"]

    med = {k: {d: C.stats(v)["median"] for d, v in per.items()} for k, per in times.items()}
    gbps = {k: {d: total / t / 1e9 for d, t in per.items()} for k, per in med.items()}
    ratio = {d: gbps["mcore_compat"][d] / gbps["pinned_limit"][d] for d in ("offload", "reload")}
    headline = [
        C.metric("offloaded bytes (params + grads + optimizer state)", total / 2**30, "GiB", goal=">= 4"
                 if cuda else None),
        C.metric("offload bandwidth / pinned-copy limit", ratio["offload"], "x", goal=">= 0.85" if cuda else None),
        C.metric("reload bandwidth / pinned-copy limit", ratio["reload"], "x", goal=">= 0.85" if cuda else None),
        C.metric("device memory left after offload", (after_off / 2**30) if cuda else None, "GiB",
                 note=f"{before / 2**30:.2f} GiB before" if cuda else "CPU: not measured"),
        C.metric("reallocating offload+reload time / mcore_compat's",
                 (med["reallocating"]["offload"] + med["reallocating"]["reload"])
                 / (med["mcore_compat"]["offload"] + med["mcore_compat"]["reload"]), "x"),
        C.metric("pageable per-cycle offload+reload time / mcore_compat's",
                 (med["pageable"]["offload"] + med["pageable"]["reload"])
                 / (med["mcore_compat"]["offload"] + med["mcore_compat"]["reload"]), "x"),
    ]
    if "megatron" in med:
        headline.append(C.metric("Megatron's own offload+reload time / mcore_compat's",
                                 (med["megatron"]["offload"] + med["megatron"]["reload"])
                                 / (med["mcore_compat"]["offload"] + med["mcore_compat"]["reload"]), "x",
                                 note=f"Megatron's path frees {megatron_freed} bytes and copies the optimizer "
                                      f"state only (its buffers drop the grads)"))
    results = {
        "bytes": {"params": moved.params, "grads": moved.grads, "optimizer_state": moved.optimizer_state,
                  "total": total},
        "first_cycle_seconds": {"offload": t_first_off, "reload": t_first_on},
        "seconds": times, "median_seconds": med, "gb_per_s": gbps,
        "memory_allocated": {"before": before, "after_offload": after_off, "megatron_freed": megatron_freed},
        "loss_after_cycles": loss_after, "patches": patches,
    }
    C.write_result(NAME, args.device, args.out, config={**spec.as_dict(), "reps": reps}, results=results,
                   headline=headline)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
