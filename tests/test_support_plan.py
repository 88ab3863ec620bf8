"""``mcore-compat doctor --for V``: what release V needs of this machine and the exact commands, before anything is
installed (:mod:`mcore_compat.support.plan`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_compat.support import base_requirements, releases
from mcore_compat.support.model import Release
from mcore_compat.support.plan import CPU_TORCH_INDEX, Interpreter, find_interpreter, plan_for

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def _release(version: str) -> Release:
    return next(r for r in releases() if str(r.version) == version)


PY311 = Interpreter("/opt/py311/bin/python", "3.11.7", "running")


def test_a_release_the_running_python_runs_installs_here_with_its_limits() -> None:
    plan = plan_for(_release("0.8.0"), releases(), base_requirements("3.11"), running=PY311, gpu=False,
                    interpreter=lambda r: pytest.fail("no other interpreter is needed"))
    assert plan.ok and plan.interpreter is PY311 and plan.fit is not None
    assert plan.commands[-1] == "/opt/py311/bin/python -m pip install megatron-core==0.8.0 'setuptools<81'"


def test_a_release_for_another_python_gets_a_new_venv_on_the_python_found() -> None:
    found = Interpreter("/home/u/.pyenv/versions/3.12.1/bin/python3.12", "3.12.1", "pyenv")
    plan = plan_for(_release("0.19.2"), releases(), base_requirements("3.12"), running=PY311, gpu=False,
                    interpreter=lambda r: found)
    assert plan.ok and plan.fit is None
    assert plan.commands[0] == f"{found.path} -m venv .venv312"
    assert plan.commands[1] == f".venv312/bin/python -m pip install torch==2.13.0 --index-url {CPU_TORCH_INDEX}"
    assert ".venv312/bin/python -m pip install megatron-core==0.19.2" in plan.commands
    assert plan.commands[-1] == ".venv312/bin/mcore-compat doctor"
    assert any("not on PATH (pyenv)" in n for n in plan.notes) and any("CPU build" in n for n in plan.notes)
    with_gpu = plan_for(_release("0.19.2"), releases(), base_requirements("3.12"), running=PY311, gpu=True,
                        interpreter=lambda r: found)
    assert with_gpu.commands[1] == ".venv312/bin/python -m pip install torch==2.13.0"


def test_no_python_for_the_release_says_how_to_get_one() -> None:
    plan = plan_for(_release("0.19.2"), releases(), base_requirements("3.12"), running=PY311, gpu=False,
                    interpreter=lambda r: None)
    assert not plan.ok and plan.commands == ()
    assert any("uv python install 3.12" in n and "pyenv install 3.12" in n for n in plan.notes), plan.notes


def test_a_release_without_a_wheel_for_its_python_is_unzipped_from_the_other_wheel() -> None:
    plan = plan_for(_release("0.4.0"), releases(), base_requirements("3.11"), running=PY311, gpu=False)
    download, unzip = plan.commands[-2:]
    assert "pip download --no-deps --only-binary=:all: --python-version 3.10" in download
    assert "megatron-core==0.4.0" in download and 'n.startswith("megatron/")' in unzip


def test_the_interpreter_search_checks_the_version_it_finds() -> None:
    release = _release("0.19.2")
    candidates = [("/usr/bin/python3.12", "PATH"), ("/pyenv/3.12.4/bin/python3.12", "pyenv")]
    versions = {"/usr/bin/python3.12": None, "/pyenv/3.12.4/bin/python3.12": "3.12.4"}  # a broken one first
    got = find_interpreter(release, candidates=lambda minor: candidates, version_of=versions.get)
    assert got == Interpreter("/pyenv/3.12.4/bin/python3.12", "3.12.4", "pyenv")
    assert find_interpreter(release, candidates=lambda minor: [("/x/python3.12", "PATH")],
                            version_of=lambda p: "3.11.7") is None


def _doctor(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-P", "-m", "mcore_compat", "doctor", *args], capture_output=True,
                          text=True, env=env, timeout=120)


def test_doctor_for_a_release_prints_the_plan_and_refuses_an_unlisted_one() -> None:
    proc = _doctor("--for", "0.8.0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("megatron-core 0.8.0 on this machine\n")
    assert "-m pip install megatron-core==0.8.0 'setuptools<81'" in proc.stdout
    as_json = json.loads(_doctor("--for", "0.8.0", "--json").stdout)
    assert as_json["release"] == "0.8.0" and as_json["ok"] is True and as_json["commands"]
    bad = _doctor("--for", "0.99.0")
    assert bad.returncode == 2 and bad.stdout == "" and len(bad.stderr.splitlines()) == 1
    assert "--for 0.99.0: not a supported release; one of: 0.4.0 " in bad.stderr


@pytest.mark.unit
def test_an_install_from_a_checkout_is_reinstalled_from_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``pip install .`` records the checkout (PEP 610 ``direct_url.json``): the plan for another release installs
    mcore-compat from there, not from a package index where it may not be."""
    import json
    from importlib import metadata

    from mcore_compat.support import plan

    class _Dist:
        def __init__(self, text: str | None) -> None:
            self.text = text

        def read_text(self, name: str) -> str | None:
            return self.text if name == "direct_url.json" else None

    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'mcore-compat'\n")
    local = json.dumps({"url": tmp_path.as_uri(), "dir_info": {}})
    monkeypatch.setattr(metadata, "distribution", lambda name: _Dist(local))
    assert plan._installed_from() == tmp_path
    monkeypatch.setattr(metadata, "distribution", lambda name: _Dist(json.dumps({"url": "https://x/y.whl"})))
    assert plan._installed_from() is None
    monkeypatch.setattr(metadata, "distribution", lambda name: _Dist(None))
    assert plan._installed_from() is None
    gone = json.dumps({"url": (tmp_path / "gone").as_uri(), "dir_info": {}})
    monkeypatch.setattr(metadata, "distribution", lambda name: _Dist(gone))
    assert plan._installed_from() is None


def test_doctor_for_says_what_to_do_under_the_cpu_index_command(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Without a GPU the torch line uses PyTorch's CPU index; where that index is unreachable pip answers
    ResolutionImpossible: the fallback is printed right under that command, and the new venv has README's name."""
    import functools

    from mcore_compat.cli import doctor
    from mcore_compat.support import plan as plan_module

    found = Interpreter("/opt/py312/bin/python3.12", "3.12.4", "PATH")
    monkeypatch.setattr(plan_module, "plan_for", functools.partial(plan_for, gpu=False, running=PY311,
                                                                   interpreter=lambda release: found))
    assert doctor._run_for("0.19.2", as_json=False) == 0
    lines = capsys.readouterr().out.splitlines()
    [i] = [n for n, line in enumerate(lines) if f"--index-url {CPU_TORCH_INDEX}" in line]
    assert lines[i].strip().startswith(".venv312/bin/python -m pip install torch")
    assert lines[i + 1].strip().startswith("# if pip cannot reach that index (ResolutionImpossible")
    assert "without --index-url" in lines[i + 1]
