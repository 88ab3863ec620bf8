"""``mcore-compat self-check``: prove that training through mcore_compat updates weights correctly."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = ["EXIT_ENVIRONMENT", "EXIT_FAIL", "EXIT_USAGE", "add_parser", "run"]

#: Exit statuses (0: every check that applies passed).
EXIT_FAIL = 1
EXIT_USAGE = 2
EXIT_ENVIRONMENT = 3

#: Options that pick one configuration; ``--sweep`` runs its own list and refuses them.
_CONFIG_FLAGS = ("tp", "pp", "dp", "vpp", "sequence_parallel", "overlap", "experts", "ep", "distributed_optimizer",
                 "dropout")


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
        epilog="Exit status: 0 every check that applies passed; 1 a check failed or a rank raised or hung; 2 bad "
               "options; 3 the environment cannot run it (megatron-core missing, unreadable, unsupported, or "
               "breaking its release's limits: nothing was started; `mcore-compat doctor` says how to fix it).",
    )
    p.add_argument("--nproc", type=int, default=None, help="local processes to spawn (default: torchrun's or 1)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=None, help="pipeline-parallel size (default 1)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (default: world/(tp*pp))")
    p.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per pipeline rank (needs --pp >= 2; default: none, one stage per rank)")
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
    p.add_argument("--dropout", type=float, default=0.0,
                   help="hidden and attention dropout of the GPT (default 0: off); the gradient reference replays "
                        "the step's random state, so it draws the same masks")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="the model params' dtype; bf16 keeps fp32 main params in the optimizer, as RL/SFT "
                        "training does (default: fp32)")
    p.add_argument("--grad-reduce-in-fp32", action=argparse.BooleanOptionalAction, default=None,
                   help="keep and reduce gradients in fp32 (default: on for bf16)")
    p.add_argument("--bind", action=argparse.BooleanOptionalAction, default=True,
                   help="bind parameters to flat buffers (bind_params) and check the binding, and with --pp > 1 "
                        "the pipeline gather (default: on)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda if available, else cpu with gloo and the CPU patches")
    p.add_argument("--model", choices=("mlp", "gpt"), default="gpt",
                   help="the model trained: a tiny GPT of Megatron's layers, or a tensor-parallel MLP (Megatron's "
                        "column- then row-parallel linear layers; default: gpt)")
    p.add_argument("--steps", type=int, default=3, help="training steps, each one proved (default: 3)")
    p.add_argument("--lr", type=float, default=1e-2,
                   help="the optimizer's learning rate (default: 1e-2; RL runs use 1e-7..1e-5, which the "
                        "checks' rounding bounds cover too)")
    p.add_argument("--weight-decay", type=float, default=0.1,
                   help="weight decay of the weights; biases and norms get none (default 0.1)")
    p.add_argument("--decoupled-weight-decay", action=argparse.BooleanOptionalAction, default=True,
                   help="Adam's weight decay decoupled (AdamW, the default) or, with --no-decoupled-weight-decay, "
                        "L2 decay through the moments (OptimizerConfig.decoupled_weight_decay, 0.15+; older "
                        "releases are refused with the reason)")
    p.add_argument("--clip-grad", type=float, default=1.0, help="gradient-norm clipping threshold (0: off; default: 1.0)")
    p.add_argument("--offload-cycles", type=int, default=None, metavar="N",
                   help="offload/reload cycles (mcore_compat.offload/reload) between the steps, each proved: "
                        "device memory freed, everything back on its own storage bit for bit, host buffers "
                        "reused, and a verified step after it (default: 0; 2 with --sweep: a full cycle and one "
                        "that keeps the params)")
    p.add_argument("--finite-differences", action=argparse.BooleanOptionalAction, default=False,
                   help="also check the second step's gradients against the forward alone: a float64 copy of the "
                        "model's backward against central differences of its loss, the step's gradients against "
                        "the copy's, each loss against the copy's (grads_match_directional_derivatives, "
                        "loss_matches_float64; N/A with the reason where it cannot run, e.g. pipeline "
                        "parallelism; default: off)")
    p.add_argument("--seed", type=int, default=1234,
                   help="the seed of the model's initialisation and of the data (default: 1234)")
    p.add_argument("--fault", choices=sorted(FAULTS), default=None,
                   help="inject a known fault to see the check that catches it FAIL (a negative control; default: "
                        "none)")
    p.add_argument("--json", metavar="PATH", type=Path, default=None,
                   help="also write the report as JSON (checked to be writable before anything runs; default: "
                        "none)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds the check may run once the ranks are up (their start-up, importing torch and "
                        "Megatron, is not counted); a hung run is stopped and each rank's Python stacks printed "
                        "(default 300)")
    p.add_argument("--sweep", action="store_true",
                   help="run the standard configurations in one process group of --nproc ranks (default 2; the "
                        "options that pick one configuration, --tp/--pp/--dp/--vpp/--ep/--experts/--overlap/"
                        "--sequence-parallel/--dropout/--no-distributed-optimizer, are refused): DP=N with the "
                        "distributed optimizer on and off, TP=N with sequence parallelism (without and with "
                        "dropout), PP=N with tied embeddings, PP=N with "
                        "virtual stages, overlapped DP, MoE with expert parallelism (those the release can run); "
                        "what the test matrix runs on every release")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="list every warning the ranks printed (by default: counted, each distinct one once with -v)")
    p.add_argument("--debug", action="store_true",
                   help="show tracebacks: of an environment problem, and of ranks that raised")
    p.set_defaults(func=run)


def _options(args: argparse.Namespace) -> Any:
    from ..selfcheck import SelfCheckOptions

    return SelfCheckOptions(nproc=args.nproc, tp=args.tp, pp=args.pp, dp=args.dp, vpp=args.vpp,
                            sequence_parallel=args.sequence_parallel, tie_embeddings=args.tie_embeddings,
                            overlap=args.overlap, experts=args.experts, ep=args.ep,
                            distributed_optimizer=args.distributed_optimizer, dtype=args.dtype,
                            grad_reduce_in_fp32=args.grad_reduce_in_fp32, bind=args.bind, device=args.device,
                            model=args.model, steps=args.steps, lr=args.lr, weight_decay=args.weight_decay,
                            clip_grad=args.clip_grad, seed=args.seed, timeout=args.timeout, fault=args.fault,
                            offload_cycles=args.offload_cycles or 0, dropout=args.dropout,
                            decoupled_weight_decay=args.decoupled_weight_decay,
                            finite_differences=args.finite_differences)


def _error(message: str) -> None:
    print(f"mcore-compat self-check: error: {message}", file=sys.stderr, flush=True)


def _json_target_problem(path: Path | None) -> str | None:
    """Why ``--json PATH`` cannot be written (``None``: it can), found before anything runs by opening it for
    appending (a file that did not exist is removed again)."""
    if path is None:
        return None
    if path.is_dir():
        return f"--json {path}: is a directory; give a file name"
    existed = path.exists()
    try:
        with path.open("a", encoding="utf-8"):
            pass
    except OSError as exc:
        return f"--json {path}: cannot write there ({exc.strerror or exc})"
    if not existed:
        path.unlink(missing_ok=True)
    return None


def _write_json(path: Path, text: str) -> bool:
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        _error(f"--json {path}: cannot write the report ({exc.strerror or exc})")
        return False
    return True


def _preflight(args: argparse.Namespace) -> int | None:
    """The environment check before any rank starts: ``None`` to go on, else the exit status (message printed)."""
    from ..preflight import UnusableEnvironmentError, require
    from ..rank0 import is_rank_0

    try:
        result = require(allow_untested=True)
    except UnusableEnvironmentError as exc:
        if is_rank_0():  # under torchrun every rank finds the same
            print("mcore-compat self-check: cannot run here; nothing was started.", file=sys.stderr)
            for line in exc.preflight.message().splitlines():
                print(f"  {line}", file=sys.stderr)
            print("  (`mcore-compat doctor` shows the whole installation)", file=sys.stderr, flush=True)
            if args.debug:
                traceback.print_exception(exc, file=sys.stderr)
        return EXIT_ENVIRONMENT
    if is_rank_0():
        for note in result.notes:
            print(f"note: {note} The self-check below tells whether it works.", flush=True)
    return None


def run(args: argparse.Namespace) -> int:
    """Run the self-check; exit status 0 only if every check passed, 1 if one failed or the run did not finish,
    2 on bad options, 3 if the environment cannot run it (nothing started)."""
    from ..errors import McoreCompatError
    from ..rank0 import is_rank_0
    from ..selfcheck import UsageError
    from ..selfcheck import run as run_selfcheck

    problem = _sweep_conflicts(args) or _json_target_problem(args.json)
    if problem:
        _error(problem)
        return EXIT_USAGE
    stop = _preflight(args)
    if stop is not None:
        return stop
    opts = _options(args)
    if args.sweep:
        with _progress(args):
            return _sweep(args, opts)
    try:
        with _progress(args):
            report = run_selfcheck(opts)
    except UsageError as exc:
        _error(str(exc))
        return EXIT_USAGE
    except McoreCompatError as exc:  # under torchrun this rank raised (spawned ranks are reported in the report)
        _error(f"rank {os.environ.get('RANK', '?')}: {type(exc).__name__}: {str(exc).splitlines()[0]}"
               + ("" if args.debug else " (--debug shows the traceback)"))
        if args.debug:
            traceback.print_exception(exc, file=sys.stderr)
        return EXIT_FAIL

    if is_rank_0():
        print(report.render(verbose=args.verbose, debug=args.debug), flush=True)
        if args.json is not None and not _write_json(args.json, report.to_json()):
            return EXIT_FAIL
    return 0 if report.ok else EXIT_FAIL


@contextlib.contextmanager
def _progress(args: argparse.Namespace) -> Iterator[None]:
    """On a terminal (standard error is one, no ``--json``): the ranks' progress lines printed as they come, one
    per configuration and per verified step (:mod:`mcore_compat.selfcheck.progress`); piped, nothing."""
    if args.json is not None or not sys.stderr.isatty():
        yield
        return
    from ..selfcheck.progress import ENV, Follower

    fd, name = tempfile.mkstemp(prefix="mcore_compat-progress-", suffix=".txt")
    os.close(fd)
    before = os.environ.get(ENV)
    os.environ[ENV] = name
    try:
        with Follower(Path(name), sys.stderr):
            yield
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before


def _sweep_conflicts(args: argparse.Namespace) -> str | None:
    """``--sweep`` with options that pick one configuration: what to drop (``None``: nothing)."""
    if not args.sweep:
        return None
    given = [f"--{f.replace('_', '-')}" if f != "distributed_optimizer" else "--no-distributed-optimizer"
             for f in _CONFIG_FLAGS
             if (getattr(args, f) is False if f == "distributed_optimizer" else getattr(args, f) not in (None, 0,
                                                                                                          False))]
    return f"--sweep runs its own configurations; drop {', '.join(given)} or drop --sweep" if given else None


def _sweep_configs(args: argparse.Namespace, opts: Any) -> tuple[list[Any], list[tuple[str, str]]]:
    """The configurations ``--sweep`` runs with these arguments, and those it skips on this release (with why)."""
    from ..selfcheck import standard_sweep

    common = {k: v for k, v in opts.as_dict().items() if k not in ("nproc", *_CONFIG_FLAGS, "timeout")}
    common["offload_cycles"] = 2 if args.offload_cycles is None else args.offload_cycles
    configs, skipped = standard_sweep(args.nproc or 2, with_skipped=True, **common)
    return list(configs), list(skipped)


def _sweep_configs_for(argv: Sequence[str]) -> list[Any]:
    """The configurations ``mcore-compat self-check <argv>`` (with ``--sweep``) runs on the installed release, built
    by the CLI's own parser and option handling (the test matrix runs them in its warm ranks)."""
    parser = argparse.ArgumentParser(prog="mcore-compat")  # the subcommand's own options, as the CLI adds them
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["self-check", *argv])
    return _sweep_configs(args, _options(args))[0]


