"""pytest setup for the PPO-actor example: ``examples/`` on ``sys.path`` (here and, through multiprocessing, in the
spawned ranks), the root suite's rule that ``mcore``-marked tests are skipped without megatron-core, and its
session-wide ``rank_group`` fixture."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

_EXAMPLES = Path(__file__).resolve().parents[2]
_ROOT_CONFTEST = _EXAMPLES.parent / "tests" / "conftest.py"

if str(_EXAMPLES) not in sys.path:
    sys.path.insert(0, str(_EXAMPLES))
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _load_root_conftest() -> object:
    spec = importlib.util.spec_from_file_location("_mcore_compat_root_conftest", _ROOT_CONFTEST)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_ROOT = _load_root_conftest()
#: The root tests/conftest.py hooks: skip ``mcore`` tests (with the reason) when megatron-core is not importable;
#: the session's shared ``rank_group`` fixture (one group of 2 ranks for both suites when run together).
pytest_collection_modifyitems = _ROOT.pytest_collection_modifyitems  # type: ignore[attr-defined]
pytest_configure = _ROOT.pytest_configure  # type: ignore[attr-defined]
