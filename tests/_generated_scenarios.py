"""Generated settings for tests/test_generated_settings.py: Hypothesis draws optimizer and scheduler settings on
every rank of the session's 2-rank gloo group (DP=2), builds them through mcore_compat on the installed release
and compares what it built with three oracles.

* the spec (``_spec_oracle``: Megatron-LM's formulas in plain float64 Python);
* raw Megatron on this release, where the raw call accepts the settings (its ``OptimizerParamScheduler`` on the
  same groups, 0.9+); where mcore_compat deliberately differs, its one-line warning;
* the reference release (the committed cases only: ``committed`` below).

Properties: ``schedule`` (every parameter's lr and weight decay over a schedule, resumed in the middle, against
both oracles), ``invalid`` (one change from :data:`INVALID_OPTIMIZER` or :data:`INVALID_SCHEDULE` to a valid draw
is refused with an ``InvalidArgumentError`` in one line naming the setting, before any group changes) and
``update`` (1-3 real training steps with drawn DDP settings - bucket size, ``overlap_grad_reduce``,
``grad_reduce_in_fp32``, ``average_in_collective``, ``overlap_param_gather`` -, forward, backward,
``finalize_model_grads``, ``optimizer_step``: each step's
gradient against a float64 replica of the model in plain torch, the reported grad norm against the gradients', the
fp32 main params after the steps against Adam in float64 with the spec's per-parameter lr and weight decay, coupled
or decoupled; faults it was seen to catch inside Megatron 0.16.1: the grad norm not summed over the distributed
optimizer's shards, DDP summing instead of averaging, beta2 taking beta1's value).

``committed`` replays :data:`COMMITTED` (the settings that broke a release, kept as regression cases, and a spread
of what users train with) against all three oracles: the spec, raw Megatron, and the reference release's record
(:data:`REFERENCE`, written by ``scripts/generated_reference.py``, which ``--check`` compares; values within
:data:`UPDATE_TOL` and :data:`ULPS`).

Not yet: fp16 with its loss scaler in the update property, several micro-batches and PP/VPP schedules, the
config-builder settings.

Hypothesis runs on rank 0 (a fixed seed per property, the committed example database, read-only) and sends each
example to every rank (:func:`_run_property`); the ranks build the same things and decide on data gathered from
all of them. Each property
returns ``{"status", "examples", "failure"}``; a failure carries Hypothesis's falsifying example.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import traceback
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _spec_oracle as O
from _training_scenarios import apply_patches

HERE = Path(__file__).resolve().parent
DATABASE = HERE / "data" / "hypothesis"
#: Examples per property and release session (the committed cases and database entries come on top).
EXAMPLES = {"schedule": 12, "invalid": 30, "update": 10}
#: Set (to anything) to let Hypothesis (on rank 0) save new failing examples into the committed database while
#: developing.
SAVE_ENV = "MCORE_COMPAT_HYPOTHESIS_SAVE"
REL = 1e-9


# ---------------------------------------------------------------------------------------------------- the model
def _model(bf16: bool) -> Any:
    """A tiny model with every kind of parameter the group rules tell apart: an embedding weight (decoupled lr),
    a linear weight and bias, a 1-D norm weight."""
    import torch

    import mcore_compat as mc

    config = mc.TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True,
                                  bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32)

    class Tiny(mc.MegatronModule):
        def __init__(self) -> None:
            super().__init__(config=config)
            self.model_type = mc.ModelType.encoder_or_decoder
            dtype = config.params_dtype
            self.embedding = torch.nn.Parameter(_values((6, 8), 1, 0.1).to(dtype))
            self.embedding.is_embedding_or_output_parameter = True
            self.fc = mc.ColumnParallelLinear(8, 8, config=config, init_method=_fill_from(2, 0.3), bias=True,
                                              gather_output=True)
            self.norm = torch.nn.Parameter(torch.ones(8, dtype=dtype))

        def set_input_tensor(self, tensor: Any) -> None:
            self.input_tensor = tensor

        def forward(self, tokens: Any) -> Any:
            return self.fc(self.embedding[tokens] * self.norm)[0]

    return Tiny()


def _values(shape: tuple[int, ...], seed: int, scale: float) -> Any:
    """Fixed values from their own generator: the same start on every release, whatever Megatron draws."""
    import torch

    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32) * scale


def _fill_from(seed: int, scale: float) -> Callable[[Any], Any]:
    def init(weight: Any) -> Any:  # Megatron's CPU init calls it on the fp32 master weight
        import torch

        with torch.no_grad():
            return weight.copy_(_values(tuple(weight.shape), seed, scale))

    return init


def _no_wd_biases(name: str, param: Any) -> bool:
    return name.endswith(".bias")


def _scale_fc(name: str, param: Any) -> bool:
    """The scaled parameters: the linear layer's (Megatron passes the DDP-wrapped name, ``module.fc.weight``)."""
    return "fc." in name


NO_WD_CONDS: dict[str, Callable[[str, Any], bool] | None] = {"default": None, "biases": _no_wd_biases}


def rule_of(name: str, shape: list[int], build: dict[str, Any]) -> O.GroupRule:
    """The spec's grouping of a parameter for the build settings ``build``."""
    cond = NO_WD_CONDS[build["no_wd"]]
    no_decay = cond(name, None) if cond is not None else (name.endswith(".bias") or len(shape) == 1)
    return O.GroupRule(decoupled=name == "embedding" and build["decoupled_lr"] is not None,
                       scaled=bool(build["scale"]) and _scale_fc(name, None), no_decay=no_decay)


