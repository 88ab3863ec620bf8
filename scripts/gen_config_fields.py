"""Regenerate mcore_compat/_translate/fields.py from the real config dataclasses of every release.

For each config class below (``TransformerConfig`` with the fields it inherits from ``ModelParallelConfig``,
``DistributedDataParallelConfig``, ``OptimizerConfig``) and every release of matrix/versions.toml, the class's
dataclass fields are read from the release's source with ``ast`` (nothing is imported, so one process reads all
releases, including those whose modules need apex or TransformerEngine to import)::

    python scripts/gen_config_fields.py                    # wheels from .cache/wheels (where nox keeps them)
    python scripts/gen_config_fields.py --wheels DIR       # megatron_core-<V>-*.whl files in DIR
    python scripts/gen_config_fields.py --src DIR          # unpacked trees DIR/<V>/megatron/...
    python scripts/gen_config_fields.py --check            # exit 1 if the file is not what would be written
    python scripts/gen_config_fields.py --candidates       # print rename candidates (fields gone and new at once)

What is written, per class: the releases where the class exists, and per field the release range(s) where it
exists (``mcore_compat/_facts/ranges.py`` syntax) and its default where it is a literal (``None`` otherwise); plus the
renames of :data:`RENAMES`, each verified here.

How a rename is established: a field ``old`` that a release drops while it adds ``new`` is a candidate
(``--candidates`` lists them); it becomes a rename only when the release's own code shows that ``new`` does what
``old`` did (the same checks in ``__post_init__`` and the same readers, renamed), and that file and release are cited
in the row. Every declared rename is then verified against the data (:func:`verify_rename`): among the releases
of the class, the two names never exist together, ``old`` exists in one run of consecutive releases, and ``new``
appears in the release right after it. A rename that fails this check stops the script.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import math
import operator
import sys
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # a script: the checkout's mcore_compat is not installed
    sys.path.insert(0, str(ROOT))
from mcore_compat._facts.probes import _body_statements  # noqa: E402  (the probes' AST walk)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _generated import write_or_check  # noqa: E402  (the write or --check step of every generator)

OUTPUT = ROOT / "mcore_compat" / "_translate" / "fields.py"


@dataclass(frozen=True)
class ConfigClass:
    """A Megatron config dataclass: its name and the file that defines it (relative to the wheel's root)."""

    name: str
    path: str


@dataclass(frozen=True)
class Rename:
    """A field of ``cls`` called ``old`` in earlier releases and ``new`` in later ones; ``source`` cites the
    Megatron file and release where the rename happened."""

    cls: str
    old: str
    new: str
    source: str


#: The config classes read (``TransformerConfig``'s base ``ModelParallelConfig`` is followed through its import).
CLASSES: tuple[ConfigClass, ...] = (
    ConfigClass("TransformerConfig", "megatron/core/transformer/transformer_config.py"),
    ConfigClass("DistributedDataParallelConfig", "megatron/core/distributed/distributed_data_parallel_config.py"),
    ConfigClass("OptimizerConfig", "megatron/core/optimizer/optimizer_config.py"),
)

#: Declared renames (verified by :func:`verify_rename`).
RENAMES: tuple[Rename, ...] = (
    Rename("TransformerConfig", "bias_gelu_fusion", "bias_activation_fusion",
           "megatron/core/transformer/transformer_config.py, 0.5.0: bias_gelu_fusion (0.4.0, commented 'TODO: this "
           "should be bias_activation_fusion ?') is replaced by bias_activation_fusion, with the same "
           "__post_init__ checks; transformer/mlp.py reads config.bias_activation_fusion where 0.4.0 read "
           "config.bias_gelu_fusion"),
    Rename("TransformerConfig", "first_pipeline_num_layers", "num_layers_in_first_pipeline_stage",
           "megatron/core/transformer/transformer_block.py get_num_layers_to_build, 0.11.0: the layers of the first "
           "pipeline stage are read from num_layers_in_first_pipeline_stage where 0.10.0 read "
           "first_pipeline_num_layers"),
    Rename("TransformerConfig", "last_pipeline_num_layers", "num_layers_in_last_pipeline_stage",
           "megatron/core/transformer/transformer_block.py get_num_layers_to_build, 0.11.0: the same for the last "
           "stage (num_layers_in_last_pipeline_stage, was last_pipeline_num_layers)"),
    Rename("DistributedDataParallelConfig", "keep_fp8_transpose_cache_when_using_custom_fsdp",
           "keep_fp8_transpose_cache",
           "megatron/core/distributed/distributed_data_parallel_config.py, 0.14.0: the FSDP buffer "
           "(distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py) reads keep_fp8_transpose_cache where "
           "0.13's (distributed/custom_fsdp/param_and_grad_buffer.py) read "
           "keep_fp8_transpose_cache_when_using_custom_fsdp"),
    Rename("OptimizerConfig", "muon_use_nesterov", "muon_nesterov",
           "megatron/core/optimizer/optimizer_config.py, 0.18.0: Muon's nesterov argument comes from "
           "config.muon_nesterov (optimizer/emerging_optimizers.py _kwargs_from_config, prefix 'muon') where "
           "0.16/0.17 passed config.muon_use_nesterov (optimizer/muon.py)"),
)

HEADER = '''"""The fields of Megatron-Core's config dataclasses in every release of the support matrix.

GENERATED by scripts/gen_config_fields.py from the release wheels -- do not edit by hand.

* ``CLASSES[cls]``: ``(module, ranges)``: the module that defines the class and the release ranges where it exists;
* ``FIELDS[cls][field]``: rows ``(range, default)``, oldest first: the class has that dataclass field (inherited
  ones included) in the releases of ``range`` (``mcore_compat/_facts/ranges.py`` syntax), with that default, the
  ``repr`` of a literal (``None``: no default, or one that is not a literal); a field whose default changed, or that
  vanished and came back, has several rows;
* ``RENAMES[cls]``: ``(old, new)`` pairs: ``old`` is what ``new`` was called before it had that name (verified by
  the script, whose ``RENAMES`` cites the Megatron file of each).

``tests/test_config_fields_real.py`` checks, in every matrix session, that this data agrees with the installed
release's real ``dataclasses.fields``.
"""

'''

# ------------------------------------------------------------------------------------------------------------------
# reading the sources
# ------------------------------------------------------------------------------------------------------------------

Reader = Callable[[str], "str | None"]  # path inside a release ("megatron/core/...py") -> source text or None


def wheel_reader(wheel: Path) -> Reader:
    """A reader of the files of one wheel."""
    zf = zipfile.ZipFile(wheel)
    names = set(zf.namelist())

    def read(path: str) -> str | None:
        return zf.read(path).decode("utf-8") if path in names else None

    return read


def tree_reader(root: Path) -> Reader:
    """A reader of the files of one unpacked release (``root`` holds ``megatron/``)."""

    def read(path: str) -> str | None:
        file = root / path
        return file.read_text(encoding="utf-8") if file.is_file() else None

    return read


_BIN_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.Pow: operator.pow, ast.FloorDiv: operator.floordiv,
}
_FACTORIES = {"list": "[]", "dict": "{}", "tuple": "()", "set": "set()"}
_NOT_LITERAL = object()


