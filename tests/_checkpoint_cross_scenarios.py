"""Checkpoints across releases from committed fixtures: run on every rank of ONE 2-rank gloo group.

A fixture (``tests/data/checkpoints/<A>/``) is what release A's ``mcore_compat.save_checkpoint`` writes for the
DP=2 distributed-optimizer bf16 GPT of :mod:`_checkpoint_scenarios` shrunk to :data:`TINY` (hidden 8, vocabulary
16: about 1,500 parameters, so that a fixture is a few tens of KB), trained :data:`STEPS` steps without dropout:
``checkpoint/`` (the manifest, the TP record, one shard per rank) and ``reference.pt`` (the full values at save, as float32:
every weight, and per param the main param, both Adam moments and the step gathered over DP; :func:`pack`).

* :func:`save_fixture` writes one (``scripts/checkpoint_matrix.py --write-fixtures`` runs it on each release A).
* :func:`load_fixtures` loads every fixture into fresh builds on the running release B, with and without the
  optimizer, compares with the reference, takes a step (``tests/test_checkpoint_cross.py`` in every release
  session, ``scripts/checkpoint_matrix.py`` by hand).
* :func:`regenerate` writes the running release's fixture again into a temporary directory and names what differs
  from the committed one (:func:`fixture_diff`: the manifest's fields but the writers' mcore_compat and torch
  versions, the shard sizes and checksums, the TP record, every value of every shard and of the reference).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _checkpoint_scenarios import CROSS, Run, _full_state, _opts
from _training_scenarios import apply_patches

#: Where the committed fixtures are, one directory per writing release.
FIXTURES = Path(__file__).resolve().parent / "data" / "checkpoints"
#: The releases a fixture is committed for (scripts/checkpoint_matrix.py's RELEASES).
SOURCES = ("0.4.0", "0.8.0", "0.12.3", "0.14.0", "0.16.1", "0.19.2")
#: selfcheck.models' sizes for the fixtures' GPT (its defaults: 2 layers, hidden 32, ffn 64, 4 heads, vocabulary
#: 64): one layer of hidden 8 (752 parameters).
TINY = {"LAYERS_PER_STAGE": 1, "HIDDEN": 8, "FFN": 16, "HEADS": 2, "VOCAB": 16}
STEPS = 2
#: How far (units in the last place) a regenerated floating value may be from the committed one. The fixture's
#: fp32 main params, Adam moments and reference values come out of CPU arithmetic whose kernels torch picks by the
#: CPU's instruction set at run time (vector width, fused multiply-add, reduction order): the fixtures written on
#: one x86 machine differ from those written on an AMD EPYC with AVX-512 by a few ulp in the main params (bf16
#: weights identical; measured at the tensor's largest magnitude, at most 2 ulp). A change in what is saved (a field, a layout, a shard's split, a wrong value) moves values
#: by far more or changes names, dtypes and shapes, which stay exact. Loading a fixture stays bit for bit.
FLOAT_ULPS = 4
#: The shards' checksums (they hash the zip files, which depend on the torch that wrote them, like the shard sizes;
#: the committed fixtures predate them and load without): not compared by :func:`fixture_diff`.
CHECKSUMS = "mcore_compat_checksums.json"
#: Manifest fields that name the writing environment rather than the checkpoint (the shard sizes depend on the
#: torch that wrote the zip files): not compared by :func:`fixture_diff`.
ENVIRONMENT_FIELDS = ("mcore_compat", "torch")


@contextlib.contextmanager
def tiny() -> Iterator[None]:
    """selfcheck.models builds (and makes batches for) the :data:`TINY` GPT meanwhile."""
    from mcore_compat.selfcheck import models

    before = {k: getattr(models, k) for k in TINY}
    for k, v in TINY.items():
        setattr(models, k, v)
    try:
        yield
    finally:
        for k, v in before.items():
            setattr(models, k, v)


def _fixture_opts(seed: int | None = None) -> Any:
    opts = _opts(CROSS, dropout=0.0)
    return opts if seed is None else dataclasses.replace(opts, seed=seed)


def _release() -> str:
    from mcore_compat.detect import detect

    return str(detect().version)


def save_fixture(root: str) -> str:
    """Train the :data:`TINY` GPT :data:`STEPS` steps and write ``root/<release>/checkpoint`` and
    ``root/<release>/reference.pt``; returns the release."""
    import torch
    import torch.distributed as dist

    import mcore_compat as mc

    apply_patches()
    version = _release()
    out = os.path.join(root, version)
    random.seed(1234)  # the checkpoint holds Python's RNG state too: the same on every write
    with tiny():
        run = Run(_fixture_opts())
        for _ in range(STEPS):
            run.step()
        mc.save_checkpoint(os.path.join(out, "checkpoint"), run.chunks, run.optimizer, iteration=STEPS)
        ref = _values(run)
        run.release()
    if dist.get_rank() == 0:
        torch.save(pack(ref), os.path.join(out, "reference.pt"))
    dist.barrier()
    return version


def pack(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (float32 tensors) as one flat tensor and each key's shape: a file of 3 zip entries instead of
    one per value (a few hundred bytes each)."""
    import torch

    assert all(v.dtype == torch.float32 for v in values.values())
    return {"shapes": {k: list(v.shape) for k, v in values.items()},
            "flat": torch.cat([v.reshape(-1) for v in values.values()])}


