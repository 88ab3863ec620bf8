"""The weight hand-off of a Ray worker group (examples/ray_rl): one object-store object per ``mc.iter_full`` bucket
against one object per parameter, in one run.

Two trainer actors (gloo on CPU; the benchmark GPT of examples/ppo_actor at the sizes given, fp32, TP=1, DP=2) and
a rollout actor on a local Ray instance. Interleaved per round (median over ``--reps`` rounds after one untimed),
each timed from the call until the rollout actor holds the weights, and checked equal to the trainers' own:

* ``buckets``: rank 0 receives the full weights through ``mc.iter_full`` (every trainer takes part) and puts one
  ``{name: tensor}`` object per bucket into the object store; the rollout actor gets them;
* ``per_tensor``: rank 0 puts one object per parameter (what a client without ``gather_full`` does at TP=1, where
  rank 0 holds every parameter whole); the rollout actor gets them.

Reported: per_tensor / buckets time (a ratio > 1: the buckets are faster), and the bytes handed over.

    python3 benchmarks/ray_handoff.py --device cpu                  # hidden 256, 4 layers, vocab 8192
    python3 benchmarks/ray_handoff.py --device cpu --hidden 512
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import _common as C

NAME = "ray_handoff"


def main(argv: list[str] | None = None) -> int:
    p = C.parser(__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    args = p.parse_args(argv)
    C.quiet()
    import ray
    from ray_rl.group import WorkerGroup

    model = {"hidden_size": args.hidden, "ffn_hidden_size": 4 * args.hidden, "num_layers": args.layers,
             "vocab_size": args.vocab, "num_attention_heads": 8, "max_seq_len": 16}
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ":".join(p for p in sys.path if p)}})
    rows: dict[str, list[float]] = {"buckets_s": [], "per_tensor_s": []}
    try:
        group = WorkerGroup(trainers=2, model=model)
        expected = group.trainer_checksums()[0]
        for round_ in range(args.reps + 1):
            order = ("bucket_refs", "tensor_refs") if round_ % 2 == 0 else ("tensor_refs", "bucket_refs")
            for method in order:
                t0 = time.perf_counter()
                held = group.hand_off_via(method)
                took = time.perf_counter() - t0
                if held != expected:
                    raise SystemExit(f"ray_handoff: {method} handed over other bytes than the trainers hold")
                if round_:
                    rows["buckets_s" if method == "bucket_refs" else "per_tensor_s"].append(took)
        params = len(expected)
        group.shutdown()
    finally:
        ray.shutdown()
    per_round = [t / b for t, b in zip(rows["per_tensor_s"], rows["buckets_s"], strict=True)]
    nbytes = _model_bytes(model)
    results = {**{k: C.stats(v) for k, v in rows.items()}, "raw": rows, "per_tensor_over_buckets_per_round":
               per_round, "tensors": params, "bytes": nbytes, "ray": ray.__version__}
    headline = [
        C.metric("per-tensor objects / iter_full bucket objects (time)", statistics.median(per_round), "x",
                 note="from the call until the rollout actor holds the weights (checked equal), paired per round"),
        C.metric("weights handed over", nbytes / 2**20, "MiB", note=f"{params} tensors, fp32"),
    ]
    C.write_result(NAME, args.device, args.out, config={**model, "reps": args.reps, "trainers": 2},
                   results=results, headline=headline)
    return 0


def _model_bytes(model: dict[str, Any]) -> int:
    """fp32 bytes of the tiny GPT at these sizes (embedding tied with the output layer)."""
    h, f, n, v, s = (model[k] for k in ("hidden_size", "ffn_hidden_size", "num_layers", "vocab_size", "max_seq_len"))
    per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
    return 4 * (v * h + s * h + n * per_layer + 2 * h)


if __name__ == "__main__":
    sys.exit(main())
