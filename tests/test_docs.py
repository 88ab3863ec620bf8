"""README.md and docs/ as a user reads them (the Python blocks themselves run through Sybil: the root conftest.py).

* README's training script is ``examples/quickstart.py``, shown whole.
* Every command of README's shell blocks is checked without running it: each ``&&``-separated command runs an
  executable the instructions create or name (the venv's ``python``, ``pip``, ``mcore-compat``; ``python3``;
  ``pyenv``), and each ``mcore-compat ...`` parses with the real command line (the subcommand and every option
  exist). The two first commands themselves are what CI runs (tests/test_support.py, .ci/run).
* README stays a landing page (about 150 lines) and links only to files that exist.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")

pytestmark = pytest.mark.unit


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def _commands() -> list[list[str]]:
    """Every command (``&&``-separated) of README's bash blocks, comments dropped."""
    out = []
    for block in _blocks(README, "bash"):
        for line in block.splitlines():
            line = line.split("  #", 1)[0].strip()
            if not line or line.startswith("#"):
                continue
            out += [shlex.split(part) for part in line.split("&&")]
    return out


def test_readme_shows_examples_quickstart_whole() -> None:
    scripts = [b for b in _blocks(README, "python") if 'if __name__ == "__main__":' in b]
    assert scripts == [(ROOT / "examples" / "quickstart.py").read_text(encoding="utf-8")]


def test_readme_commands_run_what_the_instructions_provide() -> None:
    allowed = re.compile(r"^(python3(\.\d+)?|pyenv|\.venv[\w.-]*/bin/(python|pip|mcore-compat)"
                         r'|"\$\(pyenv root\)"/versions/3\.12\.\*/bin/python3\.12)$')
    commands = _commands()
    assert len(commands) >= 10, commands
    for argv in commands:
        assert allowed.match(argv[0]) or argv[0].startswith("$(pyenv"), argv


def test_readme_mcore_compat_commands_parse() -> None:
    from mcore_compat.cli import _build

    parser, _ = _build()
    checked = 0
    for argv in _commands():
        if argv[0].endswith("/mcore-compat"):
            parser.parse_args(argv[1:])  # SystemExit(2) on an unknown subcommand or option
            checked += 1
    assert checked >= 8


def test_readme_is_a_landing_page_with_working_links() -> None:
    assert len(README.splitlines()) <= 180
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README):
        if "://" not in target:
            assert (ROOT / target).exists(), target
    for heading in ("## Quickstart", "## A complete training script", "## Porting your code", "## One naming rule",
                    "## Switching releases", "## The CLI at a glance", "## Documentation"):
        assert heading in README


def test_docs_mcore_compat_commands_parse() -> None:
    """The ``mcore-compat`` commands of docs/'s shell blocks (from the venv, as README writes them:
    ``.venv/bin/mcore-compat``, or ``.venv/bin/torchrun ... -m mcore_compat``) parse with the real command
    line."""
    from mcore_compat.cli import _build

    parser, _ = _build()
    checked = 0
    for page in sorted((ROOT / "docs").glob("*.md")):
        for block in _blocks(page.read_text(encoding="utf-8"), "bash"):
            for line in block.splitlines():
                line = line.split("  #", 1)[0].strip()
                for part in line.split("&&"):
                    argv = shlex.split(part) if part.strip() and not part.lstrip().startswith("#") else []
                    if argv and argv[0].endswith(("mcore-compat", "torchrun")):  # as README: from the venv
                        assert re.match(r"^\.venv[\w.-]*/bin/", argv[0]), f"{page.name}: {part.strip()}"
                    if argv and argv[0].endswith("torchrun") and "mcore_compat" in argv:
                        argv = argv[argv.index("mcore_compat"):]
                    if argv and (argv[0].endswith("mcore-compat") or argv[0] == "mcore_compat"):
                        parser.parse_args(argv[1:])  # SystemExit(2) on an unknown subcommand or option
                        checked += 1
    assert checked >= 10, checked


def test_the_docs_worker_keeps_a_namespace_per_page_and_reports_failures() -> None:
    """The root conftest.py's worker: blocks of one page continue each other, pages do not share names, a
    failing block reports its traceback and output (at the block's line) and the next block still runs."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_mcore_compat_docs_conftest", ROOT / "conftest.py")
    assert spec is not None and spec.loader is not None
    docs_conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(docs_conftest)
    worker = docs_conftest._Worker()
    try:
        assert worker.run("a.md", "x = 1\nprint('hello')\n", 3) is None
        assert worker.run("a.md", "assert x == 1\n", 9) is None
        error = worker.run("b.md", "print('visible')\nx\n", 20)
        assert error is not None and "NameError" in error and 'File "b.md", line 22' in error, error
        assert "visible" in error
        assert worker.run("a.md", "x += 1\nassert x == 2\n", 30) is None
    finally:
        worker.close()
