"""Mirror import cost: the same ``from megatron.core.<path> import <name>`` lines raw and through the mirror
(``from mcore_compat.core.<path> import <name>``).

Every measurement is a fresh interpreter (``python -P -c ...``, this process's environment and PYTHONPATH).
Variants, interleaved (the order rotates every repetition), after one untimed warm-up round (children may write
``.pyc`` caches, as an installed package has them, whatever ``PYTHONDONTWRITEBYTECODE`` says):

* ``raw``: the import lines as a client writes them (:data:`NAMES`, those the installed release has at that
  path: the data says so, nothing is imported to choose them);
* ``mirror``: the same lines with ``megatron.core`` replaced by ``mcore_compat.core`` (this imports the same
  Megatron modules, plus mcore_compat and its surface data: the fair comparison);
* ``overhead``: the raw lines first (untimed), then the mirror lines timed: what the mirror itself adds once
  Megatron is loaded, free of the run-to-run noise of importing thousands of modules;
* ``lazy``: ``import mcore_compat.core.<path>`` for every path of the lines, no name used: must import neither
  Megatron nor torch.

Timed inside the child (``perf_counter`` around the import lines; ``raw``, ``mirror`` and ``overhead`` import
torch first, untimed). Reported: medians, the ratio mirror/raw (goal <= 1.05) as a ratio of medians and as the
median of the per-repetition (paired) ratios, and (raw + overhead)/raw::

    PYTHONPATH=.cache/mc/0.16.1:. OMP_NUM_THREADS=1 .cache/base-py311/bin/python -P benchmarks/mirror_import.py \\
        --device cpu --reps 10
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

NAME = "mirror_import"

#: What clients import (verl, ms-swift, mbridge, Megatron-Bridge use these), as (Megatron path, name).
NAMES: tuple[tuple[str, str], ...] = (
    ("megatron.core", "parallel_state"),
    ("megatron.core", "mpu"),
    ("megatron.core", "tensor_parallel"),
    ("megatron.core.parallel_state", "get_tensor_model_parallel_rank"),
    ("megatron.core.transformer.transformer_config", "TransformerConfig"),
    ("megatron.core.transformer.module", "MegatronModule"),
    ("megatron.core.transformer.enums", "AttnMaskType"),
    ("megatron.core.optimizer", "OptimizerConfig"),
    ("megatron.core.optimizer", "get_megatron_optimizer"),
    ("megatron.core.distributed", "DistributedDataParallel"),
    ("megatron.core.distributed", "DistributedDataParallelConfig"),
    ("megatron.core.distributed", "finalize_model_grads"),
    ("megatron.core.pipeline_parallel", "get_forward_backward_func"),
    ("megatron.core.models.gpt.gpt_model", "GPTModel"),
    ("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec"),
    ("megatron.core.utils", "get_model_config"),
    ("megatron.core.enums", "ModelType"),
    ("megatron.core.tensor_parallel.layers", "ColumnParallelLinear"),
    ("megatron.core.dist_checkpointing.mapping", "ShardedTensor"),
    ("megatron.core.process_groups_config", "ProcessGroupCollection"),
)

_REPORT = """
t1 = time.perf_counter()
import json as _j
print("@@" + _j.dumps({"import_s": t1 - t0, "modules": len(sys.modules),
                        "megatron_imported": "megatron.core" in sys.modules, "torch_imported": "torch" in sys.modules}))
