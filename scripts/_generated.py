"""What every generator in scripts/ does last: write its file, or with ``--check`` compare it (exit status 1, naming
the command that regenerates it, when the committed file is stale)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_or_check(output: Path, text: str, *, check: bool, script: str, summary: str) -> int:
    """Write ``text`` to ``output`` (printing ``summary``), or with ``check`` only compare; the exit status."""
    rel = output.relative_to(ROOT)
    if check:
        if not output.is_file() or output.read_text(encoding="utf-8") != text:
            print(f"{rel} is out of date: run scripts/{script}", file=sys.stderr)
            return 1
        print(f"{rel} is up to date")
        return 0
    output.write_text(text, encoding="utf-8")
    print(f"wrote {rel}: {summary}")
    return 0