def literal(node: ast.expr) -> Any:
    """The value of a literal expression (constants, containers, +-*/ of numbers), else ``_NOT_LITERAL``."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN_OPS:
        left, right = literal(node.left), literal(node.right)
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (left, right)):
            try:
                return _BIN_OPS[type(node.op)](left, right)
            except ArithmeticError:
                return _NOT_LITERAL
    return _NOT_LITERAL


def default_text(value: ast.expr | None) -> str | None:
    """The default of a dataclass field as the ``repr`` of a literal, or ``None`` (none, or not a literal)."""
    if value is None:
        return None
    if isinstance(value, ast.Call) and _call_name(value.func) == "field":
        keywords = {k.arg: k.value for k in value.keywords if k.arg}
        if "default" in keywords:
            return default_text(keywords["default"])
        factory = keywords.get("default_factory")
        if isinstance(factory, ast.Name) and factory.id in _FACTORIES:
            return _FACTORIES[factory.id]
        return None
    found = literal(value)
    if found is _NOT_LITERAL or (isinstance(found, float) and not math.isfinite(found)):
        return None
    return repr(found)


def _call_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _is_classvar(annotation: ast.expr) -> bool:
    text = ast.unparse(annotation)
    return text.startswith(("ClassVar", "typing.ClassVar", "InitVar", "dataclasses.InitVar"))


def _module_path(current: str, node: ast.ImportFrom) -> str | None:
    """The file a ``from X import Y`` in file ``current`` (``megatron/core/a/b.py``) refers to."""
    if node.level:
        parts = current.split("/")[:-node.level]
        base = "/".join(parts + (node.module.split(".") if node.module else []))
    elif node.module:
        base = node.module.replace(".", "/")
    else:
        return None
    return base + ".py"


def _base_location(tree: ast.Module, current: str, base: ast.expr) -> tuple[str, str] | None:
    """``(file, class name)`` of a base class expression, followed through the module's imports."""
    if not isinstance(base, ast.Name):
        return None
    for stmt in tree.body:
        if isinstance(stmt, ast.ClassDef) and stmt.name == base.id:
            return current, base.id
        if isinstance(stmt, ast.ImportFrom):
            for alias in stmt.names:
                if (alias.asname or alias.name) == base.id:
                    path = _module_path(current, stmt)
                    return (path, alias.name) if path else None
    return None


