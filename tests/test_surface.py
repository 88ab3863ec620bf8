"""The generated surface data without Megatron: the static reader's rules (mcore_compat/_facts/surface_read.py) on small
made-up releases, the move matching and the check of declared moves (scripts/gen_surface.py), the consistency of
mcore_compat/_facts/surface_data.py, and the query API (mcore_compat.surface).

What the data says about each release is checked against the installed files in every release session
(tests/test_surface_data_real.py); the mirror that resolves through it, in tests/test_mirror_real.py.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from packaging.version import Version

from mcore_compat import surface
from mcore_compat._facts import surface_data as DATA
from mcore_compat._facts.ranges import specifier
from mcore_compat._facts.surface_read import Release, ReleaseSurface

pytestmark = pytest.mark.unit

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gen_surface.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_surface", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


GEN = _script()


def _release(files: dict[str, str]) -> ReleaseSurface:
    """A made-up release: ``{"a/b.py": source}`` under ``megatron/core/``."""
    return ReleaseSurface(Release({f"megatron/core/{p}": s.encode() for p, s in files.items()}))


# ---------------------------------------------------------------------------------------------------------------
# the static reader
# ---------------------------------------------------------------------------------------------------------------

READER_CASE = {
    "__init__.py": "from megatron.core import parallel_state\nfrom .pkg.mod import Thing as Alias\n"
                   "import megatron.core.parallel_state as mpu2\nmpu = parallel_state\n",
    "parallel_state.py": "import torch\nfrom typing import Optional\n_PRIVATE = 1\nGROUP = None\n"
                         "def get_rank(): ...\nclass _Hidden: ...\n",
    "pkg/__init__.py": "from .mod import *\n",
    "pkg/mod.py": "from typing import TYPE_CHECKING\nimport torch\nfrom torch import nn\n"
                  "__all__ = ['Thing', 'helper', 'nn']\n"
                  "if TYPE_CHECKING:\n    from megatron.core.parallel_state import GROUP as ONLY_TYPES\n"
                  "try:\n    from apex import fused\nexcept ImportError:\n    fused = None\n"
                  "class Thing: ...\nasync def helper(): ...\nx, (y, z) = 1, (2, 3)\nw: int = 4\nv: int\n"
                  "def gone(): ...\ndel gone\n",
    "_private_mod.py": "class Secret: ...\n",
    "nsdir/leaf.py": "LEAF = 1\n",
}


def test_the_reader_finds_modules_and_packages() -> None:
    read = _release(READER_CASE)
    # private modules too: a client imports megatron.core._rank_utils
    assert read.modules == {"megatron.core": True, "megatron.core._private_mod": False, "megatron.core.nsdir": True,
                            "megatron.core.nsdir.leaf": False, "megatron.core.parallel_state": False,
                            "megatron.core.pkg": True, "megatron.core.pkg.mod": False}


def test_the_reader_kinds_and_reexports() -> None:
    read = _release(READER_CASE)
    kinds = {m: {n: e.kind for n, e in names.items()} for m, names in read.names.items()}
    # every name a client can import: private and imported ones too (`import torch` binds torch)
    assert kinds["megatron.core.parallel_state"] == {"torch": "import", "Optional": "import", "_PRIVATE": "variable",
                                                     "GROUP": "variable", "get_rank": "function", "_Hidden": "class"}
    # try/except: the import that works binds last (here apex's, outside megatron); TYPE_CHECKING binds nothing;
    # del unbinds; a bare annotation binds nothing
    assert kinds["megatron.core.pkg.mod"] == {"TYPE_CHECKING": "import", "torch": "import", "nn": "import",
                                              "fused": "import", "Thing": "class", "helper": "function",
                                              "x": "variable", "y": "variable", "z": "variable", "w": "variable"}
    assert kinds["megatron.core.pkg"] == {"Thing": "class", "helper": "function", "nn": "import"}  # __all__ of *
    assert kinds["megatron.core._private_mod"] == {"Secret": "class"}
    assert kinds["megatron.core"] == {"parallel_state": "module", "Alias": "class", "mpu2": "module",
                                      "mpu": "module"}
    assert read.names["megatron.core"]["Alias"].origin == ("megatron.core.pkg.mod", "Thing")


# ---------------------------------------------------------------------------------------------------------------
# moves across releases
# ---------------------------------------------------------------------------------------------------------------

OLD = {"__init__.py": "", "old.py": "class Moved: ...\ndef stays(): ...\n",
       "user.py": "from megatron.core.old import Moved\n"}
NEW = {"__init__.py": "", "old.py": "def stays(): ...\n", "new.py": "class Moved: ...\n",
       "user.py": "from megatron.core.new import Moved\n"}


def _surface(*releases: dict[str, str]) -> object:
    names = [f"0.{i + 4}.0" for i in range(len(releases))]
    return GEN.Surface(names, [_release(r) for r in releases])


def test_a_definition_that_moves_is_matched_both_ways() -> None:
    moves = GEN.find_moves(_surface(OLD, NEW))
    assert moves.moved == {("Moved", "megatron.core.old", "megatron.core.new")}
    assert moves.dropped == set()  # user.py still has Moved (from the new place)


def test_a_dropped_reexport_links_to_its_origin_one_way() -> None:
    later = dict(NEW, **{"user.py": "X = 1\n"})
    moves = GEN.find_moves(_surface(NEW, later))
    assert moves.dropped == {("Moved", "megatron.core.user", "megatron.core.new")}
    assert moves.moved == set()


def test_a_declared_move_is_verified_and_a_wrong_one_refused() -> None:
    surf = _surface(OLD, NEW)
    assert GEN.verify_move(surf, GEN.Move("Moved", "megatron.core.old", "megatron.core.new", "0.5.0", "cited")) == []
    wrong = GEN.verify_move(surf, GEN.Move("stays", "megatron.core.old", "megatron.core.new", "0.5.0", "cited"))
    assert any("still has stays" in p for p in wrong) and any("has no stays" in p for p in wrong), wrong
    early = GEN.verify_move(surf, GEN.Move("Moved", "megatron.core.old", "megatron.core.new", "0.4.0", "cited"))
    assert early and "oldest" in early[0]


def test_every_declared_move_is_in_the_data_and_cites_a_megatron_file() -> None:
    moved = {(name, old, new) for old, new, text in DATA.MOVES for name in text.split()}
    for move in GEN.MOVES:
        assert (move.name, move.old, move.new) in moved, move
        assert "megatron/core/" in move.source and move.release in DATA.RELEASES, move


# ---------------------------------------------------------------------------------------------------------------
# the generated data
# ---------------------------------------------------------------------------------------------------------------

def test_the_generated_data_covers_the_releases_of_the_matrix() -> None:
    from mcore_compat import support

    assert list(DATA.RELEASES) == [str(r.version) for r in support.Matrix(SCRIPT.parents[1] / "matrix").releases()], \
        "matrix/versions.toml lists other releases: run scripts/gen_surface.py"
    assert DATA.__doc__ and "GENERATED by scripts/gen_surface.py" in DATA.__doc__


def _starts(ranges: str) -> set[str]:
    return {s.version for r in ranges.split() for s in specifier(r)}


def test_every_range_is_valid_and_bounded_by_releases() -> None:
    bounds = {r.removesuffix(".0") if r.count(".") == 2 else r for r in DATA.RELEASES} | set(DATA.RELEASES)
    for module, text in DATA.MODULES.items():
        assert module == "megatron.core" or module.startswith("megatron.core."), module
        assert _starts(text.removeprefix("package ")) <= bounds, (module, text)
    for module, groups in DATA.NAMES.items():
        assert module in DATA.MODULES, module
        for key, names in groups.items():
            kind, _, ranges = key.partition(" ")
            assert kind in surface.KINDS and _starts(ranges) <= bounds, (module, key)
            assert names.split() == sorted(names.split()) and all(n.isidentifier() for n in names.split())


def test_a_name_is_at_a_module_only_in_releases_that_have_the_module() -> None:
    bad = [(m, n, r) for m in DATA.NAMES for n in surface.names(m) for r in DATA.RELEASES
           if surface.kind(m, n, r) is not None and not surface.has_module(m, r)]
    assert bad == []


def test_every_link_joins_known_modules_that_had_the_name() -> None:
    for table in (DATA.MOVES, DATA.DROPPED):
        for old, new, text in table:
            assert old in DATA.MODULES and new in DATA.MODULES, (old, new)
            for name in text.split():
                assert surface.name_ranges(old, name) and surface.name_ranges(new, name), (old, new, name)


# ---------------------------------------------------------------------------------------------------------------
# the query API
# ---------------------------------------------------------------------------------------------------------------

TE_OLD = "megatron.core.transformer.custom_layers.transformer_engine"
TE_NEW = "megatron.core.extensions.transformer_engine"


def test_locate_follows_a_move_both_ways() -> None:
    assert surface.locate(TE_OLD, "TENorm", "0.8.0") == surface.Where(TE_OLD, False)
    assert surface.locate(TE_OLD, "TENorm", "0.19.2") == surface.Where(TE_NEW, True)
    assert surface.locate(TE_NEW, "TENorm", "0.4.0") == surface.Where(TE_OLD, True)
    assert surface.locate(TE_NEW, "TENorm", Version("0.20.0rc1")) == surface.Where(TE_NEW, False)


def test_locate_answers_none_where_no_release_path_has_it() -> None:
    assert surface.locate("megatron.core.optimizer", "OptimizerConfig", "0.5.0") is None
    assert surface.locate("megatron.core.optimizer", "NoSuchName", "0.16.1") is None
    assert surface.releases_having("megatron.core.optimizer", "OptimizerConfig") == DATA.RELEASES[2:]
    assert surface.range_summary(surface.releases_having("megatron.core.optimizer", "OptimizerConfig")) \
        == "0.6.0-0.19.2"


def test_names_include_submodules_and_kinds() -> None:
    top = surface.names("megatron.core", "0.4.0")
    assert top["parallel_state"] == "module" and top["DistributedDataParallel"] == "class"
    assert surface.kind("megatron.core.parallel_state", "get_tensor_model_parallel_rank", "0.12.3") == "function"
    assert "megatron.core.optimizer" not in surface.modules("0.5.0")
    assert "megatron.core.optimizer" in surface.modules("0.6.0") and surface.is_package("megatron.core.optimizer")
    assert surface.releases_having_module("megatron.core.distributed.custom_fsdp") == ("0.12.0", "0.12.3", "0.13.0",
                                                                                      "0.13.1")


#: Names released clients import that the data once lacked (dunder, private, re-exported from torch, a private
#: module): every one is in the data from the release that has it, so scan says raw and the mirror reaches it.
CLIENT_NAMES = {
    ("megatron.core", "__version__"): "0.8.0-0.19.2",
    ("megatron.core.package_info", "__version__"): "0.4.0-0.19.2",
    ("megatron.core.tensor_parallel.random", "detach_variable"): "0.4.0-0.19.2",
    ("megatron.core.tensor_parallel.random", "_set_all_rng_states"): "0.12.0-0.19.2",
    ("megatron.core.dist_checkpointing.strategies.async_utils", "_disable_gc"): "0.12.0-0.19.2",
    ("megatron.core._rank_utils", "safe_get_rank"): "0.16.0-0.19.2",
}


@pytest.mark.parametrize(("module", "name"), list(CLIENT_NAMES))
def test_private_dunder_and_imported_names_are_in_the_data(module: str, name: str) -> None:
    found = surface.releases_having(module, name)
    assert found, (module, name)
    expected = CLIENT_NAMES[(module, name)]
    if expected is not None:
        assert surface.range_summary(found) == expected


def test_a_name_a_later_release_has_is_said_so_by_the_mirror() -> None:
    from mcore_compat._facts.mirror import _unavailable

    text = _unavailable("megatron.core.dist_checkpointing.strategies.async_utils", "_disable_gc", "0.8.0")["message"]
    assert text.endswith("releases 0.12.0-0.19.2 have it"), text
    assert "no supported release" not in text


def test_a_compiled_extension_module_is_a_module() -> None:
    assert surface.releases_having_module("megatron.core.datasets.helpers_cpp")[0] == "0.10.0"
    read = _release({"__init__.py": "", "datasets/__init__.py": "", "datasets/helpers.py": "X = 1\n",
                     "datasets/helpers.cpython-311-x86_64-linux-gnu.so": "", "datasets/fast.cpython-311.so": ""})
    assert read.modules["megatron.core.datasets.fast"] is False and read.names["megatron.core.datasets.fast"] == {}
    assert set(read.names["megatron.core.datasets.helpers"]) == {"X"}  # the .py file wins over an .so
