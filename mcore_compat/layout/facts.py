"""The version-dependent facts of Megatron-Core's flat grad/param buffers: :data:`LAYOUT_FACTS` and :func:`layout_fact`.

The facts are rows of the one fact table (:mod:`mcore_compat._facts.table`, its buffer-layout section), each with
a probe of the Megatron file it is read from; the code of :mod:`mcore_compat.layout` looks them up here instead of
comparing versions.
"""

from __future__ import annotations

from typing import Any, Final

from packaging.version import Version

from .._facts.rows import Fact
from .._facts.table import FACTS, LAYOUT_FACT_NAMES
from ..capabilities import fact
from ..errors import UnknownFactError

__all__ = ["LAYOUT_FACTS", "layout_fact"]

#: fact name -> :class:`~mcore_compat._facts.rows.Fact` (rows of ``(version range -> value)``): the buffer-layout part
#: of the fact table.
LAYOUT_FACTS: Final[dict[str, Fact[Any]]] = {name: FACTS[name] for name in LAYOUT_FACT_NAMES}


def layout_fact(name: str, version: Version | str) -> Any:
    """The value of the buffer-layout fact ``name`` for ``version``.

    Args:
        name: a key of :data:`LAYOUT_FACTS`.
        version: the release.

    Returns:
        The value of the row covering ``version``.

    Raises:
        UnknownFactError: (a ``KeyError``) ``name`` is no buffer-layout fact.
        UnsupportedVersionError: no row covers ``version`` (older than 0.4.0).
    """
    if name not in LAYOUT_FACTS:
        raise UnknownFactError(f"unknown layout fact {name!r}; known: {', '.join(LAYOUT_FACTS)}")
    return fact(name, version)
