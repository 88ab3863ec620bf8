"""Where every parameter lives in Megatron-Core's flat grad/param buffers, read and computed.

Megatron's ``DistributedDataParallel`` packs the trainable parameters of a model chunk into flat buffers
(``GradBuffer`` in 0.4/0.5, ``ParamAndGradBuffer`` in 0.6-0.8, ``_ParamAndGradBuffer`` from 0.9): each
parameter's ``main_grad`` (and, with the distributed optimizer from 0.6, its ``.data``) is a view of
``buffer[start:end]``. The exact offsets, the bucket boundaries and the padding changed many times between
releases. This package gives one answer for every release:

* :func:`layout_of` reads what Megatron actually built from the DDP-wrapped model chunks (:mod:`.read`);
* :func:`compute_layout` derives the same layout from the parameter list and the DDP settings alone (before, or
  without, building DDP), following each release's ``megatron/core/distributed/param_and_grad_buffer.py``
  (:mod:`.compute`, :mod:`.rules`).

Both return a :class:`ModelLayout` (:mod:`.model`); two layouts compare equal exactly when every buffer, bucket
and parameter offset agrees, and :meth:`ModelLayout.diff` says where they differ.

Every version-dependent fact is a row of :data:`LAYOUT_FACTS` (:mod:`.facts`: the buffer-layout part of the one
fact table, :mod:`mcore_compat._facts.table`, each fact probed against the installed release); the code looks facts
up there instead of comparing versions.
"""

from __future__ import annotations

from .compute import DEFAULT_BUCKET_SIZE, compute_layout
from .facts import LAYOUT_FACTS, layout_fact
from .model import (
    BucketLayout,
    BufferKey,
    BufferLayout,
    LayoutError,
    ModelLayout,
    ParamLayout,
    ParamsArg,
    ParamSpec,
)
from .read import layout_of

__all__ = [
    "DEFAULT_BUCKET_SIZE",
    "LAYOUT_FACTS",
    "BucketLayout",
    "BufferKey",
    "BufferLayout",
    "LayoutError",
    "ModelLayout",
    "ParamLayout",
    "ParamSpec",
    "ParamsArg",
    "compute_layout",
    "layout_fact",
    "layout_of",
]
