"""Patches for Megatron-Core's MoE layer: ``moe_te_gemm_name`` and ``moe_local_spec_te_names`` (purpose
``"upstream_bug"``: they hit GPU users without TransformerEngine as well; each patches a Megatron module when it is
imported, or at once if it is) and ``moe_histc_cpu`` (purpose ``"cpu"``: a torch operation the CPU lacks)."""

from __future__ import annotations

import importlib.util
import types
from collections.abc import Callable
from typing import Any

import torch

from ._registry import Patch, register
from ._tools import Changes, Undo, skipped, when_imported_checked

_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"


def _te_missing() -> bool:
    try:
        return importlib.util.find_spec("transformer_engine") is None
    except (ImportError, ValueError):
        return True


def _needed_without_te() -> bool:
    """``needed_when``: TransformerEngine is missing (with it, the names the patches bind exist)."""
    return _te_missing()


def _bind_missing_to_none(patch: str, module_name: str, names: tuple[str, ...]) -> Callable[[], Undo]:
    """An ``apply_fn``: when ``module_name`` is imported (at once if it is), after its targets pass the patch's
    fingerprint check, bind each of ``names`` it lacks to ``None`` (what the release reads when TE is missing)."""

    def patch_module(module: types.ModuleType) -> Undo:
        missing = [name for name in names if not hasattr(module, name)]
        if not missing:
            return skipped(patch, f"{module.__name__} already defines {', '.join(names)}")
        changes = Changes()
        for name in missing:
            changes.setattr(module, name, None)
        return changes.undo

    return lambda: when_imported_checked(patch, module_name, patch_module)


# ------------------------------------------------------------------------------------------ moe_te_gemm_name
register(
    Patch(
        name="moe_te_gemm_name",
        versions=">=0.13,<0.17",
        purposes=("upstream_bug", "cpu"),
        description=(
            "0.13-0.16 without TransformerEngine: transformer/moe/moe_utils.py imports te_general_gemm only "
            "inside its `try: import transformer_engine` block, but RouterGatingLinearFunction tests "
            "`te_general_gemm is not None` unconditionally, so every MoE router forward raises "
            "\"NameError: name 'te_general_gemm' is not defined\". Defines it as None (what 0.17 does)."
        ),
        apply_fn=_bind_missing_to_none("moe_te_gemm_name", _MOE_UTILS, ("te_general_gemm",)),
        needed_when=_needed_without_te,
        targets=("megatron.core.transformer.moe.moe_utils:RouterGatingLinearFunction",),
    )
)


# ------------------------------------------------------------------------------------- moe_local_spec_te_names
_GPT_SPECS = "megatron.core.models.gpt.gpt_layer_specs"
_TE_SPEC_NAMES = ("TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear", "TEColumnParallelLinear",
                  "TERowParallelLinear")


register(
    Patch(
        name="moe_local_spec_te_names",
        versions=">=0.10,<0.11",
        purposes=("upstream_bug", "cpu"),
        description=(
            "0.10.x without TransformerEngine: get_gpt_layer_local_spec(num_experts=...) builds the MoE spec "
            "with use_te=True (models/gpt/gpt_layer_specs.py _get_mlp_module_spec), which reads "
            "TEColumnParallelGroupedLinear and TEColumnParallelLinear, names bound only when TE imports: "
            "\"NameError: name 'TEColumnParallelGroupedLinear' is not defined\". Binds the missing TE names to "
            "None, so the local spec gets its ColumnParallelLinear/RowParallelLinear experts (0.11 passes use_te "
            "through)."
        ),
        apply_fn=_bind_missing_to_none("moe_local_spec_te_names", _GPT_SPECS, _TE_SPEC_NAMES),
        needed_when=_needed_without_te,
        targets=("megatron.core.models.gpt.gpt_layer_specs:_get_mlp_module_spec",),
    )
)


# ------------------------------------------------------------------------------------------- moe_histc_cpu
_TORCH_HISTC = torch.histc


def _histc(input: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0, **kwargs: Any) -> torch.Tensor:
    """``torch.histc`` that also counts integer tensors on a CPU (as CUDA does), in the input's dtype."""
    if input.device.type == "cpu" and not input.is_floating_point() and not kwargs:
        return _TORCH_HISTC(input.double(), bins=bins, min=min, max=max).to(input.dtype)
    return _TORCH_HISTC(input, bins=bins, min=min, max=max, **kwargs)


def _apply_moe_histc_cpu() -> Undo:
    changes = Changes()
    changes.setattr(torch, "histc", _histc)
    return changes.undo


register(
    Patch(
        name="moe_histc_cpu",
        versions=">=0.5,<0.10,!=0.8.*",
        purposes=("cpu",),
        description=(
            "0.5-0.9 (not 0.8): the MoE token dispatchers count tokens per expert with torch.histc on the integer "
            "expert indices, which CUDA supports and the CPU does not (\"NotImplementedError: histogram_cpu not "
            "implemented for 'Long'\"). torch.histc counts integer CPU tensors through float64 (exact for "
            "expert indices) and returns the input's dtype, as on CUDA. Skipped where the dispatcher uses "
            "torch.bincount."
        ),
        apply_fn=_apply_moe_histc_cpu,
        check_fn=lambda: None if callable(getattr(torch, "histc", None)) else "torch.histc is missing",
    )
)
