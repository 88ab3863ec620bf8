"""Scenarios for tests/test_param_groups.py: the effective (lr, weight decay) of every parameter, and a
decay-only step, for the self-check's GPT on the installed release (2 gloo ranks, DP=2).

Each case builds the model, wraps it with ``wrap_ddp``, builds the optimizer with ``get_megatron_optimizer`` and
returns plain data: per parameter name its shape and its (lr, weight decay) as
``training.effective_lr_and_weight_decay`` reads them from the optimizer's main params, right after the build (no scheduler) and after each step of ``optimizer_param_scheduler``; then one optimizer step
with zero gradients and every parameter before and after it. The pytest side computes what the values must be
from the inputs alone (the same expectation on every release) and compares.
"""

from __future__ import annotations

from typing import Any

from _training_scenarios import apply_patches

LR, MIN_LR, WD = 1e-5, 1e-6, 0.1
DECOUPLED_LR, DECOUPLED_MIN_LR, LR_MULT = 3e-5, 3e-6, 0.5
SCHEDULE = dict(init_lr=0.0, max_lr=LR, min_lr=MIN_LR, lr_warmup_steps=2, lr_decay_steps=6,
                lr_decay_style="cosine", start_wd=0.05, end_wd=WD, wd_incr_steps=6, wd_incr_style="linear")
SCHEDULER_STEPS = 8


def no_decay_biases_only(name: str, param: Any) -> bool:
    """The ``conds`` case's no-decay rule: biases only (1-D norm weights decay)."""
    return name.endswith(".bias")


def scale_lr(name: str, param: Any) -> bool:
    """The ``conds`` case's ``scale_lr_cond``: the output layer (decoupled too) and the first MLP linear."""
    return "output_layer" in name or "linear_fc1" in name


#: case -> (OptimConfig fields beyond lr/min_lr/weight_decay, get_megatron_optimizer keywords, distributed
#: optimizer, bf16 params with fp32 main params)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any], bool, bool]] = {
    "defaults": ({}, {}, False, False),
    "conds": (dict(decoupled_lr=DECOUPLED_LR, decoupled_min_lr=DECOUPLED_MIN_LR),
              dict(no_weight_decay_cond=no_decay_biases_only, scale_lr_cond=scale_lr, lr_mult=LR_MULT), False, False),
    "skip-embedding": ({}, dict(default_skip_embedding_weight_decay=True), False, False),
    # explicit buffers select Megatron's private builder (0.6+), whose grouping differs (0.18+: no default rule)
    "defaults-private": ({}, dict(per_model_buffers="the chunks' buffers"), True, False),
    "conds-bf16-distopt": (dict(decoupled_lr=DECOUPLED_LR, decoupled_min_lr=DECOUPLED_MIN_LR),
                           dict(no_weight_decay_cond=no_decay_biases_only, scale_lr_cond=scale_lr, lr_mult=LR_MULT),
                           True, True),
}

#: Decay-only steps: case -> distributed optimizer on/off. ``fault-no-multipliers`` is the defect this suite is
#: for, injected where it acted: the groups' weight decay reset to the configured value after the build (what
#: Megatron's builders leave on 0.6+ without a scheduler), so biases and norms decay.
DECAY_CASES: dict[str, bool] = {"decay": False, "decay-distopt": True, "fault-no-multipliers": False}


def _build(distopt: bool, config_fields: dict[str, Any], kwargs: dict[str, Any],
           bf16: bool = False) -> tuple[Any, Any]:
    """``(chunks, optimizer)``; ``per_model_buffers`` in ``kwargs`` is replaced by the wrapped chunks' buffers."""
    import torch

    from mcore_compat import training
    from mcore_compat.selfcheck import SelfCheckOptions, models

    opts = SelfCheckOptions(nproc=2, tp=1, pp=1, dp=2, device="cpu", model="gpt", dtype="bf16" if bf16 else "fp32",
                            tie_embeddings=False, seed=11).resolved()
    models.init_parallel(opts)
    modules, _ = models.build_chunks(opts)
    chunks = training.wrap_ddp(modules, ddp_config=training.DDPConfig(use_distributed_optimizer=distopt,
                                                                      grad_reduce_in_fp32=bf16))
    config = training.OptimConfig(optimizer="adam", lr=LR, min_lr=MIN_LR, weight_decay=WD, clip_grad=1.0,
                                  use_distributed_optimizer=distopt, bf16=bf16,
                                  params_dtype=torch.bfloat16 if bf16 else torch.float32, **config_fields)
    if "per_model_buffers" in kwargs:
        # (0.4/0.5's DDP has no ``buffers`` list - ``buffers`` is nn.Module's method - and ignores the argument)
        kwargs = {**kwargs, "per_model_buffers": {i: list(c.buffers) if isinstance(c.buffers, list) else []
                                                  for i, c in enumerate(chunks)}}
    return chunks, training.get_megatron_optimizer(config, chunks, **kwargs)


def _named(chunks: list[Any]) -> dict[str, Any]:
    from mcore_compat.training.param_groups import _unwrapped

    return {n: p for chunk in chunks for n, p in _unwrapped(chunk).named_parameters()}


def _table(optimizer: Any, chunks: list[Any]) -> dict[str, tuple[float, float]]:
    from mcore_compat import training

    return training.effective_lr_and_weight_decay(optimizer, chunks)


def _release(chunks: list[Any]) -> None:
    from mcore_compat import symbols
    from mcore_compat.selfcheck import models

    models.release_chunks(chunks)
    symbols.resolve("parallel_state").destroy_model_parallel()


