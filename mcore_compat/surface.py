"""Megatron-Core's modules and importable names in every supported release, and where each name moved.

The data is generated from the release wheels by ``scripts/gen_surface.py`` (``mcore_compat/_facts/surface_data.py``:
``ast``, nothing imported) and checked against the installed release in every matrix session. This module answers
questions about it without importing Megatron::

    from mcore_compat import surface

    surface.locate("megatron.core.transformer.custom_layers.transformer_engine", "TENorm", "0.19.2")
    # Where(module='megatron.core.extensions.transformer_engine', moved=True)
    surface.releases_having("megatron.core.optimizer", "OptimizerConfig")   # ('0.6.0', ..., '0.19.2')
    surface.names("megatron.core.optimizer", "0.8.0")["OptimizerConfig"]   # 'class'

A *release* argument is a version string or :class:`packaging.version.Version`, looked up as its release
(``0.15.0rc6`` as ``0.15.0``, see :mod:`mcore_compat._facts.ranges`); ranges are open-ended upwards, so a release newer
than the matrix answers as the newest one read. Module paths are Megatron's (``megatron.core.x.y``).

A name is *at* a module in a release when the module binds it at module level there (a definition, a re-export,
or, for a package, a submodule). A name that left a module is followed along its moves (links both ways, found by
matching name and kind across releases): :func:`locate` says where the name is in a release, at the path asked
for (``moved=False``) or elsewhere (``moved=True``). The mirror :mod:`mcore_compat.core` resolves its imports with
:func:`locate`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from packaging.version import Version

from ._facts.ranges import in_range

if TYPE_CHECKING:  # pragma: no cover
    from ._facts import surface_read as _surface_read

__all__ = [
    "KEY_MODULES",
    "KINDS",
    "Where",
    "drift",
    "has_module",
    "is_package",
    "kind",
    "links",
    "locate",
    "module_ranges",
    "modules",
    "moved_names",
    "name_ranges",
    "names",
    "range_summary",
    "releases",
    "releases_having",
    "releases_having_module",
]

#: The kinds of names: a class, a function, a module-level variable, a module (a re-exported module or a
#: submodule of a package), or ``import``: a re-export from outside ``megatron.core`` that the module lists in
#: ``__all__`` (or one whose target the script did not find).
KINDS: tuple[str, ...] = ("class", "function", "variable", "module", "import")

@dataclass(frozen=True)
class Where:
    """Where a name is in one release: ``module`` (Megatron's path) and whether that is another module than the
    one asked for (``moved``)."""

    module: str
    moved: bool


def _data() -> ModuleType:
    """The generated module, loaded on first use."""
    from ._facts import surface_data as _surface_data

    return _surface_data


def releases() -> tuple[str, ...]:
    """The releases the data was read from, oldest first (those of ``matrix/versions.toml``)."""
    return tuple(_data().RELEASES)


@cache
def _member(version: str, ranges: str) -> bool:
    """Whether ``version`` lies in one of the space-separated ``ranges``."""
    return any(in_range(version, r) for r in ranges.split())


def _v(release: str | Version) -> str:
    return str(release)


@cache
def _module_row(module: str) -> tuple[bool, str] | None:
    text = _data().MODULES.get(module)
    if text is None:
        return None
    package = text.startswith("package ")
    return package, text.removeprefix("package ")


def modules(release: str | Version | None = None) -> list[str]:
    """The modules of ``release`` (of any release read when ``None``), sorted."""
    if release is None:
        return sorted(_data().MODULES)
    return sorted(m for m in _data().MODULES if _has_module(m, _v(release)))


def module_ranges(module: str) -> tuple[str, ...]:
    """The release ranges where ``module`` exists (empty: in no release read)."""
    row = _module_row(module)
    return tuple(row[1].split()) if row else ()


def is_package(module: str) -> bool:
    """Whether ``module`` is a package (in some release)."""
    row = _module_row(module)
    return bool(row and row[0])


def _has_module(module: str, version: str) -> bool:
    row = _module_row(module)
    return row is not None and _member(version, row[1])


def has_module(module: str, release: str | Version) -> bool:
    """Whether ``release`` has the module ``module``."""
    return _has_module(module, _v(release))


def releases_having_module(module: str) -> tuple[str, ...]:
    """The releases read where ``module`` exists."""
    return tuple(r for r in releases() if _has_module(module, r))


@cache
def _names(module: str) -> dict[str, tuple[tuple[str, str], ...]]:
    """``name -> ((kind, ranges), ...)`` of one module, from the generated groups."""
    out: dict[str, list[tuple[str, str]]] = {}
    for key, text in _data().NAMES.get(module, {}).items():
        kind_, _, ranges = key.partition(" ")
        for name in text.split():
            out.setdefault(name, []).append((kind_, ranges))
    return {n: tuple(rows) for n, rows in out.items()}


@cache
def _submodules(module: str) -> dict[str, str]:
    """``child name -> ranges`` of the submodules of a package."""
    prefix = module + "."
    out = {}
    for path, text in _data().MODULES.items():
        if path.startswith(prefix) and "." not in path[len(prefix):]:
            out[path[len(prefix):]] = text.removeprefix("package ")
    return out


def kind(module: str, name: str, release: str | Version) -> str | None:
    """The kind (:data:`KINDS`) of ``name`` at ``module`` in ``release``; ``None``: not there."""
    version = _v(release)
    for kind_, ranges in _names(module).get(name, ()):
        if _member(version, ranges):
            return kind_
    sub = _submodules(module).get(name)
    if sub is not None and _member(version, sub):
        return "module"
    return None


def names(module: str, release: str | Version | None = None, *, submodules: bool = True) -> dict[str, str]:
    """``name -> kind`` of the importable names at ``module`` in ``release`` (in any release read when ``None``:
    the kind of the newest release that has it); with ``submodules``, a package's submodules too (as
    ``"module"``), else only the names the module binds."""
    if not submodules:
        version = None if release is None else _v(release)
        return {n: k for n, rows in sorted(_names(module).items()) for k, ranges in rows
                if version is None or _member(version, ranges)}
    candidates = list(_names(module)) + list(_submodules(module))
    if release is None:
        out: dict[str, str] = {}
        for r in releases():
            out.update({n: k for n in candidates if (k := kind(module, n, r)) is not None})
        return dict(sorted(out.items()))
    return {n: k for n in sorted(set(candidates)) if (k := kind(module, n, release)) is not None}


def name_ranges(module: str, name: str) -> tuple[str, ...]:
    """The release ranges where ``name`` is at ``module`` (submodules: the submodule's ranges)."""
    rows = tuple(r for _, ranges in _names(module).get(name, ()) for r in ranges.split())
    sub = _submodules(module).get(name)
    return rows + (tuple(sub.split()) if sub else ())


@cache
def _links() -> dict[tuple[str, str], tuple[str, ...]]:
    """``(module, name) -> modules``: moves followed both ways, dropped re-exports from the old module only; the
    forward links first."""
    forward: dict[tuple[str, str], list[str]] = {}
    backward: dict[tuple[str, str], list[str]] = {}
    data = _data()
    for table, both in ((data.MOVES, True), (data.DROPPED, False)):
        for old, new, text in table:
            for name in text.split():
                forward.setdefault((old, name), []).append(new)
                if both:
                    backward.setdefault((new, name), []).append(old)
    return {k: tuple(forward.get(k, ())) + tuple(backward.get(k, ())) for k in forward.keys() | backward.keys()}


def links(module: str, name: str) -> tuple[str, ...]:
    """The modules ``name`` moved to from ``module`` or came from (one step; :func:`locate` follows them all)."""
    return _links().get((module, name), ())


@cache
def _moved_names() -> dict[str, tuple[str, ...]]:
    out: dict[str, list[str]] = {}
    for old, new, text in _data().MOVES:
        for module in (old, new):
            out.setdefault(module, []).extend(text.split())
    return {m: tuple(dict.fromkeys(names)) for m, names in out.items()}


def moved_names(module: str) -> tuple[str, ...]:
    """The names whose definition moved to or from ``module`` (``MOVES`` of the data; not the re-exports a module
    dropped)."""
    return _moved_names().get(module, ())


def locate(module: str, name: str, release: str | Version) -> Where | None:
    """Where ``name``, imported from ``module``, is in ``release``: at ``module`` itself, else at the nearest
    module along its moves that has it there; ``None``: the release has it nowhere along them."""
    version = _v(release)
    if kind(module, name, version) is not None:
        return Where(module, False)
    seen = {module}
    pending = deque(links(module, name))
    while pending:
        other = pending.popleft()
        if other in seen:
            continue
        seen.add(other)
        if kind(other, name, version) is not None:
            return Where(other, True)
        pending.extend(links(other, name))
    return None


def releases_having(module: str, name: str) -> tuple[str, ...]:
    """The releases read where ``from module import name`` works, at that path or where it moved."""
    return tuple(r for r in releases() if locate(module, name, r) is not None)


def range_summary(found: tuple[str, ...] | list[str]) -> str:
    """``("0.6.0", "0.7.0", "0.9.0")`` -> ``"0.6.0-0.7.0, 0.9.0"``: runs of consecutive releases read."""
    order = releases()
    spans: list[list[int]] = []
    for i in sorted(order.index(r) for r in found):
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(order[a] if a == b else f"{order[a]}-{order[b]}" for a, b in spans) or "no release read"


#: Modules every release session compares in full with its installed files (:func:`drift`), next to a sample.
KEY_MODULES: tuple[str, ...] = (
    "megatron.core", "megatron.core.parallel_state", "megatron.core.tensor_parallel", "megatron.core.optimizer",
    "megatron.core.distributed", "megatron.core.transformer.transformer_config", "megatron.core.utils",
    "megatron.core.pipeline_parallel.schedules", "megatron.core.models.gpt.gpt_layer_specs",
)


@cache
def _tree(root: str) -> _surface_read.ReleaseSurface:
    """The static read of the release under ``root`` (files parsed on first use, kept for the next call)."""
    from ._facts.surface_read import Release as _Files
    from ._facts.surface_read import ReleaseSurface

    return ReleaseSurface(_Files.from_tree(Path(root)))


def drift(root: str | Path, release: str | Version, sample: int | None = 8) -> list[str]:
    """Where the data disagrees with the files of ``release`` under ``root`` (the folder holding ``megatron/``),
    read statically (:mod:`mcore_compat._facts.surface_read`): the set of public modules, and the names of
    :data:`KEY_MODULES` plus ``sample`` more modules chosen by the release (every module when ``None``). Empty:
    they agree."""
    import random

    version = _v(release)
    read = _tree(str(Path(root).resolve()))
    said, found = set(modules(version)), set(read.modules)
    fix = "regenerate mcore_compat/_facts/surface_data.py with scripts/gen_surface.py"
    problems = [f"module {m}: in the files of megatron-core {version}, not in the data ({fix})"
                for m in sorted(found - said)]
    problems += [f"module {m}: in the data for megatron-core {version}, not in its files ({fix})"
                 for m in sorted(said - found)]
    both = sorted(said & found)
    chosen = both if sample is None else \
        sorted({m for m in KEY_MODULES if m in both} | set(random.Random(version).sample(both, min(sample, len(both)))))
    for module in chosen:
        expected = names(module, version, submodules=False)
        actual = {n: e.kind for n, e in read.names_of(module).items()}
        for name in sorted(expected.keys() | actual.keys()):
            if expected.get(name) != actual.get(name):
                problems.append(f"{module}.{name}: the data says {expected.get(name) or 'absent'} for megatron-core "
                                f"{version}, its files say {actual.get(name) or 'absent'} ({fix})")
    return problems
