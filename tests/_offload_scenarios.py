"""Scenarios for tests/test_offload.py, run on every rank of ONE 2-rank gloo group (the session's ``rank_group``).

Each configuration (fp32/bf16, distributed optimizer on/off) builds two model chunks (TinyMLP of
``_training_scenarios``, one frozen param) wrapped in DDP over both ranks, their optimizer, and a twin of both
that never offloads. ``run_all()`` returns plain data (bools, byte counts, names); the pytest side asserts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from _binding_scenarios import _verify_error
from _training_scenarios import H, _full_weights, _tiny_model, _transformer_config, apply_patches

LR = 1e-2
CYCLES = 10  # offload/reload cycles, a step before each
#: name -> (bf16, distributed optimizer, expert params)
CONFIGS = {"fp32-plain": (False, False, False), "fp32-distopt": (False, True, False),
           "bf16-plain": (True, False, False), "bf16-distopt": (True, True, False),
           "bf16-distopt-expert": (True, True, True)}
EXPERT_PREFIX = "fc2."  # with expert=True, chunk 0's params marked expert (allreduce=False), EP=2


# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------

def _init_parallel(expert: bool = False) -> None:
    from mcore_compat.training._common import parallel_state

    ps = parallel_state()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                 **({"expert_model_parallel_size": 2} if expert else {}))


def _core(chunk: Any) -> Any:
    from mcore_compat.layout.read import unwrap

    return unwrap(chunk)


def _build(bf16: bool, distopt: bool, expert: bool = False) -> tuple[list[Any], Any]:
    """Two DDP-wrapped TinyMLP chunks (the second's fc2.bias frozen; with ``expert``, the first's fc2 params
    expert-parallel) and their optimizer."""
    import torch

    from mcore_compat import training as mt

    dtype = torch.bfloat16 if bf16 else torch.float32
    modules = [_tiny_model(_transformer_config(1, bf16)) for _ in range(2)]
    full = _full_weights()
    with torch.no_grad():
        for i, m in enumerate(modules):
            for name, p in m.named_parameters():
                p.copy_((full[name] * (1 + i)).to(dtype))
                if expert and i == 0 and name.startswith(EXPERT_PREFIX):
                    setattr(p, "allreduce", False)  # Megatron's mark of expert-parallel params
    modules[1].fc2.bias.requires_grad_(False)
    for i, m in enumerate(modules):  # module state that is not a parameter (a rotary table, router statistics)
        m.register_buffer("stat", torch.arange(H, dtype=torch.float32) * (i + 1))
        m.register_buffer("table", torch.linspace(0, 1, 2 * H, dtype=dtype), persistent=False)
    chunks = mt.wrap_ddp(modules, ddp_config=mt.DDPConfig(use_distributed_optimizer=distopt,
                                                          grad_reduce_in_fp32=bf16))
    opt = mt.get_megatron_optimizer(
        mt.OptimConfig(lr=LR, weight_decay=0.0, clip_grad=1.0, bf16=bf16, params_dtype=dtype,
                       use_distributed_optimizer=distopt), chunks)
    return chunks, opt


def _step(chunks: list[Any], opt: Any, seed: int) -> bool:
    import torch
    import torch.distributed as dist

    from mcore_compat import training as mt

    mt.zero_grad_buffer(chunks, opt)
    g = torch.Generator().manual_seed(1000 * seed + dist.get_rank())
    dtype = next(_core(chunks[0]).parameters()).dtype
    out = chunks[1](chunks[0](torch.randn(2, 2, H, generator=g).to(dtype)))
    (out.float() - 0.5).square().mean().backward()
    for c in chunks:
        c.finish_grad_sync()
    ok, _, _ = mt.optimizer_step(opt)
    return bool(ok)


def _named_params(chunks: list[Any]) -> dict[str, Any]:
    return {f"chunk{c}.{n}": p for c, ch in enumerate(chunks) for n, p in _core(ch).named_parameters()}


def _expert_buffers(chunks: list[Any]) -> int:
    from mcore_compat.detect import detect
    from mcore_compat.layout.read import ddp_buffers

    return sum(is_expert for chunk in chunks for _, is_expert in ddp_buffers(chunk, detect().version))


def _buffers(chunks: list[Any]) -> list[tuple[str, Any]]:
    """(label, tensor) of every DDP buffer tensor: param_data where there is one, and the flat grads."""
    from mcore_compat.capabilities import fact
    from mcore_compat.detect import detect
    from mcore_compat.layout.read import ddp_buffers

    out = []
    for c, chunk in enumerate(chunks):
        for i, (buffer, _) in enumerate(ddp_buffers(chunk, detect().version)):
            if getattr(buffer, "param_data", None) is not None:
                out.append((f"chunk{c}.buffer{i}.param_data", buffer.param_data))
            out.append((f"chunk{c}.buffer{i}.grads", getattr(buffer, fact("grad_data_attr"))))
    return out


def _opt_tensors(chunks: list[Any], opt: Any) -> list[tuple[str, Any]]:
    """(label, tensor) of the optimizer's main params and state, labelled by model param and range (the order
    of the main params may differ between two builds)."""
    from mcore_compat.selfcheck.optimizer_view import optimizer_view

    names = {p: n for n, p in _named_params(chunks).items()}
    out = []
    for mp in optimizer_view(opt, names):
        label = f"{mp.name}[{mp.start}:{mp.end}]"
        out.append((label, mp.main))
        state = mp.inner.state.get(mp.main, {})
        out.extend((f"{label}.{k}", v) for k, v in sorted(state.items()) if hasattr(v, "untyped_storage"))
    return sorted(out, key=lambda item: item[0])


def _labelled(chunks: list[Any], opt: Any) -> dict[str, list[tuple[str, Any]]]:
    params = list(_named_params(chunks).items())
    grads = [(f"{n}.main_grad", p.main_grad) for n, p in params if getattr(p, "main_grad", None) is not None]
    bufs = _buffers(chunks)
    module_buffers = [(f"chunk{c}.{n}", b) for c, ch in enumerate(chunks) for n, b in _core(ch).named_buffers()]
    return {"params": params + module_buffers + [b for b in bufs if b[0].endswith("param_data")],
            "grads": grads + [b for b in bufs if b[0].endswith("grads")],
            "optimizer_state": _opt_tensors(chunks, opt)}


def _nbytes(chunks: list[Any], opt: Any) -> dict[str, dict[str, int]]:
    return {piece: {n: t.untyped_storage().nbytes() for n, t in items}
            for piece, items in _labelled(chunks, opt).items()}


def _storage_keys(chunks: list[Any], opt: Any) -> dict[str, int]:
    return {n: t.untyped_storage()._cdata for items in _labelled(chunks, opt).values() for n, t in items}


def _aliasing(chunks: list[Any], opt: Any, before: dict[str, int]) -> list[str]:
    """What no longer aliases what it did (storage objects replaced), and params / main_grads that are not in
    DDP's buffers (where the release puts them there)."""
    from mcore_compat.capabilities import fact

    problems = [n for n, key in _storage_keys(chunks, opt).items() if before.get(n) != key]
    buffer_keys = {t.untyped_storage()._cdata for _, t in _buffers(chunks)}
    for name, p in _named_params(chunks).items():
        if not getattr(p, "allreduce", True) and not fact("expert_buffers"):
            continue  # 0.4/0.5: an expert param's main_grad is a tensor of its own
        if p.requires_grad and getattr(p, "main_grad", None) is not None \
                and p.main_grad.untyped_storage()._cdata not in buffer_keys:
            problems.append(f"{name}.main_grad outside the grad buffer")
    return problems


