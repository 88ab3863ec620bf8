"""Background saves (``mcore_compat.save_checkpoint_async``) without Megatron: the state is copied when the call
returns (training may change it at once), the previous checkpoint stays until ``wait`` publishes, a failure of the
writer is raised by ``wait`` (on every rank, in one line), a process killed while its writer runs leaves the previous
checkpoint loadable exactly, and a later save or load publishes a pending one first."""

from __future__ import annotations

import errno
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_checkpoint_runs import _model, _same, child_env  # the same plain model, comparison, child env

import mcore_compat as mc
from mcore_compat.checkpoint import read_manifest
from mcore_compat.checkpoint import save as save_module


def test_the_state_is_copied_when_the_call_returns(tmp_path: Path) -> None:
    """The model and ``extra`` change right after the call; the checkpoint holds them as they were. Until ``wait``
    the previous checkpoint is the one at the path."""
    path = tmp_path / "ckpt"
    mc.save_checkpoint(path, _model(1), iteration=1)
    model, seen = _model(2), torch.arange(4)
    handle = mc.save_checkpoint_async(path, model, extra={"seen": seen}, iteration=2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    seen.add_(100)
    assert read_manifest(path).iteration == 1  # not published yet (the writer may have finished: wait publishes)
    assert handle.wait() == path and handle.done() and handle.wait() == path
    target = _model(0)
    loaded = mc.load_checkpoint(path, target)
    assert loaded.iteration == 2 and _same(target, _model(2)) and torch.equal(loaded.extra["seen"], torch.arange(4))


def test_a_writer_failure_is_raised_by_wait_and_keeps_the_previous_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt"
    mc.save_checkpoint(path, _model(1), iteration=1)

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", args[1].name)  # the shard's writer's file

    monkeypatch.setattr(save_module.torch, "save", full)
    handle = mc.save_checkpoint_async(path, _model(2), iteration=2)
    for _ in range(2):  # raised again on a second wait
        with pytest.raises(mc.CheckpointError) as info:
            handle.wait()
        assert "no space left on device" in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging directory left
    target = _model(0)
    assert mc.load_checkpoint(path, target).iteration == 1 and _same(target, _model(1))


def test_a_later_save_or_load_publishes_the_pending_one_first(tmp_path: Path) -> None:
    first = mc.save_checkpoint_async(tmp_path / "a", _model(1), iteration=1)
    mc.save_checkpoint(tmp_path / "b", _model(2), iteration=2)  # waits for "a" first
    assert read_manifest(tmp_path / "a").iteration == 1 and first.done()
    mc.save_checkpoint_async(tmp_path / "c", _model(3), iteration=3)
    target = _model(0)
    assert mc.load_checkpoint(tmp_path / "c", target).iteration == 3 and _same(target, _model(3))


_KILLED = """
import os, signal, sys, torch, mcore_compat as mc
path = sys.argv[1]
torch.manual_seed(1)
mc.save_checkpoint(path, torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4)), iteration=1)
torch.manual_seed(2)
big = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 4))
mc.save_checkpoint_async(path, big, iteration=2)
os.kill(os.getpid(), signal.SIGKILL)  # while the writer thread runs
"""


def test_a_process_killed_during_the_background_write_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, "-c", _KILLED, str(path)], env=child_env(), capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    target = _model(0)
    assert mc.load_checkpoint(path, target).iteration == 1 and _same(target, _model(1))
    mc.save_checkpoint(path, _model(3), iteration=3)  # the next save goes on (the killed one's staging removed)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


_RANK = """
import datetime, os, signal, sys, threading, time, torch, torch.distributed as dist
rank, path, store, mode, point = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
import mcore_compat as mc
from mcore_compat.checkpoint import save as save_module
torch.manual_seed(1)
mc.save_checkpoint(path, torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4)), iteration=1)
torch.manual_seed(2)
big = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 4))

def die(*_args, **_kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

if rank == 1:
    if point == "copy":  # while its state is copied to host memory
        save_module._payload = die
    elif point == "write":  # inside its shard's torch.save
        save_module.torch.save = die
    elif point == "conclude":  # before it tells rank 0 its shard
        save_module._Save.conclude = die
    elif point == "published":  # after the last exchange: rank 0 publishes, then hears nothing
        def conclude(self):
            save_module._gather(self.entry)
            die()
        save_module._Save.conclude = conclude
    else:  # a random moment
        threading.Timer(float(point), die).start()
start = time.monotonic()
try:
    if mode == "async":
        mc.save_checkpoint_async(path, big, iteration=2).wait()
    else:
        mc.save_checkpoint(path, big, iteration=2)
    print("OK", flush=True)
except mc.CheckpointError as exc:
    print("ERROR", round(time.monotonic() - start, 1), str(exc), flush=True)
time.sleep(1.0)  # a late kill finds rank 1 here
"""

