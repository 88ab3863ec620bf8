"""Stand-ins for NVIDIA apex (purpose ``"apex_less"``, 0.4-0.9) and TransformerEngine (``"te_less"``, 0.4-0.7).

Both are installed into ``sys.modules`` before ``megatron.core`` is imported, only when the real package is not
importable, and removed exactly on undo. They implement the few pieces Megatron uses with plain torch:

* apex: ``apex.optimizers.FusedAdam``/``FusedSGD`` (torch AdamW/SGD), ``apex.multi_tensor_apply.multi_tensor_applier``,
  ``amp_C.multi_tensor_scale``/``multi_tensor_l2norm``, ``apex.normalization.fused_layer_norm.FusedLayerNormAffineFunction``
  (``F.layer_norm``). ``apex.contrib`` / ``apex.transformer`` are absent on purpose, so Megatron's optional fused
  paths (persistent layer norm, fused RoPE) stay off.
* TransformerEngine: ``transformer_engine.pytorch.LayerNorm``/``RMSNorm`` (torch), inert ``Linear``,
  ``LayerNormLinear``, ``DotProductAttention``, ``common.recipe.DelayedScaling`` (constructing one raises), and
  ``importlib.metadata.version("transformer-engine") == "0.0.0"``. In 0.4-0.7 ``transformer_block.py`` imports TE
  unconditionally and the final layer norm of ``TransformerBlock`` is always ``TENorm``, so a GPT model needs
  these even with the local layer spec.

Never applied on 0.10+ for apex: there Megatron has torch fallbacks, and a fake apex makes the local layer spec
choose apex's FusedLayerNorm (``ValueError: Apex must be installed to use FusedLayerNorm.``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import UnsupportedFeatureError
from ._registry import Patch, register
from ._tools import Changes, Undo, install_modules, new_module


def _importable(name: str) -> bool:
    if name in sys.modules:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# ================================================================================================== apex
class FusedAdam(torch.optim.AdamW):
    """apex ``FusedAdam`` signature on top of ``torch.optim.AdamW`` (``adam_w_mode=True``, apex's default)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
    ) -> None:
        if amsgrad:
            raise UnsupportedFeatureError("FusedAdam does not support the AMSGrad variant.")
        if not bias_correction:
            raise UnsupportedFeatureError(
                "mcore-compat's apex stub: FusedAdam(bias_correction=False) is not supported"
            )
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        if not adam_w_mode:
            for group in self.param_groups:
                if "decoupled_weight_decay" not in group:
                    raise UnsupportedFeatureError(
                        "mcore-compat's apex stub: FusedAdam(adam_w_mode=False) needs torch.optim.Adam with "
                        "decoupled_weight_decay (torch >= 2.6)"
                    )
                group["decoupled_weight_decay"] = False
        self.set_grad_none = set_grad_none


class FusedSGD(torch.optim.SGD):
    """apex ``FusedSGD`` signature on top of ``torch.optim.SGD``."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        wd_after_momentum: bool = False,
        materialize_master_grads: bool = True,
        set_grad_none: bool = False,
    ) -> None:
        super().__init__(
            params, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov
        )
        self.set_grad_none = set_grad_none


class MultiTensorApply:
    """apex ``MultiTensorApply``: ``applier(op, noop_flag, tensor_lists, *args)`` calls
    ``op(chunk_size, noop_flag, tensor_lists, *args)``."""

    available = True
    warned = False

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size

    def __call__(self, op: Any, noop_flag_buffer: torch.Tensor, tensor_lists: Sequence[Any], *args: Any) -> Any:
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)


def multi_tensor_scale(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Sequence[Sequence[torch.Tensor]], scale: float
) -> None:
    """``dst = src * scale`` for each pair; sets ``noop_flag`` to 1 if a source holds inf/nan (amp_C semantics)."""
    src, dst = tensor_lists[0], tensor_lists[1]
    for s, d in zip(src, dst, strict=True):
        if not bool(torch.isfinite(s).all()):
            noop_flag.fill_(1)
        d.copy_(s * scale)


def multi_tensor_l2norm(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    per_tensor: bool = False,
    *args: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The L2 norm over all tensors of ``tensor_lists[0]`` (a float32 tensor of shape ``[1]``), and the per-tensor
    norms when ``per_tensor`` (else an empty tensor)."""
    tensors = list(tensor_lists[0])
    device = tensors[0].device if tensors else noop_flag.device
    norms = [torch.linalg.vector_norm(t.float()) for t in tensors]
    per = torch.stack(norms) if norms else torch.zeros(0, device=device)
    total = torch.linalg.vector_norm(per).reshape(1) if norms else torch.zeros(1, device=device)
    return total, (per if per_tensor else torch.zeros(0, device=device))


