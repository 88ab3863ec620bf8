"""Scenarios for tests/test_checkpoint.py, run on every rank of ONE 2-rank gloo group (the session's ``rank_group``).

Resume: a run trains K steps, saves, trains M more (the uninterrupted run); a fresh build (other seed, so its
weights differ before the load) loads the checkpoint and trains M steps. Their weights, main params, both Adam
moments, step counts and losses must be equal bit for bit. Configurations: DP=2 with the distributed optimizer
(bf16, dropout, a scheduler) and without (fp32), TP=2 (sequence parallel, dropout), PP=2 with tied embeddings,
MoE with EP=2 where the release has it. Then resharding (distributed optimizer <-> not, at DP=2; TP=2 <-> TP=1;
PP=2 <-> PP=1; a TP or PP change refused for a checkpoint without the TP / PP record)
and bad input (nothing loaded after a refusal). ``run_all()`` returns plain data; the pytest side asserts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

from _training_scenarios import apply_patches

K, M = 2, 2
BASE = dict(nproc=2, lr=1e-2, weight_decay=0.1, clip_grad=1.0, bind=False, device="cpu", seed=1234)
#: name -> SelfCheckOptions fields
CONFIGS: dict[str, dict[str, Any]] = {
    "dp2-distopt-bf16": dict(dp=2, distributed_optimizer=True, dtype="bf16", dropout=0.1),
    "dp2-plain-fp32": dict(dp=2, distributed_optimizer=False, dtype="fp32"),
    "tp2-sp-bf16": dict(tp=2, distributed_optimizer=True, dtype="bf16", sequence_parallel=True, dropout=0.1),
    "pp2-tied-fp32": dict(pp=2, distributed_optimizer=False, dtype="fp32", tie_embeddings=True),
    # no clipping: 0.6/0.7 then run it too (their chained optimizer clips dense and expert params apart)
    "ep2-moe-bf16": dict(dp=2, experts=2, ep=2, distributed_optimizer=True, dtype="bf16", clip_grad=0.0),
}


def _opts(name: str, **over: Any) -> Any:
    from mcore_compat.selfcheck.options import SelfCheckOptions

    return dataclasses.replace(SelfCheckOptions(**{**BASE, **CONFIGS[name]}), **over).resolved()


def unsupported(name: str) -> str | None:
    from mcore_compat.selfcheck.models import unsupported_reason

    return unsupported_reason(_opts(name))


class Run:
    """One model + optimizer (+ scheduler) built for ``opts``, and how to train it."""

    def __init__(self, opts: Any, scheduler: bool = False) -> None:
        from mcore_compat import training
        from mcore_compat.selfcheck import models
        from mcore_compat.selfcheck.worker import no_decay

        self.opts = opts
        models.init_parallel(opts)
        modules, _ = models.build_chunks(opts)
        self.chunks = training.wrap_ddp(modules, ddp_config=models.ddp_config(opts))
        config = dataclasses.replace(models.optim_config(opts), min_lr=1e-4)
        self.optimizer = training.get_megatron_optimizer(config, self.chunks, no_weight_decay_cond=no_decay)
        training.install_training_hooks(self.chunks, self.optimizer)
        self.scheduler = training.optimizer_param_scheduler(
            self.optimizer, 1e-3, opts.lr, 1e-4, 2, 8, "cosine", 0.1, 0.1, 8, "constant") if scheduler else None

    def step(self) -> float | None:
        import torch

        from mcore_compat import training
        from mcore_compat.selfcheck import models
        from mcore_compat.training._common import parallel_state

        ps = parallel_state()
        training.zero_grad_buffer(self.chunks, self.optimizer)
        batches = models.make_batches(self.opts, ps.get_data_parallel_rank())
        out = training.forward_backward(models.forward_step(self.opts), models.data_iterators(batches, self.chunks),
                                        self.chunks, models.MICROBATCHES, seq_length=models.SEQ,
                                        micro_batch_size=models.MICRO_BATCH)
        ok, _, _ = training.optimizer_step(self.optimizer)
        assert ok
        if self.scheduler is not None:
            self.scheduler.step(1)
        losses = [float(o["loss"]) for o in out if isinstance(o, dict) and "loss" in o]
        return float(torch.tensor(losses).sum()) if losses else None  # None: not the last pipeline stage

    def state(self) -> dict[str, Any]:
        """Every model tensor, main param and optimizer state value, labelled by param and range."""
        from mcore_compat.checkpoint.state import main_params
        from mcore_compat.layout.read import unwrap

        out = {f"model:{i}.{k}": v.detach().clone() for i, c in enumerate(self.chunks)
               for k, v in unwrap(c).state_dict().items() if hasattr(v, "detach")}
        for mp in main_params(self.chunks, self.optimizer):
            label = f"{mp.name}[{mp.start}:{mp.end}]"
            out[f"main:{label}"] = mp.main.detach().clone()
            for k, v in mp.inner.state.get(mp.main, {}).items():
                out[f"state:{label}.{k}"] = v.detach().clone() if hasattr(v, "detach") else v
        return out

    def release(self) -> None:
        from mcore_compat.selfcheck.models import release_chunks

        release_chunks(self.chunks)


def _diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    import torch

    out = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        same = torch.equal(x, y) and x.dtype == y.dtype if isinstance(x, torch.Tensor) else x == y
        if not same:
            out.append(k)
    return out


def _shared_dir(tag: str) -> str:
    import torch.distributed as dist

    from mcore_compat.checkpoint.save import _gather

    root = _gather(os.environ.get("MCORE_COMPAT_CKPT_TMP") or f"/tmp/mcc-ckpt-{os.getpid()}")[0]
    path = os.path.join(root, tag)
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
    return path


def case_resume(name: str) -> dict[str, Any]:
    import mcore_compat as mc

    with_sched = name == "dp2-distopt-bf16"
    opts = _opts(name)
    path = _shared_dir(name)
    run = Run(opts, scheduler=with_sched)
    losses = [run.step() for _ in range(K)]
    mc.save_checkpoint(path, run.chunks, run.optimizer, scheduler=run.scheduler, extra={"seen": K}, iteration=K)
    at_save = run.state()
    tail = [run.step() for _ in range(M)]
    final = run.state()
    run.release()
    fresh = Run(dataclasses.replace(opts, seed=opts.seed + 1), scheduler=with_sched)
    fresh.opts = opts  # same data as the first run
    differs_before = len(_diff(fresh.state(), at_save))
    loaded = mc.load_checkpoint(path, fresh.chunks, fresh.optimizer, scheduler=fresh.scheduler)
    after_load = _diff(fresh.state(), at_save)
    fresh_tail = [fresh.step() for _ in range(M)]
    result = {"status": "ok", "losses": losses, "tail": tail, "fresh_tail": fresh_tail,
              "differs_before": differs_before, "after_load": after_load,
              "final_diff": _diff(fresh.state(), final), "n_values": len(final),
              "n_state": sum(1 for k in final if k.startswith("state:")),
              "iteration": loaded.iteration, "extra": loaded.extra, "rng_restored": loaded.rng_restored,
              "scheduler": None if fresh.scheduler is None else str(fresh.scheduler.state_dict())}
    fresh.release()
    return result


def case_fault_dropped_moment() -> dict[str, Any]:
    """A loader that drops Adam's exp_avg (what AReaL/SkyRL saw on 0.16: moments silently missing after a load):
    the comparison of ``case_resume`` must name the moments."""
    import mcore_compat as mc
    from mcore_compat.checkpoint import load

    opts = _opts("dp2-plain-fp32")
    path = _shared_dir("fault")
    run = Run(opts)
    run.step()
    mc.save_checkpoint(path, run.chunks, run.optimizer)
    at_save = run.state()
    run.release()
    fresh = Run(dataclasses.replace(opts, seed=opts.seed + 1))
    real_apply = load._Plan.apply

    def dropping(plan: Any) -> None:
        for _, _, state in plan.states:
            state.pop("exp_avg", None)
        real_apply(plan)

    load._Plan.apply = dropping  # type: ignore[method-assign]
    try:
        mc.load_checkpoint(path, fresh.chunks, fresh.optimizer)
    finally:
        load._Plan.apply = real_apply  # type: ignore[method-assign]
    out = {"status": "ok", "after_load": _diff(fresh.state(), at_save)}
    fresh.release()
    return out


def case_reshard() -> dict[str, Any]:
    """DP=2 distributed optimizer -> DP=2 plain and back: the loaded values equal the saved ones (per param);
    a TP=2 build refuses the DP=2 checkpoint whose manifest lacks the TP record (as written before TP resharding)
    before loading anything."""
    import torch
    import torch.distributed as dist

    import mcore_compat as mc

    out: dict[str, Any] = {"status": "ok"}
    for src, dst in (("dp2-distopt-bf16", "dp2-plain-fp32"), ("dp2-plain-fp32", "dp2-distopt-bf16")):
        src_opts = _opts(src, dropout=0.0, dtype="fp32")
        dst_opts = _opts(dst, dropout=0.0, dtype="fp32")
        path = _shared_dir(f"reshard-{src}")
        run = Run(src_opts)
        run.step()
        mc.save_checkpoint(path, run.chunks, run.optimizer)
        full = _full_state(run)
        run.release()
        if _KEEP and src == "dp2-distopt-bf16" and dist.get_rank() == 0:  # for load_at_dp1 (1 rank)
            shutil.copytree(path, os.path.join(_KEEP, "dp2"), dirs_exist_ok=True)
            torch.save(full, os.path.join(_KEEP, "dp2.reference.pt"))
        other = Run(dataclasses.replace(dst_opts, seed=99))
        mc.load_checkpoint(path, other.chunks, other.optimizer)
        out[f"{src}->{dst}"] = _diff(_full_state(other), full)
        other.release()
    _strip_tp_record(path)  # as written before TP resharding: a TP change is refused
    tp = Run(_opts("tp2-sp-bf16", seed=7))
    out["tp_refusal"], out["tp_unchanged"] = _refused_unchanged(path, tp)
    tp.release()
    return out


def _refusal(path: Any, run: Run) -> str | None:
    """Load ``path`` into ``run`` (model and optimizer): the refusal (``"<error type>: <message>"``) or ``None``."""
    import mcore_compat as mc

    try:
        mc.load_checkpoint(path, run.chunks, run.optimizer)
    except mc.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _refused_unchanged(path: Any, run: Run) -> tuple[str | None, list[str]]:
    """:func:`_refusal`, and what of ``run``'s state the attempt changed (``[]``: nothing)."""
    before = run.state()
    refusal = _refusal(path, run)
    return refusal, _diff(run.state(), before)


