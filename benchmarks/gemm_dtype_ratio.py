"""What a float64 evaluation of a model costs next to bf16, measured as the GEMMs that dominate a training step.

``check_training_step(..., finite_differences=True)`` replays the step's forward in float64 (a central difference
needs float64: docs/selfcheck.md). Whatever the code around it does, its time is bounded below by the float64
matrix products. This benchmark times square matrix products of the same shape in bf16, fp32 (TF32 off), fp32 with
TF32 and float64, interleaved (rounds of one product of each), and reports the achieved TFLOPS and the float64 /
bf16 time ratio, and from it the least time of two float64 forwards in bf16 training steps (a step is about three
forwards' work: forward, and a backward of about twice its cost), the figure the issue's cost goal of "at most one
plain step" is compared against.

    python3 benchmarks/gemm_dtype_ratio.py --device cuda            # n = 8192
    python3 benchmarks/gemm_dtype_ratio.py --device cpu --n 512     # smoke

Needs torch only (no megatron-core).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

NAME = "gemm_dtype_ratio"
#: (label, dtype name, TF32 allowed)
KINDS = (("bf16", "bfloat16", False), ("fp32", "float32", False), ("tf32", "float32", True),
         ("fp64", "float64", False))


def _time_matmul(a, b, device: str, reps: int) -> float:
    """Seconds of one product (the mean over ``reps`` back-to-back products, after one warm-up)."""
    import torch

    def products() -> None:
        for _ in range(reps):
            torch.matmul(a, b)

    torch.matmul(a, b)
    return C.timed(products, device)[0] / reps


def main(argv: list[str] | None = None) -> int:
    p = C.parser(__doc__)
    p.add_argument("--n", type=int, default=None, help="matrix size (default 8192 on cuda, 1024 on cpu)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--reps", type=int, default=None, help="products per timing (default 20 on cuda, 2 on cpu)")
    args = p.parse_args(argv)
    import torch

    n = args.n or (8192 if args.device == "cuda" else 1024)
    reps = args.reps or (20 if args.device == "cuda" else 2)
    gen = torch.Generator().manual_seed(args.seed)
    base = [torch.randn(n, n, generator=gen) for _ in range(2)]
    operands = {label: [t.to(device=args.device, dtype=getattr(torch, dtype)) for t in base]
                for label, dtype, _ in KINDS}
    seconds: dict[str, list[float]] = {label: [] for label, _, _ in KINDS}
    for _ in range(args.rounds):
        for label, _, tf32 in KINDS:
            torch.backends.cuda.matmul.allow_tf32 = tf32
            seconds[label].append(_time_matmul(*operands[label], args.device, reps))
    torch.backends.cuda.matmul.allow_tf32 = False
    median = {label: statistics.median(v) for label, v in seconds.items()}
    tflops = {label: 2 * n**3 / s / 1e12 for label, s in median.items()}
    ratio = median["fp64"] / median["bf16"]
    headline = [
        C.metric("fp64 / bf16 time of one product", ratio, "x"),
        C.metric("fp32 / bf16 time of one product", median["fp32"] / median["bf16"], "x"),
        C.metric("tf32 / bf16 time of one product", median["tf32"] / median["bf16"], "x"),
        C.metric("two float64 forwards, in bf16 steps (2 x ratio / 3)", 2 * ratio / 3, "steps", goal="<= 1",
                 note="a lower bound on the finite-difference check's time: its GEMMs alone, at the measured rate"),
    ]
    C.write_result(NAME, args.device, args.out, config={"n": n, "rounds": args.rounds, "reps": reps},
                   results={"seconds": seconds, "median_seconds": median, "tflops": tflops}, headline=headline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