def _build(build: dict[str, Any], changes: dict[str, Any] | None = None) -> tuple[list[Any], Any]:
    """The DDP-wrapped tiny model and the optimizer built for ``build``; ``changes`` are set on the
    ``OptimConfig`` after it is made (the invalid-settings property's mutations)."""
    import torch

    from mcore_compat import training

    bf16, distopt = bool(build["bf16"]), bool(build["distopt"])
    ddp = {"grad_reduce_in_fp32": bf16, **build.get("ddp", {})}  # the update property draws the DDP settings
    chunks = training.wrap_ddp([_model(bf16)], ddp_config=training.DDPConfig(use_distributed_optimizer=distopt,
                                                                             **ddp))
    config = training.OptimConfig(
        optimizer="adam", lr=build["lr"], min_lr=build["min_lr"], decoupled_lr=build["decoupled_lr"],
        decoupled_min_lr=build["decoupled_min_lr"], weight_decay=build["weight_decay"], clip_grad=build["clip_grad"],
        adam_beta1=build["beta1"], adam_beta2=build["beta2"], adam_eps=build["eps"],
        decoupled_weight_decay=build["decoupled_wd"], use_distributed_optimizer=distopt, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32)
    for name, value in (changes or {}).items():
        setattr(config, name, value)
    kwargs: dict[str, Any] = {}
    if NO_WD_CONDS[build["no_wd"]] is not None:
        kwargs["no_weight_decay_cond"] = NO_WD_CONDS[build["no_wd"]]
    if build["scale"]:
        kwargs.update(scale_lr_cond=_scale_fc, lr_mult=build["lr_mult"])
    try:
        return chunks, training.get_megatron_optimizer(config, chunks, **kwargs)
    except BaseException:
        _release(chunks)
        raise


def _release(chunks: list[Any]) -> None:
    from mcore_compat.selfcheck import models

    models.release_chunks(chunks)


def _named(chunks: list[Any]) -> dict[str, Any]:
    from mcore_compat.training.param_groups import _unwrapped

    return dict(_unwrapped(chunks[0]).named_parameters())


def _all_ranks(value: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _table(optimizer: Any, chunks: list[Any]) -> dict[str, tuple[float, float]]:
    """Every parameter's (lr, weight decay), merged over the ranks (each holds its shard's main params)."""
    from mcore_compat import training

    merged: dict[str, Any] = {}
    for table in _all_ranks(training.effective_lr_and_weight_decay(optimizer, chunks)):
        for name, value in table.items():
            if merged.setdefault(name, tuple(value)) != tuple(value):
                merged[name] = ("ranks disagree", merged[name], tuple(value))
    return merged


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL, abs_tol=1e-15)


# ------------------------------------------------------------------------------------------------- strategies
def _strategies() -> Any:
    from hypothesis import strategies as st

    lr = st.floats(1e-7, 1e-2).map(lambda x: float(f"{x:.3g}"))
    frac = st.sampled_from([0.0, 0.01, 0.1, 0.5, 1.0])

    @st.composite
    def build(draw: Any) -> dict[str, Any]:
        base = draw(lr)
        decoupled = draw(st.one_of(st.none(), lr))
        return {
            "lr": base,
            "min_lr": draw(st.one_of(st.none(), frac.map(lambda f: base * f))),
            "decoupled_lr": decoupled,
            "decoupled_min_lr": None if decoupled is None else draw(
                st.one_of(st.none(), frac.map(lambda f: decoupled * f))),
            "weight_decay": draw(st.sampled_from([0.0, 0.01, 0.1])),
            "no_wd": draw(st.sampled_from(sorted(NO_WD_CONDS))),
            "scale": draw(st.booleans()),
            "lr_mult": draw(st.sampled_from([0.5, 2.0, 3.0])),
            "distopt": draw(st.booleans()),
            "bf16": draw(st.booleans()),
            "clip_grad": draw(st.sampled_from([0.0, 1.0, 1e-3])),
            "beta1": draw(st.sampled_from([0.9, 0.8])),
            "beta2": draw(st.sampled_from([0.999, 0.95])),
            "eps": draw(st.sampled_from([1e-8, 1e-5])),
            # coupled decay (0.15+'s field; refused before) is drawn by the optimizer property only
            "decoupled_wd": True,
        }

    @st.composite
    def schedule(draw: Any, build: dict[str, Any]) -> dict[str, Any]:
        decay = draw(st.integers(2, 12))
        warmup = draw(st.integers(0, decay - 1))
        style = draw(st.sampled_from(O.LR_STYLES))
        max_lr = draw(st.one_of(st.just(build["lr"]), lr))  # given to both, or the scheduler's own
        own_min = build["min_lr"] if build["min_lr"] is not None else 0.0
        floors = frac.map(lambda f: max_lr * f)  # the scheduler's own floor, or the config's where it fits
        min_lr = draw(st.one_of(st.just(own_min), floors) if own_min <= max_lr else floors)
        wd_style = draw(st.sampled_from(O.WD_STYLES))
        end_wd = draw(st.sampled_from([0.0, 0.01, 0.1]))
        start_wd = end_wd if wd_style == "constant" else draw(st.sampled_from([0.0, end_wd / 2, end_wd]))
        wsd = draw(st.integers(1, decay)) if style == "WSD" else None
        init = st.sampled_from([0.0, max_lr / 10, max_lr])
        return {"init_lr": draw(init), "max_lr": max_lr, "min_lr": min_lr,
                "lr_warmup_steps": warmup, "lr_decay_steps": decay, "lr_decay_style": style,
                "start_wd": start_wd, "end_wd": end_wd, "wd_incr_steps": draw(st.integers(1, 12)),
                "wd_incr_style": wd_style, "wsd_decay_steps": wsd,
                "lr_wsd_decay_style": draw(st.sampled_from(O.WSD_STYLES)) if style == "WSD" else None,
                "resume_at": draw(st.integers(0, decay + 2)), "steps": decay + 2}

    return st, build(), schedule


def _settings(name: str, version: str) -> Any:
    """Hypothesis's settings of property ``name`` (only rank 0 runs Hypothesis: :func:`_run_property`)."""
    from hypothesis import HealthCheck, settings
    from hypothesis.database import DirectoryBasedExampleDatabase, ReadOnlyDatabase

    db: Any = DirectoryBasedExampleDatabase(DATABASE)
    if not os.environ.get(SAVE_ENV):
        db = ReadOnlyDatabase(db)
    return settings(max_examples=EXAMPLES[name], deadline=None, database=db, print_blob=True,
                    suppress_health_check=list(HealthCheck))


