"""Exceptions raised by mcore-compat. Every message says what is wrong and what to do.

Every exception mcore-compat raises on purpose derives from :class:`McoreCompatError` (itself a
:class:`RuntimeError`), so ``except McoreCompatError`` catches them all. Errors that replace a standard exception keep
it as a second base, so code written against the standard one keeps working:

* :class:`InvalidArgumentError` (also a :class:`ValueError`): an argument, an option or an environment variable has
  a value mcore-compat cannot use, or arguments that do not go together;
* :class:`InvalidTypeError` (also a :class:`TypeError`): a value of a type mcore-compat cannot use, or an argument a
  function does not take;
* :class:`NotFoundError` (also a :class:`KeyError`): a name or key looked up in one of mcore-compat's tables is not
  there (:class:`UnknownFactError` for facts and capabilities);
* :class:`NameUnavailableError` (also an :class:`ImportError`): a module or name imported through the mirror
  :mod:`mcore_compat.core` that the installed release does not have;
* :class:`UnsupportedFeatureError` (also a :class:`NotImplementedError`): mcore-compat's stand-in for a missing
  library (the apex and TransformerEngine stubs) or a patched Megatron class does not provide what was called.

The other modules define errors of their own on the same base: ``BindingError`` (:mod:`mcore_compat.binding`),
``LayoutError`` (:mod:`mcore_compat.layout`), ``MissingTrainingHookError`` (:mod:`mcore_compat.training`),
``OffloadError`` (:mod:`mcore_compat.lifecycle`), ``CheckpointError`` and its subclasses (:mod:`mcore_compat.checkpoint`),
``RankFailure``/``RankTimeout`` (:mod:`mcore_compat.launch`), ``UsageError`` (:mod:`mcore_compat.selfcheck`),
``MatrixFileError``/``MatrixNotFoundError`` (:mod:`mcore_compat.support`).

This module imports nothing (``mcore_compat.support`` loads it from its file when it is loaded on its own).
"""

from __future__ import annotations

__all__ = [
    "InvalidArgumentError",
    "InvalidTypeError",
    "McoreCompatError",
    "MegatronNotFoundError",
    "MissingExtraError",
    "NameUnavailableError",
    "NotFoundError",
    "PatchError",
    "PatchRefusedError",
    "ReadOnlyFileError",
    "SymbolUnavailableError",
    "UnknownFactError",
    "UnsupportedFeatureError",
    "UnsupportedVersionError",
]


class McoreCompatError(RuntimeError):
    """Base class of every error raised by mcore-compat."""


class InvalidArgumentError(McoreCompatError, ValueError):
    """An argument, option or environment variable has a value mcore-compat cannot use, or arguments that do not go
    together were passed. Also a :class:`ValueError`."""


class InvalidTypeError(McoreCompatError, TypeError):
    """A value of a type mcore-compat cannot use, or an argument the function does not take. Also a
    :class:`TypeError`."""


class NotFoundError(McoreCompatError, KeyError):
    """A name or key looked up in one of mcore-compat's tables is not there; the message lists what is. Also a
    :class:`KeyError` (whose ``str()`` is the message itself, not its ``repr()``)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class UnknownFactError(NotFoundError):
    """A fact or capability name that is not in mcore-compat's table."""


class UnsupportedFeatureError(McoreCompatError, NotImplementedError):
    """mcore-compat's stand-in for a library that is not installed (the apex and TransformerEngine stubs), or a
    Megatron class mcore-compat patched, does not provide what was called. Also a :class:`NotImplementedError`."""


class MegatronNotFoundError(McoreCompatError, ImportError):
    """megatron-core is not importable."""


class NameUnavailableError(McoreCompatError, ImportError):
    """A module or name of Megatron's layout, imported through the mirror (``from mcore_compat.core.x import y``),
    that the installed megatron-core has neither at that path nor where it moved; the message names the releases
    that have it. Also an :class:`ImportError`, so ``try: ... except ImportError:`` feature checks work unchanged.
    ``name`` is the module imported from, ``symbol`` the name (``None`` for a module), ``releases`` the releases
    that have it."""

    def __init__(self, message: str, *, name: str | None = None, symbol: str | None = None,
                 releases: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.msg = message
        self.name = name
        self.symbol = symbol
        self.releases = releases


class MissingExtraError(McoreCompatError, ImportError):
    """A feature needs an optional dependency that is not installed (the message names the extra to install)."""


class ReadOnlyFileError(McoreCompatError, PermissionError):
    """A file mcore-compat was asked to rewrite (``scan --fix``) cannot be written."""


class UnsupportedVersionError(McoreCompatError):
    """The installed megatron-core is outside what mcore-compat supports, or a feature needs another version."""


class SymbolUnavailableError(McoreCompatError, AttributeError):
    """A symbol of the import surface does not exist in the installed megatron-core."""


class PatchError(McoreCompatError):
    """A runtime patch was asked for outside its versions, or failed its check."""


class PatchRefusedError(PatchError):
    """A runtime patch was refused: outside its versions, its check failed, or the Megatron code it changes is not
    the code it was written for (its fingerprint is not recorded for the patch)."""
