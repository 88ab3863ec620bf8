"""What one rank of the self-check does: build, train a few steps through mcore_compat, and prove every step
(:class:`~.verify.StepVerifier`: gradients against a plain-autograd reference, updates against the optimizer's
rule, model params against the main params, replicas), plus the settings-specific checks: hooks installed,
param groups as configured (weight decay off for biases and norms, the learning rate), params still in DDP's
buffer, the binding and the pipeline gather; with ``offload_cycles``, offload/reload cycles between the steps
(:mod:`.offload_cycle`)."""

from __future__ import annotations

import platform
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .._util.optimizer_view import optimizer_view
from .._util.own_math import own_tensor_math
from ..launch import gather_objects
from . import models, progress
from .configured import from_options
from .full_gather import gather_full_check, inject_wrong_stride
from .independent import IndependentReference
from .offload_cycle import OffloadCycles
from .options import SelfCheckOptions
from .report import Check
from .verify import StepVerifier, named_trainable

__all__ = ["run_rank"]


def _prepare(opts: SelfCheckOptions) -> list[str]:
    """Apply the patches this run needs (once per process); returns every patch applied in this process."""
    from .. import patches

    patches.apply_for_device(opts.device or "cpu")
    return patches.applied()


def _core(module: Any) -> Any:
    """Strip DDP / Float16Module wrappers."""
    from .wrappers import core_module

    return core_module(module)


def _rebind_outside(module: Any) -> None:
    """The RL-framework pattern behind the frozen-weights bug: every ``param.data`` becomes a view of one
    separately allocated flat buffer (values copied). Used only by the fault injections."""
    import torch

    params = list(_core(module).parameters())
    flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    offset = 0
    for p in params:
        n = p.numel()
        flat[offset:offset + n].copy_(p.data.reshape(-1))
        p.data = flat[offset:offset + n].view_as(p.data)
        offset += n


def no_decay(name: str, param: Any) -> bool:
    """Megatron-LM's default no-weight-decay rule: biases and 1-D params (norms)."""
    return name.endswith(".bias") or param.dim() == 1


def _param_groups_check(view: Any, opts: SelfCheckOptions) -> Check:
    """Every main param's group has the configured learning rate and its effective weight decay (0 for biases
    and norms, ``opts.weight_decay`` otherwise), betas and eps (as Megatron-LM's scheduler sets the groups)."""
    if view.unsupported:
        return Check.not_applicable("param_groups_as_configured", f"optimizer not readable: {view.unsupported}")
    wrong: list[str] = []
    lr = 0.0 if opts.fault == "lr_zero" else opts.lr
    for mp in view:
        g = mp.group
        if g is None:
            wrong.append(f"{mp.name}: in no param group")
            continue
        want_wd = 0.0 if no_decay(mp.name, mp.model) else opts.weight_decay
        if float(g["lr"]) != lr:
            wrong.append(f"{mp.name}: lr {g['lr']:g}, configured {lr:g}")
        if float(g.get("weight_decay", 0.0)) != want_wd:
            wrong.append(f"{mp.name}: weight decay {g.get('weight_decay', 0.0):g}, configured {want_wd:g}")
        if "betas" in g and tuple(float(b) for b in g["betas"]) != (0.9, 0.999):
            wrong.append(f"{mp.name}: betas {tuple(g['betas'])}, configured (0.9, 0.999)")
        if "eps" in g and float(g["eps"]) != 1e-8:
            wrong.append(f"{mp.name}: eps {g['eps']:g}, configured 1e-08")
    n_decay = sum(1 for mp in view if not no_decay(mp.name, mp.model))
    detail = (f"{len(view.params)} main params: lr {lr:g}; weight decay {opts.weight_decay:g} on {n_decay}, 0 on "
              f"the {len(view.params) - n_decay} biases/norms")
    if wrong:
        unique = sorted(set(wrong))
        detail = f"{len(unique)} mismatch(es): " + "; ".join(unique[:4])
    return Check("param_groups_as_configured", not wrong, detail, {"mismatches": sorted(set(wrong))})


