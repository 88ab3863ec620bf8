"""Turn benchmark results (``benchmarks/results/**/*.json``) into one markdown table for the README.

    python3 benchmarks/summarize.py                          # reads benchmarks/results, prints markdown
    python3 benchmarks/summarize.py results/ -o SUMMARY.md

Needs only the standard library (no torch, no megatron).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

DEFAULT = Path(__file__).resolve().parent / "results"
ORDER = ("import_cost", "step_overhead", "binding_memory", "pipeline_gather")


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _value(h: dict[str, Any]) -> str:
    v, unit = h.get("value"), h.get("unit") or ""
    if v is None:
        return "n/a"
    if unit == "B":
        return _fmt_bytes(float(v))
    if h.get("goal") == "== 1" and unit == "":  # yes/no checks
        return "yes" if v else "no"
    if isinstance(v, float):
        text = f"{v:.3f}" if unit == "x" else f"{v:.4g}"
    else:
        text = str(v)
    return f"{text} {unit}".strip()


def _goal(h: dict[str, Any]) -> str:
    goal = h.get("goal")
    if not goal:
        return ""
    if h.get("goal") == "== 1" and (h.get("unit") or "") == "":
        goal = "yes"
    elif (h.get("unit") or "") == "B" and goal.split()[-1] == "0":
        goal = f"{goal.split()[0]} 0 B"
    verdict = {True: "met", False: "**missed**", None: ""}[h.get("ok")]
    return f"{goal} ({verdict})" if verdict else goal


def load(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """Every result file under ``paths`` (files or folders, searched recursively), in a stable order."""
    files: list[Path] = []
    for p in paths:
        files += sorted(p.rglob("*.json")) if p.is_dir() else [p]
    out = []
    for f in files:
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and "benchmark" in data and "headline" in data:
            data["_file"] = str(f)
            out.append(data)

    def key(d: dict[str, Any]) -> tuple[Any, ...]:
        env = d.get("environment", {})
        b = d["benchmark"]
        return (ORDER.index(b) if b in ORDER else len(ORDER), b, env.get("device", ""),
                env.get("megatron_core", ""))

    return sorted(out, key=key)


def markdown(results: list[dict[str, Any]], *, goals_only: bool = False) -> str:
    """The table (one row per headline metric; ``goals_only``: only those with a goal) and the environments."""
    if not results:
        return "_no benchmark results found_\n"
    lines = ["| benchmark | metric | value | goal | megatron-core | device |", "|---|---|---|---|---|---|"]
    cell = lambda text: str(text).replace("|", "\\|")  # noqa: E731
    envs: dict[tuple[str, ...], dict[str, Any]] = {}
    for r in results:
        env = r.get("environment", {})
        device = env.get("device_name") or env.get("device", "")
        for h in r["headline"]:
            if goals_only and not h.get("goal"):
                continue
            lines.append(f"| `{r['benchmark']}` | {cell(h['metric'])} | {cell(_value(h))} | {cell(_goal(h))} | "
                         f"{env.get('megatron_core', '?')} | {cell(device)} |")
        ekey = tuple(str(env.get(k)) for k in ("device_name", "python", "torch", "cuda", "megatron_core"))
        envs.setdefault(ekey, env)
    lines.append("")
    lines.append("Measured with: " + "; ".join(
        f"{e.get('device_name')} ({e.get('gpu_count', 0) or 'no'} GPU), Python {e.get('python')}, torch "
        f"{e.get('torch')}, CUDA {e.get('cuda')}, megatron-core {e.get('megatron_core')}, mcore_compat "
        f"{e.get('mcore_compat')} ({e.get('mcore_compat_commit')}), {e.get('date')}" for e in envs.values()) + ".")
    lines.append("Ratios are measured side by side in one run (interleaved); raw numbers are in the JSON files "
                 "(`benchmarks/README.md`).")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="*", type=Path, default=[DEFAULT], help=f"files or folders (default {DEFAULT})")
    p.add_argument("--goals-only", action="store_true", help="only the metrics that have a goal (ratios, checks)")
    p.add_argument("-o", "--output", type=Path, help="write the markdown here (default: stdout)")
    args = p.parse_args()
    text = markdown(load(args.paths), goals_only=args.goals_only)
    if args.output:
        args.output.write_text(text)
        print(f"wrote {args.output}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
