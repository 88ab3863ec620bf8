"""Measure ``mcore-compat scan`` on real clients and record the numbers in docs/support.md.

Downloads four released clients (``pip download --no-deps``, cached under ``.cache/clients``; nothing vendored),
runs ``mcore-compat scan --json`` on each for every supported release, and writes per client and release: the
``megatron.core`` names it uses, how many import raw as written, how many the mirror ``mcore_compat.core`` reaches
(raw + moved), how many moved, how many are absent. The table goes into docs/support.md between the ``clients`` markers.
Then it applies ``scan --fix`` to a copy of each client and records the mirror imports of the fixed copy and the
mirror paths of every name the scan read, attribute uses included (``tests/data/client_mirror_imports.json``), which ``tests/test_client_imports_real.py`` imports in every release
session.

    python scripts/measure_clients.py           # download (once), scan, write docs/support.md and the data file
    python scripts/measure_clients.py --check   # exit 1 if docs/support.md or the data file differ from a new run
"""

from __future__ import annotations

import argparse
import ast
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "clients"
README = ROOT / "docs" / "support.md"
DATA = ROOT / "tests" / "data" / "client_mirror_imports.json"
#: The clients measured: (distribution==version, the top-level package read).
CLIENTS = (("verl==0.9.1", "verl"), ("ms-swift==4.6.0", "swift"), ("mbridge==0.15.1", "mbridge"),
           ("megatron-bridge==0.3.1", "megatron/bridge"))
BEGIN, END = "<!-- clients:begin (scripts/measure_clients.py) -->", "<!-- clients:end -->"


def wheel(requirement: str) -> Path:
    """The client's wheel, downloaded into the cache once."""
    name, _, version = requirement.partition("==")
    stem = name.replace("-", "_").lower()
    found = sorted(CACHE.glob(f"{stem}-{version}-*.whl"))
    if not found:
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q",
                        "-d", str(CACHE), requirement], check=True)
        found = sorted(CACHE.glob(f"{stem}-{version}-*.whl"))
    if not found:
        raise SystemExit(f"measure_clients: pip downloaded no wheel for {requirement} into {CACHE}")
    return found[0]


def scan_json(path: Path) -> dict:
    """``mcore-compat scan PATH --json`` for every supported release."""
    proc = subprocess.run([sys.executable, "-m", "mcore_compat", "scan", str(path), "--json"], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    if proc.returncode not in (0, 1) or not proc.stdout:
        raise SystemExit(f"measure_clients: scan of {path} failed: {proc.stderr.strip()}")
    return json.loads(proc.stdout)


def mirror_imports(root: Path) -> list[list[str]]:
    """``[mirror module, name]`` of every ``from mcore_compat.core... import name`` and ``import mcore_compat.core.x
    as y`` in the fixed copy (``name`` of an ``import``: the last component, under its parent)."""
    pairs: set[tuple[str, str]] = set()
    for path in sorted(root.rglob("*.py")):
        try:
            tree = ast.parse(path.read_bytes())
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(
                    "mcore_compat.core"):
                pairs.update((node.module or "", a.name) for a in node.names if a.name != "*")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("mcore_compat.core."):
                        parent, _, child = a.name.rpartition(".")
                        pairs.add((parent, child))
    return [list(p) for p in sorted(pairs)]


def measure() -> tuple[dict[str, dict], dict[str, list[list[str]]]]:
    """Per client: the scan report and the mirror imports of its fixed copy."""
    reports, imports = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for requirement, package in CLIENTS:
            src = Path(tmp) / requirement.partition("==")[0]
            with zipfile.ZipFile(wheel(requirement)) as zf:
                zf.extractall(src)
            tree = src / package
            reports[requirement] = scan_json(tree)
            fixed = Path(tmp) / "fixed" / requirement.partition("==")[0]
            shutil.copytree(tree, fixed)
            subprocess.run([sys.executable, "-m", "mcore_compat", "scan", str(fixed), "--fix", "--release", "0.16.1"],
                           cwd=ROOT, capture_output=True, check=False)
            # the fixed import lines, and every name the scan read (attribute uses ``mpu.x`` too) at its mirror path
            used = {("mcore_compat.core" + n["module"][len("megatron.core"):], n["name"])
                    for n in reports[requirement]["names"]}
            imports[requirement] = [list(p) for p in sorted(used | {tuple(p) for p in mirror_imports(fixed)})]
    return reports, imports


def table(reports: dict[str, dict]) -> str:
    """The README table: a row per release, a column per client (raw / through the mirror / moved / absent)."""
    clients = list(reports)
    releases = list(next(iter(reports.values()))["releases"])
    head = "| release | " + " | ".join(f"{c} ({len(reports[c]['names'])} names)" for c in clients) + " |"
    lines = [BEGIN, "", head, "|---|" + "---|" * len(clients)]
    for release in releases:
        cells = []
        for c in clients:
            n = reports[c]["releases"][release]["counts"]
            cells.append(f"{n['raw']} / {n['mirror']} / {n['moved']} / {n['absent']}")
        lines.append(f"| {release} | " + " | ".join(cells) + " |")
    lines += ["", "Each cell: names that import raw as written / reachable through `mcore_compat.core` (raw + moved) / "
              "moved / absent from the release. Every name that imports raw also imports through the mirror "
              "(`tests/test_client_imports_real.py`, every release session: 100 %).", "", END]
    return "\n".join(lines)


def render_readme(text: str, block: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"measure_clients: docs/support.md lacks the markers {BEGIN!r} ... {END!r}")
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return head + block + tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/support.md or the data file is stale")
    args = parser.parse_args(argv)
    reports, imports = measure()
    readme = render_readme(README.read_text(), table(reports))
    data = json.dumps(imports, indent=1) + "\n"
    if args.check:
        stale = [p.name for p, new in ((README, readme), (DATA, data)) if not p.exists() or p.read_text() != new]
        if stale:
            print(f"measure_clients: stale: {', '.join(stale)} (run python scripts/measure_clients.py)",
                  file=sys.stderr)
            return 1
        print("measure_clients: docs/support.md and the data file are current")
        return 0
    README.write_text(readme)
    DATA.write_text(data)
    print(f"measure_clients: wrote docs/support.md and {DATA.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
