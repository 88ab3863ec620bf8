"""``mcore-compat self-check``: prove that training through mcore_compat updates weights correctly."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "run"]

#: Options that pick one configuration; ``--sweep`` runs its own list and refuses them.
_CONFIG_FLAGS = ("tp", "pp", "dp", "vpp", "sequence_parallel", "overlap", "experts", "ep", "distributed_optimizer")


def add_parser(sub: Any) -> None:
    """Register the ``self-check`` subcommand."""
    from ..selfcheck import FAULTS

    p = sub.add_parser(
        "self-check",
        help="train a few steps and prove every gradient, update and replica",
        description="Trains a tiny GPT a few steps through mcore_compat and proves every step: gradients equal a "
        "plain-autograd reference, every main param's update equals the optimizer's rule (float64, within the "
        "derived fp32 rounding bound), model params equal the main params cast to the model dtype, replicated "
        "params are identical, param groups are as configured. Exit status 0 only if every check that applies "
        "passes. Use --nproc N to spawn N local ranks, or launch it under torchrun (any world size).",
    )
    p.add_argument("--nproc", type=int, default=None, help="local processes to spawn (default: torchrun's or 1)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=None, help="pipeline-parallel size (default 1)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (default: world/(tp*pp))")
    p.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per pipeline rank (needs --pp >= 2)")
    p.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                   help="sequence parallelism (default: on when --tp > 1)")
    p.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=True,
                   help="input embedding and output layer share one weight (default: on, as in Megatron-LM)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=False,
                   help="overlap_grad_reduce (and overlap_param_gather with the distributed optimizer)")
    p.add_argument("--experts", type=int, default=0, help="MoE experts per layer (default 0: dense)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size (default 1)")
    p.add_argument("--distributed-optimizer", action=argparse.BooleanOptionalAction, default=True,
                   help="use the distributed optimizer (default: on)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--grad-reduce-in-fp32", action=argparse.BooleanOptionalAction, default=None,
                   help="keep and reduce gradients in fp32 (default: on for bf16)")
    p.add_argument("--bind", action=argparse.BooleanOptionalAction, default=True,
                   help="bind parameters to flat buffers (bind_params) and check the binding, and with --pp > 1 "
                        "the pipeline gather (default: on)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda if available, else cpu with gloo and the CPU patches")
    p.add_argument("--model", choices=("mlp", "gpt"), default="gpt")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--weight-decay", type=float, default=0.1,
                   help="weight decay of the weights; biases and norms get none (default 0.1)")
    p.add_argument("--clip-grad", type=float, default=1.0, help="gradient-norm clipping threshold (0: off)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--fault", choices=sorted(FAULTS), default=None,
                   help="inject a known fault to see the check that catches it FAIL (a negative control)")
    p.add_argument("--json", metavar="PATH", type=Path, default=None, help="also write the report as JSON")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a hung run is stopped")
    p.add_argument("--sweep", action="store_true",
                   help="run the standard configurations in one process group of --nproc ranks (default 2): "
                        "DP with the distributed optimizer on and off, TP with sequence parallelism, PP with tied "
                        "embeddings, PP with virtual stages, overlapped DP, MoE with expert parallelism (those the "
                        "release can run); what the test matrix runs on every release")
    p.set_defaults(func=run)


def _options(args: argparse.Namespace) -> Any:
    from ..selfcheck import SelfCheckOptions

    return SelfCheckOptions(nproc=args.nproc, tp=args.tp, pp=args.pp, dp=args.dp, vpp=args.vpp,
                            sequence_parallel=args.sequence_parallel, tie_embeddings=args.tie_embeddings,
                            overlap=args.overlap, experts=args.experts, ep=args.ep,
                            distributed_optimizer=args.distributed_optimizer, dtype=args.dtype,
                            grad_reduce_in_fp32=args.grad_reduce_in_fp32, bind=args.bind, device=args.device,
                            model=args.model, steps=args.steps, lr=args.lr, weight_decay=args.weight_decay,
                            clip_grad=args.clip_grad, seed=args.seed, timeout=args.timeout, fault=args.fault)


def run(args: argparse.Namespace) -> int:
    """Run the self-check; exit status 0 only if every check passed, 2 on bad options."""
    from ..rank0 import is_rank_0
    from ..selfcheck import UsageError
    from ..selfcheck import run as run_selfcheck

    opts = _options(args)
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

    from ..selfcheck import UsageError, run_sweep, standard_sweep

    given = [f"--{f.replace('_', '-')}" if f != "distributed_optimizer" else "--no-distributed-optimizer"
             for f in _CONFIG_FLAGS
             if (getattr(args, f) is False if f == "distributed_optimizer" else getattr(args, f) not in (None, 0,
                                                                                                          False))]
    if given:
        print(f"mcore-compat self-check: error: --sweep runs its own configurations; drop {', '.join(given)} or "
              f"drop --sweep", file=sys.stderr)
        return 2
    nproc = args.nproc or 2
    common = {k: v for k, v in opts.as_dict().items() if k not in ("nproc", *_CONFIG_FLAGS, "timeout")}
    try:
        configs, skipped = standard_sweep(nproc, with_skipped=True, **common)
        reports = run_sweep(configs, nproc, device=args.device, timeout=args.timeout) if configs else []
    except UsageError as exc:
        print(f"mcore-compat self-check: error: {exc}", file=sys.stderr)
        return 2
    for r in reports:
        print(r.render(), flush=True)
        print()
    for name, why in skipped:
        print(f"not run: {name}: {why}")
    bad = sum(not r.ok for r in reports)
    tail = f", {len(skipped)} not run on this release" if skipped else ""
    print(f"self-check sweep: {'PASS' if not bad and reports else 'FAIL'} ({len(reports) - bad}/{len(reports)} "
          f"configurations{tail})")
    if args.json is not None:
        args.json.write_text(json.dumps([json.loads(r.to_json()) for r in reports], indent=2))
    return 0 if not bad and reports else 1
