"""``python -m mcore_compat`` = the ``mcore-compat`` command."""

from .cli import main

raise SystemExit(main())
