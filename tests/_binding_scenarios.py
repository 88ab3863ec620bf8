"""Scenarios for tests/test_binding.py, run on every rank of ONE 2-rank gloo group by ``launch.spawn``.

``run_all()`` builds small Megatron-Core models (DDP over both ranks, or PP=2), binds their parameters with
``mcore_compat.binding`` and returns plain data (bools, names, error texts, lists); the pytest side asserts.
The model and patches are those of ``_training_scenarios.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from _training_scenarios import F, H, _full_weights, _tiny_model, _transformer_config, apply_patches

LR = 1e-2


# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------

def _ps() -> Any:
    from mcore_compat.training._common import parallel_state

    return parallel_state()


def _init_parallel(pp: int = 1) -> None:
    ps = _ps()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=pp)


def _core(chunk: Any) -> Any:
    from mcore_compat.layout.read import unwrap

    return unwrap(chunk)


def _build(distopt: bool, bf16: bool = False, optimizer: bool = True, module: Any = None) -> tuple[list[Any], Any]:
    """DDP-wrapped TinyMLP (the weights of _training_scenarios) and, optionally, its optimizer."""
    import torch

    from mcore_compat import training as mt

    dtype = torch.bfloat16 if bf16 else torch.float32
    if module is None:
        module = _tiny_model(_transformer_config(1, bf16))
        full = _full_weights()
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.copy_(full[name].to(dtype))
    chunks = mt.wrap_ddp([module], ddp_config=mt.DDPConfig(use_distributed_optimizer=distopt,
                                                           grad_reduce_in_fp32=bf16))
    if not optimizer:
        return chunks, None
    return chunks, _optimizer(chunks, distopt, bf16)


def _optimizer(chunks: list[Any], distopt: bool, bf16: bool) -> Any:
    import torch

    from mcore_compat import training as mt

    return mt.get_megatron_optimizer(
        mt.OptimConfig(lr=LR, weight_decay=0.0, clip_grad=1.0, bf16=bf16,
                       params_dtype=torch.bfloat16 if bf16 else torch.float32, use_distributed_optimizer=distopt),
        chunks)


def _step(chunks: list[Any], optimizer: Any, in_dim: int = H, seed: int = 0) -> bool:
    """One local forward/backward per rank (different data per rank), DDP grad sync, optimizer step."""
    import torch
    import torch.distributed as dist

    from mcore_compat import training as mt

    mt.zero_grad_buffer(chunks, optimizer)
    g = torch.Generator().manual_seed(1000 * seed + dist.get_rank())
    dtype = next(_core(chunks[0]).parameters()).dtype
    x = torch.randn(2, 2, in_dim, generator=g).to(dtype)
    out = chunks[0](x)
    loss = (out.float() - 0.5).square().mean()
    loss.backward()
    for c in chunks:
        c.finish_grad_sync()
    ok, _, _ = mt.optimizer_step(optimizer)
    return bool(ok)


def _snapshot(chunks: list[Any]) -> dict[str, Any]:
    return {n: p.detach().clone() for n, p in _core(chunks[0]).named_parameters()}


def _changed(before: dict[str, Any], chunks: list[Any]) -> dict[str, bool]:
    import torch

    return {n: not torch.equal(before[n], p.detach()) for n, p in _core(chunks[0]).named_parameters()}


def _buffer_matches_model(binding: Any, chunks: list[Any]) -> bool:
    import torch

    views = binding.named_views()
    flats = binding.flat_buffers()
    manifest = binding.manifest()
    model = dict(_core(chunks[0]).named_parameters())
    by_manifest = all(
        torch.equal(flats[e.buffer][e.offset:e.offset + e.numel].view(e.shape), model[e.name].detach())
        for e in manifest.params)
    by_readme = _readme_consumer(manifest.to_json(), flats)
    return (by_manifest and set(views) == set(model) and all(torch.equal(views[n], model[n].detach()) for n in model)
            and set(by_readme) == set(model) and all(torch.equal(by_readme[n], model[n].detach()) for n in model))


def _readme_consumer(text: str, buffers: list[Any]) -> dict[str, Any]:
    """Run docs/binding.md's manifest consumer (the python block after "A consumer in plain torch") on a manifest's
    JSON text and the flat buffers: a consumer written only from the documentation must load the weights."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "docs" / "binding.md").read_text(encoding="utf-8")
    block = readme.split("A consumer in plain torch", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, Any] = {"text": text, "buffers": buffers}
    exec(compile(block, "docs/binding.md (manifest consumer)", "exec"), namespace)
    return namespace["weights"]


