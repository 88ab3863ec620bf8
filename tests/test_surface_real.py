"""The tables against the ONE installed megatron-core (runs inside a matrix session).

* every capability row: what the table says for the detected version == what its probe finds in the code;
* every symbol: resolves to a real object where the table says it exists, and to an ``Unavailable``
  placeholder (whose use raises ``SymbolUnavailableError`` naming the symbol, the installed version and the
  versions that have it) where it does not.

Some imports need runtime patches applied before ``megatron.core`` is imported (an apex stub on 0.6-0.9, a
TransformerEngine stub for GPT on 0.4-0.7, the CPU harness); the module fixture applies them through
``mcore_compat.patches`` when that package is available.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest


def _megatron_importable() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):
        return False


if not _megatron_importable():
    pytest.skip(
        "megatron-core is not on sys.path: these tests check the tables against a real release; run them in a "
        "nox matrix session (nox -l lists them)",
        allow_module_level=True,
    )

from mcore_compat import _probes  # noqa: E402
from mcore_compat._capability_table import CAPABILITIES  # noqa: E402
from mcore_compat._symbol_table import SYMBOLS  # noqa: E402
from mcore_compat.capabilities import Capability  # noqa: E402
from mcore_compat.detect import detect  # noqa: E402
from mcore_compat.errors import McoreCompatError, SymbolUnavailableError  # noqa: E402
from mcore_compat.symbols import Symbol, Unavailable, resolve  # noqa: E402

pytestmark = pytest.mark.mcore

#: Modules whose absence is what the runtime patches paper over.
_PATCHED_DEPENDENCIES = ("apex", "amp_C", "transformer_engine")

_STATE: dict[str, object] = {"patches": None}


def _cpu_only() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing or broken
        return True


@pytest.fixture(scope="module", autouse=True)
def _patched_megatron() -> Iterator[None]:
    """Apply the CPU/apex-less/TE-less patches for the installed release (if ``mcore_compat.patches`` exists),
    and revert exactly what was applied afterwards."""
    arch_was_set = "TORCH_CUDA_ARCH_LIST" in os.environ
    if _cpu_only() and not arch_was_set:
        # 0.15.x JIT-builds a CUDA extension while `megatron.core` is imported; with no GPU torch cannot pick
        # an architecture unless one is named (the build then fails softly and the import succeeds).
        os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
    try:
        yield from _with_patches()
    finally:
        if not arch_was_set:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)


def _with_patches() -> Iterator[None]:
    try:
        from mcore_compat import patches
    except ImportError as exc:
        _STATE["patches"] = f"mcore_compat.patches is unavailable ({exc})"
        yield
        return
    before = set(patches.applied())
    try:
        patches.apply_for("cpu", "apex_less", "te_less")
        _STATE["patches"] = [n for n in patches.applied() if n not in before]
    except McoreCompatError as exc:
        _STATE["patches"] = f"the patches were not applied ({exc})"
    yield
    for name in reversed([n for n in patches.applied() if n not in before]):
        patches.revert(name)


def _missing_patched_dependency(exc: BaseException) -> str | None:
    """The apex/TE module whose absence caused ``exc`` (following the cause chain), if any."""
    cur: BaseException | None = exc
    while cur is not None:
        if isinstance(cur, ModuleNotFoundError) and cur.name:
            root = cur.name.split(".")[0]
            if root in _PATCHED_DEPENDENCIES:
                return root
        cur = cur.__cause__ or cur.__context__
    return None


# ------------------------------------------------------------------------------------------- capabilities


@pytest.mark.parametrize("cap", CAPABILITIES, ids=[c.name for c in CAPABILITIES])
def test_capability_row_matches_code(cap: Capability) -> None:
    version = detect().version
    said = cap.holds_for(version)
    found = cap.probe()
    assert said == found, (
        f"capability {cap.name!r}: the table says it {'holds' if said else 'does not hold'} for megatron-core "
        f"{version} (range {cap.versions!r}), but the probe finds {found} in {detect().path}. Fix the range in "
        f"mcore_compat/_capability_table.py."
    )


# ------------------------------------------------------------------------------------------------ symbols


@pytest.mark.parametrize("sym", list(SYMBOLS.values()), ids=list(SYMBOLS))
def test_symbol_resolves(sym: Symbol) -> None:
    version = detect().version
    loc = sym.location_for(version)
    if loc is None:
        _check_unavailable(sym, version)
        return
    try:
        obj = resolve(sym.name)
    except SymbolUnavailableError as exc:
        dep = _missing_patched_dependency(exc)
        applied = _STATE["patches"]
        if dep is not None and sym.needs and not (isinstance(applied, list) and applied):
            why = applied if isinstance(applied, str) else "no patch applied"
            pytest.skip(f"{sym.name} needs {sym.needs}; {dep} is missing and {why}")
        raise
    assert not isinstance(obj, Unavailable), f"{sym.name}: table says {loc.dotted()} exists in {version}"
    assert obj is not None, f"{sym.name}: {loc.dotted()} is None in {version}"
    import mcore_compat

    assert getattr(mcore_compat, sym.name) is obj, f"mcore_compat.{sym.name} differs from resolve()"


def _check_unavailable(sym: Symbol, version: object) -> None:
    obj = resolve(sym.name)
    assert isinstance(obj, Unavailable), f"{sym.name}: table says absent in {version}, resolve gave {obj!r}"
    assert not obj
    for use in (lambda: obj(), lambda: obj.anything, lambda: obj[0]):
        with pytest.raises(SymbolUnavailableError) as info:
            use()
        message = str(info.value)
        assert sym.name in message, message
        assert str(version) in message, message
        assert sym.available_in() in message, message
    # ... and none of the symbol's known locations exists in the installed code.
    for loc in sym.locations:
        present = (_probes.defines(loc.module, loc.attr) if loc.attr else _probes.module_exists(loc.module))()
        assert not present, f"{sym.name}: table says absent in {version}, but {loc.dotted()} is in the code"