def _sweep(args: argparse.Namespace, opts: Any) -> int:
    import json

    from ..selfcheck import UsageError, run_sweep

    nproc = args.nproc or 2
    try:
        configs, skipped = _sweep_configs(args, opts)
        reports = run_sweep(configs, nproc, device=args.device, timeout=args.timeout) if configs else []
    except UsageError as exc:
        _error(str(exc))
        return EXIT_USAGE
    for i, (config, r) in enumerate(zip(configs, reports, strict=True), 1):
        # the configurations differ in a few settings at the far right of the settings line: name each first
        print(f"== configuration {i}/{len(reports)}: {config.label()} ==")
        print(r.render(verbose=args.verbose, debug=args.debug), flush=True)
        print()
    for name, why in skipped:
        print(f"not run: {name}: {why}")
    bad = sum(not r.ok for r in reports)
    tail = f", {len(skipped)} not run on this release" if skipped else ""
    print(f"self-check sweep: {'PASS' if not bad and reports else 'FAIL'} ({len(reports) - bad}/{len(reports)} "
          f"configurations{tail})")
    if args.json is not None and not _write_json(args.json, json.dumps([json.loads(r.to_json()) for r in reports],
                                                                        indent=2)):
        return EXIT_FAIL
    return 0 if not bad and reports else EXIT_FAIL
