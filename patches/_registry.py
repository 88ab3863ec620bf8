"""The patch registry: declaration, version scoping, verification, application and reversal."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from packaging.version import Version

from .._ranges import in_range, range_text
from ..errors import PatchError

PURPOSES = ("cpu", "apex_less", "te_less", "upstream_bug")

Undo = Callable[[], None]


@dataclass(frozen=True)
class Patch:
    """A runtime patch.

    Attributes:
        name: unique identifier.
        versions: PEP 440 range of megatron-core releases it applies to; applying it outside is refused.
        purposes: which purposes include it (see ``PURPOSES``).
        description: what it changes and which failure it fixes (shown by ``mcore-compat doctor``).
        apply_fn: performs the patch and returns a function that undoes it exactly.
        check_fn: verifies, before applying, that the patch target looks as expected (the attribute exists, the
            failure it fixes is present, ...); returns ``None`` if fine or a message saying what is off.
            A failed check refuses the patch.
        before_import: must be applied before ``megatron.core`` is imported (stubs of missing packages,
            environment variables read at import).
        needed_when: optional predicate (no args) saying whether the patch is needed in this process at all
            (e.g. ``apex`` not importable); when it returns False, ``apply_for`` skips the patch.
    """

    name: str
    versions: str
    purposes: tuple[str, ...]
    description: str
    apply_fn: Callable[[], Undo]
    check_fn: Callable[[], str | None] | None = None
    before_import: bool = False
    needed_when: Callable[[], bool] | None = None

    def applies_to(self, version: Version | str) -> bool:
        """Whether ``version`` is within this patch's range."""
        return in_range(version, self.versions)


_REGISTRY: dict[str, Patch] = {}
_APPLIED: dict[str, Undo] = {}  # insertion order = application order


def register(patch: Patch) -> Patch:
    """Add a patch to the registry (names must be unique)."""
    if patch.name in _REGISTRY:
        raise PatchError(f"patch {patch.name!r} is registered twice")
    bad = [p for p in patch.purposes if p not in PURPOSES]
    if bad:
        raise PatchError(f"patch {patch.name!r} has unknown purposes {bad}; known: {PURPOSES}")
    _REGISTRY[patch.name] = patch
    return patch


def list_patches() -> list[Patch]:
    """Every registered patch."""
    return list(_REGISTRY.values())


def get(name: str) -> Patch:
    """The patch called ``name``."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise PatchError(f"no patch called {name!r}; known: {', '.join(_REGISTRY)}") from None


def _version(version: Version | str | None) -> Version:
    if version is None:
        from ..detect import detect

        return detect().version
    return Version(str(version))


def applicable(*purposes: str, version: Version | str | None = None) -> list[Patch]:
    """Patches of any of ``purposes`` whose range contains ``version`` (default: the detected release)."""
    ver = _version(version)
    unknown = [p for p in purposes if p not in PURPOSES]
    if unknown:
        raise PatchError(f"unknown patch purposes {unknown}; known: {PURPOSES}")
    return [p for p in _REGISTRY.values() if p.applies_to(ver) and (not purposes or set(p.purposes) & set(purposes))]


def apply(name: str, version: Version | str | None = None) -> bool:
    """Apply one patch. Returns ``False`` if it was already applied.

    Raises:
        PatchError: ``version`` (default: detected) is outside the patch's range, or its check failed.
    """
    patch = get(name)
    if name in _APPLIED:
        return False
    ver = _version(version)
    if not patch.applies_to(ver):
        raise PatchError(
            f"patch {name!r} applies to megatron-core {range_text(patch.versions)}, not to {ver}; refusing to "
            f"apply it. `mcore-compat doctor` lists the patches for your release."
        )
    if patch.before_import:
        import sys

        if "megatron.core" in sys.modules and name not in _APPLIED:
            raise PatchError(
                f"patch {name!r} must be applied before `megatron.core` is imported; apply it first thing "
                f"(e.g. `mcore_compat.patches.apply_for(...)` before importing megatron or model code)."
            )
    if patch.check_fn is not None:
        problem = patch.check_fn()
        if problem:
            raise PatchError(f"patch {name!r} refused: {problem}")
    _APPLIED[name] = patch.apply_fn()
    return True


def apply_for(*purposes: str, version: Version | str | None = None) -> list[str]:
    """Apply every patch of ``purposes`` that applies to ``version`` and is needed here.

    All or nothing: if one of them is refused, the ones this call already applied are reverted before the
    error propagates.

    Returns:
        The names applied by this call, in order.
    """
    ver = _version(version)
    done: list[str] = []
    try:
        for patch in applicable(*purposes, version=ver):
            if patch.needed_when is not None and not patch.needed_when():
                continue
            if apply(patch.name, ver):
                done.append(patch.name)
    except BaseException:
        for name in reversed(done):
            if name in _APPLIED:
                revert(name)
        raise
    return done


def purposes_for_device(device: str) -> tuple[str, ...]:
    """The purposes a run on ``device`` (``"cpu"`` or ``"cuda"``) needs: ``apex_less``, ``te_less`` and
    ``upstream_bug`` everywhere (no apex or TransformerEngine is assumed; each patch applies only where it is
    needed), plus the ``cpu`` harness on a CPU."""
    if device not in ("cpu", "cuda"):
        raise PatchError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return ("apex_less", "te_less", "upstream_bug") + (("cpu",) if device == "cpu" else ())


def apply_for_device(device: str, version: Version | str | None = None) -> list[str]:
    """``apply_for(*purposes_for_device(device))``: what the self-check, the benchmarks and the tests apply
    before Megatron is imported. Returns the names applied by this call (:func:`applied` lists all)."""
    return apply_for(*purposes_for_device(device), version=version)


def applied() -> list[str]:
    """Names of the applied patches, in application order."""
    return list(_APPLIED)


def revert(name: str) -> None:
    """Undo one applied patch."""
    undo = _APPLIED.pop(name, None)
    if undo is None:
        raise PatchError(f"patch {name!r} is not applied")
    undo()


def revert_all() -> None:
    """Undo every applied patch, newest first."""
    for name in reversed(list(_APPLIED)):
        revert(name)


@contextlib.contextmanager
def patched(*purposes: str, version: Version | str | None = None) -> Iterator[list[str]]:
    """Context manager: ``apply_for(*purposes)`` on entry, revert what it applied on exit."""
    names = apply_for(*purposes, version=version)
    try:
        yield names
    finally:
        for name in reversed(names):
            if name in _APPLIED:
                revert(name)