class FusedLayerNormAffineFunction:
    """apex's fused layer norm autograd function, computed with ``F.layer_norm`` (autograd via torch)."""

    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        normalized_shape: Any,
        eps: float,
        memory_efficient: bool = False,
    ) -> torch.Tensor:
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        return F.layer_norm(input, shape, weight, bias, eps)

    @staticmethod
    def apply(*args: Any) -> torch.Tensor:
        return FusedLayerNormAffineFunction.forward(None, *args)


def _apex_modules() -> list[Any]:
    doc = "mcore-compat stand-in for NVIDIA apex (torch implementations); see mcore_compat.patches"
    apex = new_module("apex", package=True, doc=doc, __version__="0.0.0+mcore_compat_stub")
    optimizers = new_module("apex.optimizers", package=True, doc=doc, FusedAdam=FusedAdam, FusedSGD=FusedSGD)
    mta = new_module(
        "apex.multi_tensor_apply",
        package=True,
        doc=doc,
        MultiTensorApply=MultiTensorApply,
        multi_tensor_applier=MultiTensorApply(2048 * 32),
    )
    norm = new_module("apex.normalization", package=True, doc=doc,
                      FusedLayerNormAffineFunction=FusedLayerNormAffineFunction)
    fln = new_module(
        "apex.normalization.fused_layer_norm", doc=doc, FusedLayerNormAffineFunction=FusedLayerNormAffineFunction
    )
    mods = [apex, optimizers, mta, norm, fln]
    if not _importable("amp_C"):
        mods.append(
            new_module(
                "amp_C", doc=doc, multi_tensor_scale=multi_tensor_scale, multi_tensor_l2norm=multi_tensor_l2norm
            )
        )
    return mods


def _apply_apex() -> Undo:
    return install_modules(_apex_modules())


def _check_apex() -> str | None:
    if "apex" in sys.modules:
        return "a module named 'apex' is already imported"
    return None


register(
    Patch(
        name="apex",
        versions=">=0.4,<0.10",
        purposes=("apex_less", "cpu"),
        description=(
            "A torch stand-in for NVIDIA apex (FusedAdam/FusedSGD = torch AdamW/SGD, multi_tensor_applier + "
            "amp_C scale/l2norm, FusedLayerNormAffineFunction = F.layer_norm). 0.6/0.7: megatron.core.optimizer "
            "imports apex unconditionally; 0.8/0.9: 'Please install Apex or Transformer Engine to use "
            "DistributedOptimizer.'; 0.4-0.9 GPT local spec: FusedLayerNorm needs apex. Applied only when apex "
            "is not importable; never on 0.10+."
        ),
        apply_fn=_apply_apex,
        check_fn=_check_apex,
        before_import=True,
        needed_when=lambda: not _importable("apex"),
    )
)


# ================================================================================================ TE
class _TENorm(torch.nn.Module):
    """Shared constructor of the TE norm stand-ins (TE keyword arguments, ``sequence_parallel`` on the params)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype | None = None,
        zero_centered_gamma: bool = False,
        device: Any = None,
        bias: bool = True,
        **_: Any,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=dtype, device=device))
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)
        for p in self.parameters():
            setattr(p, "sequence_parallel", sequence_parallel)  # Megatron's parameter flag

    def _gamma(self) -> torch.Tensor:
        return self.weight + 1 if self.zero_centered_gamma else self.weight


class TELayerNorm(_TENorm):
    """``transformer_engine.pytorch.LayerNorm`` computed with ``F.layer_norm``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.hidden_size,), self._gamma(), self.bias, self.eps)


