"""Save + load of a trained GPT's model and optimizer: mcore_compat's checkpoint against Megatron's dist_checkpointing.

One rank builds the benchmark GPT (``_gpt.py``; bf16 params, fp32 grads, distributed optimizer, Adam), trains two
steps so that the Adam moments exist, then times, interleaved round by round in one process (the order alternates
every round; median over ``--reps`` rounds after ``--warmup`` untimed ones):

* ``mcore_compat``: ``mc.save_checkpoint(dir, chunks, optimizer)`` and ``mc.load_checkpoint(dir, chunks, optimizer)``;
* ``dist_checkpointing``: what a user of Megatron's own format writes on that release: save =
  ``module.sharded_state_dict()``, ``optimizer.sharded_state_dict(model_sd, ...)`` and
  ``dist_checkpointing.save({"model": ..., "optimizer": ...}, dir)``; load = the same two sharded state dicts
  (``is_loading=True``), ``dist_checkpointing.load(...)``, ``module.load_state_dict`` and
  ``optimizer.load_state_dict``. Default strategies (torch_dist on 0.7+). The distributed optimizer's format is the
  one Megatron-LM's training saves by default: ``metadata={"distrib_optim_sharding_type": "dp_reshardable"}`` where
  the release has it (0.15+; 0.16+ refuse the old default, ``fully_sharded_model_space``: Megatron-Core
  ``optimizer/distrib_optimizer.py``, ``dist_checkpointing/mapping.py``), the release's default before;
  ``--sharding-type`` picks another (e.g. ``fully_reshardable``).

Each save goes to an emptied directory (emptied untimed). Reported: save, load and save+load time of each and their
ratios mcore_compat / dist_checkpointing (goal <= 1.05 for save+load), the bytes and files on disk of each, and
whether each round trip restores exactly: before the timed rounds, each path saves, a training step changes every
weight, main param and moment, and the load must bring back every one of them bit for bit (goal for mcore_compat;
for dist_checkpointing the values it does not restore are counted: with torch's Adam, i.e. without apex/TE, its
``dp_reshardable`` load keeps the loading optimizer's Adam ``step``).

Loads read what the save just wrote, so from the page cache on both sides (a cold read is the disk's speed for
both). Megatron's writer processes ``fsync`` their files (``strategies/filesystem_async.py``); mcore_compat's
``torch.save`` does not: the ``fsync`` column of ``config`` says so.

    python3 benchmarks/checkpoint_cost.py --device cuda          # 8 layers, hidden 1024, seq 512, bf16
    python3 benchmarks/checkpoint_cost.py --device cpu           # small GPT, bf16 (smoke)

Needs ``psutil`` where the release's dist_checkpointing writer uses it (0.6+; without it the writer processes die
and Megatron's save waits for them forever): the script refuses up front. On a release whose optimizer has no
``sharded_state_dict`` (0.4/0.5, where mcore_compat supplies the optimizer) it says so and exits 2.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C
import _gpt as G

NAME = "checkpoint_cost"
LR = 1e-4
SIDES = ("mcore_compat", "dist_checkpointing")


def _refuse(message: str) -> int:
    print(f"{NAME}: {message}", file=sys.stderr, flush=True)
    return 2


def _leaves(optimizer: Any) -> list[Any]:
    from mcore_compat.checkpoint.state import leaves

    return leaves(optimizer)


def _optimizer_kwargs(optimizer: Any, sharding_type: str | None) -> tuple[dict[str, Any], str]:
    """The keyword arguments of ``optimizer.sharded_state_dict`` that round-trip on this release, and the sharding
    type they select (``ValueError`` with one line where none does)."""
    leaves = _leaves(optimizer)
    for leaf in leaves:
        if not callable(getattr(type(leaf), "sharded_state_dict", None)) or inspect.isabstract(type(leaf)):
            raise ValueError(f"{type(leaf).__name__} has no sharded_state_dict on this release (mcore_compat supplies "
                             "the optimizer on 0.4/0.5): there is no dist_checkpointing path to compare with")
    distributed = [leaf for leaf in leaves if hasattr(leaf, "shard_fp32_from_float16_groups")]
    if not distributed:
        return {}, "(not a distributed optimizer)"
    cls = type(distributed[0])
    params = inspect.signature(cls.sharded_state_dict).parameters
    chosen = sharding_type or ("dp_reshardable" if hasattr(cls, "checkpoint_fully_reshardable_formats") else None)
    if chosen is None:
        default = params["sharding_type"].default if "sharding_type" in params else None
        return {}, f"{default or 'fully_sharded_model_space'} (the release's default)"
    if "metadata" in params:
        return {"metadata": {"distrib_optim_sharding_type": chosen}}, chosen
    if "sharding_type" in params:
        return {"sharding_type": chosen}, chosen
    raise ValueError(f"{cls.__name__}.sharded_state_dict takes no sharding type on this release; leave "
                     "--sharding-type out")


def _psutil_missing() -> bool:
    """Megatron's dist_checkpointing writer needs psutil (``strategies/filesystem_async.py``: imported on 0.6-0.12,
    ``_process_memory`` raises in each writer process on 0.13+, and ``save`` then waits forever)."""
    if importlib.util.find_spec("psutil") is not None:
        return False
    return importlib.util.find_spec("megatron.core.dist_checkpointing.strategies.filesystem_async") is not None


class _DistCheckpointing:
    """Megatron's own save and load of the module's and optimizer's sharded state dicts."""

    def __init__(self, module: Any, optimizer: Any, kwargs: dict[str, Any]) -> None:
        self.dc = importlib.import_module("megatron.core.dist_checkpointing")
        self.module, self.optimizer, self.kwargs = module, optimizer, kwargs

    def _sharded(self, is_loading: bool) -> dict[str, Any]:
        model_sd = self.module.sharded_state_dict()
        kwargs = dict(self.kwargs, metadata=dict(self.kwargs["metadata"])) if "metadata" in self.kwargs else self.kwargs
        return {"model": model_sd,
                "optimizer": self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, **kwargs)}

    def save(self, path: Path) -> None:
        self.dc.save(self._sharded(False), str(path))

    def load(self, path: Path) -> None:
        state = self.dc.load(self._sharded(True), str(path))
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