def _verify_error(binding: Any) -> str | None:
    from mcore_compat.binding import BindingError

    try:
        binding.verify()
        return None
    except BindingError as exc:
        return str(exc)


def _as_lists(chunks: list[Any]) -> dict[str, Any]:
    return {n: p.detach().float().tolist() for n, p in _core(chunks[0]).named_parameters()}


# ----------------------------------------------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------------------------------------------

def case_raw_rebind_distopt() -> dict[str, Any]:
    """Raw Megatron, distributed optimizer, DP=2: rebind param.data to an outside flat buffer after the optimizer
    is built (what RL frameworks did), then step."""
    import torch

    from mcore_compat.layout import layout_of

    _init_parallel()
    chunks, opt = _build(distopt=True)
    if not all(b.has_param_data for b in layout_of(chunks).buffers):
        return {"status": "n/a", "why": "no DDP param buffer in this release"}
    params = list(_core(chunks[0]).parameters())
    outside = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype)
    offset = 0
    for p in params:  # the buggy pattern: param.data -> view of a buffer Megatron does not know
        n = p.numel()
        outside[offset:offset + n].copy_(p.data.reshape(-1))
        p.data = outside[offset:offset + n].view_as(p.data)
        offset += n
    param_data_before = [b.param_data.clone() for b in chunks[0].buffers]
    before = _snapshot(chunks)
    ok = _step(chunks, opt)
    changed = _changed(before, chunks)
    return {"status": "ok", "update_successful": ok, "changed": changed,
            "param_data_changed": any(not torch.equal(a, b.param_data)
                                      for a, b in zip(param_data_before, chunks[0].buffers, strict=True))}


def _bind_step(distopt: bool, bf16: bool, bind_before_optimizer: bool) -> dict[str, Any]:
    from mcore_compat.binding import bind_params

    _init_parallel()
    chunks, _ = _build(distopt=distopt, bf16=bf16, optimizer=False)
    binding = None
    if bind_before_optimizer:
        binding = bind_params(chunks)
    opt = _optimizer(chunks, distopt, bf16)
    if binding is None:
        binding = bind_params(chunks)
    before = _snapshot(chunks)
    ok = _step(chunks, opt)
    ok = _step(chunks, opt, seed=1) and ok
    return {"status": "ok", "mode": binding.mode, "update_successful": ok, "changed": _changed(before, chunks),
            "buffer_matches_model": _buffer_matches_model(binding, chunks), "verify_error": _verify_error(binding),
            "params": _as_lists(chunks), "n_flat": len(binding.flat_buffers())}


