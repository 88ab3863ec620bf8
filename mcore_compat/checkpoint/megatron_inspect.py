"""``mcore-compat checkpoint inspect`` of a Megatron ``dist_checkpointing`` directory, read without Megatron:
backend, ``iteration``, ``checkpoint_version``, the sharded tensors' keys and global shapes, the optimizer state's
format, and what :func:`~mcore_compat.load_checkpoint` loads of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .megatron_files import optimizer_format, read_common, read_metadata, read_tensors, scheduler_state

__all__ = ["FORMAT_NAME", "LOADABLE", "inspect_megatron", "render_megatron"]

FORMAT_NAME = "megatron dist_checkpointing"

#: What mcore_compat loads of such a directory (the releases: docs/checkpoints.md).
LOADABLE = {
    "weights": "load_checkpoint(path, chunks) on 0.6-0.19 (0.6-0.12 with psutil installed): through Megatron's own "
               "dist_checkpointing.load with the chunks' sharded_state_dict(), so at any TP / PP / DP layout "
               "Megatron reshards; the tensors must have the same keys, global shapes and dtypes",
    "optimizer": "not loaded (Megatron's optimizer formats drop or reset state on some releases): refused before "
                 "anything is loaded; load weights only: optimizer=None",
    "scheduler": "opt_param_scheduler (or the older lr_scheduler), when present, with scheduler=",
    "iteration": "iteration and checkpoint_version are returned; the RNG states are not restored",
}


def _plain(value: Any) -> Any:
    """A JSON-friendly summary of a ``common.pt`` value."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, torch.Tensor):
        return {"shape": list(value.shape), "dtype": str(value.dtype).replace("torch.", "")}
    if isinstance(value, dict):
        return {"type": "dict", "keys": sorted(str(k) for k in value)[:20]}
    return {"type": type(value).__name__}


def inspect_megatron(root: Path) -> dict[str, Any]:
    """The report of Megatron dist_checkpointing directory ``root``.

    Raises:
        CheckpointFormatError: ``metadata.json``, ``common.pt`` or ``.metadata`` cannot be read.
    """
    metadata = read_metadata(root)
    common = read_common(root)
    tensors = read_tensors(root) if (root / ".metadata").exists() else {}
    model = {k: v for k, v in sorted(tensors.items()) if "shape" in v and not k.startswith("optimizer.")}
    objects = sorted({k.split("/shard_")[0] for k, v in tensors.items()
                      if "shape" not in v and not k.startswith("optimizer.")})
    return {
        "path": str(root), "format": FORMAT_NAME, "metadata": metadata,
        "iteration": common.get("iteration"), "checkpoint_version": common.get("checkpoint_version"),
        "common": {str(k): _plain(v) for k, v in sorted(common.items(), key=lambda kv: str(kv[0]))},
        "model": model, "objects": objects,
        "optimizer": optimizer_format(common, tensors),
        "optimizer_tensors": sum(1 for k in tensors if k.startswith("optimizer.")),
        "scheduler": scheduler_state(common) is not None,
        "rng": any(k.startswith("rng_state") for k in objects) or "rng_state" in common,
        "loadable": LOADABLE if metadata["sharded_backend"] == "torch_dist" else {
            "nothing": f"the {metadata['sharded_backend']!r} backend: mcore_compat loads torch_dist only"},
    }


def render_megatron(info: dict[str, Any]) -> str:
    """The human-readable text of :func:`inspect_megatron`'s result."""
    md = info["metadata"]
    lines = [f"checkpoint {info['path']}",
             f"  format        {FORMAT_NAME}, backend {md['sharded_backend']} v{md.get('sharded_backend_version')}",
             f"  holds         iteration {info['iteration']}, checkpoint_version {info['checkpoint_version']}, "
             f"optimizer: {info['optimizer'] or 'none'}, scheduler: {'yes' if info['scheduler'] else 'no'}, "
             f"rng: {'yes' if info['rng'] else 'no'}",
             f"  common.pt     {', '.join(info['common']) or '-'}",
             f"  model tensors {len(info['model'])} (global shapes)"]
    for key, d in info["model"].items():
        lines.append(f"      {key:60s} {d['dtype']} {tuple(d['shape'])}")
    if info["objects"]:
        lines.append(f"  objects       {', '.join(info['objects'][:8])}{' ...' if len(info['objects']) > 8 else ''}")
    lines.append(f"  optimizer     {info['optimizer_tensors']} sharded tensors")
    lines.append("  loadable")
    lines.extend(f"    {part:10s} {text}" for part, text in info["loadable"].items())
    return "\n".join(lines)
