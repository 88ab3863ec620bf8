"""Regenerate mcore_compat/_facts/surface_data.py: every module and importable name of ``megatron.core`` in every release.

Every release of matrix/versions.toml is read from its wheel (or unpacked tree) with ``ast``; nothing is imported,
so one process reads all releases, including modules that need apex or TransformerEngine to import::

    python scripts/gen_surface.py                    # wheels from .cache/wheels (where nox keeps them)
    python scripts/gen_surface.py --wheels DIR       # megatron_core-<V>-*.whl files in DIR
    python scripts/gen_surface.py --src DIR          # unpacked trees DIR/<V>/megatron/...
    python scripts/gen_surface.py --check            # exit 1 if the file is not what would be written
    python scripts/gen_surface.py --candidates       # print the moves found, and the names gone with no match

What is read, per release:

* the modules: every ``megatron/core/**.py`` file and package directory, private ones too (``_rank_utils``;
  ``__init__.py`` makes its directory a package);
* every name a client can import from each module: the names bound at module level (into ``if``/``try`` blocks,
  not into ``if TYPE_CHECKING:``), public, private and dunder alike: classes, functions, assignments (``x = ...``,
  ``x: T = ...``), re-exports (``from megatron.core.x import y [as z]``, relative or absolute, ``import
  megatron.core.x as z``, ``from x import *``), imports from outside Megatron (``detach_variable`` from torch,
  ``Optional``) and the names ``__all__`` lists; a package's submodules are modules of their own. Moves are
  matched for public names only (a private helper is not followed to another module).

Each name has a kind: ``class``, ``function``, ``variable``, ``module`` (a re-exported module), or ``import`` (a
re-export whose target is outside ``megatron.core`` or not found); a re-export has the kind of what it names.

How a move is established: a name that a module has in one release and no longer has in the next (``gone``) is
matched to the module that provides the same name with the same kind in that next release: where its definition
was (the module a re-export pointed to, when that module still has it), else the one module that newly defines a
class or function of that name. Moves are links both ways: the mirror (``mcore_compat.core``) follows them from an
old path to a new one and from a new path back to the old one. :data:`MOVES` declares the moves that matter to
clients, each citing the Megatron file and release; each is verified against the data (:func:`verify_move`: the
name is at ``old`` in the release before, gone from it in ``release``, and at ``new`` in ``release`` with the same
kind) and a declared move that fails stops the script, like ``gen_config_fields.py``'s renames.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # a script: the checkout's mcore_compat is not installed
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _generated import write_or_check  # noqa: E402  (the write or --check step of every generator)
from gen_config_fields import matrix_releases, ranges_of  # noqa: E402  (the same release ranges)

from mcore_compat._facts.surface_read import Release, ReleaseSurface  # noqa: E402  (the static read of one release)

OUTPUT = ROOT / "mcore_compat" / "_facts" / "surface_data.py"


@dataclass(frozen=True)
class Move:
    """``name`` left module ``old`` in ``release`` and is at ``new`` from that release on; ``source`` cites the
    Megatron file(s) of the change."""

    name: str
    old: str
    new: str
    release: str
    source: str


#: Declared moves (verified by :func:`verify_move`; the automatic matching finds these and more).
MOVES: tuple[Move, ...] = (
    *(Move(name, "megatron.core.transformer.custom_layers.transformer_engine",
           "megatron.core.extensions.transformer_engine", "0.17.0",
           "megatron/core/extensions/transformer_engine.py defines the TransformerEngine wrappers from 0.9.0; "
           "megatron/core/transformer/custom_layers/transformer_engine.py, where 0.4-0.8 defined them, is from 0.9.0 "
           "a deprecated `from megatron.core.extensions.transformer_engine import *` and is deleted in 0.17.0")
      for name in ("TENorm", "TELinear", "TEColumnParallelLinear", "TERowParallelLinear",
                   "TELayerNormColumnParallelLinear", "TEDotProductAttention")),
    Move("FullyShardedDataParallel", "megatron.core.distributed.custom_fsdp",
         "megatron.core.distributed.fsdp.mcore_fsdp_adapter", "0.14.0",
         "megatron/core/distributed/fsdp/mcore_fsdp_adapter.py, 0.14.0: Megatron's FSDP wrapper (0.12-0.13: "
         "distributed/custom_fsdp/fully_sharded_data_parallel.py, re-exported by distributed/custom_fsdp/__init__.py; "
         "the custom_fsdp package is deleted in 0.14.0, distributed/__init__.py re-exports the adapter's class)"),
)

HEADER = '''"""Megatron-Core's modules and importable names (public, private, dunder, imported) in every release.