def case_faults(distopt: bool) -> dict[str, Any]:
    """verify() against three broken bindings: an outside rebind, a moved param, two params swapped."""
    import torch

    from mcore_compat.binding import bind_params

    _init_parallel()
    chunks, _ = _build(distopt=distopt, optimizer=False)
    binding = bind_params(chunks)
    model = dict(_core(chunks[0]).named_parameters())
    views = binding.named_views()
    out: dict[str, Any] = {"status": "ok", "mode": binding.mode, "clean": _verify_error(binding)}

    def restore() -> None:
        for n, p in model.items():
            p.data = views[n]

    # 1. one param rebound to private storage
    model["fc1.bias"].data = model["fc1.bias"].data.clone()
    out["outside"] = _verify_error(binding)
    restore()
    # 2. one param moved to another offset of its own flat buffer
    entry = next(e for e in binding.manifest().params if e.name == "fc2.bias")
    flat = binding.flat_buffers()[entry.buffer]
    shifted = entry.offset + 1 if entry.offset + 1 + entry.numel <= flat.numel() else entry.offset - 1
    model["fc2.bias"].data = flat[shifted:shifted + entry.numel].view(entry.shape)
    out["moved"] = _verify_error(binding)
    restore()
    # 3. fc1.weight (16x8) and fc2.weight (8x16) swapped: each at the other's place
    w1, w2 = model["fc1.weight"], model["fc2.weight"]
    v1, v2 = views["fc1.weight"], views["fc2.weight"]
    w1.data, w2.data = v2.reshape(w1.shape), v1.reshape(w2.shape)
    out["swapped"] = _verify_error(binding)
    restore()
    out["restored"] = _verify_error(binding)
    # 4. a parameter object replaced in the module
    old = _core(chunks[0]).fc1.bias
    _core(chunks[0]).fc1.bias = torch.nn.Parameter(old.detach().clone())
    out["replaced"] = _verify_error(binding)
    _core(chunks[0]).fc1.bias = old
    return out


def case_unbind(distopt: bool) -> dict[str, Any]:
    """bind -> 2 steps -> unbind: weights and state_dict unchanged, private storage, training goes on."""
    import torch

    from mcore_compat.binding import BindingError, bind_params

    _init_parallel()
    chunks, _ = _build(distopt=distopt, optimizer=False)
    opt = _optimizer(chunks, distopt, False)
    core = _core(chunks[0])
    initial = _snapshot(chunks)
    with bind_params(chunks) as binding:
        _step(chunks, opt)
        _step(chunks, opt, seed=1)
        mode = binding.mode
        flat_ptrs = {f.untyped_storage().data_ptr() for f in binding.flat_buffers()}
        sd_before = _clone_sd(core.state_dict())
        weights_before = _snapshot(chunks)
        core.load_state_dict(_clone_sd(sd_before))  # loads in place: the binding must survive it
        bound_load_verify = _verify_error(binding)
        bound_load_diff = _sd_diff(sd_before, _clone_sd(core.state_dict()))
    after = _snapshot(chunks)
    storages = [p.untyped_storage() for p in core.parameters()]
    private = (len({s.data_ptr() for s in storages}) == len(storages)
               and all(s.nbytes() == p.numel() * p.element_size() for s, p in zip(storages, core.parameters(),
                                                                                    strict=True)))
    in_flats = [n for n, p in core.named_parameters() if p.untyped_storage().data_ptr() in flat_ptrs]
    sd_after = _clone_sd(core.state_dict())
    core.load_state_dict(_clone_sd(sd_after))
    sd_round = _clone_sd(core.state_dict())
    try:
        binding.named_views()
        after_unbind_error = None
    except BindingError as exc:
        after_unbind_error = str(exc)
    moved = _changed(after, chunks)
    _step(chunks, opt, seed=2)
    return {
        "status": "ok", "mode": mode, "bound_after_exit": binding.bound,
        "trained": any(not torch.equal(initial[n], weights_before[n]) for n in initial),
        "weights_preserved": all(torch.equal(weights_before[n], after[n]) for n in after),
        "state_dict_diff": _sd_diff(sd_before, sd_after),
        "state_dict_round_trip_diff": _sd_diff(sd_after, sd_round),
        "bound_load_verify": bound_load_verify, "bound_load_diff": bound_load_diff,
        "moved_by_unbind": any(moved.values()),
        "private_storage": private, "still_in_flat_buffers": in_flats,
        "after_unbind_error": after_unbind_error,
        "trains_after_unbind": all(_changed(after, chunks).values()),
    }


def _clone_sd(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().clone() if hasattr(v, "detach") else v for k, v in sd.items()}


