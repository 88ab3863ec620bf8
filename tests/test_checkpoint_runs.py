"""Run directories (mcore_compat.checkpoint.runs) without Megatron, in one process: ``iter_*`` checkpoints and
Megatron-LM's tracker, ``keep_last`` retention, the newest complete checkpoint found past incomplete ones, ``inspect``
of a run directory, and a writer killed (SIGKILL) at random points of its saves that never costs the last complete
checkpoint."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import mcore_compat as mc
from mcore_compat.checkpoint import manifest as man
from mcore_compat.checkpoint import runs
from mcore_compat.cli import main

ROOT = Path(__file__).resolve().parent.parent


def child_env() -> dict[str, str]:
    """The environment of a child interpreter that imports this checkout's mcore_compat."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4))


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def _names(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir())


def test_megatron_lm_names() -> None:
    """Megatron-LM's names (megatron/training/checkpointing.py: get_checkpoint_name, get_checkpoint_tracker_filename)."""
    assert runs.ITERATION_DIR.format(100) == "iter_0000100"
    assert runs.TRACKER == "latest_checkpointed_iteration.txt"


def test_saves_track_and_retire(tmp_path: Path) -> None:
    """Each save publishes iter_<n>, then the tracker says n, then only the newest keep_last complete ones stay;
    a load of the run directory is the newest one."""
    run = tmp_path / "run"
    for n in (10, 20, 30):
        assert mc.save_to_run(run, n, _model(n), keep_last=2) == run / runs.ITERATION_DIR.format(n)
        assert runs.tracked_iteration(run) == n
    assert _names(run) == ["iter_0000020", "iter_0000030", runs.TRACKER]
    assert (run / runs.TRACKER).read_text() == "30\n"
    target = _model(0)
    loaded = mc.load_checkpoint(run, target)
    assert loaded.iteration == 30 and _same(target, _model(30))
    assert [e.iteration for e in mc.checkpoint.run_checkpoints(run)] == [20, 30]
    mc.save_to_run(run, 40, _model(40))  # keep_last None: all kept
    assert [e.iteration for e in mc.checkpoint.run_checkpoints(run)] == [20, 30, 40]


def test_newest_complete_past_incomplete_ones(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A newer iter_* that cannot be loaded (a shard missing, a save interrupted) is skipped with one line naming
    why; the tracker does not decide; no complete checkpoint at all: one line naming each problem."""
    run = tmp_path / "run"
    mc.save_to_run(run, 1, _model(1))
    broken = mc.save_to_run(run, 2, _model(2))
    (broken / man.shard_name(0)).unlink()
    (run / runs.ITERATION_DIR.format(3)).mkdir()  # a save that never wrote its manifest
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        target = _model(0)
        assert mc.load_checkpoint(run, target).iteration == 1 and _same(target, _model(1))
    said = [str(w.message) for w in caught if "skipping" in str(w.message)]
    assert len(said) == 2 and all("\n" not in s for s in said), said
    assert "iter_0000003" in said[0] and "iter_0000002" in said[1] and "missing shard rank_00000.pt" in said[1]
    # inspect lists them, the text and --json
    assert main(["checkpoint", "inspect", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"loads         {run / 'iter_0000001'}" in out and "NOT LOADABLE" in out and "tracker       iteration 2" in out
    assert main(["checkpoint", "inspect", "--json", str(run)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [c["iteration"] for c in info["checkpoints"]] == [1, 2, 3] and info["newest_complete"].endswith("0001")
    (run / "iter_0000001" / man.MANIFEST).unlink()
    with pytest.raises(mc.CheckpointError) as error:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mc.load_checkpoint(run, _model(0))
    assert "holds no complete checkpoint" in str(error.value) and "\n" not in str(error.value)


def test_bad_arguments_in_one_line(tmp_path: Path) -> None:
    for kwargs, words in (({"iteration": -1}, "iteration must be an int >= 0"),
                          ({"iteration": 1, "keep_last": 0}, "keep_last must be an int >= 1")):
        with pytest.raises(mc.CheckpointError, match=words):
            mc.save_to_run(tmp_path / "run", chunks=_model(0), **kwargs)
    assert not (tmp_path / "run").exists()


_WRITER = """
import os, sys, torch, mcore_compat as mc
from mcore_compat.checkpoint import runs
run = sys.argv[1]
start = max([e.iteration for e in runs.run_checkpoints(run)] if os.path.isdir(run) else [], default=0) + 1
for n in range(start, start + 100000):
    torch.manual_seed(n)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4))
    mc.save_to_run(run, n, model, extra={"n": n}, keep_last=2)
    print(n, flush=True)
