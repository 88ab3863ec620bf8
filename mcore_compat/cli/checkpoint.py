"""``mcore-compat checkpoint inspect PATH [--json]``: what a checkpoint holds, who wrote it, who can load it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "run_inspect"]


def add_parser(sub: Any) -> None:
    """Register the ``checkpoint`` subcommand (and its ``inspect`` action)."""
    p = sub.add_parser("checkpoint", help="look into a checkpoint written by mcore_compat.save_checkpoint",
                       description="Checkpoints written by mcore_compat.save_checkpoint. 'inspect PATH' prints the "
                                   "format, the releases that wrote it, the parallel layout, each tensor's name, "
                                   "shape and dtype, the optimizer's records, and which releases can load which "
                                   "part; exit 1 (one line) if PATH is not a complete checkpoint. A directory "
                                   "Megatron's dist_checkpointing wrote (Megatron-LM): backend, iteration, the "
                                   "tensors' global shapes, the optimizer's format, what mcore_compat loads of it.")
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    insp = actions.add_parser("inspect", help="what is inside a checkpoint")
    insp.add_argument("path", metavar="PATH", help="the checkpoint directory")
    insp.add_argument("--json", action="store_true", help="print the report as JSON")
    insp.add_argument("--verify", action="store_true", help="read every shard and check it against its recorded "
                                                            "checksum; exit 1 (one line naming the shard) if one differs")
    insp.set_defaults(func=run_inspect)
    p.set_defaults(func=lambda args: p.error("say what to do: 'checkpoint inspect PATH'"))


def run_inspect(args: argparse.Namespace) -> int:
    """Print the report of ``args.path``; 1 with one line on stderr when it cannot be read."""
    from ..checkpoint import CheckpointError, inspect_checkpoint
    from ..checkpoint.inspect import render

    try:
        info = inspect_checkpoint(args.path, verify=getattr(args, "verify", False))
    except CheckpointError as exc:
        print(f"mcore-compat checkpoint inspect: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(info, indent=1) if args.json else render(info))
    verified = dict(info.get("verified") or {})
    for row in info.get("checkpoints") or ():  # a run directory: every complete checkpoint's shards
        verified.update({f"{Path(row['path']).name}/{k}": v for k, v in (row.get("verified") or {}).items()})
    bad = [text for text in verified.values() if text not in ("ok", "no checksum recorded")]
    if bad:
        print(f"mcore-compat checkpoint inspect: {bad[0]}", file=sys.stderr)
        return 1
    return 0
