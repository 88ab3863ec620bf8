"""Run every benchmark for one or more megatron-core releases on one device, then summarise.

On a GPU machine without megatron-core installed (wheels in a folder; no network needed)::

    python3 benchmarks/run_all.py --device cuda --wheels .whl --versions 0.19.2

unpacks ``megatron_core-0.19.2-*.whl`` (its pure-Python ``megatron/`` tree) into ``/tmp/mc-0.19.2``, runs
``import_cost``, ``step_overhead``, ``binding_memory``, ``pipeline_gather`` (2 GPUs; skipped with fewer),
``ppo_actor_overhead`` (where present), ``check_step_cost`` and ``checkpoint_cost``, each in a fresh interpreter
with ``PYTHONPATH=/tmp/mc-0.19.2:<repo root>`` (and the NCCL settings of ``_common.NCCL_ENV``), writes
``<out>/<benchmark>-cuda.json`` (``<out>/<version>/...`` when several versions are given), ``<out>/run_all.log``
and ``<out>/SUMMARY.md``. Other ways to pick megatron-core:

    python3 benchmarks/run_all.py --device cpu --sites .cache/mc --versions 0.16.1   # unpacked trees <sites>/<v>
    python3 benchmarks/run_all.py --device cpu                                      # whatever is importable now

Exit status: non-zero if a benchmark failed or timed out (a missed goal is reported, not a failure).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path
from typing import TextIO

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

HERE = Path(__file__).resolve().parent
#: The benchmarks, in run order; ``ppo_actor_overhead`` (written separately) runs too where the file exists.
BENCHMARKS = tuple(b for b in ("import_cost", "step_overhead", "binding_memory", "pipeline_gather",
                               "ppo_actor_overhead", "check_step_cost", "checkpoint_cost")
                   if (HERE / f"{b}.py").is_file())
#: Per-benchmark time limits in seconds (cuda, cpu).
TIMEOUTS = {"import_cost": (560, 300), "step_overhead": (240, 180), "binding_memory": (180, 120),
            "pipeline_gather": (300, 240), "ppo_actor_overhead": (240, 180), "check_step_cost": (300, 180),
            "checkpoint_cost": (300, 180)}


def unpack(wheel: Path, dest: Path) -> None:
    """Extract the wheel's ``megatron/`` tree (no compiled extensions) into ``dest`` (once)."""
    marker = dest / f".unpacked-{wheel.name}"
    if marker.exists():
        return
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.startswith("megatron/") and not name.endswith(".so"):
                zf.extract(name, dest)
    marker.touch()


def _gpu_count() -> int:
    try:
        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                             capture_output=True, text=True, timeout=120)
        return int(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 0


def _run(cmd: list[str], env: dict[str, str], timeout: float, log: TextIO) -> int:
    """Run ``cmd`` in its own session, echoing its output to the terminal and ``log``; returns its exit status
    (124: killed at ``timeout``, with every process it started)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=str(C.REPO), start_new_session=True)

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="", flush=True)
            log.write(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the benchmark's own session: it and the ranks it spawned
        proc.wait()
        rc = 124
        log.write(f"!! timed out after {timeout:.0f} s\n")
        print(f"!! timed out after {timeout:.0f} s", flush=True)
    reader.join(timeout=10)
    return int(rc)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--versions", nargs="*", default=[], help="megatron-core releases (with --wheels/--sites)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--wheels", type=Path, help="folder of megatron_core-<v>-*.whl, unpacked into /tmp/mc-<v>")
    src.add_argument("--sites", type=Path, help="folder of unpacked trees <sites>/<v>/megatron")
    p.add_argument("--out", type=Path, default=C.DEFAULT_OUT)
    p.add_argument("--only", nargs="+", choices=BENCHMARKS, default=list(BENCHMARKS))
    p.add_argument("--import-reps", type=int, default=10, help="repetitions of import_cost (default 10)")
    p.add_argument("--budget", type=float, default=480.0, help="start no benchmark after this many seconds")
    args = p.parse_args()
    if (args.wheels or args.sites) and not args.versions:
        p.error("--wheels/--sites need --versions")

    start = time.monotonic()
    targets: list[tuple[str, list[str]]] = []  # (label, PYTHONPATH entries to prepend)
    for v in args.versions or [""]:
        if args.wheels:
            wheels = sorted(args.wheels.glob(f"megatron_core-{v}-*.whl"))
            if not wheels:
                print(f"{v}: no megatron_core-{v}-*.whl in {args.wheels}", flush=True)
                return 2
            site = Path(f"/tmp/mc-{v}")
            unpack(wheels[0], site)
            targets.append((v, [str(site)]))
        elif args.sites:
            targets.append((v, [str((args.sites / v).resolve())]))
        else:
            targets.append((v or "installed", []))
    ngpu = _gpu_count() if args.device == "cuda" else 0
    if args.device == "cuda" and ngpu == 0:
        print("no CUDA device visible", flush=True)
        return 2

    args.out.mkdir(parents=True, exist_ok=True)
    failures: list[str] = []
    with open(args.out / "run_all.log", "a") as log:
        log.write(f"\n=== run_all {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(sys.argv[1:])}\n")
        for label, prefix in targets:
            out = args.out / label if len(targets) > 1 else args.out
            existing = [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([*prefix, *existing, str(C.REPO)]),
                       PYTHONUNBUFFERED="1")
            env.setdefault("OMP_NUM_THREADS", "4" if args.device == "cuda" else "1")
            if args.device == "cuda":
                env.update(C.NCCL_ENV)
            for name in args.only:
                if time.monotonic() - start > args.budget:
                    print(f"== {label} {name}: not run (budget of {args.budget:.0f} s spent)", flush=True)
                    failures.append(f"{label}/{name} (budget)")
                    continue
                if name == "pipeline_gather" and args.device == "cuda" and ngpu < 2:
                    print(f"== {label} {name}: skipped (needs 2 GPUs, {ngpu} visible)", flush=True)
                    continue
                cmd = [sys.executable, *C.python_flags(), str(HERE / f"{name}.py"), "--device", args.device,
                       "--out", str(out)]
                limit = TIMEOUTS[name][0 if args.device == "cuda" else 1]
                if name == "import_cost":  # stops in time: one repetition took up to 60 s on a slow GPU machine
                    cmd += ["--reps", str(args.import_reps), "--budget", str(limit - 90)]
                head = f"== {label} {name} ({time.monotonic() - start:.0f} s elapsed): {' '.join(cmd)}"
                print(head, flush=True)
                log.write(head + "\n")
                t0 = time.monotonic()
                rc = _run(cmd, env, limit, log)
                tail = f"== {label} {name}: exit {rc} in {time.monotonic() - t0:.0f} s"
                print(tail, flush=True)
                log.write(tail + "\n")
                if rc != 0:
                    failures.append(f"{label}/{name} (exit {rc})")

    import summarize

    text = summarize.markdown(summarize.load([args.out]))
    (args.out / "SUMMARY.md").write_text(text)
    print("\n" + text)
    print(f"wrote {args.out / 'SUMMARY.md'} in {time.monotonic() - start:.0f} s"
          + (f"; FAILED: {', '.join(failures)}" if failures else ""), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