"""


def _killed(script: str, run: Path, env: dict[str, str], rng: random.Random) -> list[int]:
    """Start a writer loop, let it report one complete save, SIGKILL it at a random moment up to 0.25 s later;
    the iterations it reported complete."""
    proc = subprocess.Popen([sys.executable, "-c", script, str(run)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    first = int(proc.stdout.readline())  # one more complete save
    time.sleep(rng.uniform(0.0, 0.25))
    proc.send_signal(signal.SIGKILL)
    reported = [first] + [int(line) for line in proc.stdout.read().split()]
    proc.wait()
    return reported


def test_a_writer_killed_anywhere_leaves_the_last_complete_checkpoint(tmp_path: Path) -> None:
    """A writer saving in a loop is SIGKILLed at random moments (during a shard, the manifest, the rename, the
    tracker, the retirement): every time, the run directory loads a checkpoint whose values are exactly the ones
    saved for its iteration, at least the last one the writer reported complete, and the next save goes on."""
    run = tmp_path / "run"
    env = child_env()
    rng = random.Random(1234)
    for trial in range(3):
        reported = _killed(_WRITER, run, env, rng)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            newest = runs.latest_checkpoint(run)
            target = _model(0)
            loaded = mc.load_checkpoint(run, target)
        n = loaded.iteration
        assert newest.name == runs.ITERATION_DIR.format(n) and n >= reported[-1], (trial, n, reported[-1:])
        assert loaded.extra["n"] == n and _same(target, _model(n)), (trial, n)
        complete = [e for e in mc.checkpoint.run_checkpoints(run) if e.complete]
        assert 1 <= len(complete) <= 3, complete  # keep_last=2, and one more when killed before retiring
    # the next save to another iteration removes what killed saves left (their staging directories)
    mc.save_to_run(run, runs.run_checkpoints(run)[-1].iteration + 5, _model(1), keep_last=2)
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")], _names(run)


_ASYNC_WRITER = """
import os, sys, torch, mcore_compat as mc
from mcore_compat.checkpoint import runs
run = sys.argv[1]
start = max([e.iteration for e in runs.run_checkpoints(run)] if os.path.isdir(run) else [], default=0) + 1
handle = None
for n in range(start, start + 100000):
    torch.manual_seed(n)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
    handle = mc.save_to_run_async(run, n, model, extra={"n": n}, keep_last=2)  # waits for the previous one first
    with torch.no_grad():  # training goes on: the state was copied
        for p in model.parameters():
            p.add_(1.0)
    if n % 2:
        handle.wait()
        print(n, flush=True)
"""


def test_a_background_writer_killed_anywhere_leaves_the_last_published_checkpoint(tmp_path: Path) -> None:
    """The same with background saves into the run directory (``save_to_run_async``, the model changed while the
    writer thread runs, every other save published by ``wait()`` and the others by the next save): SIGKILL at
    random moments - in the host copy, the writer thread, the publication, the tracker, the retirement - always
    leaves a run directory that loads exactly the values saved for its iteration, at least the last one
    ``wait()`` returned for."""
    run = tmp_path / "run"
    env = child_env()
    rng = random.Random(4321)
    for trial in range(3):
        reported = _killed(_ASYNC_WRITER, run, env, rng)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            target = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
            loaded = mc.load_checkpoint(run, target)
        n = loaded.iteration
        torch.manual_seed(n)
        expected = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
        assert n >= reported[-1] and runs.latest_checkpoint(run).name == runs.ITERATION_DIR.format(n), (trial, n)
        assert loaded.extra["n"] == n and _same(target, expected), (trial, n)


def _two_ranks(run: str) -> dict[str, object]:
    """On each of 2 gloo ranks (data-parallel replicas of one plain module): two saves into the run directory
    (keep_last=1), a load of it, then a save whose tracker cannot be written (a directory in its way)."""
    import torch.distributed as dist

    for n in (1, 2):
        mc.save_to_run(run, n, _model(n), keep_last=1)
    target = _model(0)
    loaded = mc.load_checkpoint(run, target)
    before = _names(Path(run))
    dist.barrier()
    if dist.get_rank() == 0:
        (Path(run) / runs.TRACKER).unlink()
        (Path(run) / runs.TRACKER).mkdir()
    dist.barrier()
    try:
        mc.save_to_run(run, 3, _model(3))
        error = None
    except mc.CheckpointError as exc:
        error = str(exc)
    return {"iteration": loaded.iteration, "exact": _same(target, _model(2)), "before": before,
            "after": _names(Path(run)), "error": error}


def test_two_ranks_agree_on_the_run_directory(tmp_path: Path) -> None:
    """Under torch.distributed (2 gloo ranks): rank 0 keeps the tracker and retires, every rank loads the same
    newest checkpoint, and a tracker that cannot be written fails the save on every rank in one line (the new
    checkpoint is complete and loadable)."""
    from mcore_compat.launch import Group

    with Group(2) as group:
        out = group.run(_two_ranks, args=(str(tmp_path / "run"),), timeout=300)
    for r in out:
        assert r["iteration"] == 2 and r["exact"], r
        assert r["error"] is not None and "\n" not in r["error"] and "rank 0:" in r["error"] and \
            "iter_0000003 is complete" in r["error"], r["error"]
    assert out[0]["before"] == ["iter_0000002", runs.TRACKER], out[0]["before"]
    assert out[0]["after"] == ["iter_0000002", "iter_0000003", runs.TRACKER], out[0]["after"]
    target = _model(0)
    assert mc.load_checkpoint(tmp_path / "run" / "iter_0000003", target).iteration == 3 and _same(target, _model(3))
