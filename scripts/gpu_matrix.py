"""Run the self-check on CUDA/NCCL for a list of megatron-core releases and write one JSON per release.

Reproduces the GPU column of matrix/ from one command on a GPU machine (no package registry needed):

    python3 scripts/gpu_matrix.py --wheels .whl --out results/ 0.16.1 0.19.2

Each release's wheel is unpacked (its pure-Python ``megatron/`` tree; cp311 wheels work on other Pythons) into a
private directory that is put first on ``sys.path`` of a fresh subprocess. Configurations per release, all bf16
with weight decay and clipping: 1 GPU, distributed optimizer on and off, at lr 1e-2 and 1e-6; if two GPUs are
visible, also the self-check's standard sweep for 2 ranks (``standard_sweep(2)``). Every configuration runs two
offload/reload cycles between its steps (``offload_cycles=2``). Then ``python3 scripts/record_gpu_results.py
results/`` on the development machine writes them into matrix/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, sys
from mcore_compat.selfcheck import SelfCheckOptions, run_sweep, standard_sweep
ngpu, out, timeout = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
common = dict(dtype="bf16", model="gpt", steps=3, device="cuda", bind=True, offload_cycles=2)
one = [SelfCheckOptions(distributed_optimizer=d, lr=lr, **common) for lr in (1e-2, 1e-6) for d in (True, False)]
results = []
for nproc in (1, 2):
    if nproc > ngpu:
        continue
    configs = one if nproc == 1 else standard_sweep(2, **common)
    for c, r in zip(configs, run_sweep(configs, nproc, device="cuda", timeout=timeout), strict=True):
        results.append({"nproc": nproc, "config": {k: v for k, v in c.__dict__.items() if v is not None},
                        "label": c.label(), "ok": r.ok, "summary": r.summary_line(), "error": r.error,
                        "environment": r.environment,
                        "checks": [{"name": k.name, "status": k.status, "detail": k.detail} for k in r.checks]})
    json.dump(results, open(out, "w"), indent=2, default=str)  # after each sweep: a later hang keeps these
json.dump(results, open(out, "w"), indent=2, default=str)
print("\n".join(f"  {x['nproc']} GPU {x['label']} lr={x['config'].get('lr')}: {x['summary']}" for x in results))
"""


def _unpack(wheel: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.startswith("megatron/") and not name.endswith(".so"):
                zf.extract(name, dest)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("versions", nargs="+")
    parser.add_argument("--wheels", type=Path, required=True, help="folder of megatron_core-*.whl")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget", type=float, default=540.0, help="start no release after this many seconds")
    parser.add_argument("--timeout", type=float, default=200.0, help="seconds per sweep before hung ranks are stopped")
    args = parser.parse_args()
    import torch

    ngpu = torch.cuda.device_count()
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    status = 0
    for v in args.versions:
        if time.monotonic() - start > args.budget:
            print(f"{v}: not run (time budget spent)", flush=True)
            continue
        wheels = sorted(args.wheels.glob(f"megatron_core-{v}-*.whl"))
        if not wheels:
            print(f"{v}: no wheel in {args.wheels}", flush=True)
            status = 1
            continue
        site = Path(f"/tmp/mc-{v}")
        _unpack(wheels[0], site)
        env = dict(os.environ, PYTHONPATH=f"{site}:{ROOT}", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="4",
                   NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
        t0 = time.monotonic()
        out = args.out / f"gpu-{v}.json"
        proc = subprocess.run([sys.executable, "-W", "ignore", "-P", "-c", _CHILD, str(ngpu), str(out), str(args.timeout)], env=env,
                              capture_output=True, text=True, timeout=560)
        took = time.monotonic() - t0
        print(f"{v}: exit {proc.returncode} in {took:.0f}s\n{proc.stdout[-3000:]}", flush=True)
        failed = proc.returncode != 0 or not out.is_file() or not all(r["ok"] for r in json.loads(out.read_text()))
        if failed:
            print(proc.stderr[-8000:], flush=True)
            status = 1
    meta = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "torch": torch.__version__,
            "cuda": torch.version.cuda, "gpus": ngpu, "device": torch.cuda.get_device_name(0) if ngpu else None,
            "python": sys.version.split()[0],
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if ngpu else None}
    (args.out / "environment.json").write_text(json.dumps(meta, indent=2))
    from record_gpu_results import load_bundle  # scripts/ is sys.path[0]

    # One file holding everything: easy to fetch back from the GPU machine.
    (args.out / "gpu-matrix.json").write_text(json.dumps(load_bundle(args.out), indent=1))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
