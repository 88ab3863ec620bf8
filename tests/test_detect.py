"""Version detection on fake trees (no megatron-core needed): every way a release can be installed or checked
out."""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.version import Version

import mcore_compat
from mcore_compat._facts.ranges import feature_version, in_range
from mcore_compat.errors import MegatronNotFoundError

detect_mod = importlib.import_module("mcore_compat.detect")  # the module (mcore_compat.detect is the function)

PACKAGE_INFO = """\
MAJOR = {major}
MINOR = {minor}
PATCH = {patch}
PRE_RELEASE = {pre!r}
VERSION = (MAJOR, MINOR, PATCH, PRE_RELEASE)
__shortversion__ = '.'.join(map(str, VERSION[:3]))
__version__ = '.'.join(map(str, VERSION[:3])) + ''.join(VERSION[3:])
"""


def _tree(root: Path, version: str | None, *, explicit: str | None = None, init: bool = True) -> Path:
    """A minimal ``megatron/core`` tree under ``root`` (no ``megatron/__init__.py``, as in every release)."""
    core = root / "megatron" / "core"
    core.mkdir(parents=True)
    if init:
        (core / "__init__.py").write_text("raise RuntimeError('detection must not import megatron.core')\n")
    if explicit is not None:
        (core / "package_info.py").write_text(f"__version__ = {explicit!r}\n")
    elif version is not None:
        v = Version(version)
        pre = version[len(v.base_version):]
        (core / "package_info.py").write_text(
            PACKAGE_INFO.format(major=v.major, minor=v.minor, patch=v.micro, pre=pre))
    return core


def _dist_info(root: Path, version: str, name: str = "megatron_core") -> None:
    """Distribution metadata owning ``root/megatron/core/__init__.py``."""
    info = root / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n")
    (info / "RECORD").write_text("megatron/core/__init__.py,,\nmegatron/core/package_info.py,,\n")
    (info / "top_level.txt").write_text("megatron\n")


@pytest.fixture
def syspath(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """An isolated sys.path / sys.modules view for megatron; detection cache cleared before and after."""
    for mod in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "megatron" not in p])
    monkeypatch.delenv("MCORE_COMPAT_VERSION", raising=False)
    detect_mod.refresh()
    detect_mod._WARNED.clear()
    yield sys.path
    for mod in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        del sys.modules[mod]  # fake trees imported by a test must not leak into later tests
    detect_mod.refresh()


def test_not_installed_names_the_fix(syspath: list[str], tmp_path: Path) -> None:
    syspath.insert(0, str(tmp_path))  # nothing there
    with pytest.raises(MegatronNotFoundError) as err:
        mcore_compat.detect()
    assert "pip install megatron-core" in str(err.value)
    with pytest.raises(MegatronNotFoundError):
        _ = mcore_compat.MCORE_VERSION


def test_installed_wheel_uses_metadata(syspath: list[str], tmp_path: Path) -> None:
    core = _tree(tmp_path, "0.16.1")
    _dist_info(tmp_path, "0.16.1")
    syspath.insert(0, str(tmp_path))
    info = mcore_compat.detect()
    assert info.version == Version("0.16.1")
    assert info.source == "metadata"
    assert info.path == core.resolve()
    assert info.distribution == "megatron-core"
    assert not info.checkout and info.warnings == ()
    assert "megatron.core" not in sys.modules  # detection never imports the package


def test_checkout_without_metadata_and_without_dunder_version(syspath: list[str], tmp_path: Path) -> None:
    _tree(tmp_path, "0.4.0")  # 0.4-0.7 have no megatron.core.__version__, only package_info
    syspath.insert(0, str(tmp_path))
    info = mcore_compat.detect()
    assert info.version == Version("0.4.0")
    assert info.source == "package_info" and info.checkout and info.distribution is None


@pytest.mark.parametrize(
    ("raw", "feature"),
    [("0.20.0+abc123", "0.20.0"), ("0.15.0rc6", "0.15.0"), ("0.20.0.dev0", "0.20.0"),
     ("0.14.0rc0+git.1a2b3c", "0.14.0")],
)
def test_local_and_prerelease_versions(syspath: list[str], tmp_path: Path, raw: str, feature: str) -> None:
    _tree(tmp_path, None, explicit=raw)
    syspath.insert(0, str(tmp_path))
    info = mcore_compat.detect()
    assert info.version == Version(raw)
    assert feature_version(info.version) == Version(feature)


def test_rc_tag_in_pre_release_field(syspath: list[str], tmp_path: Path) -> None:
    _tree(tmp_path, "0.16.0rc1")
    syspath.insert(0, str(tmp_path))
    assert mcore_compat.detect().version == Version("0.16.0rc1")