def unpack(packed: dict[str, Any]) -> dict[str, Any]:
    """The values :func:`pack` packed."""
    import math

    out, at = {}, 0
    for k, shape in packed["shapes"].items():
        n = math.prod(shape)
        out[k] = packed["flat"][at:at + n].reshape(shape)
        at += n
    assert at == packed["flat"].numel()
    return out


def _values(run: Run, optimizer: bool = True) -> dict[str, Any]:
    """:func:`_checkpoint_scenarios._full_state` with each param's step as one value (not a tensor of the
    param's size whose first element is the step)."""
    return {k: v[:1] if k.startswith("step:") else v for k, v in _full_state(run, optimizer=optimizer).items()}


def _compare(got: dict[str, Any], ref: dict[str, Any], optimizer: bool) -> list[str]:
    """The reference keys whose values differ (bit for bit, dtype included) or are missing; with ``optimizer``,
    keys ``got`` has beyond the reference too."""
    import torch

    keys = [k for k in ref if optimizer or k.startswith("model:")]
    out = [k for k in keys if k not in got or got[k].dtype != ref[k].dtype or not torch.equal(got[k], ref[k])]
    return out + (sorted(set(got) - set(ref)) if optimizer else [])


def load_one(path: Path, ref: dict[str, Any], optimizer: bool) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into a fresh :data:`TINY` build (another seed), with the optimizer or
    weights only: ``{"result": "exact" | "differs: [...]" | "refused: <error type>: <message>",
    "differs_before": n, "step_after_load": "ok" | None}``."""
    import mcore_compat as mc

    run = Run(_fixture_opts(seed=99))
    try:
        before = _compare(_values(run, optimizer=False), ref, optimizer=False)  # no optimizer state before a step
        try:
            mc.load_checkpoint(path, run.chunks, run.optimizer if optimizer else None)
        except mc.CheckpointError as exc:
            return {"result": f"refused: {type(exc).__name__}: {exc}", "differs_before": len(before),
                    "step_after_load": None}
        diff = _compare(_values(run, optimizer), ref, optimizer)
        loss = run.step()
        return {"result": "exact" if not diff else f"differs: {diff[:6]}", "differs_before": len(before),
                "step_after_load": "ok" if loss is not None and loss == loss else f"loss {loss}"}
    finally:
        run.release()


def load_fixtures(root: str | None = None, sources: tuple[str, ...] = SOURCES) -> dict[str, Any]:
    """Every fixture of ``sources`` under ``root`` (default: :data:`FIXTURES`) loaded on this release, with the
    optimizer (``full``) and weights only (``weights``): ``{"version", "cases": {"from-<A>": {"status", "full",
    "weights"}}}`` (see :func:`load_one`); on a release of ``sources`` also ``"regenerate"`` (its fixture written
    again and compared, :func:`regenerate`)."""
    import torch
    from _case_groups import run_case

    apply_patches()
    base = Path(root) if root is not None else FIXTURES
    cases: dict[str, Any] = {}

    def one(src: str) -> dict[str, Any]:
        ref = unpack(torch.load(base / src / "reference.pt", weights_only=True))
        with tiny():
            return {"status": "ok", **{part: load_one(base / src / "checkpoint", ref, part == "full")
                                       for part in ("full", "weights")}}

    for src in sources:
        cases[f"from-{src}"] = run_case(lambda s=src: one(s))
    if _release() in sources:  # a release that wrote a fixture: it still writes the same
        cases["regenerate"] = run_case(lambda: _regenerate_case(base))
    return {"version": _release(), "cases": cases}


def ulp_distance(a: Any, b: Any) -> float:
    """The largest difference between two floating tensors of one dtype and shape, in units in the last place of
    that dtype at the tensor's largest magnitude (``inf`` where one is NaN or infinite and the other not): an
    element near 0 carries the rounding of the larger ones it was computed from."""
    import torch

    x, y = a.detach().double(), b.detach().double()
    if not torch.equal(x.isnan(), y.isnan()) or not torch.equal(x[x.isinf()], y[y.isinf()]):
        return float("inf")
    finite = x.isfinite() & y.isfinite()
    x, y = x[finite], y[finite]
    if x.numel() == 0:
        return 0.0
    info = torch.finfo(a.dtype)
    mag = torch.maximum(x.abs().max(), y.abs().max()).clamp_min(info.tiny)
    spacing = info.eps * torch.exp2(torch.floor(torch.log2(mag)))
    return float(((x - y).abs() / spacing).max())


def _values_diff(a: Any, b: Any, where: str) -> list[str]:
    """Where two loaded objects differ: dtype and shape exactly, integer tensors bit for bit, floating tensors
    within :data:`FLOAT_ULPS` (:func:`ulp_distance`), dicts by key, lists by item."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape):
            return [where]
        if torch.equal(a, b):
            return []
        ulps = ulp_distance(a, b) if a.is_floating_point() else float("inf")
        return [] if ulps <= FLOAT_ULPS else [f"{where} ({ulps:.3g} ulp)"]
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{where}.{k}" for k in sorted(set(a) ^ set(b), key=str)]
        for k in sorted(set(a) & set(b), key=str):
            out += _values_diff(a[k], b[k], f"{where}.{k}")
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where} (length {len(a)} != {len(b)})"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _values_diff(x, y, f"{where}[{i}]")]
    return [] if a == b else [where]


