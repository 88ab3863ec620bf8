"""Scenarios for tests/test_training_step.py, run on every rank of ONE 2-rank gloo group by ``launch.spawn``.

``run_all()`` runs every configuration (DP=1 through explicit one-rank groups, DP=2, TP=2; distributed optimizer
off/on; fp32/bf16 params; overlap_grad_reduce; the finalize hook left unset) through mcore_compat's training-step
API against the installed megatron-core, and computes for each a reference step with plain PyTorch (the
unsharded model, the same initial weights, the same data, ``torch.optim.AdamW``). ``run_broadcast()`` runs the
``broadcast_params`` cases (DP rank 1 perturbed, Megatron's own method called directly as the fault check, then
mcore_compat's). Both return plain data; the pytest side asserts.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import traceback
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

H, F = 8, 16  # hidden, ffn
B = 4  # micro-batch size
M = 2  # microbatches per step
LR, BETAS, EPS, WD, CLIP = 1e-2, (0.9, 0.95), 1e-8, 0.1, 1.0


@dataclass(frozen=True)
class Case:
    """One configuration. ``dp`` 1 = explicit one-rank DP groups; ``tp`` 2 = TP over both ranks."""

    name: str
    dp: int
    tp: int
    distopt: bool
    bf16: bool
    overlap: bool = False
    hooks: bool = True
    native: bool = False  # Megatron's own config classes, no_weight_decay_cond, per_model_buffers


def cases() -> list[Case]:
    """Every configuration, in the order they run."""
    out = []
    for par, dp, tp in (("dp2", 2, 1), ("dp1", 1, 1), ("tp2", 1, 2)):
        for distopt in (False, True):
            for bf16 in (False, True):
                out.append(Case(f"{par}-{'distopt' if distopt else 'plainopt'}-{'bf16' if bf16 else 'fp32'}",
                                dp, tp, distopt, bf16))
    out.append(Case("dp2-plainopt-fp32-overlap", 2, 1, False, False, overlap=True))
    out.append(Case("dp2-distopt-fp32-overlap", 2, 1, True, False, overlap=True))
    out.append(Case("dp2-distopt-fp32-native", 2, 1, True, False, native=True))
    out.append(Case("dp2-nohook-fp32", 2, 1, False, False, hooks=False))
    return out


# ----------------------------------------------------------------------------------------------------------------
# patches
# ----------------------------------------------------------------------------------------------------------------

def _patches_module() -> Any:
    """``mcore_compat.patches`` (installed), or the repo's ``patches/`` directory when running from a checkout."""
    try:
        return importlib.import_module("mcore_compat.patches")
    except ImportError:
        root = Path(__file__).resolve().parents[1] / "patches"
        spec = importlib.util.spec_from_file_location("mcore_compat.patches", root / "__init__.py",
                                                      submodule_search_locations=[str(root)])
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["mcore_compat.patches"] = module
        spec.loader.exec_module(module)
        import mcore_compat

        mcore_compat.patches = module  # type: ignore[attr-defined]
        return module


def apply_patches() -> list[str]:
    """The CPU harness patches for the detected release, before megatron is imported."""
    patches = _patches_module()
    patches.apply_for_device("cpu")
    return patches.applied()  # all of this process's (an earlier module on the same ranks may have applied them)


# ----------------------------------------------------------------------------------------------------------------
# model, data, reference
# ----------------------------------------------------------------------------------------------------------------

def _full_weights() -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(1234)
    return {
        "fc1.weight": torch.randn(F, H, generator=g) / H**0.5,
        "fc1.bias": torch.randn(F, generator=g) * 0.1,
        "fc2.weight": torch.randn(H, F, generator=g) / F**0.5,
        "fc2.bias": torch.randn(H, generator=g) * 0.1,
    }


def _data(dp_rank: int) -> list[tuple[Any, Any]]:
    import torch

    out = []
    for m in range(M):
        g = torch.Generator().manual_seed(100 + 10 * dp_rank + m)
        # [seq, batch, hidden]: 0.4's tensor-parallel backward assumes 3-D activations
        shape = (2, B // 2, H)
        out.append((torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)))
    return out


