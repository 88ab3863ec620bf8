"""Memory cost of ``mcore_compat.binding.bind_params`` vs copying the weights into a new flat buffer.

Three cases, each on a fresh copy of the GPT of ``step_overhead.py`` wrapped in DDP (world size 1) with its
Megatron optimizer built:

* ``bind_zero_copy``: distributed optimizer; ``bind_params`` returns Megatron's own ``param_data`` buffers
  (goal: 0 bytes more, peak included).
* ``bind_allocated``: no distributed optimizer (DDP has no param buffer); ``bind_params`` allocates flat
  buffers in DDP's layout, copies, rebinds each ``param.data`` and the old per-param storages are freed (goal:
  no lasting duplicate; the peak is one transient copy of the weights).
* ``copy_flat`` (the usual approach): allocate one flat buffer, copy every parameter in, keep both (lasting
  duplicate = the weights' bytes).

Measured: on CUDA ``torch.cuda.memory_allocated()`` before/after and the peak in between; on every device the
bytes of the unique storages reachable from parameters, module buffers and the flat buffers held (by
``data_ptr``), and how many bytes of the parameters' old storages are still alive afterwards (storage weak
references: "lasting duplicate").

    python3 benchmarks/binding_memory.py --device cuda
    python3 benchmarks/binding_memory.py --device cpu
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C
import _gpt as G

NAME = "binding_memory"


def _storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the unique storages behind ``tensors`` (keyed by storage ``data_ptr``)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _reachable(model: Any, held: list[Any]) -> int:
    return _storage_bytes([p.data for p in model.parameters()] + list(model.buffers()) + held)


def _allocated(device: str) -> int | None:
    if device != "cuda":
        return None
    import torch

    return int(torch.cuda.memory_allocated())


def _build(spec: G.GPTSpec, seed: int, distopt: bool) -> tuple[Any, Any, Any]:
    import torch

    from mcore_compat import training as mt

    module = G.build_gpt(spec, seed)
    chunks = mt.wrap_ddp([module], ddp_config=mt.DDPConfig(use_distributed_optimizer=distopt,
                                                           grad_reduce_in_fp32=spec.dtype == "bf16"))
    optimizer = mt.get_megatron_optimizer(mt.OptimConfig(
        optimizer="adam", lr=1e-4, bf16=spec.dtype == "bf16", use_distributed_optimizer=distopt,
        params_dtype=torch.bfloat16 if spec.dtype == "bf16" else torch.float32), chunks)
    mt.install_training_hooks(chunks, optimizer)
    return module, chunks, optimizer


def _weak_storages(module: Any) -> dict[int, tuple[Any, int]]:
    """``{storage data_ptr: (weak reference, bytes)}`` of the parameters' current storages."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return {p.data.untyped_storage().data_ptr(): (StorageWeakRef(p.data.untyped_storage()),
                                                  p.data.untyped_storage().nbytes()) for p in module.parameters()}


def _copy_flat(module: Any) -> list[Any]:
    """The usual approach: one new flat buffer per dtype with every parameter copied in; params untouched."""
    import torch

    by_dtype: dict[Any, list[Any]] = {}
    for p in module.parameters():
        by_dtype.setdefault(p.dtype, []).append(p)
    flats = []
    with torch.no_grad():
        for dtype, params in by_dtype.items():
            flat = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=params[0].device)
            offset = 0
            for p in params:
                flat[offset:offset + p.numel()].copy_(p.data.reshape(-1))
                offset += p.numel()
            flats.append(flat)
    return flats


def _case(name: str, spec: G.GPTSpec, seed: int, distopt: bool) -> dict[str, Any]:
    """Build, measure, apply ``name``'s approach, measure again; returns the numbers."""
    import torch

    from mcore_compat.binding import bind_params

    module, chunks, optimizer = _build(spec, seed, distopt)
    gc.collect()
    device = spec.device
    C.sync(device)
    weights = G.param_bytes(module)
    old = _weak_storages(module)  # (no local may keep a storage alive)
    alloc_before, reach_before = _allocated(device), _reachable(module, [])
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    mode = None
    if name == "copy_flat":
        held = _copy_flat(module)
    else:
        binding = bind_params(chunks)
        mode = binding.mode
        held = binding.flat_buffers()
    gc.collect()
    C.sync(device)
    alloc_after = _allocated(device)
    peak = int(torch.cuda.max_memory_allocated()) if device == "cuda" else None
    reach_after = _reachable(module, held)
    new_ptrs = {t.untyped_storage().data_ptr() for t in held}
    alive_old = sum(nbytes for ptr, (ref, nbytes) in old.items() if not ref.expired() and ptr not in new_ptrs)
    # copy_flat: the held flat buffers duplicate the (untouched) params; a bind: old storages still alive do.
    lasting_dup = (sum(t.untyped_storage().nbytes() for t in held) if name == "copy_flat" else alive_old)
    out = {
        "distributed_optimizer": distopt, "binding_mode": mode, "weight_bytes": weights,
        "reachable_bytes_before": reach_before, "reachable_bytes_after": reach_after,
        "reachable_extra_bytes": reach_after - reach_before,
        "old_storage_bytes_still_alive": alive_old,
        "lasting_duplicate_bytes": lasting_dup,
        "cuda_allocated_before": alloc_before, "cuda_allocated_after": alloc_after,
        "cuda_extra_bytes": None if alloc_after is None or alloc_before is None else alloc_after - alloc_before,
        "cuda_peak_extra_bytes": None if peak is None or alloc_before is None else peak - alloc_before,
    }
    del held, module, chunks, optimizer
    if name != "copy_flat":
        del binding
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> int:
    p = C.parser(__doc__)
    G.add_args(p)
    args = p.parse_args()
    patches, ps = C.single_rank_megatron(args.device)
    spec = G.spec_from_args(args)
    cases = {"bind_zero_copy": True, "bind_allocated": False, "copy_flat": False}
    results = {name: _case(name, spec, args.seed, distopt) for name, distopt in cases.items()}
    cuda = args.device == "cuda"

    def extra(name: str) -> int:
        r = results[name]
        return int(r["cuda_extra_bytes"] if cuda else r["reachable_extra_bytes"])

    z, a, c = results["bind_zero_copy"], results["bind_allocated"], results["copy_flat"]
    how = "cuda memory_allocated" if cuda else "reachable storages"
    headline = [
        C.metric(f"zero-copy bind: extra bytes ({how})", extra("bind_zero_copy"), "B", goal="== 0"),
        C.metric("zero-copy bind: peak extra bytes", z["cuda_peak_extra_bytes"], "B",
                 goal="== 0" if cuda else None, note="" if cuda else "CUDA only"),
        C.metric("allocated bind: lasting duplicate of the weights", a["lasting_duplicate_bytes"], "B",
                 goal="== 0", note="old per-param storages still alive after rebinding"),
        C.metric(f"allocated bind: extra bytes ({how}) / weight bytes", extra("bind_allocated") / a["weight_bytes"],
                 "x", goal="<= 0.05", note="only DDP-layout padding may remain"),
        C.metric(f"copy-into-flat: extra bytes ({how}) / weight bytes", extra("copy_flat") / c["weight_bytes"],
                 "x", note="the usual approach keeps a full duplicate"),
        C.metric("weights", c["weight_bytes"] / 2**20, "MiB"),
    ]
    config = {**spec.as_dict(), "patches": patches, "world_size": 1}
    C.write_result(NAME, args.device, args.out, config=config, results=results, headline=headline)
    ps.destroy_model_parallel()
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