def _seed(version: str, name: str) -> int:
    """One fixed seed per property: every release session draws the same examples, the same every run, so that a
    release that fails where the others pass is told apart from a new draw."""
    return zlib.crc32(name.encode())


def _broadcast(value: Any = None) -> Any:
    """Rank 0's ``value`` on every rank."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _run_property(name: str, version: str, draw: Callable[[Any], dict[str, Any]],
                  body: Callable[[dict[str, Any]], list[str]]) -> dict[str, Any]:
    """Hypothesis on rank 0 only: each example it draws (``draw(data)``) is sent to every rank, which run
    ``body(example)`` together (builds and collectives in step) and return the same mismatches, computed from data
    gathered over the ranks; rank 0's verdict goes back to every rank. Two Hypothesis engines, one per rank, drift
    apart even with one seed and one database (seen: the same outcomes, different draws from the 8th example on,
    after another suite had run in the ranks), and then the ranks' collectives no longer match: one engine only.

    Returns:
        ``{"status", "examples", "failure"}``; a failure carries Hypothesis's falsifying example.
    """
    import torch.distributed as dist
    from hypothesis import given, seed
    from hypothesis import strategies as st

    if dist.get_rank() != 0:
        while True:
            command, payload = _broadcast()
            if command == "stop":
                return dict(payload)
            body(payload)
    count = [0]

    @_settings(name, version)
    @given(st.data())
    def test(data: Any) -> None:
        example = draw(data)
        count[0] += 1
        _broadcast(("run", example))
        bad = body(example)
        assert not bad, "; ".join(bad[:4])

    try:
        seed(_seed(version, name))(test)()
        result: dict[str, Any] = {"status": "pass", "examples": count[0], "failure": None}
    except Exception as exc:  # the falsifying example is in the exception's notes
        result = {"status": "fail", "examples": count[0], "failure": "".join(traceback.format_exception(exc))[-6000:]}
    _broadcast(("stop", result))
    return result


# ------------------------------------------------------------------------------------------------- properties
def observe_schedule(build: dict[str, Any], sched: dict[str, Any]) -> dict[str, Any]:
    """Build the optimizer, run the scheduler ``steps`` steps (resumed from its ``state_dict`` into a new scheduler
    at ``resume_at``); per parameter its (lr, wd) at every step, and raw Megatron's where it accepts the groups."""
    from mcore_compat import rank0, symbols, training
    from mcore_compat.capabilities import has

    chunks, optimizer = _build(build)
    shapes = {n: list(p.shape) for n, p in _named(chunks).items()}
    kwargs = {k: v for k, v in sched.items() if k not in ("resume_at", "steps")}
    lacks_style = sched["lr_wsd_decay_style"] == "minus_sqrt" and not has("scheduler_wsd_minus_sqrt")
    # Where mcore_compat deliberately differs from the release's scheduler (a warmup from init_lr > 0 with scaled
    # groups before 0.16: 0.16's meaning everywhere), it must say so in a warning instead of matching it.
    differs = (has("megatron_scheduler") and not has("scheduler_ignores_lr_mult") and sched["init_lr"] > 0
               and sched["lr_warmup_steps"] > 0 and any(g.get("lr_mult", 1.0) != 1.0 for g in optimizer.param_groups))
    raw_accepts = has("megatron_scheduler") and not lacks_style and not differs and all(
        g.get("min_lr") is not None and g.get("max_lr") is not None for g in optimizer.param_groups)
    raw_groups = [dict(g, params=[]) for g in optimizer.param_groups] if raw_accepts else None
    def groups(param_groups: list[dict[str, Any]]) -> list[list[float]]:
        return [[float(g["lr"]), float(g["weight_decay"])] for g in param_groups]

    for key in [k for k in rank0._WARNED if k[0].startswith("optimizer_param_scheduler: init_lr=")]:
        rank0._WARNED.discard(key)  # this warning may come afresh in every example (it is once per process)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scheduler = training.optimizer_param_scheduler(optimizer, **kwargs)
    said = [str(w.message) for w in caught if "init_lr" in str(w.message) and "lr_mult" in str(w.message)]
    seen, ours = [_table(optimizer, chunks)], [groups(optimizer.param_groups)]
    for n in range(1, sched["steps"] + 1):
        if n == sched["resume_at"]:
            state = scheduler.state_dict()
            scheduler = training.optimizer_param_scheduler(optimizer, **kwargs)
            scheduler.load_state_dict(state)
        scheduler.step(1)
        seen.append(_table(optimizer, chunks))
        ours.append(groups(optimizer.param_groups))
    raw = None
    if raw_groups is not None:  # the release's own scheduler on a copy of the groups as built, never resumed
        class _Opt:
            param_groups = raw_groups

        raw_sched = symbols.resolve("OptimizerParamScheduler")(_Opt(), **kwargs)
        raw = [groups(raw_groups)]
        for _ in range(sched["steps"]):
            raw_sched.step(1)
            raw.append(groups(raw_groups))
    _release(chunks)
    said_anywhere = any(_all_ranks(bool(said)))  # the warning comes from rank 0 only
    return {"shapes": shapes, "seen": [{k: list(v) for k, v in t.items()} for t in seen], "raw": raw,
            "groups": ours, "differs": differs, "said": said_anywhere}


def schedule_mismatches(build: dict[str, Any], sched: dict[str, Any], observed: dict[str, Any]) -> list[str]:
    """What ``observed`` (from :func:`observe_schedule`) gets wrong against the spec, in words."""
    spec = O.Schedule(**{k: v for k, v in sched.items() if k not in ("resume_at", "steps")})
    bad = []
    for name, shape in observed["shapes"].items():
        want = O.trajectory(rule_of(name, shape, build), sched["steps"], spec, lr=build["lr"],
                            min_lr=build["min_lr"], decoupled_lr=build["decoupled_lr"],
                            decoupled_min_lr=build["decoupled_min_lr"],
                            lr_mult=build["lr_mult"] if build["scale"] else 1.0)
        for step, (table, (lr, wd)) in enumerate(zip(observed["seen"], want, strict=True)):
            got = table.get(name)
            if got is None or len(got) != 2 or not (_close(got[0], lr) and _close(got[1], wd)):
                bad.append(f"{name} at step {step}: (lr, wd) = {got}, the spec gives ({lr!r}, {wd!r})")
                break
    return bad


