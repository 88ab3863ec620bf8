"""Property ``schedules`` of tests/test_generated_settings.py: the gradient of a global batch does not depend on how
the training step is scheduled.

Hypothesis draws a layout on the session's 2 gloo ranks - pipeline size 1 (DP=2) or 2 (DP=1), with PP=2 virtual
stages (VPP=2, two model chunks per rank) where the release runs them (0.8+, fact ``interleaved_needs_pp_over_2``;
the interleaved schedule needs an even number of micro-batches there) -, 1-4 micro-batches, the micro-batch size,
tied or untied embeddings, and the DDP settings ``overlap_grad_reduce``, ``bucket_size`` and
``use_distributed_optimizer`` (fp32 only), with VPP the P2P settings; and whether ``finalize_model_grads`` runs
as the schedule's hook (``install_training_hooks``) or is called after ``forward_backward``. A tiny GPT (Megatron's local layer spec,
:data:`LAYERS` layers split over the PP x VPP stages, CPU init) is built through mcore_compat's public API
(``symbols``, ``training.wrap_ddp``), every parameter then set to values that depend only on its single-rank name
(:func:`mcore_compat.binding.placement.single_rank_names`), so every layout starts from the same full weights.
ONE step runs (``training.forward_backward`` over the global batch of :func:`global_batch`, the DP ranks' shares
split into micro-batches, then ``finalize_model_grads``), and every parameter's full gradient, gathered over the
pipeline stages (the distributed optimizer's shards put together from the buffer layout,
``mcore_compat.layout.layout_of``), is compared with

* the reference layout: the same global batch on the same ranks at PP=1, DP=2, one micro-batch per DP rank,
  plain DDP (no overlap, one default bucket, no distributed optimizer): norm-wise relative :data:`GRAD_TOL` per
  parameter (fp32 rounding). It shares Megatron's layer code, DDP and ``finalize_model_grads`` with the code under
  test, so it catches schedule, pipeline (P2P, virtual stages), bucketing, overlap, sharding and finalize faults,
  not faults inside the layers;
* a float64 computation of the same loss (:mod:`mcore_compat.selfcheck.plain_gpt`: the GPT written from the math in
  plain torch, no Megatron code) on the same full weights: :data:`F64_TOL`; it catches layer faults too (it
  shares with the code under test only mcore_compat's naming of the parameters).

The quantity: Megatron's schedules divide each micro-batch's loss (the mean token cross-entropy of that
micro-batch) by the number of micro-batches M, and DDP averages the gradients over the DP ranks, so a step's
gradient is that of ``sum_{d, m} loss_{d, m} / (DP * M)``; with micro-batches of equal size (DP * M * b = G
sequences) that is the gradient of the mean token cross-entropy over the whole global batch, which the float64
reference differentiates directly. With tied embeddings at PP=2 the first stage's word embedding and the last
stage's output-layer copy must each hold the whole gradient after ``finalize_model_grads`` (its embedding
all-reduce); both copies are compared; data-parallel replicas of a gradient must agree.

With virtual stages the P2P settings are drawn too: Megatron-Core's default (``batch_p2p_comm=True``), which
at PP=2 swaps activations and gradients between the two stages (``_batched_p2p_ops`` posts both directions to one
peer in one batch; found by this property: on 0.9.0, 0.12.3, 0.16.1 and 0.19.2 at M=4 the gradient was 30-300x
off, M=2 has no steady state) and which ``forward_backward`` now runs as Megatron-LM does
(``batch_p2p_comm=False, overlap_p2p_comm=True``, with a one-time warning); or either of those set by the user.
A drawn layout mcore_compat refuses on the release (``wrap_ddp``'s tied embedding over two buckets with the
distributed optimizer, 0.7-0.12) is not applicable and passes.
"""

from __future__ import annotations

import math
import traceback
import zlib
from typing import Any

#: Examples per release session.
EXAMPLES = 8
HIDDEN, FFN, HEADS, VOCAB, SEQ, LAYERS = 16, 32, 2, 32, 6, 4
#: Norm-wise relative tolerance per parameter between two fp32 layouts (fp32 rounding, sums in another order).
GRAD_TOL = 1e-5
#: The same against the float64 computation.
F64_TOL = 5e-5
#: What the DDP settings' ``bucket_size`` is drawn from (elements; ``None`` = Megatron's default).
BUCKETS = (None, 1000, 4000)
#: The name the last stage's copy of a tied embedding is compared under.
_COPY = "output_layer.weight (the last stage's copy of the tied embedding)"
REFERENCE = {"pp": 1, "vpp": 1, "dp": 2, "microbatches": 1, "overlap": False, "bucket_size": None,
             "distopt": False, "finalize": "hook", "p2p": None}


