"""The self-check's offload cycles (``--offload-cycles N``): between two verified steps, the RL colocation cycle
through :func:`mcore_compat.offload` / :func:`mcore_compat.reload`, proved from the outside.

Each cycle offloads params, grads and optimizer state (even cycles) or grads and optimizer state only (odd
cycles: the params stay for a weight hand-off), then reloads them. The tensors are found here independently of
the offload code (every param and module buffer of every chunk, DDP's buffers, each ``main_grad``, the
optimizer's main params, their ``.grad`` and their state, read through
:func:`~mcore_compat._util.optimizer_view.optimizer_view`), and three checks come out:

* ``offload_frees_memory``: after ``offload`` every storage of an offloaded piece is 0 bytes and every kept one
  is untouched; on CUDA, ``torch.cuda.memory_allocated()`` dropped by at least their bytes;
* ``reload_in_place``: after ``reload`` every tensor is on the storage it was on (the same ``StorageImpl``) at
  the same offset, bit-identical to before the offload: params still alias DDP's buffers, ``main_grad`` and the
  binding's views stay valid;
* ``offload_host_memory_bounded``: the host buffers hold 1x the bytes offloaded, and every cycle after the
  first reuses the buffers of the first (none allocated again).

The step after the reload is then proved like every step (gradients, update rule, model params against the main
params, nothing changed between the steps), so a reload that restores the bytes but detaches the params from
what Megatron updates fails there too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .._util.own_math import own_tensor_math
from .report import Check

__all__ = ["OffloadCycles"]

_ALL = ("params", "grads", "optimizer_state")
_KEEP_PARAMS = ("grads", "optimizer_state")


@dataclass
class _Tracked:
    piece: str
    name: str
    tensor: Any


@dataclass
class _Findings:
    freed: list[str] = field(default_factory=list)
    in_place: list[str] = field(default_factory=list)
    host: list[str] = field(default_factory=list)
    bytes_freed: dict[str, int] = field(default_factory=dict)
    tensors: int = 0
    host_bytes: int = 0
    offloaded_bytes: int = 0
    cuda_dropped: dict[str, int] = field(default_factory=dict)


def _storage_key(t: Any) -> int:
    return int(t.untyped_storage()._cdata)


def _tracked(chunks: list[Any], view: Any) -> list[_Tracked]:
    """Every tensor holding the model's or the optimizer's memory on the model's device, by piece (a storage
    reached from several pieces belongs to the first of params, grads, optimizer state)."""
    import torch

    from ..capabilities import fact
    from ..detect import detect
    from ..layout.read import ddp_buffers
    from .wrappers import core_module

    out: list[_Tracked] = []
    grad_attr = fact("grad_data_attr")
    for i, chunk in enumerate(chunks):
        for j, (buf, _expert) in enumerate(ddp_buffers(chunk, detect().version)):
            if getattr(buf, "param_data", None) is not None:
                out.append(_Tracked("params", f"{i}.buffer{j}.param_data", buf.param_data))
            if getattr(buf, grad_attr, None) is not None:
                out.append(_Tracked("grads", f"{i}.buffer{j}.grads", getattr(buf, grad_attr)))
        for name, p in core_module(chunk).named_parameters():
            out.append(_Tracked("params", f"{i}.{name}", p))
            for attr in ("main_grad", "grad"):
                if isinstance(getattr(p, attr, None), torch.Tensor):
                    out.append(_Tracked("grads", f"{i}.{name}.{attr}", getattr(p, attr)))
        out.extend(_Tracked("params", f"{i}.{name} (buffer)", b) for name, b in core_module(chunk).named_buffers())
    for k, mp in enumerate(view):
        label = f"{mp.name}[main {k}]"
        if mp.main is not mp.model:
            out.append(_Tracked("optimizer_state", label, mp.main))
        if mp.main.grad is not None:
            out.append(_Tracked("grads", f"{label}.grad", mp.main.grad))
        state = mp.inner.state.get(mp.main, {}) if mp.inner is not None else {}
        out.extend(_Tracked("optimizer_state", f"{label}.{key}", v) for key, v in sorted(state.items())
                   if isinstance(v, torch.Tensor))
    device = next((t.tensor.device for t in out), None)
    out = [t for t in out if t.tensor.device == device]
    first_piece: dict[int, str] = {}
    for piece in _ALL:
        for t in out:
            if t.piece == piece:
                first_piece.setdefault(_storage_key(t.tensor), piece)
    for t in out:
        t.piece = first_piece[_storage_key(t.tensor)]
    return out


def _storage_bytes(tracked: list[_Tracked], pieces: tuple[str, ...]) -> int:
    seen: dict[int, int] = {}
    for t in tracked:
        if t.piece in pieces:
            seen[_storage_key(t.tensor)] = t.tensor.untyped_storage().nbytes()
    return sum(seen.values())


class OffloadCycles:
    """Runs the offload cycles of one self-check configuration and keeps what they showed.

    Args:
        chunks: the DDP-wrapped model chunks.
        optimizer: their optimizer.
        view: the optimizer's main params (:func:`~mcore_compat._util.optimizer_view.optimizer_view` with names).
        cycles: how many cycles in all (0: none; the checks are then left out of the report).
        fault: the self-check's injected fault (the offload faults act inside the offload code).
    """

    def __init__(self, chunks: list[Any], optimizer: Any, view: Any, cycles: int, fault: str | None = None) -> None:
        self.chunks = chunks
        self.optimizer = optimizer
        self.view = view
        self.cycles = cycles
        self.fault = fault
        self.done = 0
        self.found = _Findings()
        self._first_buffers: set[int] | None = None
        self._refused: str | None = None

    def gaps(self, steps: int) -> list[int]:
        """How many cycles run after each step (all but the last step: a verified step follows every reload)."""
        gaps = [0] * steps
        for i in range(self.cycles):
            gaps[i % max(steps - 1, 1)] += 1
        return gaps

    @own_tensor_math
    def run(self, count: int) -> None:
        """Run ``count`` cycles now (between two steps, no communication in flight)."""
        from .. import lifecycle

        if self.done == 0:
            lifecycle.release_host_buffers()  # this configuration's buffers only (earlier ones of the process gone)
        for _ in range(count):
            if self._refused is not None:
                return
            pieces = _ALL if self.done % 2 == 0 else _KEEP_PARAMS
            try:
                with _Injected(self.fault):
                    self._cycle(pieces)
            except lifecycle.OffloadError as exc:
                self._refused = str(exc).splitlines()[0]
            self.done += 1

    def _cycle(self, pieces: tuple[str, ...]) -> None:
        import torch

        import mcore_compat as mc

        from ..lifecycle import _host

        tracked = _tracked(self.chunks, self.view)
        before = {t.name: (_storage_key(t.tensor), t.tensor.storage_offset(), t.tensor.detach().to("cpu", copy=True))
                  for t in tracked}
        kept = {t.name: t.tensor.untyped_storage().nbytes() for t in tracked if t.piece not in pieces}
        per_piece = {piece: _storage_bytes(tracked, (piece,)) for piece in pieces}
        expected = sum(per_piece.values())
        device = tracked[0].tensor.device if tracked else torch.device("cpu")
        cuda = device.type == "cuda"
        allocated = torch.cuda.memory_allocated(device) if cuda else 0
        flags = {piece: piece in pieces for piece in _ALL}
        mc.offload(self.chunks, self.optimizer, **flags)
        f = self.found
        cycle = f"cycle {self.done} ({'+'.join(pieces)})"
        for t in tracked:
            left = t.tensor.untyped_storage().nbytes()
            if t.piece in pieces and left:
                f.freed.append(f"{cycle}: {t.piece} {t.name} still holds {left} bytes")
            elif t.piece not in pieces and left != kept[t.name]:
                f.freed.append(f"{cycle}: {t.name} ({t.piece}, kept) changed from {kept[t.name]} to {left} bytes")
        for piece, n in per_piece.items():
            f.bytes_freed[piece] = max(f.bytes_freed.get(piece, 0), n)
        if cuda:
            dropped = allocated - torch.cuda.memory_allocated(device)
            label = "+".join(pieces)
            f.cuda_dropped[label] = min(f.cuda_dropped.get(label, dropped), dropped)
            if dropped < expected:
                f.freed.append(f"{cycle}: torch.cuda.memory_allocated() dropped by {dropped} bytes, the offloaded "
                               f"storages hold {expected}")
        f.offloaded_bytes = max(f.offloaded_bytes, expected)
        host = _host.host_bytes()
        f.host_bytes = max(f.host_bytes, host)
        buffers = {b.data_ptr() for b in _host.buffers()}
        if host > f.offloaded_bytes:
            f.host.append(f"{cycle}: host buffers hold {host} bytes, {host / max(f.offloaded_bytes, 1):.2f}x the "
                          f"{f.offloaded_bytes} bytes offloaded")
        if self._first_buffers is None:
            if pieces == _ALL:
                self._first_buffers = buffers
        elif buffers - self._first_buffers:
            f.host.append(f"{cycle}: {len(buffers - self._first_buffers)} host buffer(s) allocated again instead of "
                          f"reusing the first cycle's")
        mc.reload(self.chunks, self.optimizer, **flags)
        for t in tracked:
            key, offset, value = before[t.name]
            f.tensors += 1
            if _storage_key(t.tensor) != key:
                f.in_place.append(f"{cycle}: {t.name} is on new storage (no longer what Megatron updates)")
            elif t.tensor.storage_offset() != offset:
                f.in_place.append(f"{cycle}: {t.name} moved from offset {offset} to {t.tensor.storage_offset()}")
            elif not torch.equal(t.tensor.detach().cpu(), value):
                f.in_place.append(f"{cycle}: {t.name} differs from before the offload")

    def checks(self) -> list[Check]:
        """The three verdicts (none when no cycle was asked for)."""
        if self.cycles == 0:
            return []
        if self._refused is not None:
            why = f"offload refused: {self._refused}"
            return [Check("offload_frees_memory", False, why), Check.not_applicable("reload_in_place", why),
                    Check.not_applicable("offload_host_memory_bounded", why)]
        if self.done == 0:
            na = "no cycle ran (a cycle runs between two steps)"
            return [Check.not_applicable(n, na) for n in ("offload_frees_memory", "reload_in_place",
                                                          "offload_host_memory_bounded")]
        f = self.found
        pieces = ", ".join(f"{p.replace('_', ' ')} {n} B" for p, n in f.bytes_freed.items())
        cuda = "".join(f"; memory_allocated() dropped by >= {n} B offloading {label}"
                       for label, n in f.cuda_dropped.items())
        later = "cycle 2" if self.done == 2 else f"cycles 2-{self.done}"
        reuse = (f"; {later} reused the first cycle's buffers" if self.done > 1 else
                 "; one cycle: reuse not tested (--offload-cycles 2 tests it)")
        return [
            _check("offload_frees_memory", f.freed,
                   f"{self.done} cycle(s): every storage of the offloaded pieces at 0 bytes ({pieces}), the kept "
                   f"pieces untouched{cuda}"),
            _check("reload_in_place", f.in_place,
                   f"{f.tensors} tensor checks over {self.done} reload(s): each tensor on its own storage at its "
                   f"offset, bit-identical to before the offload"),
            _check("offload_host_memory_bounded", f.host,
                   f"host buffers {f.host_bytes} B = {f.host_bytes / max(f.offloaded_bytes, 1):.2f}x the "
                   f"{f.offloaded_bytes} B offloaded at once{reuse}"),
        ]


def _check(name: str, failures: list[str], detail: str) -> Check:
    if failures:
        return Check(name, False, f"{len(failures)} failure(s): " + "; ".join(failures[:3]),
                     {"failures": failures[:50]})
    return Check(name, True, detail)


class _Injected:
    """The offload faults of the self-check, acting inside the offload code where a real bug would act."""

    def __init__(self, fault: str | None) -> None:
        self.fault = fault
        self.undo: list[tuple[Any, str, Any]] = []

    def _patch(self, owner: Any, attr: str, value: Any) -> None:
        self.undo.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, value)

    def __enter__(self) -> None:
        from ..lifecycle import _collect, _host, _storage

        if self.fault == "reload_recreates_storage":
            refill = _storage.refill

            def recreate(slot: Any, tensors: Any) -> int:
                import torch

                n = refill(slot, tensors)
                for t in tensors:  # hand-written reload code: the bytes into new memory, param.data rebound
                    if isinstance(t, torch.nn.Parameter):
                        t.data = t.data.clone()
                return n

            self._patch(_storage, "refill", recreate)
        elif self.fault == "offload_misses_optimizer_state":
            self._patch(_collect, "_optimizer_tensors", lambda optimizer, want_state: ([], []))
        elif self.fault == "offload_reallocates_host":
            leaked: list[Any] = []

            def fresh(slot: Any, nbytes: int, device: Any) -> Any:
                import torch

                if slot.host is not None:
                    leaked.append(slot.host)  # still referenced: a new pinned buffer every cycle
                slot.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
                return slot.host

            self._patch(_host.HostSlot, "ensure_host", fresh)

    def __exit__(self, *exc: object) -> None:
        for owner, attr, value in reversed(self.undo):
            setattr(owner, attr, value)
        self.undo.clear()