"""
_HEAD = "import sys, time, warnings\nwarnings.simplefilter('ignore')\n"
_T0 = "t0 = time.perf_counter()\n"


def names_at_path(release: str) -> list[tuple[str, str]]:
    """The :data:`NAMES` the release has at that path (from the data; nothing imported)."""
    from mcore_compat import surface

    return [(m, n) for m, n in NAMES if (w := surface.locate(m, n, release)) is not None and not w.moved]


def variants(names: list[tuple[str, str]]) -> dict[str, str]:
    raw = "".join(f"from {m} import {n}\n" for m, n in names)
    mirror = raw.replace("from megatron.core", "from mcore_compat.core")
    lazy = "".join(f"import {m.replace('megatron.core', 'mcore_compat.core', 1)}\n" for m in dict.fromkeys(m for m, _ in names))
    return {
        "raw": _HEAD + "import torch\n" + _T0 + raw + _REPORT,
        "mirror": _HEAD + "import torch\n" + _T0 + mirror + _REPORT,
        "overhead": _HEAD + "import torch\n" + raw + _T0 + mirror + _REPORT,
        "lazy": _HEAD + _T0 + lazy + _REPORT,
    }


def _run(code: str) -> dict[str, Any]:
    """One fresh interpreter; the child's numbers plus the parent's wall time."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # .pyc caches, as installed
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *C.python_flags(), "-c", code], env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    wall = time.perf_counter() - t0
    lines = [line for line in proc.stdout.splitlines() if line.startswith("@@")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"child failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return {**json.loads(lines[-1][2:]), "wall_s": wall}


def main() -> int:
    p = C.parser(__doc__)
    p.add_argument("--reps", type=int, default=10, help="timed repetitions of every variant (default 10)")
    args = p.parse_args()
    from mcore_compat._facts.mirror import installed_release

    release = installed_release()
    names = names_at_path(release)
    codes = variants(names)
    order = list(codes)
    for v in order:  # warm-up: .pyc caches, page cache
        _run(codes[v])
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in order}
    for r in range(args.reps):
        for v in order[r % len(order):] + order[:r % len(order)]:
            runs[v].append(_run(codes[v]))
            print(f"  rep {r + 1}/{args.reps} {v}: {runs[v][-1]['import_s'] * 1e3:.1f} ms", flush=True)
    imp = {v: C.stats([x["import_s"] for x in runs[v]]) for v in order}
    ratio = imp["mirror"]["median"] / imp["raw"]["median"]
    paired = C.stats([m["import_s"] / r["import_s"] for m, r in zip(runs["mirror"], runs["raw"], strict=True)])
    added = (imp["raw"]["median"] + imp["overhead"]["median"]) / imp["raw"]["median"]
    lazy_ok = not any(x["megatron_imported"] or x["torch_imported"] for x in runs["lazy"])
    results = {"import_s": imp, "runs": runs, "paired_ratio": paired, "overhead_ms": imp["overhead"]["median"] * 1e3,
               "names": [f"{m}.{n}" for m, n in names], "modules_loaded": {v: runs[v][-1]["modules"] for v in order}}
    headline = [
        C.metric(f"raw: {len(names)} names from megatron.core (torch preloaded)", imp["raw"]["median"] * 1e3, "ms"),
        C.metric("same lines through mcore_compat.core", imp["mirror"]["median"] * 1e3, "ms"),
        C.metric("import ratio mirror/raw", ratio, "x", goal="<= 1.05", note="ratio of medians"),
        C.metric("import ratio mirror/raw, paired", paired["median"], "x", goal="<= 1.05",
                 note=f"median of {paired['n']} per-repetition ratios, spread {paired['min']:.2f}-{paired['max']:.2f}"),
        C.metric("the mirror's own cost, Megatron already imported", imp["overhead"]["median"] * 1e3, "ms"),
        C.metric("(raw + own cost)/raw", added, "x", goal="<= 1.05"),
        C.metric("importing the mirror modules alone is lazy (no torch, no megatron.core)", float(lazy_ok), "",
                 goal="== 1"),
    ]
    config = {"reps": args.reps, "release": release, "variants": codes, "python_flags": C.python_flags(),
              "order": "rotating per repetition, one warm-up round"}
    import torch  # noqa: F401  (environment() reads its version; after all children ran)

    C.write_result(NAME, args.device, args.out, config=config, results=results, headline=headline)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
