"""``mcore-compat self-check``: prove that training through mcore_compat updates weights correctly."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Register the ``self-check`` subcommand."""
    p = sub.add_parser(
        "self-check",
        help="build, step and prove parameters changed correctly and in place",
        description="Runs a few training steps through mcore_compat next to a plain-PyTorch reference and checks "
        "every property; exit status 0 only if every check passes. Use --nproc N to spawn N local ranks, or "
        "launch it under torchrun (any world size).",
    )
    p.add_argument("--nproc", type=int, default=None, help="local processes to spawn (default: torchrun's or 1)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=None, help="pipeline-parallel size (default 1)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (default: world/(tp*pp))")
    p.add_argument("--distributed-optimizer", action=argparse.BooleanOptionalAction, default=True,
                   help="use the distributed optimizer (default: on)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--bind", action=argparse.BooleanOptionalAction, default=True,
                   help="bind parameters to flat buffers (bind_params) and check the binding, and with --pp > 1 "
                        "the pipeline gather (default: on)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda if available, else cpu with gloo and the CPU patches")
    p.add_argument("--model", choices=("mlp", "gpt"), default="gpt")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", metavar="PATH", type=Path, default=None, help="also write the report as JSON")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a hung run is stopped")
    p.add_argument("--sweep", action="store_true",
                   help="check DP=N and TP=N, distributed optimizer on and off, in one process group of --nproc "
                        "ranks (what the test matrix runs on every release)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the self-check; exit status 0 only if every check passed, 2 on bad options."""
    from ..selfcheck import SelfCheckOptions, UsageError
    from ..selfcheck import run as run_selfcheck

    opts = SelfCheckOptions(nproc=args.nproc, tp=args.tp, pp=args.pp, dp=args.dp,
                            distributed_optimizer=args.distributed_optimizer, dtype=args.dtype, bind=args.bind,
                            device=args.device, model=args.model, steps=args.steps, lr=args.lr, seed=args.seed,
                            timeout=args.timeout)
    from ..rank0 import is_rank_0

    if args.sweep:
        return _sweep(args, opts)
    try:
        report = run_selfcheck(opts)
    except UsageError as exc:
        print(f"mcore-compat self-check: error: {exc}", file=sys.stderr)
        return 2

    if is_rank_0():
        print(report.render(), flush=True)
        if args.json is not None:
            args.json.write_text(report.to_json())
    return 0 if report.ok else 1


def _sweep(args: argparse.Namespace, opts: Any) -> int:
    import json
    from dataclasses import replace

    from ..selfcheck import UsageError, run_sweep, standard_sweep

    nproc = args.nproc or 2
    base = {k: v for k, v in opts.as_dict().items()
            if k not in ("nproc", "tp", "pp", "dp", "distributed_optimizer", "fault")}
    try:
        configs = [replace(c, **{k: v for k, v in base.items() if k != "timeout"}) for c in standard_sweep(nproc)]
        reports = run_sweep(configs, nproc, device=args.device, timeout=args.timeout)
    except UsageError as exc:
        print(f"mcore-compat self-check: error: {exc}", file=sys.stderr)
        return 2
    for r in reports:
        print(r.render(), flush=True)
        print()
    bad = sum(not r.ok for r in reports)
    print(f"self-check sweep: {'PASS' if not bad else 'FAIL'} ({len(reports) - bad}/{len(reports)} configurations)")
    if args.json is not None:
        args.json.write_text(json.dumps([json.loads(r.to_json()) for r in reports], indent=2))
    return 0 if not bad else 1
