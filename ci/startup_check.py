"""The start-up check of a release session, run by the base interpreter before pytest.

``python -P ci/startup_check.py VERSION MC_DIR MCC_DIR REPORT_JSON`` with ``PYTHONPATH=MC_DIR:MCC_DIR``.
It fails unless mcore_compat is imported from the installed copy in ``MCC_DIR`` and megatron-core ``VERSION`` is
found in ``MC_DIR`` (and torch is installed), then writes what the session runs on (Python, torch, megatron-core,
apex, ...) to ``REPORT_JSON`` (recorded in ``matrix/results.json``).

It imports neither torch nor megatron.core: both are located the way ``import`` would locate them (``find_spec``;
megatron-core's version from its ``package_info.py``, torch's from ``torch/version.py``). pytest, which runs next, imports
them in every test process; importing them here as well cost each session 4-15 s of a 2-core machine.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import importlib.util
import json
import platform
import sys
from pathlib import Path


def _inside(path: str | Path, root: Path) -> bool:
    resolved = Path(path).resolve()
    return resolved == root or root in resolved.parents


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            pass
    return None


def _declared_version(path: Path) -> str:
    """The ``__version__`` that ``path`` (e.g. ``torch/version.py``) assigns, read without importing it: torch's
    carries its build (``2.13.0+cpu``, ``2.13.0+cu130``), which its distribution metadata may not."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__version__" for t in targets) and node.value is not None:
                return str(ast.literal_eval(node.value))
    raise AssertionError(f"{path} assigns no __version__")


def check(want: str, mc_dir: Path, mcc_dir: Path) -> dict[str, object]:
    """Import mcore_compat, locate torch and megatron.core (without importing them) and check where they are.

    Args:
        want: the megatron-core version the session tests.
        mc_dir: the release's ``--target`` tree.
        mcc_dir: the installed mcore-compat.

    Returns:
        The report (each value a string or ``None``).

    Raises:
        AssertionError: something was imported from the wrong place or is the wrong version.
    """
    import mcore_compat

    assert _inside(mcore_compat.__file__, mcc_dir), (
        f"mcore_compat was imported from {mcore_compat.__file__}, not from the installed copy in {mcc_dir}")
    info = mcore_compat.detect()
    assert str(info.version) == want, (
        f"mcore_compat.detect() reports megatron-core {info.version}, the session wants {want}: {info.describe()}")
    assert _inside(info.path, mc_dir), (
        f"mcore_compat.detect() found megatron.core in {info.path}, not in {mc_dir}")
    core = importlib.util.find_spec("megatron.core")  # imports the namespace package megatron only
    assert core is not None and core.origin is not None and _inside(core.origin, mc_dir), (
        f"megatron.core would be imported from {core.origin if core else None}, not from {mc_dir}")
    torch = importlib.util.find_spec("torch")
    assert torch is not None and torch.origin is not None, f"torch is not installed for {sys.executable}"
    torch_version = _declared_version(Path(torch.origin).parent / "version.py")
    return {
        "python": platform.python_version(),
        "executable": sys.executable,
        "torch": torch_version,
        "megatron_core": str(info.version),
        "megatron_source": info.source,
        "megatron_path": str(info.path),
        "megatron_checkout": info.checkout,
        "mcore_compat": getattr(mcore_compat, "__version__", "?"),
        "mcore_compat_path": str(Path(mcore_compat.__file__).parent),
        "apex": _dist_version("apex") or ("present" if importlib.util.find_spec("apex") else None),
        "transformer_engine": _dist_version("transformer-engine", "transformer_engine")
        or ("present" if importlib.util.find_spec("transformer_engine") else None),
        "numpy": _dist_version("numpy"),
        "setuptools": _dist_version("setuptools"),
    }


def main(argv: list[str]) -> int:
    """Run the check, print the report and write it to the JSON file."""
    want, mc_dir, mcc_dir, report_path = argv[0], Path(argv[1]).resolve(), Path(argv[2]).resolve(), argv[3]
    report = check(want, mc_dir, mcc_dir)
    for key, value in report.items():
        print(f"  {key:<18} {value}")
    with open(report_path, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=2)
    print(f"start-up check OK: megatron-core {want} from {mc_dir}, mcore_compat from {mcc_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