def _strip_tp_record(path: str) -> None:
    """Rank 0: drop the per-param TP record, as a checkpoint written before TP resharding lacks it."""
    _strip_record(path, "TP_RECORD")


def _strip_record(path: str, which: str) -> None:
    """Rank 0: drop the file beside the manifest named by ``manifest.<which>`` (``TP_RECORD``, ``PP_RECORD``)."""
    import torch.distributed as dist

    from mcore_compat.checkpoint import manifest

    if dist.get_rank() == 0:
        os.remove(os.path.join(path, getattr(manifest, which)))
    dist.barrier()


def _tp_opts(tp: int, **over: Any) -> Any:
    """The GPT on the 2 ranks at TP=2 x DP=1 (sequence parallel) or TP=1 x DP=2; fp32, biases, no dropout,
    distributed optimizer."""
    return _opts("tp2-sp-bf16", tp=tp, dp=2 // tp, dtype="fp32", dropout=0.0, bias=True,
                 sequence_parallel=tp > 1, **over)


def _tp_unsupported() -> str | None:
    from mcore_compat.selfcheck.models import unsupported_reason

    return unsupported_reason(_tp_opts(2)) or unsupported_reason(_tp_opts(1))


def _pp_unsupported() -> str | None:
    from mcore_compat.selfcheck.models import unsupported_reason

    return unsupported_reason(_pp_opts(2)) or unsupported_reason(_pp_opts(1))


