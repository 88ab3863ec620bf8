"""Lookups over the generated config-field data (``fields.py``): which fields a config class has in a
release, what a renamed field is called there, a field's default, and a drift check against a real class.

Nothing here imports Megatron; the real class is passed in where one is needed (:func:`drift`).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
from functools import cache
from typing import Any

from packaging.version import Version

from .._facts.ranges import feature_version, in_range, range_text
from ..errors import InvalidArgumentError
from . import fields as _data

__all__ = ["NO_DEFAULT", "class_exists", "close_matches", "config_classes", "default_near", "drift",
           "existence_text", "family", "fields_in", "is_known"]


class _NoDefault:
    """The default of a field that has none, or one that is not a literal: equal to nothing."""

    def __repr__(self) -> str:
        return "<no literal default>"


#: Returned by :func:`default_near` when the nearest release's default is not known as a literal.
NO_DEFAULT: Any = _NoDefault()


def config_classes() -> tuple[str, ...]:
    """The config classes the data covers (``"TransformerConfig"``, ...)."""
    return tuple(_data.CLASSES)


def _rows(cls: str) -> dict[str, tuple[tuple[str, str | None], ...]]:
    try:
        return _data.FIELDS[cls]
    except KeyError:
        raise InvalidArgumentError(f"no field data for config class {cls!r}; known: "
                                   f"{', '.join(_data.CLASSES)}") from None


def class_exists(cls: str, version: str | Version) -> bool:
    """Whether megatron-core ``version`` has the config class ``cls``."""
    return any(in_range(version, spec) for spec in _data.CLASSES[cls][1])


def is_known(cls: str, name: str) -> bool:
    """Whether ``name`` is a field of ``cls`` in some release."""
    return name in _rows(cls)


def fields_in(cls: str, version: str | Version) -> frozenset[str]:
    """The fields of ``cls`` in ``version`` according to the data (empty where the class does not exist)."""
    return frozenset(name for name, rows in _rows(cls).items() if any(in_range(version, r) for r, _ in rows))


@cache
def _families(cls: str) -> dict[str, tuple[str, ...]]:
    """Each renamed field's names, oldest first (``old -> new`` pairs chained)."""
    newer = dict(_data.RENAMES.get(cls, ()))
    older = {new: old for old, new in newer.items()}
    out: dict[str, tuple[str, ...]] = {}
    for name in set(newer) | set(older):
        first = name
        while first in older:
            first = older[first]
        chain = [first]
        while chain[-1] in newer:
            chain.append(newer[chain[-1]])
        out[name] = tuple(chain)
    return out


def family(cls: str, name: str) -> tuple[str, ...]:
    """Every name the field ``name`` of ``cls`` has had, oldest first (``(name,)`` when it was never renamed)."""
    return _families(cls).get(name, (name,))


def _merged(ranges: list[str]) -> list[str]:
    """Adjacent ranges joined: ``[">=0.5,<0.6", ">=0.6"]`` -> ``[">=0.5"]`` (ranges as the generator writes
    them: ``">=X"`` or ``">=X,<Y"``)."""
    out: list[str] = []
    for spec in ranges:
        low, _, high = spec.partition(",")
        if out:
            prev_low, _, prev_high = out[-1].partition(",")
            if prev_high and prev_high == "<" + low.removeprefix(">="):
                out[-1] = prev_low + ("," + high if high else "")
                continue
        out.append(spec)
    return out


def existence_text(cls: str, names: tuple[str, ...]) -> str:
    """Where the field called ``names`` exists, for messages: ``"TransformerConfig.apply_rope_fusion exists in
    v >= 0.5"``; a renamed field names each of its names with its releases."""
    parts = []
    for name in reversed(names):
        rows = _rows(cls).get(name, ())
        if rows:
            where = " and ".join(range_text(r) for r in _merged([r for r, _ in rows]))
            parts.append(f"{name} in {where}")
    if not parts:
        return f"no release has {cls}.{names[-1]}"
    return f"{cls} has " + "; ".join(parts)


def default_near(cls: str, names: tuple[str, ...], version: str | Version) -> Any:
    """The default of the field called ``names`` in the listed release nearest to ``version`` that has it (the
    newer one on a tie): the behaviour of a release without the field (the release that added it kept the old
    behaviour as its default; the one that removed it had settled on its last default). :data:`NO_DEFAULT` when
    that default is not a literal."""
    releases = [Version(r) for r in _data.RELEASES]
    here = feature_version(version)
    # positions on a line of half steps: listed release j at 2j, the installed one at 2i (listed) or between
    position = 2 * releases.index(here) if here in releases else 2 * sum(r < here for r in releases) - 1
    best: tuple[tuple[int, int], str | None] | None = None
    for name in names:
        for spec, text in _rows(cls).get(name, ()):
            for j, release in enumerate(releases):
                if in_range(release, spec):
                    key = (abs(2 * j - position), -j)
                    if best is None or key < best[0]:
                        best = (key, text)
    if best is None or best[1] is None:
        return NO_DEFAULT
    return ast.literal_eval(best[1])


def close_matches(cls: str, name: str) -> list[str]:
    """Field names of ``cls`` (any release) close to ``name``, best first."""
    return difflib.get_close_matches(name, list(_rows(cls)), n=3, cutoff=0.6)


def drift(cls: str, real: Any, version: str | Version) -> list[str]:
    """Where the data for ``version`` disagrees with the real dataclass ``real`` of that release (``None`` where
    the release has no such class): fields missing or extra, and literal defaults that differ. Empty: it agrees.
    """
    fix = "regenerate mcore_compat/_translate/fields.py with scripts/gen_config_fields.py"
    if real is None or not dataclasses.is_dataclass(real):
        return [f"the data says megatron-core {version} has {cls}, the release has none; {fix}"] \
            if class_exists(cls, version) else []
    if not class_exists(cls, version):
        return [f"the data says megatron-core {version} has no {cls}, the release has one; {fix}"]
    said = fields_in(cls, version)
    found = {f.name: f for f in dataclasses.fields(real)}
    problems = [f"{cls}.{name}: megatron-core {version} has this field, the data says it does not; {fix}"
                for name in sorted(set(found) - said)]
    problems += [f"{cls}.{name}: the data says megatron-core {version} has this field (rows "
                 f"{_rows(cls)[name]}), the release does not; {fix}" for name in sorted(said - set(found))]
    for name in sorted(said & set(found)):
        text = next(t for spec, t in _rows(cls)[name] if in_range(version, spec))
        if text is None:
            continue
        f = found[name]
        if f.default is not dataclasses.MISSING:
            actual = f.default
        elif f.default_factory is not dataclasses.MISSING and text in ("[]", "{}", "()", "set()"):
            actual = f.default_factory()
        else:
            problems.append(f"{cls}.{name}: the data says megatron-core {version} defaults it to {text}, the "
                            f"release gives no default; {fix}")
            continue
        expected = ast.literal_eval(text)
        if type(actual) is not type(expected) or actual != expected:
            problems.append(f"{cls}.{name}: the data says megatron-core {version} defaults it to {text}, the "
                            f"release to {actual!r}; {fix}")
    return problems