def _buffer_alias_check(chunks: list[Any]) -> Check | None:
    """With a parameter buffer (0.6+ distributed optimizer): every param still lives at its buffer offset."""
    bad, total = [], 0
    for chunk in chunks:
        buffers = [b for attr in ("buffers", "expert_parallel_buffers")  # 0.4/0.5: `buffers` is nn.Module's method
                   if isinstance(getattr(chunk, attr, None), (list, tuple)) for b in getattr(chunk, attr)]
        names = {p: n for n, p in _core(chunk).named_parameters()}
        for buf in buffers:
            data = getattr(buf, "param_data", None)
            if data is None:
                continue
            for p, (start, _end, _bucket) in buf.param_index_map.items():
                total += 1
                if p.data.data_ptr() != data[start:].data_ptr():
                    bad.append(names.get(p, "?"))
    if total == 0:
        return None
    return Check("params_in_ddp_buffer", not bad,
                 f"{total - len(bad)}/{total} parameters alias DDP's param buffer" +
                 (f"; not aliased: {', '.join(bad[:5])}" if bad else ""), {"not_aliased": bad})


def _bind(chunks: list[Any], checks: list[Check]) -> Any:
    """``bind_params`` on the wrapped chunks; a refusal becomes a failed ``binding_verified`` check."""
    from ..binding import BindingError, bind_params

    try:
        return bind_params(chunks)
    except BindingError as exc:
        checks.append(Check("binding_verified", False, f"bind_params refused: {exc}"))
        return None


@own_tensor_math
def _binding_checks(binding: Any, chunks: list[Any]) -> list[Check]:
    """After the steps: the binding still verifies, and its flat-buffer views equal the model's weights."""
    import torch

    from ..binding import BindingError

    try:
        binding.verify()
        verified = Check("binding_verified", True, f"{len(binding)} parameters at their offsets of "
                         f"{len(binding.flat_buffers())} flat buffer(s) ({binding.mode})")
    except BindingError as exc:
        verified = Check("binding_verified", False, " ".join(ln.strip() for ln in str(exc).splitlines()[:2]))
    params: dict[str, Any] = {}
    for i, chunk in enumerate(chunks):
        for n, p in _core(chunk).named_parameters():
            params[n if len(chunks) == 1 else f"chunk{i}.{n}"] = p
    views = binding.named_views()
    stale = [n for n, v in views.items() if not torch.equal(v, params[n].detach())]
    current = Check("bound_buffer_current", not stale,
                    f"{len(views) - len(stale)}/{len(views)} flat-buffer views equal the model's weights after "
                    f"the steps" + (f"; differ from the model: {', '.join(stale[:5])}" if stale else ""),
                    {"stale": stale})
    return [verified, current]


@own_tensor_math
def _pipeline_gather_check(binding: Any, ps: Any) -> Check:
    """``gather_pipeline`` equals every stage's own weights (exchanged tensor by tensor as the reference)."""
    import torch

    from ..binding import gather_pipeline

    group = ps.get_pipeline_model_parallel_group()
    gathered = gather_pipeline(binding, group=group)
    mine = {n: v.detach().cpu().clone() for n, v in binding.named_views().items()}
    stages = gather_objects(mine, group)
    expected = {f"stage{s}.{n}": t for s, d in enumerate(stages) for n, t in d.items()}
    missing = sorted(set(expected) - set(gathered))
    extra = sorted(set(gathered) - set(expected))
    wrong = [n for n in expected if n in gathered and not torch.equal(gathered[n].cpu(), expected[n])]
    ok = not missing and not extra and not wrong
    return Check("pipeline_gather_matches", ok,
                 f"{len(expected) - len(missing) - len(wrong)}/{len(expected)} tensors of {len(stages)} stages "
                 f"equal each stage's weights" + (f"; missing {missing[:3]}" if missing else "") +
                 (f"; unexpected {extra[:3]}" if extra else "") + (f"; differ {wrong[:3]}" if wrong else ""),
                 {"missing": missing, "extra": extra, "differ": wrong})