_POINTS = ["copy", "write", "conclude", "published", "random"]


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("point", _POINTS)
def test_a_rank_killed_during_a_save_leaves_the_survivor_an_error_and_the_last_checkpoint(
        tmp_path: Path, mode: str, point: str) -> None:
    """2 processes in one gloo group; rank 1 is SIGKILLed during a save - copying its state, inside its shard's
    write, before it reports its shard, after the last exchange, or at a random moment (0-0.3 s). Rank 0 never
    hangs: it returns, or raises one CheckpointError line naming the dead peer within seconds (saying whether the
    new checkpoint was published); the path loads a complete checkpoint exactly - the previous one unless the new
    one was published - with no staging directory left behind."""
    where = f"{random.Random(f'{mode}-{point}').uniform(0.0, 0.3):.3f}" if point == "random" else point
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), str(tmp_path / "ckpt"), str(tmp_path / "store"),
                               mode, where], env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in (0, 1)]
    out0, err0 = procs[0].communicate(timeout=240)
    procs[1].communicate(timeout=60)
    assert procs[0].returncode == 0, err0[-2000:]
    assert procs[1].returncode == -signal.SIGKILL, where  # rank 1 died as planned
    line = out0.strip().splitlines()[-1]
    published = read_manifest(tmp_path / "ckpt").iteration == 2
    if line.startswith("ERROR"):
        assert float(line.split()[1]) < 30 and "stopped answering" in line and "\n" not in line, line
        assert ("is complete and published" in line) == published, line
        assert published or "the previous checkpoint there is unchanged" in line, line
    else:
        assert line == "OK" and published and point == "random", out0
    if point in ("copy", "write", "conclude"):
        assert not published, line
    if point == "published":
        assert published, line
    torch.manual_seed(0)
    target = _big() if published else _model(0)
    loaded = mc.load_checkpoint(tmp_path / "ckpt", target)
    torch.manual_seed(2)
    assert loaded.iteration == (2 if published else 1), where
    assert _same(target, _big() if published else _model(1)), where
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "store") == ["ckpt"], where


def _big() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 4))


def _two_ranks_async(path: str) -> dict[str, object]:
    """On each of 2 gloo ranks: a background save, the model changed at once, wait, load."""
    model = _model(5)
    handle = mc.save_checkpoint_async(path, model, iteration=5)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.0)
    handle.wait()
    target = _model(0)
    loaded = mc.load_checkpoint(path, target)
    return {"iteration": loaded.iteration, "exact": _same(target, _model(5)),
            "shards": [f.name for f in read_manifest(path).files]}


def test_two_ranks_save_in_the_background(tmp_path: Path) -> None:
    from mcore_compat.launch import Group

    with Group(2) as group:
        out = group.run(_two_ranks_async, args=(str(tmp_path / "ckpt"),), timeout=300)
    assert all(r["iteration"] == 5 and r["exact"] for r in out), out
    assert out[0]["shards"] == ["rank_00000.pt", "rank_00001.pt"], out[0]["shards"]


@pytest.fixture
def small_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB tmpfs (needs the right to mount: root in a container that allows it; skipped otherwise)."""
    where = tmp_path / "small"
    where.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)], capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({(proc.stderr or proc.stdout).strip()[:120]}): the disk-full "
                    "cases run simulated in tests/test_checkpoint_files.py")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)


@pytest.mark.parametrize("background", [False, True])
def test_a_full_filesystem_keeps_the_previous_checkpoint(small_filesystem: Path, background: bool) -> None:
    """On a real 2 MiB filesystem: a re-save that does not fit fails in one line saying so (the bytes needed and
    free), leaves the previous checkpoint loadable exactly, and frees what it wrote."""
    import shutil

    path = small_filesystem / "ckpt"
    mc.save_checkpoint(path, _model(1), iteration=1)
    free = shutil.disk_usage(small_filesystem).free
    torch.manual_seed(2)
    big = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 4))  # about 4 MiB of weights
    with pytest.raises(mc.CheckpointError) as info:
        if background:
            mc.save_checkpoint_async(path, big, iteration=2).wait()
        else:
            mc.save_checkpoint(path, big, iteration=2)
    text = str(info.value)
    assert "\n" not in text and "no space left on device" in text and "needs about" in text, text
    assert sorted(p.name for p in small_filesystem.iterdir()) == ["ckpt"]
    assert shutil.disk_usage(small_filesystem).free == free
    target = _model(0)
    assert mc.load_checkpoint(path, target).iteration == 1 and _same(target, _model(1))
