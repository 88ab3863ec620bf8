"""The public API of mcore_compat as a committed listing, and the breaking-change check lint runs against it.

::

    python scripts/gen_api.py            # write api/mcore_compat.json from the source tree
    python scripts/gen_api.py --check    # exit 1 on a breaking change against the listing, or a stale listing

What the listing holds (``api/mcore_compat.json``, sorted, one entry per public name):

* ``modules``: every public module of the package (no path component starting with ``_``; ``patches/`` is
  ``mcore_compat.patches``) and its public names (its ``__all__``, else the names it defines without a leading
  underscore): functions with each parameter's name, kind, default and annotation; classes with their public
  methods and attributes and ``__init__`` (dataclasses' generated one too); a name re-exported from a private
  module is listed as what it is, under the public path;
* ``lazy``: the names ``mcore_compat`` resolves on first access (its submodules, re-exports and the Megatron
  symbols of the symbol table), which no static reader sees;
* ``facts``: the fact names ``has()``/``fact()`` answer (the fact table and the deprecated capability names);
* ``deprecated``: the deprecated aliases (``mcore_compat._util.deprecated``): old name or parameter -> replacement.

Why griffe: it reads the package statically (nothing of mcore_compat, torch or Megatron is imported to list its
signatures; dataclasses get their generated ``__init__``), and its ``find_breaking_changes`` is a maintained
implementation of the comparison rules (removed objects and parameters, parameters that became required or
changed kind, moved positional parameters, changed defaults) that mkdocstrings' ecosystem and ``griffe check``
use. The listing is normalised first (aliases resolved, docstrings and line numbers dropped), and both the
committed listing and the live tree are rebuilt as griffe objects from that same normal form, so the comparison
sees the same shapes on both sides and the committed file diffs readably.

The check fails on a public name that disappears, a parameter removed (a rename removes the old name), a
parameter that becomes required or changes kind, an object that changes kind, a fact or lazy name that
disappears, and a deprecated alias that is dropped, unless ``mcore_compat._util.deprecated`` declares the old name or
parameter as a deprecated alias (which its tests prove still answers). Moved positional parameters and changed
defaults are printed, not failed. Writing the listing records an intended change; its diff is the API's record.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import griffe

ROOT = Path(__file__).resolve().parents[1]
LISTING = Path("api") / "mcore_compat.json"
PACKAGE = "mcore_compat"
#: Top-level folders that setuptools maps into the package (pyproject's package-dir) and hold code.
MAPPED = {"patches": f"{PACKAGE}.patches"}

#: griffe's parameter kinds, short.
_KINDS = {
    "positional-only": "pos", "positional or keyword": "pos_kw", "variadic positional": "var_pos",
    "keyword-only": "kw", "variadic keyword": "var_kw",
}
_GRIFFE_KINDS = {short: griffe.ParameterKind(long) for long, short in _KINDS.items()}
#: Breakages that fail the check (the rest are printed).
FAILING = {
    griffe.BreakageKind.OBJECT_REMOVED, griffe.BreakageKind.PARAMETER_REMOVED,
    griffe.BreakageKind.PARAMETER_CHANGED_REQUIRED, griffe.BreakageKind.PARAMETER_ADDED_REQUIRED,
    griffe.BreakageKind.PARAMETER_CHANGED_KIND, griffe.BreakageKind.OBJECT_CHANGED_KIND,
}


# ------------------------------------------------------------------------------------------------ the listing
def _public_path(path: str) -> bool:
    return not any(part.startswith("_") for part in path.split(".")[1:])


def _annotation(value: Any) -> str | None:
    return None if value is None else str(value)


def _function(fn: griffe.Function) -> dict[str, Any]:
    params: list[list[Any]] = []
    for p in fn.parameters:
        if p.name in ("self", "cls") and not params and fn.parent is not None and fn.parent.is_class:
            continue
        params.append([p.name, _KINDS[p.kind.value], None if p.required else str(p.default), _annotation(p.annotation)])
    return {"kind": "function", "params": params, "returns": _annotation(fn.returns)}


def _class_member_public(name: str) -> bool:
    return name == "__init__" or not name.startswith("_")


def _entry(obj: Any, seen: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The normal form of one public object (an alias within the package is listed as its target)."""
    if obj.is_alias:
        try:
            target = obj.final_target
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            return {"kind": "alias", "target": obj.target_path}
        if not target.path.startswith(f"{PACKAGE}.") or target.is_module:
            return {"kind": "alias", "target": target.path}
        return {**_entry(target, seen), "of": target.path}
    if obj.is_function:
        return _function(obj)
    if obj.is_class:
        if obj.path in seen:
            return {"kind": "class", "members": {}}
        members = {}
        for name, member in sorted(obj.all_members.items()):
            if not _class_member_public(name) or (member.is_alias and not name.startswith("_") and
                                                   not _resolves(member)):
                continue
            if member.is_class or (member.is_alias and _resolves(member) and member.final_target.is_class):
                members[name] = {"kind": "class"}
                continue
            members[name] = _entry(member, seen | {obj.path})
        bases = [str(b) for b in obj.bases]
        return {"kind": "class", "bases": bases, "members": members}
    return {"kind": "attribute"}


