"""Exceptions raised by mcore-compat. Every message says what is wrong and what to do."""

from __future__ import annotations

__all__ = [
    "McoreCompatError",
    "MegatronNotFoundError",
    "PatchError",
    "PatchRefusedError",
    "SymbolUnavailableError",
    "UnknownFactError",
    "UnsupportedVersionError",
]


class McoreCompatError(RuntimeError):
    """Base class of every error raised by mcore-compat."""


class MegatronNotFoundError(McoreCompatError, ImportError):
    """megatron-core is not importable."""


class UnsupportedVersionError(McoreCompatError):
    """The installed megatron-core is outside what mcore-compat supports, or a feature needs another version."""


class SymbolUnavailableError(McoreCompatError, AttributeError):
    """A symbol of the import surface does not exist in the installed megatron-core."""


class UnknownFactError(McoreCompatError, KeyError):
    """A fact or capability name that is not in mcore-compat's table."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class PatchError(McoreCompatError):
    """A runtime patch was asked for outside its versions, or failed its check."""


class PatchRefusedError(PatchError):
    """A runtime patch was refused: outside its versions, its check failed, or the Megatron code it changes is not
    the code it was written for (its fingerprint is not recorded for the patch)."""