def _partial_state(chunks: list[Any], opt: Any) -> dict[str, bool]:
    """Params (and main params that are the params themselves, fp32) resident; grads and the rest of the
    optimizer state freed."""
    items = _labelled(chunks, opt)
    param_keys = {t.untyped_storage()._cdata for _, t in items["params"]}
    own_state = [t for _, t in items["optimizer_state"] if t.untyped_storage()._cdata not in param_keys]
    return {"params_resident": all(t.untyped_storage().nbytes() for _, t in items["params"]),
            "rest_freed": bool(own_state) and not any(t.untyped_storage().nbytes()
                                                      for t in own_state + [t for _, t in items["grads"]])}


def _clone_all(chunks: list[Any], opt: Any) -> dict[str, Any]:
    return {f"{piece}:{n}": t.detach().clone() for piece, items in _labelled(chunks, opt).items()
            for n, t in items}


def _differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    import torch

    return sorted(n for n in a if n not in b or not torch.equal(a[n], b[n]))


def _twin_differences(a: tuple[list[Any], Any], b: tuple[list[Any], Any]) -> list[str]:
    """Params, main grads and optimizer state of run ``a`` that differ from its twin ``b``."""
    return _differences(_clone_all(*a), _clone_all(*b))


def _host_ptrs() -> dict[str, Any]:
    """The host buffers in use: their addresses (sorted: a storage re-created every step - a main param's
    ``.grad`` - gets a new key but the spare buffer of the one it replaced), each slot's allocation count, and the
    process's allocation count."""
    from mcore_compat.lifecycle._host import allocations, buffers, slots

    live = [s for s in slots() if s.host is not None]
    return {"ptrs": sorted(h.data_ptr() for h in buffers()),
            "per_slot": [s.allocations for s in live], "allocations": allocations(), "buffers": len(live)}


# ----------------------------------------------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------------------------------------------