# ------------------------------------------------------------------------------------------------ faults
def _wrap_finalize(chunks: list[Any], after: Callable[[list[Any]], object],
                   before: Callable[[list[Any]], object] | None = None) -> None:
    """Run ``after(chunks)`` right after the real ``finalize_model_grads`` (where a reduction bug acts)."""
    from .. import symbols

    cfg = symbols.resolve("get_model_config")(chunks[0])
    real = cfg.finalize_model_grads_func

    def finalize(*args: Any, **kwargs: Any) -> None:
        if before is not None:
            before(chunks)
        real(*args, **kwargs)
        after(chunks)

    cfg.finalize_model_grads_func = finalize


def _main_grads(chunks: list[Any]) -> list[tuple[str, Any]]:
    return [(n, p.main_grad) for c in chunks for n, p in _core(c).named_parameters()
            if getattr(p, "main_grad", None) is not None]


def _inject_grad_fault(opts: SelfCheckOptions, chunks: list[Any], ps: Any) -> None:
    import torch

    fault = opts.fault
    if fault == "negate_norm_grads":  # wrong direction for a subset: the norms' gradients
        def negate(cs: list[Any]) -> None:
            for n, g in _main_grads(cs):
                if "norm" in n:
                    g.neg_()
        _wrap_finalize(chunks, negate)
    elif fault == "scale_grads":  # every gradient x3 (a sum where a mean belongs)
        _wrap_finalize(chunks, lambda cs: [g.mul_(3.0) for _, g in _main_grads(cs)])
    elif fault == "unreduced_dp_rank":  # the last data-parallel rank keeps its own, unreduced gradients
        saved: dict[str, Any] = {}
        last = ps.get_data_parallel_rank() == ps.get_data_parallel_world_size() - 1

        def keep(cs: list[Any]) -> None:
            saved.clear()
            saved.update({n: g.detach().clone() for n, g in _main_grads(cs)})

        def restore(cs: list[Any]) -> None:
            if last:
                with torch.no_grad():
                    for n, g in _main_grads(cs):
                        g.copy_(saved[n])
        _wrap_finalize(chunks, restore, before=keep)


def _inject_group_fault(opts: SelfCheckOptions, optimizer: Any, view: Any) -> None:
    if opts.fault == "decay_no_decay_params":
        for mp in view:
            if mp.group is not None and no_decay(mp.name, mp.model):
                mp.group["weight_decay"] = opts.weight_decay
    elif opts.fault == "wrong_group_lr":
        group = next(mp.group for mp in view if mp.group is not None)
        group["lr"] = group["lr"] * 10.0
    elif opts.fault == "group_not_stepped":
        inner = view.inner[0]
        dropped = inner.param_groups.pop()
        for mp in view:
            if mp.group is dropped:
                mp.group = None


def _inject_step_fault(opts: SelfCheckOptions, view: Any) -> None:
    """The faults that act inside the optimizer's step: the torch optimizer's ``step`` changes its own param
    groups first (what a bug in an optimizer wrapper or a param-group hook would do), then updates."""
    if opts.fault not in ("maximize_in_step", "swap_betas_in_step", "decay_no_decay_in_step"):
        return
    no_decay_groups = {id(mp.group) for mp in view if mp.group is not None and no_decay(mp.name, mp.model)}

    def corrupt(groups: list[dict[str, Any]]) -> None:
        for group in groups:
            if opts.fault == "maximize_in_step":
                group["maximize"] = True
            elif opts.fault == "swap_betas_in_step" and "betas" in group:
                b1, b2 = group["betas"]
                group["betas"] = (b2, b1)
            elif opts.fault == "decay_no_decay_in_step" and id(group) in no_decay_groups:
                group["weight_decay"] = opts.weight_decay

    for inner in view.inner:
        real = inner.step

        def faulty(*args: Any, _real: Any = real, _inner: Any = inner, **kwargs: Any) -> Any:
            corrupt(_inner.param_groups)
            return _real(*args, **kwargs)

        inner.step = faulty


