"""The Python blocks of README.md and docs/*.md are tests (Sybil), run as written in a real release.

Each ```` ```python ```` block is one pytest item (Sybil's Markdown parser), marked ``mcore``: it runs in the release
sessions tagged ``docs`` in matrix/versions.toml (the default release and the newest) and is skipped in the others
with a reason naming the installed release. A block is either complete or continues the blocks above it on the
same page: the blocks of one page share one namespace, in one interpreter started once per pytest session
(:class:`_Worker`: a fresh ``python -P`` with the session's environment, in a temporary directory, so that nothing
a block imports or patches reaches the test process). A block that is a script (it has an
``if __name__ == "__main__":`` guard, like README's training script) runs as a script file of its own, exactly as
a user runs it. ``examples/quickstart.py`` must be README's script, byte for byte (tests/test_docs.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from sybil import Sybil
from sybil.parsers.markdown import CodeBlockParser

ROOT = Path(__file__).resolve().parent
#: The versions.toml tag of the release sessions that run the blocks.
DOCS_TAG = "docs"
_REPLY = "\x00mcore-compat-docs-reply\x00"
#: Seconds one block may take (the worker prints its stacks and exits after that; scripts are killed).
BLOCK_TIMEOUT = 600

#: The worker: reads one JSON request a line ({"doc", "code", "line"}), runs the code in that page's namespace,
#: answers with one marked line ({"ok", "error"}); the blocks' own output goes to stderr.
_WORKER = r"""
import faulthandler, json, sys, traceback
reply, sys.stdout = sys.stdout, sys.stderr
spaces = {}
for request in sys.stdin:
    req = json.loads(request)
    space = spaces.setdefault(req["doc"], {"__name__": "__docs__"})
    faulthandler.dump_traceback_later(TIMEOUT, exit=True)  # a hung block: its stacks, then the worker exits
    try:
        exec(compile("\n" * (req["line"]) + req["code"], req["doc"], "exec"), space)
        answer = {"ok": True}
    except BaseException:
        answer = {"ok": False, "error": traceback.format_exc()}
    faulthandler.cancel_dump_traceback_later()
    sys.stderr.flush()
    reply.write(MARK + json.dumps(answer) + "\n")
    reply.flush()
"""


class _Worker:
    """One interpreter for the blocks of every page (started on first use, stopped at the end of the session)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.log = tempfile.TemporaryFile(mode="w+")
        self.cwd = tempfile.TemporaryDirectory(prefix="mcore-compat-docs-")

    def run(self, doc: str, code: str, line: int) -> str | None:
        if self.proc is None:
            source = f"MARK = {_REPLY!r}\nTIMEOUT = {BLOCK_TIMEOUT}\n{_WORKER}"
            self.proc = subprocess.Popen([sys.executable, "-P", "-c", source],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                         cwd=self.cwd.name)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        start = self.log.tell()
        self.proc.stdin.write(json.dumps({"doc": doc, "code": code, "line": line}) + "\n")
        self.proc.stdin.flush()
        for out in self.proc.stdout:
            if out.startswith(_REPLY):
                answer = json.loads(out[len(_REPLY):])
                break
        else:
            answer = {"ok": False, "error": f"the docs worker exited (status {self.proc.wait()})"}
            self.proc = None  # the next block starts a fresh worker
        if answer["ok"]:
            return None
        self.log.seek(start)
        return f"{answer['error']}\n--- output of the block ---\n{self.log.read()[-4000:]}"

    def close(self) -> None:
        if self.proc is not None and self.proc.stdin is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        self.cwd.cleanup()
        self.log.close()


_WORKER_INSTANCE: list[_Worker] = []


def _run_script(code: str) -> str | None:
    with tempfile.TemporaryDirectory(prefix="mcore-compat-docs-") as tmp:
        script = Path(tmp) / "script.py"
        script.write_text(code, encoding="utf-8")
        proc = subprocess.run([sys.executable, "-P", str(script)], capture_output=True, text=True, cwd=tmp,
                              timeout=BLOCK_TIMEOUT)
    return None if proc.returncode == 0 else f"exit status {proc.returncode}\n{proc.stdout}\n{proc.stderr[-6000:]}"


def _evaluate(example: Any) -> str | None:
    code = example.parsed
    if 'if __name__ == "__main__":' in code:
        return _run_script(code)
    if not _WORKER_INSTANCE:
        _WORKER_INSTANCE.append(_Worker())
    return _WORKER_INSTANCE[0].run(str(Path(example.path).relative_to(ROOT)), code, example.line)


pytest_collect_file = Sybil(parsers=[CodeBlockParser(language="python", evaluator=_evaluate)],
                            patterns=["README.md", "docs/*.md"]).pytest()


def _docs_releases() -> list[str]:
    from mcore_compat.support import releases

    return [str(r.version) for r in releases() if DOCS_TAG in r.tags]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the blocks ``mcore``; outside the ``docs`` releases skip them, naming the installed release."""
    blocks = [item for item in items if item.path.suffix == ".md"]
    if not blocks:
        return
    installed = None
    if os.path.isdir(ROOT / "matrix"):
        from mcore_compat import detect

        try:
            installed = str(detect().version)
        except Exception:  # no megatron-core: tests/conftest.py skips every mcore item
            installed = None
    tagged = _docs_releases()
    for item in blocks:
        item.add_marker(pytest.mark.mcore)
        if installed is not None and installed not in tagged:
            item.add_marker(pytest.mark.skip(
                reason=f"megatron-core {installed} is not tagged `{DOCS_TAG}` in matrix/versions.toml: the README "
                       f"and docs/ blocks run in the sessions of {', '.join(tagged)}"))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    while _WORKER_INSTANCE:
        _WORKER_INSTANCE.pop().close()
