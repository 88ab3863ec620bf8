"""Generated settings for tests/test_generated_settings.py: Hypothesis draws optimizer and scheduler settings on
every rank of the session's 2-rank gloo group (DP=2), builds them through mcore_compat on the installed release
and compares what it built with three oracles.

* the spec (``_spec_oracle``: Megatron-LM's formulas in plain float64 Python);
* raw Megatron on this release, where the raw call accepts the settings (its ``OptimizerParamScheduler`` on the
  same groups, 0.9+); where mcore_compat deliberately differs, its one-line warning;
* the reference release (the committed cases only: ``committed`` below).

Properties: ``schedule`` (every parameter's lr and weight decay over a schedule, resumed in the middle, against
both oracles), ``resume`` (a restarted job's scheduler - other settings or not, ``use_checkpoint_opt_param_scheduler``,
``override_opt_param_scheduler`` or neither - loads a checkpointed one's ``state_dict`` at a drawn step: Megatron's
rules, against the spec and Megatron's own scheduler through the same resume), ``invalid`` (one change from :data:`INVALID_OPTIMIZER` or :data:`INVALID_SCHEDULE` to a valid draw
is refused with an ``InvalidArgumentError`` in one line naming the setting, before any group changes) and
``update`` (1-3 real training steps - 1-4 in fp16 - with drawn DDP settings - bucket size, ``overlap_grad_reduce``,
``grad_reduce_in_fp32``, ``average_in_collective``, ``overlap_param_gather`` -, fp32, bf16 or fp16 with a static or
dynamic loss scaler, forward, backward,
``finalize_model_grads``, ``optimizer_step``: each step's
gradient against a float64 replica of the model in plain torch, the reported grad norm against the gradients', the
fp32 main params after the steps against Adam in float64 with the spec's per-parameter lr and weight decay, coupled
or decoupled; in fp16 which steps were skipped and every step's loss scale against Megatron's scalers in plain
Python; faults it was seen to catch inside Megatron 0.16.1: the grad norm not summed over the distributed
optimizer's shards, DDP summing instead of averaging, beta2 taking beta1's value, a dynamic loss scale that never
grows). ``builders`` and ``schedules`` live in modules of their own (:data:`MODULE_PROPERTIES`).

``committed`` replays :data:`COMMITTED` (the settings that broke a release, kept as regression cases, and a spread
of what users train with) against all three oracles: the spec, raw Megatron, and the reference release's record
(:data:`REFERENCE`, written by ``scripts/generated_reference.py``, which ``--check`` compares; values within
:data:`UPDATE_TOL` and :data:`ULPS`).

Hypothesis runs on rank 0 (a fixed seed per property, the committed example database, read-only) and sends each
example to every rank (:func:`_run_property`); the ranks build the same things and decide on data gathered from
all of them. Each property
returns ``{"status", "examples", "failure"}``; a failure carries Hypothesis's falsifying example.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import math
import os
import traceback
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _generated_reference as R
import _spec_oracle as O
from _training_scenarios import apply_patches

HERE = Path(__file__).resolve().parent
DATABASE = HERE / "data" / "hypothesis"
#: Examples per property and release session (the committed cases and database entries come on top).
EXAMPLES = {"schedule": 12, "resume": 16, "overrides": 10, "invalid": 30, "update": 12}
#: Set (to anything) to let Hypothesis (on rank 0) save new failing examples into the committed database while
#: developing.
SAVE_ENV = "MCORE_COMPAT_HYPOTHESIS_SAVE"
REL = 1e-9


# ---------------------------------------------------------------------------------------------------- the model
def _dtype(precision: str) -> Any:
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def _precision(build: dict[str, Any]) -> str:
    return "fp16" if build.get("fp16") else "bf16" if build["bf16"] else "fp32"


def _model(precision: str) -> Any:
    """A tiny model with every kind of parameter the group rules tell apart: an embedding weight (decoupled lr),
    a linear weight and bias, a 1-D norm weight; its parameters in ``precision`` (fp32, bf16 or fp16)."""
    import torch

    import mcore_compat as mc

    config = mc.TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True,
                                  bf16=precision == "bf16", fp16=precision == "fp16", params_dtype=_dtype(precision))

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
    # default_skip_embedding_weight_decay (0.14/0.15's flag, on every release): embeddings too, unless a
    # no_weight_decay_cond is given
    no_decay = cond(name, None) if cond is not None else (
        name.endswith(".bias") or len(shape) == 1 or (bool(build.get("skip_embedding_wd")) and "embedding" in name))
    return O.GroupRule(decoupled=name == "embedding" and build["decoupled_lr"] is not None,
                       scaled=bool(build["scale"]) and _scale_fc(name, None), no_decay=no_decay)


def override_of(name: str, desc: dict[str, Any]) -> dict[str, Any]:
    """The spec's merged ``config_overrides`` entry of a parameter for the drawn description ``desc`` (what
    :func:`_config_overrides` builds): ``*.bias`` -> ``wd_mult``; ``*fc.*`` -> ``max_lr``/``min_lr``; the
    embedding (``is_embedding_or_output_parameter``) -> ``max_lr``/``min_lr``."""
    merged: dict[str, Any] = {}
    if name.endswith(".bias") and desc["bias_wd_mult"] is not None:
        merged["wd_mult"] = desc["bias_wd_mult"]
    if name.startswith("fc.") and desc["fc"] is not None:
        merged.update(desc["fc"])
    if name == "embedding" and desc["embedding"] is not None:
        merged.update(desc["embedding"])
    return merged


def _config_overrides(desc: dict[str, Any]) -> dict[Any, Any]:
    """Megatron's ``config_overrides`` (0.16+) for the drawn description ``desc``."""
    from mcore_compat import symbols

    key = symbols.resolve("ParamKey")
    if not key:  # before 0.16 (no ParamKey): a mapping of the same shape, which the adapter must refuse
        def key(**fields: str) -> Any:
            return tuple(fields.items())
    out: dict[Any, Any] = {}
    if desc["bias_wd_mult"] is not None:
        out[key(name="*.bias")] = {"wd_mult": desc["bias_wd_mult"]}
    if desc["fc"] is not None:
        out[key(name="*fc.*")] = dict(desc["fc"])
    if desc["embedding"] is not None:
        out[key(attr="is_embedding_or_output_parameter")] = dict(desc["embedding"])
    return out