def _tp_dump(run: Run, file: str) -> None:
    """Save this rank's values (weights; main params, moments and step gathered over DP) with each param's shape
    and Megatron's TP attributes as set on the live param (tensor_parallel/layers.py) to ``file``."""
    import torch

    from mcore_compat.layout.read import unwrap

    attrs = {f"{i}.{n}": [int(getattr(p, "partition_dim", -1)) if getattr(p, "tensor_model_parallel", False) else -1,
                          int(getattr(p, "partition_stride", 1)), list(p.shape)]
             for i, c in enumerate(run.chunks) for n, p in unwrap(c).named_parameters()}
    torch.save({"values": _full_state(run), "attrs": attrs}, file)


@contextlib.contextmanager
def _gated() -> Iterator[None]:
    """Models built meanwhile have a gated MLP (``gated_linear_unit``): each TP rank's ``linear_fc1`` holds
    [gate shard; up shard], Megatron's partition_stride 2 layout (transformer/mlp.py)."""
    from mcore_compat.selfcheck import models

    plain = models.transformer_config
    models.transformer_config = lambda opts: dataclasses.replace(plain(opts), gated_linear_unit=True)
    try:
        yield
    finally:
        models.transformer_config = plain


def case_reshard_tp() -> dict[str, Any]:
    """Saved at TP=2 after 2 steps, loaded into a fresh TP=1 build (other seed), and TP=1 -> TP=2: each rank dumps
    its values at save and after the load (and the checkpoint is kept) for the test to reassemble with torch.cat;
    step 3 from the loaded state next to the saved run's step 3 (the same batch on DP rank 0); a refused TP load (a
    vocabulary of another size: embedding shapes that do not tile) leaves the values unchanged; and a gated MLP
    (partition_stride 2) TP=2 -> TP=1, checked by its step-3 loss."""
    import torch.distributed as dist

    import mcore_compat as mc
    from mcore_compat.selfcheck import models

    assert _KEEP is not None
    rank = dist.get_rank()
    out: dict[str, Any] = {"status": "ok"}
    for src, dst in ((2, 1), (1, 2)):
        tag = f"tp{src}-tp{dst}"
        path = _shared_dir(f"reshard-{tag}")
        run = Run(_tp_opts(src))
        run.step(), run.step()
        mc.save_checkpoint(path, run.chunks, run.optimizer, iteration=2)
        _tp_dump(run, os.path.join(_KEEP, f"{tag}.saved.rank{rank}.pt"))
        next_loss = run.step()  # data-parallel rank 0's loss of step 3 at the saved TP size
        run.release()
        other = Run(_tp_opts(dst, seed=99))
        other.opts = _tp_opts(dst)  # the same data as the saved run
        loaded = mc.load_checkpoint(path, other.chunks, other.optimizer)
        _tp_dump(other, os.path.join(_KEEP, f"{tag}.loaded.rank{rank}.pt"))
        out[tag] = {"rng_restored": loaded.rng_restored, "iteration": loaded.iteration, "next_loss": next_loss,
                    "loss": other.step()}  # step 3 from the loaded state: the same batch on DP rank 0
        other.release()
        if rank == 0:
            shutil.copytree(path, os.path.join(_KEEP, tag), dirs_exist_ok=True)
        dist.barrier()
        if src == 2:
            vocab, models.VOCAB = models.VOCAB, models.VOCAB + 2  # another (padded) vocabulary at TP=1
            try:
                bad = Run(_tp_opts(1, seed=98))
            finally:
                models.VOCAB = vocab
            out["vocab_refusal"], out["vocab_unchanged"] = _refused_unchanged(path, bad)
            bad.release()
    with _gated():  # TP=2 -> TP=1 of a stride-2 layout: step 3 from the loaded state computes the same loss
        path = _shared_dir("reshard-gated")
        run = Run(_tp_opts(2))
        run.step(), run.step()
        mc.save_checkpoint(path, run.chunks, run.optimizer)
        next_loss = run.step()
        run.release()
        other = Run(_tp_opts(1, seed=99))
        other.opts = _tp_opts(1)
        mc.load_checkpoint(path, other.chunks, other.optimizer)
        out["gated-tp2-tp1"] = {"next_loss": next_loss, "loss": other.step()}
        other.release()
    return out