class TERMSNorm(_TENorm):
    """``transformer_engine.pytorch.RMSNorm`` computed with torch."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> None:
        super().__init__(hidden_size, eps, bias=False, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.to(x.dtype) * self._gamma()


def _refusing_init(qualname: str) -> Callable[..., None]:
    """An ``__init__`` that says ``qualname`` is not part of the TransformerEngine stand-in."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise UnsupportedFeatureError(
            f"{qualname} is not available: transformer_engine is mcore-compat's stand-in (te_stub), which only "
            f"provides LayerNorm/RMSNorm. Use the local (non-TE) layer spec, or install TransformerEngine."
        )

    return __init__


def _inert(qualname: str) -> type:
    name = qualname.rsplit(".", 1)[1]
    return type(name, (torch.nn.Module,), {"__init__": _refusing_init(qualname),
                                           "__module__": qualname.rsplit(".", 1)[0]})


_TE_DIST = "transformer-engine"
_TE_VERSION = "0.0.0"


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class _TEDistribution(importlib.metadata.Distribution):
    """Metadata of the stand-in: ``version('transformer-engine') == '0.0.0'``."""

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return f"Metadata-Version: 2.1\nName: {_TE_DIST}\nVersion: {_TE_VERSION}\n"
        return None

    def locate_file(self, path: Any) -> Any:
        return None


class _TEDistributionFinder(importlib.metadata.DistributionFinder):
    """Finds only the stand-in's distribution metadata; never finds modules."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        return None

    def find_distributions(self, context: Any = None) -> Iterator[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is not None and _normalize(name) in (_normalize(_TE_DIST),):
            yield _TEDistribution()


def _te_modules() -> list[Any]:
    doc = "mcore-compat stand-in for TransformerEngine (torch norms only); see mcore_compat.patches"
    te = new_module("transformer_engine", package=True, doc=doc, __version__=_TE_VERSION)
    pt = new_module(
        "transformer_engine.pytorch",
        package=True,
        doc=doc,
        LayerNorm=TELayerNorm,
        RMSNorm=TERMSNorm,
        Linear=_inert("transformer_engine.pytorch.Linear"),
        LayerNormLinear=_inert("transformer_engine.pytorch.LayerNormLinear"),
        DotProductAttention=_inert("transformer_engine.pytorch.DotProductAttention"),
    )
    common = new_module("transformer_engine.common", package=True, doc=doc)
    recipe = new_module(
        "transformer_engine.common.recipe",
        doc=doc,
        DelayedScaling=type(
            "DelayedScaling",
            (),
            {"__init__": _refusing_init("transformer_engine.common.recipe.DelayedScaling")},
        ),
    )
    return [te, pt, common, recipe]


def _apply_te_stub() -> Undo:
    changes = Changes()
    changes.add(install_modules(_te_modules()))
    finder = _TEDistributionFinder()
    sys.meta_path.append(finder)

    def remove_finder() -> None:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)

    changes.add(remove_finder)
    return changes.undo


def _check_te_stub() -> str | None:
    if "transformer_engine" in sys.modules:
        return "a module named 'transformer_engine' is already imported"
    try:
        importlib.metadata.version(_TE_DIST)
    except importlib.metadata.PackageNotFoundError:
        return None
    return "distribution metadata for transformer-engine is installed (without an importable package)"


register(
    Patch(
        name="te_stub",
        versions=">=0.4,<0.8",
        purposes=("te_less", "cpu"),
        description=(
            "A torch stand-in for TransformerEngine for GPT on 0.4-0.7: transformer_block.py imports "
            "custom_layers/transformer_engine.py unconditionally ('No module named transformer_engine') and "
            "TransformerBlock's final layer norm is always TENorm; 0.6/0.7 call "
            "importlib.metadata.version('transformer-engine') at import. Provides torch LayerNorm/RMSNorm and "
            "version 0.0.0; other TE layers raise when constructed. Applied only when TE is not importable."
        ),
        apply_fn=_apply_te_stub,
        check_fn=_check_te_stub,
        before_import=True,
        needed_when=lambda: not _importable("transformer_engine"),
    )
)
