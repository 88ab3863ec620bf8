"""Offload/reload on CUDA, per release: twin training bit for bit, device memory freed, host buffers reused.

For each release given, a fresh interpreter with that release's unpacked wheel first on ``sys.path`` runs, on one
GPU: two identical copies of the self-check's GPT (bf16, fp32 main params, the distributed optimizer on and off),
trained side by side for 6 steps; copy A goes through ``mc.offload``/``mc.reload`` between steps (full, then grads
+ optimizer state only, alternating), copy B never. Checked after every step: A's params equal B's bit for bit,
``torch.cuda.memory_allocated`` dropped by at least the offloaded bytes of the full offloads, and the host
buffers were allocated once (``host_bytes`` constant after the first cycle).

    python3 scripts/gpu_offload_check.py --wheels .whl --out results/ 0.4.0 0.6.0 0.12.3 0.19.2

Run on 1 H200 on 2026-12-01: PASS on all four (matrix/gpu-runs/2026-12-01-offload.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, sys
from mcore_compat import patches
patches.apply_for_device("cuda")
import torch
import mcore_compat as mc
from mcore_compat import launch, training
from mcore_compat.selfcheck import SelfCheckOptions, models

launch.init_from_env(device="cuda")
out = []
for distopt in (True, False):
    opts = SelfCheckOptions(nproc=1, tp=1, pp=1, dp=1, device="cuda", model="gpt", dtype="bf16",
                            distributed_optimizer=distopt, tie_embeddings=False, lr=1e-4).resolved()
    twins = []
    for _ in range(2):
        models.init_parallel(opts)
        modules, _ = models.build_chunks(opts)
        chunks = training.wrap_ddp(modules, ddp_config=models.ddp_config(opts))
        opt = training.get_megatron_optimizer(models.optim_config(opts), chunks)
        training.install_training_hooks(chunks, opt)
        twins.append((chunks, opt))
    batches = models.make_batches(opts, 0)
    fwd = models.forward_step(opts)

    def step(chunks, opt):
        training.zero_grad_buffer(chunks, opt)
        training.forward_backward(fwd, iter(batches), chunks, models.MICROBATCHES, seq_length=models.SEQ,
                                  micro_batch_size=models.MICRO_BATCH)
        training.optimizer_step(opt)

    rec = {"distopt": distopt, "equal": [], "freed": [], "moved": [], "host_bytes": []}
    initial = [p.detach().clone() for p in twins[0][0][0].parameters()]
    for i in range(6):
        (a, oa), (b, ob) = twins
        step(a, oa)
        step(b, ob)
        full = i % 2 == 0
        torch.cuda.synchronize()
        m0 = torch.cuda.memory_allocated()
        moved = mc.offload(a, oa, params=full)
        torch.cuda.synchronize()
        rec["freed"].append(m0 - torch.cuda.memory_allocated())
        rec["moved"].append(moved.total)
        mc.reload(a, oa, params=full)
        rec["host_bytes"].append(mc.lifecycle.host_bytes())
        rec["equal"].append(all(torch.equal(p, q) for p, q in zip(a[0].parameters(), b[0].parameters())))
    rec["trained"] = any(not torch.equal(p, q) for p, q in zip(initial, twins[0][0][0].parameters()))
    out.append(rec)
    for chunks, _ in twins:
        models.release_chunks(chunks)
json.dump(out, open(sys.argv[1], "w"))
"""


def _unpack(wheels: Path, version: str, dest: Path) -> Path:
    [wheel] = sorted(wheels.glob(f"megatron_core-{version}-*.whl"))
    target = dest / version
    if not (target / "megatron").is_dir():
        with zipfile.ZipFile(wheel) as z:
            z.extractall(target, [n for n in z.namelist() if n.startswith("megatron/")])
    return target


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wheels", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("versions", nargs="+")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for version in args.versions:
        site = _unpack(args.wheels, version, Path("/tmp/mc-offload"))
        path = args.out / f"offload-{version}.json"
        env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": "29533", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
        proc = subprocess.run([sys.executable, "-P", "-c", _CHILD, str(path)], env=env, capture_output=True,
                              text=True, timeout=600)
        if proc.returncode != 0 or not path.is_file():
            print(f"{version}: FAILED (exit {proc.returncode})\n{proc.stderr[-3000:]}")
            failed += 1
            continue
        for rec in json.loads(path.read_text()):
            ok = all(rec["equal"]) and rec["trained"] and len(set(rec["host_bytes"][1:])) <= 1 and all(
                f >= m for f, m, full in zip(rec["freed"], rec["moved"], (True, False) * 3, strict=True) if full)
            failed += not ok
            print(f"{version} distopt={rec['distopt']}: {'PASS' if ok else 'FAIL'} equal={rec['equal']} "
                  f"freed/moved={[round(f / max(m, 1), 3) for f, m in zip(rec['freed'], rec['moved'], strict=True)]} "
                  f"host_bytes={rec['host_bytes']}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
