"""Rank body for tests/test_surface_real.py: every fact's probe and every symbol of the tables, checked against
the installed megatron-core on a rank of the session's group (``rank_group``), after the patches a CPU run needs.

The pytest process itself never imports Megatron: the patches that must precede ``import megatron.core`` (the
apex and TransformerEngine stand-ins) are applied first thing on the ranks, as every scenario there does, so
the result does not depend on which test ran before. Returns plain data; the pytest side asserts.
"""

from __future__ import annotations

import traceback
from typing import Any


def _fact(entry: Any, version: Any) -> dict[str, Any]:
    """What the table says for ``version`` and what the probe finds (``error`` set if the probe raised)."""
    row = entry.row_for(version)
    out: dict[str, Any] = {"said": None if row is None else row.value, "row": None if row is None else row.versions,
                           "files": entry.files(), "error": None, "found": None}
    try:
        out["found"] = entry.probe()
    except Exception:
        out["error"] = traceback.format_exc()
    return out


def _injected_drift(version: Any) -> list[str]:
    """The drift report with one wrong row injected: ``ddp_ctor``'s row for ``version`` says "wrong"."""
    import dataclasses

    from mcore_compat._facts.rows import Row
    from mcore_compat._facts.table import FACTS
    from mcore_compat.capabilities import drift

    right = FACTS["ddp_ctor"]
    FACTS["ddp_ctor"] = dataclasses.replace(right, rows=tuple(
        Row(r.versions, "wrong") if r is right.row_for(version) else r for r in right.rows))
    try:
        return drift(version)
    finally:
        FACTS["ddp_ctor"] = right


def _present(sym: Any, version: Any) -> list[str]:
    """Problems of a symbol the table says exists in ``version``."""
    import mcore_compat
    from mcore_compat.symbols import Unavailable, resolve

    loc = sym.location_for(version)
    try:
        obj = resolve(sym.name)
    except Exception:
        return [f"resolving {loc.dotted()} raised:\n{traceback.format_exc()}"]
    if isinstance(obj, Unavailable):
        return [f"the table says {loc.dotted()} exists in {version}, resolve() gave a placeholder: {obj!r}"]
    if obj is None:
        return [f"{loc.dotted()} is None in {version}"]
    if getattr(mcore_compat, sym.name) is not obj:
        return [f"mcore_compat.{sym.name} differs from resolve({sym.name!r})"]
    return []


def _absent(sym: Any, version: Any) -> list[str]:
    """Problems of a symbol the table says does not exist in ``version``: its placeholder must be falsy and raise,
    naming the symbol, the installed version and the versions that have it; no known location may exist."""
    from mcore_compat._facts import probes as _probes
    from mcore_compat.errors import SymbolUnavailableError
    from mcore_compat.symbols import Unavailable, resolve

    obj = resolve(sym.name)
    if not isinstance(obj, Unavailable):
        return [f"the table says absent in {version}, resolve() gave {obj!r}"]
    problems = ["the placeholder is truthy"] if obj else []
    for what, use in (("call", lambda: obj()), ("attribute", lambda: obj.anything), ("item", lambda: obj[0])):
        try:
            use()
        except SymbolUnavailableError as exc:
            message = str(exc)
            missing = [part for part in (sym.name, str(version), sym.available_in()) if part not in message]
            if missing:
                problems.append(f"{what}: the error does not name {missing}: {message}")
        except Exception as exc:
            problems.append(f"{what}: raised {type(exc).__name__} instead of SymbolUnavailableError: {exc}")
        else:
            problems.append(f"{what}: did not raise")
    for loc in sym.locations:
        present = (_probes.defines(loc.module, loc.attr) if loc.attr else _probes.module_exists(loc.module))()
        if present:
            problems.append(f"the table says absent in {version}, but {loc.dotted()} is in the code")
    return problems


def check_surface() -> dict[str, Any]:
    """Facts (table vs probe), symbols (resolution) and the drift check of the installed release, on this rank."""
    from mcore_compat import patches

    patches.apply_for_device("cpu")
    from mcore_compat._facts.symbol_table import SYMBOLS
    from mcore_compat._facts.table import FACTS
    from mcore_compat.capabilities import drift
    from mcore_compat.detect import detect

    info = detect()
    version = info.version
    symbols = {}
    for name, sym in SYMBOLS.items():
        try:
            symbols[name] = (_present if sym.location_for(version) is not None else _absent)(sym, version)
        except Exception:
            symbols[name] = [f"checking it raised:\n{traceback.format_exc()}"]
    return {
        "version": str(version),
        "path": str(info.path),
        "patches": patches.applied(),
        "facts": {name: _fact(entry, version) for name, entry in FACTS.items()},
        "drift": drift(version),
        "injected_drift": _injected_drift(version),
        "symbols": symbols,
    }