def class_fields(read: Reader, path: str, name: str) -> dict[str, str | None] | None:
    """The dataclass fields of class ``name`` in file ``path`` (bases first, as ``dataclasses.fields`` orders them),
    each with :func:`default_text`; ``None`` if the file or the class does not exist."""
    source = read(path)
    if source is None:
        return None
    tree = ast.parse(source)
    node = next((s for s in tree.body if isinstance(s, ast.ClassDef) and s.name == name), None)
    if node is None:
        return None
    fields: dict[str, str | None] = {}
    for base in node.bases:
        location = _base_location(tree, path, base)
        inherited = class_fields(read, *location) if location else None
        if inherited:
            fields.update(inherited)
    for stmt in _body_statements(node):  # the class body, into if/try blocks (they run at class creation)
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) \
                and not _is_classvar(stmt.annotation):
            fields[stmt.target.id] = default_text(stmt.value)
    return fields


# ------------------------------------------------------------------------------------------------------------------
# ranges and renames
# ------------------------------------------------------------------------------------------------------------------

def short_version(version: str) -> str:
    """``"0.6.0"`` -> ``"0.6"`` (how the project's tables write a release boundary); ``"0.17.1"`` unchanged."""
    return version[:-2] if version.count(".") == 2 and version.endswith(".0") else version


def runs(releases: Sequence[str], present: Sequence[bool]) -> list[tuple[int, int]]:
    """The ``[start, stop)`` index runs of consecutive releases where ``present`` holds."""
    out: list[tuple[int, int]] = []
    start = None
    for i, here in enumerate([*present, False]):
        if here and start is None:
            start = i
        elif not here and start is not None:
            out.append((start, i))
            start = None
    return out


def ranges_of(releases: Sequence[str], present: Sequence[bool]) -> tuple[str, ...]:
    """The release ranges (one per run) of the releases where ``present`` holds, oldest first: ``">=0.5"``,
    ``">=0.6,<0.10"``; a run that reaches the newest release is open-ended."""
    out = []
    for start, stop in runs(releases, present):
        text = f">={short_version(releases[start])}"
        if stop < len(releases):
            text += f",<{short_version(releases[stop])}"
        out.append(text)
    return tuple(out)


def verify_rename(releases: Sequence[str], class_present: Sequence[bool], old: Sequence[bool],
                  new: Sequence[bool]) -> list[str]:
    """Problems of a declared rename ``old`` -> ``new`` (empty: verified).

    Among the releases where the class exists, the two names never exist together, ``old`` exists in one run of
    consecutive releases, and ``new`` appears in the release right after that run. (Releases before ``old``
    appeared may have neither: a field renamed after it was introduced.)
    """
    old = [c and o for c, o in zip(class_present, old, strict=True)]
    new = [c and n for c, n in zip(class_present, new, strict=True)]
    problems = []
    both = [r for r, o, n in zip(releases, old, new, strict=True) if o and n]
    if both:
        problems.append(f"both names exist in {', '.join(both)}")
    old_runs, new_runs = runs(releases, old), runs(releases, new)
    if len(old_runs) != 1:
        problems.append(f"the old name exists in {len(old_runs)} runs of consecutive releases, not one")
    if not new_runs:
        problems.append("the new name exists in no release")
    if old_runs and new_runs and old_runs[0][1] != new_runs[0][0]:
        stop = old_runs[0][1]
        after = releases[stop] if stop < len(releases) else "no later release"
        problems.append(f"the new name does not appear where the old one ends ({after}) but in "
                        f"{releases[new_runs[0][0]]}")
    return problems


def rename_candidates(releases: Sequence[str], presence: dict[str, list[bool]]) -> list[tuple[str, str, str]]:
    """``(release, gone, added)``: a field that a release drops while it adds another of a similar name."""
    out = []
    for i in range(1, len(releases)):
        gone = [f for f, p in presence.items() if p[i - 1] and not p[i]]
        added = [f for f, p in presence.items() if p[i] and not p[i - 1]]
        for g in gone:
            for a in difflib.get_close_matches(g, added, n=3, cutoff=0.5):
                out.append((releases[i], g, a))
    return out


# ------------------------------------------------------------------------------------------------------------------
# the table
# ------------------------------------------------------------------------------------------------------------------

@dataclass
class ClassData:
    """What was read of one class: per release its fields (``None`` where the class does not exist)."""

    cls: ConfigClass
    per_release: list[dict[str, str | None] | None]

    def class_present(self) -> list[bool]:
        return [f is not None for f in self.per_release]

    def field_names(self) -> list[str]:
        """Every field of every release, in the order the newest release that has it lists it."""
        order: dict[str, None] = {}
        for fields in reversed(self.per_release):
            for name in fields or ():
                order.setdefault(name, None)
        return list(order)

    def presence(self, field: str) -> list[bool]:
        return [fields is not None and field in fields for fields in self.per_release]