def _tiny_model(config: Any) -> Any:
    import torch

    from mcore_compat import symbols

    megatron_module = symbols.resolve("MegatronModule")
    column = symbols.resolve("ColumnParallelLinear")
    row = symbols.resolve("RowParallelLinear")

    class TinyMLP(megatron_module):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__(config=config)
            self.model_type = importlib.import_module("megatron.core.enums").ModelType.encoder_or_decoder
            init = torch.nn.init.zeros_
            self.fc1 = column(H, F, config=config, init_method=init, bias=True, gather_output=False)
            self.fc2 = row(F, H, config=config, init_method=init, bias=True, input_is_parallel=True,
                           skip_bias_add=False)

        def set_input_tensor(self, tensor: Any) -> None:  # the schedules call it (pipeline input)
            self.input_tensor = tensor

        def forward(self, x: Any) -> Any:
            h, _ = self.fc1(x)
            y, _ = self.fc2(torch.nn.functional.gelu(h))
            return y

    return TinyMLP()


def _shard(name: str, full: Any, tp_rank: int, tp: int) -> Any:
    if name.startswith("fc1."):
        n = full.shape[0] // tp
        return full[tp_rank * n:(tp_rank + 1) * n]
    if name == "fc2.weight":
        n = full.shape[1] // tp
        return full[:, tp_rank * n:(tp_rank + 1) * n]
    return full


def _gather_full(module: Any, tp: int) -> dict[str, Any]:
    """The unsharded fp32 parameters of the (unwrapped) model."""
    import torch
    import torch.distributed as dist

    from mcore_compat.training._common import parallel_state

    group = parallel_state().get_tensor_model_parallel_group()
    out = {}
    for name, p in module.named_parameters():
        t = p.detach().float().clone()
        if tp > 1 and name != "fc2.bias":
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=group)
            t = torch.cat(parts, dim=0 if name.startswith("fc1.") else 1)
        out[name] = t
    return out