def _resolves(alias: Any) -> bool:
    try:
        alias.final_target  # noqa: B018
    except (griffe.AliasResolutionError, griffe.CyclicAliasError):
        return False
    return True


def _modules(module: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    yield prefix, module
    for name, sub in sorted(module.members.items()):
        path = f"{prefix}.{name}"
        if not sub.is_alias and sub.is_module and _public_path(path):
            yield from _modules(sub, path)


def _public_names(module: Any) -> list[str]:
    if module.exports is not None:
        return sorted(str(e) if not isinstance(e, str) else e for e in module.exports)
    return sorted(name for name, m in module.members.items()
                  if not name.startswith("_") and not m.is_alias and not m.is_module)


def _load(root: Path) -> dict[str, Any]:
    loader = griffe.GriffeLoader(search_paths=[str(root)], allow_inspection=False)
    trees = {PACKAGE: loader.load(PACKAGE, try_relative_path=False)}
    for folder, path in MAPPED.items():
        trees[path] = loader.load(folder, try_relative_path=False)
    loader.resolve_aliases(external=False, implicit=False)
    return trees


_RUNTIME = """
import json, sys
sys.path.insert(0, sys.argv[1])
import mcore_compat as pkg
from mcore_compat._util import deprecated as dep
from mcore_compat._facts.table import FACTS
deprecated = {name: row.replacement for name, row in dep.DEPRECATED_FLAGS.items()}
deprecated.update(getattr(dep, "DEPRECATED_NAMES", {}))
deprecated.update(getattr(dep, "DEPRECATED_PARAMS", {}))
print(json.dumps({"lazy": sorted(set(pkg._LAZY_MODULE_ATTRS) | set(pkg._LAZY_ATTRS) | set(pkg.symbol_names())),
                  "facts": sorted(set(FACTS) | set(dep.DEPRECATED_FLAGS)),
                  "deprecated": dict(sorted(deprecated.items()))}))
"""


def _runtime_names(root: Path) -> subprocess.Popen[str]:
    """What only importing the package tells: lazy names, facts, deprecated aliases. Read in a fresh interpreter
    (``import mcore_compat`` imports nothing of torch or Megatron), so that the caller's own mcore_compat, if
    any, is not replaced; it runs while griffe reads the source (:func:`_collect`)."""
    return subprocess.Popen([sys.executable, "-P", "-c", _RUNTIME, str(root)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ""})


def _collect(proc: subprocess.Popen[str], root: Path) -> dict[str, Any]:
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"importing {PACKAGE} from {root} failed:\n{err}")
    return json.loads(out)


def listing(root: Path = ROOT) -> dict[str, Any]:
    """The normal form of the public API of the package under ``root``."""
    runtime = _runtime_names(root)
    modules: dict[str, dict[str, Any]] = {}
    for top, tree in _load(root).items():
        for path, module in _modules(tree, top):
            names = {}
            for name in _public_names(module):
                member = module.all_members.get(name)
                if member is None:
                    continue  # a name __all__ lists that only a module __getattr__ provides
                if member.is_module or (member.is_alias and _resolves(member) and member.final_target.is_module):
                    names[name] = {"kind": "module"}
                else:
                    names[name] = _entry(member)
            modules[path] = names
    return {"format": 1, "modules": dict(sorted(modules.items())), **_collect(runtime, root)}


