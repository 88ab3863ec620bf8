"""The public API's breaking-change check (scripts/gen_api.py) catches what it is for, on a temporary copy of the
package: a public name removed, a parameter renamed, a fact name removed each fail naming it; a deprecated alias
declared in ``mcore_compat/_util/deprecated.py`` makes the same change pass; the committed listing parses and lists
the deprecated capability names.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("griffe", reason="the API check needs griffe (a lint tool of the tools base)")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gen_api.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_api", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = _script()


@pytest.fixture(scope="module")
def copy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A copy of the package (with patches/) and its listing, as committed."""
    root = tmp_path_factory.mktemp("api")
    ignore = shutil.ignore_patterns("__pycache__")
    for folder in ("mcore_compat", "patches", "matrix"):
        shutil.copytree(ROOT / folder, root / folder, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root, GEN.listing(root)


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert old in text, f"{path}: {old!r} not found"
    path.write_text(text.replace(old, new, 1), encoding="utf-8")


def _declare(root: Path, names: dict[str, str] | None = None, params: dict[str, str] | None = None) -> None:
    with (root / "mcore_compat" / "_util" / "deprecated.py").open("a", encoding="utf-8") as f:
        f.write(f"\nDEPRECATED_NAMES.update({names or {}!r})\nDEPRECATED_PARAMS.update({params or {}!r})\n")


@pytest.fixture
def work(copy: tuple[Path, dict[str, Any]], tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    root = tmp_path / "work"
    shutil.copytree(copy[0], root)
    return root, copy[1]


def test_unchanged_copy_has_no_breaking_change(copy: tuple[Path, dict[str, Any]]) -> None:
    _, old = copy
    assert GEN.breaking_changes(old, old) == ([], [])
    assert "mcore_compat.capabilities" in old["modules"] and "has" in old["modules"]["mcore_compat.capabilities"]
    assert "ddp_ctor" in old["facts"] and "finalize_num_tokens" in old["facts"]


def test_each_break_fails_naming_it_and_an_alias_excuses_removals(work: tuple[Path, dict[str, Any]]) -> None:
    """One copy with five breaks: a name removed, a parameter renamed (also re-exported as mcore_compat.has), a
    parameter made required, a fact renamed, a deprecated capability alias dropped."""
    root, old = work
    caps = root / "mcore_compat" / "capabilities.py"
    _edit(caps, '"fact_row", ', "")
    _edit(caps, "def fact_row(", "def _fact_row(")
    _edit(caps, "def has(name: str, version:", "def has(name: str, release:")
    _edit(caps, "def resolved(version: Version | str | None = None)", "def resolved(version: Version | str | None)")
    _edit(root / "mcore_compat" / "_facts" / "table.py", 'F("timers", ', 'F("timers_renamed", ')
    _edit(root / "mcore_compat" / "_util" / "deprecated.py",
          '    _member("finalize_num_tokens", "finalize_params", "num_tokens", ">=0.7"),\n', "")
    failures, _ = GEN.breaking_changes(old, GEN.listing(root))
    unexcusable = ["mcore_compat.capabilities.resolved(version): Parameter is now required",
                   "fact 'finalize_num_tokens': Public object was removed",
                   "fact 'timers': Public object was removed",
                   "finalize_num_tokens: deprecated alias was removed (it replaced "
                   "\"'num_tokens' in fact('finalize_params')\")"]
    assert sorted(failures) == sorted(["mcore_compat.capabilities.fact_row: Public object was removed",
                                       "mcore_compat.capabilities.has(version): Parameter was removed",
                                       *unexcusable])
    _declare(root, names={"mcore_compat.capabilities.fact_row": "mcore_compat.capabilities._fact_row"},
             params={"mcore_compat.capabilities.has(version)": "release"})
    failures, notes = GEN.breaking_changes(old, GEN.listing(root))
    assert sorted(failures) == sorted(unexcusable)
    assert any("fact_row" in n and "deprecated alias" in n for n in notes), notes


def test_cli_check_names_the_break_then_the_stale_listing(work: tuple[Path, dict[str, Any]]) -> None:
    root, old = work
    (root / "api").mkdir()
    (root / "api" / "mcore_compat.json").write_text(GEN.render(old), encoding="utf-8")
    shutil.copytree(ROOT / "scripts", root / "scripts", ignore=shutil.ignore_patterns("__pycache__"))
    run = [sys.executable, str(root / "scripts" / "gen_api.py"), "--check"]
    _edit(root / "mcore_compat" / "capabilities.py", "def has(name: str, version:", "def has(name: str, release:")
    broken = subprocess.run(run, capture_output=True, text=True, check=False)
    assert broken.returncode == 1, broken.stderr
    assert broken.stderr.startswith("api BREAKING: mcore_compat.capabilities.has(version): Parameter was removed\n")
    _declare(root, params={"mcore_compat.capabilities.has(version)": "release"})
    stale = subprocess.run(run, capture_output=True, text=True, check=False)
    assert stale.returncode == 1 and "BREAKING" not in stale.stderr and "is stale" in stale.stderr
    bad = subprocess.run([*run[:2], "--root", str(root / "nowhere")], capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "no mcore_compat package" in bad.stderr


def test_committed_listing_parses_and_lists_the_deprecations() -> None:
    data = json.loads((ROOT / GEN.LISTING).read_text(encoding="utf-8"))
    assert data["format"] == 1
    assert "ddp_config" in data["deprecated"] and "ddp_config" in data["facts"]
    assert GEN.to_griffe(data).members["capabilities"].members["has"].parameters["version"].default == "None"
