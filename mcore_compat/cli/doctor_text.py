"""The text form of ``mcore-compat doctor``'s report: one screen by default, every table with ``--verbose``."""

from __future__ import annotations

import textwrap
from typing import Any

__all__ = ["render"]

_LABEL = 19  # width of the label column
_WIDTH = 110  # wrap the releases line here


def _line(label: str, text: str) -> str:
    return f"{label:<{_LABEL - 1}} {text}"


def _header(report: dict[str, Any]) -> list[str]:
    t = report["torch"]
    out = [_line("mcore-compat", report["mcore_compat"]),
           _line("python", f"{report['python']['version']} ({report['python']['executable']})")]
    if t.get("present"):
        cuda = f"CUDA {t['cuda_build']}, {t['device_count']} GPU(s)" if t["cuda_available"] else (
            f"CUDA build {t['cuda_build']}, no GPU" if t["cuda_build"] else "CPU build")
        out.append(_line("torch", f"{t['version']} ({cuda})"))
    else:
        out.append(_line("torch", f"MISSING ({t.get('error')})"))
    for key, label in (("apex", "apex"), ("transformer_engine", "TransformerEngine")):
        pkg = report[key]
        out.append(_line(label, (pkg["version"] or "present") if pkg["present"] else "not installed"))
    return out


def _megatron(report: dict[str, Any]) -> list[str]:
    m = report["megatron_core"]
    if not m["found"]:
        if m.get("version_unknown"):  # found, but its version cannot be told
            label = "VERSION CONFLICT" if "disagrees with the installed" in str(m["error"]) else "VERSION UNKNOWN"
            return [_line("megatron-core", f"{label}: {m['error']}")]
        return [_line("megatron-core", f"NOT FOUND: {m['error']}")]
    where = "source checkout (no metadata)" if m["checkout"] else f"distribution {m['distribution']}"
    out = [_line("megatron-core", f"{m['version']} (from {m['source']}; {where})"),
           _line("  imported from", m["path"])]
    out += [_line("  WARNING", w) for w in m["warnings"]]
    s = report.get("support") or {}
    if s:
        out.append(_line("support", s.get("summary", str(s))))
    env = report.get("environment")
    if env is not None:
        if env["ok"]:
            limits = ", ".join(f"{'python' if k == 'requires_python' else k}{v}" for k, v in env["limits"].items())
            out.append(_line("environment", f"fits the limits of {env['release']} ({limits or 'none'})"))
        else:
            out.append(_line("environment", f"does NOT fit the limits of {env['release']} (see below)"))
    return out


def _releases(report: dict[str, Any]) -> list[str]:
    by_python: dict[str, list[str]] = {}
    for r in report.get("releases", []):
        by_python.setdefault(r["python"], []).append(r["version"])
    out: list[str] = []
    for i, (python, versions) in enumerate(by_python.items()):
        text = f"Python {python}: " + " ".join(versions)
        wrapped = textwrap.wrap(text, _WIDTH - _LABEL, subsequent_indent="  ")
        for j, piece in enumerate(wrapped):
            out.append(_line("releases" if i == 0 and j == 0 else "", piece))
    exe = report["python"]["executable"]
    out.append(_line("  switch", f"{exe} -m pip install megatron-core==<V>, then run doctor again (the limits of "
                                 f"each release: {exe} -m mcore_compat.support list)"))
    return out


def _tables_summary(report: dict[str, Any]) -> list[str]:
    if "facts" not in report:
        return []
    version = report["megatron_core"]["version"]
    unavailable = sum(1 for s in report["symbols"] if not s["location"])
    applies = [p for p in report["patches"] if p["applies"]]
    needed = [p["name"] for p in applies if p["needed_here"]]
    return [_line("tables", f"{len(report['facts'])} facts, {len(report['symbols'])} symbols ({unavailable} "
                            f"unavailable in {version}), {len(applies)} patches for {version} ("
                            f"{', '.join(needed) + ' needed here' if needed else 'none needed here'}); "
                            f"`mcore-compat doctor --verbose` lists them")]


def _verdict(report: dict[str, Any]) -> list[str]:
    v = report.get("verdict")
    if v is None:  # a partial report (no verdict was computed): nothing to conclude
        return []
    m = report["megatron_core"]
    out = [f"note: {n}" for n in v["notes"]]
    if v["ok"]:
        out.append(f"doctor: OK (megatron-core {m['version']} is usable here)")
        return out
    out.append("doctor: NOT USABLE" + (" (see megatron-core above)" if not m["found"] else ""))
    out += [f"  {p}" for p in v["problems"] if p != m.get("error")]  # the megatron-core line said it already
    if v["fix"]:
        out.append(f"  fix: {v['fix']}")
    return out


def _patch_state(p: dict[str, Any]) -> str:
    if p["applied"]:
        return "APPLIED"
    if p["skipped"]:
        return f"SKIPPED, not applied ({p['skipped']})"
    if p["refused"]:
        return f"REFUSED ({p['refused']})"
    return "not applied"


def _tables(report: dict[str, Any]) -> list[str]:
    """Every fact, symbol and patch (``--verbose``)."""
    out: list[str] = [""]
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
    out.append("")
    return out


def render(report: dict[str, Any], verbose: bool = False) -> str:
    """The human-readable form of :func:`~mcore_compat.cli.doctor.collect`'s report.

    Args:
        report: the report.
        verbose: also every fact, symbol and patch (the default fits one screen).

    Returns:
        The text, without a trailing newline.
    """
    out = _header(report) + _megatron(report) + _releases(report)
    if "facts" in report:
        out += _tables(report) if verbose else _tables_summary(report)
    out += _verdict(report)
    return "\n".join(out)
