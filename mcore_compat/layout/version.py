"""Which megatron-core release a layout is for: the installed one by default, never older than 0.4.0."""

from __future__ import annotations

from typing import Final

from packaging.version import Version

from .._ranges import feature_version
from ..errors import UnsupportedVersionError

__all__ = ["MIN_VERSION", "resolve_version"]

#: The oldest release the buffer-layout table covers.
MIN_VERSION: Final = Version("0.4.0")


def resolve_version(version: Version | str | None) -> Version:
    """The release to lay buffers out for, as a feature version (pre/dev/post/local parts dropped).

    Args:
        version: a release, or ``None`` for the installed megatron-core.

    Returns:
        The release as compared against :data:`~mcore_compat.layout.LAYOUT_FACTS`' ranges.

    Raises:
        UnsupportedVersionError: ``version`` is older than 0.4.0.
        MegatronNotFoundError: ``version`` is ``None`` and no megatron-core is installed.
    """
    if version is None:
        from ..detect import detect

        version = detect().version
    v = feature_version(version)
    if v < MIN_VERSION:
        raise UnsupportedVersionError(f"megatron-core {version} is older than 0.4.0, which mcore-compat does not support")
    return v
