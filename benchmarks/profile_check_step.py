"""Where the time and memory of one ``check_training_step`` go (the benchmark GPT of ``check_step_cost``).

Times each phase of :class:`~mcore_compat.selfcheck.verify.StepVerifier` (synchronized; peak memory above the
phase's start), then one checked step under cProfile and under the torch profiler; prints the tables.

    python3 benchmarks/profile_check_step.py --device cuda
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C
import _gpt as G


def main(argv: list[str] | None = None) -> int:
    p = C.parser(__doc__)
    G.add_args(p)
    args = p.parse_args(argv)
    spec = G.spec_from_args(args)
    C.single_rank_megatron(args.device)
    import torch

    from mcore_compat.selfcheck import check_training_step
    from mcore_compat.selfcheck import verify as V

    cuda = args.device == "cuda"
    module, chunks, optimizer = G.train_setup(spec, args.seed, lr=1e-5)
    batches = G.make_batches(spec, args.seed, spec.microbatches)
    kw = dict(seq_length=spec.seq, micro_batch_size=spec.micro_batch)
    params = G.param_bytes(module)
    phases: dict[str, list[tuple[float, int]]] = {}

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def wrap(cls: Any, name: str) -> None:
        fn = getattr(cls, name)

        def timed(*a: Any, **k: Any) -> Any:
            sync()
            base = torch.cuda.memory_allocated() if cuda else 0
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            out = fn(*a, **k)
            sync()
            peak = (torch.cuda.max_memory_allocated() - base) if cuda else 0
            phases.setdefault(f"{cls.__name__}.{name}", []).append((time.perf_counter() - t0, peak))
            return out
        setattr(cls, name, timed)

    for name in ("__init__", "before_step", "after_backward", "after_step", "final_replicas", "checks",
                 "_compare_grads", "_check_norm", "_check_update", "_check_model_params", "_check_changed",
                 "_replicas", "_moved", "_prints", "_snapshot", "_snapshot_grads", "_entering_step",
                 "_scale_check", "_part_snapshot", "_verify_part", "_verify_update", "_after_streamed"):
        wrap(V.StepVerifier, name)
    from mcore_compat.selfcheck import reference as R
    wrap(R.PlainReference, "__init__")
    wrap(R.PlainReference, "run")

    def check() -> Any:
        return check_training_step(chunks, optimizer, G.forward_step, iter(batches),
                                   num_microbatches=spec.microbatches, reference=True, **kw)

    for _ in range(2):
        G.train_step(spec, chunks, optimizer, batches)
    check()
    sync()
    plain = []
    for _ in range(5):
        t0 = time.perf_counter()
        G.train_step(spec, chunks, optimizer, batches)
        sync()
        plain.append(time.perf_counter() - t0)
    phases.clear()
    total = []
    for _ in range(3):
        for opt in [optimizer, *getattr(optimizer, "chained_optimizers", [])]:  # a scheduler's new lr each step:
            for group in opt.param_groups:  # the fused kernels must not be compiled again for it
                group["lr"] *= 0.9
        t0 = time.perf_counter()
        rep = check()
        sync()
        total.append(time.perf_counter() - t0)
    from mcore_compat.selfcheck import fused
    try:
        from torch._dynamo.utils import counters
        compiled = dict(counters["stats"])
    except Exception:
        compiled = {}
    print(f"fused kernels: {'on' if fused.enabled(torch.device(args.device)) else 'off'}; compile failures "
          f"{fused._FAILED}; dynamo stats {compiled}")
    print(f"param bytes {params / 2**20:.1f} MiB; plain step median {sorted(plain)[2] * 1e3:.1f} ms; check "
          f"{[round(x * 1e3, 1) for x in total]} ms; {rep.summary_line()}")
    for k, v in phases.items():
        ts = sorted(x[0] for x in v)
        pk = max(x[1] for x in v)
        print(f"  {k:42s} n={len(v):2d} median {ts[len(ts) // 2] * 1e3:8.1f} ms  peak+ {pk / params:5.2f}x param")
    pr = cProfile.Profile()
    pr.enable()
    check()
    sync()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    print(s.getvalue()[:6000])
    if cuda:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            check()
            sync()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=50))
        print(prof.key_averages().table(sort_by="count", row_limit=15, max_name_column_width=50))
    return 0


if __name__ == "__main__":
    sys.exit(main())
