"""Scenarios for tests/test_configs_real.py: the self-check's parallel configurations trained through mcore_compat.

``run_world(world)`` runs, on every rank of ONE gloo group of ``world`` ranks, each configuration of that world
size (:func:`configs`): ``mcore_compat.selfcheck.models`` builds the tiny GPT (``init_parallel``,
``build_chunks``), ``mcore_compat.training`` wraps, builds the optimizer, installs the hooks and trains
:data:`STEPS` steps. A configuration the installed release cannot run on a CPU returns its
``unsupported_reason`` instead. Each rank returns plain data (its coordinates, losses, which parameters did not
change, a digest of every parameter after the steps); the pytest side compares ranks and asserts.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from _training_scenarios import apply_patches

STEPS = 2
BUCKET_SIZE = 4000  # elements: several buckets per chunk when overlapping (the tiny GPT has ~40k parameters)


@dataclass(frozen=True)
class Config:
    """One configuration: ``options`` are :class:`~mcore_compat.selfcheck.SelfCheckOptions` fields.
    ``finalize=False`` is a negative control: ``config.finalize_model_grads_func`` is left unset (and the
    schedules called without mcore_compat's check), so the evidence that the hook ran must be missing."""

    name: str
    world: int
    options: dict[str, Any] = field(default_factory=dict)
    finalize: bool = True


def configs() -> list[Config]:
    """Every configuration, in the order they run (world size 2 first)."""
    out = []
    for distopt in (False, True):
        for dtype in ("fp32", "bf16"):
            out.append(Config(f"dp2-{'distopt' if distopt else 'plain'}-{dtype}", 2,
                              dict(distributed_optimizer=distopt, dtype=dtype)))
    out.append(Config("tp2-sp", 2, dict(tp=2, sequence_parallel=True)))
    for distopt in (False, True):
        suffix = "-distopt" if distopt else ""
        out.append(Config(f"pp2-tied{suffix}", 2, dict(pp=2, tie_embeddings=True, distributed_optimizer=distopt)))
        out.append(Config(f"pp2-vpp2-tied{suffix}", 2, dict(pp=2, vpp=2, tie_embeddings=True,
                                                             distributed_optimizer=distopt)))
    out += [
        Config("dp2-overlap-plain", 2, dict(overlap=True, distributed_optimizer=False)),
        Config("dp2-overlap-distopt", 2, dict(overlap=True, distributed_optimizer=True)),
        Config("dp2-moe-ep2", 2, dict(experts=4, ep=2)),
        # negative controls (plain optimizer: the distributed optimizer's param all-gather would re-align DP ranks)
        Config("no-finalize-dp2", 2, dict(distributed_optimizer=False), finalize=False),
        Config("no-finalize-tp2-sp", 2, dict(tp=2, sequence_parallel=True), finalize=False),
        Config("no-finalize-pp2-tied", 2, dict(pp=2, tie_embeddings=True, distributed_optimizer=False),
               finalize=False),
        Config("tp2-pp2-sp", 4, dict(tp=2, pp=2, sequence_parallel=True, distributed_optimizer=False)),
        Config("dp2-pp2", 4, dict(pp=2, distributed_optimizer=False)),
        Config("dp2-tp2-sp", 4, dict(tp=2, sequence_parallel=True)),
    ]
    return out


def options_of(config: Config) -> Any:
    """The resolved :class:`SelfCheckOptions` of a configuration (CPU, tiny GPT)."""
    from mcore_compat.selfcheck import SelfCheckOptions

    return SelfCheckOptions(nproc=config.world, device="cpu", model="gpt", **config.options).resolved()


# ----------------------------------------------------------------------------------------------------------------
# one configuration on one rank
# ----------------------------------------------------------------------------------------------------------------

def _core(chunk: Any) -> Any:
    while hasattr(chunk, "module") and type(chunk).__name__ in ("DistributedDataParallel", "Float16Module"):
        chunk = chunk.module
    return chunk


def _params(chunks: list[Any]) -> dict[str, Any]:
    """``{"chunk<i>.<name>": param}`` of the unwrapped chunks."""
    return {f"chunk{i}.{n}": p for i, c in enumerate(chunks) for n, p in _core(c).named_parameters()}


def _digest(t: Any) -> str:
    return hashlib.sha256(t.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()[:20]


def _tied(opts: Any, params: dict[str, Any], ps: Any) -> dict[str, str]:
    """Digests of the first stage's input embedding and the last stage's output-layer copy of it."""
    out = {}
    vpp = opts.vpp or 1
    if ps.get_pipeline_model_parallel_rank() == 0:
        out["embedding"] = _digest(params["chunk0.embedding.word_embeddings.weight"])
    last = f"chunk{vpp - 1}.output_layer.weight"
    if ps.get_pipeline_model_parallel_rank() == ps.get_pipeline_model_parallel_world_size() - 1 and last in params:
        out["output"] = _digest(params[last])
    return out


def _run(config: Config) -> dict[str, Any]:
    import torch

    from mcore_compat import symbols
    from mcore_compat import training as mt
    from mcore_compat.selfcheck import models

    opts = options_of(config)
    reason = models.unsupported_reason(opts)
    if reason is not None:
        return {"status": "unsupported", "reason": reason}
    models.init_parallel(opts)
    ps = symbols.resolve("parallel_state")
    chunks, _ = models.build_chunks(opts)
    twin, _ = models.build_chunks(opts)  # a second copy (what the self-check's reference needs): same weights
    twin_params = _params(twin)
    same_weights = all(torch.equal(p.detach(), twin_params[n].detach()) for n, p in _params(chunks).items())
    del twin, twin_params
    chunks = mt.wrap_ddp(chunks, ddp_config=models.ddp_config(opts, bucket_size=BUCKET_SIZE if opts.overlap
                                                              else None))
    optimizer = mt.get_megatron_optimizer(models.optim_config(opts), chunks)
    mt.install_training_hooks(chunks, optimizer)
    if not config.finalize:
        for chunk in chunks:
            symbols.resolve("get_model_config")(chunk).finalize_model_grads_func = None
    params = _params(chunks)
    before = {n: p.detach().float().clone() for n, p in params.items()}
    batches = models.make_batches(opts, ps.get_data_parallel_rank())
    step = models.forward_step(opts)
    losses, norms = [], []
    for _ in range(STEPS):
        mt.zero_grad_buffer(chunks, optimizer)
        stored = mt.forward_backward(step, models.data_iterators(batches, chunks), chunks, models.MICROBATCHES, seq_length=models.SEQ,
                                     micro_batch_size=models.MICRO_BATCH, check_hooks=config.finalize)
        _ok, norm, _ = mt.optimizer_step(optimizer)
        norms.append(norm)
        if stored:
            losses.append(sum(float(d["loss"]) for d in stored) / len(stored))
    # the weights are read now; keep_overlap=False: the ranks run other scenarios next
    overlapped = mt.finish_param_sync(chunks, optimizer, keep_overlap=False)
    after = {n: p.detach().float() for n, p in params.items()}
    return {
        "status": "ok",
        "coords": {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
                   "dp": ps.get_data_parallel_rank()},
        "last_stage": ps.get_pipeline_model_parallel_rank() == ps.get_pipeline_model_parallel_world_size() - 1,
        "losses": losses,
        "grad_norms": norms,
        "finite": all(math.isfinite(v) for v in losses),
        "param_gather_overlapped": overlapped,
        "second_build_identical": same_weights,
        "layer_numbers": [[layer.layer_number for layer in _core(c).decoder.layers] for c in chunks],
        "n_params": len(params),
        "unchanged": sorted(n for n in params if torch.equal(before[n], after[n])),
        "digests": {n: _digest(t) for n, t in after.items()},
        "tp_replicated": sorted(n for n, p in params.items() if not getattr(p, "tensor_model_parallel", False)),
        "expert": sorted(n for n, p in params.items() if not getattr(p, "allreduce", True)),
        "tied": _tied(opts, params, ps) if opts.tie_embeddings else {},
    }


def _cleanup() -> None:
    from mcore_compat import symbols

    ps = symbols.resolve("parallel_state")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


_CALLS = itertools.count()
AGREE_TIMEOUT = 120.0  # seconds a rank waits for the others to finish a configuration


def _all_finished(tag: str) -> bool:
    """Tell the other ranks that this rank finished ``tag`` and wait for theirs, through the process group's
    store: unlike a collective, it cannot hang when a failed rank left the others inside one."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    store.set(f"mcore_compat_configs/{tag}/{dist.get_rank()}", "1")
    try:
        store.wait([f"mcore_compat_configs/{tag}/{r}" for r in range(dist.get_world_size())],
                   timedelta(seconds=AGREE_TIMEOUT))
    except Exception:  # a timeout: some rank is stuck (in a collective this rank left)
        return False
    return True


def run_world(world: int, names: list[str] | None = None) -> dict[str, Any]:
    """Every configuration of ``world`` ranks (or only ``names``) on this rank:
    ``{"version": str, "results": {name: result}}``.

    A configuration that raises is recorded as an error; if the other ranks then cannot finish it (they wait in
    a collective this rank left) the error is raised, so that the group stops at once and names it.
    """
    apply_patches()
    from mcore_compat.detect import detect

    call = next(_CALLS)
    results: dict[str, Any] = {}
    for config in configs():
        if config.world != world or (names is not None and config.name not in names):
            continue
        start = time.perf_counter()
        try:
            results[config.name] = _run(config)
        except Exception:
            results[config.name] = {"status": "error", "error": traceback.format_exc()}
        finally:
            _cleanup()
        if not _all_finished(f"{call}/{config.name}"):
            raise RuntimeError(f"configuration {config.name}: the other ranks did not finish it within "
                               f"{AGREE_TIMEOUT:g} s; this rank's result: {results[config.name]}")
        results[config.name]["seconds"] = round(time.perf_counter() - start, 2)
    return {"version": str(detect().version), "results": results}
