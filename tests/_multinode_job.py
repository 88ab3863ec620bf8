"""A user's training job for tests/test_multinode.py, run under torchrun (two "nodes" on one machine) or alone.

    python -m torch.distributed.run --nnodes 2 ... tests/_multinode_job.py train RUN_DIR   # every node
    python tests/_multinode_job.py load RUN_DIR                                           # one process

``train-kill``: the same, but global rank 1 SIGKILLs itself after the warm-up step (a lost node).

``train``: the tiny GPT of the self-check's models (bf16, the distributed optimizer, data-parallel over every rank),
one warm-up step, then ``check_training_step`` on the next (its verdict printed by global rank 0), then
``save_to_run`` of model and optimizer; rank 0 also writes the full weights it saved (``RUN_DIR/weights.pt``: at
TP=1 every rank holds them whole). ``load``: the same model on one process (DP=1, another size), the run directory
loaded into it and its optimizer, the weights compared with ``weights.pt`` exactly, then one step trains.
Prints one ``RESULT {json}`` line (global rank 0 only).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
from _own_model_scenarios import build_user_model, train_step


def _setup(world: int) -> tuple:
    """The model of the own-model fixtures (tests/_own_model_scenarios.py) on this job's ranks."""
    from mcore_compat import patches

    patches.apply_for_device("cpu")
    from mcore_compat import launch, symbols
    from mcore_compat.selfcheck import SelfCheckOptions, models

    launch.init_from_env()
    opts = replace(SelfCheckOptions(model="gpt", dtype="bf16", lr=1e-3, distributed_optimizer=True, tp=1, pp=1,
                                    bind=False, offload_cycles=0), nproc=world, device="cpu").resolved()
    chunks, optimizer = build_user_model(opts)
    return opts, models, chunks, optimizer, symbols.resolve("parallel_state")


def _weights(chunks) -> dict[str, torch.Tensor]:
    from mcore_compat.selfcheck.wrappers import core_module

    return {n: p.detach().float().clone() for n, p in core_module(chunks[0]).named_parameters()}


def train(run: Path, kill: bool = False) -> dict:
    import signal

    import torch.distributed as dist

    import mcore_compat as mc
    from mcore_compat.selfcheck import check_training_step

    world = int(os.environ["WORLD_SIZE"])
    opts, models, chunks, optimizer, ps = _setup(world)
    train_step(opts, chunks, optimizer)
    if kill and dist.get_rank() == 1:  # a lost node: its rank dies between steps
        os.kill(os.getpid(), signal.SIGKILL)
    batches = models.make_batches(opts, ps.get_data_parallel_rank())
    report = check_training_step(chunks, optimizer, models.forward_step(opts), iter(batches),
                                 num_microbatches=models.MICROBATCHES, seq_length=models.SEQ,
                                 micro_batch_size=models.MICRO_BATCH)
    mc.save_to_run(run, 2, chunks, optimizer, extra={"world": world})
    if dist.get_rank() == 0:
        torch.save(_weights(chunks), run / "weights.pt")
    return {"world": world, "dp": ps.get_data_parallel_world_size(), "check_ok": report.ok,
            "failed": [c.name for c in report.checks if c.failed], "ranks": _ranks()}


def _ranks() -> list[tuple[int, int]]:
    """(RANK, LOCAL_RANK) of every rank, gathered."""
    import torch.distributed as dist

    mine = (int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")))
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return sorted(out)


def load(run: Path) -> dict:
    import mcore_compat as mc

    opts, _models, chunks, optimizer, ps = _setup(1)
    loaded = mc.load_checkpoint(run, chunks, optimizer)
    saved = torch.load(run / "weights.pt")
    now = _weights(chunks)
    exact = sorted(saved) == sorted(now) and all(torch.equal(saved[n], now[n]) for n in saved)
    train_step(opts, chunks, optimizer)
    moved = any(not torch.equal(saved[n], v) for n, v in _weights(chunks).items())
    return {"iteration": loaded.iteration, "extra": loaded.extra, "exact": exact, "trains": moved,
            "dp": ps.get_data_parallel_world_size()}


if __name__ == "__main__":
    mode, where = sys.argv[1], Path(sys.argv[2])
    result = train(where, kill=mode == "train-kill") if mode.startswith("train") else load(where)
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(result), flush=True)
    from mcore_compat import launch

    launch.end_job()  # as a torchrun job should end (docs/launch.md)