# ---------------------------------------------------------------------------------------- the committed cases
def committed() -> list[dict[str, Any]]:
    """Examples replayed before the drawn ones in every release session where they apply: the setting this
    property found broken (virtual stages at PP=2 with Megatron-Core's default batched P2P, M=4)."""
    from mcore_compat.capabilities import has

    if has("interleaved_needs_pp_over_2"):
        return []
    return [{"pp": 2, "vpp": 2, "dp": 1, "microbatches": 4, "micro_batch_size": 1, "p2p": (True, False),
             "tie": True, "overlap": False, "bucket_size": None, "distopt": False, "finalize": "hook", "seed": 7}]


# ------------------------------------------------------------------------------------------------- the draw
def draw(data: Any) -> dict[str, Any]:
    """One layout, its global batch and its DDP settings (on rank 0, in the release's process)."""
    from hypothesis import strategies as st

    from mcore_compat.capabilities import has

    pp = data.draw(st.sampled_from([1, 2]), label="pipeline size")
    vpp_ok = pp == 2 and not has("interleaved_needs_pp_over_2")
    vpp = 2 if vpp_ok and data.draw(st.booleans(), label="virtual stages") else 1
    # the interleaved schedule needs M divisible by PP (0.8-0.9) / M % PP in {0} or >= PP (0.10+)
    micro = data.draw(st.sampled_from([2, 4]) if vpp > 1 else st.integers(1, 4), label="micro-batches")
    dp = 2 // pp
    # the reference splits the global batch over 2 DP ranks: it needs an even number of sequences
    b = data.draw(st.sampled_from([1, 2]) if (dp * micro) % 2 == 0 else st.just(2), label="micro-batch size")
    return {
        "pp": pp, "vpp": vpp, "dp": dp, "microbatches": micro, "micro_batch_size": b,
        # (batch_p2p_comm, overlap_p2p_comm): Megatron-Core's default, Megatron-LM's, unbatched without overlap
        "p2p": data.draw(st.sampled_from([(True, False), (False, True), (False, False)]), label="P2P settings")
        if vpp > 1 else None,
        "tie": data.draw(st.booleans(), label="tied embeddings"),
        "overlap": data.draw(st.booleans(), label="overlap_grad_reduce"),
        "bucket_size": data.draw(st.sampled_from(BUCKETS), label="bucket_size"),
        "distopt": data.draw(st.booleans(), label="use_distributed_optimizer"),
        "finalize": data.draw(st.sampled_from(["hook", "explicit"]), label="finalize_model_grads"),
        "seed": data.draw(st.integers(0, 2**16), label="data seed"),
    }


def describe(layout: dict[str, Any]) -> str:
    """A layout in a few words."""
    text = f"PP={layout['pp']}" + (f" VPP={layout['vpp']}" if layout["vpp"] > 1 else "") + \
        f" DP={layout['dp']} M={layout['microbatches']}"
    extras = [k for k in ("overlap", "distopt") if layout.get(k)]
    if layout.get("p2p") is not None:
        extras.append("batch_p2p_comm={} overlap_p2p_comm={}".format(*layout["p2p"]))
    if layout.get("bucket_size") is not None:
        extras.append(f"bucket_size={layout['bucket_size']}")
    if layout.get("finalize") == "explicit":
        extras.append("finalize called")
    return text + (f" ({', '.join(extras)})" if extras else "")


# ------------------------------------------------------------------------------------------ model and data
def full_value(name: str, shape: tuple[int, ...]) -> Any:
    """The starting value of the single-rank parameter ``name`` (1-based layer numbers): a function of its name
    only, the same on every layout and release."""
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    noise = torch.randn(shape, generator=g, dtype=torch.float64)
    if "layernorm" in name or name.endswith("norm.weight"):
        return 1.0 + 0.1 * noise if name.endswith("weight") else 0.1 * noise
    return (0.1 if name.endswith("bias") else 0.3) * noise


def global_batch(example: dict[str, Any]) -> tuple[Any, Any]:
    """``(tokens, labels)`` [G, SEQ] of the step: G = DP * M * micro-batch size sequences from the drawn seed."""
    import torch

    n = example["dp"] * example["microbatches"] * example["micro_batch_size"]
    g = torch.Generator().manual_seed(int(example["seed"]))
    return torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, VOCAB, (n, SEQ), generator=g)


def _mask_and_positions(b: int) -> tuple[Any, Any]:
    import torch

    mask = torch.tril(torch.ones(SEQ, SEQ)).view(1, 1, SEQ, SEQ) < 0.5  # True = masked
    return mask, torch.arange(SEQ).unsqueeze(0).expand(b, SEQ).contiguous()


