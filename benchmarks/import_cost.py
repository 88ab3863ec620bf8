"""Import cost: the common Megatron-Core symbols through mcore_compat vs imported directly from megatron.

Every measurement is a fresh interpreter (``python -P -c ...``, this process's environment and PYTHONPATH). Variants,
interleaved (the order rotates every repetition), after one untimed warm-up round (it writes the ``.pyc``
caches where it can):

* ``raw``: ``import megatron.core`` and the same symbols from their megatron modules (``parallel_state``,
  ``DistributedDataParallel``, ``OptimizerConfig``, ``get_forward_backward_func``, ``TransformerConfig``,
  ``GPTModel``);
* ``shim``: ``import mcore_compat as mc`` and first access of ``mc.parallel_state``, ``mc.DistributedDataParallel``,
  ... (which imports the same megatron modules: the fair comparison);
* ``overhead``: the raw imports first (untimed), then the ``shim`` lines timed: what mcore_compat itself adds
  once megatron is loaded, free of the run-to-run noise of importing thousands of torch/megatron modules;
* ``bare``: ``import mcore_compat`` alone (lazy: must import neither megatron nor torch);
* ``torch``: ``import torch`` alone (the floor of every process; context for the wall times).

Timed inside the child (``perf_counter`` around the import statements; ``raw`` and ``shim`` import torch
first, untimed, so the ratio is not diluted by torch's own import) and, for context, the whole process's wall
time from the parent. Reported: medians, the ratio shim/raw (goal <= 1.05) as a ratio of medians and as the
median of the per-repetition ratios, and (raw + overhead)/raw.

    python3 benchmarks/import_cost.py --device cuda --reps 10
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

NAME = "import_cost"

_REPORT = """
t1 = time.perf_counter()
import json as _j
print("@@" + _j.dumps({"import_s": t1 - t0, "modules": len(sys.modules),
                        "megatron_imported": "megatron" in sys.modules, "torch_imported": "torch" in sys.modules}))
"""

_HEAD = """
import sys, time, warnings
warnings.simplefilter("ignore")
import torch
"""
_RAW_IMPORTS = """
import megatron.core
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import OptimizerConfig
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.models.gpt.gpt_model import GPTModel
"""
_SHIM_ACCESS = """
import mcore_compat as mc
mc.parallel_state
mc.DistributedDataParallel
mc.OptimizerConfig
mc.get_forward_backward_func
mc.TransformerConfig
mc.GPTModel
"""
_T0 = "t0 = time.perf_counter()\n"

VARIANTS: dict[str, str] = {
    "raw": _HEAD + _T0 + _RAW_IMPORTS + _REPORT,
    "shim": _HEAD + _T0 + _SHIM_ACCESS + _REPORT,
    # megatron already imported (untimed): what mcore_compat itself adds, free of the import-order noise
    "overhead": _HEAD + _RAW_IMPORTS + _T0 + _SHIM_ACCESS + _REPORT,
    "bare": "import sys, time\n" + _T0 + "import mcore_compat\n" + _REPORT,
    "torch": "import sys, time\n" + _T0 + "import torch\n" + _REPORT,
}


def _run(variant: str) -> dict[str, Any]:
    """One fresh interpreter; the child's numbers plus the parent's wall time."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *C.python_flags(), "-c", VARIANTS[variant]], env=dict(os.environ),
                          capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"import_cost: variant {variant!r} failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    return {**json.loads(lines[-1][2:]), "wall_s": wall}


def main() -> int:
    p = C.parser(__doc__)
    p.add_argument("--reps", type=int, default=10, help="timed repetitions of every variant (default 10)")
    p.add_argument("--budget", type=float, default=None,
                   help="start no repetition after this many seconds (the ones done are reported)")
    args = p.parse_args()
    names = list(VARIANTS)
    start = time.monotonic()
    for v in names:  # warm-up: .pyc caches, page cache
        _run(v)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in names}
    for r in range(args.reps):
        if args.budget is not None and r >= 2 and time.monotonic() - start > args.budget:
            print(f"  budget of {args.budget:.0f} s spent: {r} of {args.reps} repetitions done", flush=True)
            break
        for v in names[r % len(names):] + names[:r % len(names)]:
            runs[v].append(_run(v))
            print(f"  rep {r + 1}/{args.reps} {v}: {runs[v][-1]['import_s'] * 1e3:.1f} ms "
                  f"(process {runs[v][-1]['wall_s']:.2f} s)", flush=True)
    imp = {v: C.stats([x["import_s"] for x in runs[v]]) for v in names}
    wall = {v: C.stats([x["wall_s"] for x in runs[v]]) for v in names}
    ratio = imp["shim"]["median"] / imp["raw"]["median"]
    paired = C.stats([s["import_s"] / r["import_s"] for s, r in zip(runs["shim"], runs["raw"], strict=True)])
    added = (imp["raw"]["median"] + imp["overhead"]["median"]) / imp["raw"]["median"]
    wall_ratio = wall["shim"]["median"] / wall["raw"]["median"]
    bare_lazy = not any(x["megatron_imported"] or x["torch_imported"] for x in runs["bare"])
    results = {
        "import_s": imp, "process_wall_s": wall, "raw_runs": runs,
        "shim_minus_raw_ms": (imp["shim"]["median"] - imp["raw"]["median"]) * 1e3,
        "paired_ratio": paired, "overhead_ms": imp["overhead"]["median"] * 1e3,
        "bare_imports_megatron": any(x["megatron_imported"] for x in runs["bare"]),
        "bare_imports_torch": any(x["torch_imported"] for x in runs["bare"]),
        "modules_loaded": {v: runs[v][-1]["modules"] for v in names},
    }
    headline = [
        C.metric("raw megatron imports (torch preloaded)", imp["raw"]["median"] * 1e3, "ms"),
        C.metric("same symbols via mcore_compat (torch preloaded)", imp["shim"]["median"] * 1e3, "ms"),
        C.metric("import ratio mcore_compat/raw", ratio, "x", goal="<= 1.05", note="ratio of medians"),
        C.metric("import ratio mcore_compat/raw, paired", paired["median"], "x", goal="<= 1.05",
                 note=f"median of {paired['n']} per-repetition ratios, spread {paired['min']:.2f}-{paired['max']:.2f}"),
        C.metric("mcore_compat's own cost, megatron already imported", imp["overhead"]["median"] * 1e3, "ms"),
        C.metric("(raw + own cost)/raw", added, "x", goal="<= 1.05"),
        C.metric("process wall-time ratio mcore_compat/raw", wall_ratio, "x", goal="<= 1.05",
                 note="whole interpreter: python + torch + imports"),
        C.metric("bare `import mcore_compat`", imp["bare"]["median"] * 1e3, "ms"),
        C.metric("bare import is lazy (no torch, no megatron)", float(bare_lazy), "", goal="== 1"),
    ]
    config = {"reps": len(runs["raw"]), "reps_asked": args.reps, "budget_s": args.budget, "variants": VARIANTS, "python_flags": C.python_flags(),
              "order": "rotating per repetition, one warm-up round"}
    import torch  # noqa: F401  (environment() reads its version; after all children ran)

    C.write_result(NAME, args.device, args.out, config=config, results=results, headline=headline)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