def _pp_opts(pp: int, **over: Any) -> Any:
    """The GPT (tied embeddings, biases, bf16 with fp32 main params, distributed optimizer, no dropout) at PP=2 x
    DP=1 or PP=1 x DP=2 on the 2 ranks; 4 transformer layers either way (see :func:`_layers`)."""
    return _opts("pp2-tied-fp32", **{"pp": pp, "dp": 2 // pp, "dtype": "bf16", "distributed_optimizer": True,
                                      "bias": True, **over})


@contextlib.contextmanager
def _layers(per_stage: int) -> Iterator[None]:
    """Models built meanwhile have ``per_stage`` transformer layers per pipeline rank (the self-check's default
    is 2), so that PP=1 and PP=2 builds can have the same 4 layers."""
    from mcore_compat.selfcheck import models

    default, models.LAYERS_PER_STAGE = models.LAYERS_PER_STAGE, per_stage
    try:
        yield
    finally:
        models.LAYERS_PER_STAGE = default


def _pp_run(pp: int, **over: Any) -> Run:
    """:func:`_pp_opts`' model built (4 layers), with the distributed optimizer; without it where the release
    refuses to build this model with it (0.7 at PP=1: the tied embedding would start inside the gradient bucket
    before it, :mod:`mcore_compat.training.tied_buckets`; the test checks that only a release that can lay it so
    falls back)."""
    from mcore_compat.errors import UnsupportedVersionError

    with _layers(4 // pp):
        try:
            return Run(_pp_opts(pp, **over))
        except UnsupportedVersionError as exc:
            if "tied embedding/output weight" not in str(exc) or not over.get("distributed_optimizer", True):
                raise
            return Run(_pp_opts(pp, **{**over, "distributed_optimizer": False}))


def case_reshard_pp() -> dict[str, Any]:
    """Saved at PP=2 after 2 steps, loaded into a fresh PP=1 x DP=2 build (other seed), and PP=1 x DP=2 -> PP=2
    (distributed optimizer where the release builds the model with it, :func:`_pp_run`):
    each rank dumps its values at save and after the load (and the checkpoint is kept, for :func:`load_pp_at_1rank`
    and for the test to rename stage 1's layers); step 3 from the loaded state next to the saved run's step 3 on
    the same batch; a PP=1 model of 2 layers refuses the 4-layer checkpoint with its values unchanged, and so does
    any PP=1 model once the pipeline record is removed (as written before PP resharding)."""
    import torch.distributed as dist

    import mcore_compat as mc
    from mcore_compat.checkpoint.save import _gather

    assert _KEEP is not None
    rank = dist.get_rank()
    out: dict[str, Any] = {"status": "ok"}
    for src, dst in ((2, 1), (1, 2)):
        tag = f"pp{src}-pp{dst}"
        path = _shared_dir(f"reshard-{tag}")
        run = _pp_run(src)
        run.step(), run.step()
        mc.save_checkpoint(path, run.chunks, run.optimizer, iteration=2)
        torch_save(_full_state(run), os.path.join(_KEEP, f"{tag}.saved.rank{rank}.pt"))
        next_loss = next(x for x in _gather(run.step()) if x is not None)  # step 3: the last stage / DP rank 0
        run.release()
        other = _pp_run(dst, seed=99)
        other.opts = dataclasses.replace(other.opts, seed=run.opts.seed)  # the same data as the saved run
        loaded = mc.load_checkpoint(path, other.chunks, other.optimizer)
        torch_save(_full_state(other), os.path.join(_KEEP, f"{tag}.loaded.rank{rank}.pt"))
        loss = next(x for x in _gather(other.step()) if x is not None)  # the same batch (data-parallel rank 0's)
        out[tag] = {"rng_restored": loaded.rng_restored, "iteration": loaded.iteration, "next_loss": next_loss,
                    "loss": loss, "distopt": [run.opts.distributed_optimizer, other.opts.distributed_optimizer]}
        other.release()
        if rank == 0:
            shutil.copytree(path, os.path.join(_KEEP, tag), dirs_exist_ok=True)
        dist.barrier()
        if src == 2:  # a model of another depth: refused, nothing loaded
            with _layers(2):
                bad = Run(_pp_opts(1, seed=98))
            out["layers_refusal"], out["layers_unchanged"] = _refused_unchanged(path, bad)
            _strip_record(path, "PP_RECORD")  # as written before PP resharding: a PP change is refused
            out["record_refusal"], out["record_unchanged"] = _refused_unchanged(path, bad)
            bad.release()
    return out


def torch_save(value: Any, file: str) -> None:
    import torch

    torch.save(value, file)


def load_pp_at_1rank(keep: str) -> dict[str, Any]:
    """On ONE rank: the PP=2 checkpoint :func:`case_reshard_pp` left in ``keep``, loaded at PP=1 (DP=1) with and
    without the distributed optimizer: the loaded values (for the test to compare: in ``keep``, a file per mode, as
    tensors passed back between processes are slow to move) and step 3's loss; then its copy
    whose last stage's tied output weight the test changed (``pp2-pp1-tampered``): the refusal, and what it changed
    (``[]``)."""
    import mcore_compat as mc

    apply_patches()
    out: dict[str, Any] = {}
    for distopt in (True, False):
        run = _pp_run(1, nproc=1, dp=1, seed=5, distributed_optimizer=distopt)
        run.opts = dataclasses.replace(run.opts, seed=BASE["seed"])  # the saved run's data
        loaded = mc.load_checkpoint(os.path.join(keep, "pp2-pp1"), run.chunks, run.optimizer)
        torch_save(_full_state(run), os.path.join(keep, f"pp2-pp1.loaded.1rank.distopt={distopt}.pt"))
        mode = out[f"distopt={distopt}"] = {"rng_restored": loaded.rng_restored, "iteration": loaded.iteration,
                                            "distopt": run.opts.distributed_optimizer}
        if not distopt:
            out["tied_refusal"], out["tied_unchanged"] = _refused_unchanged(
                os.path.join(keep, "pp2-pp1-tampered"), run)
        mode["loss"] = run.step()
        run.release()
    from mcore_compat.training._common import parallel_state

    parallel_state().destroy_model_parallel()
    return out


def _full_state(run: Run, optimizer: bool = True) -> dict[str, Any]:
    """Weights, and per param the full main param and moments gathered over the data-parallel ranks (this TP
    rank's shard of them)."""
    import torch
    import torch.distributed as dist

    from mcore_compat.checkpoint.state import main_params
    from mcore_compat.layout.read import unwrap

    out: dict[str, Any] = {f"model:{i}.{k}": v.detach().float().clone() for i, c in enumerate(run.chunks)
                           for k, v in unwrap(c).state_dict().items() if hasattr(v, "detach")}
    from mcore_compat.checkpoint.state import named_params

    if not optimizer:
        return out
    trainable = {n: p for p, n in named_params(run.chunks).items() if p.requires_grad}
    pieces = {f"{what}:{n}": torch.zeros(p.numel()) for n, p in sorted(trainable.items())
              for what in ("main", "exp_avg", "exp_avg_sq", "step")}
    views = list(main_params(run.chunks, run.optimizer))
    for mp in views:
        lo = 0 if mp.start is None else mp.start
        st = mp.inner.state.get(mp.main, {})
        for what, t in (("main", mp.main), ("exp_avg", st.get("exp_avg")), ("exp_avg_sq", st.get("exp_avg_sq"))):
            pieces[f"{what}:{mp.name}"][lo:lo + t.numel()] = t.detach().reshape(-1).float()
        pieces[f"step:{mp.name}"][0] = float(st["step"])
    sharded = any(mp.sharded for mp in views)
    from mcore_compat.training._common import parallel_state

    group = parallel_state().get_data_parallel_group()  # the ranks the optimizer shards over (not the TP ranks)
    for k in sorted(pieces):
        if sharded:
            dist.all_reduce(pieces[k], op=dist.ReduceOp.MAX if k.startswith("step:") else dist.ReduceOp.SUM,
                            group=group)
        out[k] = pieces[k]
    return out


def case_bad_input() -> dict[str, Any]:
    """Each bad checkpoint refused with its error class; the model and optimizer unchanged after it."""
    import json
    from pathlib import Path

    import torch.distributed as dist

    import mcore_compat as mc
    from mcore_compat.checkpoint import manifest as man

    opts = _opts("dp2-distopt-bf16", dropout=0.0)
    good = _shared_dir("bad-good")
    run = Run(opts)
    run.step()
    mc.save_checkpoint(good, run.chunks, run.optimizer)
    run.step()
    before = run.state()
    rank = dist.get_rank()
    results: dict[str, Any] = {"status": "ok"}

    def variant(tag: str, mutate: Callable[[Path], None]) -> str:
        path = Path(_shared_dir(f"bad-{tag}"))
        if rank == 0:
            shutil.copytree(good, path)
            mutate(path)
        dist.barrier()
        return str(path)

    def truncate(p: Path) -> None:
        f = p / man.shard_name(1)
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])

    def truncate_keep_size(p: Path) -> None:  # same size, garbage inside
        f = p / man.shard_name(1)
        f.write_bytes(b"\0" * f.stat().st_size)

    def foreign(p: Path) -> None:
        (p / man.MANIFEST).unlink()
        (p / "metadata.json").write_text("{}")

    def writing(p: Path) -> None:
        (p / man.MARKER).write_text(json.dumps({"pid": 4242, "host": "elsewhere", "started": "now"}))

    def missing(p: Path) -> None:
        (p / man.shard_name(1)).unlink()

    paths = {"truncated": variant("truncated", truncate), "corrupt": variant("corrupt", truncate_keep_size),
             "foreign": variant("foreign", foreign), "in_progress": variant("in-progress", writing),
             "missing_shard": variant("missing", missing)}
    for tag, path in paths.items():
        results[tag] = _refusal(path, run)
    results["unchanged"] = _diff(run.state(), before)
    run.release()
    # a model that does not match: other shapes (hidden size via another model), other names (MLP), no optimizer
    for tag, other in (("other_model", _opts("dp2-distopt-bf16", model="mlp", dropout=0.0)),
                       ("other_dtype", _opts("dp2-distopt-bf16", dtype="fp32", dropout=0.0))):
        o = Run(other)
        o.step()
        results[tag], results[f"{tag}_unchanged"] = _refused_unchanged(good, o)
        o.release()
    return results