def _init_parallel(pp: int, vpp: int) -> None:
    import torch

    from mcore_compat import symbols

    ps = symbols.resolve("parallel_state")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    kwargs: dict[str, Any] = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": pp}
    if vpp > 1:
        kwargs["virtual_pipeline_model_parallel_size"] = vpp
    ps.initialize_model_parallel(**kwargs)
    torch.manual_seed(1234)
    symbols.resolve("model_parallel_cuda_manual_seed")(1234)


def _config(pp: int, vpp: int) -> Any:
    import torch

    from mcore_compat import symbols

    cls = symbols.resolve("TransformerConfig")
    kwargs: dict[str, Any] = dict(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, bias_activation_fusion=False,
        bias_gelu_fusion=False, apply_rope_fusion=False)
    fields = set(getattr(cls, "__dataclass_fields__", {}))
    return cls(**{k: v for k, v in kwargs.items() if k in fields})


def _build(pp: int, vpp: int, tie: bool) -> tuple[list[Any], Any]:
    """This rank's unwrapped chunks (one per virtual stage) and their config, every parameter at
    :func:`full_value` of its single-rank name."""
    import torch

    from mcore_compat import symbols
    from mcore_compat.binding.placement import single_rank_names
    from mcore_compat.capabilities import has

    ps = symbols.resolve("parallel_state")
    config = _config(pp, vpp)
    spec = symbols.resolve("get_gpt_layer_local_spec")()
    rank = ps.get_pipeline_model_parallel_rank()
    by_argument = has("gpt_vp_stage")
    chunks = []
    for i in range(vpp):
        kwargs: dict[str, Any] = {}
        if vpp > 1 and by_argument:
            kwargs["vp_stage"] = i
        elif vpp > 1:  # before 0.13 the GPT reads its virtual stage from parallel_state while it is built
            ps.set_virtual_pipeline_model_parallel_rank(i)
        try:
            chunk = symbols.resolve("GPTModel")(
                config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                pre_process=rank == 0 and i == 0, post_process=rank == pp - 1 and i == vpp - 1,
                share_embeddings_and_output_weights=tie, parallel_output=True, **kwargs)
        finally:
            if vpp > 1 and not by_argument:
                ps.set_virtual_pipeline_model_parallel_rank(0)
        with torch.no_grad():
            for p, name in single_rank_names(chunk, layer_base=1).items():
                p.copy_(full_value(name, tuple(p.shape)).to(p.dtype))
        chunks.append(chunk)
    return chunks, config


def _forward_step(data_iterator: Any, model: Any) -> Any:
    tokens, labels, positions, mask = next(data_iterator)
    out = model(tokens, positions, mask, labels=labels)

    def loss_func(output: Any) -> Any:
        loss = output.float().mean()  # this micro-batch's mean token cross-entropy
        return loss, {"loss": loss.detach().clone()}

    return out, loss_func


# ------------------------------------------------------------------------------------------- one layout
def _owned(chunks: list[Any], dp: int, dp_rank: int) -> dict[tuple[int, str], tuple[int, int, list[tuple[int, int]]]]:
    """With the distributed optimizer: per (chunk, name) the element ranges of the parameter whose reduced
    gradient this DP rank holds (its shard of each bucket, Megatron's ``shard_buffer``)."""
    from mcore_compat.layout import layout_of

    out: dict[tuple[int, str], tuple[int, int, list[tuple[int, int]]]] = {}
    for buffer, param in layout_of(chunks).params():
        bucket = next(k for k in buffer.buckets if k.index == param.bucket)
        size = bucket.numel // dp
        lo, hi = bucket.start + dp_rank * size, bucket.start + (dp_rank + 1) * size
        start, end = max(lo, param.start), min(hi, param.end)
        ranges = [(start - param.start, end - param.start)] if start < end else []
        out[(buffer.key.chunk, param.name)] = (param.start, param.end, ranges)
    return out