GENERATED by scripts/gen_surface.py from the release wheels -- do not edit by hand; read it through
:mod:`mcore_compat.surface`.

* ``MODULES[module]``: the release ranges where the module exists (``mcore_compat/_facts/ranges.py`` syntax,
  several for a module that vanished and came back), prefixed ``"package "`` for a package;
* ``NAMES[module][key]``: every name the module lets a client import, space-separated, grouped by ``key``: the name's kind
  (``class``, ``function``, ``variable``, ``module``, ``import``: a re-export from outside ``megatron.core``) and
  its release ranges at that module, e.g. ``"class >=0.6,<0.12"``;
* ``MOVES``: ``(old module, new module, names)``: each name's definition left the old module at a release where the
  new one defines it (matched across releases by name and kind; the script's ``MOVES`` declares and verifies the
  ones it cites); followed both ways;
* ``DROPPED``: ``(old module, new module, names)``: the old module re-exported each name and stopped at a release
  where the new one (the re-export's origin, or a new definition) has it; followed from old to new.

``tests/test_surface_data_real.py`` checks, in every matrix session, that this data agrees with the installed
release's files.
"""

'''

# ------------------------------------------------------------------------------------------------------------------
# across releases
# ------------------------------------------------------------------------------------------------------------------


@dataclass
class Surface:
    """Every release's surface, oldest first."""

    releases: list[str]
    per_release: list[ReleaseSurface]

    def module_names(self) -> list[str]:
        return sorted({m for s in self.per_release for m in s.modules})

    def kinds(self, module: str, name: str) -> list[str | None]:
        """The kind of ``module.name`` per release (``None`` where absent)."""
        return [(e.kind if (e := s.names.get(module, {}).get(name)) else None) for s in self.per_release]

    def names_of(self, module: str) -> list[str]:
        return sorted({n for s in self.per_release for n in s.names.get(module, {})})


@dataclass
class Moves:
    """What :func:`find_moves` found: ``(name, old module, new module)`` triples."""

    moved: set[tuple[str, str, str]] = field(default_factory=set)  # a definition moved: links both ways
    dropped: set[tuple[str, str, str]] = field(default_factory=set)  # a re-export dropped: old -> its origin
    unmatched: list[str] = field(default_factory=list)  # classes/functions gone with no match (--candidates)


def find_moves(surface: Surface) -> Moves:
    """Match names across consecutive releases.

    * a module's own definition becomes a re-export of another module that newly has it (the old path kept as a
      shim): ``moved``;
    * a name gone from a module: when its origin (where a re-export pointed) still has it, ``dropped``; else the
      one module that newly defines a class or function of that name and kind: ``moved`` when the old module
      defined it, ``dropped`` when it re-exported it.
    """
    found = Moves()
    for i in range(1, len(surface.releases)):
        before, after = surface.per_release[i - 1], surface.per_release[i]
        new_defs: dict[tuple[str, str], list[str]] = {}  # (name, kind) -> modules that newly define it
        for module, names in after.names.items():
            for name, entry in names.items():
                if name.startswith("_") or entry.kind == "import":
                    continue  # private helpers and imports from outside Megatron are not matched across modules
                if entry.origin == (module, name):
                    old = before.names.get(module, {}).get(name)
                    if old is None or old.origin != (module, name):
                        new_defs.setdefault((name, entry.kind), []).append(module)
        for module, names in before.names.items():
            still = after.names.get(module, {})
            for name, entry in names.items():
                if name.startswith("_") or entry.kind == "import":
                    continue
                defined = entry.origin == (module, name)
                now = still.get(name)
                if now is not None:
                    if defined and now.origin != (module, name) and now.origin[1] == name \
                            and now.kind == entry.kind and now.origin[0] in new_defs.get((name, now.kind), []):
                        found.moved.add((name, module, now.origin[0]))
                    continue
                origin_module, origin_name = entry.origin
                target = after.names.get(origin_module, {}).get(origin_name)
                if origin_name == name and origin_module != module and target and target.kind == entry.kind:
                    found.dropped.add((name, module, origin_module))
                    continue
                if entry.kind not in ("class", "function"):
                    continue
                anew = new_defs.get((name, entry.kind), [])
                if len(anew) == 1:
                    (found.moved if defined else found.dropped).add((name, module, anew[0]))
                else:
                    found.unmatched.append(f"{surface.releases[i]}: {module}.{name} ({entry.kind}) gone; "
                                           + (f"defined anew in {', '.join(anew)}" if anew else "no new definition"))
    return found


def verify_move(surface: Surface, move: Move) -> list[str]:
    """Problems of a declared move (empty: verified)."""
    if move.release not in surface.releases:
        return [f"{move.release} is not a release of matrix/versions.toml"]
    i = surface.releases.index(move.release)
    if i == 0:
        return [f"{move.release} is the oldest release: nothing can move there"]
    old, new = surface.kinds(move.old, move.name), surface.kinds(move.new, move.name)
    problems = []
    if old[i - 1] is None:
        problems.append(f"{move.old} has no {move.name} in {surface.releases[i - 1]}")
    if old[i] is not None:
        problems.append(f"{move.old} still has {move.name} in {move.release}")
    if new[i] is None:
        problems.append(f"{move.new} has no {move.name} in {move.release}")
    elif old[i - 1] is not None and new[i] != old[i - 1]:
        problems.append(f"the kind changes: {old[i - 1]} at {move.old}, {new[i]} at {move.new}")
    return problems


# ------------------------------------------------------------------------------------------------------------------
# the data module
# ------------------------------------------------------------------------------------------------------------------


def _wrap(names: Sequence[str], indent: str, width: int = 110) -> list[str]:
    """``names`` space-separated as one string literal, split over lines of at most ``width`` characters."""
    chunks: list[str] = []
    line = ""
    for name in names:
        if line and len(indent) + len(line) + len(name) + 4 > width:
            chunks.append(line + " ")
            line = ""
        line += (" " if line else "") + name
    chunks.append(line)
    return [f"{indent}{c!r}" for c in chunks]


def _first_release(releases: Sequence[str], key: str) -> int:
    """The index of the release a group key's first range starts at (``"class >=0.6,<0.9"`` -> that of 0.6)."""
    start = key.split()[1].split(",")[0].removeprefix(">=")
    return next(i for i, r in enumerate(releases) if r == start or r == f"{start}.0")


def render(surface: Surface, moves: Moves) -> str:
    releases = surface.releases
    lines = [HEADER.rstrip("\n"), "", "from __future__ import annotations", "",
             "#: The releases read (matrix/versions.toml).",
             f"RELEASES: tuple[str, ...] = {tuple(releases)!r}", "",
             "MODULES: dict[str, str] = {"]
    modules = surface.module_names()
    for module in modules:
        present = [module in s.modules for s in surface.per_release]
        package = any(s.modules.get(module) for s in surface.per_release)
        text = ("package " if package else "") + " ".join(ranges_of(releases, present))
        lines.append(f"    {module!r}: {text!r},")
    lines += ["}", "", "NAMES: dict[str, dict[str, str]] = {"]
    for module in modules:
        groups: dict[str, list[str]] = {}
        for name in surface.names_of(module):
            kinds = surface.kinds(module, name)
            for kind in dict.fromkeys(k for k in kinds if k is not None):
                key = f"{kind} " + " ".join(ranges_of(releases, [k == kind for k in kinds]))
                groups.setdefault(key, []).append(name)
        if not groups:
            continue
        lines.append(f"    {module!r}: {{")
        for key in sorted(groups, key=lambda k: (k.split()[0], _first_release(releases, k))):
            wrapped = _wrap(groups[key], " " * 12)
            if len(wrapped) == 1 and len(wrapped[0]) - 12 + len(key) + 14 <= 110:
                lines.append(f"        {key!r}: {wrapped[0].strip()},")
            else:
                lines += [f"        {key!r}: (", *wrapped, "        ),"]
        lines.append("    },")
    lines += ["}", ""]
    for title, triples in (("MOVES", moves.moved), ("DROPPED", moves.dropped)):
        lines.append(f"{title}: tuple[tuple[str, str, str], ...] = (")
        pairs: dict[tuple[str, str], list[str]] = {}
        for name, old, new in sorted(triples):
            pairs.setdefault((old, new), []).append(name)
        for (old, new), names in sorted(pairs.items()):
            wrapped = _wrap(names, " " * 8)
            wrapped[-1] += ","
            lines += ["    (", f"        {old!r},", f"        {new!r},", *wrapped, "    ),"]
        lines += [")", ""]
    lines.pop()
    return "\n".join(lines) + "\n"


def read_releases(releases: Sequence[str], wheels: Path | None, src: Path | None) -> list[Release]:
    if src is not None:
        missing = [v for v in releases if not (src / v / "megatron" / "core").is_dir()]
        if missing:
            raise SystemExit(f"no unpacked release tree {src}/<V>/megatron/core for {', '.join(missing)}")
        return [Release.from_tree(src / v) for v in releases]
    assert wheels is not None
    out = []
    for version in releases:
        found = sorted(wheels.glob(f"megatron_core-{version}-*.whl"))
        if not found:
            raise SystemExit(f"no wheel megatron_core-{version}-*.whl in {wheels} (pip download --no-deps "
                             f"--only-binary=:all: megatron-core=={version} -d {wheels}; 0.4.0's only wheel is "
                             f"cp310: add --python-version 3.10), or pass --src")
        out.append(Release.from_wheel(found[0]))
    return out


def build(releases: Sequence[str], wheels: Path | None, src: Path | None) -> Surface:
    return Surface(list(releases), [ReleaseSurface(r) for r in read_releases(releases, wheels, src)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--wheels", type=Path, default=ROOT / ".cache" / "wheels",
                       help="directory of megatron_core-<V>-*.whl files (default: .cache/wheels)")
    where.add_argument("--src", type=Path, default=None, help="directory of unpacked releases <V>/megatron/")
    parser.add_argument("--check", action="store_true", help="only check that the file is up to date")
    parser.add_argument("--candidates", action="store_true",
                        help="print the moves found and the classes/functions gone with no match, and exit")
    args = parser.parse_args(argv)
    surface = build(matrix_releases(), None if args.src else args.wheels, args.src)
    moves = find_moves(surface)
    if args.candidates:
        for name, old, new in sorted(moves.moved):
            print(f"moved {name}: {old} <-> {new}")
        for name, old, new in sorted(moves.dropped):
            print(f"dropped {name}: {old} -> {new}")
        print("\n".join(moves.unmatched))
        return 0
    problems = [f"{m.name}: {m.old} -> {m.new} ({m.release}): {p}" for m in MOVES for p in verify_move(surface, m)]
    if problems:
        print("declared moves that the releases do not show:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    moves.moved |= {(m.name, m.old, m.new) for m in MOVES}
    moves.dropped -= moves.moved
    count = sum(len(s.names[m]) for s in surface.per_release[-1:] for m in s.names)
    return write_or_check(OUTPUT, render(surface, moves), check=args.check, script="gen_surface.py",
                          summary=f"{len(surface.module_names())} modules, {count} names in {surface.releases[-1]}, "
                                  f"{len(moves.moved)} moves, {len(moves.dropped)} re-exports dropped")


if __name__ == "__main__":
    sys.exit(main())
