"""What one rank of the self-check does: build, train next to a plain-PyTorch reference, check."""

from __future__ import annotations

import platform
from typing import Any

from .models import MICRO_BATCH, MICROBATCHES, SEQ, build_model, make_batches
from .options import SelfCheckOptions
from .report import Check

__all__ = ["run_rank"]

#: Tolerances (absolute, on one Adam update of size ~lr) used by the update check.
FP32_UPDATE_ATOL = 1e-5
BF16_MEAN_ERR_FRACTION = 0.1  # mean |err| <= 0.1 * lr
BF16_OUTLIER_FRACTION = 0.02  # <= 2 % of elements off by more than 0.25 * lr + 2 bf16 ulps (sign-ambiguous grads)
GRAD_NORM_RTOL = {"fp32": 1e-4, "bf16": 2e-2}
LOSS_RTOL = {"fp32": 1e-5, "bf16": 2e-2}


def _prepare(opts: SelfCheckOptions) -> list[str]:
    """Apply the patches this run needs (once per process); returns every patch applied in this process."""
    from .. import patches

    patches.apply_for_device(opts.device or "cpu")
    return patches.applied()


def _core(module: Any) -> Any:
    """Strip DDP / Float16Module wrappers."""
    while hasattr(module, "module") and type(module).__name__ in ("DistributedDataParallel", "Float16Module"):
        module = module.module
    return module


def _forward_step(opts: SelfCheckOptions) -> Any:
    def forward_step(data_iterator: Any, model: Any) -> Any:
        b = next(data_iterator)
        if opts.model == "gpt":
            out = model(b.tokens, b.position_ids, b.attention_mask, labels=b.labels)
        else:
            out = model(b.x)

        def loss_func(output: Any) -> Any:
            loss = output.float().mean() if opts.model == "gpt" else ((output.float() - b.target) ** 2).mean()
            return loss, {"loss": loss.detach().clone()}

        return out, loss_func

    return forward_step


