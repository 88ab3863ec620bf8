"""Where does the import time of the shim go? ``-X importtime`` of the raw and the shim imports (import_cost.py's
two snippets), in fresh processes: modules imported by only one side, the largest cumulative times, and the
time of each first symbol access through mcore_compat.

    PYTHONPATH=<megatron tree>:<repo> python3 benchmarks/import_profile.py
"""

from __future__ import annotations

import os
import subprocess
import sys

RAW = """
import torch
import megatron.core
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import OptimizerConfig
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.models.gpt.gpt_model import GPTModel
"""

SHIM = """
import time, torch
t = time.perf_counter()
import mcore_compat as mc
print(f"access import mcore_compat {1e3 * (time.perf_counter() - t):.1f} ms")
t = time.perf_counter()
mc.detect()
print(f"access detect() {1e3 * (time.perf_counter() - t):.1f} ms")
for name in ("parallel_state", "DistributedDataParallel", "OptimizerConfig", "get_forward_backward_func",
             "TransformerConfig", "GPTModel"):
    t = time.perf_counter()
    getattr(mc, name)
    print(f"access {name} {1e3 * (time.perf_counter() - t):.1f} ms")
"""


def _profile(code: str) -> tuple[dict[str, tuple[int, int]], str]:
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True,
                          env=dict(os.environ), check=True)
    mods: dict[str, tuple[int, int]] = {}
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            self_us, cum_us, name = (p.strip() for p in line.removeprefix("import time:").split("|"))
            if self_us.isdigit():
                mods[name] = (int(self_us), int(cum_us))
    return mods, proc.stdout


def main() -> int:
    _profile(RAW)  # warm the file system caches and __pycache__
    _profile(SHIM)
    raw, _ = _profile(RAW)
    shim, accesses = _profile(SHIM)
    total = {k: sum(v[0] for v in d.values()) / 1e3 for k, d in (("raw", raw), ("shim", shim))}
    print(f"modules: raw {len(raw)}, shim {len(shim)}; summed self time: raw {total['raw']:.0f} ms, "
          f"shim {total['shim']:.0f} ms")
    print(accesses.strip())
    for title, a, b in (("only in shim", shim, raw), ("only in raw", raw, shim)):
        only = sorted(((k, v) for k, v in a.items() if k not in b), key=lambda kv: -kv[1][0])
        print(f"{title}: {len(only)} modules, {sum(v[0] for _, v in only) / 1e3:.1f} ms self")
        for name, (self_us, cum_us) in only[:15]:
            print(f"  {name:<60} self {self_us / 1e3:8.1f} ms  cumulative {cum_us / 1e3:8.1f} ms")
    diffs = sorted(((k, shim[k][0] - raw[k][0]) for k in shim if k in raw), key=lambda kv: -abs(kv[1]))
    print("largest self-time differences (shim - raw) among shared modules:")
    for name, d in diffs[:10]:
        print(f"  {name:<60} {d / 1e3:+8.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
