"""Scenarios for tests/test_configs_real.py: the self-check's model in every parallel configuration, built.

Training, gradients, finalize effects and replicas of these configurations are proven by the self-check suite
(tests/test_selfcheck_real.py); what is left to test here is the construction itself, which the self-check's
reference copies and cannot see: each virtual stage holds its own layers, the tied embedding has its two copies
on the first and last stage, sequence-parallel norms are marked for the tensor-parallel all-reduce, experts are
marked as expert-parallel. ``build_world(2)`` builds every configuration of world size 2 on every rank of ONE
gloo group (:func:`configs`) and returns plain data; the pytest side asserts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from _training_scenarios import apply_patches


@dataclass(frozen=True)
class Config:
    """One configuration: ``options`` are :class:`~mcore_compat.selfcheck.SelfCheckOptions` fields."""

    name: str
    world: int
    options: dict[str, Any] = field(default_factory=dict)


def configs() -> list[Config]:
    """Every configuration whose construction is checked."""
    return [
        Config("tp2-sp", 2, dict(tp=2, sequence_parallel=True)),
        Config("pp2-tied", 2, dict(pp=2, tie_embeddings=True)),
        Config("pp2-vpp2-tied", 2, dict(pp=2, vpp=2, tie_embeddings=True)),
        Config("dp2-moe-ep2", 2, dict(experts=4, ep=2)),
    ]


def options_of(config: Config) -> Any:
    """The resolved :class:`SelfCheckOptions` of a configuration (CPU, tiny GPT)."""
    from mcore_compat.selfcheck import SelfCheckOptions

    return SelfCheckOptions(nproc=config.world, device="cpu", model="gpt", **config.options).resolved()


def _core(chunk: Any) -> Any:
    while hasattr(chunk, "module") and type(chunk).__name__ in ("DistributedDataParallel", "Float16Module"):
        chunk = chunk.module
    return chunk


def _build(config: Config) -> dict[str, Any]:
    from mcore_compat import symbols
    from mcore_compat.selfcheck import models

    opts = options_of(config)
    reason = models.unsupported_reason(opts)
    if reason is not None:
        return {"status": "unsupported", "reason": reason}
    models.init_parallel(opts)
    ps = symbols.resolve("parallel_state")
    chunks, _ = models.build_chunks(opts)
    params = {f"chunk{i}.{n}": p for i, c in enumerate(chunks) for n, p in _core(c).named_parameters()}
    return {
        "status": "ok",
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "layer_numbers": [[layer.layer_number for layer in _core(c).decoder.layers] for c in chunks],
        "names": sorted(params),
        "sequence_parallel": sorted(n for n, p in params.items() if getattr(p, "sequence_parallel", False)),
        "tp_replicated": sorted(n for n, p in params.items() if not getattr(p, "tensor_model_parallel", False)),
        "expert": sorted(n for n, p in params.items() if not getattr(p, "allreduce", True)),
        "tied": sorted(n for i, c in enumerate(chunks)
                       if getattr(_core(c), "share_embeddings_and_output_weights", False)
                       and hasattr(_core(c), "shared_embedding_or_output_weight")
                       and _core(c).shared_embedding_or_output_weight() is not None
                       for n in [f"chunk{i}"]),
    }


def build_world(world: int) -> dict[str, Any]:
    """Every configuration of ``world`` ranks, built on this rank: ``{name: result}``."""
    apply_patches()
    from mcore_compat import symbols

    out = {}
    for config in configs():
        if config.world == world:
            out[config.name] = _build(config)
            ps = symbols.resolve("parallel_state")
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
    return out