def _sd_diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Keys whose entries differ (non-tensor entries, e.g. ``_extra_state``, hold no weights: compared by type)."""
    import torch

    if list(a) != list(b):
        return [f"keys {list(a)} != {list(b)}"]
    return [f"{k}: {a[k]!r:.60} != {b[k]!r:.60}" for k in a
            if not (torch.equal(a[k], b[k]) if hasattr(a[k], "detach") else type(a[k]) is type(b[k]))]


def case_refusals() -> dict[str, Any]:
    """Not-wrapped models and reuse_grad_buf_for_mxfp8_param_ag are refused with BindingError."""
    from mcore_compat.binding import BindingError, bind_params

    _init_parallel()
    out: dict[str, Any] = {"status": "ok"}
    module = _tiny_model(_transformer_config(1, False))
    try:
        bind_params([module])
        out["not_wrapped"] = None
    except BindingError as exc:
        out["not_wrapped"] = str(exc)
    chunks, _ = _build(distopt=True, optimizer=False)
    cfg = getattr(chunks[0], "ddp_config", None)
    if cfg is None or not hasattr(cfg, "reuse_grad_buf_for_mxfp8_param_ag"):
        out["mxfp8"] = "n/a"
    else:
        cfg.reuse_grad_buf_for_mxfp8_param_ag = True
        try:
            bind_params(chunks)
            out["mxfp8"] = None
        except BindingError as exc:
            out["mxfp8"] = str(exc)
        cfg.reuse_grad_buf_for_mxfp8_param_ag = False
    return out


#: Parameters the user points into a flat buffer of their own in case_own_buffer (one at storage offset 0).
OWN_BUFFER_PARAMS = ("fc1.weight", "fc2.bias")


def _refusal(fn: Callable[[], Any]) -> str | None:
    """The text of the BindingError that ``fn`` raises (``None``: it returned)."""
    from mcore_compat.binding import BindingError

    try:
        fn()
        return None
    except BindingError as exc:
        return str(exc)


def case_own_buffer(distopt: bool) -> dict[str, Any]:
    """A user points some params of a DDP-wrapped model into a flat buffer of their own (values copied), then
    calls bind_params: refused, naming them, nothing changed, the buffer still aliases them. Then a clean model
    (with one param registered twice: tied) binds, a second bind of it is refused while the first one holds the
    params (allocated) and succeeds after unbind(); zero-copy bindings coexist."""
    import torch

    from mcore_compat.binding import bind_params

    _init_parallel()
    chunks, _ = _build(distopt=distopt)
    model = dict(_core(chunks[0]).named_parameters())
    mine = [model[n] for n in OWN_BUFFER_PARAMS]
    offsets = [0, mine[0].numel() + 3]  # the first at storage offset 0 of a larger buffer, a gap, the second
    user_flat = torch.zeros(offsets[1] + mine[1].numel(), dtype=mine[0].dtype)
    for p, o in zip(mine, offsets, strict=True):  # the pattern of the report: p.data = my_flat[o:o+n].view(shape)
        user_flat[o:o + p.numel()].copy_(p.data.reshape(-1))
        p.data = user_flat[o:o + p.numel()].view(p.shape)
    ptrs = {n: p.data_ptr() for n, p in model.items()}
    values = {n: p.detach().clone() for n, p in model.items()}
    refused = _refusal(lambda: bind_params(chunks))
    out: dict[str, Any] = {
        "status": "ok", "refused": refused,
        "ptrs_unchanged": {n: p.data_ptr() == ptrs[n] for n, p in model.items()},
        "values_unchanged": {n: torch.equal(p.detach(), values[n]) for n, p in model.items()},
        "user_buffer_aliases": all(
            p.data_ptr() == user_flat[o:].data_ptr() and torch.equal(p.detach().reshape(-1),
                                                                      user_flat[o:o + p.numel()])
            for p, o in zip(mine, offsets, strict=True)),
    }
    # a clean model, with fc1.weight registered a second time (a tied parameter: one Parameter, two names)
    clean, _ = _build(distopt=distopt, optimizer=False)
    core = _core(clean[0])
    core.tied = core.fc1.weight
    first = bind_params(clean)
    out["clean_mode"] = first.mode
    out["clean_names"] = [e.name for e in first.manifest().params]
    second_ptrs = {n: p.data_ptr() for n, p in core.named_parameters()}
    out["second"] = _refusal(lambda: bind_params(clean))
    out["second_ptrs_unchanged"] = all(p.data_ptr() == second_ptrs[n] for n, p in core.named_parameters())
    out["first_verify"] = _verify_error(first)
    first.unbind()
    third = bind_params(clean)
    out["after_unbind_mode"] = third.mode
    out["after_unbind_verify"] = _verify_error(third)
    third.unbind()
    return out


def _stage_model(stage: int) -> Any:
    """Pipeline stage ``stage`` of a 3-layer MLP: stage 0 = ``fc1``; stage 1 = ``fc2`` and ``head``."""
    import importlib

    import torch

    from mcore_compat import symbols

    config = _transformer_config(1, False)
    megatron_module = symbols.resolve("MegatronModule")
    column = symbols.resolve("ColumnParallelLinear")
    row = symbols.resolve("RowParallelLinear")

    class Stage(megatron_module):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__(config=config)
            self.model_type = importlib.import_module("megatron.core.enums").ModelType.encoder_or_decoder
            init = torch.nn.init.zeros_
            if stage == 0:
                self.fc1 = column(H, F, config=config, init_method=init, bias=True, gather_output=False)
            else:
                self.fc2 = row(F, H, config=config, init_method=init, bias=True, input_is_parallel=True,
                               skip_bias_add=False)
                self.head = column(H, 4, config=config, init_method=init, bias=False, gather_output=True)

        def set_input_tensor(self, tensor: Any) -> None:
            self.input_tensor = tensor

        def forward(self, x: Any) -> Any:
            if stage == 0:
                return self.fc1(x)[0]
            return self.head(torch.nn.functional.gelu(self.fc2(x)[0]))[0]

    module = Stage()
    g = torch.Generator().manual_seed(77 + stage)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module


def _stage_flats(binding: Any) -> list[Any]:
    """Per stage (collective over all ranks): ``(manifest dict, [flat buffer clones])`` of that stage's binding."""
    import torch.distributed as dist

    stages: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(stages, (binding.manifest().to_dict(), [f.clone() for f in binding.flat_buffers()]))
    return stages


