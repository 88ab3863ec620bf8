"""The registered patches.

Registration order is application order for ``apply_for``: the torch-level CPU patches (``cpu.py``), the
stand-in packages (``stubs.py``), then the Megatron-level upstream fixes (``upstream.py``); ``moe.py`` (MoE fixes
without TransformerEngine) registers between the first two. Order does not matter for correctness: nothing here
imports megatron.

**``apply_for("cpu")`` is the whole CPU harness**: besides the ``"cpu"`` patches proper it includes, for the
releases that need them, the apex stand-in (0.4-0.9), the TransformerEngine stand-in (0.4-0.7) and the
upstream-bug fixes (0.6.0 ``fp32opt_abstract``, 0.12.x ``fp8_noop``); those also carry their own purposes
(``"apex_less"``, ``"te_less"``, ``"upstream_bug"``) for GPU users who want only them. Call it first thing,
before importing megatron or model code::

    from mcore_compat import patches
    patches.apply_for("cpu")          # detected release
    import megatron.core ...

Patches of Megatron modules (``rng``'s ``_set_cuda_rng_state``, ``fp32opt_abstract``, ``fp8_noop``) are applied
when that module is imported (an import hook), or at once if it already is; stand-ins are installed only when
the real package is not importable. Everything is undone exactly by ``revert``/``revert_all``.

Measured on every release 0.4.0-0.19.2 (torch 2.13; CPU build on 3.11, CUDA build without GPU on 3.12):
Column/RowParallelLinear + DDP + ``get_megatron_optimizer`` (distributed on/off) + one no-pipelining step at world 1,
DP=2 and TP=2 (bf16), and a 2-layer local-spec GPTModel at world 1; every parameter moved, DP ranks agreed.
Each patch's range is the one where leaving it out fails (leave-one-out); ``tests/test_patches.py`` reproduces
the upstream bugs.

``cuda_factory`` is a TorchFunctionMode, which torch keeps per thread: it covers the thread that applied it, not
other threads, and torch does not keep it active inside autograd backward hooks (Megatron's DDP grad hooks create
no CUDA tensors, so this was never hit). ``tensor_cuda`` can be applied by name as a process-wide fallback for
``Tensor.cuda()``.
"""

from __future__ import annotations

from . import cpu, moe, stubs, upstream

__all__ = ["cpu", "moe", "stubs", "upstream"]
