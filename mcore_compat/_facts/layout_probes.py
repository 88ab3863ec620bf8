"""Probes of the buffer-layout facts that no generic builder of :mod:`mcore_compat._facts.probes` expresses.

Each reads the source of the installed release with ``ast`` (no import) and returns the value the fact table
holds for it: how a shared-embedding parameter gets a bucket of its own, how many params a bucket needs before
it may be closed by size, and what ``bucket_size=None`` means. The code they read:

* ``megatron/core/distributed/grad_buffer.py`` (``GradBuffer``, 0.4/0.5);
* ``megatron/core/distributed/param_and_grad_buffer.py`` (``ParamAndGradBuffer`` 0.6-0.8,
  ``_ParamAndGradBuffer`` 0.9+; from 0.18 only the layout without the distributed optimizer);
* ``megatron/core/optimizer/distrib_optimizer.py`` (``DistributedOptimizer._compute_per_buffer_param_layout``,
  the layout with the distributed optimizer, 0.18+);
* ``megatron/core/distributed/distributed_data_parallel.py`` (``DistributedDataParallel.__init__``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from .probes import Probe, call_name, find_node, module_tree

__all__ = ["bucket_size_none", "min_params_per_sized_bucket", "shared_embedding_split"]

_GB = "megatron.core.distributed.grad_buffer"
_BUF = "megatron.core.distributed.param_and_grad_buffer"
_DOPT = "megatron.core.optimizer.distrib_optimizer"
_DDP = "megatron.core.distributed.distributed_data_parallel"

#: Modules that compute the layout, oldest first.
_LAYOUT_MODULES = (_GB, _BUF, _DOPT)
#: The name of the running start index of the next param (``data_start_index`` before 0.9).
_START_NAMES = frozenset({"param_start_index", "data_start_index"})
#: Megatron's predicate "this param needs a bucket of its own" (shared embeddings, distributed optimizer).
_NEEDS_OWN_BUCKET = "_does_param_require_new_bucket"


def _ifs(modules: tuple[str, ...]) -> Iterator[ast.If]:
    """Every ``if`` statement of ``modules`` (installed ones only), module by module, in source order."""
    for module in modules:
        tree = module_tree(module)
        if tree is not None:
            yield from sorted((n for n in ast.walk(tree) if isinstance(n, ast.If)),
                              key=lambda n: (n.lineno, n.col_offset))


def _calls(node: ast.AST, func: str) -> bool:
    return any(isinstance(n, ast.Call) and call_name(n) == func for n in ast.walk(node))


def _stored_names(stmts: list[ast.stmt], nested: bool) -> set[str]:
    """Names assigned by ``stmts`` (directly, or anywhere under them if ``nested``)."""
    nodes = [n for s in stmts for n in ast.walk(s)] if nested else [
        t for s in stmts if isinstance(s, ast.Assign) for t in s.targets]
    return {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _shared_embedding_split() -> str:
    # The ``if`` that closes the running bucket *before* a shared-embedding param: its test calls the
    # predicate and is no ``or`` (the ``... >= bucket_size) or _does_param_require_new_bucket(param)`` closes
    # the bucket after the param).
    for node in _ifs(_LAYOUT_MODULES):
        test = node.test
        if not _calls(test, _NEEDS_OWN_BUCKET) or (isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or)):
            continue
        if _stored_names(node.body, nested=False) & _START_NAMES:
            return "start_after_close"  # 0.13+: the param starts at the closed bucket's padded end
        if _stored_names(node.body, nested=True) & _START_NAMES:
            return "dp_align_then_close"  # 0.9-0.12: start padded only if not a multiple of dp
        return "close_at_start"  # 0.6-0.8: the start stays (asserted to be a multiple of dp)
    return "none"


def shared_embedding_split() -> Probe[str]:
    """Probe: how a ``shared_embedding`` param gets a bucket of its own (values of the fact
    ``shared_embedding_split``): ``none`` without the predicate ``_does_param_require_new_bucket``; else by what
    the ``if`` that closes the running bucket before the param assigns to the param's start index."""
    return Probe(_shared_embedding_split, _LAYOUT_MODULES)


def _is_len_of_bucket_params(node: ast.expr) -> bool:
    return (isinstance(node, ast.Call) and call_name(node) == "len" and len(node.args) == 1
            and isinstance(node.args[0], ast.Name) and node.args[0].id == "bucket_params")


def _reaches_bucket_size(node: ast.AST) -> bool:
    """Whether ``node`` contains ``... >= bucket_size``."""
    return any(isinstance(n, ast.Compare) and isinstance(n.ops[0], ast.GtE)
               and isinstance(n.comparators[0], ast.Name) and n.comparators[0].id == "bucket_size"
               for n in ast.walk(node))


def _min_params_per_sized_bucket() -> int | None:
    for node in _ifs(_LAYOUT_MODULES):
        if not _reaches_bucket_size(node.test):
            continue
        for cmp in ast.walk(node.test):  # ``len(bucket_params) > N``: at least N + 1 params
            if (isinstance(cmp, ast.Compare) and _is_len_of_bucket_params(cmp.left) and isinstance(cmp.ops[0], ast.Gt)
                    and isinstance(cmp.comparators[0], ast.Constant) and isinstance(cmp.comparators[0].value, int)):
                return cmp.comparators[0].value + 1
        return 1
    return None


def min_params_per_sized_bucket() -> Probe[int | None]:
    """Probe: how many params a bucket must hold before it is closed by size (fact
    ``min_params_per_sized_bucket``): read from the first ``if`` whose test compares with ``bucket_size``
    (``... >= bucket_size and len(bucket_params) > 1`` in 0.4/0.5); ``None`` if there is none."""
    return Probe(_min_params_per_sized_bucket, _LAYOUT_MODULES)


def _bucket_size_none() -> str:
    init = find_node(_DDP, "DistributedDataParallel.__init__")
    if init is not None and any(
        isinstance(n, ast.Compare) and isinstance(n.left, ast.Attribute) and n.left.attr == "bucket_size"
        and isinstance(n.ops[0], ast.Is) and isinstance(n.comparators[0], ast.Constant)
        and n.comparators[0].value is None
        for n in ast.walk(init)
    ):
        return "default"
    return "single_bucket"


def bucket_size_none() -> Probe[str]:
    """Probe: what an explicit ``bucket_size=None`` means (fact ``bucket_size_none``): ``default`` where
    ``DistributedDataParallel.__init__`` tests ``ddp_config.bucket_size is None`` to fill in the default (0.7+),
    else ``single_bucket`` (``None`` is the DDP argument that disables bucketing)."""
    return Probe(_bucket_size_none, (_DDP,))
