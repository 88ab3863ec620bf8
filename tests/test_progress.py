"""Progress lines of a long self-check (:mod:`mcore_compat.selfcheck.progress`): rank 0's lines reach the CLI's
terminal as they are written, and nothing is written or printed when the output is piped or ``--json`` is given."""

from __future__ import annotations

import argparse
import io
import os
import time
from pathlib import Path

import pytest

from mcore_compat.cli import selfcheck as cli
from mcore_compat.selfcheck import progress


def test_lines_are_printed_as_rank_0_writes_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "progress.txt"
    monkeypatch.setenv(progress.ENV, str(path))
    out = io.StringIO()
    with progress.Follower(path, out, interval=0.01):
        progress.note("configuration 1/2: tp2")
        deadline = time.monotonic() + 5
        while "tp2" not in out.getvalue() and time.monotonic() < deadline:  # printed while still running
            time.sleep(0.01)
        assert out.getvalue() == "  ... configuration 1/2: tp2\n"
        progress.note("tp2: step 1/3\ndone")
    assert out.getvalue().splitlines() == ["  ... configuration 1/2: tp2", "  ... tp2: step 1/3 done"]
    assert not path.exists()


def test_nothing_is_written_without_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(progress.ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    progress.note("x")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("tty", "json", "shown"), [(True, None, True), (False, None, False),
                                                     (True, "out.json", False)])
def test_the_cli_follows_only_on_a_terminal_without_json(monkeypatch: pytest.MonkeyPatch, tty: bool,
                                                         json: str | None, shown: bool) -> None:
    err = io.StringIO()
    err.isatty = lambda: tty  # type: ignore[method-assign]
    monkeypatch.setattr(cli.sys, "stderr", err)
    monkeypatch.delenv(progress.ENV, raising=False)
    with cli._progress(argparse.Namespace(json=json)):
        progress.note("step 1/1 done")
        follows = progress.ENV in os.environ
    assert follows is shown and progress.ENV not in os.environ
    assert err.getvalue() == ("  ... step 1/1 done\n" if shown else "")