def raw_mismatches(observed: dict[str, Any]) -> list[str]:
    """Where raw Megatron accepts the groups, the adapter must give exactly its values; where mcore_compat
    deliberately differs, it must have said so in its one-line warning."""
    bad = []
    raw = observed["raw"]
    if raw is not None:
        for step, (mine, theirs) in enumerate(zip(observed["groups"], raw, strict=True)):
            if mine != theirs:
                bad.append(f"step {step}: the groups' (lr, wd) {mine} differ from raw Megatron's {theirs}")
                break
    if observed["differs"] != observed["said"]:
        bad.append("a warmup from init_lr > 0 with scaled groups differs from this release's scheduler "
                   f"(differs={observed['differs']}) but the one-line warning was given={observed['said']}")
    return bad


def _schedule_property(version: str) -> dict[str, Any]:
    _, builds, schedules = _strategies()

    def draw(data: Any) -> dict[str, Any]:
        build = data.draw(builds, label="build")
        return {"build": build, "schedule": data.draw(schedules(build), label="schedule")}

    def body(example: dict[str, Any]) -> list[str]:
        observed = observe_schedule(example["build"], example["schedule"])
        return schedule_mismatches(example["build"], example["schedule"], observed) + raw_mismatches(observed)

    return _run_property("schedule", version, draw, body)


# One change that makes a valid draw invalid: (the setting the one-line message must name, the changes as a
# function of the valid settings). The optimizer's are set on the OptimConfig; the scheduler's on its arguments.
Changes = Callable[[dict[str, Any]], dict[str, Any]]
INVALID_OPTIMIZER: dict[str, tuple[str, Changes]] = {
    "lr negative": ("lr", lambda b: {"lr": -b["lr"]}),
    "lr nan": ("lr", lambda b: {"lr": math.nan}),
    "lr inf": ("lr", lambda b: {"lr": math.inf}),
    "lr a string (a config file's unparsed value)": ("lr", lambda b: {"lr": f"{b['lr']}"}),
    "min_lr above lr": ("min_lr", lambda b: {"min_lr": 2 * b["lr"]}),
    "min_lr negative": ("min_lr", lambda b: {"min_lr": -b["lr"] / 10}),
    "decoupled_lr negative": ("decoupled_lr", lambda b: {"decoupled_lr": -1e-4}),
    "decoupled_min_lr above decoupled_lr": ("decoupled_min_lr", lambda b: {
        "decoupled_lr": b["decoupled_lr"] or b["lr"], "decoupled_min_lr": 2 * (b["decoupled_lr"] or b["lr"])}),
    "weight_decay negative": ("weight_decay", lambda b: {"weight_decay": -0.01}),
    "weight_decay None": ("weight_decay", lambda b: {"weight_decay": None}),
    "clip_grad negative": ("clip_grad", lambda b: {"clip_grad": -1.0}),
    "clip_grad None": ("clip_grad", lambda b: {"clip_grad": None}),
    "adam_beta1 one": ("adam_beta1", lambda b: {"adam_beta1": 1.0}),
    "adam_beta1 negative": ("adam_beta1", lambda b: {"adam_beta1": -0.1}),
    "adam_beta2 above one": ("adam_beta2", lambda b: {"adam_beta2": 1.5}),
    "adam_eps negative": ("adam_eps", lambda b: {"adam_eps": -b["eps"]}),
    "fp16 and bf16": ("fp16", lambda b: {"fp16": True, "bf16": True}),
    "static loss_scale zero": ("loss_scale", lambda b: {"fp16": True, "bf16": False, "loss_scale": 0.0}),
    "dynamic scaler min above initial": ("min_loss_scale", lambda b: {
        "fp16": True, "bf16": False, "initial_loss_scale": 2.0**16, "min_loss_scale": 2.0**17}),
    "dynamic scaler hysteresis zero": ("hysteresis", lambda b: {"fp16": True, "bf16": False, "hysteresis": 0}),
    "a field no release has": ("adam_beta3", lambda b: {"extra": {"adam_beta3": 0.99}}),
    "a misspelt field": ("use_distributed_optimiser", lambda b: {"extra": {"use_distributed_optimiser": True}}),
}
INVALID_SCHEDULE: dict[str, tuple[str, Changes]] = {
    "min_lr above max_lr": ("min_lr", lambda s: {"min_lr": 2 * s["max_lr"]}),
    "min_lr None": ("min_lr", lambda s: {"min_lr": None}),
    "min_lr negative": ("min_lr", lambda s: {"min_lr": -s["max_lr"] / 10}),
    "max_lr nan": ("max_lr", lambda s: {"max_lr": math.nan}),
    "max_lr negative": ("max_lr", lambda s: {"max_lr": -s["max_lr"], "min_lr": 0.0, "init_lr": 0.0}),
    "init_lr above max_lr": ("init_lr", lambda s: {"init_lr": 2 * s["max_lr"]}),
    "init_lr negative": ("init_lr", lambda s: {"init_lr": -s["max_lr"]}),
    "warmup as long as the decay": ("lr_warmup_steps", lambda s: {"lr_warmup_steps": s["lr_decay_steps"]}),
    "warmup negative": ("lr_warmup_steps", lambda s: {"lr_warmup_steps": -1}),
    "no decay steps": ("lr_decay_steps", lambda s: {"lr_decay_steps": 0, "lr_warmup_steps": 0}),
    "decay steps a string": ("lr_decay_steps", lambda s: {"lr_decay_steps": str(s["lr_decay_steps"])}),
    "unknown lr style": ("lr_decay_style", lambda s: {"lr_decay_style": "cosinus"}),
    "WSD without decay steps": ("wsd_decay_steps", lambda s: {
        "lr_decay_style": "WSD", "wsd_decay_steps": None, "lr_wsd_decay_style": "linear"}),
    "WSD with an unknown sub-style": ("lr_wsd_decay_style", lambda s: {
        "lr_decay_style": "WSD", "wsd_decay_steps": 1, "lr_wsd_decay_style": "cosinus"}),
    "WSD decay steps negative": ("wsd_decay_steps", lambda s: {
        "lr_decay_style": "WSD", "wsd_decay_steps": -1, "lr_wsd_decay_style": "linear"}),
    "start_wd above end_wd": ("start_wd", lambda s: {
        "wd_incr_style": "linear", "start_wd": s["end_wd"] + 0.1}),
    "start_wd negative": ("start_wd", lambda s: {"wd_incr_style": "linear", "start_wd": -0.1}),
    "end_wd nan": ("end_wd", lambda s: {"end_wd": math.nan}),
    "constant wd that changes": ("start_wd", lambda s: {
        "wd_incr_style": "constant", "start_wd": 0.0, "end_wd": 0.1}),
    "unknown wd style": ("wd_incr_style", lambda s: {"wd_incr_style": "linearly"}),
    "increasing wd over no steps": ("wd_incr_steps", lambda s: {
        "wd_incr_style": "cosine", "wd_incr_steps": 0, "start_wd": 0.0, "end_wd": 0.1}),
    "override and use_checkpoint": ("override_opt_param_scheduler", lambda s: {
        "override_opt_param_scheduler": True, "use_checkpoint_opt_param_scheduler": True}),
}


