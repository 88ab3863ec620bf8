"""``mcore-compat doctor``: is this installation usable (the release found, its support status, the environment
against its limits, with the pip command that fixes it), and what each fact, symbol and patch resolved to."""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import json
import platform
import sys
from typing import Any

from ..errors import McoreCompatError
from .doctor_text import render

__all__ = ["add_parser", "collect", "render"]


def add_parser(sub: Any) -> None:
    """Register the ``doctor`` subcommand."""
    p = sub.add_parser(
        "doctor", help="check the installation: megatron-core, its support status, the environment against the "
                       "release's limits (with the pip command that fixes it), the supported releases",
        description="Checks the installation: which megatron-core is imported and from where, whether it is a "
                    "supported release, whether Python/torch/numpy/setuptools fit that release's limits "
                    "(matrix/versions.toml; a misfit prints the exact pip command that fixes it), and lists the "
                    "supported releases. Exit status 0 only if the installation is usable: 1 if megatron-core is "
                    "missing, its version cannot be told, it is older than every supported release, untested "
                    "(unless --allow-untested), or the environment breaks its limits. To switch releases: "
                    "`pip install megatron-core==<V>`, then run doctor again.")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also list every fact, symbol and patch for the installed release")
    p.add_argument("--json", action="store_true", help="print the whole report (every table) as JSON")
    p.add_argument("--allow-untested", action="store_true",
                   help="accept a megatron-core the support matrix does not list (e.g. newer than the newest "
                        "supported release): exit 0 if everything else is fine")
    p.add_argument("--probe", action="store_true",
                   help="also import megatron.core and check every fact row against the real module "
                        "(applies the CPU patches first when no GPU is present; lists the tables as --verbose)")
    p.add_argument("--for", dest="for_release", metavar="V",
                   help="before installing release V: which Python it runs on, whether this one is it (else where "
                        "one was found: PATH, pyenv, uv), and the exact commands (a new venv where needed; torch's "
                        "CPU build without a GPU); nothing is installed or imported. Exit 1 if no Python for V "
                        "was found (default: none, the report of this install)")
    p.add_argument("--expect-version", metavar="V",
                   help="exit with status 1 unless the detected megatron-core is exactly version V (default: any "
                        "supported release passes)")
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


def collect(probe: bool = False, allow_untested: bool = False) -> dict[str, Any]:
    """Gather the doctor report as a JSON-serialisable dict.

    Args:
        probe: also import megatron.core and check every fact against the real module.
        allow_untested: a release the support matrix does not list is acceptable (see
            :func:`mcore_compat.preflight.preflight`).

    Returns:
        The report; ``report["verdict"]["ok"]`` says whether the installation is usable, ``report["verdict"]["fix"]``
        how to repair it.
    """
    from .. import __version__
    from ..preflight import preflight

    report: dict[str, Any] = {
        "mcore_compat": __version__,
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "torch": _torch(),
        "apex": _package("apex", "apex"),
        "transformer_engine": _package("transformer_engine", "transformer-engine", "transformer_engine"),
    }
    check = preflight(allow_untested=allow_untested)
    report["releases"] = _releases()
    report["verdict"] = check.as_dict()
    info = check.info
    if info is None:
        report["megatron_core"] = {"found": False, "version_unknown": check.version_unknown,
                                   "path": str(check.found_at) if check.found_at else None,
                                   "error": check.problems[0]}
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
    report["support"] = check.status.as_dict() if check.status is not None else {}
    report["environment"] = check.fit.as_dict() if check.fit is not None else None
    report["facts"] = _facts(info.version, probe)
    report["symbols"] = _symbols(info.version)
    report["patches"] = _patches(info.version)
    return report


def _releases() -> list[dict[str, str]]:
    """The listed releases: version, the Python the matrix tests it on, its limits."""
    from .. import support

    return [{"version": str(r.version), "python": r.python,
             "limits": ", ".join(f"{'python' if k == 'requires_python' else k}{v}" for k, v in r.limits().items())}
            for r in support.releases()]


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
    from .._facts.symbol_table import SYMBOLS

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


def run(args: argparse.Namespace) -> int:
    """Run ``doctor``; exit status 0 if the installation is usable, 1 if it is not (missing, unreadable, unsupported,
    untested without ``--allow-untested``, the environment breaking the release's limits), not the expected
    version, or a fact row disagrees with the probe. With ``--for V``: the plan for release V (0 if a Python for it
    was found, 1 if not, 2 if V is not a listed release)."""
    if getattr(args, "for_release", None):
        return _run_for(args.for_release, as_json=args.json)
    report = collect(probe=args.probe, allow_untested=args.allow_untested)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(render(report, verbose=args.verbose or args.probe))
    m = report["megatron_core"]
    if not report["verdict"]["ok"]:
        return 1
    if args.expect_version and m["version"] != args.expect_version:
        print(f"error: expected megatron-core {args.expect_version}, but {m['version']} is imported from "
              f"{m['path']}", file=sys.stderr)
        return 1
    if args.probe and any(c.get("agrees") is False for c in report.get("facts", [])):
        print("error: some fact rows disagree with the installed module (see DISAGREES above)", file=sys.stderr)
        return 1
    return 0


def _run_for(wanted: str, *, as_json: bool) -> int:
    """``doctor --for V``: what release V needs of this machine and the commands (see :mod:`..support.plan`)."""
    from ..support import base_requirements, releases
    from ..support.plan import CPU_INDEX_FALLBACK, CPU_TORCH_INDEX, plan_for

    listed = releases()
    release = next((r for r in listed if str(r.version) == wanted.strip()), None)
    if release is None:
        print(f"mcore-compat doctor: error: --for {wanted}: not a supported release; one of: "
              f"{' '.join(str(r.version) for r in listed)}", file=sys.stderr)
        return 2
    plan = plan_for(release, listed, base_requirements(release.python))
    if as_json:
        print(json.dumps({"release": str(release.version), "python": plan.python_minor,
                          "requires_python": release.requires_python, "running": vars(plan.running),
                          "interpreter": vars(plan.interpreter) if plan.interpreter else None,
                          "fit": plan.fit.as_dict() if plan.fit else None, "commands": list(plan.commands),
                          "notes": list(plan.notes), "ok": plan.ok}, indent=2))
        return 0 if plan.ok else 1
    lines = [f"megatron-core {release.version} on this machine",
             f"  runs on          Python {plan.python_minor} (the release declares "
             f"{release.requires_python or 'nothing'})",
             f"  running Python   {plan.running.version} ({plan.running.path})"]
    if plan.interpreter is not None and plan.interpreter is not plan.running:
        lines.append(f"  Python found     {plan.interpreter.version} ({plan.interpreter.path}; "
                     f"{plan.interpreter.found_by})")
    if plan.fit is not None and not plan.fit.ok:
        lines.append(f"  this environment {plan.fit.summary()}")
    lines += [f"  note             {n}" for n in plan.notes]
    if plan.commands:
        lines.append("commands:")
        for c in plan.commands:
            lines.append(f"  {c}")
            if f"--index-url {CPU_TORCH_INDEX}" in c:  # said here, where the command fails, not only in a note
                lines.append(f"    # {CPU_INDEX_FALLBACK}")
    print("\n".join(lines))
    return 0 if plan.ok else 1