def _manifest(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((path / "mcore_compat_checkpoint.json").read_text(encoding="utf-8"))
    for k in ENVIRONMENT_FIELDS:
        data.pop(k, None)
    for f in data["files"]:
        f.pop("bytes", None)
    return data


def fixture_diff(committed: Path, written: Path) -> list[str]:
    """What differs between two fixture directories (``<A>/``): the manifest's fields but
    :data:`ENVIRONMENT_FIELDS` and the shard sizes, the TP record, every value of every shard (``torch.load``)
    and of ``reference.pt``; the file names present but :data:`CHECKSUMS`. Empty: the same fixture."""
    import torch

    out: list[str] = []
    names = [sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file() and p.name != CHECKSUMS)
             for d in (committed, written)]
    if names[0] != names[1]:
        out.append(f"files {names[0]} != {names[1]}")
    a, b = committed / "checkpoint", written / "checkpoint"
    out += _values_diff(_manifest(a), _manifest(b), "manifest")
    out += _values_diff(*(json.loads((d / "mcore_compat_tensor_parallel.json").read_text(encoding="utf-8"))
                          for d in (a, b)), "tp_record")
    for name in sorted(set(names[0]) & set(names[1])):
        if name.endswith(".pt"):
            out += _values_diff(*(torch.load(d / name, weights_only=True) for d in (committed, written)), name)
    return out


def _regenerate_case(base: Path) -> dict[str, Any]:
    """This release's fixture written again into a temporary directory every rank sees and compared with the one
    in ``base`` on rank 0 (:func:`fixture_diff`): ``{"status": "ok", "diff": [...]}``."""
    import torch.distributed as dist

    from mcore_compat.checkpoint.save import _gather

    tmp = _gather(tempfile.mkdtemp(prefix="mcc-fixture-") if dist.get_rank() == 0 else None)[0]
    try:
        version = save_fixture(tmp)
        diff = fixture_diff(base / version, Path(tmp) / version) if dist.get_rank() == 0 else []
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    return {"status": "ok", "diff": diff}


def regenerate(committed: str | None = None) -> dict[str, Any]:
    """:func:`_regenerate_case` against ``committed`` (default :data:`FIXTURES`): ``{"version", "cases":
    {"regenerate": {"status", "diff"}}}``."""
    from _case_groups import run_case

    apply_patches()
    base = Path(committed) if committed is not None else FIXTURES
    return {"version": _release(), "cases": {"regenerate": run_case(lambda: _regenerate_case(base))}}