#: The valid draw every invalid change is applied to once per session (a decoupled embedding, a scaled linear
#: layer, a WSD schedule with a weight-decay increment).
BASE_BUILD: dict[str, Any] = {
    "lr": 1e-3, "min_lr": 1e-4, "decoupled_lr": 2e-3, "decoupled_min_lr": 1e-4, "weight_decay": 0.1, "no_wd": "default",
    "scale": True, "lr_mult": 2.0, "distopt": True, "bf16": True, "clip_grad": 1.0, "beta1": 0.9, "beta2": 0.95,
    "eps": 1e-8, "decoupled_wd": True}
BASE_SCHEDULE: dict[str, Any] = {
    "init_lr": 0.0, "max_lr": 1e-3, "min_lr": 1e-4, "lr_warmup_steps": 2, "lr_decay_steps": 10,
    "lr_decay_style": "WSD", "start_wd": 0.05, "end_wd": 0.1, "wd_incr_steps": 10, "wd_incr_style": "linear",
    "wsd_decay_steps": 4, "lr_wsd_decay_style": "cosine", "resume_at": 0, "steps": 12}


def _snapshot(optimizer: Any) -> list[dict[str, Any]]:
    """The param groups' settings (everything but the parameters), to tell that nothing was changed."""
    return [{k: repr(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def observe_invalid(build: dict[str, Any], sched: dict[str, Any], case: str) -> dict[str, Any]:
    """Apply the invalid change ``case`` to a valid draw: ``{"error": type name, "message", "changed": whether
    the groups' settings changed}`` (``error`` None when nothing was raised)."""
    from mcore_compat import training

    out: dict[str, Any] = {"error": None, "message": "", "changed": False}
    if case in INVALID_OPTIMIZER:
        changes = INVALID_OPTIMIZER[case][1](build)
        try:
            chunks, optimizer = _build(build, changes)
        except Exception as exc:
            return {**out, "error": type(exc).__name__, "message": str(exc)}
        _release(chunks)
        return out
    chunks, optimizer = _build(build)
    before = _snapshot(optimizer)
    kwargs = {k: v for k, v in sched.items() if k not in ("resume_at", "steps")}
    kwargs.update(INVALID_SCHEDULE[case][1](sched))
    try:
        training.optimizer_param_scheduler(optimizer, **kwargs)
    except Exception as exc:
        out.update(error=type(exc).__name__, message=str(exc))
    out["changed"] = _snapshot(optimizer) != before
    _release(chunks)
    return out


def invalid_mismatches(case: str, observed: dict[str, Any]) -> list[str]:
    """What ``observed`` (from :func:`observe_invalid`) gets wrong: the refusal must be an InvalidArgumentError
    in one line that names the setting, with nothing changed."""
    setting = {**INVALID_OPTIMIZER, **INVALID_SCHEDULE}[case][0]
    bad = []
    if observed["error"] != "InvalidArgumentError":
        bad.append(f"{case}: raised {observed['error']} ({observed['message'][:200]!r}), not InvalidArgumentError")
    elif "\n" in observed["message"] or setting not in observed["message"]:
        bad.append(f"{case}: the message is not one line naming {setting}: {observed['message']!r}")
    if observed["changed"]:
        bad.append(f"{case}: the param groups changed before the refusal")
    return bad


def _invalid_property(version: str) -> dict[str, Any]:
    st, builds, schedules = _strategies()
    cases = sorted(INVALID_OPTIMIZER) + sorted(INVALID_SCHEDULE)
    # Every change once on one valid draw (the drawn examples below may miss some), then drawn ones.
    bad = [m for case in cases for m in invalid_mismatches(case, observe_invalid(BASE_BUILD, BASE_SCHEDULE, case))]
    if bad:
        return {"status": "fail", "examples": len(cases), "failure": "every change on the base draw: " +
                "; ".join(bad)}

    def draw(data: Any) -> dict[str, Any]:
        build = data.draw(builds, label="build")
        sched = data.draw(schedules(build), label="schedule")
        return {"build": build, "schedule": sched, "case": data.draw(st.sampled_from(cases), label="invalid change")}

    def body(example: dict[str, Any]) -> list[str]:
        case = example["case"]
        return invalid_mismatches(case, observe_invalid(example["build"], example["schedule"], case))

    result = _run_property("invalid", version, draw, body)
    return {**result, "examples": result["examples"] + len(cases)}


# ------------------------------------------------------------------------------------------ the optimizer update
def _tokens(rank: int, step: int) -> Any:
    import torch

    return torch.randint(0, 6, (4, 3), generator=torch.Generator().manual_seed(100 * step + rank))


def _loss(out: Any) -> Any:
    return (out.float() ** 2).mean()


def reference_grads(params: dict[str, Any], step: int, world: int) -> dict[str, list[float]]:
    """The data-parallel average of every rank's gradient, from a float64 replica of the tiny model in plain
    torch (the model's weights as they are, every rank's tokens): shares no code with Megatron or mcore_compat."""
    import torch

    leaves = {n: p.detach().to(torch.float64).clone().requires_grad_(True) for n, p in params.items()}
    total = None
    for rank in range(world):
        h = leaves["embedding"][_tokens(rank, step)] * leaves["norm"]
        loss = _loss(h @ leaves["fc.weight"].t() + leaves["fc.bias"]) / world
        total = loss if total is None else total + loss
    assert total is not None
    total.backward()
    return {n: [float(x) for x in leaf.grad.reshape(-1)] for n, leaf in leaves.items()}


def _main_state(optimizer: Any, chunks: list[Any]) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Every parameter's fp32 main values and the gradient the optimizer will read, merged over the ranks (the
    distributed optimizer's shards put together), read through mcore_compat's optimizer view (a reader: a bug in
    it shows as a mismatch, it cannot hide a wrong update)."""
    from mcore_compat._optimizer_view import optimizer_view

    named = _named(chunks)
    view = optimizer_view(optimizer, {p: n for n, p in named.items()})
    assert view.unsupported is None, view.unsupported
    mine = []
    for mp in view:
        grad = mp.finalized_grad()
        mine.append((mp.name, mp.start, [float(x) for x in mp.main.detach().reshape(-1)],
                     None if grad is None else [float(x) for x in grad.reshape(-1)]))
    values = {n: [math.nan] * p.numel() for n, p in named.items()}
    grads = {n: [math.nan] * p.numel() for n, p in named.items()}
    for part in _all_ranks(mine):
        for name, start, main, grad in part:
            offset = start or 0
            values[name][offset:offset + len(main)] = main
            grads[name][offset:offset + len(main)] = grad if grad is not None else [0.0] * len(main)
    return values, grads


def _norm_rel_error(a: list[float], b: list[float]) -> float:
    diff = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b, strict=True)))
    return diff / max(math.sqrt(sum(y * y for y in b)), 1e-30)


def observe_update(build: dict[str, Any], steps: int) -> dict[str, Any]:
    """Build the optimizer, train ``steps`` steps (forward, backward, ``finalize_model_grads``,
    ``optimizer_step``) on the ranks' own tokens: the main values before the first step, the gradients and the
    reported grad norm of every step, the main values after the last, and every step's reference gradients.
    ``{"refused": message}`` when the release refuses the settings."""
    import torch.distributed as dist

    from mcore_compat import training
    from mcore_compat.errors import UnsupportedVersionError

    try:
        chunks, optimizer = _build(build)
    except UnsupportedVersionError as exc:
        return {"refused": str(exc)}
    named = _named(chunks)
    start, _ = _main_state(optimizer, chunks)
    out: dict[str, Any] = {"refused": None, "start": start, "grads": [], "norms": [], "reference": []}
    for step in range(steps):
        training.finish_param_sync(chunks, optimizer)  # overlap_param_gather: the weights gathered before reading
        out["reference"].append(reference_grads(named, step, dist.get_world_size()))
        training.zero_grad_buffer(chunks, optimizer)
        _loss(chunks[0](_tokens(dist.get_rank(), step))).backward()
        training.finalize_model_grads(chunks)
        out["grads"].append(_main_state(optimizer, chunks)[1])
        ok, norm, _ = training.optimizer_step(optimizer)
        assert ok, "the optimizer step was skipped"
        out["norms"].append(None if norm is None else float(norm))
    out["end"] = _main_state(optimizer, chunks)[0]
    out["shapes"] = {n: list(p.shape) for n, p in named.items()}
    _release(chunks)
    return out


def build_hyper(build: dict[str, Any], shapes: dict[str, list[int]]) -> dict[str, tuple[float, float]]:
    """The spec's (lr, weight decay) of every parameter as built (no scheduler)."""
    spec = O.Schedule(init_lr=0.0, max_lr=build["lr"], min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=1,
                      lr_decay_style="constant", start_wd=0.0, end_wd=0.0, wd_incr_steps=0,
                      wd_incr_style="constant")
    hyper = {}
    for name, shape in shapes.items():
        rule = rule_of(name, shape, build)
        peak, _ = O.bounds(rule, lr=build["lr"], min_lr=build["min_lr"], decoupled_lr=build["decoupled_lr"],
                           decoupled_min_lr=build["decoupled_min_lr"],
                           lr_mult=build["lr_mult"] if build["scale"] else 1.0, s=spec)
        hyper[name] = (peak, 0.0 if rule.no_decay else build["weight_decay"])
    return hyper


def update_mismatches(build: dict[str, Any], observed: dict[str, Any]) -> list[str]:
    """What ``observed`` (from :func:`observe_update`) gets wrong against the spec: each step's gradient against
    the float64 replica's (norm-wise, 1e-5 in fp32, 3e-2 in bf16), the reported grad norm against the gradients'
    (where clipping is on), and the main values after the steps against Adam in float64 from the same start and
    the gradients the optimizer read, with each parameter's (lr, weight decay) from the spec's grouping."""
    if observed["refused"] is not None:
        try:  # the release's own OptimizerConfig says whether it has the field (none on 0.4/0.5)
            from megatron.core.optimizer import OptimizerConfig
            fields = {f.name for f in dataclasses.fields(OptimizerConfig)}
        except ImportError:
            fields = set()
        if build["decoupled_wd"] or "decoupled_weight_decay" in fields:
            return [f"refused settings the release supports: {observed['refused']}"]
        return []
    bad = []
    grad_tol = 3e-2 if build["bf16"] else 1e-5
    for step, (got, want) in enumerate(zip(observed["grads"], observed["reference"], strict=True)):
        for name in want:
            err = _norm_rel_error(got[name], want[name])
            if not err <= grad_tol:
                bad.append(f"step {step}: {name}'s gradient is {err:.2e} (norm-wise) from the float64 replica's")
        if build["clip_grad"] > 0 and observed["norms"][step] is not None:
            norm = math.sqrt(sum(g * g for gs in got.values() for g in gs))
            if not math.isclose(observed["norms"][step], norm, rel_tol=1e-5):
                bad.append(f"step {step}: reported grad norm {observed['norms'][step]!r}, the gradients' is {norm!r}")
    hyper = build_hyper(build, observed["shapes"])
    adam = O.Adam(beta1=build["beta1"], beta2=build["beta2"], eps=build["eps"], decoupled=build["decoupled_wd"],
                  clip_grad=build["clip_grad"])
    want_end = O.adam_steps(observed["start"], observed["grads"], [hyper] * len(observed["grads"]), adam)
    for name, values in observed["end"].items():
        lr = hyper[name][0]
        for i, (got_v, want_v, was) in enumerate(zip(values, want_end[name], observed["start"][name], strict=True)):
            # fp32 arithmetic: a few ulp of the value, and a relative 1e-4 of the steps taken
            tol = 4 * 2.0 ** -23 * max(abs(want_v), abs(was)) + 1e-4 * lr * len(observed["grads"])
            if not abs(got_v - want_v) <= tol:
                bad.append(f"{name}[{i}] after {len(observed['grads'])} step(s): {got_v!r}, Adam gives {want_v!r} "
                           f"(from {was!r}, lr {lr!r}, wd {hyper[name][1]!r})")
                break
    return bad


def _update_property(version: str) -> dict[str, Any]:
    st, builds, _ = _strategies()

    def draw(data: Any) -> dict[str, Any]:
        build = dict(data.draw(builds, label="build"))
        build["decoupled_wd"] = data.draw(st.booleans(), label="decoupled weight decay")
        build["ddp"] = {
            "bucket_size": data.draw(st.sampled_from([None, 40, 200]), label="bucket_size"),
            "overlap_grad_reduce": data.draw(st.booleans(), label="overlap_grad_reduce"),
            "grad_reduce_in_fp32": data.draw(st.booleans(), label="grad_reduce_in_fp32") if build["bf16"] else False,
            "average_in_collective": data.draw(st.booleans(), label="average_in_collective"),
            "overlap_param_gather": data.draw(st.booleans(), label="overlap_param_gather") if build["distopt"]
            else False}
        return {"build": build, "steps": data.draw(st.integers(1, 3), label="steps")}

    def body(example: dict[str, Any]) -> list[str]:
        return update_mismatches(example["build"], observe_update(example["build"], example["steps"]))

    return _run_property("update", version, draw, body)


# ------------------------------------------------------------------------------------------ the committed cases
REFERENCE = HERE / "data" / "generated" / "reference.json"
#: The release whose observations of :data:`COMMITTED` are committed in :data:`REFERENCE`
#: (``python scripts/generated_reference.py`` writes them, ``--check`` compares).
REFERENCE_RELEASE = "0.16.1"
_COMMITTED_BUILD = {"weight_decay": 0.1, "no_wd": "default", "scale": False, "lr_mult": 2.0, "distopt": False,
             "bf16": False, "clip_grad": 1.0, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "decoupled_wd": True,
             "decoupled_lr": None, "decoupled_min_lr": None}
_CONSTANT_WD = {"start_wd": 0.1, "end_wd": 0.1, "wd_incr_steps": 10, "wd_incr_style": "constant",
                "wsd_decay_steps": None, "lr_wsd_decay_style": None, "resume_at": 0}


def _case(build: dict[str, Any], schedule: dict[str, Any], steps: int) -> dict[str, Any]:
    sched = {**_CONSTANT_WD, **schedule}
    return {"build": {**_COMMITTED_BUILD, **build}, "schedule": {**sched, "steps": sched["lr_decay_steps"] + 2},
            "steps": steps}


#: Cases replayed in every release session and compared with all three oracles (the spec, raw Megatron, the
#: reference release's record): the settings that broke a release, kept as regression cases, and a spread of the
#: settings users train with.
COMMITTED: dict[str, dict[str, Any]] = {
    # OptimConfig(lr=1e-2) with min_lr only given to the scheduler: raw 0.6+ failed at the second step
    # (max_lr - None), 0.4/0.5 decayed to 0
    "min_lr given to the scheduler only, cosine": _case(
        {"lr": 1e-2, "min_lr": None},
        {"init_lr": 0.0, "max_lr": 1e-2, "min_lr": 1e-3, "lr_warmup_steps": 1, "lr_decay_steps": 10,
         "lr_decay_style": "cosine"}, 2),
    # 0.9-0.12's scheduler leaves minus_sqrt's coefficient unset (UnboundLocalError inside get_lr)
    "WSD minus_sqrt with a decoupled embedding": _case(
        {"lr": 1e-3, "min_lr": 1e-4, "decoupled_lr": 3e-3, "decoupled_min_lr": None, "distopt": True},
        {"init_lr": 0.0, "max_lr": 1e-3, "min_lr": 1e-4, "lr_warmup_steps": 2, "lr_decay_steps": 8,
         "lr_decay_style": "WSD", "wsd_decay_steps": 3, "lr_wsd_decay_style": "minus_sqrt", "resume_at": 5}, 2),
    # before 0.16 a scaled group warmed up from init_lr * lr_mult (found by the schedule property on 0.12.3)
    "warmup from init_lr > 0 in a scaled group": _case(
        {"lr": 7.81e-4, "min_lr": None, "scale": True, "lr_mult": 0.5, "bf16": True, "distopt": True},
        {"init_lr": 7.81e-4, "max_lr": 7.81e-4, "min_lr": 0.0, "lr_warmup_steps": 1, "lr_decay_steps": 2,
         "lr_decay_style": "linear", "start_wd": 0.0, "end_wd": 0.01, "wd_incr_steps": 1,
         "wd_incr_style": "linear"}, 1),
    "bf16, distributed optimizer, clipping, coupled decay where the release has it": _case(
        {"lr": 1e-5, "min_lr": 1e-6, "bf16": True, "distopt": True, "clip_grad": 1e-3, "beta2": 0.95,
         "decoupled_wd": False, "no_wd": "biases"},
        {"init_lr": 1e-6, "max_lr": 1e-5, "min_lr": 1e-6, "lr_warmup_steps": 3, "lr_decay_steps": 9,
         "lr_decay_style": "inverse-square-root", "start_wd": 0.0, "end_wd": 0.1, "wd_incr_steps": 6,
         "wd_incr_style": "cosine", "resume_at": 4}, 3),
    "fp32, RL learning rate, no clipping, scaled linear layer": _case(
        {"lr": 1e-6, "min_lr": 1e-7, "scale": True, "lr_mult": 3.0, "clip_grad": 0.0, "eps": 1e-5,
         "weight_decay": 0.01},
        {"init_lr": 0.0, "max_lr": 1e-6, "min_lr": 1e-7, "lr_warmup_steps": 0, "lr_decay_steps": 6,
         "lr_decay_style": "linear", "start_wd": 0.01, "end_wd": 0.01, "resume_at": 3}, 2),
}


def observe_committed() -> dict[str, Any]:
    """Every committed case observed on this rank's release: ``{"version", "cases": {name: {"schedule",
    "update"}}}`` (the raw observations, compared by :func:`committed_mismatches`)."""
    return _on_release(lambda version: observe_committed_here())


def reference_record(observed: dict[str, Any]) -> dict[str, Any]:
    """What :data:`REFERENCE` keeps of :func:`observe_committed`'s result on the reference release."""
    cases = {}
    for name, c in observed["cases"].items():
        update = c["update"]
        cases[name] = {"schedule": c["schedule"]["seen"],
                       "update": None if update["refused"] is not None else
                       {"start": update["start"], "end": update["end"]}}
    return {"release": observed["version"], "cases": cases}


#: The cross-release tolerance of an update, per element, in units of the parameter's learning rate, and
#: :data:`ULPS` fp32 units in the last place of its value. Measured on one CPU, 0.4.0, 0.12.3 and 0.19.2 gave the
#: reference's values within 8 ulp with no lr term at all; the margin is for other CPUs (their kernels differ by
#: a few ulp: see the checkpoint fixtures) and for bf16 models, whose gradients carry bf16 rounding.
UPDATE_TOL = {"fp32": 1e-4, "bf16": 2e-2}
ULPS = 32


def _reference_mismatches(case: dict[str, Any], observed: dict[str, Any], ref: dict[str, Any]) -> list[str]:
    """``observed`` (one committed case) against the reference release's record ``ref``."""
    bad = []
    for step, (mine, theirs) in enumerate(zip(observed["schedule"]["seen"], ref["schedule"], strict=True)):
        if set(mine) != set(theirs) or any(
                not all(_close(a, b) for a, b in zip(mine[n], theirs[n], strict=True)) for n in mine):
            bad.append(f"step {step}: (lr, wd) per parameter {mine} differ from the reference release's {theirs}")
            break
    update, ref_update = observed["update"], ref["update"]
    if (update["refused"] is None) and ref_update is not None:
        build = case["build"]
        hyper = build_hyper(build, update["shapes"])
        for name, start in update["start"].items():
            lr = hyper[name][0]
            tol = UPDATE_TOL["bf16" if build["bf16"] else "fp32"] * lr * case["steps"]
            for i, (s0, s1, r0, r1) in enumerate(zip(start, update["end"][name], ref_update["start"][name],
                                                     ref_update["end"][name], strict=True)):
                ulps = ULPS * 2.0 ** -23 * max(abs(s1), abs(r1))
                if not abs(s0 - r0) <= ulps or not abs((s1 - s0) - (r1 - r0)) <= tol + ulps:
                    bad.append(f"{name}[{i}]: from {s0!r} to {s1!r}, on the reference release from {r0!r} to "
                               f"{r1!r} (tolerance {tol:.2e})")
                    break
    return bad


def committed_mismatches(name: str, observed: dict[str, Any], reference: dict[str, Any] | None) -> list[str]:
    """One committed case against the three oracles."""
    case = COMMITTED[name]
    bad = schedule_mismatches(case["build"], case["schedule"], observed["schedule"])
    bad += raw_mismatches(observed["schedule"]) + update_mismatches(case["build"], observed["update"])
    entry = (reference or {}).get("cases", {}).get(name)
    if entry is None:
        bad.append(f"no record of the reference release for it in {REFERENCE.relative_to(HERE.parent)}: run "
                   f"python scripts/generated_reference.py")
    else:
        bad += _reference_mismatches(case, observed, entry)
    return [f"{name}: {b}" for b in bad]


def _committed_property(version: str) -> dict[str, Any]:
    try:
        reference = json.loads(REFERENCE.read_text(encoding="utf-8"))
    except FileNotFoundError:
        reference = None
    try:
        observed = observe_committed_here()
        bad = [m for name in COMMITTED for m in committed_mismatches(name, observed[name], reference)]
    except Exception as exc:
        return {"status": "fail", "examples": 0, "failure": "".join(traceback.format_exception(exc))[-6000:]}
    return {"status": "fail" if bad else "pass", "examples": len(COMMITTED),
            "failure": "; ".join(bad[:6]) if bad else None}


def observe_committed_here() -> dict[str, Any]:
    """:func:`observe_committed`'s cases, inside :func:`run_all` (model parallel already initialized)."""
    # the schedule does not depend on how decay is applied: observed with decoupled decay, which every release has
    return {name: {"schedule": observe_schedule({**c["build"], "decoupled_wd": True}, c["schedule"]),
                   "update": observe_update(c["build"], c["steps"])} for name, c in COMMITTED.items()}


def _on_release(cases: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    """``{"version", "cases": cases(version)}`` on this rank, with the CPU patches applied and model parallelism
    initialized (TP = PP = 1) around it."""
    from mcore_compat import symbols
    from mcore_compat.detect import detect

    apply_patches()
    version = str(detect().version)
    symbols.resolve("parallel_state").initialize_model_parallel()
    try:
        return {"version": version, "cases": cases(version)}
    finally:
        symbols.resolve("parallel_state").destroy_model_parallel()


def run_all() -> dict[str, Any]:
    """Every property on this rank: ``{"version", "cases": {name: result}}``."""
    return _on_release(lambda version: {
        "committed": _committed_property(version), "schedule": _schedule_property(version),
        "invalid": _invalid_property(version), "update": _update_property(version)})
