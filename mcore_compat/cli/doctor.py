"""``mcore-compat doctor``: what is installed and what each fact, symbol and patch resolved to."""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import json
import platform
import sys
from typing import Any

from ..errors import McoreCompatError

__all__ = ["add_parser", "collect", "render"]


def add_parser(sub: Any) -> None:
    """Register the ``doctor`` subcommand."""
    p = sub.add_parser("doctor", help="show Python/torch/megatron-core/apex/TE, support status, facts "
                                      "(capabilities and valued facts), symbols and applicable patches")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--probe", action="store_true",
                   help="also import megatron.core and check every fact row against the real module "
                        "(applies the CPU patches first when no GPU is present)")
    p.add_argument("--expect-version", metavar="V",
                   help="exit with status 1 unless the detected megatron-core is exactly version V")
    p.set_defaults(func=run)


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return None


def _package(module: str, *dists: str) -> dict[str, Any]:
    present = importlib.util.find_spec(module) is not None
    return {"present": present, "version": _dist_version(*dists) if present else None}


def _torch() -> dict[str, Any]:
    try:
        import torch
    except ImportError as exc:
        return {"present": False, "error": str(exc)}
    cuda = torch.cuda.is_available()
    return {
        "present": True,
        "version": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": cuda,
        "device_count": torch.cuda.device_count() if cuda else 0,
        "distributed": torch.distributed.is_available(),
    }


def collect(probe: bool = False) -> dict[str, Any]:
    """Gather the doctor report as a JSON-serialisable dict."""
    from .. import __version__
    from ..detect import detect
    from ..errors import MegatronNotFoundError

    report: dict[str, Any] = {
        "mcore_compat": __version__,
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "torch": _torch(),
        "apex": _package("apex", "apex"),
        "transformer_engine": _package("transformer_engine", "transformer-engine", "transformer_engine"),
    }
    try:
        info = detect()
    except MegatronNotFoundError as exc:
        report["megatron_core"] = {"found": False, "error": str(exc)}
        return report
    report["megatron_core"] = {
        "found": True,
        "version": str(info.version),
        "source": info.source,
        "path": str(info.path),
        "distribution": info.distribution,
        "metadata_version": str(info.metadata_version) if info.metadata_version else None,
        "checkout": info.checkout,
        "warnings": list(info.warnings),
    }
    report["support"] = _support(info.version)
    report["facts"] = _facts(info.version, probe)
    report["symbols"] = _symbols(info.version)
    report["patches"] = _patches(info.version)
    return report


def _support(version: Any) -> dict[str, Any]:
    try:
        from .. import support
    except ImportError as exc:  # pragma: no cover
        return {"error": f"support matrix unavailable: {exc}"}
    status = support.status(version)
    return status.as_dict() if hasattr(status, "as_dict") else dict(vars(status))


def _facts(version: Any, probe: bool) -> list[dict[str, Any]]:
    """Every fact of the table: its value for ``version`` and, with ``probe``, what the installed code says."""
    from ..capabilities import facts

    rows = []
    if probe:
        problem = _prepare_import()
        if problem:
            rows.append({"name": "(patches)", "flag": False, "value": None, "range": "", "source": "",
                         "probe": f"error: {problem}", "description": "the patches applied before the probe"})
    for entry in facts():
        row: dict[str, Any] = {"name": entry.name, "flag": entry.is_flag, "range": entry.range(),
                               "source": entry.files(), "description": entry.description}
        try:
            row["value"] = entry.value_for(version)
        except McoreCompatError as exc:
            row["value"] = f"error: {exc}"
        if probe:
            try:
                row["probe"] = entry.probe()
                row["agrees"] = row["probe"] == row["value"]
            except Exception as exc:  # report, don't crash the doctor
                row["probe"] = f"error: {type(exc).__name__}: {exc}"
        rows.append(row)
    return rows


def _prepare_import() -> str | None:
    """Apply the patches a run on this device needs; what went wrong, if anything (the probe goes on)."""
    import torch

    from .. import patches
    from ..errors import PatchError

    try:
        patches.apply_for_device("cuda" if torch.cuda.is_available() else "cpu")
    except PatchError as exc:
        return str(exc)
    return None


def _symbols(version: Any) -> list[dict[str, Any]]:
    from .._symbol_table import SYMBOLS

    rows = []
    for name, sym in sorted(SYMBOLS.items()):
        loc = sym.location_for(version)
        rows.append({"name": name, "location": loc.dotted() if loc else None,
                     "available_in": sym.available_in()})
    return rows


