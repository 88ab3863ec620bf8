"""Rank body for tests/test_config_fields_real.py: the generated config-field data and the config builders
(``mcore_compat.transformer_config``, ``ddp_config``, ``optimizer_config``) against the installed release's real
dataclasses, on a rank of the session's group after the patches a CPU run needs. Returns plain data; the pytest
side asserts.
"""

from __future__ import annotations

import dataclasses
import functools
import traceback
import warnings
from collections.abc import Callable
from typing import Any

CLASSES = ("TransformerConfig", "DistributedDataParallelConfig", "OptimizerConfig")
#: The model fields every build below uses.
BASE = {"num_layers": 1, "hidden_size": 8, "num_attention_heads": 2, "use_cpu_initialization": True}


def _outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    """What ``fn()`` did: its value, the warnings it emitted, or the error it raised (type and message)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            value = fn()
        except Exception as exc:
            return {"error": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}
    return {"error": None, "value": value,
            "warnings": [str(w.message) for w in caught if str(w.message).startswith("mcore_compat")]}


def _fields(cls: Any) -> dict[str, Any]:
    """``{name: value}`` of a dataclass instance, for the fields whose value pickles as plain data."""
    return {f.name: getattr(cls, f.name) for f in dataclasses.fields(cls)
            if isinstance(getattr(cls, f.name), (bool, int, float, str, type(None)))}


def _pick_absent(version: Any, cls: str, harmless: bool) -> tuple[str, Any] | None:
    """A field of ``cls`` the data says ``version`` lacks (under all its names), classified ``harmless`` (or not),
    with a bool/int literal default, and a value that is not that default."""
    from mcore_compat._translate.effects import harmless_if_missing
    from mcore_compat._translate.fields import FIELDS
    from mcore_compat._translate.names import NO_DEFAULT, default_near, family, fields_in

    here = fields_in(cls, version)
    for name in FIELDS[cls]:
        names = family(cls, name)
        if name != names[-1] or any(n in here for n in names) or name.startswith("_"):
            continue
        if any(harmless_if_missing(cls, n) for n in names) is not harmless:
            continue
        default = default_near(cls, names, version)
        if default is NO_DEFAULT:
            continue
        if isinstance(default, bool):
            return name, not default
        if isinstance(default, int):
            return name, default + 3
    return None


def _injected(version: Any, real: Any) -> list[str]:
    """The drift report for TransformerConfig with one wrong row: ``num_layers``'s rows say it exists only in a
    release that is not the installed one, and ``hidden_size``'s default is 12345."""
    from mcore_compat._translate import fields as data
    from mcore_compat._translate.names import drift

    right = data.FIELDS["TransformerConfig"]
    wrong = dict(right)
    wrong["num_layers"] = (("<0.1", "0"),)
    wrong["hidden_size"] = tuple((spec, "12345") for spec, _ in right["hidden_size"])
    data.FIELDS["TransformerConfig"] = wrong
    try:
        return drift("TransformerConfig", real, version)
    finally:
        data.FIELDS["TransformerConfig"] = right


def check_configs() -> dict[str, Any]:
    """Everything tests/test_config_fields_real.py asserts, computed on this rank."""
    import _training_scenarios

    _training_scenarios.apply_patches()
    import mcore_compat as mc
    from mcore_compat._translate.fields import RENAMES
    from mcore_compat._translate.names import drift
    from mcore_compat.configs import translate_fields
    from mcore_compat.detect import detect
    from mcore_compat.rank0 import get_rank, reset_warn_once
    from mcore_compat.symbols import resolve

    version = detect().version
    real = {cls: resolve(cls) for cls in CLASSES}
    real_fields = {cls: [f.name for f in dataclasses.fields(c)] if c else None for cls, c in real.items()}
    out: dict[str, Any] = {"version": str(version), "rank": get_rank(), "real_fields": real_fields}
    out["drift"] = {cls: drift(cls, c if c else None, version) for cls, c in real.items()}
    out["injected"] = _injected(version, real["TransformerConfig"])

    def build(**fields: Any) -> dict[str, Any]:
        return _fields(mc.transformer_config(**BASE, **fields))

    reset_warn_once()
    out["brief"] = _outcome(lambda: build(bias_activation_fusion=False, apply_rope_fusion=False))
    out["new_name"] = _outcome(lambda: build(bias_activation_fusion=True))
    out["old_name"] = _outcome(lambda: build(bias_gelu_fusion=True))
    out["both_names"] = _outcome(lambda: build(bias_gelu_fusion=True, bias_activation_fusion=False))
    out["unknown"] = _outcome(lambda: build(hiden_size=8))
    renames = []
    for cls, pairs in RENAMES.items():
        have = set(real_fields[cls] or ())
        for old, new in pairs:
            installed = [n for n in (old, new) if n in have]
            for given in (old, new):
                renames.append({"cls": cls, "given": given, "installed": installed,
                                "outcome": _outcome(functools.partial(translate_fields, cls, {given: 7},
                                                                      version, have))})
    out["renames"] = renames
    harmful = _pick_absent(version, "TransformerConfig", harmless=False)
    out["harmful"] = None if harmful is None else {
        "field": harmful[0], "value": harmful[1],
        "outcome": _outcome(lambda: build(**{harmful[0]: harmful[1]})),
        "at_default": _outcome(lambda: build(**{harmful[0]: not harmful[1] if isinstance(harmful[1], bool)
                                                else harmful[1] - 3}))}
    harmless = _pick_absent(version, "TransformerConfig", harmless=True)
    out["harmless"] = None if harmless is None else {
        "field": harmless[0], "value": harmless[1],
        "first": _outcome(lambda: build(**{harmless[0]: harmless[1]})),
        "again": _outcome(lambda: build(**{harmless[0]: harmless[1]}))}
    out["ddp"] = _outcome(lambda: _plain(mc.ddp_config(grad_reduce_in_fp32=True, use_distributed_optimizer=True,
                                                       bucket_size=1000, keep_fp8_transpose_cache=False)))
    out["optimizer"] = _outcome(lambda: _plain(mc.optimizer_config(lr=1e-3, weight_decay=0.05,
                                                                   muon_use_nesterov=False)))
    out["decoupled_wd"] = _outcome(lambda: _plain(mc.optimizer_config(lr=1e-3, decoupled_weight_decay=False)))
    return out


def _plain(config: Any) -> dict[str, Any]:
    """A config as plain data: its type's name and its simple fields (a dict stays a dict)."""
    if isinstance(config, dict):
        return {"type": "dict", "fields": dict(config)}
    return {"type": type(config).__name__, "fields": _fields(config)}