def _snapshot(chunks: list[Any], optimizer: Any) -> dict[str, Any]:
    """Copies of every model tensor, main param and optimizer state value, by name."""
    import torch

    from mcore_compat.checkpoint.state import main_params
    from mcore_compat.layout.read import unwrap

    out: dict[str, Any] = {}
    for i, chunk in enumerate(chunks):
        for k, v in unwrap(chunk).state_dict().items():
            if isinstance(v, torch.Tensor):
                out[f"model:{i}.{k}"] = v.detach().clone()
    for mp in main_params(chunks, optimizer):
        out[f"main:{mp.name}"] = mp.main.detach().clone()
        for k, v in mp.inner.state.get(mp.main, {}).items():
            out[f"state:{mp.name}.{k}"] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    return out


def _differ(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Names whose values are not identical (or present on one side only)."""
    import torch

    def same(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            return x.dtype == y.dtype and x.shape == y.shape and bool(torch.equal(x, y.to(x.device)))
        return bool(x == y)

    return sorted(set(a) ^ set(b)) + [k for k in sorted(set(a) & set(b)) if not same(a[k], b[k])]


def _on_disk(path: Path) -> tuple[int, int]:
    """(bytes, files) under ``path``."""
    sizes = [f.stat().st_size for f in path.rglob("*") if f.is_file()]
    return sum(sizes), len(sizes)


def _fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def main(argv: list[str] | None = None) -> int:
    p = C.parser(__doc__)
    G.add_args(p)
    p.add_argument("--reps", type=int, default=None, help="timed rounds (default: 5 on cuda, 7 on cpu)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    p.add_argument("--sharding-type", default=None,
                   help="the distributed optimizer's dist_checkpointing format (default: dp_reshardable on 0.15+, "
                        "the release's default before)")
    p.add_argument("--dir", type=Path, default=None,
                   help="where the checkpoints are written (default: a new temporary folder, removed at the end)")
    args = p.parse_args(argv)
    if args.device == "cpu" and args.dtype is None:
        args.dtype = "bf16"  # the benchmark GPT's precision on both devices: bf16 params, fp32 main params
    spec = G.spec_from_args(args)
    reps = args.reps or (5 if args.device == "cuda" else 7)
    if reps < 1 or args.warmup < 0:
        return _refuse("--reps must be >= 1 and --warmup >= 0")
    patches, _ps = C.single_rank_megatron(args.device)
    if _psutil_missing():
        return _refuse("megatron-core's dist_checkpointing writer needs psutil (its writer processes die without it "
                       "and the save never returns): pip install psutil")

    import mcore_compat as mc

    module, chunks, optimizer = G.train_setup(spec, args.seed, lr=LR)
    try:
        kwargs, sharding = _optimizer_kwargs(optimizer, args.sharding_type)
    except ValueError as exc:
        return _refuse(f"megatron-core {mc.detect().version}: {exc}")
    batches = G.make_batches(spec, args.seed, spec.microbatches)

    def step() -> float:
        return G.train_step(spec, chunks, optimizer, batches)

    step()
    step()
    megatron = _DistCheckpointing(module, optimizer, kwargs)
    root = Path(tempfile.mkdtemp(prefix=f"{NAME}-", dir=args.dir))
    dirs = {side: root / side for side in SIDES}
    doing = [""]  # what ran last, for the refusal's line

    def named(what: str, fn: Callable[[Path], Any]) -> Callable[[Path], Any]:
        def run(d: Path) -> Any:
            doing[0] = what
            return fn(d)

        return run

    ops: dict[str, tuple[Callable[[Path], Any], Callable[[Path], Any]]] = {
        "mcore_compat": (named("mcore_compat save", lambda d: mc.save_checkpoint(d, chunks, optimizer)),
                         named("mcore_compat load", lambda d: mc.load_checkpoint(d, chunks, optimizer))),
        "dist_checkpointing": (named(f"dist_checkpointing save ({sharding})", megatron.save),
                               named(f"dist_checkpointing load ({sharding})", megatron.load)),
    }
    try:
        for _ in range(args.warmup):
            for side in SIDES:
                save, load = ops[side]
                save(_fresh(dirs[side]))
                load(dirs[side])
        # Exactness: save, change everything with a training step, load, compare with the state as saved.
        round_trip: dict[str, dict[str, Any]] = {}
        for side in SIDES:
            save, load = ops[side]
            before = _snapshot(chunks, optimizer)
            save(_fresh(dirs[side]))
            step()
            changed = len(_differ(before, _snapshot(chunks, optimizer)))
            load(dirs[side])
            diff = _differ(before, _snapshot(chunks, optimizer))
            round_trip[side] = {"values": len(before), "changed_by_step": changed, "differ_after_load": diff[:20],
                                "n_differ": len(diff)}
        times: dict[str, dict[str, list[float]]] = {s: {"save": [], "load": []} for s in SIDES}
        for r in range(reps):
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                save, load = ops[side]
                target = _fresh(dirs[side])
                t, _ = C.timed(save, args.device, target)
                times[side]["save"].append(t)
                t, _ = C.timed(load, args.device, target)
                times[side]["load"].append(t)
        disk = {side: _on_disk(dirs[side]) for side in SIDES}
    except Exception as exc:  # a release whose dist_checkpointing cannot round-trip this model on this device
        text = " ".join(str(exc).split())
        return _refuse(f"megatron-core {mc.detect().version}: {doing[0]} failed, so there is no comparison on this "
                       f"release ({type(exc).__name__}: {text[:240]}{' ...' if len(text) > 240 else ''})")
    finally:
        shutil.rmtree(root, ignore_errors=True)

    total = {s: [a + b for a, b in zip(times[s]["save"], times[s]["load"], strict=True)] for s in SIDES}
    med = {s: {"save": statistics.median(times[s]["save"]), "load": statistics.median(times[s]["load"]),
               "save_load": statistics.median(total[s])} for s in SIDES}
    ratio = {k: med["mcore_compat"][k] / med["dist_checkpointing"][k] for k in ("save", "load", "save_load")}
    paired = statistics.median(a / b for a, b in zip(total["mcore_compat"], total["dist_checkpointing"], strict=True))
    changed = all(rt["changed_by_step"] > 0 for rt in round_trip.values())
    exact = round_trip["mcore_compat"]["n_differ"] == 0 and changed
    theirs = round_trip["dist_checkpointing"]
    steps_only = all(k.endswith(".step") for k in theirs["differ_after_load"])
    # Megatron's dp_reshardable load with torch's Adam (no apex/TE) keeps the loading optimizer's Adam step:
    # DistributedOptimizer._set_main_param_and_optimizer_states copies every state key from the is_loading
    # template, "step" included, over the step that load_state_dict set from the saved param groups.
    their_note = ("all restored" if theirs["n_differ"] == 0 else
                  f"{theirs['n_differ']} not restored: "
                  + ("Adam's step of each main param (the loading optimizer's value is kept)" if steps_only
                     else ", ".join(theirs["differ_after_load"][:3])))
    ms = {s: {k: v * 1e3 for k, v in med[s].items()} for s in SIDES}
    (mc_bytes, mc_files), (dc_bytes, dc_files) = disk["mcore_compat"], disk["dist_checkpointing"]
    headline = [
        C.metric("save+load time, mcore_compat / dist_checkpointing", ratio["save_load"], "x", goal="<= 1.05",
                 note=f"median of {reps}: {ms['mcore_compat']['save_load']:.1f} ms vs "
                      f"{ms['dist_checkpointing']['save_load']:.1f} ms; median of paired ratios {paired:.3f}"),
        C.metric("save time, mcore_compat / dist_checkpointing", ratio["save"], "x",
                 note=f"{ms['mcore_compat']['save']:.1f} ms vs {ms['dist_checkpointing']['save']:.1f} ms"),
        C.metric("load time, mcore_compat / dist_checkpointing", ratio["load"], "x",
                 note=f"{ms['mcore_compat']['load']:.1f} ms vs {ms['dist_checkpointing']['load']:.1f} ms"),
        C.metric("bytes on disk, mcore_compat / dist_checkpointing", mc_bytes / dc_bytes, "x",
                 note=f"{C.fmt_bytes(mc_bytes)} in {mc_files} files vs {C.fmt_bytes(dc_bytes)} in {dc_files} files"),
        C.metric("mcore_compat round trip restores every value exactly", float(exact), "", goal="== 1",
                 note=f"{round_trip['mcore_compat']['values']} weights, main params and optimizer-state values, "
                      f"{round_trip['mcore_compat']['changed_by_step']} of them changed by a step before the load"),
        C.metric("dist_checkpointing round trip: values not restored", float(theirs["n_differ"]), "values",
                 note=their_note),
    ]
    results = {
        "seconds": times, "median_seconds": med, "ratio": ratio, "ratio_save_load_paired_median": paired,
        "bytes_on_disk": {s: disk[s][0] for s in SIDES}, "files_on_disk": {s: disk[s][1] for s in SIDES},
        "round_trip": round_trip, "param_bytes": G.param_bytes(module), "patches": patches,
    }
    config = {"spec": spec.as_dict(), "reps": reps, "warmup": args.warmup, "lr": LR, "train_steps_before": 2,
              "distrib_optim_sharding_type": sharding, "optimizer_sharded_state_dict_kwargs": kwargs,
              "dist_checkpointing_strategy": "release default (dist_checkpointing.save / load without strategies)",
              "fsync": {"mcore_compat": False, "dist_checkpointing": True},
              "directory": "a new temporary folder" if args.dir is None else "--dir (given)",
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    C.write_result(NAME, args.device, args.out, config=config, results=results, headline=headline)
    # Non-zero when ours is not exact, or when Megatron's misses more than Adam's step (then the two paths did not
    # do the same work and the ratio would mean nothing).
    return 0 if exact and changed and steps_only else 1


if __name__ == "__main__":
    raise SystemExit(main())