def _patches(version: Any) -> list[dict[str, Any]]:
    """Every patch: its range, whether it is needed here, whether the installed Megatron code is what it was
    written for (``refused``: why not), and whether it is applied in this process (``skipped``: undone when its
    target module was imported and found changed)."""
    from .. import patches

    applied, skipped = set(patches.applied()), patches.skipped()
    rows = []
    for p in patches.list_patches():
        applies = p.applies_to(version)
        needed: bool | None = None
        if applies and p.needed_when is not None:
            try:
                needed = bool(p.needed_when())
            except Exception:
                needed = None
        refused = None
        if applies:
            try:
                refused = patches.refusal(p.name, version)
            except Exception as exc:  # report, don't crash the doctor
                refused = f"the check failed: {type(exc).__name__}: {exc}"
        rows.append({"name": p.name, "purposes": list(p.purposes), "applies": applies, "versions": p.versions,
                     "needed_here": needed if applies else False, "targets": list(p.targets), "refused": refused,
                     "applied": p.name in applied, "skipped": skipped.get(p.name), "description": p.description})
    return rows


def _patch_state(p: dict[str, Any]) -> str:
    if p["applied"]:
        return "APPLIED"
    if p["skipped"]:
        return f"SKIPPED, not applied ({p['skipped']})"
    if p["refused"]:
        return f"REFUSED ({p['refused']})"
    return "not applied"


def render(report: dict[str, Any]) -> str:
    """The human-readable table form of :func:`collect`'s report."""
    out: list[str] = []
    t = report["torch"]
    out.append(f"mcore-compat       {report['mcore_compat']}")
    out.append(f"python             {report['python']['version']} ({report['python']['executable']})")
    if t.get("present"):
        cuda = f"CUDA {t['cuda_build']}, {t['device_count']} GPU(s)" if t["cuda_available"] else (
            f"CUDA build {t['cuda_build']}, no GPU" if t["cuda_build"] else "CPU build")
        out.append(f"torch              {t['version']} ({cuda})")
    else:
        out.append(f"torch              MISSING ({t.get('error')})")
    for key, label in (("apex", "apex"), ("transformer_engine", "TransformerEngine")):
        pkg = report[key]
        out.append(f"{label:<18} {pkg['version'] or 'present' if pkg['present'] else 'not installed'}")
    m = report["megatron_core"]
    if not m["found"]:
        out.append(f"megatron-core      NOT FOUND: {m['error']}")
        return "\n".join(out)
    where = "source checkout (no metadata)" if m["checkout"] else f"distribution {m['distribution']}"
    out.append(f"megatron-core      {m['version']} (from {m['source']}; {where})")
    out.append(f"  imported from    {m['path']}")
    for w in m["warnings"]:
        out.append(f"  WARNING          {w}")
    s = report.get("support", {})
    if s:
        out.append(f"support            {s.get('summary', s)}")
    out.append("")
    rows = report.get("facts", [])
    out.append("facts (table for this version" + (", probe of the real module)" if any(
        "probe" in c for c in rows) else ")"))
    for c in rows:
        probe = ""
        if "agrees" in c:
            probe = "  probe=" + ("agrees" if c["agrees"] else f"DISAGREES ({c['probe']!r})")
        elif "probe" in c:
            probe = f"  probe={c['probe']}"
        if c["flag"]:
            out.append(f"  {'yes' if c['value'] is True else 'no ':<4} {c['name']:<40} {c['range']}{probe}")
        else:
            out.append(f"  {'=':<4} {c['name']:<40} {c['value']!r}{probe}")
    out.append("")
    out.append("import surface (mcore_compat.<name>)")
    for s_ in report["symbols"]:
        out.append(f"  {s_['name']:<32} {s_['location'] or 'unavailable (exists in ' + s_['available_in'] + ')'}")
    out.append("")
    out.append("patches for this version (applied only on request; targets checked against their fingerprints)")
    for p in report["patches"]:
        if p["applies"]:
            need = {True: "needed here", False: "not needed here", None: "when asked"}[p["needed_here"]]
            out.append(f"  {p['name']:<22} [{', '.join(p['purposes'])}] {need}, {_patch_state(p)}: "
                       f"{p['description']}")
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    """Run ``doctor``; exit status 0, or 1 if megatron-core is missing or not the expected version."""
    report = collect(probe=args.probe)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(render(report))
    m = report["megatron_core"]
    if not m["found"]:
        return 1
    if args.expect_version and m["version"] != args.expect_version:
        print(f"error: expected megatron-core {args.expect_version}, but {m['version']} is imported from "
              f"{m['path']}", file=sys.stderr)
        return 1
    if args.probe and any(c.get("agrees") is False for c in report.get("facts", [])):
        print("error: some fact rows disagree with the installed module (see DISAGREES above)", file=sys.stderr)
        return 1
    return 0
