"""mcore-compat: one import surface over every Megatron-Core release (0.4.0 to 0.19.x).

Import this instead of raw ``megatron.*``::

    import mcore_compat as mc

    mc.MCORE_VERSION                 # packaging.version.Version of the installed megatron-core
    mc.detect()                      # version, where it came from, the path imported
    mc.has("core_optimizer")         # boolean facts (capabilities): table rows, not version comparisons
    mc.fact("ddp_ctor")              # valued facts, e.g. how DistributedDataParallel takes its settings
    mc.parallel_state, mc.mpu, mc.DistributedDataParallel, mc.TransformerConfig, ...  # lazily resolved
    mc.print_rank_0("hello")         # rank-zero logging, before and after init_process_group
    mc.transformer_config(num_layers=2, hidden_size=64, num_attention_heads=4, bias_activation_fusion=True)
                                     # Megatron's config objects from the field names of any release
    mc.offload(chunks, optimizer); mc.reload(chunks, optimizer)   # free device memory in place, bring it back

Nothing in Megatron-Core is imported or patched by ``import mcore_compat``: symbols are resolved on first access,
and runtime patches (``mcore_compat.patches``) are applied only when asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._util.deprecated import DEPRECATED_TOP_LEVEL, warn_deprecated_name
from ._version import __version__
from .capabilities import capabilities, fact, has
from .detect import MegatronInfo, detect, refresh
from .errors import (
    McoreCompatError,
    MegatronNotFoundError,
    PatchError,
    PatchRefusedError,
    SymbolUnavailableError,
    UnsupportedVersionError,
)
from .rank0 import get_rank, is_rank_0, log_rank_0, print_rank_0, warn_once_rank_0
from .symbols import Unavailable, symbol_names

if TYPE_CHECKING:  # pragma: no cover
    from packaging.version import Version

    from .configs import ddp_config as ddp_config
    from .configs import optimizer_config as optimizer_config
    from .configs import transformer_config as transformer_config

    MCORE_VERSION: Version

__all__ = [
    "MCORE_VERSION",
    "McoreCompatError",
    "MegatronInfo",
    "MegatronNotFoundError",
    "PatchError",
    "PatchRefusedError",
    "SymbolUnavailableError",
    "Unavailable",
    "UnsupportedVersionError",
    "__version__",
    "capabilities",
    "detect",
    "fact",
    "get_rank",
    "has",
    "is_rank_0",
    "log_rank_0",
    "print_rank_0",
    "refresh",
    "symbol_names",
    "warn_once_rank_0",
]


def _source_checkout_path() -> None:
    """In a source checkout (not installed), find ``patches/`` and ``matrix/`` the way the installed package has
    them (``mcore_compat.patches``, ``mcore_compat.matrix``): pyproject maps those top-level folders into it."""
    from pathlib import Path

    here = Path(__file__).resolve().parent
    root = here.parent
    if not (here / "patches").is_dir() and (root / "patches" / "__init__.py").is_file() \
            and (root / "pyproject.toml").is_file():
        __path__.append(str(root))


_source_checkout_path()


def _fold_from_environment() -> None:
    """``MCORE_COMPAT_FOLD_WARNINGS=1``: Megatron's and torch's known-harmless warnings folded into one line
    (:mod:`mcore_compat.quiet`), from before Megatron is imported."""
    import os

    if os.environ.get("MCORE_COMPAT_FOLD_WARNINGS", "") not in ("", "0"):
        from .quiet import fold_known_warnings

        fold_known_warnings()


_fold_from_environment()

#: Public names provided by mcore_compat's own submodules, imported on first access.
_LAZY_MODULE_ATTRS: dict[str, str] = {
    "patches": "mcore_compat.patches",
    "launch": "mcore_compat.launch",
    "support": "mcore_compat.support",
    "training": "mcore_compat.training",
    "selfcheck": "mcore_compat.selfcheck",
    "lifecycle": "mcore_compat.lifecycle",
    "checkpoint": "mcore_compat.checkpoint",
}
#: Names re-exported from submodules on first access (module, attribute).
_LAZY_ATTRS: dict[str, tuple[str, str]] = {
    name: ("mcore_compat.training", name)
    for name in ("DDPConfig", "OptimConfig", "wrap_ddp", "get_megatron_optimizer", "install_training_hooks",
                 "check_training_hooks", "forward_backward", "optimizer_step", "zero_grad_buffer",
                 "MissingTrainingHookError")
}
_LAZY_ATTRS.update({name: ("mcore_compat.configs", name)
                    for name in ("transformer_config", "ddp_config", "optimizer_config")})
_LAZY_ATTRS.update({name: ("mcore_compat.layout", name) for name in ("layout_of", "compute_layout", "ModelLayout")})
_LAZY_ATTRS.update({name: ("mcore_compat.binding", name)
                    for name in ("bind_params", "gather_pipeline", "gather_pipeline_flat", "gather_full", "iter_full",
                                 "ParamBinding", "StageBuffers", "BindingError", "Manifest")})
_LAZY_ATTRS.update({name: ("mcore_compat.lifecycle", name)
                    for name in ("offload", "reload", "offloaded", "OffloadError", "release_host_buffers")})
_LAZY_ATTRS["fold_known_warnings"] = ("mcore_compat.quiet", "fold_known_warnings")
_LAZY_ATTRS.update({name: ("mcore_compat.checkpoint", name)
                    for name in ("save_checkpoint", "load_checkpoint", "inspect_checkpoint", "CheckpointError",
                                 "LoadedCheckpoint", "save_to_run", "latest_checkpoint", "save_checkpoint_async",
                                 "save_to_run_async")})


def __getattr__(name: str) -> Any:
    if name == "MCORE_VERSION":
        return detect().version
    if name in _LAZY_MODULE_ATTRS:
        module = importlib.import_module(_LAZY_MODULE_ATTRS[name])
        globals()[name] = module
        return module
    if name in _LAZY_ATTRS:
        mod, attr = _LAZY_ATTRS[name]
        value = getattr(importlib.import_module(mod), attr)
        if name in DEPRECATED_TOP_LEVEL:  # an adapter under a Megatron name: warn (once) on every access
            warn_deprecated_name(f"mcore_compat.{name}")
            return value
        globals()[name] = value
        return value
    if name in symbol_names():
        from .symbols import resolve

        value = resolve(name)
        globals()[name] = value  # cache: later accesses skip __getattr__
        return value
    raise AttributeError(f"module 'mcore_compat' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(symbol_names()) | set(_LAZY_MODULE_ATTRS) | set(_LAZY_ATTRS))
