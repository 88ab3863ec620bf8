"""What a checkpoint holds and who can load it (``mcore-compat checkpoint inspect``), read without Megatron."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .files import verify_shard
from .manifest import FORMAT, Manifest, read_manifest
from .megatron_files import is_megatron_checkpoint
from .megatron_inspect import FORMAT_NAME, inspect_megatron, render_megatron
from .runs import is_run_directory, run_checkpoints, tracked_iteration

__all__ = ["inspect_checkpoint", "inspect_run", "render"]

#: Who can load which part of a checkpoint of this format (the format is the same on every release).
LOADABLE = {
    "weights": "every release 0.4-0.19 whose model has the same parameter names and shapes, at the same EP and "
               "virtual-stage layout (any data-parallel size; another TP size when the manifest records the "
               "params' TP splits and the model has no experts; another PP size, without virtual stages, at EP=1, "
               "when it records each stage's layer numbers; TP or PP changed, not both at once)",
    "optimizer": "the same, into a distributed or non-distributed optimizer of any data-parallel size (main params, "
                 "both Adam moments and step reassembled per parameter)",
}


def _reshard(manifest: Manifest) -> dict[str, str]:
    """Per dimension, whether this checkpoint loads at another size (and why not)."""
    lay = manifest.layout
    again = "load it at the saved size and save it again with this mcore_compat"
    if manifest.tensor_parallel is None:
        tp = f"no: written without the TP record ({again})"
    else:
        tp = "yes, into a model without experts"
    if lay["vpp"] != 1 or lay["ep"] != 1:
        pp = f"no: saved with virtual stages or expert parallelism (VPP={lay['vpp']}, EP={lay['ep']})"
    elif manifest.pipeline is None:
        pp = f"no: written without the pipeline record ({again})"
    else:
        stages = [sorted(c.get("layers", {}).values()) for s in sorted(manifest.pipeline)
                  for c in manifest.pipeline[s]]
        if not any(stages):
            pp = "not applicable: the model has no transformer layers to split into stages"
        else:
            spans = ", ".join(f"{n[0]}-{n[-1]}" if n else "none" for n in stages)
            pp = f"yes, into a model without experts or virtual stages (layers per saved stage: {spans})"
    return {"dp": "yes (distributed optimizer on or off)", "tp": tp, "pp": pp,
            "ep": "no (export full weights with mcore_compat.gather_full)",
            "vpp": "no (export full weights with mcore_compat.gather_full)"}


def _describe(value: Any) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        return {"shape": list(value.shape), "dtype": str(value.dtype).replace("torch.", "")}
    return {"type": type(value).__name__}


def _verify(root: Path, manifest: Manifest) -> dict[str, str]:
    """Per shard: ``"ok"``, ``"no checksum recorded"`` or the mismatch (:func:`.files.verify_shard`)."""
    recorded = (manifest.checksums or {}).get("shards") or {}
    return {f.name: "no checksum recorded" if f.name not in recorded
            else (verify_shard(root / f.name, recorded[f.name], f.name) or "ok") for f in manifest.files}


def inspect_checkpoint(path: str | os.PathLike[str], verify: bool = False) -> dict[str, Any]:
    """The manifest, and of the first shard: each chunk's tensors (name, shape, dtype), the optimizer's records
    (param, range, state names) and what else it holds; who can load what, and at which other sizes (``reshard``:
    per dimension, yes or why not); ``checksums``: the algorithm, or ``None`` for a checkpoint written before
    checksums (nothing to verify). With ``verify``, ``verified``: per shard ``"ok"``, ``"no checksum recorded"`` or
    the mismatch (every shard's file read and hashed). For a directory Megatron's dist_checkpointing wrote:
    :func:`~.megatron_inspect.inspect_megatron`; for a run directory: :func:`inspect_run`.

    Raises:
        CheckpointFormatError, CheckpointInProgressError: as :func:`~.load.load_checkpoint`.
    """
    root = Path(path)
    if is_run_directory(root):  # iter_* checkpoints and a tracker
        return inspect_run(root, verify)
    if is_megatron_checkpoint(root):  # written by Megatron's dist_checkpointing
        return inspect_megatron(root)
    manifest: Manifest = read_manifest(root)
    first = manifest.files[0]
    shard = torch.load(root / first.name, map_location="cpu", weights_only=True, mmap=True)
    optimizer = shard.get("optimizer")
    return {
        "path": str(root), "manifest": manifest.to_json(), "shard": first.name,
        "model": [{k: _describe(v) for k, v in chunk.items()} for chunk in shard["model"]],
        "optimizer": None if optimizer is None else [
            {"key": r["key"], "numel": r["numel"], "range": [r["start"], r["end"]],
             "main": _describe(r["main"]), "state": sorted(r["state"])} for r in optimizer["params"]],
        "scheduler": shard.get("scheduler") is not None, "rng": sorted(shard.get("rng") or {}),
        "iteration": shard.get("iteration"), "extra": sorted(shard.get("extra") or {}),
        "written_by": {"mcore_compat": manifest.mcore_compat, "megatron_core": manifest.megatron_core,
                       "torch": manifest.torch},
        "loadable": LOADABLE if manifest.format == FORMAT else {},
        "reshard": _reshard(manifest),
        "checksums": (manifest.checksums or {}).get("algorithm"),
        **({"verified": _verify(root, manifest)} if verify else {}),
    }


def inspect_run(root: Path, verify: bool = False) -> dict[str, Any]:
    """A run directory (:mod:`.runs`): ``{"run": path, "tracker": iteration or None, "newest_complete": path or None,
    "checkpoints": [{"iteration", "path", "writer", "problem"}]}``, oldest first; with ``verify``, each complete
    mcore_compat checkpoint's shards are checked too (``verified``: per shard, as for one checkpoint)."""
    entries = run_checkpoints(root)
    rows: list[dict[str, Any]] = []
    for e in entries:
        row: dict[str, Any] = {"iteration": e.iteration, "path": str(e.path), "writer": e.writer,
                               "problem": e.problem}
        if verify and e.complete and e.writer == "mcore_compat":
            row["verified"] = _verify(e.path, read_manifest(e.path))
        rows.append(row)
    newest = next((e for e in reversed(entries) if e.complete), None)
    return {"run": str(root), "tracker": tracked_iteration(root),
            "newest_complete": None if newest is None else str(newest.path), "checkpoints": rows}


def _render_run(info: dict[str, Any]) -> str:
    lines = [f"run directory {info['run']}",
             f"  tracker       {'iteration ' + str(info['tracker']) if info['tracker'] is not None else 'none'}",
             f"  loads         {info['newest_complete'] or 'nothing: no complete checkpoint'}"]
    for row in info["checkpoints"]:
        state = "complete" if row["problem"] is None else f"NOT LOADABLE: {row['problem']}"
        lines.append(f"  {Path(row['path']).name:16s} {row['writer']:13s} {state}")
        for name, text in (row.get("verified") or {}).items():
            lines.append(f"    {name:16s} {text}")
    return "\n".join(lines)


def render(info: dict[str, Any]) -> str:
    """The human-readable text of :func:`inspect_checkpoint`'s result."""
    if "run" in info:
        return _render_run(info)
    if info.get("format") == FORMAT_NAME:
        return render_megatron(info)
    m = info["manifest"]
    lay = m["layout"]
    lines = [f"checkpoint {info['path']}",
             f"  format        {m['format']} v{m['format_version']} (optimizer: {m['optimizer_format']})",
             f"  written by    mcore_compat {m['mcore_compat']}, megatron-core {m['megatron_core']}, torch {m['torch']}",
             f"  layout        TP={lay['tp']} PP={lay['pp']} DP={lay['dp']} EP={lay['ep']} VPP={lay['vpp']} "
             f"(world {lay['world']}), distributed optimizer {'on' if m['distributed_optimizer'] else 'off'}",
             f"  holds         model{', optimizer' if m['has_optimizer'] else ''}"
             f"{', scheduler' if m['has_scheduler'] else ''}, rng, iteration {m['iteration']}"
             f"{', extra ' + ','.join(info['extra']) if info['extra'] else ''}",
             f"  shards        {len(m['files'])} file{'s' if len(m['files']) != 1 else ''}, "
             f"{sum(f['bytes'] for f in m['files'])} bytes",
             f"  checksums     {info.get('checksums') or 'none recorded (written before checksums): nothing to verify'}",
             f"  {info['shard']}:"]
    for i, chunk in enumerate(info["model"]):
        lines.append(f"    chunk {i}: {len(chunk)} entries")
        for name, d in chunk.items():
            if "dtype" in d:
                lines.append(f"      {name:60s} {d['dtype']} {tuple(d['shape'])}")
            elif d.get("type") == "NoneType":  # a module's empty extra state (TransformerEngine's _extra_state)
                lines.append(f"      {name:60s} (empty)")
            else:
                lines.append(f"      {name:60s} {d.get('type')}")
    if info["optimizer"] is not None:
        lines.append(f"    optimizer: {len(info['optimizer'])} main params")
        for r in info["optimizer"]:
            rng = "all" if r["range"][0] is None else f"[{r['range'][0]}:{r['range'][1]}]"
            lines.append(f"      {r['key']:60s} {rng} of {r['numel']}  state {','.join(r['state']) or '-'}")
    if "verified" in info:
        lines.append("  verify")
        lines.extend(f"    {name:16s} {text}" for name, text in info["verified"].items())
    lines.append("  loadable")
    lines.extend(f"    {part:10s} {text}" for part, text in info["loadable"].items())
    lines.append("  at another size")
    lines.extend(f"    {dim.upper():10s} {text}" for dim, text in info.get("reshard", {}).items())
    return "\n".join(lines)
