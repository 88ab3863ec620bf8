"""Which megatron-core release a layout is for: the installed one by default, one the buffer-layout facts cover."""

from __future__ import annotations

from packaging.version import Version

from .._facts.ranges import feature_version
from .._util.deprecated import warn_deprecated_name
from ..errors import UnsupportedVersionError
from .facts import LAYOUT_FACTS

__all__ = ["resolve_version"]


def resolve_version(version: Version | str | None) -> Version:
    """The release to lay buffers out for, as a feature version (pre/dev/post/local parts dropped).

    Args:
        version: a release, or ``None`` for the installed megatron-core.

    Returns:
        The release as compared against :data:`~mcore_compat.layout.LAYOUT_FACTS`' ranges.

    Raises:
        UnsupportedVersionError: no row of the buffer-layout facts covers ``version`` (older than 0.4.0).
        MegatronNotFoundError: ``version`` is ``None`` and no megatron-core is installed.
    """
    if version is None:
        from ..detect import detect

        version = detect().version
    v = feature_version(version)
    uncovered = [entry for entry in LAYOUT_FACTS.values() if entry.row_for(v) is None]
    if uncovered:
        raise UnsupportedVersionError(
            f"megatron-core {version} is not covered by the buffer-layout facts (fact {uncovered[0].name!r} "
            f"covers {uncovered[0].where(lambda _: True)}); mcore-compat does not support it")
    return v


def __getattr__(name: str) -> Version:
    """``MIN_VERSION`` (0.4.0, the oldest release the buffer-layout facts cover): deprecated, it warns once."""
    if name == "MIN_VERSION":
        warn_deprecated_name(f"{__name__}.MIN_VERSION")
        return Version("0.4.0")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
