"""The start-up check of a release session, run by the base interpreter before pytest.

``python -P ci/startup_check.py VERSION MC_DIR MCC_DIR REPORT_JSON`` with ``PYTHONPATH=MC_DIR:MCC_DIR``.
It fails unless mcore_compat is imported from the installed copy in ``MCC_DIR`` and megatron-core ``VERSION`` from
``MC_DIR``, then writes what the session runs on (Python, torch, megatron-core, apex, ...) to ``REPORT_JSON``
(recorded in ``matrix/results.json``).
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import os
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


def check(want: str, mc_dir: Path, mcc_dir: Path) -> dict[str, object]:
    """Import mcore_compat, torch and megatron.core and check where they come from.

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
    import torch

    # 0.15.x JIT-builds a CUDA extension on import unless this is set (mcore_compat's patches handle it in the tests).
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    import megatron.core

    assert _inside(megatron.core.__file__, mc_dir), (
        f"megatron.core was imported from {megatron.core.__file__}, not from {mc_dir}")
    return {
        "python": platform.python_version(),
        "executable": sys.executable,
        "torch": torch.__version__,
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
