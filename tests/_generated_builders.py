"""Property ``builders`` (run by ``_generated_scenarios`` as a module property): Hypothesis draws calls of the
config builders ``mcore_compat.transformer_config``, ``ddp_config`` and ``optimizer_config`` with field names of
ANY release, and each call on the installed release is checked against an oracle written from the spec
(``mcore_compat/configs.py``'s docstring).

What is drawn (:func:`draw`, plain data): the builder; up to 8 fields of that class from the generated table
(``mcore_compat/_translate/fields.py``: names of every release, so names the installed release lacks, both names of a
renamed field and fields some release removed are drawn; 0-2 of them from the removed or renamed ones), each at one
of its defaults (the table's rows) or at a non-default value of its type (a bool flipped, an int doubled or + 1, a
float halved, or a value from :data:`PICKED`; one in :data:`REFUSED_ALONE`, which Megatron's ``__post_init__``
refuses alone on some release, less often), the model's base fields for ``TransformerConfig`` and, in
about 3 draws of 8, one invalid change: a misspelled or unknown name, or both names of a renamed field with
different values. Both names of a renamed field drawn as valid fields get one value.

The oracle (:func:`body`), per drawn field, from the INSTALLED release's real classes (``dataclasses.fields`` of the
class ``mcore_compat.symbols.resolve`` returns; 0.4-0.6 DDP: the keyword parameters of ``DistributedDataParallel``'s
constructor; 0.4/0.5 optimizer: the settings of mcore_compat's own optimizer):

* a name neither the table nor the installed class has, or two names of one field with different values:
  ``InvalidArgumentError``, one line, naming it (both names);
* else a field the release has (under the given name or another name of the renamed field): the built object is
  the installed class and carries the field under the installed name with the value Megatron's own class gets for
  the same keywords (built here, raw: ``__post_init__`` may normalise a value); where Megatron's class refuses those
  keywords, the builder raises the same error with the same message (0.4-0.6 DDP: the keyword dict carries the
  value, ``bucket_size=None`` as the constructor's default; 0.4/0.5 optimizer: mcore_compat's ``OptimConfig``);
* a field the release lacks: at its default (the nearest release's that has it) dropped silently, no warning naming
  it; harmless (``mcore_compat._translate.effects``) dropped with a warning on rank 0 naming it (the warn-once memory is emptied
  for the call and restored after); otherwise ``UnsupportedVersionError``, one line, naming it.

Shared with the code under test: the generated field table (which names exist in which release, their defaults,
the renames; checked against the release wheels by ``scripts/gen_config_fields.py --check`` and against the
installed class by tests/test_config_fields_real.py), the harmless-if-missing table (``mcore_compat._translate.effects``, the spec's
own data), 0.4/0.5's optimizer settings (``optim_config._LEGACY_SETTINGS``), the ``accumulate_allreduce_grads_in_fp32``
alias of 0.4-0.6 (from ``ddp_config``'s docstring) and ``detect()``'s release. Independent: which fields the
installed release has (its real classes and constructor), the nearest-default rule (re-implemented here with
``packaging``), where a value lands and what it becomes (Megatron's own class on the same keywords), errors,
messages and warnings.

Drawn since ``ddp_config`` refuses it: ``accumulate_allreduce_grads_in_fp32`` and ``grad_reduce_in_fp32`` with
different values (it took ``grad_reduce_in_fp32``'s silently before, on every release). Not drawn: fields without a literal
default (dtypes), non-default values of fields defaulting to None or a str outside :data:`PICKED`
(callables, dtypes, names), tuple-valued fields, and private (``_``) fields.

``body`` runs the same on every rank and does no collectives; it never raises (a failing check is a mismatch).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import warnings
from collections.abc import Callable
from functools import cache
from typing import Any

#: Examples per release session.
EXAMPLES = 60

#: Builder name -> config class of the generated table.
BUILDERS: dict[str, str] = {"transformer": "TransformerConfig", "ddp": "DistributedDataParallelConfig",
                            "optimizer": "OptimizerConfig"}
#: ``TransformerConfig``'s base fields, drawn from these values every time (num_attention_heads divides
#: hidden_size); ``use_cpu_initialization`` is always True.
BASE: dict[str, tuple[Any, ...]] = {"num_layers": (1, 2, 4), "hidden_size": (8, 16, 32),
                                    "num_attention_heads": (1, 2, 4)}
#: Accepted names outside the table: (old, new) of one field (``ddp_config``'s docstring: 0.4-0.6's keyword).
ALIASES: dict[str, tuple[tuple[str, str], ...]] = {
    "DistributedDataParallelConfig": (("accumulate_allreduce_grads_in_fp32", "grad_reduce_in_fp32"),)}
#: Non-default values for fields whose default has no generic other value (None, str), per class.
PICKED: dict[str, dict[str, tuple[Any, ...]]] = {
    "TransformerConfig": {
        "ffn_hidden_size": (32,), "kv_channels": (4,), "num_query_groups": (1,), "softmax_scale": (0.5,),
        "normalization": ("RMSNorm",), "moe_router_load_balancing_type": ("sinkhorn",),
        "moe_token_dispatcher_type": ("alltoall",), "moe_token_drop_policy": ("position",),
        "moe_router_score_function": ("sigmoid",), "cross_entropy_fusion_impl": ("te",),
        "fp8_amax_compute_algo": ("max",), "transformer_impl": ("local",),
        "num_layers_in_first_pipeline_stage": (1,), "first_pipeline_num_layers": (1,),
        "num_layers_in_last_pipeline_stage": (1,), "last_pipeline_num_layers": (1,),
        "recompute_granularity": ("selective",), "moe_z_loss_coeff": (0.001,), "moe_input_jitter_eps": (0.01,),
        "moe_expert_capacity_factor": (1.0,), "activation_func_clamp_value": (7.0,),
    },
    "DistributedDataParallelConfig": {"bucket_size": (1000,), "suggested_communication_unit_size": (1000,)},
    "OptimizerConfig": {"lr": (1e-3,), "min_lr": (1e-5,), "decoupled_lr": (2e-3,), "decoupled_min_lr": (1e-6,),
                        "loss_scale": (1024.0,), "optimizer": ("sgd",)},
}
#: Fields whose non-default value Megatron's ``__post_init__`` refuses alone (with the base fields) on some release
#: (calibrated on 0.4.0, 0.5.0, 0.6.0, 0.8.0, 0.9.0, 0.11.0, 0.12.3, 0.13.1, 0.14.0, 0.15.0, 0.15.3, 0.16.0, 0.16.1,
#: 0.19.2: a missing fused kernel, a parallel size without its companions, a setting that needs another): drawn at
#: that value in 1 of 4 draws of the field only, so that most calls build (a refused one still checks that the
#: builder passes Megatron's own error on).
REFUSED_ALONE: dict[str, frozenset[str]] = {
    "TransformerConfig": frozenset({
        "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
        "activation_func_fp8_input_store", "apply_rope_fusion", "batch_invariant_mode", "cpu_offloading_num_layers",
        "defer_embedding_wgrad_compute", "delay_wgrad_compute", "ep_overlap_early_attn_memory_release",
        "expert_model_parallel_size", "fine_grained_activation_offloading", "first_pipeline_num_layers", "fp4_param",
        "fp8_output_proj", "fp8_param", "fused_residual_rmsnorm", "inference_disable_triton_nvls_kernels",
        "inference_fuse_tp_communication", "last_pipeline_num_layers", "moe_enable_deepep",
        "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity", "moe_paged_stash", "moe_permute_fusion",
        "moe_router_enable_expert_bias", "moe_router_padding_for_fp8", "moe_router_padding_for_quantization",
        "moe_single_grouped_bias", "moe_single_grouped_weight", "num_layers_in_first_pipeline_stage",
        "num_layers_in_last_pipeline_stage", "overlap_dispatch_backward_with_experts_wgrad",
        "overlap_moe_expert_parallel_comm", "overlap_p2p_comm_warmup_flush", "pipeline_model_parallel_size",
        "sequence_parallel", "variable_seq_lengths"}),
    "DistributedDataParallelConfig": frozenset({"reuse_grad_buf_for_mxfp8_param_ag"}),
    "OptimizerConfig": frozenset({"use_precision_aware_optimizer"}),
}
#: Fields drawn at their defaults only: a non-default value reaches beyond the config (a directory to write to).
DEFAULT_ONLY = frozenset({"config_logger_dir"})
#: Invalid changes, each about once in 8 draws (none otherwise).
CHANGES = ("none", "none", "none", "none", "none", "misspelled", "unknown", "conflict")
#: Names for the ``unknown`` change (checked against the table; ``_x`` is appended to one some release has).
UNKNOWN = ("not_a_config_field", "learning_rate_warmup", "use_flash_attn", "model_dim", "zero_stage")
_PLAIN = (bool, int, float, str, type(None))


# -------------------------------------------------------------------------------------------------- the table
@cache
def _rows(cls: str) -> dict[str, tuple[tuple[str, str | None], ...]]:
    from mcore_compat._translate.fields import FIELDS

    return dict(FIELDS[cls])


def _known(cls: str) -> frozenset[str]:
    return frozenset(_rows(cls)) | {n for pair in ALIASES.get(cls, ()) for n in pair}


@cache
def _families(cls: str) -> dict[str, tuple[str, ...]]:
    """Each renamed field's names, oldest first (the table's renames and :data:`ALIASES`)."""
    from mcore_compat._translate.fields import RENAMES

    out: dict[str, tuple[str, ...]] = {}
    for old, new in (*RENAMES.get(cls, ()), *ALIASES.get(cls, ())):
        chain = (*out.get(old, (old,)), *(n for n in out.get(new, (new,)) if n != old))
        for name in chain:
            out[name] = chain
    return out


def _family(cls: str, name: str) -> tuple[str, ...]:
    return _families(cls).get(name, (name,))


def _defaults(cls: str, name: str) -> list[Any]:
    """The field's literal defaults over the releases (distinct, oldest first); empty: none is a literal."""
    out: list[Any] = []
    for _, text in _rows(cls).get(name, ()):
        if text is None:
            return []
        value = ast.literal_eval(text)
        if not any(_same(value, v) for v in out):
            out.append(value)
    return out