def cases() -> dict[str, Callable[[], dict[str, Any]]]:
    out: dict[str, Callable[[], dict[str, Any]]] = {}
    for name in CONFIGS:
        out[f"resume-{name}"] = (lambda n=name: case_resume(n))
    out["fault-dropped-moment"] = case_fault_dropped_moment
    out["reshard"] = case_reshard
    out["reshard-tp"] = case_reshard_tp
    out["reshard-pp"] = case_reshard_pp
    out["bad-input"] = case_bad_input
    return out


CASE_NAMES = list(cases())


_KEEP: str | None = None  # where case_reshard leaves its DP=2 checkpoint for load_at_dp1


def load_at_dp1(keep: str) -> dict[str, Any]:
    """On ONE rank: the DP=2 distributed-optimizer checkpoint ``case_reshard`` left in ``keep``, loaded at DP=1 with
    and without the distributed optimizer; the differences from the values at save (empty = exact)."""
    import torch

    import mcore_compat as mc

    apply_patches()
    ref = torch.load(os.path.join(keep, "dp2.reference.pt"), weights_only=True)
    out: dict[str, Any] = {}
    for distopt in (True, False):
        run = Run(_opts("dp2-distopt-bf16", nproc=1, dp=1, dtype="fp32", dropout=0.0, seed=5,
                        distributed_optimizer=distopt))
        loaded = mc.load_checkpoint(os.path.join(keep, "dp2"), run.chunks, run.optimizer)
        out[f"distopt={distopt}"] = {"diff": _diff(_full_state(run), ref), "rng_restored": loaded.rng_restored,
                                     "trains": run.step() is not None}
        run.release()
    from mcore_compat.training._common import parallel_state

    parallel_state().destroy_model_parallel()
    return out