def _reference_step(ref: Any, batches: list[Any], opts: SelfCheckOptions, ps: Any) -> dict[str, Any]:
    """One step in plain PyTorch: autograd grads, DP mean by all_reduce, TP/PP-aware norm, clip, torch AdamW."""
    import torch
    import torch.distributed as dist

    from ..training import forward_backward

    params = dict(_core(ref).named_parameters())
    losses: list[float] = []
    if (opts.pp or 1) == 1:
        step = _forward_step(opts)
        it = iter(batches)
        for _ in batches:
            out, loss_func = step(it, ref)
            loss, _ = loss_func(out)
            (loss / len(batches)).backward()
            losses.append(float(loss))
    else:  # Megatron's pipeline schedule on the unwrapped copy (no DDP, no hooks): it only moves activations
        stored = forward_backward(_forward_step(opts), iter(batches), [ref], MICROBATCHES, seq_length=SEQ,
                                  micro_batch_size=MICRO_BATCH, check_hooks=False)
        losses = [float(d["loss"]) for d in stored]
    dp_group = ps.get_data_parallel_group()
    dp = dist.get_world_size(dp_group)
    grads = {}
    for name, p in params.items():
        g = p.grad.detach().float().clone()
        if dp > 1:
            dist.all_reduce(g, group=dp_group)
            g /= dp
        grads[name] = g
    tp_rank = ps.get_tensor_model_parallel_rank()
    sq = torch.zeros(1, dtype=torch.float64, device=next(iter(grads.values())).device)
    for name, p in params.items():
        if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
            sq += (grads[name].double() ** 2).sum()
    dist.all_reduce(sq, group=ps.get_model_parallel_group())
    norm = float(sq.sqrt())
    coeff = 1.0 / (norm + 1e-6)  # clip_grad = 1.0
    main = {n: torch.nn.Parameter(p.detach().float().clone()) for n, p in params.items()}
    for n, m in main.items():
        m.grad = grads[n] * coeff if coeff < 1.0 else grads[n]
    opt = torch.optim.AdamW(list(main.values()), lr=opts.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    opt.step()
    return {"params": {n: m.detach() for n, m in main.items()}, "grad_norm": norm,
            "loss": sum(losses) / len(losses) if losses else None}


def _twin(module: Any, opts: SelfCheckOptions) -> Any:
    """A second, independent copy of ``module`` with the same weights (configs hold process groups: no deepcopy)."""
    import torch

    twin, _ = build_model(opts)
    src = dict(_core(module).named_parameters())
    with torch.no_grad():
        for name, p in _core(twin).named_parameters():
            p.copy_(src[name])
    return twin


def _rebind_outside(module: Any) -> None:
    """The RL-framework pattern behind the frozen-weights bug: every ``param.data`` becomes a view of one
    separately allocated flat buffer (values copied). Used only by the negative controls."""
    import torch

    params = list(_core(module).parameters())
    flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    offset = 0
    for p in params:
        n = p.numel()
        flat[offset:offset + n].copy_(p.data.reshape(-1))
        p.data = flat[offset:offset + n].view_as(p.data)
        offset += n


def _snapshot(module: Any) -> dict[str, Any]:
    return {n: p.detach().float().clone() for n, p in _core(module).named_parameters()}


def _update_check(before: dict[str, Any], after: dict[str, Any], ref: dict[str, Any], opts: SelfCheckOptions,
                  module: Any) -> Check:

    worst, worst_name, outliers, total, err_sum = 0.0, "", 0, 0, 0.0
    dtypes = {n: p.dtype for n, p in _core(module).named_parameters()}
    for n in before:
        err = ((after[n] - before[n]) - (ref[n] - before[n])).abs()
        if opts.dtype == "bf16":  # compare with what a bf16 parameter can hold
            err = (after[n] - ref[n].to(dtypes[n]).float()).abs()
            ulp = before[n].abs().clamp_min(1e-30) * 2.0**-7
            outliers += int((err > 0.25 * opts.lr + 2 * ulp).sum())
        total += err.numel()
        err_sum += float(err.sum())
        if float(err.max()) > worst:
            worst, worst_name = float(err.max()), n
    mean = err_sum / max(total, 1)
    if opts.dtype == "fp32":
        ok = worst <= FP32_UPDATE_ATOL
        tol = f"max |err| <= {FP32_UPDATE_ATOL:g}"
    else:
        ok = mean <= BF16_MEAN_ERR_FRACTION * opts.lr and outliers <= BF16_OUTLIER_FRACTION * total
        tol = (f"mean |err| <= {BF16_MEAN_ERR_FRACTION:g}*lr, outliers <= {BF16_OUTLIER_FRACTION:.0%}"
               f" (got {outliers}/{total})")
    return Check("update_matches_reference", ok,
                 f"max |update - reference| = {worst:.3g} ({worst_name}), mean {mean:.3g}; {tol}",
                 {"max_err": worst, "mean_err": mean, "param": worst_name, "outliers": outliers, "elements": total})


def _dp_consistency(module: Any, ps: Any) -> Check:
    import torch
    import torch.distributed as dist

    group = ps.get_data_parallel_group()
    size = dist.get_world_size(group)
    flat = torch.cat([p.detach().float().reshape(-1) for p in _core(module).parameters()])
    gathered = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(gathered, flat, group=group)
    diff = max(float((g - flat).abs().max()) for g in gathered)
    return Check("dp_ranks_identical", diff == 0.0,
                 f"max difference from the other {size - 1} data-parallel rank(s): {diff:.3g}", {"max_diff": diff})


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


def _binding_checks(binding: Any, module: Any, before: dict[str, Any]) -> list[Check]:
    """After the steps: the binding still verifies, and its flat buffers hold the model's new weights."""
    import torch

    from ..binding import BindingError

    try:
        binding.verify()
        verified = Check("binding_verified", True, f"{len(binding)} parameters at their offsets of "
                         f"{len(binding.flat_buffers())} flat buffer(s) ({binding.mode})")
    except BindingError as exc:
        verified = Check("binding_verified", False, str(exc))
    params = dict(_core(module).named_parameters())
    views = binding.named_views()
    stale = [n for n, v in views.items() if not torch.equal(v, params[n].detach())]
    unchanged = [n for n, v in views.items() if torch.equal(v.float(), before[n])]
    current = Check("bound_buffer_current", not stale and not unchanged,
                    f"{len(views) - len(stale)}/{len(views)} flat-buffer views equal the model's weights, "
                    f"{len(views) - len(unchanged)}/{len(views)} changed by the steps" +
                    (f"; differ from the model: {', '.join(stale[:5])}" if stale else "") +
                    (f"; unchanged: {', '.join(unchanged[:5])}" if unchanged else ""),
                    {"stale": stale, "unchanged": unchanged})
    return [verified, current]


def _pipeline_gather_check(binding: Any, ps: Any) -> Check:
    """``gather_pipeline`` equals every stage's own weights (exchanged tensor by tensor as the reference)."""
    import torch
    import torch.distributed as dist

    from ..binding import gather_pipeline

    group = ps.get_pipeline_model_parallel_group()
    gathered = gather_pipeline(binding, group=group)
    mine = {n: v.detach().cpu().clone() for n, v in binding.named_views().items()}
    stages: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(stages, mine, group=group)
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


def run_rank(opts: SelfCheckOptions) -> tuple[list[Check], dict[str, Any]]:
    """Run the self-check on this rank (process group already initialised); returns its checks and environment."""
    applied = _prepare(opts)
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
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=opts.tp or 1,
                                 pipeline_model_parallel_size=opts.pp or 1)
    torch.manual_seed(opts.seed)
    symbols.resolve("model_parallel_cuda_manual_seed")(opts.seed)
    env = {"python": platform.python_version(), "torch": torch.__version__, "megatron_core": str(detect().version),
           "device": opts.device, "backend": dist.get_backend(), "patches": ",".join(applied) or "none"}

    module, _config = build_model(opts)
    reference = _twin(module, opts)
    dtype = torch.bfloat16 if opts.dtype == "bf16" else torch.float32
    chunks = training.wrap_ddp([module], ddp_config=training.DDPConfig(
        use_distributed_optimizer=opts.distributed_optimizer, grad_reduce_in_fp32=opts.dtype == "bf16"))
    if opts.fault == "rebind_before_optimizer":
        _rebind_outside(chunks[0])
    optimizer = training.get_megatron_optimizer(training.OptimConfig(
        optimizer="adam", lr=0.0 if opts.fault == "lr_zero" else opts.lr, weight_decay=0.0, clip_grad=1.0,
        bf16=opts.dtype == "bf16", params_dtype=dtype, use_distributed_optimizer=opts.distributed_optimizer),
        chunks)
    training.install_training_hooks(chunks, optimizer)
    if opts.fault == "rebind_after_optimizer":
        _rebind_outside(chunks[0])
    checks: list[Check] = []
    binding = _bind(chunks, checks) if opts.bind else None
    if opts.fault == "rebind_after_bind":
        _rebind_outside(chunks[0])
    if opts.fault == "no_finalize_hook":
        symbols.resolve("get_model_config")(chunks[0]).finalize_model_grads_func = None

    cfg = symbols.resolve("get_model_config")(chunks[0])
    try:
        training.check_training_hooks(chunks)
        checks.append(Check("training_hooks_installed", cfg.finalize_model_grads_func is not None,
                            "finalize_model_grads_func set on the config the model uses"))
    except training.MissingTrainingHookError as exc:
        checks.append(Check("training_hooks_installed", False, str(exc)))

    dp_rank = ps.get_data_parallel_rank()
    batches = make_batches(opts, dp_rank)
    ref = _reference_step(reference, batches, opts, ps)
    before = _snapshot(chunks[0])
    last_stage = ps.is_pipeline_last_stage()
    losses: list[float] = []
    norms: list[float | None] = []
    after_first: dict[str, Any] = {}
    for k in range(opts.steps):
        training.zero_grad_buffer(chunks, optimizer)
        stored = training.forward_backward(_forward_step(opts), iter(batches), chunks, MICROBATCHES,
                                           seq_length=SEQ, micro_batch_size=MICRO_BATCH,
                                           check_hooks=opts.fault != "no_finalize_hook")
        _ok, norm, _zeros = training.optimizer_step(optimizer)
        if k == 0 and opts.fault == "perturb_dp_rank" and dp_rank == ps.get_data_parallel_world_size() - 1:
            with torch.no_grad():
                for p in _core(chunks[0]).parameters():
                    p.add_(1e-3)
        norms.append(None if norm is None else float(norm))
        if last_stage:
            losses.append(sum(float(d["loss"]) for d in stored) / len(stored))
        if k == 0:
            after_first = _snapshot(chunks[0])

    changed = [n for n in before if not torch.equal(before[n], after_first[n])]
    checks.append(Check("all_params_changed", len(changed) == len(before),
                        f"{len(changed)}/{len(before)} trainable parameters changed after optimizer.step()",
                        {"unchanged": [n for n in before if n not in changed]}))
    checks.append(_update_check(before, after_first, ref["params"], opts, chunks[0]))
    got = norms[0]
    rtol = GRAD_NORM_RTOL[opts.dtype]
    ok = got is not None and abs(got - ref["grad_norm"]) <= rtol * ref["grad_norm"]
    checks.append(Check("grad_norm_matches_reference", ok,
                        f"grad norm {got} vs reference {ref['grad_norm']:.6g} (rtol {rtol:g})",
                        {"grad_norm": got, "reference": ref["grad_norm"]}))
    if last_stage and losses:
        lrtol = LOSS_RTOL[opts.dtype]
        ref_loss = ref["loss"]
        checks.append(Check("loss_matches_reference", abs(losses[0] - ref_loss) <= lrtol * abs(ref_loss),
                            f"first loss {losses[0]:.6g} vs reference {ref_loss:.6g} (rtol {lrtol:g})",
                            {"loss": losses[0], "reference": ref_loss}))
        if opts.steps > 1:
            checks.append(Check("loss_decreases", losses[-1] < losses[0],
                                f"loss {losses[0]:.5g} -> {losses[-1]:.5g} over {opts.steps} steps",
                                {"losses": losses}))
    checks.append(_dp_consistency(chunks[0], ps))
    alias = _buffer_alias_check(chunks)
    if alias is not None:
        checks.append(alias)
    if binding is not None:
        checks.extend(_binding_checks(binding, chunks[0], before))
        if (opts.pp or 1) > 1:
            checks.append(_pipeline_gather_check(binding, ps))
    ps.destroy_model_parallel()
    return checks, env