def _flat_result_check(got: list[Any], expected: list[Any], me: int, binding: Any) -> dict[str, Any]:
    """Compare gather_pipeline_flat's answer with every stage's (manifest, flat buffers)."""
    import torch

    from mcore_compat.binding import Manifest, StageBuffers

    mine = binding.flat_buffers()
    return {
        "stages": [sb.stage for sb in got],
        "types_ok": all(isinstance(sb, StageBuffers) for sb in got),
        "manifests_equal": [sb.manifest == Manifest.from_dict(expected[sb.stage][0]) for sb in got],
        "buffers_equal": [len(sb.buffers) == len(expected[sb.stage][1])
                          and all(torch.equal(a, b) for a, b in zip(sb.buffers, expected[sb.stage][1], strict=True))
                          for sb in got],
        "own_is_live": all(a is b for sb in got if sb.stage == me for a, b in zip(sb.buffers, mine, strict=True)),
        "views_match": all(
            torch.equal(views[e.name], expected[sb.stage][1][e.buffer][e.offset:e.offset + e.numel].view(e.shape))
            for sb in got for views in [sb.views()] for e in sb.manifest.params),
    }


def case_pipeline(distopt: bool) -> dict[str, Any]:
    """PP=2 over both ranks: step, then gather_pipeline / gather_pipeline_flat on every rank and with dst=0; then
    gather_pipeline_flat(reuse_buffers=True) twice around another step."""
    import torch
    import torch.distributed as dist

    from mcore_compat.binding import bind_params, gather_pipeline, gather_pipeline_flat

    _init_parallel(pp=2)
    ps = _ps()
    stage = ps.get_pipeline_model_parallel_rank()
    chunks, opt = _build(distopt=distopt, module=_stage_model(stage))
    binding = bind_params(chunks)
    before = _snapshot(chunks)
    _step(chunks, opt, in_dim=H if stage == 0 else F)
    changed = _changed(before, chunks)
    mine = {n: p.detach().clone() for n, p in _core(chunks[0]).named_parameters()}
    stages: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(stages, mine)
    expected = {f"stage{s}.{n}": t for s, named in enumerate(stages) for n, t in named.items()}

    from mcore_compat.binding import BindingError

    try:
        gather_pipeline(binding, dst=2)
        bad_dst = None
    except BindingError as exc:
        bad_dst = str(exc)
    calls: dict[str, int] = {}
    originals: dict[str, Callable[..., Any]] = {}

    def counting(name: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] = calls.get(name, 0) + 1
            return originals[name](*args, **kwargs)
        return wrapper

    for name in ("broadcast", "send", "recv", "all_gather_object"):
        originals[name] = getattr(dist, name)
        setattr(dist, name, counting(name))
    try:
        got_all = gather_pipeline(binding)
        calls_all = dict(calls)
        calls.clear()
        got_all_again = gather_pipeline(binding)
        calls_again = dict(calls)
        calls.clear()
        got_dst = gather_pipeline(binding, dst=0)
        calls_dst = dict(calls)
        calls.clear()
        got_flat = gather_pipeline_flat(binding)
        calls_flat = dict(calls)
        calls.clear()
        got_flat_dst = gather_pipeline_flat(binding, dst=0)
        calls_flat_dst = dict(calls)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    n_flat = len(binding.flat_buffers())
    flats_per_stage: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flats_per_stage, n_flat)

    def same(got: dict[str, Any]) -> bool:
        return list(got) == list(expected) and all(torch.equal(got[k], expected[k]) for k in expected)

    out = {"status": "ok", "stage": stage, "mode": binding.mode, "changed": changed,
           "all_equal": same(got_all), "again_equal": same(got_all_again), "keys": list(got_all),
           "expected_keys": list(expected), "dst_keys": list(got_dst),
           "dst_equal": same(got_dst) if got_dst else None,
           "calls_all": calls_all, "calls_again": calls_again, "calls_dst": calls_dst,
           "flats_per_stage": flats_per_stage, "bad_dst": bad_dst,
           "calls_flat": calls_flat, "calls_flat_dst": calls_flat_dst}
    stage_flats = _stage_flats(binding)
    flat = _flat_result_check(got_flat, stage_flats, stage, binding)
    flat_dst = _flat_result_check(got_flat_dst, stage_flats, stage, binding)
    # reuse_buffers=True: same receive tensors on the next call, overwritten with the new weights.
    first = gather_pipeline_flat(binding, reuse_buffers=True)
    first_ids = [[(id(t), t.data_ptr()) for t in sb.buffers] for sb in first]
    first_copies = [[t.clone() for t in sb.buffers] for sb in first]
    _step(chunks, opt, in_dim=H if stage == 0 else F, seed=1)
    second = gather_pipeline_flat(binding, reuse_buffers=True)
    fresh = gather_pipeline_flat(binding)
    stage_flats_after = _stage_flats(binding)
    other = [i for i, sb in enumerate(second) if sb.stage != stage]
    reuse = {
        "after_step": _flat_result_check(second, stage_flats_after, stage, binding),
        "same_objects": [[(id(t), t.data_ptr()) for t in sb.buffers] for sb in second] == first_ids
        and all(a is b for i in other for a, b in zip(first[i].buffers, second[i].buffers, strict=True)),
        "first_overwritten": all(not torch.equal(a, b) for i in other
                                 for a, b in zip(first[i].buffers, first_copies[i], strict=True)),
        "fresh_is_new": all(a.data_ptr() != b.data_ptr() for i in other
                            for a, b in zip(fresh[i].buffers, second[i].buffers, strict=True)),
        "n_other_buffers": sum(len(second[i].buffers) for i in other),
    }
    out.update(flat=flat, flat_dst=flat_dst, reuse=reuse)
    _init_parallel()
    return out


