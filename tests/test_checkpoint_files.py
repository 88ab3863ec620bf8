"""The checkpoint format without Megatron: a plain module saved and loaded in one process (no torch.distributed),
the manifest, the refusals, and ``mcore-compat checkpoint inspect`` (text, --json, one-line errors)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import mcore_compat as mc
from mcore_compat.checkpoint import manifest as man
from mcore_compat.cli import main


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _saved(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    mc.save_checkpoint(path, _model(0), extra={"seen": 3, "note": "x", "t": torch.arange(3)}, iteration=7)
    return path


def test_round_trip_and_manifest(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    other = _model(1)
    loaded = mc.load_checkpoint(path, other)
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), _model(0).state_dict().values(), strict=True))
    assert loaded.iteration == 7 and loaded.extra["seen"] == 3 and torch.equal(loaded.extra["t"], torch.arange(3))
    data = json.loads((path / man.MANIFEST).read_text())
    assert data["format"] == "mcore_compat.torch" and data["layout"] == {"world": 1, "tp": 1, "pp": 1, "dp": 1,
                                                                        "ep": 1, "vpp": 1}
    assert not (path / man.MARKER).exists() and [f["name"] for f in data["files"]] == ["rank_00000.pt"]


def test_extra_must_be_plain(tmp_path: Path) -> None:
    with pytest.raises(mc.CheckpointError, match=r"extra\['bad'\] is a object"):
        mc.save_checkpoint(tmp_path / "c", _model(0), extra={"bad": object()})


@pytest.mark.parametrize("damage, error", [
    ("marker", "CheckpointInProgressError"), ("truncate", "CheckpointFormatError"),
    ("no_manifest", "CheckpointFormatError"), ("shapes", "CheckpointMismatchError"),
])
def test_refusals_leave_the_model_alone(tmp_path: Path, damage: str, error: str) -> None:
    path = _saved(tmp_path)
    target = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2)) if damage == "shapes" else _model(1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    if damage == "marker":
        (path / man.MARKER).write_text("{}")
    elif damage == "truncate":
        f = path / man.shard_name(0)
        f.write_bytes(f.read_bytes()[:100])
    elif damage == "no_manifest":
        (path / man.MANIFEST).unlink()
    with pytest.raises(mc.CheckpointError) as info:
        mc.load_checkpoint(path, target)
    assert type(info.value).__name__ == error and "\n" not in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


@pytest.mark.parametrize("saved, record, error, words", [
    ({"pp": 2, "vpp": 2}, True, "CheckpointReshardError", ["PP 2 -> 1, VPP 2 -> 1", "gather_full"]),
    ({"pp": 2, "ep": 2}, True, "CheckpointReshardError", ["PP 2 -> 1, EP 2 -> 1", "PP without virtual stages"]),
    ({"pp": 2, "tp": 2}, True, "CheckpointReshardError", ["TP 2 -> 1, PP 2 -> 1", "one of them per load"]),
    ({"pp": 2}, False, "CheckpointReshardError", ["PP 2 -> 1", "did not record each stage's layer numbers"]),
    ({"pp": 2}, True, "CheckpointFormatError", ["no shard of TP rank 0 for each of its 2 PP stages"]),
])
def test_pipeline_change_refusals(tmp_path: Path, saved: dict[str, int], record: bool, error: str,
                                  words: list[str]) -> None:
    """A layout the format does not reshard to (virtual stages, EP, TP and PP at once), a checkpoint without the
    pipeline record, one missing a stage's shards: one line naming it and the way out, the model untouched."""
    path = _saved(tmp_path)
    data = json.loads((path / man.MANIFEST).read_text())
    data["layout"].update(saved)
    (path / man.MANIFEST).write_text(json.dumps(data))
    if not record:
        (path / man.PP_RECORD).unlink()
    target = _model(1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(mc.CheckpointError) as info:
        mc.load_checkpoint(path, target)
    text = str(info.value)
    assert type(info.value).__name__ == error and "\n" not in text and all(w in text for w in words), text
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_inspect_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _saved(tmp_path)
    assert main(["checkpoint", "inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "mcore_compat.torch v1" in text and "0.weight" in text and "float32 (3, 4)" in text and "loadable" in text
    assert main(["checkpoint", "inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["model"][0]["1.bias"] == {"shape": [2], "dtype": "float32"} and info["iteration"] == 7
    # a model without transformer layers: no stages to split (not "layers per saved stage: none")
    assert info["reshard"]["tp"].startswith("yes") and info["reshard"]["pp"].startswith("not applicable"), \
        info["reshard"]
    (path / man.PP_RECORD).unlink()  # as written before PP resharding
    assert main(["checkpoint", "inspect", str(path)]) == 0
    assert "PP         no: written without the pipeline record" in capsys.readouterr().out
    assert main(["checkpoint", "inspect", str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a directory" in err


class _WithExtraState(torch.nn.Linear):
    """A layer whose extra state is empty (TransformerEngine's layers keep ``_extra_state`` None without FP8)."""

    def get_extra_state(self) -> object:
        return None

    def set_extra_state(self, state: object) -> None:
        pass


def test_inspect_text_of_a_small_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    mc.save_checkpoint(tmp_path / "ck", torch.nn.Sequential(_WithExtraState(4, 3)), iteration=1)
    assert main(["checkpoint", "inspect", str(tmp_path / "ck")]) == 0
    text = capsys.readouterr().out
    assert "  shards        1 file, " in text, text
    assert [ln.split() for ln in text.splitlines() if "_extra_state" in ln] == [["0._extra_state", "(empty)"]]
    assert "PP         not applicable: the model has no transformer layers" in text, text


def test_support_table_shows_the_checkpoint_matrix() -> None:
    """matrix/README.md's section from checkpoint_cross.json: rows in release order, a refusal named by its error."""
    from mcore_compat.support.render import _checkpoint_section

    cross = {"releases": ["0.4.0", "0.19.2"], "format": "f", "what": "w", "recorded": "d", "results": {
        "0.19.2": {"0.4.0": {"full": "refused: CheckpointMismatchError: x", "weights": "exact"},
                   "0.19.2": {"full": "exact", "weights": "exact"}},
        "0.4.0": {"0.4.0": {"full": "exact", "weights": "exact"},
                  "0.19.2": {"full": "differs: ['a']", "weights": "differs: ['a']"}}}}
    rows = [ln for ln in _checkpoint_section(cross) if ln.startswith("| 0.")]
    assert rows == ["| 0.4.0 | exact | differs |", "| 0.19.2 | weights exact; optimizer refused | exact |"]


def test_strict_names(tmp_path: Path) -> None:
    """A model with a buffer the checkpoint lacks: strict refuses naming it; strict=False loads what both have."""
    path = _saved(tmp_path)
    target = _model(1)
    target.register_buffer("stat", torch.ones(2))
    with pytest.raises(mc.CheckpointError, match=r"missing in the checkpoint \['stat'\]"):
        mc.load_checkpoint(path, target)
    mc.load_checkpoint(path, target, strict=False)
    assert torch.equal(target[0].weight, _model(0)[0].weight) and torch.equal(target.stat, torch.ones(2))


def test_manifest_records_tp_splits(tmp_path: Path) -> None:
    """Every parameter's split over TP is recorded beside the manifest (a file of its own: the manifest keeps the
    fields an earlier mcore_compat reads); a plain module's params are duplicated (dim -1)."""
    root = _saved(tmp_path)
    assert "tensor_parallel" not in json.loads((root / man.MANIFEST).read_text())
    record = {"pp0": {f"0.{n}": [-1, 1] for n, _ in _model(0).named_parameters()}}
    assert json.loads((root / man.TP_RECORD).read_text()) == record
    assert man.read_manifest(root).tensor_parallel == record


def test_tp_reshard_gated_layout() -> None:
    """Megatron's partition_stride layout (tensor_parallel/layers.py ``_initialize_affine_weight_cpu``; a gated
    MLP's fc1 holds [gate shard; up shard] per TP rank): TP=2 shards -> TP=1 and back, exactly."""
    from mcore_compat.checkpoint.tp import Split, reshard

    gate, up = torch.arange(8.0).reshape(4, 2), 100 + torch.arange(8.0).reshape(4, 2)
    full = torch.cat([gate, up])
    shards = [torch.cat([gate[:2], up[:2]]), torch.cat([gate[2:], up[2:]])]
    split = Split(0, 2)
    assert torch.equal(reshard("fc1", shards, split, split, 0, 1, (8, 2), "hint"), full)
    for rank in (0, 1):
        assert torch.equal(reshard("fc1", [full], split, split, rank, 2, (4, 2), "hint"), shards[rank])
    row = Split(1, 1)  # a row-parallel weight: split on the input dim
    assert torch.equal(reshard("proj", [full[:, :1], full[:, 1:]], row, row, 0, 1, (8, 2), "hint"), full)


def test_tp_reshard_refusals() -> None:
    """Shapes that do not tile (a vocabulary padded to another size), splits that differ, per-rank buffers."""
    from mcore_compat.checkpoint import CheckpointReshardError
    from mcore_compat.checkpoint.tp import Split, reshard, same_copies

    shards = [torch.zeros(32, 4), torch.zeros(32, 4)]
    with pytest.raises(CheckpointReshardError, match=r"^emb: .*\[64, 4\].*\[66, 4\].*vocabulary.*resume at TP=2$"):
        reshard("emb", shards, Split(0), Split(0), 0, 1, (66, 4), "resume at TP=2")
    with pytest.raises(CheckpointReshardError, match=r"split on dim 0.*split on dim 1"):
        reshard("w", shards, Split(0), Split(1), 0, 4, (16, 4), "resume at TP=2")
    with pytest.raises(CheckpointReshardError, match="copies on the checkpoint's TP ranks differ"):
        same_copies("amax", [torch.zeros(2), torch.ones(2)], "resume at TP=2")


# ---------------------------------------------------------------------------------------------------------------
# atomic, durable, checksummed saves; every failure named in one line, the previous checkpoint kept exact
# ---------------------------------------------------------------------------------------------------------------

def _weights(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


def _loads_exact(path: Path, seed: int, iteration: int) -> None:
    target = _model(1)
    loaded = mc.load_checkpoint(path, target)
    assert loaded.iteration == iteration and loaded.checksums_verified
    assert all(torch.equal(a, b) for a, b in zip(target.state_dict().values(), _model(seed).state_dict().values(),
                                                 strict=True))


def _disk_full(monkeypatch: pytest.MonkeyPatch, after: int = 0) -> None:
    """torch.save fails as it does on a full disk (its zip writer's "unexpected pos"), with ``after`` bytes free."""
    import collections
    import shutil

    from mcore_compat.checkpoint import save

    def full(obj: object, f: Any, *a: object, **k: object) -> None:
        f.write(b"x" * after)  # the shard's writer (files.HashingWriter): the bytes land in the staging directory
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(save.torch, "save", full)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - after, after))


def test_failed_resave_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A re-save to the same path that fails (disk full mid-shard, at its first byte): one line naming the cause with
    the bytes needed and free, no partial files left, the previous checkpoint loads exactly."""
    path = _saved(tmp_path)
    for after in (0, 300):
        with monkeypatch.context() as mp:
            _disk_full(mp, after)
            with pytest.raises(mc.CheckpointError) as info:
                mc.save_checkpoint(path, _model(5), iteration=8)
        text = str(info.value)
        assert "\n" not in text and "rank 0: no space left on device writing" in text and "needs about" in text \
            and "free" in text, text
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # the staging directory is gone
        _loads_exact(path, 0, 7)
    mc.save_checkpoint(path, _model(5), iteration=8)  # and a good re-save replaces it
    _loads_exact(path, 5, 8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_save_refusals_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A path that is a file (or below one), a directory holding other files, permission denied: one line each,
    nothing written."""
    (tmp_path / "f").write_text("x")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    cases = {tmp_path / "f": "is a file, not a directory", tmp_path / "f" / "c": "is a file, not a directory",
             tmp_path / "other": "holds files that are not part of an mcore_compat checkpoint (notes.txt)"}
    for path, words in cases.items():
        with pytest.raises(mc.CheckpointError) as info:
            mc.save_checkpoint(path, _model(0))
        assert words in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert (tmp_path / "other" / "notes.txt").read_text() == "keep me"

    def denied(self: Path, *a: object, **k: object) -> None:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", denied)
    with pytest.raises(mc.CheckpointError, match=r"failed on 1 rank\(s\): rank 0: permission denied: \S+: make it "
                                                 r"writable"):
        mc.save_checkpoint(tmp_path / "c", _model(0))


@pytest.mark.parametrize("where", ["middle"])
def test_flipped_byte_refused_naming_shard_and_tensor(tmp_path: Path, where: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """One byte flipped in a shard: the load refuses naming the shard (and the tensor, when the file still
    loads), nothing loaded; ``inspect --verify`` exits 1 naming it; without the checksums file (a checkpoint
    written before them) nothing is verified."""
    path = tmp_path / "ckpt"
    mc.save_checkpoint(path, torch.nn.Linear(256, 4), iteration=1)
    shard = path / man.shard_name(0)
    data = bytearray(shard.read_bytes())
    weight = torch.load(shard, weights_only=True)["model"][0]["weight"]
    at = bytes(data).find(weight.numpy().tobytes()[:32]) + 500 if where == "middle" else len(data) - 30
    data[at] ^= 0x01
    shard.write_bytes(bytes(data))
    target = torch.nn.Linear(256, 4)
    before = _weights(target)
    with pytest.raises(mc.CheckpointError) as info:
        mc.load_checkpoint(path, target)
    text = str(info.value)
    assert f"shard {shard} fails its checksum" in text and "\n" not in text, text
    if where == "middle":
        assert "tensor model[0].weight differs" in text, text
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    assert main(["checkpoint", "inspect", str(path), "--verify"]) == 1
    out = capsys.readouterr()
    assert "fails its checksum" in out.err and out.err.count("\n") == 1
    (path / man.CHECKSUMS).unlink()
    assert main(["checkpoint", "inspect", str(path), "--verify"]) in (0, 1)
    assert "nothing to verify" in capsys.readouterr().out


def test_old_checkpoint_without_checksums_loads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint written before checksums (no checksums file) loads, saying nothing was verified."""
    path = _saved(tmp_path)
    (path / man.CHECKSUMS).unlink()
    assert not mc.load_checkpoint(path, _model(1)).checksums_verified
    assert main(["checkpoint", "inspect", str(path), "--verify"]) == 0
    assert "no checksum recorded" in capsys.readouterr().out


@pytest.mark.parametrize("complete", [True, False])
def test_stale_marker_of_a_dead_writer(tmp_path: Path, complete: bool) -> None:
    """A marker left in place (by an mcore_compat before atomic saves) whose writer pid is dead on this host: an
    interrupted save; complete -> remove only the marker; incomplete -> load an earlier one or save again. Never
    'delete the directory'."""
    import socket
    import subprocess
    import sys

    path = _saved(tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    (path / man.MARKER).write_text(json.dumps({"pid": int(dead), "host": socket.gethostname(), "started": "x"}))
    if not complete:
        (path / man.shard_name(0)).unlink()
    with pytest.raises(mc.CheckpointError) as info:
        mc.load_checkpoint(path, _model(1))
    text = str(info.value)
    assert "was interrupted" in text and "is gone" in text and "delete" not in text and "\n" not in text, text
    if complete:
        assert f"remove only the file {path / man.MARKER}" in text, text
        (path / man.MARKER).unlink()
        _loads_exact(path, 0, 7)
    else:
        assert "holds no complete checkpoint" in text, text
