"""``python -m mcore_compat.support``: see :mod:`mcore_compat.support.cli`."""

from .cli import main

raise SystemExit(main())