def _other(default: Any) -> Any:
    """A generic non-default value of ``default``'s type (``None``: none)."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default * 2 if default >= 2 else default + 1
    if isinstance(default, float):
        return default / 2 if default > 0 else 0.25
    return None


@cache
def _options(cls: str, name: str) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """``(defaults, non-defaults)`` drawn for a field; no defaults: the field is not drawn."""
    if name.startswith("_") or name in BASE or name == "use_cpu_initialization":
        return (), ()
    defaults = _defaults(cls, name) if name in _rows(cls) else [False]  # an alias: grad_reduce_in_fp32's
    if not defaults or not all(isinstance(d, _PLAIN) or d == [] for d in defaults):
        return (), ()
    others: list[Any] = []
    if name not in DEFAULT_ONLY:
        for value in (*(_other(d) for d in defaults), *PICKED.get(cls, {}).get(name, ())):
            if value is not None and not any(_same(value, d) for d in defaults + others):
                others.append(value)
    return tuple(defaults), tuple(others)


def _value(cls: str, name: str) -> Any:
    """A strategy for the field's value: a default or a non-default value, half and half (a value in
    :data:`REFUSED_ALONE`: 1 in 4)."""
    from hypothesis import strategies as st

    defaults, others = _options(cls, name)
    if not others:
        return st.sampled_from(defaults)
    if name in REFUSED_ALONE.get(cls, frozenset()):
        return st.sampled_from(defaults * 3 + others)
    return st.one_of(st.sampled_from(defaults), st.sampled_from(others))


@cache
def _pools(cls: str) -> tuple[list[str], list[str]]:
    """``(all drawable names, the renamed or removed ones)``, sorted."""
    from mcore_compat._translate.fields import RELEASES

    names = sorted(n for n in _known(cls) if _options(cls, n)[0])
    newest = RELEASES[-1]
    special = [n for n in names if len(_family(cls, n)) > 1
               or (n in _rows(cls) and not any(_in_range(newest, spec) for spec, _ in _rows(cls)[n]))]
    return names, special


# ------------------------------------------------------------------------------------------------------- draw
def _misspell(cls: str, name: str, how: int, at: int) -> str:
    i = at % len(name)
    out = [name[:i] + name[i + 1:], name[:i] + name[i] + name[i:], name + "s",
           name[:i] + name[i + 1:i + 2] + name[i] + name[i + 2:]][how]
    return out if out and out not in _known(cls) else name + "_x"


def draw(data: Any) -> dict[str, Any]:
    """One call: ``{"builder", "fields": {name: value} (the call's keywords, in order), "invalid": None or
    {"kind", "names"}}``."""
    from hypothesis import strategies as st

    builder = data.draw(st.sampled_from(sorted(BUILDERS)), label="builder")
    cls = BUILDERS[builder]
    names, special = _pools(cls)
    chosen = data.draw(st.lists(st.sampled_from(special), max_size=2, unique=True), label="renamed or removed")
    chosen += [n for n in data.draw(st.lists(st.sampled_from(names), max_size=6, unique=True), label="fields")
               if n not in chosen]
    fields: dict[str, Any] = {}
    if cls == "TransformerConfig":
        fields.update({k: data.draw(st.sampled_from(v), label=k) for k, v in BASE.items()})
        fields["use_cpu_initialization"] = True
    for name in chosen:
        twin = next((n for n in _family(cls, name) if n in fields), None)
        if twin is not None:  # both names of one field: one value
            fields[name] = fields[twin]
            continue
        fields[name] = data.draw(_value(cls, name), label=name)
    change = data.draw(st.sampled_from(CHANGES), label="invalid change")
    invalid: dict[str, Any] | None = None
    if change == "misspelled":
        base = data.draw(st.sampled_from(names), label="misspelled field")
        name = _misspell(cls, base, data.draw(st.integers(0, 3), label="how"),
                         data.draw(st.integers(0, 40), label="at"))
        fields[name] = _options(cls, base)[0][0]
        invalid = {"kind": change, "names": [name], "of": base}
    elif change == "unknown":
        name = data.draw(st.sampled_from(UNKNOWN), label="unknown field")
        name = name if name not in _known(cls) else name + "_x"
        fields[name] = data.draw(st.sampled_from([1, True, "x"]), label="its value")
        invalid = {"kind": change, "names": [name]}
    elif change == "conflict":
        pairs = _conflict_pairs(cls)
        if pairs:
            old, new = data.draw(st.sampled_from(pairs), label="renamed field")
            defaults, others = _options(cls, new)
            values = [*defaults, *others]
            first = data.draw(st.sampled_from(values), label="old name's value")
            second = data.draw(st.sampled_from([v for v in values if not _same(v, first)]), label="new name's")
            for n in _family(cls, new):
                fields.pop(n, None)
            fields.update({old: first, new: second})
            invalid = {"kind": change, "names": [old, new]}
    return {"builder": builder, "fields": fields, "invalid": invalid}


def _conflict_pairs(cls: str) -> list[tuple[str, str]]:
    """The table's renames and :data:`ALIASES` whose values can differ."""
    from mcore_compat._translate.fields import RENAMES

    return [(old, new) for old, new in (*RENAMES.get(cls, ()), *ALIASES.get(cls, ()))
            if sum(map(len, _options(cls, new))) >= 2]


# ------------------------------------------------------------------------------------------------------ oracle
def _in_range(version: Any, spec: str) -> bool:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    return Version(str(version)) in SpecifierSet(spec)


def _default_where_absent(cls: str, names: tuple[str, ...], version: Any) -> tuple[bool, Any]:
    """``(known, default)``: the field's default in the listed release nearest to ``version`` that has it under
    any of ``names`` (the newer one on a tie); not known where that default is no literal."""
    from packaging.version import Version

    from mcore_compat._translate.fields import RELEASES

    here = Version(Version(str(version)).base_version)
    listed = [Version(r) for r in RELEASES]
    best: tuple[tuple[float, int], str | None] | None = None
    for j, release in enumerate(listed):
        distance = abs(j - listed.index(here)) if here in listed else abs(j - (sum(r < here for r in listed) - 0.5))
        for name in names:
            for spec, text in _rows(cls).get(name, ()):
                if _in_range(release, spec) and (best is None or (distance, -j) < best[0]):
                    best = ((distance, -j), text)
    if best is None or best[1] is None:
        return False, None
    return True, ast.literal_eval(best[1])


def _same(a: Any, b: Any) -> bool:
    """Equal plain values of one type (1 is not True, 1 is not 1.0); other objects: of one type."""
    if isinstance(a, _PLAIN) or isinstance(b, _PLAIN):
        if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            return True
        return type(a) is type(b) and a == b
    if isinstance(a, (list, tuple, dict)) or isinstance(b, (list, tuple, dict)):
        return type(a) is type(b) and a == b
    return type(a) is type(b)


def _installed(builder: str) -> tuple[Any, frozenset[str], str]:
    """``(Megatron's class or None, the names the installed release takes, style)``; style ``"class"``,
    ``"kwargs"`` (0.4-0.6 DDP: the constructor's keywords) or ``"legacy"`` (0.4/0.5 optimizer)."""
    from mcore_compat.symbols import resolve

    real = resolve(BUILDERS[builder])
    if real and dataclasses.is_dataclass(real):
        return real, frozenset(f.name for f in dataclasses.fields(real)), "class"
    if builder == "ddp":
        return None, frozenset(p for p in _ddp_params() if p not in ("self", "config", "module") and "group" not in p), \
            "kwargs"
    if builder == "optimizer":
        from mcore_compat.training.optim_config import _LEGACY_SETTINGS

        return None, frozenset(_LEGACY_SETTINGS), "legacy"
    raise AssertionError(f"megatron-core has no {BUILDERS[builder]}")


def _call(builder: str, fields: dict[str, Any]) -> dict[str, Any]:
    """The builder's result or error, and the mcore_compat warnings it emitted (the warn-once memory emptied for
    the call, then restored with what the call added)."""
    import mcore_compat as mc
    from mcore_compat import rank0

    fn: Callable[..., Any] = {"transformer": mc.transformer_config, "ddp": mc.ddp_config,
                              "optimizer": mc.optimizer_config}[builder]
    saved = set(rank0._WARNED)
    rank0.reset_warn_once()
    out: dict[str, Any] = {"value": None, "error": None}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                out["value"] = fn(**fields)
            except Exception as exc:
                out["error"] = exc
    finally:
        rank0._WARNED.update(saved)
    out["warnings"] = [str(w.message) for w in caught if str(w.message).startswith("mcore_compat")]
    return out


def _raw(real: Any, kwargs: dict[str, Any]) -> tuple[Any, BaseException | None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return real(**kwargs), None
        except Exception as exc:
            return None, exc


def _text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def _rank() -> int:
    import torch.distributed as dist

    return int(dist.get_rank()) if dist.is_available() and dist.is_initialized() else 0


def _get(built: Any, name: str) -> Any:
    return built[name] if isinstance(built, dict) else getattr(built, name)


def _has(built: Any, name: str) -> bool:
    return name in built if isinstance(built, dict) else hasattr(built, name)


def body(example: dict[str, Any]) -> list[str]:
    """The mismatches of one drawn call on the installed release (empty: it did what the spec says)."""
    try:
        return _check(example)
    except Exception as exc:  # the check itself broke: a mismatch, never an exception
        return [f"{example.get('builder')}: the check raised {_text(exc)}"]


@dataclasses.dataclass
class _Spec:
    """What the spec says one call does on the installed release."""

    invalid: list[list[str]]  # names one of which the InvalidArgumentError must name (all of one entry)
    expected: dict[str, Any]  # installed name -> value given
    landing: dict[str, str]  # installed name -> the name it was given as
    silent: list[list[str]]  # absent, at the default: dropped silently
    warned: list[list[str]]  # absent, harmless: dropped with a warning on rank 0
    refused: list[list[str]]  # absent, would change results: UnsupportedVersionError


def _spec(cls: str, fields: dict[str, Any], present: frozenset[str], version: Any) -> _Spec:
    from mcore_compat._translate.effects import harmless_if_missing

    unknown = [n for n in fields if n not in _known(cls) and n not in present]
    given: dict[tuple[str, ...], list[str]] = {}
    for name in fields:
        if name not in unknown:
            given.setdefault(_family(cls, name), []).append(name)
    conflicts = [names for names in given.values() if any(not _same(fields[n], fields[names[0]]) for n in names)]
    spec = _Spec([[n] for n in unknown] + conflicts, {}, {}, [], [], [])
    for names, given_names in given.items():
        value = fields[given_names[0]]
        here = [n for n in names if n in present]
        if here:  # the newest name the release has
            spec.expected[here[-1]], spec.landing[here[-1]] = value, given_names[0]
            continue
        known, default = _default_where_absent(cls, names, version)
        if known and _same_default(value, default):
            spec.silent.append(given_names)
        elif any(harmless_if_missing(cls, n) for n in names):
            spec.warned.append(given_names)
        else:
            spec.refused.append(given_names)
    return spec


def _check(example: dict[str, Any]) -> list[str]:
    from mcore_compat.detect import detect
    from mcore_compat.errors import InvalidArgumentError, UnsupportedVersionError

    builder, fields = example["builder"], dict(example["fields"])
    cls = BUILDERS[builder]
    version = detect().version
    real, present, style = _installed(builder)
    call = f"{builder}_config({', '.join(f'{k}={v!r}' for k, v in fields.items())}) on {version}"
    spec = _spec(cls, fields, present, version)
    got = _call(builder, fields)
    error: Exception | None = got["error"]
    if spec.invalid:
        bad = _refusal(call, error, InvalidArgumentError, spec.invalid, all_of=True)
        if error is not None and not bad and (example.get("invalid") or {}).get("kind") == "misspelled" \
                and not any(f"'{n}'" in str(error) for n in _known(cls)):  # "did you mean 'hidden_size'?"
            bad.append(f"{call}: InvalidArgumentError names no close match: {_text(error)}")
        return bad
    if spec.refused:
        return _refusal(call, error, UnsupportedVersionError, spec.refused, all_of=False)
    if style == "class":
        raw, raw_error = _raw(real, spec.expected)
        if raw_error is not None:  # Megatron's own class refuses these keywords: its error, passed on
            if error is None or type(error) is not type(raw_error) or str(error) != str(raw_error):
                return [f"{call}: Megatron's class refuses {spec.expected} with {_text(raw_error)}; the builder "
                        f"gave {_text(error) if error is not None else 'no error'}"]
            return []
        want = {name: getattr(raw, name) for name in spec.expected}
    elif style == "kwargs":  # bucket_size=None: the constructor's default
        params = _ddp_params()
        want = {name: params[name].default if value is None and params[name].default is not inspect.Parameter.empty
                else value for name, value in spec.expected.items()}
    else:
        want = dict(spec.expected)
    if error is not None:
        return [f"{call}: raised {_text(error)}; expected a build"]
    return _built(call, got, spec, want, real, style, version)


def _refusal(call: str, error: Exception | None, kind: type[Exception], named: list[list[str]], *,
             all_of: bool) -> list[str]:
    """``error`` is a ``kind`` in one line that names all names of one entry of ``named`` (``all_of``) or one name
    of any entry."""
    if not isinstance(error, kind):
        return [f"{call}: expected {kind.__name__} for {named[0]}, got "
                + (_text(error) if error is not None else "no error")]
    message = str(error)
    bad = [f"{call}: the message is not one line without a traceback: {message[:200]!r}"] \
        if "\n" in message or "Traceback" in message else []
    if not any((all if all_of else any)(n in message for n in names) for names in named):
        bad.append(f"{call}: {kind.__name__} does not name {named[0]}: {_text(error)}")
    return bad


def _built(call: str, got: dict[str, Any], spec: _Spec, want: dict[str, Any], real: Any, style: str,
           version: Any) -> list[str]:
    """The built object against the spec: its type, each field's value, the warnings."""
    built = got["value"]
    bad: list[str] = []
    kind = {"class": real, "kwargs": dict}.get(style)
    if kind is not None and type(built) is not kind:
        bad.append(f"{call}: built a {type(built).__name__}, expected {kind.__name__}")
    if style == "legacy" and type(built).__name__ != "OptimConfig":
        bad.append(f"{call}: built a {type(built).__name__}, expected mcore_compat's OptimConfig")
    if style == "kwargs":
        bad += [f"{call}: built {k!r}, no keyword of DistributedDataParallel.__init__" for k in built
                if k not in _ddp_params()]
    if bad:
        return bad
    for name, value in want.items():
        given = spec.landing[name]
        if not _has(built, name):
            bad.append(f"{call}: {given}={spec.expected[name]!r} is missing from the built config (as {name})")
        elif not _same(_get(built, name), value):
            bad.append(f"{call}: {given}={spec.expected[name]!r} built {name}={_get(built, name)!r}, "
                       f"expected {value!r}")
    if style != "legacy":  # mcore_compat's OptimConfig keeps every setting; its optimizer ignores these
        bad += [f"{call}: {names[0]} (absent on this release) is on the built config"
                for names in spec.silent + spec.warned if any(n in _fields_of(built) for n in names)]
    rank_0 = _rank() == 0
    for names in spec.silent + ([] if rank_0 else spec.warned):
        loud = [w for w in got["warnings"] if any(f"`{n}=" in w for n in names)]
        if loud:
            bad.append(f"{call}: unexpected warning about {names[0]}: {loud[0][:200]!r}")
    for names in spec.warned if rank_0 else []:
        if not any(f"`{n}=" in w and str(version) in w for w in got["warnings"] for n in names):
            bad.append(f"{call}: no warning on rank 0 naming {names[0]} (absent here, harmless); warnings: "
                       f"{[w[:120] for w in got['warnings']]}")
    return bad


def _same_default(value: Any, default: Any) -> bool:
    """Whether ``value`` is the field's default (compared with ``==``, as the spec does: 0 and 0.0 are one default;
    True is no int default)."""
    return value is default or ((type(value) is bool) == (type(default) is bool) and value == default)


def _ddp_params() -> Any:
    """The parameters of the installed ``DistributedDataParallel.__init__``."""
    from mcore_compat.symbols import resolve

    return inspect.signature(resolve("DistributedDataParallel").__init__).parameters


def _fields_of(built: Any) -> set[str]:
    if isinstance(built, dict):
        return set(built)
    return {f.name for f in dataclasses.fields(built)} if dataclasses.is_dataclass(built) else set()
