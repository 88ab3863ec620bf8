"""Known-harmless warnings folded into one line (:mod:`mcore_compat.quiet`): a known warning is counted, not
printed; any other warning prints as before; the one line names the kinds; the switch is off unless asked for;
and the quickstart, run as a user runs it with ``MCORE_COMPAT_FOLD_WARNINGS=1``, prints no Python warning and one
line (every release session tagged ``launcher``: a fresh interpreter and spawned rank, as a user gets)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from mcore_compat import quiet

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def folding(monkeypatch: pytest.MonkeyPatch) -> object:
    monkeypatch.setattr(quiet, "_FOLDED", {})
    monkeypatch.setattr(quiet, "_STATE", {"atexit": True})  # no atexit handler from a test
    yield
    quiet.fold_known_warnings(False)


def test_known_warnings_are_counted_and_others_printed(folding: object, capsys: pytest.CaptureFixture[str]) -> None:
    passed: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *_a, **_k: passed.append(str(message))  # what prints without us
        quiet.fold_known_warnings()
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", stacklevel=1)
        warnings.warn("full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.", stacklevel=1)
        warnings.warn("a warning of the user's own", stacklevel=1)
        logging.getLogger("torch.utils.cpp_extension").warning("No CUDA runtime is found, using CUDA_HOME='/x'")
        quiet.fold_known_warnings(False)
        warnings.warn("Apex is not installed. Falling back to Torch Norm", stacklevel=1)  # off again: printed
    assert passed == ["a warning of the user's own", "Apex is not installed. Falling back to Torch Norm"]
    assert quiet.folded() == {"TransformerEngine/apex not installed": 1, "cuda_graph_scope default deprecated": 1,
                              "no CUDA runtime (torch.utils.cpp_extension)": 1}
    assert "CUDA runtime" not in capsys.readouterr().err
    quiet._summary()
    quiet._summary()  # once
    line = capsys.readouterr().err
    assert line.count("\n") == 1 and line.startswith("mcore-compat: folded 3 known-harmless warnings (")


def test_every_row_says_why_and_compiles() -> None:
    import re

    assert len({k.label for k in quiet.KNOWN}) == len(quiet.KNOWN)
    for k in quiet.KNOWN:
        re.compile(k.pattern)
        assert k.why and k.label


def test_off_unless_asked() -> None:
    code = "import warnings, mcore_compat; warnings.warn('Apex is not installed. Falling back to Torch Norm')"
    env = {k: v for k, v in os.environ.items() if k != quiet.ENV}
    env["PYTHONPATH"] = str(ROOT)
    shown = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "Apex is not installed" in shown.stderr and "folded" not in shown.stderr
    folded = subprocess.run([sys.executable, "-c", code], env={**env, quiet.ENV: "1"}, capture_output=True,
                            text=True, check=True)
    assert folded.stderr.startswith("mcore-compat: folded 1 known-harmless warning (TransformerEngine/apex")
    assert folded.stderr.count("\n") == 1


@pytest.mark.mcore
@pytest.mark.launcher
def test_the_quickstart_prints_one_line_instead_of_the_warnings() -> None:
    env = {**os.environ, quiet.ENV: "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loss after each step" in proc.stdout
    lines = proc.stderr.strip().splitlines()  # every warning and log line of the run is a known one
    assert len(lines) == 1 and lines[0].startswith("mcore-compat: folded"), proc.stderr