def _forward_step_for(opts: SelfCheckOptions) -> Any:
    step = models.forward_step(opts)
    if opts.fault != "loss_not_averaged":
        return step

    def undivided(data_iterator: Any, model: Any) -> Any:
        out, loss_func = step(data_iterator, model)

        def loss_times_n(output: Any) -> Any:
            loss, stats = loss_func(output)
            return loss * models.MICROBATCHES, stats

        return out, loss_times_n

    return undivided


# ------------------------------------------------------------------------------------------------ the run
def run_rank(opts: SelfCheckOptions) -> tuple[list[Check], dict[str, Any]]:
    """Run the self-check on this rank (process group already initialised); returns its checks and environment."""
    _prepare(opts)
    import warnings

    # Known, harmless noise from torch's collectives and Megatron's CPU fallbacks; the report says what matters.
    for pattern in (".*reduce_scatter_tensor.*", ".*all_gather_into_tensor.*", ".*is not a leaf Tensor.*",
                    ".*requires_grad=True to a scalar.*", ".*Apex is not installed.*"):
        warnings.filterwarnings("ignore", message=pattern)
    import torch
    import torch.distributed as dist

    from .. import symbols, training
    from ..detect import detect

    ps = symbols.resolve("parallel_state")
    models.init_parallel(opts)
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "megatron_core": str(detect().version),
           "device": opts.device, "backend": dist.get_backend()}

    modules, _config = models.build_chunks(opts)
    chunks = training.wrap_ddp(modules, ddp_config=models.ddp_config(opts))
    if opts.fault == "rebind_before_optimizer":
        _rebind_outside(chunks[0])
    lr = 0.0 if opts.fault == "lr_zero" else opts.lr
    optimizer = training.get_megatron_optimizer(replace(models.optim_config(opts), lr=lr), chunks,
                                                no_weight_decay_cond=no_decay)
    training.set_lr_and_weight_decay(optimizer, lr, opts.weight_decay)
    training.install_training_hooks(chunks, optimizer)
    if opts.fault == "rebind_after_optimizer":
        _rebind_outside(chunks[0])
    checks: list[Check] = []
    binding = _bind(chunks, checks) if opts.bind else None
    if opts.fault == "rebind_after_bind":
        _rebind_outside(chunks[0])
    if opts.fault == "stale_binding" and binding is not None:
        binding._flats = [f.detach().clone() for f in binding._flats]
    if opts.fault == "gather_full_wrong_stride" and binding is not None:
        inject_wrong_stride(binding)
    if opts.fault == "no_finalize_hook":
        for chunk in chunks:
            symbols.resolve("get_model_config")(chunk).finalize_model_grads_func = None
    _inject_grad_fault(opts, chunks, ps)

    cfg = symbols.resolve("get_model_config")(chunks[0])
    try:
        training.check_training_hooks(chunks)
        checks.append(Check("training_hooks_installed", cfg.finalize_model_grads_func is not None,
                            "finalize_model_grads_func set on the config the model uses"))
    except training.MissingTrainingHookError as exc:
        checks.append(Check("training_hooks_installed", False, str(exc)))

    _inject_group_fault(opts, optimizer, optimizer_view(optimizer, named_trainable(chunks)))
    verifier = StepVerifier(chunks, optimizer, reference=True, continuity=True, stream=True,
                            configured=from_options(opts, no_decay))
    _inject_step_fault(opts, verifier.view)
    independent = IndependentReference(opts, chunks, cfg, verifier.view)
    cycles = OffloadCycles(chunks, optimizer, verifier.view, opts.offload_cycles, opts.fault)
    gaps = cycles.gaps(opts.steps)
    checks.append(_param_groups_check(verifier.view, opts))
    batches = models.make_batches(opts, ps.get_data_parallel_rank())
    per_chunk = [batches] * len(chunks)
    forward_step = _forward_step_for(opts)
    fd_checks: list[Check] = []
    progress.note(f"{opts.label()}: built; training {opts.steps} step(s), each verified")
    for k in range(opts.steps):
        verifier.before_step()
        training.zero_grad_buffer(chunks, optimizer)
        data = models.data_iterators(batches, chunks)
        stored = training.forward_backward(verifier.recording(forward_step), data, chunks, models.MICROBATCHES,
                                           seq_length=models.SEQ,
                                           micro_batch_size=models.MICRO_BATCH,
                                           check_hooks=opts.fault != "no_finalize_hook")
        verifier.after_backward(models.forward_step(opts), per_chunk, models.MICROBATCHES, stored)
        if opts.finite_differences and k == min(1, opts.steps - 1):  # after a warm-up step: stale weights show
            fd_checks = _finite_differences(opts, chunks, cfg, verifier, per_chunk, stored)
        independent.step(stored, verifier.view.loss_scale() if not verifier.view.unsupported else 1.0)
        with verifier.stepping():
            ok, norm, _zeros = training.optimizer_step(optimizer)
        verifier.after_step(ok, norm)
        if k == 0 and opts.fault == "perturb_dp_rank" and \
                ps.get_data_parallel_rank() == ps.get_data_parallel_world_size() - 1:
            with torch.no_grad():
                for p in _core(chunks[0]).parameters():
                    p.add_(1e-3)
        if gaps[k]:
            training.finish_param_sync(chunks, optimizer)  # nothing in flight while the memory is away
            cycles.run(gaps[k])
        progress.note(f"{opts.label()}: step {k + 1}/{opts.steps} done")
    # the overlapped all-gather of the last step's params (and, on 0.6-0.8, the optimizer's process-wide hook)
    training.finish_param_sync(chunks, optimizer, keep_overlap=False)
    verifier.final_replicas()
    checks.extend(verifier.checks())
    checks.append(_loss_check(verifier))
    checks.append(independent.check())
    checks.extend(fd_checks)
    checks.extend(cycles.checks())
    alias = _buffer_alias_check(chunks)
    if alias is not None:
        checks.append(alias)
    if binding is not None:
        checks.extend(_binding_checks(binding, chunks))
        if (opts.pp or 1) > 1:
            checks.append(_pipeline_gather_check(binding, ps))
        if max(opts.tp or 1, opts.pp or 1, opts.ep or 1) > 1:
            checks.append(gather_full_check(binding, chunks))
    env["reference_bytes"] = verifier.reference_bytes
    from .. import patches

    env["patches"] = ",".join(patches.applied()) or "none"  # after Megatron's import: a patch undone there is out
    from .. import lifecycle

    lifecycle.release_host_buffers()
    models.release_chunks(chunks)
    ps.destroy_model_parallel()
    return checks, env


