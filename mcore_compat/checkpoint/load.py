"""``load_checkpoint``: every rank plans its whole load (reads, matches and checks everything), the ranks agree
that every plan is sound, and only then are values written into the model, the optimizer and the scheduler.

A refusal on any rank is raised on every rank (its message names the rank) and leaves every rank's model and
optimizer as they were. Resharding: the optimizer's records are keyed by model parameter and flattened range
(:mod:`.state`), so they are reassembled per parameter and cut to this rank's range: a checkpoint loads at
another data-parallel size and with or without the distributed optimizer, exactly; at another TP size the saved TP
shards of each parameter (weights, main params, moments) are joined and cut to this rank's piece as the manifest's
per-param record says (:mod:`.tp`), exactly; at another PP size (no virtual stages, EP=1) each rank reads every
saved stage of its TP rank and takes its own layers' values by Megatron's layer numbers, recorded per stage at save
(:mod:`.pp`), exactly; another EP / virtual-stage layout, or TP and PP changed together, is refused before anything
is read into the model.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..layout.read import unwrap
from .coords import Coords, coords, is_expert
from .errors import CheckpointError, CheckpointFormatError, CheckpointMismatchError, CheckpointReshardError
from .files import verify_shard
from .manifest import FORMAT, Manifest, ShardFile, read_manifest
from .megatron_files import is_megatron_checkpoint
from .outcome import LoadedCheckpoint, _agree
from .pp import restage
from .runs import is_run_directory, latest_checkpoint
from .save import _gather, _rank, wait_for_pending
from .state import leaves, main_params, named_params, param_key, restore_rng
from .tp import Split, reshard, same_copies, splits

__all__ = ["LoadedCheckpoint", "load_checkpoint"]  # LoadedCheckpoint: defined in .outcome, public here too

_FIXED_DIMS = (("tp", "TP"), ("pp", "PP"), ("ep", "EP"), ("vpp", "VPP"))


@dataclass
class _Plan:
    """Everything one rank will write, decided before anything is."""

    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    states: list[tuple[Any, Any, dict[str, Any]]] = field(default_factory=list)  # (inner optimizer, main, state)
    groups: list[tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=list)
    scalers: list[tuple[Any, dict[str, Any]]] = field(default_factory=list)
    rng: dict[str, Any] | None = None
    undo: list[Callable[[], None]] = field(default_factory=list)
    result: LoadedCheckpoint | None = None
    saved: set[str] = field(default_factory=set)  # at a PP change: the ids the checkpoint holds (:mod:`.pp`)
    used: set[str] = field(default_factory=set)  # and those this rank loads
    manifest: Manifest | None = None
    verify: bool = True  # check each shard read against its recorded checksum
    verified: bool = False  # and did so (the checkpoint has checksums)

    def apply(self) -> None:
        with torch.no_grad():
            for dest, src in self.copies:
                dest.copy_(src)
        for inner, main, state in self.states:
            inner.state[main] = state
        for group, settings in self.groups:
            for k, v in settings.items():
                if k in group:
                    group[k] = tuple(v) if isinstance(group[k], tuple) else v
        for scaler, state in self.scalers:
            scaler.load_state_dict(state)
        if self.rng is not None:
            restore_rng(self.rng)


def _read_shard(root: Path, shard: ShardFile, manifest: Manifest | None = None, verify: bool = False) \
        -> dict[str, Any]:
    recorded = ((manifest.checksums or {}).get("shards") or {}).get(shard.name) if manifest is not None else None
    if verify and recorded is not None:
        bad = verify_shard(root / shard.name, recorded, str(root / shard.name))
        if bad is not None:
            raise CheckpointFormatError(bad)
    try:
        data = torch.load(root / shard.name, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise CheckpointFormatError(f"shard {root / shard.name} cannot be read ({type(exc).__name__}: {exc}): "
                                    "truncated or corrupt; copy the checkpoint again") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointFormatError(f"{root / shard.name} is not a shard of format {FORMAT}")
    return data


def _check_layout(root: Path, manifest: Manifest, where: Coords) -> None:
    """Refuse an EP / virtual-stage change, TP and PP changed together, and a TP or PP change this checkpoint
    cannot make (see :mod:`.tp`, :mod:`.pp`)."""
    mine = where.layout()
    differ = [f"{label} {manifest.layout[k]} -> {mine[k]}" for k, label in _FIXED_DIMS if manifest.layout[k] != mine[k]]
    changed = [d.split()[0] for d in differ]
    if changed == ["TP"] and manifest.tensor_parallel is None:
        raise CheckpointReshardError(
            f"{root} was saved at {manifest.layout_text()}; this job differs in {differ[0]}, and the mcore_compat "
            f"that wrote it ({manifest.mcore_compat}) did not record how each param is split over TP, which a TP "
            f"change of the {FORMAT} format needs: load it at TP={manifest.layout['tp']}, save it again with this "
            f"mcore_compat, then load that at TP={mine['tp']}")
    flat = manifest.layout["vpp"] == mine["vpp"] == 1 and manifest.layout["ep"] == mine["ep"] == 1
    if changed == ["PP"] and flat and manifest.pipeline is None:
        raise CheckpointReshardError(
            f"{root} was saved at {manifest.layout_text()}; this job differs in {differ[0]}, and the mcore_compat "
            f"that wrote it ({manifest.mcore_compat}) did not record each stage's layer numbers, which a PP change "
            f"of the {FORMAT} format needs: load it at PP={manifest.layout['pp']}, save it again with this "
            f"mcore_compat, then load that at PP={mine['pp']}")
    if differ and changed != ["TP"] and not (changed == ["PP"] and flat):
        lay = manifest.layout
        raise CheckpointReshardError(
            f"{root} was saved at {manifest.layout_text()}; this job differs in {', '.join(differ)}. The {FORMAT} "
            f"format reshards over data-parallel size, distributed optimizer on/off, and TP or PP size, one of them "
            f"per load (PP without virtual stages or expert parallelism): resume at TP={lay['tp']} PP={lay['pp']} "
            f"EP={lay['ep']} VPP={lay['vpp']} (then change TP or PP alone), or export full weights for another "
            f"layout with mcore_compat.gather_full")


@dataclass(frozen=True)
class _TpChange:
    """A load at another TP size (:mod:`.tp`): the splits recorded for this pipeline stage, the loading model's,
    this rank's TP rank and size, and the way out that ends each refusal."""

    saved: dict[str, Split]
    mine: dict[str, Split]
    rank: int
    size: int
    hint: str

    def piece(self, key: str, pieces: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """This rank's value of ``key`` (``"<chunk>.<name>"``) from the saved TP ranks' ``pieces``."""
        src, dst = self.saved.get(key), self.mine.get(key)
        if src is None and dst is None:  # not a parameter: a buffer or a layer's extra state
            return same_copies(key, pieces, self.hint)
        if src is None or dst is None:
            raise CheckpointReshardError(f"{key}: a parameter in the {'model' if src is None else 'checkpoint'} "
                                         f"only, so its split over TP is unknown; {self.hint}")
        return reshard(key, pieces, src, dst, self.rank, self.size, shape, self.hint)


def _tp_change(root: Path, manifest: Manifest, chunks: list[Any], where: Coords) -> _TpChange | None:
    """``None`` at the saved TP size; else what a TP change needs, refusing expert params (their layout over
    expert-tensor-parallel ranks is not resharded)."""
    saved_tp = manifest.layout["tp"]
    if saved_tp == where.tp_size:
        return None
    hint = f"resume at TP={saved_tp} (or export full weights with mcore_compat.gather_full)"
    experts = sorted(n for p, n in named_params(chunks).items() if is_expert(p))
    if experts:
        raise CheckpointReshardError(f"{experts[0]}: an expert param (allreduce=False); experts are not resharded "
                                     f"over TP {saved_tp} -> {where.tp_size}: {hint}")
    record = (manifest.tensor_parallel or {}).get(f"pp{where.pp}", {})
    saved = {k: Split(int(v[0]), int(v[1])) for k, v in record.items()}
    return _TpChange(saved, splits(chunks), where.tp, where.tp_size, hint)


def _model_copies(plan: _Plan, chunks: list[Any], saved: list[list[dict[str, Any]]], strict: bool, source: str,
                  tp: _TpChange | None) -> None:
    """Plan the copies of every model tensor; ``saved``: the model state of each saved TP rank (one entry when
    the TP size is unchanged)."""
    if len(saved[0]) != len(chunks):
        raise CheckpointMismatchError(f"{source} holds {len(saved[0])} model chunk(s), the model has {len(chunks)}")
    for i, (chunk, state) in enumerate(zip(chunks, saved[0], strict=True)):
        target = unwrap(chunk).state_dict(keep_vars=True)
        tensors = {k: v for k, v in target.items() if isinstance(v, torch.Tensor)}
        stored = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        missing, unexpected = sorted(set(tensors) - set(stored)), sorted(set(stored) - set(tensors))
        if strict and (missing or unexpected):
            raise CheckpointMismatchError(
                f"chunk {i} does not match {source}: missing in the checkpoint {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}, not in the model {unexpected[:5]}"
                f"{' ...' if len(unexpected) > 5 else ''} (strict=False loads the names both have)")
        for name in sorted(set(tensors) & set(stored)):
            dest, src = tensors[name], stored[name]
            if tp is not None:
                pieces = [s[i].get(name) for s in saved]
                held = [p for p in pieces if isinstance(p, torch.Tensor)]
                if len(held) != len(pieces):
                    raise CheckpointFormatError(f"chunk {i} {name} is missing from a TP rank's shard of the checkpoint")
                src = tp.piece(f"{i}.{name}", held, tuple(dest.shape))
            if dest.shape != src.shape or dest.dtype != src.dtype:
                raise CheckpointMismatchError(
                    f"chunk {i} {name}: the checkpoint has {src.dtype} {tuple(src.shape)}, the model "
                    f"{dest.dtype} {tuple(dest.shape)} (another model configuration, dtype or TP size)")
            plan.copies.append((dest.detach(), src))


def _assemble(key: str, records: list[dict[str, Any]], get: Callable[[dict[str, Any]], Any]) -> torch.Tensor:
    """The full flattened tensor of one param from its records (each a range; a record without one is whole)."""
    for r in records:
        if r["start"] is None:
            return get(r).reshape(-1)
    numel = records[0]["numel"]
    pieces, at = [], 0
    for r in sorted(records, key=lambda r: r["start"]):
        if r["start"] > at:
            break
        if r["end"] > at:
            pieces.append(get(r).reshape(-1)[at - r["start"]:])
            at = r["end"]
    if at != numel:
        raise CheckpointFormatError(f"the optimizer records of {key} cover elements [0, {at}) of {numel}: a shard "
                                    "of the checkpoint is missing")
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # one record: its view, no copy


def _state_of(name: str) -> Callable[[dict[str, Any]], Any]:
    return lambda record: record["state"][name]


def _by_tp(shards: list[dict[str, Any]]) -> dict[int, dict[str, list[dict[str, Any]]]]:
    """``{saved TP rank: {key: records}}`` of the optimizer records of ``shards``."""
    index: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for shard in shards:
        for record in shard["optimizer"]["params"]:
            index.setdefault(shard["coords"]["tp"], {}).setdefault(record["key"], []).append(record)
    return index


def _optimizer_plan(plan: _Plan, chunks: list[Any], optimizer: Any, shards: list[dict[str, Any]],
                    source: dict[str, Any], where: Coords, strict: bool, tp: _TpChange | None,
                    models: list[list[dict[str, Any]]]) -> None:
    """Plan the optimizer's values; ``models``: the model state of each saved TP rank (for the shard shapes)."""
    by_tp = _by_tp(shards)
    tp_ranks = [where.tp] if tp is None else list(range(len(models)))
    index = by_tp.get(tp_ranks[0], {})
    cache: dict[tuple[str, str], torch.Tensor] = {}

    def full(key: str, what: str, get: Callable[[dict[str, Any]], Any], shape: tuple[int, ...]) -> torch.Tensor:
        """The flattened value of this rank's whole param (of ``shape``; before the cut to its range)."""
        if (key, what) not in cache:
            if tp is None:
                cache[key, what] = _assemble(key, index[key], get)
            else:
                chunk, _, name = key.partition(".")
                pieces = [_assemble(key, by_tp[t][key], get).reshape(models[t][int(chunk)][name].shape)
                          for t in tp_ranks]
                cache[key, what] = tp.piece(key, pieces, shape).reshape(-1)
        return cache[key, what]

    for mp in main_params(chunks, optimizer):
        key = param_key(mp, where)
        records = index.get(key)
        if not records or any(key not in by_tp.get(t, {}) for t in tp_ranks):
            raise CheckpointMismatchError(f"the checkpoint has no optimizer state for {mp.name} (a param the "
                                          "checkpoint's model did not train)")
        if tp is None and records[0]["numel"] != mp.model.numel():
            raise CheckpointMismatchError(f"{mp.name}: {records[0]['numel']} elements in the checkpoint, "
                                          f"{mp.model.numel()} in the model")
        lo, hi = (0, mp.model.numel()) if mp.start is None else (mp.start, mp.end)
        shape = tuple(mp.model.shape)
        main = full(key, "main", lambda r: r["main"], shape)[lo:hi]
        plan.copies.append((mp.main.detach(), main.reshape(mp.main.shape).to(mp.main.dtype)))
        current = mp.inner.state.get(mp.main, {})
        state: dict[str, Any] = {}
        for name, value in records[0]["state"].items():
            if isinstance(value, torch.Tensor) and value.numel() == (records[0]["end"] or records[0]["numel"]) \
                    - (records[0]["start"] or 0) and value.dim() > 0:
                part = full(key, name, _state_of(name), shape)[lo:hi]  # may view the read shard: copied here
                state[name] = part.reshape(mp.main.shape).to(device=mp.main.device, dtype=value.dtype, copy=True)
            elif isinstance(value, torch.Tensor):
                device = current[name].device if isinstance(current.get(name), torch.Tensor) else value.device
                state[name] = value.to(device, copy=True)
            else:
                state[name] = value
        plan.states.append((mp.inner, mp.main, state))
    trained = {f"{n}@ep{where.ep}" if is_expert(p) else n for p, n in named_params(chunks).items() if p.requires_grad}
    mine = {k for t in tp_ranks for k in by_tp.get(t, {}) if "@ep" not in k or k.endswith(f"@ep{where.ep}")}
    if strict and mine - trained:
        extra = sorted(mine - trained)
        raise CheckpointMismatchError(f"the checkpoint has optimizer state for params this optimizer does not "
                                      f"update: {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    inners: list[Any] = []
    for leaf in leaves(optimizer):
        inner = getattr(leaf, "optimizer", None)
        if inner is not None and all(inner is not i for i in inners):
            inners.append(inner)
    saved_groups = source["optimizer"]["groups"]
    if [len(g) for g in saved_groups] == [len(i.param_groups) for i in inners]:
        for inner, groups in zip(inners, saved_groups, strict=True):
            plan.groups.extend(zip(inner.param_groups, groups, strict=True))
    elif strict:
        raise CheckpointMismatchError(
            f"the optimizer's param groups {[len(i.param_groups) for i in inners]} differ from the checkpoint's "
            f"{[len(g) for g in saved_groups]} (another weight-decay / lr-multiplier grouping)")
    scalers = [getattr(leaf, "grad_scaler", None) for leaf in leaves(optimizer)]
    saved_scalers = source["optimizer"]["grad_scalers"]
    if len(scalers) == len(saved_scalers):
        plan.scalers.extend((s, st) for s, st in zip(scalers, saved_scalers, strict=True)
                            if s is not None and st is not None)


def _model_files(root: Path, manifest: Manifest, where: Coords, tp: _TpChange | None) -> list[ShardFile]:
    """The files holding this rank's model state: its own TP rank's (this rank's own file first when the layout is
    the same), or at a TP change one per saved TP rank, in TP order."""
    stage = [f for f in manifest.files if f.coords["pp"] == where.pp and f.coords["ep"] == where.ep]
    if tp is None:
        files = [f for f in stage if f.coords["tp"] == where.tp]
        own = [f for f in files if manifest.layout == where.layout() and f.coords == where.as_dict()]
        files = (own + [f for f in files if f not in own])[:1]
    else:
        first: dict[int, ShardFile] = {}
        for f in stage:
            first.setdefault(f.coords["tp"], f)
        files = [first[t] for t in range(manifest.layout["tp"]) if t in first]
        if len(files) != manifest.layout["tp"]:
            files = []
    if not files:
        raise CheckpointFormatError(f"{root} has no shard for TP rank {where.tp if tp is None else 'each'}, PP rank "
                                    f"{where.pp}, EP rank {where.ep}")
    return files


def _pp_source(root: Path, manifest: Manifest, chunks: list[Any], where: Coords) \
        -> tuple[list[ShardFile], ShardFile]:
    """At a PP change: the files to read (every stage's, every DP rank's, of this rank's TP rank) and the one whose
    scheduler, param-group settings, iteration and extra this rank takes (its own stage's, or the last saved
    stage's when this rank's is beyond it; its own DP rank's where there is one). Refuses expert params."""
    experts = sorted(n for p, n in named_params(chunks).items() if is_expert(p))
    saved_pp = manifest.layout["pp"]
    if experts:
        raise CheckpointReshardError(f"{experts[0]}: an expert param (allreduce=False); models with experts are not "
                                     f"resharded over PP {saved_pp} -> {where.pp_size}: resume at PP={saved_pp} (or "
                                     "export full weights with mcore_compat.gather_full)")
    files = [f for f in manifest.files if f.coords["tp"] == where.tp and f.coords["ep"] == where.ep]
    stage = min(where.pp, saved_pp - 1)
    candidates = sorted((f for f in files if f.coords["pp"] == stage), key=lambda f: f.coords["dp"] != where.dp)
    if not candidates or {f.coords["pp"] for f in files} != set(range(saved_pp)):
        raise CheckpointFormatError(f"{root} has no shard of TP rank {where.tp} for each of its {saved_pp} PP stages")
    return files, candidates[0]


def _plan_pp(plan: _Plan, root: Path, manifest: Manifest, chunks: list[Any], optimizer: Any, strict: bool,
             where: Coords) -> tuple[ShardFile, dict[str, Any]]:
    """Plan a load at another pipeline size (:mod:`.pp`): the model and optimizer values of this rank's layers
    and stage-specific tensors, from whichever saved stage holds them. Returns the source file and its shard."""
    files, source_file = _pp_source(root, manifest, chunks, where)
    shards = {f.name: _read_shard(root, f, plan.manifest, plan.verify) for f in files}
    saved_pp = manifest.layout["pp"]
    hint = f"resume at PP={saved_pp} (or export full weights with mcore_compat.gather_full)"
    staged = restage(list(shards.values()), manifest.pipeline or {}, saved_pp, chunks, where.tp, _assemble, hint)
    models = [[staged.model]]
    _model_copies(plan, chunks, models, strict, f"{root} (saved at PP={saved_pp})", None)
    source = shards[source_file.name]
    with_optimizer = optimizer is not None and source["optimizer"] is not None
    if with_optimizer:
        _optimizer_plan(plan, chunks, optimizer, staged.shards, source, where, strict, None, models)
    plan.saved = {k for k in staged.saved if with_optimizer or not k.startswith("opt:")}
    plan.used = staged.used
    return source_file, source


def _plan(root: Path, chunks: list[Any], optimizer: Any, scheduler: Any, strict: bool, where: Coords,
          verify: bool = True) -> _Plan:
    manifest = read_manifest(root)
    _check_layout(root, manifest, where)
    plan = _Plan(manifest=manifest, verify=verify, verified=verify and manifest.checksums is not None)
    if manifest.layout["pp"] != where.pp_size:
        source_file, source = _plan_pp(plan, root, manifest, chunks, optimizer, strict, where)
    else:
        source_file, source = _plan_same_pp(plan, root, manifest, chunks, optimizer, strict, where)
    if optimizer is not None and source["optimizer"] is None and strict:
        raise CheckpointMismatchError(f"{root} holds no optimizer state (saved without an optimizer): load "
                                      "the weights with load_checkpoint(path, chunks)")
    if scheduler is not None:
        if source["scheduler"] is None:
            if strict:
                raise CheckpointMismatchError(f"{root} holds no scheduler state (saved without scheduler=)")
        else:
            before = scheduler.state_dict()
            try:
                scheduler.load_state_dict(source["scheduler"])
            except Exception as exc:
                scheduler.load_state_dict(before)
                raise CheckpointMismatchError(f"the scheduler refused the checkpoint's state: {exc}") from None
            plan.undo.append(lambda: scheduler.load_state_dict(before))
    own = source_file.coords == where.as_dict() and manifest.layout == where.layout()
    plan.rng = source["rng"] if own else None
    plan.result = LoadedCheckpoint(iteration=source["iteration"], extra=source["extra"], manifest=manifest,
                                   rng_restored=own,
                                   optimizer_loaded=optimizer is not None and source["optimizer"] is not None,
                                   checksums_verified=plan.verified)
    return plan


def _plan_same_pp(plan: _Plan, root: Path, manifest: Manifest, chunks: list[Any], optimizer: Any, strict: bool,
                  where: Coords) -> tuple[ShardFile, dict[str, Any]]:
    """Plan a load at the saved pipeline size (any DP size; another TP size, :mod:`.tp`). Returns the source file
    and its shard."""
    tp = _tp_change(root, manifest, chunks, where)
    model_files = _model_files(root, manifest, where, tp)
    source_file = model_files[0]
    wanted = list(model_files)
    if optimizer is not None:
        wanted += [f for f in manifest.files if f.coords["pp"] == where.pp and f not in wanted
                   and (tp is not None or f.coords["tp"] == where.tp)]
    shards = {f.name: _read_shard(root, f, plan.manifest, plan.verify) for f in wanted}
    source = shards[source_file.name]
    models = [shards[f.name]["model"] for f in model_files]
    _model_copies(plan, chunks, models, strict, source_file.name, tp)
    if optimizer is not None and source["optimizer"] is not None:
        _optimizer_plan(plan, chunks, optimizer, list(shards.values()), source, where, strict, tp, models)
    return source_file, source


def _unplaced(plan: _Plan, used: list[set[str]]) -> None:
    """At a PP change with ``strict``: refuse (on every rank alike) when a saved tensor is loaded by no rank."""
    left = sorted(plan.saved - set().union(*used))
    if left:
        raise CheckpointMismatchError(
            f"the checkpoint holds {len(left)} tensor(s) that no rank of this model loads: {left[:5]}"
            f"{' ...' if len(left) > 5 else ''} (by layer number / name; another model configuration? strict=False "
            "loads what both have)")


def _newest_agreed(run: Path) -> Path:
    """The newest complete checkpoint of the run directory ``run``, the same on every rank (collective)."""
    chosen: str | None = None
    problem: str | None = None
    try:
        chosen = str(latest_checkpoint(run)) if _rank() == 0 else _quiet_latest(run)
    except CheckpointFormatError as exc:
        problem = str(exc)
    seen = _gather((chosen, problem))
    problems = [p for _, p in seen if p is not None]
    if problems:
        raise CheckpointFormatError(problems[0])
    choices = sorted({c for c, _ in seen if c is not None})
    if len(choices) > 1:
        raise CheckpointFormatError(f"the ranks see different newest checkpoints in {run} ({', '.join(choices)}): is "
                                    "a save running there? Load one checkpoint directory by its name")
    return Path(choices[0])


def _quiet_latest(run: Path) -> str:
    """:func:`.runs.latest_checkpoint` without its warnings (rank 0 gives them)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return str(latest_checkpoint(run))


def load_checkpoint(path: str | os.PathLike[str], chunks: Any, optimizer: Any = None, *, scheduler: Any = None,
                    strict: bool = True, verify: bool = True) -> LoadedCheckpoint:
    """Load a checkpoint written by :func:`~.save.save_checkpoint` into the model chunks (and optimizer,
    scheduler), in place. Call it on every rank, after building the model and optimizer as for training.

    A run directory (``iter_*`` checkpoints and a tracker, :mod:`.runs`) loads its newest complete checkpoint,
    skipping newer incomplete ones with a one-line warning each (on rank 0).

    A directory Megatron's ``dist_checkpointing`` wrote (``metadata.json``, no mcore_compat manifest; Megatron-LM's
    checkpoints) loads its model weights through Megatron's own load, resharded by Megatron, and its scheduler;
    the optimizer is refused (:mod:`.megatron`, docs/checkpoints.md).

    Args:
        path: the checkpoint directory, or a run directory (its newest complete checkpoint).
        chunks: the DDP-wrapped model chunk, or the list of them.
        optimizer: the optimizer to load main params, Adam moments, step, param-group settings and grad scaler
            into; ``None`` loads the weights only.
        scheduler: the scheduler to load (``load_state_dict``), or ``None``.
        strict: refuse a checkpoint whose names differ from the model's (or that lacks optimizer / scheduler
            state asked for); ``False`` loads what both have. Shapes and dtypes must always match.
        verify: check every shard this rank reads against the checksum recorded at save (one more read of the
            file); a checkpoint written before checksums has none to verify (``checksums_verified`` is ``False``).

    Each error below is raised on every rank when any rank refuses; nothing is loaded then.

    Returns:
        A :class:`LoadedCheckpoint` (iteration, this rank's extra, manifest, whether RNG states were restored: not
        after a TP, PP or DP change).

    Raises:
        CheckpointFormatError: not a (complete) checkpoint of this format: no manifest, a shard missing,
            truncated or failing its checksum (the message names the shard, and the tensor where it still loads).
        CheckpointInProgressError: another process is writing it (or died doing so).
        CheckpointMismatchError: it does not fit the model / optimizer / scheduler (at a PP change also: another
            layer count or tied-embedding setting, a saved tensor no rank takes with ``strict``).
        CheckpointReshardError: saved at another EP or virtual-stage layout, at another TP and PP size at once,
            or at another TP or PP size that this checkpoint or model cannot be resharded to (no per-param TP /
            per-stage layer record, experts, shapes that do not tile, e.g. another vocabulary padding, tied
            embedding copies that differ between the saved stages).
    """
    wait_for_pending()  # a background save of this process is published first (collective)
    chunk_list = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
    where = coords(len(chunk_list))
    if is_run_directory(path):  # iter_* checkpoints and a tracker: the newest complete one (.runs)
        path = _newest_agreed(Path(path))
    if is_megatron_checkpoint(Path(path)):  # written by Megatron-LM: its weights through Megatron's own load
        from .megatron import load_megatron

        return load_megatron(Path(path), chunk_list, optimizer, scheduler, strict, where)
    try:
        plan = _plan(Path(path), chunk_list, optimizer, scheduler, strict, where, verify)
    except Exception as exc:
        _agree((type(exc).__name__, str(exc), where.rank))
        raise
    try:
        used = _agree(None, plan.used)
        if strict and plan.saved:
            _unplaced(plan, used)
    except CheckpointError:
        for undo in plan.undo:
            undo()
        raise
    assert plan.result is not None
    plan.apply()
    return plan.result