def _render(value: Any, indent: int, key: str = "") -> str:
    """JSON with one line per name (function, attribute, class member); the levels above them spread out."""
    pad = " " * indent
    spread = indent < 3 or key == "members" or bool(isinstance(value, dict) and value.get("members"))
    if isinstance(value, dict) and value and spread:
        items = [f"{pad} {json.dumps(k)}: {_render(v, indent + 1, k)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    return json.dumps(value)


def render(data: dict[str, Any]) -> str:
    """The listing's text (what is committed)."""
    return _render(data, 0) + "\n"


# ------------------------------------------------------------------------------------- the breaking-change check
def _griffe_object(name: str, entry: dict[str, Any]) -> griffe.Object:
    kind = entry["kind"]
    obj: griffe.Object
    if kind == "function":
        params = [griffe.Parameter(n, kind=_GRIFFE_KINDS[k], default=d, annotation=a) for n, k, d, a in entry["params"]]
        obj = griffe.Function(name, parameters=griffe.Parameters(*params))
    elif kind == "class":
        obj = griffe.Class(name)
        for member_name, member in entry.get("members", {}).items():
            obj.set_member(member_name, _griffe_object(member_name, member))
    elif kind == "module":
        obj = griffe.Module(name)
    else:
        obj = griffe.Attribute(name)
    obj.public = True
    return obj


def to_griffe(data: dict[str, Any]) -> griffe.Module:
    """The listing as griffe objects: modules, and in each its public names."""
    top = griffe.Module(PACKAGE)
    top.public = True
    made = {PACKAGE: top}
    for path in sorted(data["modules"], key=lambda p: p.count(".")):
        if path not in made:
            parent, _, name = path.rpartition(".")
            module = griffe.Module(name)
            module.public = True
            made[parent].set_member(name, module)
            made[path] = module
        for name, entry in data["modules"][path].items():
            if name not in made[path].members:
                made[path].set_member(name, _griffe_object(name, entry))
    return top


def _canonical(path: str, data: dict[str, Any]) -> str:
    """Where ``path`` (a listed name, or a member of one) is defined: a re-exported name's ``of``."""
    module = path
    while module and module not in data["modules"]:
        module = module.rpartition(".")[0]
    if not module or module == path:
        return path
    name, _, rest = path[len(module) + 1:].partition(".")
    entry = data["modules"][module].get(name, {})
    base = entry.get("of", f"{module}.{name}")
    return f"{base}.{rest}" if rest else base


def _key(breakage: griffe.Breakage, data: dict[str, Any]) -> str:
    """``module.name`` of a removed object, ``function(param)`` of a parameter, at the path that defines it."""
    if breakage.kind in (griffe.BreakageKind.OBJECT_REMOVED, griffe.BreakageKind.OBJECT_CHANGED_KIND):
        return _canonical(breakage.obj.path, data)
    param = breakage.old_value if breakage.old_value is not None else breakage.new_value
    return f"{_canonical(breakage.obj.path, data)}({param.name})"


def breaking_changes(old: dict[str, Any], new: dict[str, Any]) -> tuple[list[str], list[str]]:
    """``(failures, notes)`` of ``new`` against ``old`` (both listings).

    A removal is excused when ``new["deprecated"]`` declares the removed name or parameter as a deprecated alias.
    """
    excused = set(new["deprecated"])
    failures: list[str] = []
    notes: list[str] = []
    for b in griffe.find_breaking_changes(to_griffe(old), to_griffe(new)):
        key = _key(b, old)
        text = f"{key}: {b.kind.value}"
        if text in failures or text in notes or text + " (deprecated alias" in " ".join(notes):
            continue  # the same object re-exported under another name
        if b.kind not in FAILING:
            notes.append(text)
        elif key in excused and b.kind in (griffe.BreakageKind.OBJECT_REMOVED,
                                           griffe.BreakageKind.PARAMETER_REMOVED):
            notes.append(f"{text} (deprecated alias: {new['deprecated'][key]})")
        else:
            failures.append(text)
    for section, what in (("lazy", "mcore_compat.{} (resolved on first access)"), ("facts", "fact {!r}")):
        for name in sorted(set(old[section]) - set(new[section])):
            if name not in excused:
                failures.append(f"{what.format(name)}: {griffe.BreakageKind.OBJECT_REMOVED.value}")
    for name in sorted(set(old["deprecated"]) - set(new["deprecated"])):
        failures.append(f"{name}: deprecated alias was removed (it replaced {old['deprecated'][name]!r})")
    return failures, notes


def check(root: Path = ROOT, listing_path: Path | None = None) -> int:
    """Exit status of ``--check``: breaking changes first (each named), then staleness."""
    path = listing_path or root / LISTING
    if not path.is_file():
        print(f"{path}: no API listing; write it with python scripts/gen_api.py", file=sys.stderr)
        return 1
    old = json.loads(path.read_text(encoding="utf-8"))
    new = listing(root)
    failures, notes = breaking_changes(old, new)
    for note in notes:
        print(f"api note: {note}")
    for failure in failures:
        print(f"api BREAKING: {failure}", file=sys.stderr)
    if failures:
        print(f"{len(failures)} breaking change(s) of mcore_compat's public API against {LISTING}: keep the old "
              f"name or parameter as a deprecated alias (mcore_compat/_util/deprecated.py)", file=sys.stderr)
        return 1
    if render(new) != path.read_text(encoding="utf-8"):
        print(f"{LISTING} is stale (the public API changed compatibly): run python scripts/gen_api.py",
              file=sys.stderr)
        return 1
    print(f"{LISTING}: current, no breaking change ({len(new['modules'])} modules)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail on a breaking change or a stale listing")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to read (default: this one)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    if not (root / PACKAGE / "__init__.py").is_file():
        print(f"{root}: no {PACKAGE} package there", file=sys.stderr)
        return 2
    if args.check:
        return check(root)
    (root / LISTING).parent.mkdir(exist_ok=True)
    (root / LISTING).write_text(render(listing(root)), encoding="utf-8")
    print(f"wrote {root / LISTING}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