def _finite_differences(opts: SelfCheckOptions, chunks: list[Any], cfg: Any, verifier: Any,
                        per_chunk: list[Any], stored: Any) -> list[Check]:
    """``grads_match_directional_derivatives`` and ``loss_matches_float64`` on this step's finalized gradients,
    before the optimizer reads them (collective)."""
    from .directional import FiniteDifferences

    fd = FiniteDifferences(chunks, verifier.view, verifier.groups, verifier.names,
                           per_token_loss=bool(getattr(cfg, "calculate_per_token_loss", False)), seed=opts.seed)
    return fd.run(models.forward_step(opts), per_chunk, models.MICROBATCHES, stored or [], verifier.loss_scale_now,
                  verifier.rng, verifier.routing)


def _loss_check(verifier: StepVerifier) -> Check:
    t = verifier.tally["loss"]
    if verifier.unreplayable:
        return Check.not_applicable("loss_matches_reference", verifier.unreplayable)
    if not t.applicable:
        return Check.not_applicable("loss_matches_reference", "no loss on this rank")
    curve = " -> ".join(f"{x:.5g}" for x in verifier.losses_seen)
    if t.failures:
        return Check("loss_matches_reference", False, "; ".join(t.failures[:3]), {"failures": t.failures})
    return Check("loss_matches_reference", True,
                 f"every micro-batch's loss equals the reference's, every step (mean loss per step {curve})",
                 {"losses": verifier.losses_seen})
