"""Import every mirror import of the four fixed clients (``tests/data/client_mirror_imports.json``, written by
``scripts/measure_clients.py`` from ``scan --fix`` of each client) on the installed release, raw and through the
mirror (runs on a rank of the session's group: the CPU patches applied, as a client's process would)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent / "data" / "client_mirror_imports.json"


def load() -> dict[str, list[tuple[str, str]]]:
    """``client -> [(mirror module, name), ...]``."""
    return {c: [(m, n) for m, n in pairs] for c, pairs in json.loads(DATA.read_text()).items()}


def _resolve(module: str, name: str) -> tuple[bool, str]:
    """Whether ``from module import name`` works here (``import module.name`` for a submodule), and why not."""
    try:
        mod = importlib.import_module(module)
        if hasattr(mod, name):
            return True, ""
        importlib.import_module(f"{module}.{name}")
        return True, ""
    except Exception as exc:  # any failure of the raw import counts as 'does not resolve'
        return False, f"{type(exc).__name__}: {exc}"[:300]


def check_clients() -> dict[str, Any]:
    """Per client: the pairs whose raw import works, and of those the ones the mirror fails (with the error);
    the moved pairs (raw fails, the data says moved) and the mirror's failures among them. Rank 0 only (the other
    ranks return at once: the imports are the same on every rank)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return {}
    from mcore_compat import patches

    patches.apply_for_device("cpu")
    from mcore_compat import surface
    from mcore_compat._facts.mirror import installed_release, real_path

    release = installed_release()
    out: dict[str, Any] = {"release": release, "clients": {}}
    for client, pairs in load().items():
        raw_ok, failed, moved, moved_failed, verdicts = 0, [], 0, [], []
        for mirror_module, name in pairs:
            raw_module = real_path(mirror_module)
            ok, why_not = _resolve(raw_module, name)
            # the scan's verdict (the surface data) against the real import: 'raw' exactly where it imports; a
            # failure counts as absent where Megatron's module or name is missing, not where the module fails to
            # import for want of another package (TransformerEngine, apex on this CPU machine)
            said = surface.locate(raw_module, name, release)
            says_raw = said is not None and not said.moved
            absent = not ok and "No module named 'megatron." in why_not
            if (ok and not says_raw) or (absent and says_raw):
                verdicts.append(f"{raw_module}.{name}: the data says {'raw' if says_raw else 'not raw'}, the import "
                                f"{'works' if ok else 'fails: ' + why_not}")
            if ok:
                raw_ok += 1
                good, why = _resolve(mirror_module, name)
                if not good:
                    failed.append(f"{raw_module}.{name}: {why}")
                continue
            where = surface.locate(raw_module, name, release)
            if where is not None and where.moved and _resolve(where.module, name)[0]:
                moved += 1
                good, why = _resolve(mirror_module, name)
                if not good:
                    moved_failed.append(f"{raw_module}.{name} (moved to {where.module}): {why}")
        out["clients"][client] = {"pairs": len(pairs), "raw_ok": raw_ok, "mirror_failed": failed,
                                  "moved": moved, "moved_failed": moved_failed, "verdicts_wrong": verdicts}
    return out