def case_two_chunks(distopt: bool) -> dict[str, Any]:
    """Two model chunks (as with virtual pipelining), one frozen parameter, and the dtype filter."""
    import torch

    from mcore_compat import training as mt
    from mcore_compat.binding import bind_params

    _init_parallel()
    modules = [_tiny_model(_transformer_config(1, False)) for _ in range(2)]
    full = _full_weights()
    with torch.no_grad():
        for m in modules:
            for name, p in m.named_parameters():
                p.copy_(full[name])
    modules[1].fc2.bias.requires_grad_(False)
    chunks = mt.wrap_ddp(modules, ddp_config=mt.DDPConfig(use_distributed_optimizer=distopt))
    opt = _optimizer(chunks, distopt, False)
    binding = bind_params(chunks)
    before = {f"chunk{c}.{n}": p.detach().clone() for c, ch in enumerate(chunks)
              for n, p in _core(ch).named_parameters()}
    mt.zero_grad_buffer(chunks, opt)
    g = torch.Generator().manual_seed(5)
    out = chunks[1](chunks[0](torch.randn(2, 2, H, generator=g)))
    out.square().mean().backward()
    for c in chunks:
        c.finish_grad_sync()
    ok, _, _ = mt.optimizer_step(opt)
    model = {f"chunk{c}.{n}": p for c, ch in enumerate(chunks) for n, p in _core(ch).named_parameters()}
    views = binding.named_views()
    manifest = binding.manifest()
    none = bind_params(chunks, dtype=torch.bfloat16)
    return {
        "status": "ok", "mode": binding.mode, "update_successful": bool(ok),
        "names": list(views), "unbound": list(binding.unbound),
        "changed": {n: not torch.equal(before[n], p.detach()) for n, p in model.items()},
        "views_match": all(torch.equal(views[n], model[n].detach()) for n in views),
        "buffer_chunks": [b.chunk for b in manifest.buffers], "verify_error": _verify_error(binding),
        "bf16_only": len(none), "bf16_only_unbound": len(none.unbound), "bf16_only_mode": none.mode,
    }


