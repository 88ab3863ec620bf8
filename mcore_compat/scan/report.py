"""Scan a codebase and classify each Megatron name it uses, per release, against the surface data.

For each release a ``(module, name)`` pair is ``raw`` (the release has it at the path the client writes), ``moved``
(elsewhere: the mirror spelling ``from mcore_compat.core.<same path> import name`` reaches it) or ``absent`` (the
release has it nowhere along its moves; the report names the releases that have it). Names mcore_compat adapts by
signature carry the mcore_compat call (:mod:`mcore_compat.scan.adapters`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import surface
from .adapters import adapter_for
from .read import FileError, RawImport, Use, python_files, read_file

__all__ = ["Scan", "classify", "scan_paths"]

ROOT = "mcore_compat.core"


@dataclass
class Scan:
    """What :func:`scan_paths` read: the uses, the raw import lines, the files it could not parse."""

    files: int = 0
    uses: list[Use] = field(default_factory=list)
    raw_imports: list[RawImport] = field(default_factory=list)
    errors: list[FileError] = field(default_factory=list)

    def pairs(self) -> dict[tuple[str, str], list[Use]]:
        """``(module, name) -> uses``, sorted."""
        out: dict[tuple[str, str], list[Use]] = {}
        for use in self.uses:
            out.setdefault((use.module, use.name), []).append(use)
        return dict(sorted(out.items()))


def _is_module(path: str) -> bool:
    return surface.module_ranges(path) != ()


def scan_paths(paths: list[Path]) -> Scan:
    """Read every Python file under ``paths`` (each an existing file or folder); a file that cannot be read or
    parsed is recorded in :attr:`Scan.errors` and the rest are still read."""
    result = Scan()
    for root in paths:
        for path in python_files(root):
            label = str(path)
            result.files += 1
            try:
                uses, raw = read_file(path, label, _is_module)
            except SyntaxError as exc:
                result.errors.append(FileError(label, f"does not parse (line {exc.lineno}: {exc.msg})"))
                continue
            except (OSError, UnicodeDecodeError, ValueError) as exc:
                result.errors.append(FileError(label, f"cannot be read ({exc})"))
                continue
            result.uses += uses
            result.raw_imports += raw
    return result


def mirror_spelling(module: str, name: str) -> str:
    """``from mcore_compat.core.<path> import name`` for ``module = megatron.core.<path>``."""
    return f"from {ROOT}{module[len('megatron.core'):]} import {name}"


def classify(scan: Scan, releases: list[str]) -> dict[str, Any]:
    """The report as plain data (what ``scan --json`` prints): the names with their uses and adapter, and per
    release the raw / moved / absent names and their counts."""
    pairs = scan.pairs()
    names = [{"module": m, "name": n, "adapter": adapter_for(m, n),
              "uses": [f"{u.file}:{u.line}" for u in uses]} for (m, n), uses in pairs.items()]
    per_release: dict[str, Any] = {}
    for release in releases:
        raw: list[str] = []
        moved: list[dict[str, str]] = []
        absent: list[dict[str, str]] = []
        for module, name in pairs:
            where = surface.locate(module, name, release)
            if where is None:
                absent.append({"name": f"{module}.{name}",
                               "releases": surface.range_summary(surface.releases_having(module, name))})
            elif where.moved:
                moved.append({"name": f"{module}.{name}", "at": where.module,
                              "mirror": mirror_spelling(module, name)})
            else:
                raw.append(f"{module}.{name}")
        per_release[release] = {
            "counts": {"names": len(pairs), "raw": len(raw), "mirror": len(raw) + len(moved), "moved": len(moved),
                       "absent": len(absent)},
            "raw": raw, "moved": moved, "absent": absent}
    return {
        "files": scan.files,
        "names": names,
        "raw_imports": [{"file": r.file, "line": r.line, "module": r.module, "fixable": r.fixable}
                        for r in scan.raw_imports],
        "errors": [{"file": e.file, "reason": e.reason} for e in scan.errors],
        "releases": per_release,
    }


def render(report: dict[str, Any]) -> str:
    """The report as text: the counts per release, the moved and absent names, the adapted names, the import
    lines ``--fix`` rewrites."""
    lines = [f"{report['files']} files, {len(report['names'])} megatron.core names, "
             f"{len(report['raw_imports'])} raw import lines"]
    for release, row in report["releases"].items():
        c = row["counts"]
        lines.append(f"megatron-core {release}: {c['raw']} raw, {c['moved']} moved (through the mirror: "
                     f"{c['mirror']} of {c['names']}), {c['absent']} absent")
        lines += [f"  moved   {m['name']} -> {m['at']}: {m['mirror']}" for m in row["moved"]]
        lines += [f"  absent  {a['name']} (in {a['releases']})" for a in row["absent"]]
    adapted = [n for n in report["names"] if n["adapter"]]
    if adapted:
        lines.append("adapted by mcore_compat (signature differs across releases):")
        lines += [f"  {n['module']}.{n['name']} -> {n['adapter']}" for n in adapted]
    manual = [r for r in report["raw_imports"] if not r["fixable"]]
    if manual:
        lines.append("imports --fix leaves (they bind the name 'megatron'; give them an 'as' name):")
        lines += [f"  {r['file']}:{r['line']}: {r['module']}" for r in manual]
    return "\n".join(lines)
