"""Shared helpers of the benchmarks: command-line options, environment capture, timing, JSON results.

Every benchmark writes ``<out>/<name>-<device>.json``::

    {"benchmark": name, "environment": {...}, "config": {...}, "results": {...raw numbers...},
     "headline": [{"metric", "value", "unit", "goal", "ok", "note"}, ...]}

``headline`` holds the ratios measured side by side in one run (and their goals); ``benchmarks/summarize.py``
turns the files into a markdown table.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results"

#: Environment for NCCL runs on machines whose NVLink multicast must stay off.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

#: Known, harmless warnings of Megatron's CPU fallbacks and torch's collectives.
_NOISE = (".*reduce_scatter_tensor.*", ".*all_gather_into_tensor.*", ".*is not a leaf Tensor.*",
          ".*requires_grad=True to a scalar.*", ".*Apex is not installed.*", ".*TransformerEngine.*",
          ".*Transformer Engine.*", ".*apex.*", ".*deprecated.*", ".*torch.distributed.*")


def parser(description: str | None) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark takes (``--device``, ``--out``, ``--seed``)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda", help="default: cuda")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results folder (default {DEFAULT_OUT})")
    p.add_argument("--seed", type=int, default=1234)
    return p


def quiet() -> None:
    """Silence known, harmless warnings (they would drown the benchmark's own output)."""
    import warnings

    for pattern in _NOISE:
        warnings.filterwarnings("ignore", message=pattern)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


def prepare_megatron(device: str) -> list[str]:
    """Apply mcore_compat's runtime patches this run needs (before megatron is imported); returns their names.

    CPU: the CPU/gloo harness plus the apex-less, TE-less and upstream-bug patches; CUDA: the latter three (as
    the self-check does). Both sides of every comparison run in the same process, so they share the patches.
    """
    from mcore_compat import patches

    return patches.apply_for_device(device)


def single_rank_megatron(device: str) -> tuple[list[str], Any]:
    """Quiet warnings, apply the patches (:func:`prepare_megatron`), join a world of one (gloo or nccl) and
    initialise model parallelism with TP = PP = 1; returns ``(patch names, parallel_state)``."""
    quiet()
    patches = prepare_megatron(device)
    import mcore_compat as mc
    from mcore_compat import launch

    launch.init_from_env(device=device)
    ps = mc.parallel_state
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    return patches, ps


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "mcore_compat", "patches"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _install_kind(path: Any) -> str:
    """How megatron-core was installed, without the machine's path: ``site-packages`` or an unpacked tree on
    ``sys.path`` (``PYTHONPATH``)."""
    if not path:
        return ""
    parts = Path(str(path)).parts
    return "site-packages" if {"site-packages", "dist-packages"} & set(parts) else "unpacked tree on sys.path"


def environment(device: str) -> dict[str, Any]:
    """Python, torch, CUDA, NCCL, megatron-core and mcore_compat versions, device name, date, host facts."""
    import torch

    import mcore_compat

    try:
        info: Any = mcore_compat.detect()
    except mcore_compat.MegatronNotFoundError:  # a benchmark of torch alone (gemm_dtype_ratio)
        info = None
    env: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "megatron_core": str(info.version) if info else "not installed",
        "megatron_core_source": str(getattr(info, "source", "")),
        "megatron_core_install": _install_kind(getattr(info, "path", None)),
        "mcore_compat": mcore_compat.__version__,
        "mcore_compat_commit": _git_commit(),
        "device": device,
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "platform": platform.platform(),
    }
    if device == "cuda" and torch.cuda.is_available():
        env["device_name"] = torch.cuda.get_device_name(0)
        env["gpu_count"] = torch.cuda.device_count()
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # pragma: no cover - builds without NCCL
            env["nccl"] = None
    else:
        env["device_name"] = env["cpu"]
    return env


def sync(device: str) -> None:
    """Wait for queued device work (``torch.cuda.synchronize`` on CUDA; nothing on CPU)."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def timed(fn: Callable[..., Any], device: str, *args: Any) -> tuple[float, Any]:
    """``(seconds, result)`` of ``fn(*args)``, device work included (synchronised before and after on CUDA)."""
    sync(device)
    t0 = time.perf_counter()
    result = fn(*args)
    sync(device)
    return time.perf_counter() - t0, result


def stats(values: Sequence[float]) -> dict[str, float]:
    """``median``, ``mean``, ``min``, ``max``, ``stdev``, ``n`` of ``values`` (raw values are kept elsewhere)."""
    vals = list(values)
    return {"median": statistics.median(vals), "mean": statistics.fmean(vals), "min": min(vals), "max": max(vals),
            "stdev": statistics.stdev(vals) if len(vals) > 1 else 0.0, "n": len(vals)}


def metric(name: str, value: float | None, unit: str = "", *, goal: str | None = None,
           note: str = "") -> dict[str, Any]:
    """One headline number. ``goal`` is ``"<= 1.05"``, ``">= 0.9"`` or ``"== 0"``; ``ok`` is evaluated here."""
    ok: bool | None = None
    if goal is not None and value is not None:
        op, _, bound = goal.partition(" ")
        b = float(bound)
        ok = {"<=": value <= b, ">=": value >= b, "==": value == b, "<": value < b, ">": value > b}[op]
    return {"metric": name, "value": value, "unit": unit, "goal": goal, "ok": ok, "note": note}


def write_result(name: str, device: str, out: Path, *, config: dict[str, Any], results: dict[str, Any],
                 headline: list[dict[str, Any]], environment_: dict[str, Any] | None = None) -> Path:
    """Write ``<out>/<name>-<device>.json`` and print the headline; returns the path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{device}.json"
    payload = {"benchmark": name, "environment": environment_ or environment(device), "config": config,
               "results": results, "headline": headline}
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"[{name}] megatron-core {payload['environment']['megatron_core']} on "
          f"{payload['environment']['device_name']}:")
    for h in headline:
        value = h["value"]
        shown = "n/a" if value is None else (f"{value:.4g}" if isinstance(value, float) else str(value))
        verdict = "" if h["ok"] is None else (" OK" if h["ok"] else " MISSED")
        goal = f" (goal {h['goal']}{verdict})" if h["goal"] else ""
        print(f"  {h['metric']}: {shown} {h['unit']}{goal}")
    print(f"  -> {path}", flush=True)
    return path


def fmt_bytes(n: float) -> str:
    """``n`` bytes as text (KiB/MiB/GiB)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def python_flags() -> list[str]:
    """Interpreter flags for child processes: ``-P`` (no script folder / cwd on ``sys.path``) where available."""
    return ["-P"] if sys.version_info >= (3, 11) else []
