"""Capabilities as data: named facts about Megatron-Core that hold for a version range.

Adapters ask ``has("ddp_config")`` instead of comparing versions. The rows are in
:mod:`mcore_compat._capability_table`; each carries a probe that inspects the real installed module, and
``tests/test_surface_real.py`` asserts in every matrix session that each row's range agrees with its probe, so
the table cannot drift from the code it describes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from packaging.version import Version

from ._ranges import in_range, range_text

__all__ = ["Capability", "capabilities", "capability", "has", "resolved"]


@dataclass(frozen=True)
class Capability:
    """One named fact and where it holds.

    Attributes:
        name: identifier used by adapters (``has(name)``).
        versions: PEP 440 range of releases where it holds.
        description: what it means, for ``mcore-compat doctor``.
        probe: checks the fact against the installed ``megatron.core`` (imports it); used by the drift test
            and by ``doctor --probe``. Never used to decide behaviour at run time.
    """

    name: str
    versions: str
    description: str
    probe: Callable[[], bool]

    def holds_for(self, version: Version | str) -> bool:
        """Whether the table says this capability holds for ``version``."""
        return in_range(version, self.versions)

    def range(self) -> str:
        """Human-readable range."""
        return range_text(self.versions)


def capabilities() -> tuple[Capability, ...]:
    """Every row of the table."""
    from ._capability_table import CAPABILITIES

    return CAPABILITIES


def capability(name: str) -> Capability:
    """The row called ``name``.

    Raises:
        KeyError: with the list of known names.
    """
    for cap in capabilities():
        if cap.name == name:
            return cap
    raise KeyError(f"unknown capability {name!r}; known: {', '.join(c.name for c in capabilities())}")


def has(name: str, version: Version | str | None = None) -> bool:
    """Whether capability ``name`` holds for ``version`` (default: the detected megatron-core)."""
    if version is None:
        from .detect import detect

        version = detect().version
    return capability(name).holds_for(version)


def resolved(version: Version | str | None = None) -> dict[str, bool]:
    """``{name: holds}`` for every capability, for ``version`` (default: the detected one)."""
    if version is None:
        from .detect import detect

        version = detect().version
    return {cap.name: cap.holds_for(version) for cap in capabilities()}
