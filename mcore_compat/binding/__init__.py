"""Bind every trainable parameter of DDP-wrapped model chunks to flat buffers, safely, on every release.

RL frameworks rebind ``param.data`` to views of one flat buffer so that weights can be broadcast to inference
engines with one collective. With Megatron-Core's distributed optimizer (0.6+) that silently freezes training:
DDP already moved every ``param.data`` into its own ``buffer.param_data`` and the optimizer writes its updates
there (all-gathered shards), never to ``param.data``; a param rebound elsewhere is never updated again.

:func:`bind_params` gives the flat view without that trap:

* **zero-copy** (a buffer that holds ``param_data``: distributed optimizer, 0.6+): the flat buffers *are*
  Megatron's ``param_data`` tensors; ``param.data`` is never touched.
* **allocated** (no parameter buffer: 0.4/0.5, or 0.6+ without the distributed optimizer): one flat tensor per
  DDP grad buffer, with the same grouping, order, offsets and padding as that grad buffer (read with
  :func:`~mcore_compat.layout.layout_of`); each ``param.data`` is rebound once into it, values copied exactly.
  Parameters that do not own their storage (pointed into a buffer of yours, or still in an earlier binding's
  flat buffer) are refused with nothing changed, as zero-copy refuses parameters no longer in ``param_data``:
  moving them would leave that buffer stale.
  Every optimizer in that situation (``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``, the
  ``mcore_compat.legacy_optimizer`` for 0.4/0.5, plain and distributed) writes the update into the *current*
  ``param.data`` (in place, or a main -> model copy through ``param.data``), so binding before or after the
  optimizer is built both work (tests, every release 0.4.0-0.19.2: after the optimizer with FP32Optimizer,
  Float16Optimizer and the legacy optimizer, plain and distributed, fp32 and bf16; before it with fp32).

::

    from mcore_compat.binding import bind_params, gather_pipeline, gather_pipeline_flat

    chunks = mt.wrap_ddp(chunks, ddp_config=mt.DDPConfig(use_distributed_optimizer=True))
    optimizer = mt.get_megatron_optimizer(opt_config, chunks)
    binding = bind_params(chunks)             # zero-copy here: Megatron's own param_data
    ...train...
    binding.verify()                          # raises BindingError if someone rebound param.data
    weights = gather_pipeline(binding)        # {"stage0.<name>": tensor, ...} on every pipeline rank
    full = gather_full(binding, dst=0)        # {"decoder.layers.7.mlp.linear_fc1.weight": full tensor, ...}
    engine.load(binding.manifest().to_json(), binding.flat_buffers())
    for stage in gather_pipeline_flat(binding, reuse_buffers=True):   # flat buffers of every stage, no views
        engine.load(stage.manifest.to_json(), stage.buffers)

:func:`gather_full` gives the full, unsharded weights of a TP x PP x EP (+ virtual pipeline) model under the
single-rank model's names (:func:`iter_full`: bucket by bucket), moving flat-buffer slices and concatenating
TP shards on the receiving side from the manifests.

:meth:`ParamBinding.verify` checks the aliasing cheaply, :func:`gather_pipeline` gathers all pipeline stages'
weights with one collective per flat buffer per stage (:func:`gather_pipeline_flat`: the same, as flat buffers
plus manifests, without building per-parameter views), and :meth:`ParamBinding.unbind` gives every param its own
storage back.

Caveats (documented, not checked):

* Optimizers that keep master copies (fp32 main params of bf16/fp16 models, the legacy distributed optimizer's
  fp32 shards bound after it was built) do not see weights *written into* the flat buffers by you; call the
  optimizer's ``reload_model_params()`` after loading weights that way.
* With ``overlap_param_gather`` the all-gather of updated parameters is deferred to the next forward pass: the
  zero-copy buffers hold the old values of other ranks' shards until then.
* Params in no DDP buffer (frozen params; expert params on 0.4/0.5) are not bound; see
  :attr:`ParamBinding.unbound`.
"""

from __future__ import annotations

from .bind import bind_params
from .errors import BindingError
from .full import gather_full, iter_full
from .gather import StageBuffers, gather_pipeline, gather_pipeline_flat
from .manifest import MANIFEST_FORMAT, Manifest, ManifestBuffer, ManifestEntry
from .param_binding import ParamBinding

__all__ = [
    "MANIFEST_FORMAT",
    "BindingError",
    "Manifest",
    "ManifestBuffer",
    "ManifestEntry",
    "ParamBinding",
    "StageBuffers",
    "bind_params",
    "gather_full",
    "gather_pipeline",
    "gather_pipeline_flat",
    "iter_full",
]
