"""Packaging: every subpackage ships, patches/ and matrix/ are installed under mcore_compat, the CLI is wired."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_subpackage_is_listed() -> None:
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "mcore_compat").rglob("__init__.py")}
    assert on_disk <= listed, f"add to pyproject [tool.setuptools].packages: {sorted(on_disk - listed)}"


def test_patches_and_matrix_are_mapped_into_the_package() -> None:
    package_dir = _pyproject()["tool"]["setuptools"]["package-dir"]
    assert package_dir["mcore_compat.patches"] == "patches"
    assert package_dir["mcore_compat.matrix"] == "matrix"
    assert (ROOT / "patches" / "__init__.py").is_file() and (ROOT / "matrix" / "versions.toml").is_file()


def test_console_script_and_module_entry() -> None:
    assert _pyproject()["project"]["scripts"]["mcore-compat"] == "mcore_compat.cli:main"
    out = subprocess.run([sys.executable, "-m", "mcore_compat", "--version"], capture_output=True, text=True,
                         check=True)
    assert out.stdout.startswith("mcore-compat ")


def test_import_does_not_import_megatron_or_patch_anything() -> None:
    code = ("import sys, torch; before = torch.cuda.current_device; import mcore_compat; "
            "assert not any(m.startswith('megatron') for m in sys.modules), 'megatron imported'; "
            "assert torch.cuda.current_device is before, 'patched on import'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