def read_all(readers: Sequence[Reader]) -> dict[str, ClassData]:
    """Every class of :data:`CLASSES` as read by each reader (one per release, oldest first)."""
    return {c.name: ClassData(c, [class_fields(read, c.path, c.name) for read in readers]) for c in CLASSES}


def check_renames(releases: Sequence[str], data: dict[str, ClassData]) -> list[str]:
    problems = []
    for rename in RENAMES:
        cd = data[rename.cls]
        for problem in verify_rename(releases, cd.class_present(), cd.presence(rename.old), cd.presence(rename.new)):
            problems.append(f"{rename.cls}: {rename.old} -> {rename.new}: {problem}")
    return problems


def field_rows(releases: Sequence[str], cd: ClassData, field: str) -> list[tuple[str, str | None]]:
    """``(range, default)`` rows of a field: one per run of consecutive releases where it exists with one default,
    oldest first."""
    rows = []
    for default in {f[field] for f in cd.per_release if f is not None and field in f}:
        here = [f is not None and field in f and f[field] == default for f in cd.per_release]
        rows += [(start, text, default) for (start, _), text in zip(runs(releases, here), ranges_of(releases, here),
                                                                     strict=True)]
    return [(text, default) for _, text, default in sorted(rows, key=lambda r: r[0])]


def render(releases: Sequence[str], data: dict[str, ClassData]) -> str:
    lines = [HEADER.rstrip("\n"), "", "from __future__ import annotations", "",
             "#: The releases read (matrix/versions.toml).",
             f"RELEASES: tuple[str, ...] = {tuple(releases)!r}", "",
             "CLASSES: dict[str, tuple[str, tuple[str, ...]]] = {"]
    for name, cd in data.items():
        module = cd.cls.path.removesuffix(".py").replace("/", ".")
        lines.append(f"    {name!r}: ({module!r}, {ranges_of(releases, cd.class_present())!r}),")
    lines += ["}", "", "FIELDS: dict[str, dict[str, tuple[tuple[str, str | None], ...]]] = {"]
    for name, cd in data.items():
        lines.append(f"    {name!r}: {{")
        for field in cd.field_names():
            rows = field_rows(releases, cd, field)
            lines.append(f"        {field!r}: {tuple(rows)!r},")
        lines.append("    },")
    lines += ["}", "", "RENAMES: dict[str, tuple[tuple[str, str], ...]] = {"]
    for name in data:
        lines.append(f"    {name!r}: (")
        lines += [f"        ({r.old!r}, {r.new!r})," for r in RENAMES if r.cls == name]
        lines.append("    ),")
    lines.append("}")
    return "\n".join(lines) + "\n"


def matrix_releases() -> list[str]:
    from mcore_compat import support

    return [str(r.version) for r in support.Matrix(ROOT / "matrix").releases()]


def readers_for(releases: Sequence[str], wheels: Path | None, src: Path | None) -> list[Reader]:
    if src is not None:
        missing = [v for v in releases if not (src / v / "megatron").is_dir()]
        if missing:
            raise SystemExit(f"no unpacked release tree {src}/<V>/megatron for {', '.join(missing)}")
        return [tree_reader(src / v) for v in releases]
    assert wheels is not None
    out = []
    for version in releases:
        found = sorted(wheels.glob(f"megatron_core-{version}-*.whl"))
        if not found:
            raise SystemExit(f"no wheel megatron_core-{version}-*.whl in {wheels} (pip download --no-deps "
                             f"megatron-core=={version} -d {wheels}), or pass --src")
        out.append(wheel_reader(found[0]))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--wheels", type=Path, default=ROOT / ".cache" / "wheels",
                       help="directory of megatron_core-<V>-*.whl files (default: .cache/wheels)")
    where.add_argument("--src", type=Path, default=None, help="directory of unpacked releases <V>/megatron/")
    parser.add_argument("--check", action="store_true", help="only check that the file is up to date")
    parser.add_argument("--candidates", action="store_true", help="print rename candidates and exit")
    args = parser.parse_args(argv)
    releases = matrix_releases()
    data = read_all(readers_for(releases, args.wheels, args.src))
    if args.candidates:
        for name, cd in data.items():
            presence = {f: cd.presence(f) for f in cd.field_names()}
            for release, gone, added in rename_candidates(releases, presence):
                print(f"{name} {release}: {gone} -> {added}")
        return 0
    problems = check_renames(releases, data)
    if problems:
        print("declared renames that the releases do not show:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    return write_or_check(OUTPUT, render(releases, data), check=args.check, script="gen_config_fields.py",
                          summary=", ".join(f"{name} {len(cd.field_names())} fields" for name, cd in data.items()))


if __name__ == "__main__":
    sys.exit(main())