def run_all(only: tuple[str, ...] = (), keep: str | None = None) -> dict[str, Any]:
    """Every case (or those named in ``only``) on this rank: ``{"version": str, "cases": {name: result}}``.
    ``keep``: a directory (every rank sees) where ``case_reshard`` leaves a DP=2 checkpoint for :func:`load_at_dp1`."""
    import torch.distributed as dist

    global _KEEP
    _KEEP = keep

    apply_patches()
    from _case_groups import run_case

    from mcore_compat.detect import detect

    version = str(detect().version)
    results: dict[str, Any] = {}
    for name, fn in cases().items():
        if only and name not in only:
            continue
        config = name.removeprefix("resume-")
        why = unsupported(config) if config in CONFIGS else None
        if name == "reshard-tp":
            why = _tp_unsupported()
        if name == "reshard-pp":
            why = _pp_unsupported()
        if why is not None:
            results[name] = {"status": "unsupported", "reason": why}
            continue
        results[name] = run_case(fn)
    from mcore_compat.training._common import parallel_state

    parallel_state().destroy_model_parallel()
    root = os.path.dirname(_shared_dir("done"))
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    return {"version": version, "cases": results}


# ----------------------------------------------------------------------------------------------------------------
# across releases (scripts/checkpoint_matrix.py): saved on A, loaded on B
# ----------------------------------------------------------------------------------------------------------------