def _gather_grads(chunks: list[Any], layout: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Every parameter's full gradient (``main_grad``) by single-rank name, merged over the ranks (the last
    stage's copy of a tied embedding under ``output_layer.weight (tied copy)``), and where data-parallel replicas
    of a gradient disagree (each must hold the reduced gradient; the distributed optimizer's: in its shard)."""
    import torch
    import torch.distributed as dist

    from mcore_compat import symbols
    from mcore_compat.binding.placement import placements
    from mcore_compat.layout.read import unwrap

    ps = symbols.resolve("parallel_state")
    owned = _owned(chunks, layout["dp"], ps.get_data_parallel_rank()) if layout["distopt"] and layout["dp"] > 1 \
        else None
    mine = []
    for index, chunk in enumerate(chunks):
        core = unwrap(chunk)
        places = placements(core)
        for local, p in core.named_parameters():
            pl = places[local]
            name = _COPY if pl.tied_to else pl.full_name
            parts = name.split(".")
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(int(parts[2]) + 1)
                name = ".".join(parts)
            grad = getattr(p, "main_grad", None)
            values = None if grad is None else grad.detach().double().reshape(-1).clone()
            mask = None
            if owned is not None and values is not None:
                mask = torch.zeros(values.numel(), dtype=torch.bool)
                for lo, hi in owned[(index, local)][2]:
                    mask[lo:hi] = True
            mine.append((name, tuple(p.shape), values, mask))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged: dict[str, Any] = {}
    disagree = []
    for rank, records in enumerate(everyone):
        for name, shape, values, mask in records:
            if values is None:
                merged.setdefault(name, None)
                continue
            have = merged.get(name)
            if mask is None:
                if have is None:
                    merged[name] = values.view(shape)
                elif not _norm_rel(values.view(shape), have) <= GRAD_TOL:
                    disagree.append(f"{name}: rank {rank}'s gradient is {_norm_rel(values.view(shape), have):.2e} "
                                    f"(norm-wise) from rank 0's; data-parallel replicas must agree")
                continue
            if have is None:
                have = merged[name] = torch.full(shape, math.nan, dtype=torch.float64)
            have.view(-1)[mask] = values[mask]
    return merged, disagree


def run_layout(layout: dict[str, Any], example: dict[str, Any]) -> dict[str, Any]:
    """One step of ``example``'s global batch on ``layout`` (collective): ``{"grads": {name: tensor}}``, or
    ``{"na": why}`` where mcore_compat refuses the settings on this release."""
    import torch.distributed as dist

    from mcore_compat import symbols, training
    from mcore_compat.errors import UnsupportedVersionError
    from mcore_compat.selfcheck.models import release_chunks

    pp, vpp, micro = layout["pp"], layout["vpp"], layout["microbatches"]
    _init_parallel(pp, vpp)
    ps = symbols.resolve("parallel_state")
    raw, config = _build(pp, vpp, example["tie"])
    if vpp > 1:  # the drawn P2P settings of the interleaved schedule (see the module docstring)
        config.batch_p2p_comm, config.overlap_p2p_comm = (bool(x) for x in layout["p2p"])
    ddp = training.DDPConfig(use_distributed_optimizer=layout["distopt"], overlap_grad_reduce=layout["overlap"],
                             bucket_size=layout["bucket_size"])
    try:
        chunks = training.wrap_ddp(raw, ddp_config=ddp)
    except UnsupportedVersionError as exc:
        return {"na": str(exc).splitlines()[0]}
    try:
        explicit = layout["finalize"] == "explicit"
        training.install_training_hooks(chunks, finalize=not explicit)
        training.zero_grad_buffer(chunks)
        tokens, labels = global_batch(example)
        b = tokens.shape[0] // (layout["dp"] * micro)
        d = ps.get_data_parallel_rank()
        mask, positions = _mask_and_positions(b)
        batches = [(tokens[s:s + b], labels[s:s + b], positions, mask)
                   for s in range(d * micro * b, (d + 1) * micro * b, b)]
        iterators: Any = [iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches)
        training.forward_backward(_forward_step, iterators, chunks if len(chunks) > 1 else chunks[0], micro,
                                  seq_length=SEQ, micro_batch_size=b, check_hooks=not explicit)
        if explicit:
            training.finalize_model_grads(chunks)
        grads, disagree = _gather_grads(chunks, layout)
    finally:
        release_chunks(chunks)
        dist.barrier()
    return {"grads": grads, "disagree": disagree}


# ------------------------------------------------------------------------------------------------ oracles
def float64_grads(example: dict[str, Any], config: Any) -> dict[str, Any]:
    """The gradient of the mean token cross-entropy over the global batch, in float64 from the math
    (:mod:`mcore_compat.selfcheck.plain_gpt`) on the full weights of :func:`full_value`."""
    import torch

    from mcore_compat.selfcheck import plain_gpt

    names = ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
             "decoder.final_layernorm.weight", "decoder.final_layernorm.bias"]
    shapes = {"embedding.word_embeddings.weight": (VOCAB, HIDDEN), "embedding.position_embeddings.weight":
              (SEQ, HIDDEN), "decoder.final_layernorm.weight": (HIDDEN,), "decoder.final_layernorm.bias": (HIDDEN,)}
    if not example["tie"]:
        names.append("output_layer.weight")
        shapes["output_layer.weight"] = (VOCAB, HIDDEN)
    layer = {"input_layernorm.weight": (HIDDEN,), "input_layernorm.bias": (HIDDEN,),
             "self_attention.linear_qkv.weight": (3 * HIDDEN, HIDDEN), "self_attention.linear_qkv.bias": (3 * HIDDEN,),
             "self_attention.linear_proj.weight": (HIDDEN, HIDDEN), "self_attention.linear_proj.bias": (HIDDEN,),
             "pre_mlp_layernorm.weight": (HIDDEN,), "pre_mlp_layernorm.bias": (HIDDEN,),
             "mlp.linear_fc1.weight": (FFN, HIDDEN), "mlp.linear_fc1.bias": (FFN,),
             "mlp.linear_fc2.weight": (HIDDEN, FFN), "mlp.linear_fc2.bias": (HIDDEN,)}
    for n in range(1, LAYERS + 1):
        for rest, shape in layer.items():
            names.append(f"decoder.layers.{n}.{rest}")
            shapes[names[-1]] = shape
    w = {n: full_value(n, shapes[n]).requires_grad_() for n in names}
    cfg = {**plain_gpt.attention_settings(config), "layers": list(range(1, LAYERS + 1)), "tied": example["tie"]}
    tokens, labels = global_batch(example)
    mask, positions = _mask_and_positions(tokens.shape[0])
    with torch.enable_grad():
        plain_gpt.gpt_token_losses(w, cfg, tokens, labels, positions, mask).mean().backward()
    return {n: t.grad for n, t in w.items()}


def _norm_rel(got: Any, want: Any) -> float:
    import torch

    if got is None or tuple(got.shape) != tuple(want.shape) or not bool(torch.isfinite(got).all()):
        return math.inf
    return float((got - want).norm() / max(float(want.norm()), 1e-30))


def compare(got: dict[str, Any], want: dict[str, Any], tol: float, what: str, copy: bool) -> list[str]:
    """``got``'s gradients against ``want``'s, parameter by parameter; with ``copy`` (tied embeddings on
    several stages) the last stage's copy of the embedding against the embedding's."""
    bad = []
    want = {k: v for k, v in want.items() if k != _COPY}
    if copy:
        want[_COPY] = want.get("embedding.word_embeddings.weight")
    for name in sorted(set(got) | set(want)):
        if name not in want or want[name] is None:
            bad.append(f"{name}: a gradient {what} has none")
            continue
        if name not in got:
            bad.append(f"{name}: no gradient, {what} has one")
            continue
        err = _norm_rel(got[name], want[name])
        if not err <= tol:
            bad.append(f"{name}'s gradient is {err:.2e} (norm-wise) from {what}'s (tolerance {tol:.0e})")
    return bad


def _mismatches(example: dict[str, Any]) -> list[str]:
    reference = {**REFERENCE, "micro_batch_size": None}
    ref = run_layout(reference, example)
    drawn = run_layout(example, example)
    if "na" in ref:
        return [f"the reference layout was refused: {ref['na']}"]
    if "na" in drawn:
        return []  # mcore_compat refuses these settings on this release (e.g. a tied embedding over two buckets)
    config = _config(1, 1)
    f64 = float64_grads(example, config)
    label = describe(example)
    copy = example["tie"] and example["pp"] > 1
    bad = [f"reference layout: {m}" for m in ref["disagree"] + compare(ref["grads"], f64, F64_TOL, "float64",
                                                                         False)]
    bad += [f"{label}: {m}" for m in drawn["disagree"]]
    bad += [f"{label}: {m}" for m in compare(drawn["grads"], ref["grads"], GRAD_TOL,
                                             "the reference layout (PP=1, DP=2, one micro-batch per rank)", copy)]
    bad += [f"{label}: {m}" for m in compare(drawn["grads"], f64, F64_TOL, "float64", copy)]
    return bad


def body(example: dict[str, Any]) -> list[str]:
    """The example's mismatches in words, the same on every rank; leaves TP = PP = 1 initialized."""
    import torch.distributed as dist

    from mcore_compat import symbols

    try:
        bad = _mismatches(example)
    except Exception as exc:
        bad = [f"{describe(example)}: raised {''.join(traceback.format_exception(exc))[-1500:]}"]
    finally:
        ps = symbols.resolve("parallel_state")
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel()
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, bad)
    out: list[str] = []
    for rank, words in enumerate(everyone):
        out += [w if rank == 0 or w in everyone[0] else f"rank {rank}: {w}" for w in words]
    return list(dict.fromkeys(out))
