"""Pipeline-parallel resharding of a checkpoint: which saved stage holds each tensor a rank of another pipeline
size loads, found from Megatron's own layer numbers rather than from names.

Each pipeline stage numbers its transformer layers locally in its ``state_dict`` (``<block>.layers.<i>.``); the global
number is the stage's layer offset plus ``i``, computed differently per release
(megatron/core/transformer/transformer_layer.py: the method ``TransformerLayer._get_layer_offset`` 0.4-0.10,
``get_transformer_layer_offset(config)`` from 0.11 with uneven first/last stages through
``num_layers_in_first_pipeline_stage`` / ``..._last_...``, a ``vp_stage`` argument from 0.13, ``pp_rank`` from 0.15).
Every release stores the result on the layer: ``TransformerLayer.layer_number`` (1-based, global).
:func:`stage_record` reads it at save from the built model: per chunk, ``{module name: layer_number}`` of the
outermost modules carrying ``layer_number`` (inner modules such as 0.4's attention carry the local number), the name
of the tied embedding / output weight and ``config.num_layers``. The load reads the same from the loading model, so a
tensor's place is its layer number and its name inside the layer (or, outside the layers, its name), whatever the
split of layers over stages.

Tied embeddings (``share_embeddings_and_output_weights``): at PP > 1 the last stage holds ``output_layer.weight``,
a parameter of its own that Megatron keeps equal to the first stage's embedding (zeroed then all-reduced over the
embedding group at build, its gradient all-reduced with the embedding's: models/common/language_module/
language_module.py, ``setup_embeddings_and_output_layer``; distributed/finalize_model_grads.py), with its own main
param and Adam moments; at PP=1 there is only the embedding. ``shared_embedding_or_output_weight()`` (every
release) names it on each stage; both are the one tensor ``tied`` here. Saved at PP > 1, the copies (weights,
main params, moments) must be equal (else the load is refused naming them) and the first stage's is taken; loaded
at PP > 1, the last stage's copy and its optimizer state come from the saved embedding's.

Refused, before anything is loaded: a checkpoint without the record (written before it existed), a changed layer
count or tied-embedding setting, one layer number held by two modules (e.g. multi-token-prediction layers), and a
non-layer tensor held by two saved stages with different values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..layout.read import unwrap
from .errors import CheckpointMismatchError, CheckpointReshardError

__all__ = ["TIED", "Assemble", "Restaged", "StageChunk", "global_id", "restage", "stage_record"]

#: The global id of the tied embedding / output weight (on whichever stage holds it).
TIED = "<tied embedding>"


@dataclass(frozen=True)
class StageChunk:
    """One model chunk's place in the model: ``layers`` maps the name of each transformer layer module to its global
    ``layer_number`` (1-based), ``tied`` names the chunk's tied embedding / output weight (``None``: none on this
    chunk), ``share`` is the model's ``share_embeddings_and_output_weights`` and ``num_layers`` its
    ``config.num_layers`` (``None``: unknown)."""

    layers: dict[str, int] = field(default_factory=dict)
    tied: str | None = None
    share: bool = False
    num_layers: int | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StageChunk:
        return cls(layers={k: int(v) for k, v in data.get("layers", {}).items()}, tied=data.get("tied"),
                   share=bool(data.get("share", False)), num_layers=data.get("num_layers"))

    def to_json(self) -> dict[str, Any]:
        return {"layers": dict(self.layers), "tied": self.tied, "share": self.share, "num_layers": self.num_layers}

    def duplicate(self) -> tuple[int, list[str]] | None:
        """A layer number held by two modules, and their names (``None``: each number once)."""
        seen: dict[int, list[str]] = {}
        for name, number in self.layers.items():
            seen.setdefault(number, []).append(name)
        return next(((n, names) for n, names in sorted(seen.items()) if len(names) > 1), None)


def chunk_layout(chunk: Any) -> StageChunk:
    """The :class:`StageChunk` of a (wrapped) model chunk, read from the built model."""
    core = unwrap(chunk)
    layers: dict[str, int] = {}
    for name, module in core.named_modules():
        number = getattr(module, "layer_number", None)
        if isinstance(number, int) and not isinstance(number, bool) and name \
                and not any(name.startswith(outer + ".") for outer in layers):
            layers[name] = number
    share = bool(getattr(core, "share_embeddings_and_output_weights", False))
    tied = None
    getter = getattr(core, "shared_embedding_or_output_weight", None)
    if share and callable(getter):
        weight = getter()
        tied = next((n for n, p in core.named_parameters() if p is weight), None) if weight is not None else None
    num_layers = getattr(getattr(core, "config", None), "num_layers", None)
    return StageChunk(layers, tied, share, num_layers if isinstance(num_layers, int) else None)


def stage_record(chunks: list[Any]) -> list[dict[str, Any]]:
    """What the pipeline record (:data:`~.manifest.PP_RECORD`) stores for one stage: each chunk's
    :class:`StageChunk` as JSON."""
    return [chunk_layout(c).to_json() for c in chunks]


def global_id(name: str, chunk: StageChunk) -> str:
    """The stage-independent id of the tensor ``name`` of ``chunk``'s ``state_dict`` (or ``named_parameters``):
    :data:`TIED` for the tied weight, ``"layer<N>/<name inside the layer>"`` inside transformer layer ``N``, else
    ``name``."""
    if name == chunk.tied:
        return TIED
    best = max((p for p in chunk.layers if name.startswith(p + ".")), key=len, default=None)
    return name if best is None else f"layer{chunk.layers[best]}/{name[len(best) + 1:]}"


@dataclass
class Restaged:
    """The saved values one loading rank needs, under its own names.

    ``model``: ``{name: tensor}`` of the rank's (one) chunk; ``shards``: one shard-like dict (``coords`` and
    ``optimizer.params``) whose records carry the rank's param names; ``saved`` / ``used``: the global ids the
    checkpoint holds and those this rank loads (``"model:<id>"``, ``"opt:<id>"``), so that the ranks together can
    tell whether every saved tensor found a place."""

    model: dict[str, torch.Tensor] = field(default_factory=dict)
    shards: list[dict[str, Any]] = field(default_factory=list)
    saved: set[str] = field(default_factory=set)
    used: set[str] = field(default_factory=set)


def _stage_chunks(record: dict[str, list[dict[str, Any]]], saved_pp: int, hint: str) -> dict[int, StageChunk]:
    """``{saved stage: its one chunk's StageChunk}`` from the record (refused: a stage missing or with virtual
    stages)."""
    out: dict[int, StageChunk] = {}
    for stage in range(saved_pp):
        chunks = record.get(f"pp{stage}")
        if not chunks or len(chunks) != 1:
            raise CheckpointReshardError(f"the checkpoint's pipeline record has {len(chunks or [])} chunk(s) for "
                                         f"PP stage {stage}, a PP change needs one; {hint}")
        out[stage] = StageChunk.from_json(chunks[0])
    return out


def _check_layouts(saved: dict[int, StageChunk], mine: StageChunk, hint: str) -> None:
    """Refuse another layer count or tie setting, and a layer number held twice (saved or here)."""
    counts = {c.num_layers for c in saved.values() if c.num_layers is not None}
    if counts and mine.num_layers is not None and mine.num_layers not in counts:
        raise CheckpointMismatchError(f"the checkpoint's model has {sorted(counts)[0]} transformer layers, this one "
                                      f"{mine.num_layers} (config.num_layers): build the model it was saved from")
    share = any(c.share for c in saved.values())
    if share != mine.share:
        raise CheckpointMismatchError(f"share_embeddings_and_output_weights is {share} in the checkpoint's model and "
                                      f"{mine.share} in this one: build the model with the saved setting")
    numbers: dict[int, tuple[int, str]] = {}
    for stage, c in sorted(saved.items()):
        dup = c.duplicate()
        if dup is not None:
            raise CheckpointReshardError(f"layer number {dup[0]} is held by {dup[1]} on saved PP stage {stage}, so "
                                         f"the layers cannot be placed on other stages; {hint}")
        for name, n in c.layers.items():
            if n in numbers:
                raise CheckpointReshardError(f"layer number {n} is held by {numbers[n][1]} on saved PP stage "
                                             f"{numbers[n][0]} and by {name} on stage {stage}; {hint}")
            numbers[n] = (stage, name)
    dup = mine.duplicate()
    if dup is not None:
        raise CheckpointReshardError(f"layer number {dup[0]} is held by {dup[1]} in this model, so the saved layers "
                                     f"cannot be placed; {hint}")


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and values."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


def _describe(gid: str, places: list[tuple[int, str]]) -> str:
    """The saved tensors ``places`` (stage, name) of one id, for a refusal."""
    where = " and ".join(f"{name} on saved PP stage {stage}" for stage, name in places)
    return f"the tied embedding / output weight ({where})" if gid == TIED else where


#: Joins one param's flattened-range records (``key``, records, which value of a record) into its whole value.
Assemble = Callable[[str, list[dict[str, Any]], Callable[[dict[str, Any]], Any]], torch.Tensor]


def restage(shards: Iterable[dict[str, Any]], record: dict[str, list[dict[str, Any]]], saved_pp: int,
            chunks: list[Any], tp_rank: int, assemble: Assemble, hint: str) -> Restaged:
    """The saved values this rank loads at another pipeline size (see the module docstring).

    Args:
        shards: every saved shard of this rank's TP rank (all stages, all data-parallel ranks), as read.
        record: the checkpoint's pipeline record (``{"pp<stage>": [chunk record]}``).
        saved_pp: the saved pipeline size.
        chunks: this rank's model chunks (one: virtual stages are not resharded).
        tp_rank: this rank's TP rank (the synthetic shard's coordinate).
        assemble: joins a param's flattened-range records into its whole flattened value.
        hint: the way out, ending each refusal.

    Raises:
        CheckpointReshardError: see the module docstring.
        CheckpointMismatchError: another layer count or tied-embedding setting.
    """
    saved = _stage_chunks(record, saved_pp, hint)
    if len(chunks) != 1:
        raise CheckpointReshardError(f"this model has {len(chunks)} chunks (virtual pipeline stages); {hint}")
    mine = chunk_layout(chunks[0])
    _check_layouts(saved, mine, hint)
    out = Restaged()
    values: dict[str, list[tuple[int, str, torch.Tensor]]] = {}
    records: dict[str, dict[int, list[dict[str, Any]]]] = {}
    names: dict[tuple[str, int], str] = {}
    model_seen: set[int] = set()
    for shard in sorted(shards, key=lambda s: (s["coords"]["pp"], s["coords"]["dp"])):
        stage = int(shard["coords"]["pp"])
        layout = saved[stage]
        if stage not in model_seen:  # the data-parallel ranks of a stage hold the same weights
            model_seen.add(stage)
            for name, value in shard["model"][0].items():
                if isinstance(value, torch.Tensor):
                    values.setdefault(global_id(name, layout), []).append((stage, name, value))
        for r in (shard.get("optimizer") or {}).get("params", []):
            name = r["key"].partition(".")[2]
            gid = global_id(name, layout)
            records.setdefault(gid, {}).setdefault(stage, []).append(r)
            names[gid, stage] = r["key"]
    for gid, held in values.items():
        out.saved.add(f"model:{gid}")
        for stage, name, value in held[1:]:
            if not _equal(value, held[0][2]):
                raise CheckpointReshardError(f"{_describe(gid, [(held[0][0], held[0][1]), (stage, name)])}: the "
                                             f"copies differ, so no one value fits another PP size; {hint}")
    chosen: dict[str, list[dict[str, Any]]] = {}
    for gid, per_stage in records.items():
        out.saved.add(f"opt:{gid}")
        first, *others = sorted(per_stage)
        chosen[gid] = per_stage[first]
        for stage in others:
            both = set(per_stage[first][0]["state"]) & set(per_stage[stage][0]["state"])
            for what, get in [("main param", _main)] + [(m, _state(m)) for m in ("exp_avg", "exp_avg_sq") if m in both]:
                a, b = (assemble(gid, per_stage[s], get) for s in (first, stage))
                if not _equal(a, b):
                    raise CheckpointReshardError(
                        f"{_describe(gid, [(first, names[gid, first]), (stage, names[gid, stage])])}: the {what}s "
                        f"differ, so no one optimizer state fits another PP size; {hint}")
    for name, value in unwrap(chunks[0]).state_dict(keep_vars=True).items():
        gid = global_id(name, mine)
        if isinstance(value, torch.Tensor) and gid in values:
            out.model[name] = values[gid][0][2]
            out.used.add(f"model:{gid}")
    params: list[dict[str, Any]] = []
    for name, _ in unwrap(chunks[0]).named_parameters():
        gid = global_id(name, mine)
        if gid in chosen:
            params.extend({**r, "key": f"0.{name}"} for r in chosen[gid])
            out.used.add(f"opt:{gid}")
    out.shards.append({"coords": {"tp": tp_rank}, "optimizer": {"params": params}})
    return out


def _main(record: dict[str, Any]) -> Any:
    """A record's main param."""
    return record["main"]


def _state(name: str) -> Callable[[dict[str, Any]], Any]:
    """A record's optimizer state ``name``."""
    return lambda record: record["state"][name]