CROSS = "dp2-distopt-bf16"


def cross_save(root: str) -> str:
    """Train 2 steps of the DP=2 distributed-optimizer bf16 GPT, save to ``root/<release>`` and write the full
    values (weights, per-param main params, both moments, step) next to it as the reference."""
    import torch
    import torch.distributed as dist

    import mcore_compat as mc
    from mcore_compat.detect import detect

    apply_patches()
    version = str(detect().version)
    run = Run(_opts(CROSS, dropout=0.0))
    run.step(), run.step()
    mc.save_checkpoint(os.path.join(root, version), run.chunks, run.optimizer, iteration=2)
    ref = _full_state(run)
    if dist.get_rank() == 0:
        torch.save(ref, os.path.join(root, f"{version}.reference.pt"))
    dist.barrier()
    run.release()
    return version


def cross_load(root: str, sources: list[str]) -> dict[str, Any]:
    """Load each source release's checkpoint into a fresh build: ``full`` (model + optimizer) and ``weights``
    (model only), each "exact", "differs: <names>" or "refused: <error>"."""
    import torch

    import mcore_compat as mc
    from mcore_compat.detect import detect

    apply_patches()
    out: dict[str, Any] = {"version": str(detect().version), "from": {}}
    for src in sources:
        path = os.path.join(root, src)
        ref = torch.load(os.path.join(root, f"{src}.reference.pt"), weights_only=True)
        entry: dict[str, str] = {}
        for part in ("full", "weights"):
            run = Run(_opts(CROSS, dropout=0.0, seed=99))
            try:
                mc.load_checkpoint(path, run.chunks, run.optimizer if part == "full" else None)
            except mc.CheckpointError as exc:
                entry[part] = f"refused: {type(exc).__name__}: {exc}"
            else:
                got = _full_state(run, optimizer=part == "full")
                keys = [k for k in ref if part == "full" or k.startswith("model:")]
                diff = [k for k in keys if k not in got or not torch.equal(got[k], ref[k])]
                if part == "full":
                    diff += sorted(set(got) - set(ref))
                entry[part] = "exact" if not diff else f"differs: {diff[:6]}"
                if part == "full":  # the loaded optimizer trains on
                    entry["step_after_load"] = "ok" if run.step() is not None else "ok (no loss on this rank)"
            run.release()
        out["from"][src] = entry
    return out
