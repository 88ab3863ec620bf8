"""The mirror of ``megatron.core``: ``from mcore_compat.core.optimizer import X`` is ``from megatron.core.optimizer
import X`` on every release that has ``X`` at that path or where it moved (see :mod:`mcore_compat._facts.mirror`).

Nothing of Megatron is imported until a name is used; names are Megatron's own objects.
"""

import sys as _sys

from .._facts.mirror import install_root as _install_root

_install_root(_sys.modules[__name__])
del _install_root, _sys
