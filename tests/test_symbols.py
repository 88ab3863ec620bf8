"""The import surface table and its placeholders (no megatron-core needed: resolution is asked per version)."""

from __future__ import annotations

import pytest
from packaging.version import Version

import mcore_compat
from mcore_compat.errors import SymbolUnavailableError
from mcore_compat.symbols import Unavailable, resolve, resolve_location, symbol_names

REQUIRED = [
    "parallel_state", "mpu", "tensor_parallel", "DistributedDataParallel", "DistributedDataParallelConfig",
    "OptimizerConfig", "finalize_model_grads", "get_forward_backward_func", "get_model_config",
    "ModelParallelConfig", "TransformerConfig", "MegatronModule", "Float16Module", "GPTModel",
    "get_gpt_layer_local_spec", "dist_checkpointing", "Timers", "unwrap_model",
]


def test_required_names_are_in_the_table() -> None:
    missing = [n for n in REQUIRED if n not in symbol_names()]
    assert not missing


@pytest.mark.parametrize("version", ["0.4.0", "0.6.0", "0.9.0", "0.16.1", "0.19.2", "0.25.0rc1+abc"])
def test_everyday_symbols_resolve_on_every_release(version: str) -> None:
    for name in ["parallel_state", "DistributedDataParallel", "finalize_model_grads", "TransformerConfig",
                 "get_forward_backward_func", "GPTModel"]:
        assert resolve_location(name, Version(version)) is not None, (name, version)


def test_moved_symbol_follows_the_table() -> None:
    assert resolve_location("ParamAndGradBuffer", Version("0.8.0")).attr == "ParamAndGradBuffer"
    assert resolve_location("ParamAndGradBuffer", Version("0.10.0")).attr == "_ParamAndGradBuffer"
    assert resolve_location("ParamAndGradBuffer", Version("0.5.0")) is None
    assert resolve_location("GradBuffer", Version("0.5.0")) is not None


def test_absent_symbol_is_a_placeholder_that_explains_itself() -> None:
    placeholder = resolve("Timers", Version("0.4.0"))  # Timers appeared in 0.5
    assert isinstance(placeholder, Unavailable)
    assert not placeholder
    with pytest.raises(SymbolUnavailableError) as err:
        placeholder()
    message = str(err.value)
    assert "Timers" in message and "0.4.0" in message and "0.5" in message
    with pytest.raises(SymbolUnavailableError):
        placeholder.start  # noqa: B018
    with pytest.raises(AttributeError):  # dunder lookups behave like a normal object (copy, pickle, hasattr)
        placeholder.__wrapped__  # noqa: B018
    assert "unavailable" in repr(placeholder)


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(SymbolUnavailableError, match="not part of mcore_compat's import surface"):
        resolve_location("NoSuchThing", Version("0.16.1"))
    with pytest.raises(AttributeError):
        mcore_compat.NoSuchThing  # noqa: B018


def test_dir_lists_the_surface() -> None:
    assert set(REQUIRED) <= set(dir(mcore_compat))