def param_bounds(name: str, shape: list[int], build: dict[str, Any], sched: dict[str, Any]) -> tuple[float, float]:
    """The spec's (peak, floor) of a parameter under the schedule ``sched``. With ``config_overrides``
    (Megatron 0.16+'s rule): the entry's ``max_lr``/``min_lr``, else ``OptimConfig.lr``/``min_lr`` (``decoupled_lr``
    is not applied: the user's entries replace the standard ones), a missing floor the scheduler's."""
    spec = O.Schedule(**{k: v for k, v in sched.items() if k not in ("resume_at", "steps")})
    if build.get("overrides") is not None:
        entry = override_of(name, build["overrides"])
        floor = entry.get("min_lr", build["min_lr"])
        return entry.get("max_lr", build["lr"]), spec.min_lr if floor is None else floor
    return O.bounds(rule_of(name, shape, build), lr=build["lr"], min_lr=build["min_lr"],
                    decoupled_lr=build["decoupled_lr"], decoupled_min_lr=build["decoupled_min_lr"],
                    lr_mult=build["lr_mult"] if build["scale"] else 1.0, s=spec)


#: The tiny model's parameters and shapes (what :func:`_model` builds).
SHAPES = {"embedding": [6, 8], "fc.weight": [8, 8], "fc.bias": [8], "norm": [8]}


def param_trajectory(name: str, shape: list[int], build: dict[str, Any], sched: dict[str, Any],
                     steps: int) -> list[tuple[float, float]]:
    """The spec's (lr, weight decay) of a parameter at steps ``0 .. steps``."""
    spec = O.Schedule(**{k: v for k, v in sched.items() if k not in ("resume_at", "steps")})
    if build.get("overrides") is None:
        return O.trajectory(rule_of(name, shape, build), steps, spec, lr=build["lr"], min_lr=build["min_lr"],
                            decoupled_lr=build["decoupled_lr"], decoupled_min_lr=build["decoupled_min_lr"],
                            lr_mult=build["lr_mult"] if build["scale"] else 1.0)
    peak, floor = param_bounds(name, shape, build, sched)
    wd_mult = float(override_of(name, build["overrides"]).get("wd_mult", 1.0))
    return [(O.lr_at(n, spec, peak, floor), O.wd_at(n, spec) * wd_mult) for n in range(steps + 1)]


def decays_upwards(build: dict[str, Any], sched: dict[str, Any]) -> list[str]:
    """The parameters whose floor is above their peak under ``sched`` (the scheduler refuses such groups)."""
    return [n for n, shape in SHAPES.items() if (lambda b: b[1] > b[0])(param_bounds(n, shape, build, sched))]