def _reference(init: dict[str, Any], dp_ranks: list[int], decay_1d: bool) -> dict[str, Any]:
    """One step of plain PyTorch on the unsharded model over the data of all DP ranks.

    ``decay_1d``: weight decay on biases too (the ``native`` cases pass ``no_weight_decay_cond=lambda *_: False``);
    otherwise biases are not decayed, on every release, without a scheduler (``get_megatron_optimizer`` sets the
    effective weight decay per group; tests/test_param_groups.py).
    """
    import torch

    params = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}

    def fwd(x: Any) -> Any:
        h = torch.nn.functional.linear(x, params["fc1.weight"], params["fc1.bias"])
        return torch.nn.functional.linear(torch.nn.functional.gelu(h), params["fc2.weight"], params["fc2.bias"])

    losses = {d: [((fwd(x) - t) ** 2).mean() for x, t in _data(d)] for d in dp_ranks}
    total = sum(sum(v) for v in losses.values()) / (len(dp_ranks) * M)
    total.backward()
    plist = list(params.values())
    grad_norm = float(torch.nn.utils.clip_grad_norm_(plist, CLIP))
    groups = [{"params": [p for p in plist if decay_1d or p.dim() > 1], "weight_decay": WD},
              {"params": [p for p in plist if not (decay_1d or p.dim() > 1)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=LR, betas=BETAS, eps=EPS)
    opt.step()
    return {
        "rank_loss": {d: float(sum(v) / M) for d, v in losses.items()},
        "grad_norm": grad_norm,
        "params": {k: v.detach().clone() for k, v in params.items()},
    }


# ----------------------------------------------------------------------------------------------------------------
# one case
# ----------------------------------------------------------------------------------------------------------------

def _transformer_config(tp: int, bf16: bool) -> Any:
    import torch

    from mcore_compat import symbols

    cls = symbols.resolve("TransformerConfig")
    return cls(num_layers=1, hidden_size=H, num_attention_heads=2, tensor_model_parallel_size=tp,
               use_cpu_initialization=True, params_dtype=torch.bfloat16 if bf16 else torch.float32, bf16=bf16)


def _version() -> Any:
    from mcore_compat.detect import detect

    return detect().version


def _init_parallel(tp: int, ep: int = 1) -> None:
    from mcore_compat.training._common import parallel_state

    ps = parallel_state()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, **({"expert_model_parallel_size": ep} if ep > 1
                                                                    else {}))


def _run_case(case: Case, one_rank_groups: list[Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from mcore_compat import training as mt
    from mcore_compat.training._common import parallel_state

    rank = dist.get_rank()
    _init_parallel(case.tp)
    ps = parallel_state()
    tp_rank = ps.get_tensor_model_parallel_rank()
    explicit = one_rank_groups[rank] if case.dp == 1 and case.tp == 1 else None
    dp_rank = 0 if case.dp == 1 else ps.get_data_parallel_rank()
    data_owner = rank if explicit is not None else dp_rank  # whose data this rank trains on
    dp_ranks = [data_owner] if case.dp == 1 else list(range(case.dp))

    config = _transformer_config(case.tp, case.bf16)
    model = _tiny_model(config)
    full = _full_weights()
    dtype = torch.bfloat16 if case.bf16 else torch.float32
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_shard(name, full[name], tp_rank, case.tp).to(dtype))
    init = {k: v.to(dtype).float() for k, v in full.items()}

    ddp_cfg = mt.DDPConfig(grad_reduce_in_fp32=case.bf16, overlap_grad_reduce=case.overlap,
                           use_distributed_optimizer=case.distopt, bucket_size=64 if case.overlap else None)
    opt_cfg = mt.OptimConfig(lr=LR, weight_decay=WD, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_eps=EPS,
                             clip_grad=CLIP, bf16=case.bf16, params_dtype=dtype,
                             use_distributed_optimizer=case.distopt)
    out: dict[str, Any] = {"case": case.name, "rank": rank, "dp_rank": data_owner}
    try:
        if case.native:  # the installed release's own config objects (a keyword dict / OptimConfig before 0.7/0.6)
            from mcore_compat.capabilities import has
            from mcore_compat.training.optimizer import optimizer_config_of

            ddp_cfg = mt.ddp_config_of(ddp_cfg)
            if has("core_optimizer", _version()):
                opt_cfg = optimizer_config_of(opt_cfg)
        chunks = mt.wrap_ddp([model], ddp_config=ddp_cfg, data_parallel_group=explicit)
        extra: dict[str, Any] = {}
        if case.native:  # every parameter decays (as the reference); explicit buffers -> Megatron's private builder
            extra = dict(no_weight_decay_cond=lambda name, param: False,
                         per_model_buffers={0: getattr(chunks[0], "buffers", None) or []})
        optimizer = mt.get_megatron_optimizer(opt_cfg, chunks, data_parallel_group=explicit, **extra)
    except Exception as exc:
        from mcore_compat.errors import UnsupportedVersionError

        if isinstance(exc, UnsupportedVersionError):
            out.update(status="unsupported", error=str(exc))
            return out
        raise
    if case.hooks:
        mt.install_training_hooks(chunks, optimizer)
    mt.zero_grad_buffer(chunks, optimizer)

    def forward_step(data_iterator: Any, module: Any) -> Any:
        x, target = next(data_iterator)
        y = module(x.to(dtype))

        def loss_func(output: Any) -> Any:
            loss = ((output.float() - target) ** 2).mean()
            # clone: 0.5+ divide the returned loss tensor in place by num_microbatches after loss_func
            return loss, {"loss": loss.detach().clone()}

        return y, loss_func

    if case.hooks:
        stored = mt.forward_backward(forward_step, iter(_data(data_owner)), chunks, M)
    else:
        # The silent failure: Megatron's own schedule with config.finalize_model_grads_func left unset.
        from mcore_compat import symbols

        cfg = symbols.resolve("get_model_config")(chunks[0])
        out["finalize_hook_set"] = cfg.finalize_model_grads_func is not None
        fb = mt.get_forward_backward_func()
        stored = fb(forward_step_func=forward_step, data_iterator=iter(_data(data_owner)), model=chunks[0],
                    num_microbatches=M, seq_length=0, micro_batch_size=B, decoder_seq_length=None,
                    forward_only=False)
        out["main_grad_norm"] = float(torch.sqrt(sum((p.main_grad.float() ** 2).sum()
                                                     for p in chunks[0].module.parameters())))
        for fn in (mt.check_training_hooks, partial(mt.forward_backward, forward_step,
                                                     iter(_data(data_owner)), chunks, M)):
            try:
                fn(chunks) if fn is mt.check_training_hooks else fn()
                out.setdefault("check_errors", []).append(None)
            except mt.MissingTrainingHookError as exc:
                out.setdefault("check_errors", []).append(str(exc))
    losses = [float(d["loss"]) for d in stored]
    ok, grad_norm, _ = mt.optimizer_step(optimizer)
    ref = _reference(init, dp_ranks, decay_1d=case.native)
    got = _gather_full(chunks[0].module, case.tp)
    out.update(
        status="ok",
        optimizer=f"{type(optimizer).__module__}.{type(optimizer).__name__}",
        update_successful=ok,
        loss=sum(losses) / len(losses),
        ref_loss=ref["rank_loss"][data_owner],
        grad_norm=grad_norm,
        ref_grad_norm=ref["grad_norm"],
        update_err={k: float((got[k] - init[k] - (ref["params"][k] - init[k])).abs().max()) for k in got},
        update_max={k: float((ref["params"][k] - init[k]).abs().max()) for k in got},
        changed={k: bool((got[k] != init[k]).any()) for k in got},
        # plain lists: tensors in the result queue are shared by file descriptor and can vanish with the child
        params={k: v.tolist() for k, v in got.items()},
        ref_params={k: v.tolist() for k, v in ref["params"].items()},
        init_params={k: v.tolist() for k, v in init.items()},
    )
    return out


def run_all() -> dict[str, Any]:
    """Every case on this rank: ``{"version": str, "patches": [...], "cases": {name: result}}``."""
    import torch.distributed as dist

    patches = apply_patches()
    from mcore_compat.detect import detect

    version = str(detect().version)
    one_rank_groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    results: dict[str, Any] = {}
    from _case_groups import run_case

    for case in cases():
        results[case.name] = run_case(lambda: _run_case(case, one_rank_groups), case=case.name)  # noqa: B023
    from mcore_compat.training._common import parallel_state

    parallel_state().destroy_model_parallel()  # the session's ranks run other modules next
    return {"version": version, "patches": patches, "cases": results}


# ----------------------------------------------------------------------------------------------------------------
# broadcast_params
# ----------------------------------------------------------------------------------------------------------------

#: ``broadcast_params`` configurations (DP=2 over both ranks, distributed optimizer on so that 0.6+ DDP keeps
#: param buffers): "dp2" default groups (one chunk, not a list); "dp2-ep2" expert parallelism 2, fc2's params
#: marked expert (``allreduce=False``: their expert-data-parallel group is each rank alone); "explicit-dp1"
#: ``wrap_ddp(data_parallel_group=<this rank alone>)`` while parallel_state's DP group holds both ranks.
BROADCAST_CASES: tuple[str, ...] = ("dp2", "dp2-ep2", "explicit-dp1")
EXPERT_PREFIX = "fc2."  # the params marked expert in "dp2-ep2"


def _named_values(module: Any) -> dict[str, Any]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _as_lists(values: dict[str, Any]) -> dict[str, Any]:
    return {n: v.tolist() for n, v in values.items()}


def _alias_check(chunk: Any) -> tuple[int, list[str]]:
    """``(params checked, names of params that are not their view of param_data)`` over DDP's param buffers."""
    import torch

    from mcore_compat.layout.read import ddp_buffers

    names = {p: n for n, p in chunk.module.named_parameters()}
    checked, bad = 0, []
    for buffer, _ in ddp_buffers(chunk, _version()):
        data = getattr(buffer, "param_data", None)
        if data is None:
            continue
        for param, (start, end, _) in buffer.param_index_map.items():
            view = data[start:end]
            checked += 1
            if param.data.data_ptr() != view.data_ptr() or not torch.equal(param.data.reshape(-1), view):
                bad.append(names[param])
    return checked, bad


def _broadcast_case(name: str, one_rank_groups: list[Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from mcore_compat import training as mt
    from mcore_compat.errors import UnsupportedVersionError

    rank = dist.get_rank()
    _init_parallel(1, ep=2 if name == "dp2-ep2" else 1)
    model = _tiny_model(_transformer_config(1, False))
    full = _full_weights()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(full[n])
            if name == "dp2-ep2" and n.startswith(EXPERT_PREFIX):
                setattr(p, "allreduce", False)  # Megatron's mark of expert-parallel params
    out: dict[str, Any] = {"case": name, "rank": rank}
    try:
        chunks = mt.wrap_ddp([model], ddp_config=mt.DDPConfig(use_distributed_optimizer=True),
                             data_parallel_group=one_rank_groups[rank] if name == "explicit-dp1" else None)
    except UnsupportedVersionError as exc:
        out.update(status="unsupported", error=str(exc))
        return out
    chunk = chunks[0]
    with torch.no_grad():
        if rank == 1:  # DP rank 1 drifts away from rank 0 in every element, in place (views stay views)
            for i, p in enumerate(chunk.module.parameters()):
                p.data.add_(0.5 + i)
    before = _named_values(chunk.module)

    # Megatron's own method, called directly (the fault check), then the values put back in place.
    try:
        chunk.broadcast_params()
        out["raw_error"] = None
    except Exception as exc:  # 0.6/0.7: AttributeError, raised on every rank before anything is sent
        out["raw_error"] = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    out["raw"] = _as_lists(_named_values(chunk.module))
    with torch.no_grad():
        for n, p in chunk.module.named_parameters():
            p.data.copy_(before[n])

    megatron_method = chunk.broadcast_params
    calls = []

    def spy() -> None:
        calls.append(1)
        megatron_method()

    chunk.broadcast_params = spy  # the instance attribute shadows the method: counts what mcore_compat calls
    mt.broadcast_params(chunk if name == "dp2" else chunks)
    checked, bad = _alias_check(chunk)
    out.update(status="ok", before=_as_lists(before), after=_as_lists(_named_values(chunk.module)),
               megatron_calls=len(calls), alias_checked=checked, alias_bad=bad)
    return out


def _not_wrapped_error() -> dict[str, Any]:
    """``broadcast_params`` on a plain module after a wrapped one: refused before anything is sent."""
    import torch

    from mcore_compat import training as mt
    from mcore_compat.errors import McoreCompatError

    _init_parallel(1)
    wrapped = mt.wrap_ddp(_tiny_model(_transformer_config(1, False)))
    try:
        mt.broadcast_params([wrapped, torch.nn.Linear(2, 2)])
    except Exception as exc:
        return {"type": type(exc).__name__, "compat": isinstance(exc, McoreCompatError), "message": str(exc)}
    return {"type": None}


def run_broadcast() -> dict[str, Any]:
    """Every ``broadcast_params`` case on this rank: ``{"version": str, "cases": {name: result}, "not_wrapped":
    {...}}``."""
    import torch.distributed as dist

    apply_patches()
    from mcore_compat.detect import detect

    one_rank_groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    results: dict[str, Any] = {}
    for name in BROADCAST_CASES:
        try:
            results[name] = _broadcast_case(name, one_rank_groups)
        except Exception:
            results[name] = {"case": name, "status": "error", "error": traceback.format_exc()}
            dist.barrier()
    try:
        not_wrapped = _not_wrapped_error()
    except Exception:
        not_wrapped = {"type": "error", "error": traceback.format_exc()}
    from mcore_compat.training._common import parallel_state

    parallel_state().destroy_model_parallel()  # the session's ranks run other modules next
    return {"version": str(detect().version), "cases": results, "not_wrapped": not_wrapped}
