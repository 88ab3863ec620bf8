"""pytest setup for the Ray worker-group example: the PPO actor example's own (``examples/`` on ``sys.path``, the
root suite's skip rule for ``mcore`` tests and its ``rank_group`` fixture), which this example builds on."""

from __future__ import annotations

import sys
from pathlib import Path

_EXAMPLES = str(Path(__file__).resolve().parents[2])
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

from ppo_actor.tests.conftest import pytest_collection_modifyitems, pytest_configure  # noqa: E402

__all__ = ["pytest_collection_modifyitems", "pytest_configure"]