def case_cycles(bf16: bool, distopt: bool, expert: bool = False) -> dict[str, Any]:
    """Offload everything, check it is freed, reload, check nothing is lost or detached; then CYCLES cycles
    (full, then grads + optimizer only, then full, ...) interleaved with steps, against a twin."""
    import torch

    import mcore_compat as mc
    from mcore_compat.binding import bind_params

    _init_parallel(expert)
    run, twin = _build(bf16, distopt, expert), _build(bf16, distopt, expert)
    chunks, opt = run
    binding = bind_params(chunks)
    initial = {n: p.detach().clone() for n, p in _named_params(chunks).items()}
    ok = all([_step(*run, seed=0), _step(*twin, seed=0)])
    keys = _storage_keys(chunks, opt)
    before = _clone_all(chunks, opt)
    moved = mc.offload(chunks, opt)
    after_offload = _nbytes(chunks, opt)
    first_ptrs = _host_ptrs()
    back = mc.reload(chunks, opt)
    result: dict[str, Any] = {
        "status": "ok", "update_successful": ok,
        "moved": {"params": moved.params, "grads": moved.grads, "optimizer_state": moved.optimizer_state},
        "reloaded": {"params": back.params, "grads": back.grads, "optimizer_state": back.optimizer_state},
        "not_freed": sorted(f"{piece}:{n}" for piece, sizes in after_offload.items() for n, b in sizes.items()
                            if b),
        "counted": {piece: len(sizes) for piece, sizes in after_offload.items()},
        "expert_buffers": _expert_buffers(chunks),
        "changed_by_cycle": _differences(before, _clone_all(chunks, opt)),
        "alias_problems": _aliasing(chunks, opt, keys),
        "verify_error": _verify_error(binding),
    }
    ptrs, partial = [], []
    for cycle in range(CYCLES):
        ok = all([_step(*run, seed=cycle + 1), _step(*twin, seed=cycle + 1)]) and ok
        keep_params = cycle % 2 == 1
        with mc.offloaded(chunks, opt, params=not keep_params):
            if keep_params:
                partial.append(_partial_state(chunks, opt))
            ptrs.append(_host_ptrs())
    result.update({
        "update_successful_cycles": ok,
        "twin_differences": _twin_differences(run, twin),
        "alias_problems_cycles": _aliasing(chunks, opt, keys),
        "verify_error_cycles": _verify_error(binding),
        "partial": partial,
        "host_ptrs_stable": all(p["ptrs"] == first_ptrs["ptrs"] and p["allocations"] == first_ptrs["allocations"]
                                for p in ptrs),
        "host_allocations": max((a for p in ptrs for a in p["per_slot"]), default=0),
        "host_buffers": first_ptrs["buffers"],
        "host_bytes": mc.lifecycle.host_bytes(),
    })
    ok = all([_step(*run, seed=100), _step(*twin, seed=100)])
    result["twin_differences_after"] = _twin_differences(run, twin) if ok else ["step failed"]
    result["trained"] = {n: not torch.equal(initial[n], p.detach()) for n, p in _named_params(chunks).items()}
    return result


def case_fault(bf16: bool, distopt: bool) -> dict[str, Any]:
    """A reload that gives the params new storage (the host bytes copied into new memory, ``param.data`` rebound:
    what hand-written offload code does) instead of refilling theirs; the buffers are refilled, so training runs.
    The checks of ``case_cycles`` must catch it."""
    import mcore_compat as mc
    from mcore_compat.binding import bind_params
    from mcore_compat.selfcheck.offload_cycle import _Injected  # the self-check's injector of the same fault

    _init_parallel()
    run, twin = _build(bf16, distopt), _build(bf16, distopt)
    chunks, opt = run
    binding = bind_params(chunks)
    _step(*run, seed=0), _step(*twin, seed=0)
    keys = _storage_keys(chunks, opt)
    with _Injected("reload_recreates_storage"):
        mc.offload(chunks, opt)
        mc.reload(chunks, opt)
    out: dict[str, Any] = {"status": "ok", "alias_problems": _aliasing(chunks, opt, keys),
                           "verify_error": _verify_error(binding)}
    for seed in range(1, 4):
        _step(*run, seed=seed), _step(*twin, seed=seed)
    out["twin_differences"] = _twin_differences(run, twin)
    return out


def cases() -> dict[str, Callable[[], dict[str, Any]]]:
    """Every case, by name, in the order they run."""
    out: dict[str, Callable[[], dict[str, Any]]] = {}
    for name, (bf16, distopt, expert) in CONFIGS.items():
        out[f"cycles-{name}"] = functools.partial(case_cycles, bf16, distopt, expert)
    out["fault-fp32-distopt"] = lambda: case_fault(False, True)
    out["fault-fp32-plain"] = lambda: case_fault(False, False)
    return out


CASE_NAMES = list(cases())


def run_all() -> dict[str, Any]:
    """Every case on this rank: ``{"version": str, "cases": {name: result}}``."""

    apply_patches()
    from mcore_compat.detect import detect

    version = str(detect().version)
    results: dict[str, Any] = {}
    from _case_groups import run_case

    for name, fn in cases().items():
        results[name] = run_case(fn)
    from mcore_compat.training._common import parallel_state

    parallel_state().destroy_model_parallel()
    return {"version": version, "cases": results}