def _build(build: dict[str, Any], changes: dict[str, Any] | None = None) -> tuple[list[Any], Any]:
    """The DDP-wrapped tiny model and the optimizer built for ``build``; ``changes`` are set on the
    ``OptimConfig`` after it is made (the invalid-settings property's mutations)."""
    from mcore_compat import training

    precision, distopt = _precision(build), bool(build["distopt"])
    # the update property draws the DDP settings and fp16's loss scaler
    ddp = {"grad_reduce_in_fp32": precision != "fp32", **build.get("ddp", {})}
    chunks = training.wrap_ddp([_model(precision)], ddp_config=training.DDPConfig(use_distributed_optimizer=distopt,
                                                                             **ddp))
    config = training.OptimConfig(
        optimizer="adam", lr=build["lr"], min_lr=build["min_lr"], decoupled_lr=build["decoupled_lr"],
        decoupled_min_lr=build["decoupled_min_lr"], weight_decay=build["weight_decay"], clip_grad=build["clip_grad"],
        adam_beta1=build["beta1"], adam_beta2=build["beta2"], adam_eps=build["eps"],
        decoupled_weight_decay=build["decoupled_wd"], use_distributed_optimizer=distopt, bf16=precision == "bf16",
        fp16=precision == "fp16", params_dtype=_dtype(precision), **build.get("scaler", {}))
    for name, value in (changes or {}).items():
        setattr(config, name, value)
    kwargs: dict[str, Any] = {}
    if NO_WD_CONDS[build["no_wd"]] is not None:
        kwargs["no_weight_decay_cond"] = NO_WD_CONDS[build["no_wd"]]
    if build["scale"]:
        kwargs.update(scale_lr_cond=_scale_fc, lr_mult=build["lr_mult"])
    if build.get("overrides") is not None:
        kwargs["config_overrides"] = _config_overrides(build["overrides"])
    if build.get("skip_embedding_wd"):
        kwargs["default_skip_embedding_weight_decay"] = True
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
            "skip_embedding_wd": draw(st.booleans()),
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
    examples = EXAMPLES[name] if name in EXAMPLES else importlib.import_module(MODULE_PROPERTIES[name]).EXAMPLES
    from hypothesis import HealthCheck, settings
    from hypothesis.database import DirectoryBasedExampleDatabase, ReadOnlyDatabase

    db: Any = DirectoryBasedExampleDatabase(DATABASE)
    if not os.environ.get(SAVE_ENV):
        db = ReadOnlyDatabase(db)
    return settings(max_examples=examples, deadline=None, database=db, print_blob=True,
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


@contextlib.contextmanager
def _no_local_constants() -> Iterator[None]:
    """Hypothesis draws some values from the constants it reads in the source of every module loaded from outside
    site-packages (``hypothesis.internal.conjecture.providers._get_local_constants``): Megatron's tree on
    ``sys.path`` and whatever the ranks ran before. So one seed drew other examples on other releases (2 of 30
    ``invalid`` examples differed between 0.4.0 and 0.16.1) and after other suites. Without them the draws depend
    only on the seed and the example database, and every release sees the examples the reference release
    recorded. A private function of the pinned Hypothesis (ci/matrix_env.py): if it moves, this fails loudly."""
    from hypothesis.internal.conjecture import providers
    from hypothesis.internal.constants_ast import Constants

    real = providers._get_local_constants
    empty = Constants()
    providers._get_local_constants = lambda: empty
    providers.CONSTANTS_CACHE.cache.clear()
    try:
        yield
    finally:
        providers._get_local_constants = real
        providers.CONSTANTS_CACHE.cache.clear()


def _run_property(name: str, version: str, draw: Callable[[Any], dict[str, Any]],
                  body: Callable[[dict[str, Any]], list[str]]) -> dict[str, Any]:
    """Hypothesis on rank 0 only: each example it draws (``draw(data)``) is sent to every rank, which run
    ``body(example)`` together (builds and collectives in step) and return the same mismatches, computed from data
    gathered over the ranks; rank 0's verdict goes back to every rank. Two Hypothesis engines, one per rank, drift
    apart even with one seed and one database (seen: the same outcomes, different draws from the 8th example on,
    after another suite had run in the ranks: :func:`_no_local_constants` says why), and then the ranks'
    collectives no longer match: one engine only.

    Returns:
        ``{"status", "examples", "failure"}``; a failure carries Hypothesis's falsifying example.
    """
    import torch.distributed as dist
    from hypothesis import given, seed
    from hypothesis import strategies as st

    checked = body

    def body(example: dict[str, Any]) -> list[str]:  # an exception is a mismatch: every rank goes on to the next
        try:
            return checked(example)
        except Exception as exc:
            return [f"raised {type(exc).__name__}: {exc}"[:2000]]

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
        with _no_local_constants():
            seed(_seed(version, name))(test)()
        result: dict[str, Any] = {"status": "pass", "examples": count[0], "failure": None}
    except Exception as exc:  # the falsifying example is in the exception's notes
        result = {"status": "fail", "examples": count[0], "failure": "".join(traceback.format_exception(exc))[-6000:]}
    if name in R.COMPARED:
        result["reference"] = {**R.counts(name), "drawn": count[0]}
    _broadcast(("stop", result))
    return result


# ------------------------------------------------------------------------------------------------- properties
def observe_schedule(build: dict[str, Any], sched: dict[str, Any]) -> dict[str, Any]:
    """Build the optimizer, run the scheduler ``steps`` steps (resumed from its ``state_dict`` into a new scheduler
    at ``resume_at``); per parameter its (lr, wd) at every step, and raw Megatron's where it accepts the groups."""
    from mcore_compat import rank0, symbols, training
    from mcore_compat.capabilities import has
    from mcore_compat.errors import InvalidArgumentError

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
    before = _snapshot(optimizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            scheduler = training.optimizer_param_scheduler(optimizer, **kwargs)
        except InvalidArgumentError as exc:
            changed = _snapshot(optimizer) != before
            _release(chunks)
            return {"shapes": shapes, "refused": str(exc), "changed": changed}
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
            "groups": ours, "differs": differs, "said": said_anywhere, "refused": None}


def schedule_mismatches(build: dict[str, Any], sched: dict[str, Any], observed: dict[str, Any]) -> list[str]:
    """What ``observed`` (from :func:`observe_schedule`) gets wrong against the spec, in words."""
    upwards = decays_upwards(build, sched)
    if upwards or observed["refused"] is not None:
        if not upwards:
            return [f"refused a schedule the spec runs: {observed['refused']}"]
        if observed["refused"] is None:
            return [f"{upwards} would decay upwards (floor above peak), but the scheduler was built"]
        if "\n" in observed["refused"] or "decay upwards" not in observed["refused"] or observed["changed"]:
            return [f"the refusal of {upwards} is not one line saying so, or the groups changed: "
                    f"{observed['refused']!r}"]
        return []
    bad = []
    for name, shape in observed["shapes"].items():
        want = param_trajectory(name, shape, build, sched, sched["steps"])
        for step, (table, (lr, wd)) in enumerate(zip(observed["seen"], want, strict=True)):
            got = table.get(name)
            if got is None or len(got) != 2 or not (_close(got[0], lr) and _close(got[1], wd)):
                bad.append(f"{name} at step {step}: (lr, wd) = {got}, the spec gives ({lr!r}, {wd!r})")
                break
    return bad


def raw_mismatches(observed: dict[str, Any]) -> list[str]:
    """Where raw Megatron accepts the groups, the adapter must give exactly its values; where mcore_compat
    deliberately differs, it must have said so in its one-line warning."""
    if observed["refused"] is not None:
        return []
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
        return (schedule_mismatches(example["build"], example["schedule"], observed) + raw_mismatches(observed)
                + R.against_reference("schedule", example, schedule_observable(observed), schedule_differences))

    return _run_property("schedule", version, draw, body)


def schedule_observable(observed: dict[str, Any]) -> dict[str, Any]:
    """What the reference release's record keeps of :func:`observe_schedule`'s result."""
    return {"refused": observed["refused"] is not None, "seen": observed.get("seen")}


def schedule_differences(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    if mine["refused"] != theirs["refused"]:
        return [f"refused={mine['refused']}, on the reference release refused={theirs['refused']}"]
    return [] if mine["refused"] else R.close_tables(mine["seen"], theirs["seen"], _close, "schedule")


# ------------------------------------------------------------------------------------------------- the resume
#: The settings a scheduler's ``state_dict`` holds, in the groups a resume draws as changed together (each group
#: is valid on its own); ``init_lr`` and the WSD anneal are not in it and always come from the constructor.
STATE_GROUPS = {"bounds": ("max_lr", "min_lr"), "steps": ("lr_warmup_steps", "lr_decay_steps"),
                "style": ("lr_decay_style",), "weight decay": ("start_wd", "end_wd", "wd_incr_steps", "wd_incr_style")}
RESUME_MODES = ("use_checkpoint", "override", "neither")
_NOT_IN_STATE = ("init_lr", "wsd_decay_steps", "lr_wsd_decay_style")


def resume_spec(build: dict[str, Any], first: dict[str, Any], second: dict[str, Any],
                mode: str) -> tuple[dict[str, Any] | None, list[str]]:
    """What a scheduler built with ``second`` (and the ``mode``'s flags) follows after ``load_state_dict`` of one
    built with ``first``: (the schedule's settings, []) or (None, the settings whose refusal is expected).
    Megatron's rules: ``override`` - the constructor's; ``use_checkpoint`` - the checkpoint's; neither - they must
    be equal. Settings not in a ``state_dict`` (``init_lr``, the WSD anneal) are the constructor's. A restored
    combination the scheduler cannot run (a WSD style without its anneal, ``init_lr`` above the restored peak,
    a warmup as long as the restored decay: the message says it is the checkpoint's; a group whose floor comes
    above its peak: the message says it would decay upwards) is refused."""
    state = [n for names in STATE_GROUPS.values() for n in names]
    differ = [n for n in state if first[n] != second[n]]
    if mode == "neither" and differ:
        return None, differ
    merged = dict(second) if mode == "override" else {**second, **{n: first[n] for n in state}}
    bad = []
    if merged["lr_decay_style"] == "WSD" and (merged["wsd_decay_steps"] is None
                                              or merged["lr_wsd_decay_style"] is None):
        bad.append("WSD")
    if not merged["init_lr"] <= merged["max_lr"]:
        bad.append("init_lr")
    if not merged["lr_warmup_steps"] < merged["lr_decay_steps"]:
        bad.append("lr_warmup_steps")
    if bad:
        return None, ["checkpoint"]
    if decays_upwards(build, merged):
        return None, ["decay upwards"]
    return merged, []


def observe_resume(build: dict[str, Any], first: dict[str, Any], second: dict[str, Any], mode: str,
                   resume_at: int, steps: int) -> dict[str, Any]:
    """Run a scheduler built with ``first`` ``resume_at`` steps, then - as a restarted job does - build the
    optimizer again, a scheduler with ``second`` and the ``mode``'s flags, ``load_state_dict`` the first one's
    state and step on to ``steps``: per parameter its (lr, wd) from the resumed step on, or the refusal; raw
    Megatron's groups through the same resume where it accepts them (0.9+, every group with its own bounds)."""
    from mcore_compat import rank0, symbols, training
    from mcore_compat.capabilities import has

    flags = {"use_checkpoint_opt_param_scheduler": mode == "use_checkpoint",
             "override_opt_param_scheduler": mode == "override"}
    chunks, optimizer = _build(build)
    scheduler = training.optimizer_param_scheduler(optimizer, **first)
    scheduler.step(resume_at)
    state = scheduler.state_dict()
    _release(chunks)
    chunks, optimizer = _build(build)
    shapes = {n: list(p.shape) for n, p in _named(chunks).items()}
    resumed = training.optimizer_param_scheduler(optimizer, **second, **flags)
    before = _snapshot(optimizer)
    out: dict[str, Any] = {"shapes": shapes, "error": None, "message": "", "changed": False, "seen": [],
                           "groups": [], "raw": None}
    for key in [k for k in rank0._WARNED if k[0].startswith("optimizer_param_scheduler.load_state_dict:")]:
        rank0._WARNED.discard(key)
    megatron = symbols.resolve("OptimizerParamScheduler") if has("megatron_scheduler") else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            resumed.load_state_dict(state)
        except Exception as exc:
            out.update(error=type(exc).__name__, message=str(exc), changed=_snapshot(optimizer) != before)
    out["said"] = any(_all_ranks(any("load_state_dict" in str(w.message) for w in caught)))
    out["megatron_class"] = megatron is not None and isinstance(resumed, megatron)
    if out["error"] is None:
        for n in range(resume_at, steps + 1):
            if n > resume_at:
                resumed.step(1)
            out["seen"].append(_table(optimizer, chunks))
            out["groups"].append([[float(g["lr"]), float(g["weight_decay"])] for g in optimizer.param_groups])
        if out["megatron_class"] and all(g.get("min_lr") is not None for g in optimizer.param_groups):
            out["raw"] = _raw_resume(optimizer, first, second, flags, resume_at, steps, state)
    _release(chunks)
    return out


def _raw_resume(optimizer: Any, first: dict[str, Any], second: dict[str, Any], flags: dict[str, bool],
                resume_at: int, steps: int, state: dict[str, Any]) -> list[list[list[float]]] | None:
    """Megatron's own scheduler through the same resume, on copies of the groups as built ([lr, wd] per group per
    step from the resumed one), or None where it refuses."""
    from mcore_compat import symbols

    class _Opt:
        param_groups = [dict(g, params=[]) for g in optimizer.param_groups]

    raw = symbols.resolve("OptimizerParamScheduler")(_Opt(), **second, **flags)
    try:
        raw.load_state_dict(dict(state))
    except AssertionError:
        return None
    seen = [[[float(g["lr"]), float(g["weight_decay"])] for g in _Opt.param_groups]]
    for _ in range(resume_at, steps):
        raw.step(1)
        seen.append([[float(g["lr"]), float(g["weight_decay"])] for g in _Opt.param_groups])
    return seen


def resume_mismatches(build: dict[str, Any], first: dict[str, Any], second: dict[str, Any], mode: str,
                      resume_at: int, steps: int, observed: dict[str, Any]) -> list[str]:
    """``observed`` (from :func:`observe_resume`) against :func:`resume_spec` and raw Megatron."""
    merged, names = resume_spec(build, first, second, mode)
    if merged is None:
        if observed["error"] != "InvalidArgumentError":
            return [f"{mode}: expected a refusal naming {names}, got {observed['error']} "
                    f"{observed['message'][:200]!r}"]
        bad = [] if "\n" not in observed["message"] and all(n in observed["message"] for n in names) else [
            f"{mode}: the refusal is not one line naming {names}: {observed['message']!r}"]
        if observed["changed"]:
            bad.append(f"{mode}: the param groups changed before the refusal")
        return bad
    if observed["error"] is not None:
        return [f"{mode}: refused a resume the spec runs: {observed['error']}: {observed['message'][:300]}"]
    bad = []
    for name, shape in observed["shapes"].items():
        want = param_trajectory(name, shape, build, merged, steps)[resume_at:]
        for n, (table, (lr, wd)) in enumerate(zip(observed["seen"], want, strict=True), start=resume_at):
            got = table.get(name)
            if got is None or len(got) != 2 or not (_close(got[0], lr) and _close(got[1], wd)):
                bad.append(f"{mode}: {name} at step {n} after resuming at {resume_at}: (lr, wd) = {got}, the spec "
                           f"gives ({lr!r}, {wd!r})")
                break
    wd_changed = mode == "use_checkpoint" and any(first[n] != second[n] for n in STATE_GROUPS["weight decay"])
    if observed["said"] != (observed["megatron_class"] and wd_changed):
        bad.append(f"{mode}: restored weight-decay settings that Megatron's scheduler applies a step late "
                   f"(megatron class={observed['megatron_class']}, changed={wd_changed}) but the warning was "
                   f"given={observed['said']}")
    return bad


def _resume_property(version: str) -> dict[str, Any]:
    from hypothesis import assume

    st, builds, schedules = _strategies()

    def draw(data: Any) -> dict[str, Any]:
        build = data.draw(builds, label="build")
        first = data.draw(schedules(build), label="checkpointed schedule")
        other = data.draw(schedules(build), label="the restarted job's schedule")
        second = dict(first)
        for group, names in STATE_GROUPS.items():
            if data.draw(st.booleans(), label=f"{group} changed"):
                second.update({n: other[n] for n in names})
        if data.draw(st.booleans(), label="init_lr and WSD anneal changed"):
            second.update({n: other[n] for n in _NOT_IN_STATE})
        if second["init_lr"] > second["max_lr"] or (second["lr_decay_style"] == "WSD" and (
                second["wsd_decay_steps"] is None or second["lr_wsd_decay_style"] is None)):
            second.update({n: other[n] for n in (*_NOT_IN_STATE, "max_lr", "min_lr", "lr_decay_style")})
        if not second["lr_warmup_steps"] < second["lr_decay_steps"]:
            second.update(lr_warmup_steps=other["lr_warmup_steps"], lr_decay_steps=other["lr_decay_steps"])
        first = {k: v for k, v in first.items() if k not in ("resume_at", "steps")}
        second = {k: v for k, v in second.items() if k not in ("resume_at", "steps")}
        assume(not decays_upwards(build, first) and not decays_upwards(build, second))  # the schedule property's
        steps = max(first["lr_decay_steps"], second["lr_decay_steps"]) + 2
        return {"build": build, "first": first, "second": second,
                "mode": data.draw(st.sampled_from(RESUME_MODES), label="mode"),
                "resume_at": data.draw(st.integers(1, steps - 1), label="resume at"), "steps": steps}

    def body(e: dict[str, Any]) -> list[str]:
        observed = observe_resume(e["build"], e["first"], e["second"], e["mode"], e["resume_at"], e["steps"])
        return (resume_mismatches(e["build"], e["first"], e["second"], e["mode"], e["resume_at"], e["steps"],
                                  observed) + resume_raw_mismatches(e["first"], e["second"], e["mode"], observed)
                + R.against_reference("resume", e, {"error": observed["error"], "seen": observed["seen"]},
                                      resume_differences))

    return _run_property("resume", version, draw, body)


def resume_differences(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    if mine["error"] != theirs["error"]:
        return [f"load_state_dict raised {mine['error']}, on the reference release {theirs['error']}"]
    return R.close_tables(mine["seen"], theirs["seen"], _close, "the resumed schedule")


def resume_raw_mismatches(first: dict[str, Any], second: dict[str, Any], mode: str,
                          observed: dict[str, Any]) -> list[str]:
    """Where raw Megatron runs the same resume, the groups must get its values: from the step after the resumed
    one, and at the resumed step too unless restored weight-decay settings differ (Megatron applies them a step
    late; said by :func:`resume_mismatches`' warning check)."""
    raw = observed["raw"]
    if raw is None:
        return []
    wd_changed = mode == "use_checkpoint" and any(first[n] != second[n] for n in STATE_GROUPS["weight decay"])
    for n, (mine, theirs) in enumerate(zip(observed["groups"], raw, strict=True)):
        if (n > 0 or not wd_changed) and mine != theirs:
            return [f"{mode}: {n} step(s) after the resume the groups' (lr, wd) {mine} differ from raw "
                    f"Megatron's {theirs}"]
    return []


# ---------------------------------------------------------------------------------------- config_overrides
def observe_overrides(build: dict[str, Any], sched: dict[str, Any]) -> dict[str, Any]:
    """The schedule property's observation with the drawn ``config_overrides`` (0.16+): also the one-time
    warning about an unapplied ``decoupled_lr``, and the set of group settings (``max_lr``, ``min_lr``,
    ``wd_mult``) as mcore_compat built them and as Megatron's own ``get_megatron_optimizer`` builds them from the
    same config and overrides. Before 0.16: ``{"refused": (error type, message)}``."""
    from mcore_compat import rank0, training
    from mcore_compat.capabilities import fact

    if fact("param_groups_style") != "v16":
        try:
            chunks, _ = _build(build)
        except Exception as exc:
            return {"before_16": (type(exc).__name__, str(exc))}
        _release(chunks)
        return {"before_16": (None, "built")}
    for key in [k for k in rank0._WARNED if k[0].startswith("get_megatron_optimizer: decoupled_lr=")]:
        rank0._WARNED.discard(key)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        observed = observe_schedule(build, sched)
    observed["before_16"] = None
    try:  # with default_skip_embedding_weight_decay too: refused in one line naming both
        chunks, _ = _build({**build, "skip_embedding_wd": True})
        _release(chunks)
        observed["both"] = None
    except Exception as exc:
        observed["both"] = (type(exc).__name__, str(exc))
    observed["warned"] = any(_all_ranks(any("decoupled_lr=" in str(w.message) for w in caught)))
    settings = ("max_lr", "min_lr", "wd_mult")
    chunks, optimizer = _build(build)
    ours = sorted({tuple(g.get(k) for k in settings) for g in optimizer.param_groups}, key=repr)
    _release(chunks)
    from megatron.core.optimizer import get_megatron_optimizer as raw_builder

    chunks, _ = _build({**build, "overrides": None})  # the same model: the optimizer Megatron builds for it
    config = training.optimizer_config_of(training.OptimConfig(
        optimizer="adam", lr=build["lr"], min_lr=build["min_lr"], decoupled_lr=build["decoupled_lr"],
        decoupled_min_lr=build["decoupled_min_lr"], weight_decay=build["weight_decay"],
        use_distributed_optimizer=bool(build["distopt"]), bf16=build["bf16"], params_dtype=_dtype(_precision(build))))
    raw = raw_builder(config, chunks, config_overrides=_config_overrides(build["overrides"]))
    theirs = sorted({tuple(g.get(k) for k in settings) for g in raw.param_groups}, key=repr)
    _release(chunks)
    observed["groups_built"] = [sorted({repr(x) for r in _all_ranks(ours) for x in r}),
                                sorted({repr(x) for r in _all_ranks(theirs) for x in r})]
    return observed


def overrides_mismatches(build: dict[str, Any], sched: dict[str, Any], observed: dict[str, Any]) -> list[str]:
    """Before 0.16 one ``UnsupportedVersionError`` line naming ``config_overrides``; from 0.16 the schedule
    property's checks with the overrides' spec, Megatron's own builder's group settings, and the warning about
    ``decoupled_lr`` exactly where no entry applies it."""
    if observed["before_16"] is not None:
        kind, message = observed["before_16"]
        if kind != "UnsupportedVersionError" or "config_overrides" not in message or "\n" in message:
            return [f"before 0.16: {kind}: {message[:200]!r}, not one UnsupportedVersionError line naming "
                    f"config_overrides"]
        return []
    bad = schedule_mismatches(build, sched, observed) + raw_mismatches(observed)
    both = observed["both"]
    if both is None or both[0] != "InvalidArgumentError" or "\n" in both[1] or not all(
            n in both[1] for n in ("config_overrides", "default_skip_embedding_weight_decay")):
        bad.append(f"config_overrides with default_skip_embedding_weight_decay: {both}, not one "
                   f"InvalidArgumentError line naming both")
    ours, theirs = observed["groups_built"]
    if ours != theirs:
        bad.append(f"group settings (max_lr, min_lr, wd_mult) {ours}, Megatron's own builder gives {theirs}")
    desc = build["overrides"]
    unapplied = build["decoupled_lr"] is not None and not any(
        (desc[k] or {}).get("max_lr") == build["decoupled_lr"] for k in ("fc", "embedding"))
    if observed["warned"] != unapplied:
        bad.append(f"decoupled_lr={build['decoupled_lr']} unapplied={unapplied}, warned={observed['warned']}")
    return bad


def _overrides_property(version: str) -> dict[str, Any]:
    st, builds, schedules = _strategies()
    lr = st.floats(1e-7, 1e-2).map(lambda x: float(f"{x:.3g}"))

    def bounds(peak: Any) -> Any:
        return st.one_of(st.none(), peak.flatmap(lambda mx: st.fixed_dictionaries(
            {"max_lr": st.just(mx)}, optional={"min_lr": st.sampled_from([0.0, mx / 10, mx])})))

    def draw(data: Any) -> dict[str, Any]:
        build = dict(data.draw(builds, label="build"))
        decoupled = st.just(build["decoupled_lr"]) if build["decoupled_lr"] is not None else lr
        build.update(no_wd="default", scale=False, skip_embedding_wd=False, overrides={
            "bias_wd_mult": data.draw(st.sampled_from([None, 0.0, 0.5]), label="*.bias wd_mult"),
            "fc": data.draw(bounds(lr), label="*fc.* bounds"),
            "embedding": data.draw(bounds(st.one_of(decoupled, lr)), label="embedding bounds")})
        return {"build": build, "schedule": data.draw(schedules(build), label="schedule")}

    def body(example: dict[str, Any]) -> list[str]:
        observed = observe_overrides(example["build"], example["schedule"])
        observable = None if observed["before_16"] is not None else {
            **schedule_observable(observed), "groups_built": observed["groups_built"][0]}
        return (overrides_mismatches(example["build"], example["schedule"], observed)
                + R.against_reference("overrides", example, observable, overrides_differences))

    return _run_property("overrides", version, draw, body)


def overrides_differences(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    bad = schedule_differences(mine, theirs)
    if mine["groups_built"] != theirs["groups_built"]:
        bad.append(f"group settings (max_lr, min_lr, wd_mult) {mine['groups_built']}, on the reference release "
                   f"{theirs['groups_built']}")
    return bad


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
        observed = observe_invalid(example["build"], example["schedule"], case)
        return invalid_mismatches(case, observed) + R.against_reference(
            "invalid", example, {"error": observed["error"]},
            lambda mine, theirs: [] if mine == theirs else [f"raised {mine['error']}, on the reference release "
                                                            f"{theirs['error']}"])

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
    """Every parameter's fp32 main values and the gradient the optimizer will read (unscaled by fp16's loss
    scale), merged over the ranks (the distributed optimizer's shards put together), read through mcore_compat's
    optimizer view (a reader: a bug in it shows as a mismatch, it cannot hide a wrong update)."""
    from mcore_compat._util.optimizer_view import optimizer_view

    named = _named(chunks)
    view = optimizer_view(optimizer, {p: n for n, p in named.items()})
    assert view.unsupported is None, view.unsupported
    scale = _loss_scale(optimizer)
    mine = []
    for mp in view:
        grad = mp.finalized_grad()
        mine.append((mp.name, mp.start, [float(x) for x in mp.main.detach().reshape(-1)],
                     None if grad is None else [float(x) / scale for x in grad.float().reshape(-1)]))
    values = {n: [math.nan] * p.numel() for n, p in named.items()}
    grads = {n: [math.nan] * p.numel() for n, p in named.items()}
    for part in _all_ranks(mine):
        for name, start, main, grad in part:
            offset = start or 0
            values[name][offset:offset + len(main)] = main
            grads[name][offset:offset + len(main)] = grad if grad is not None else [0.0] * len(main)
    return values, grads


def _loss_scale(optimizer: Any) -> float:
    """The loss scale the optimizer's next step unscales by (1.0 without a scaler)."""
    get = getattr(optimizer, "get_loss_scale", None)
    return 1.0 if get is None else float(get())


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
    out: dict[str, Any] = {"refused": None, "start": start, "grads": [], "norms": [], "reference": [], "ok": [],
                           "scales": []}
    for step in range(steps):
        training.finish_param_sync(chunks, optimizer)  # overlap_param_gather: the weights gathered before reading
        out["reference"].append(reference_grads(named, step, dist.get_world_size()))
        training.zero_grad_buffer(chunks, optimizer)
        loss = _loss(chunks[0](_tokens(dist.get_rank(), step)))
        (optimizer.scale_loss(loss) if build.get("fp16") else loss).backward()  # what forward_backward does
        training.finalize_model_grads(chunks)
        out["scales"].append(_loss_scale(optimizer))
        out["grads"].append(_main_state(optimizer, chunks)[1])
        ok, norm, _ = training.optimizer_step(optimizer)
        out["ok"].append(bool(ok))
        out["norms"].append(None if norm is None else float(norm))
    out["scales"].append(_loss_scale(optimizer))
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


#: fp16's largest finite value: a scaled gradient above it is inf.
FP16_MAX = 65504.0


def scaler_mismatches(build: dict[str, Any], observed: dict[str, Any]) -> list[str]:
    """Which steps were skipped and the loss scale of every step, against Megatron's loss scalers in plain Python
    (``ConstantGradScaler`` for fp16's static ``loss_scale``, ``DynamicGradScaler`` otherwise: a step whose
    gradients overflow is skipped; after ``hysteresis`` such steps the scale halves, never below
    ``min_loss_scale``; after ``loss_scale_window`` good steps in a row it doubles). Without fp16 no step may be
    skipped. Whether a step overflows is taken from the float64 replica: certain where its largest gradient times
    the scale is above fp16's range, excluded where 64 times that is still inside it (the activations' gradients
    are of the same order in this model); in between, the step's own outcome is used."""
    if not build.get("fp16"):
        skipped = [step for step, ok in enumerate(observed["ok"]) if not ok]
        return [f"steps {skipped} were skipped without fp16"] if skipped else []
    scaler = build.get("scaler", {})
    static = scaler.get("loss_scale")
    scale = float(static or scaler.get("initial_loss_scale", 2.0**32))
    hysteresis, window = int(scaler.get("hysteresis", 2)), int(scaler.get("loss_scale_window", 1000))
    floor = float(scaler.get("min_loss_scale", 1.0))
    growth, tracker = 0, hysteresis
    for step, (ok, ref) in enumerate(zip(observed["ok"], observed["reference"], strict=True)):
        if observed["scales"][step] != scale:
            return [f"step {step}: loss scale {observed['scales'][step]!r}, the scaler's rule gives {scale!r}"]
        peak = max(abs(g) for gs in ref.values() for g in gs) * scale
        if ok and peak > FP16_MAX:
            return [f"step {step}: the scaled gradients reach {peak:.3g} (fp16 overflows) but it was not skipped"]
        if not ok and 64 * peak < FP16_MAX:
            return [f"step {step}: skipped, though the largest scaled gradient is {peak:.3g}"]
        if static:
            continue
        if not ok:
            growth, tracker = 0, tracker - 1
            if tracker <= 0:
                scale = max(scale * 0.5, floor)
        else:
            growth += 1
            if growth == window:
                growth, tracker, scale = 0, hysteresis, scale * 2.0
    if observed["scales"][-1] != scale:
        return [f"after the last step: loss scale {observed['scales'][-1]!r}, the scaler's rule gives {scale!r}"]
    return []


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
    bad = scaler_mismatches(build, observed)
    grad_tol = {"fp32": 1e-5, "bf16": 3e-2, "fp16": 1e-2}[_precision(build)]
    taken = [step for step, ok in enumerate(observed["ok"]) if ok]  # the steps the optimizer did not skip
    for step in taken:
        got, want = observed["grads"][step], observed["reference"][step]
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
    grads = [observed["grads"][step] for step in taken]
    want_end = O.adam_steps(observed["start"], grads, [hyper] * len(grads), adam)
    for name, values in observed["end"].items():
        lr = hyper[name][0]
        for i, (got_v, want_v, was) in enumerate(zip(values, want_end[name], observed["start"][name], strict=True)):
            # fp32 arithmetic: a few ulp of the value, and a relative 1e-4 of the steps taken
            tol = 4 * 2.0 ** -23 * max(abs(want_v), abs(was)) + 1e-4 * lr * len(grads)
            if not abs(got_v - want_v) <= tol:
                bad.append(f"{name}[{i}] after {len(grads)} step(s): {got_v!r}, Adam gives {want_v!r} "
                           f"(from {was!r}, lr {lr!r}, wd {hyper[name][1]!r})")
                break
    return bad


def _update_property(version: str) -> dict[str, Any]:
    st, builds, _ = _strategies()
    # fp16's loss scaler: static (a scale that never overflows here, or one that always does), or dynamic from a
    # scale that overflows (Megatron's default 2**32), one in between, or one that never does
    scalers = st.one_of(
        st.fixed_dictionaries({"loss_scale": st.sampled_from([1.0, 1024.0, 2.0**32])}),
        st.sampled_from([2.0**32, 2.0**16, 16.0]).flatmap(lambda initial: st.fixed_dictionaries({
            "initial_loss_scale": st.just(initial), "min_loss_scale": st.sampled_from([1.0, initial / 4]),
            "loss_scale_window": st.sampled_from([1, 2, 1000]), "hysteresis": st.sampled_from([1, 2])})))

    def draw(data: Any) -> dict[str, Any]:
        build = dict(data.draw(builds, label="build"))
        build["decoupled_wd"] = data.draw(st.booleans(), label="decoupled weight decay")
        if data.draw(st.integers(0, 2), label="fp16 (in one of three)") == 0:
            build.update(bf16=False, fp16=True, scaler=data.draw(scalers, label="loss scaler"))
        build["ddp"] = {
            "bucket_size": data.draw(st.sampled_from([None, 40, 200]), label="bucket_size"),
            "overlap_grad_reduce": data.draw(st.booleans(), label="overlap_grad_reduce"),
            "grad_reduce_in_fp32": data.draw(st.booleans(), label="grad_reduce_in_fp32")
            if _precision(build) != "fp32" else False,
            "average_in_collective": data.draw(st.booleans(), label="average_in_collective"),
            "overlap_param_gather": data.draw(st.booleans(), label="overlap_param_gather") if build["distopt"]
            else False}
        return {"build": build, "steps": data.draw(st.integers(1, 4 if build.get("fp16") else 3), label="steps")}

    def body(example: dict[str, Any]) -> list[str]:
        observed = observe_update(example["build"], example["steps"])
        return update_mismatches(example["build"], observed) + R.against_reference(
            "update", example, update_observable(observed),
            lambda mine, theirs: update_differences_of(example["build"], example["steps"], mine, theirs))

    return _run_property("update", version, draw, body)


def update_observable(observed: dict[str, Any]) -> dict[str, Any] | None:
    """What the reference release's record keeps of :func:`observe_update`'s result (None: this release refuses
    the settings, not comparable)."""
    if observed["refused"] is not None:
        return None
    return {k: observed[k] for k in ("start", "end", "ok", "scales", "shapes")}


def update_differences_of(build: dict[str, Any], steps: int, mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """The update against the reference release's: the same skipped steps and loss scales, the main params within
    :data:`UPDATE_TOL` (per lr and step) and :data:`ULPS`."""
    bad = []
    if mine["ok"] != theirs["ok"] or mine["scales"] != theirs["scales"]:
        bad.append(f"steps taken {mine['ok']} with loss scales {mine['scales']}, on the reference release "
                   f"{theirs['ok']} with {theirs['scales']}")
    lrs = {name: lr for name, (lr, _) in build_hyper(build, mine["shapes"]).items()}
    return bad + R.update_differences(mine, theirs, lrs, steps, update_tol(build), ULPS)


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


def update_tol(build: dict[str, Any]) -> float:
    """:data:`UPDATE_TOL` of ``build``'s precision (fp16 takes bf16's: its rounding is finer)."""
    return UPDATE_TOL.get(_precision(build), UPDATE_TOL["bf16"])


def _reference_mismatches(case: dict[str, Any], observed: dict[str, Any], ref: dict[str, Any]) -> list[str]:
    """``observed`` (one committed case) against the reference release's record ``ref``."""
    bad = R.close_tables(observed["schedule"]["seen"], ref["schedule"], _close, "schedule")
    update, ref_update = observed["update"], ref["update"]
    if (update["refused"] is None) and ref_update is not None:
        build = case["build"]
        lrs = {name: lr for name, (lr, _) in build_hyper(build, update["shapes"]).items()}
        bad += R.update_differences(update, ref_update, lrs, case["steps"], update_tol(build), ULPS)
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


#: Properties kept in modules of their own, by name: each module has ``EXAMPLES`` (per session), ``draw(data)``
#: (an example from Hypothesis's ``data``, on rank 0; picklable) and ``body(example) -> list[str]`` (run on every
#: rank with TP = PP = 1 initialized, which it leaves so; the mismatches, the same on every rank), and may have
#: ``committed() -> list[example]`` (regression cases replayed first).
MODULE_PROPERTIES = {"builders": "_generated_builders", "schedules": "_generated_pipeline"}
#: Every property's name, in the order a session runs them.
PROPERTIES = ("committed", "schedule", "resume", "overrides", "invalid", "update", *MODULE_PROPERTIES)


def _module_property(name: str, version: str) -> dict[str, Any]:
    """The module's committed examples (``committed()``, where it has one: the same list on every rank), then
    the drawn ones."""
    module = importlib.import_module(MODULE_PROPERTIES[name])
    cases = module.committed() if hasattr(module, "committed") else []
    for case in cases:
        try:
            bad = module.body(case)
        except Exception as exc:
            bad = [f"raised {type(exc).__name__}: {exc}"[:2000]]
        if bad:
            return {"status": "fail", "examples": len(cases), "failure": f"committed case {case}: " + "; ".join(bad[:4])}
    result = _run_property(name, version, module.draw, module.body)
    return {**result, "examples": result["examples"] + len(cases)}


def _own() -> dict[str, Callable[[str], dict[str, Any]]]:
    return {"committed": _committed_property, "schedule": _schedule_property, "resume": _resume_property,
            "overrides": _overrides_property, "invalid": _invalid_property, "update": _update_property}


def run_all() -> dict[str, Any]:
    """Every property on this rank: ``{"version", "cases": {name: result}}``."""
    own = _own()
    return _on_release(lambda version: {
        name: own[name](version) if name in own else _module_property(name, version) for name in PROPERTIES})


def record_drawn() -> dict[str, Any]:
    """On every rank, with ``_generated_reference.RECORD_ENV`` set: the drawn examples of every compared property
    observed on this release, ``{"release", "properties": {property: {key: observable}}}`` (what
    ``_generated_reference.DRAWN`` keeps; scripts/generated_reference.py). Raises if a property fails here."""
    if not R.recording():
        raise RuntimeError(f"record_drawn needs ${R.RECORD_ENV} set in the ranks")
    own = _own()
    result = _on_release(lambda version: {name: own[name](version) for name in R.COMPARED})
    failed = {k: v["failure"] for k, v in result["cases"].items() if v["status"] != "pass"}
    if failed:
        raise RuntimeError(f"the properties fail on megatron-core {result['version']}: {failed}")
    return {"release": result["version"], "properties": R.recorded()}