def _groups_case(name: str) -> dict[str, Any]:
    from mcore_compat import training

    config_fields, kwargs, distopt, bf16 = CASES[name]
    chunks, optimizer = _build(distopt, config_fields, kwargs, bf16)
    shapes = {n: list(p.shape) for n, p in _named(chunks).items()}
    built = _table(optimizer, chunks)
    scheduler = training.optimizer_param_scheduler(optimizer, **SCHEDULE)
    scheduled = [_table(optimizer, chunks)]
    for _ in range(SCHEDULER_STEPS):
        scheduler.step(1)
        scheduled.append(_table(optimizer, chunks))
    out = {"shapes": shapes, "built": built, "scheduled": scheduled,
           # the class and the first of its bases that is not mcore_compat's (Megatron's, under our load_state_dict)
           "scheduler": [f"{c.__module__}.{c.__name__}" for c in type(scheduler).__mro__
                         if c is type(scheduler) or not c.__module__.startswith("mcore_compat")][:2],
           "embedding_or_output": sorted(n for n in shapes if "word_embeddings" in n or "output_layer" in n)}
    _release(chunks)
    return out


def _decay_case(name: str) -> dict[str, Any]:
    import torch

    from mcore_compat import training

    chunks, optimizer = _build(DECAY_CASES[name], {}, {})
    if name == "fault-no-multipliers":
        for group in optimizer.param_groups:
            group["weight_decay"] = WD
    training.zero_grad_buffer(chunks, optimizer)
    before = {n: p.detach().clone() for n, p in _named(chunks).items()}
    for chunk in chunks:  # zero gradients, as a backward of a loss that does not depend on the weights leaves them
        for p in chunk.module.parameters():
            if getattr(p, "main_grad", None) is not None:
                p.main_grad.zero_()
    ok, _, _ = training.optimizer_step(optimizer)
    after = {n: p.detach().clone() for n, p in _named(chunks).items()}
    out = {
        "update_successful": ok,
        "shapes": {n: list(t.shape) for n, t in before.items()},
        # the expected decayed value is computed as AdamW does (fp32 multiply by 1 - lr * wd)
        "decayed_exactly": {n: bool(torch.equal(after[n], before[n] * (1 - LR * WD))) for n in before},
        "unchanged": {n: bool(torch.equal(after[n], before[n])) for n in before},
        "max_rel_change": {n: float(((after[n] - before[n]).abs() / before[n].abs().clamp_min(1e-30)).max())
                           for n in before},
    }
    _release(chunks)
    return out


#: Schedules on which mcore_compat's own scheduler is compared with Megatron's (where the release has one).
STYLES: dict[str, dict[str, Any]] = {
    "constant": dict(lr_decay_style="constant", wd_incr_style="constant", start_wd=WD),
    "linear": dict(lr_decay_style="linear", wd_incr_style="linear"),
    "cosine": dict(lr_decay_style="cosine", wd_incr_style="cosine"),
    "inverse-square-root": dict(lr_decay_style="inverse-square-root"),
    "WSD-linear": dict(lr_decay_style="WSD", wsd_decay_steps=3, lr_wsd_decay_style="linear"),
    "WSD-cosine": dict(lr_decay_style="WSD", wsd_decay_steps=3, lr_wsd_decay_style="cosine"),
    "WSD-exponential": dict(lr_decay_style="WSD", wsd_decay_steps=3, lr_wsd_decay_style="exponential"),
}


class _Groups:
    """The one attribute a scheduler touches: ``param_groups`` (a default group and a decoupled, no-decay one)."""

    def __init__(self) -> None:
        self.param_groups = [{"max_lr": LR, "min_lr": MIN_LR, "wd_mult": 1.0, "lr": 0.0, "weight_decay": 0.0},
                             {"max_lr": DECOUPLED_LR, "min_lr": DECOUPLED_MIN_LR, "wd_mult": 0.0, "lr": 0.0,
                              "weight_decay": 0.0}]


def _schedules() -> dict[str, dict[str, list[list[float]]]]:
    """Per style: the (lr, wd) of both groups at steps 0..10 from our scheduler and from Megatron's."""
    from mcore_compat import symbols
    from mcore_compat.capabilities import has
    from mcore_compat.training.scheduler import ParamScheduler

    classes: dict[str, Any] = {"ours": ParamScheduler}
    if has("megatron_scheduler"):
        classes["megatron"] = symbols.resolve("OptimizerParamScheduler")
    out: dict[str, dict[str, list[list[float]]]] = {}
    for style, fields in STYLES.items():
        for who, cls in classes.items():
            opt = _Groups()
            args = {**SCHEDULE, **fields}
            sched = cls(opt, **args)
            values = []
            for _ in range(11):
                values.append([v for g in opt.param_groups for v in (float(g["lr"]), float(g["weight_decay"]))])
                sched.step(1)
            restored = cls(_Groups(), **args)
            restored.load_state_dict(sched.state_dict())
            values.append([float(restored.num_steps)])
            out.setdefault(style, {})[who] = values
    return out


def run_all() -> dict[str, Any]:
    """Every case on this rank: ``{"version", "groups": {case: ...}, "decay": {case: ...}, "schedules": ...}``."""
    from mcore_compat.detect import detect

    apply_patches()
    return {"version": str(detect().version),
            "groups": {name: _groups_case(name) for name in CASES},
            "decay": {name: _decay_case(name) for name in DECAY_CASES},
            "schedules": _schedules()}
