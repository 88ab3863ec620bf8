"""Rules of the suite itself, enforced by tests/conftest.py.

* Collecting the suite imports no Megatron. A test module that imports ``megatron.core`` while it is collected
  (``find_spec("megatron.core.optimizer")`` in a ``skipif`` does: finding a submodule imports its parent
  package) runs Megatron before any test could apply the patches that must come first (the apex /
  TransformerEngine stand-ins), and every later test then depends on the collection order. The conftest records
  the ``megatron.core`` modules present when collection ends; in every release session the ``mcore`` test below
  asserts there are none.
* In a release session a skip is a release limit: its reason names the installed release, or it is a failure.
* Asked for it (``$MCORE_COMPAT_TIMING_REPORT``), the conftest writes where the session's time went.

The ``unit`` tests prove both rules on a fake release in a fresh pytest (the real conftest, this file's ``mcore``
test, one more test module).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.mcore
def test_collection_imports_no_megatron(megatron_at_collection: list[str]) -> None:
    assert megatron_at_collection == [], (
        f"collecting the tests imported {', '.join(megatron_at_collection)}: a test module imports Megatron at "
        f"module level or in a decorator (find_spec of a megatron.core submodule imports megatron.core); ask at "
        f"run time instead, inside the test"
    )


def _fake_session(tmp_path: Path, test_module: str, timing: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``pytest -m mcore`` over this file and ``test_module``, with the real conftest and a fake megatron-core
    0.9.0 on ``sys.path``."""
    import mcore_compat

    fake = tmp_path / "site"
    (fake / "megatron" / "core" / "optimizer").mkdir(parents=True)
    (fake / "megatron" / "core" / "__init__.py").write_text("")
    (fake / "megatron" / "core" / "package_info.py").write_text("__version__ = '0.9.0'\n")
    (fake / "megatron" / "core" / "optimizer" / "__init__.py").write_text("")
    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(HERE / "conftest.py", suite / "conftest.py")
    shutil.copy(__file__, suite / "test_rules.py")
    (suite / "test_other.py").write_text(textwrap.dedent(test_module))
    (suite / "pytest.ini").write_text("[pytest]\nmarkers =\n    mcore: x\n    unit: x\n")
    own = Path(mcore_compat.__file__).resolve().parents[1]
    env = {"PYTHONPATH": f"{fake}:{own}", "PATH": "/usr/bin:/bin", "PYTHONNOUSERSITE": "1"}
    if timing is not None:
        env["MCORE_COMPAT_TIMING_REPORT"] = str(timing)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "mcore",
                           "-c", str(suite / "pytest.ini"), str(suite)],
                          capture_output=True, text=True, cwd=suite, env=env, timeout=120, check=False)


@pytest.mark.unit
def test_an_import_at_collection_fails_the_check(tmp_path: Path) -> None:
    proc = _fake_session(tmp_path, """
        import importlib.util

        HAS_OPTIMIZER = importlib.util.find_spec("megatron.core.optimizer") is not None
        """)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 failed" in proc.stdout and "collecting the tests imported megatron.core:" in proc.stdout, proc.stdout


@pytest.mark.unit
def test_skips_must_be_release_limits_and_imports_wait_for_run_time(tmp_path: Path) -> None:
    proc = _fake_session(tmp_path, """
        import importlib.util
        import pytest

        pytestmark = pytest.mark.mcore

        def test_imports_when_run():
            assert importlib.util.find_spec("megatron.core.optimizer") is not None

        def test_release_limit():
            pytest.skip("release limit: megatron-core 0.9.0 has no such thing")

        @pytest.mark.skipif(True, reason="something unrelated to the release")
        def test_other_skip():
            pass

        @pytest.mark.xfail(reason="known", strict=True)
        def test_expected_failure():
            assert False
        """)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # the skip mark acts in the setup phase: the test reports an error there
    assert "2 passed, 1 skipped, 3 deselected, 1 xfailed, 1 error" in proc.stdout, proc.stdout
    assert "ERROR at setup of test_other_skip" in proc.stdout, proc.stdout
    assert "skipped without naming a limit of the installed release (megatron-core 0.9.0)" in proc.stdout
    assert "SKIPPED [1] test_other.py:11: release limit: megatron-core 0.9.0 has no such thing" in proc.stdout


@pytest.mark.unit
def test_the_timing_report_counts_collection_phases_subprocesses_and_modules(tmp_path: Path) -> None:
    report = tmp_path / "timing.json"
    proc = _fake_session(tmp_path, """
        import subprocess, sys, time
        import pytest

        pytestmark = pytest.mark.mcore

        def test_runs_a_process():
            subprocess.run([sys.executable, "-c", "import time; time.sleep(0.3)"], check=True)

        def test_sleeps():
            time.sleep(0.2)
        """, timing=report)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import json

    data = json.loads(report.read_text())
    assert data["collect"] > 0 and data["seconds"] >= data["call"] >= 0.5
    assert data["subprocesses"]["count"] == 1 and data["subprocesses"]["seconds"] >= 0.3
    assert data["rank_starts"] == []
    assert next(iter(data["modules"])) == "test_other.py" and data["modules"]["test_other.py"] >= 0.5