def cases() -> dict[str, Callable[[], dict[str, Any]]]:
    """Every case, by name, in the order they run."""
    return {
        "raw-rebind-distopt": case_raw_rebind_distopt,
        "bind-distopt-fp32-after": lambda: _bind_step(True, False, False),
        "bind-distopt-bf16-after": lambda: _bind_step(True, True, False),
        "bind-plain-fp32-after": lambda: _bind_step(False, False, False),
        "bind-plain-bf16-after": lambda: _bind_step(False, True, False),
        "bind-plain-fp32-before": lambda: _bind_step(False, False, True),
        "faults-plain": lambda: case_faults(False),
        "faults-distopt": lambda: case_faults(True),
        "unbind-plain": lambda: case_unbind(False),
        "unbind-distopt": lambda: case_unbind(True),
        "refusals": case_refusals,
        "own-buffer-plain": lambda: case_own_buffer(False),
        "own-buffer-distopt": lambda: case_own_buffer(True),
        "two-chunks-plain": lambda: case_two_chunks(False),
        "two-chunks-distopt": lambda: case_two_chunks(True),
        "pipeline-distopt": lambda: case_pipeline(True),
        "pipeline-plain": lambda: case_pipeline(False),
    }


CASE_NAMES = list(cases())


def run_all() -> dict[str, Any]:
    """Every case on this rank: ``{"version": str, "patches": [...], "cases": {name: result}}``."""

    patches = apply_patches()
    from mcore_compat.detect import detect

    version = str(detect().version)
    results: dict[str, Any] = {}
    from _case_groups import run_case

    for name, fn in cases().items():
        results[name] = run_case(fn)
    _ps().destroy_model_parallel()  # the session's ranks run other modules next
    return {"version": version, "patches": patches, "cases": results}
