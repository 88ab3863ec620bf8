"""``python -m mcore_compat.support``: see :mod:`mcore_compat.support.cli`."""

from .._util.pipes import exit_status
from .cli import main

raise SystemExit(exit_status(main))