def test_metadata_disagreeing_with_module_trusts_module_and_warns_once(syspath: list[str], tmp_path: Path) -> None:
    _tree(tmp_path, "0.16.0")
    _dist_info(tmp_path, "0.16.1")
    syspath.insert(0, str(tmp_path))
    with pytest.warns(UserWarning, match="trusting the imported module"):
        info = mcore_compat.detect()
    assert info.version == Version("0.16.0") and info.metadata_version == Version("0.16.1")
    assert info.source == "package_info"
    detect_mod.refresh()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second detection must not warn again
        assert mcore_compat.detect().version == Version("0.16.0")


def test_checkout_shadowing_an_installed_wheel(syspath: list[str], tmp_path: Path) -> None:
    wheel, checkout = tmp_path / "site", tmp_path / "checkout"
    _tree(wheel, "0.15.3")
    _dist_info(wheel, "0.15.3")
    core = _tree(checkout, None, explicit="0.20.0rc0+abc123")
    syspath[:0] = [str(checkout), str(wheel)]
    with pytest.warns(UserWarning, match="does not own"):
        info = mcore_compat.detect()
    assert info.version == Version("0.20.0rc0+abc123")
    assert info.path == core.resolve() and info.checkout
    assert info.metadata_version == Version("0.15.3")


def test_metadata_only_when_package_info_missing(syspath: list[str], tmp_path: Path) -> None:
    _tree(tmp_path, None)
    _dist_info(tmp_path, "0.9.0")
    syspath.insert(0, str(tmp_path))
    info = mcore_compat.detect()
    assert info.version == Version("0.9.0") and info.source == "metadata"


def test_no_version_anywhere_is_an_error_not_zero(syspath: list[str], tmp_path: Path) -> None:
    _tree(tmp_path, None)
    syspath.insert(0, str(tmp_path))
    with pytest.raises(MegatronNotFoundError, match="cannot tell the version"):
        mcore_compat.detect()


def test_an_unreadable_version_names_the_tree_and_the_override_names_its_version(
        syspath: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    core = _tree(tmp_path, None, explicit="dev-build")
    syspath.insert(0, str(tmp_path))
    with pytest.raises(detect_mod.MegatronVersionUnknownError, match="cannot tell the version") as err:
        mcore_compat.detect()
    assert err.value.found_at == core.resolve() and "'dev-build'" in str(err.value)
    assert "MCORE_COMPAT_VERSION=" in str(err.value)
    monkeypatch.setenv("MCORE_COMPAT_VERSION", "0.16.1")  # what the message says to do now works
    detect_mod.refresh()
    info = mcore_compat.detect()
    assert info.version == Version("0.16.1") and info.source == "MCORE_COMPAT_VERSION" and info.path == core.resolve()
    monkeypatch.setenv("MCORE_COMPAT_VERSION", "latest")
    detect_mod.refresh()
    with pytest.raises(ValueError, match="MCORE_COMPAT_VERSION='latest' is not a valid version"):
        mcore_compat.detect()


def test_directory_without_init_is_not_an_install(syspath: list[str], tmp_path: Path) -> None:
    _tree(tmp_path, "0.16.1", init=False)
    syspath.insert(0, str(tmp_path))
    with pytest.raises(MegatronNotFoundError, match=r"without __init__\.py"):
        mcore_compat.detect()


def test_already_imported_module_wins(syspath: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    core = _tree(tmp_path, "0.16.1")
    (core / "__init__.py").write_text("__version__ = '0.16.1'\n")
    syspath.insert(0, str(tmp_path))
    import megatron.core  # noqa: F401  (the fake tree; safe to import)

    info = mcore_compat.detect()
    assert info.version == Version("0.16.1") and info.source == "__version__"


def test_override_env(syspath: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _tree(tmp_path, "0.16.1")
    syspath.insert(0, str(tmp_path))
    monkeypatch.setenv("MCORE_COMPAT_VERSION", "0.16.0")
    # a readable version disagreeing with the variable: an error naming both, not a silent override
    with pytest.raises(ValueError, match=r"MCORE_COMPAT_VERSION=0.16.0 disagrees with the installed megatron-core "
                                         r"0.16.1 at .*; unset MCORE_COMPAT_VERSION"):
        mcore_compat.detect()
    monkeypatch.setenv("MCORE_COMPAT_VERSION", "0.16.1")  # agreeing: fine
    assert mcore_compat.detect().version == Version("0.16.1")


def test_versions_compare_as_versions_not_strings() -> None:
    assert in_range("0.10.0", ">=0.9")  # "0.10.0" < "0.9" as strings
    assert not in_range("0.9.0", ">=0.10")
    assert in_range("0.15.0rc6", ">=0.15,<0.16")  # an rc of a minor has that minor's API
    assert in_range("0.20.0+abc123", ">=0.19")
    with pytest.raises(ValueError, match="not a valid PEP 440"):
        feature_version("latest")
