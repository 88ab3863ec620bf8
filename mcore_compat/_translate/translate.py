"""The field-translation engine: keyword arguments for the installed config class from field names of any release.

Below both the public builders (``mcore_compat/configs.py``, which re-exports :func:`translate_fields`) and the
training-step modules (``mcore_compat/training/``), which use it for what the installed release lacks
(:func:`drop_or_raise`). It reads the generated field data (``names``) and the harmless-if-missing table
(``effects``); it imports nothing of ``configs`` or ``training``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from packaging.version import Version

from ..errors import InvalidArgumentError, UnsupportedVersionError
from ..rank0 import warn_once_rank_0
from .effects import harmless_if_missing
from .names import close_matches, default_near, existence_text, family, fields_in, is_known

__all__ = ["drop_or_raise", "translate_fields"]


def drop_or_raise(name: str, value: Any, default: Any, version: Version, *, harmful: bool, why: str) -> None:
    """Handle an argument the installed release cannot take.

    ``value == default`` is dropped silently; otherwise a warning (once, rank 0) when ignoring it does not change
    results, or :class:`~mcore_compat.errors.UnsupportedVersionError` when it would.
    """
    if value is default or value == default:
        return
    if harmful:
        raise UnsupportedVersionError(
            f"`{name}={value!r}` cannot be honoured by megatron-core {version}: {why}. Ignoring it would change "
            f"the results; remove it or use a release that supports it."
        )
    warn_once_rank_0(f"mcore_compat: `{name}={value!r}` has no effect on megatron-core {version} ({why}); ignored.")


def translate_fields(cls: str, fields: Mapping[str, Any], version: Version,
                     present: Collection[str] | None = None) -> dict[str, Any]:
    """The keyword arguments for the installed ``cls`` from ``fields`` named as in any release.

    Args:
        cls: the config class (``"TransformerConfig"``, ``"DistributedDataParallelConfig"``,
            ``"OptimizerConfig"``).
        fields: field names (of any release, old or new name of a renamed field) to values.
        version: the installed release (for messages, defaults and, without ``present``, the fields).
        present: the fields the installed class really has (``dataclasses.fields``); default: what the generated
            data says for ``version``. A name the data does not know but ``present`` has is passed on.

    Returns:
        ``{installed name: value}`` for the fields the release has.

    Raises:
        InvalidArgumentError: a name no release has, or two names of one renamed field with different values.
        UnsupportedVersionError: a field the release lacks, set to a value that is not its default, whose absence
            would change results.
    """
    have = fields_in(cls, version) if present is None else frozenset(present)
    given: dict[str, tuple[str, Any]] = {}  # newest name of the field -> (name given, value)
    for name, value in fields.items():
        if not is_known(cls, name) and name not in have:
            hint = close_matches(cls, name)
            raise InvalidArgumentError(
                f"{cls} has no field {name!r} in any megatron-core release"
                + (f"; did you mean {' or '.join(map(repr, hint))}?" if hint else ""))
        names = family(cls, name)
        if names[-1] in given:
            first, other = given[names[-1]]
            if other is not value and other != value:
                raise InvalidArgumentError(
                    f"`{first}={other!r}` and `{name}={value!r}` set the same {cls} field (renamed: "
                    f"{' -> '.join(names)}) to different values; pass one of them")
        given[names[-1]] = (name, value)
    out: dict[str, Any] = {}
    for newest, (name, value) in given.items():
        names = family(cls, newest)
        here = [n for n in names if n in have]
        if here:
            out[here[-1]] = value
            continue
        drop_or_raise(name, value, default_near(cls, names, version), version,
                      harmful=not any(harmless_if_missing(cls, n) for n in names),
                      why=existence_text(cls, names))
    return out
