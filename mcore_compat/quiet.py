"""Known-harmless warnings of Megatron-Core and torch folded into one line (opt-in).

Importing Megatron on a machine without TransformerEngine or apex, or building its config with defaults, prints a
handful of ``UserWarning``/``FutureWarning`` lines that say nothing about the user's run (``Transformer Engine and
Apex are not installed. Falling back to ...``, ``full scope is deprecated``, torch's ``reduce_scatter_tensor is
deprecated`` from Megatron's own calls). With :func:`fold_known_warnings` - or ``MCORE_COMPAT_FOLD_WARNINGS=1`` in
the environment before ``import mcore_compat`` - each warning that matches a row of :data:`KNOWN` is counted
instead of printed, and one line at exit says how many were folded and which kinds; every other warning prints as
before (the ``warnings`` filters still decide what is shown at all)::

    import mcore_compat as mc

    mc.fold_known_warnings()      # or: MCORE_COMPAT_FOLD_WARNINGS=1 python train.py

    # at exit, on stderr:
    # mcore-compat: folded 6 known-harmless warnings (TransformerEngine/apex not installed: 5, ...); ...
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import sys
import warnings
from dataclasses import dataclass
from typing import Any

__all__ = ["ENV", "KNOWN", "Known", "fold_known_warnings", "folded"]

#: The environment variable that turns folding on at ``import mcore_compat`` (any value but ``""``/``0``).
ENV = "MCORE_COMPAT_FOLD_WARNINGS"


@dataclass(frozen=True)
class Known:
    """A known-harmless warning: the ``pattern`` its message matches (``re.search``), a short ``label`` for the
    summary line and ``why`` it is harmless (with the Megatron or torch file that emits it); ``logger``: a log
    record of that logger instead of a Python warning."""

    pattern: str
    label: str
    why: str
    logger: str | None = None


#: The warnings folded (one table: add a row for a new harmless warning, with where it comes from).
KNOWN: tuple[Known, ...] = (
    Known(r"Transformer Engine and Apex are not installed|Apex is not installed\. Falling back",
          "TransformerEngine/apex not installed",
          "Megatron falls back to its torch implementations (optimizer/__init__.py, optimizer/clip_grads.py, "
          "models/backends.py, models/gpt/gpt_layer_specs.py); expected on a CPU or without those packages"),
    Known(r"full scope is deprecated", "cuda_graph_scope default deprecated",
          "TransformerConfig's own default (transformer/transformer_config.py, 0.16+) warns though no CUDA graph "
          "is captured"),
    Known(r"moe_ffn_hidden_size is not set", "moe_ffn_hidden_size defaulted",
          "MoE configs without it take ffn_hidden_size, as documented (transformer/transformer_config.py)"),
    Known(r"MimoModelConfig is experimental", "MimoModelConfig experimental",
          "printed when Megatron's models package is imported (0.19), whether or not MIMO is used"),
    Known(r"absl\.logging is not installed", "absl.logging not installed",
          "Megatron logs through the standard logging module instead (0.19)"),
    Known(r"torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
          "torch collective renamed",
          "Megatron calls torch's older collective names (torch/distributed/c10d_logger.py warns); same operation"),
    Known(r"torch\.cuda\.amp\.custom_(fwd|bwd)\(args\.\.\.\)` is deprecated", "torch.cuda.amp decorators renamed",
          "Megatron 0.4-0.8 decorate autograd functions with the older name (tensor_parallel/layers.py); same "
          "behaviour"),
    Known(r"pkg_resources is deprecated as an API", "pkg_resources deprecated",
          "imported by a dependency at import time; nothing in the run uses it"),
    Known(r"Zarr-based strategies will not be registered", "zarr checkpoint strategy unavailable",
          "dist_checkpointing/strategies/__init__.py (0.4-0.5) logs it without the zarr package; mcore_compat's "
          "checkpoints and Megatron's torch_dist strategy do not use zarr",
          logger="megatron.core.dist_checkpointing.strategies"),
    Known(r"No CUDA runtime is found", "no CUDA runtime (torch.utils.cpp_extension)",
          "logged when Megatron 0.19 imports torch.utils.cpp_extension on a machine without CUDA; nothing is "
          "compiled", logger="torch.utils.cpp_extension"),
)

_COMPILED = [(re.compile(k.pattern), k) for k in KNOWN if k.logger is None]
#: label -> count of the warnings folded in this process.
_FOLDED: dict[str, int] = {}
_STATE: dict[str, Any] = {}


def folded() -> dict[str, int]:
    """How many warnings were folded so far in this process, by :attr:`Known.label`."""
    return dict(_FOLDED)


def _show(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
          line: str | None = None) -> None:
    text = str(message)
    for pattern, known in _COMPILED:
        if pattern.search(text):
            _FOLDED[known.label] = _FOLDED.get(known.label, 0) + 1
            return
    _STATE["show"](message, category, filename, lineno, file, line)


def _summary() -> None:
    """The one line, once per process, on rank 0 only (``RANK`` as torchrun and mcore_compat's launcher set it)."""
    if not _FOLDED or _STATE.get("said") or os.environ.get("RANK", "0") != "0":
        return
    _STATE["said"] = True
    total = sum(_FOLDED.values())
    kinds = ", ".join(f"{label}: {n}" for label, n in _FOLDED.items())
    print(f"mcore-compat: folded {total} known-harmless warning{'s' if total != 1 else ''} ({kinds}); "
          f"mcore_compat/quiet.py says why each is harmless; without {ENV} (or fold_known_warnings(False)) they "
          f"print", file=sys.stderr, flush=True)


class _LogFold(logging.Filter):
    """Folds one logger's records that match a :class:`Known` row."""

    def __init__(self, known: Known) -> None:
        super().__init__()
        self.known, self.pattern = known, re.compile(known.pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:
            return True
        if self.pattern.search(text):
            _FOLDED[self.known.label] = _FOLDED.get(self.known.label, 0) + 1
            return False
        return True


_LOG_FOLDS = [_LogFold(k) for k in KNOWN if k.logger is not None]


def fold_known_warnings(enable: bool = True) -> None:
    """Fold the warnings of :data:`KNOWN` into one line at exit (``enable=False``: print them again)."""
    for fold in _LOG_FOLDS:
        assert fold.known.logger is not None
        (logging.getLogger(fold.known.logger).addFilter if enable else
         logging.getLogger(fold.known.logger).removeFilter)(fold)
    if enable and "show" not in _STATE:
        _STATE["show"] = warnings.showwarning
        warnings.showwarning = _show
        if not _STATE.get("atexit"):
            atexit.register(_summary)  # a rank of mcore_compat.launch ends with os._exit: launch says it there
            _STATE["atexit"] = True
    elif not enable and "show" in _STATE:
        warnings.showwarning = _STATE.pop("show")
