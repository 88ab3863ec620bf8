"""The patch registry: declaration, version scoping, verification, application and reversal.

Verification: a patch that changes Megatron code names its targets (``Patch.targets``); it is applied only if
each target's fingerprint in the installed megatron-core is one recorded for it in ``patches/_fingerprints.py``
(see ``_targets.py``); otherwise it is refused (:class:`~mcore_compat.errors.PatchRefusedError`). A patch whose
target module is imported later is checked again then, against the loaded file; if that fails, the patch is
undone, a warning says why, and it is listed by :func:`skipped`, not by :func:`applied`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from packaging.version import Version

from .._facts.ranges import in_range, range_text
from ..errors import PatchError, PatchRefusedError
from . import _targets
from ._fingerprints import FINGERPRINTS

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
        check_fn: verifies, before applying, what ``targets`` cannot (the torch attribute it replaces exists, no
            real package is imported where a stand-in goes, ...); returns ``None`` if fine or a message saying
            what is off. A failed check refuses the patch.
        before_import: must be applied before ``megatron.core`` is imported (stubs of missing packages,
            environment variables read at import).
        needed_when: optional predicate (no args) saying whether the patch is needed in this process at all
            (e.g. ``apex`` not importable); when it returns False, ``apply_for`` skips the patch.
        targets: the Megatron code the patch replaces or wraps, ``"megatron.core.<module>:<qualname>"`` or a
            whole module; each must have, in the installed release, a fingerprint recorded for this patch in
            ``patches/_fingerprints.py``, or the patch is refused. Empty for patches of torch or of packages
            that stand in for missing ones (they change no Megatron code).
    """

    name: str
    versions: str
    purposes: tuple[str, ...]
    description: str
    apply_fn: Callable[[], Undo]
    check_fn: Callable[[], str | None] | None = None
    before_import: bool = False
    needed_when: Callable[[], bool] | None = None
    targets: tuple[str, ...] = ()

    def applies_to(self, version: Version | str) -> bool:
        """Whether ``version`` is within this patch's range."""
        return in_range(version, self.versions)


_REGISTRY: dict[str, Patch] = {}
_APPLIED: dict[str, Undo] = {}  # insertion order = application order
_SKIPPED: dict[str, str] = {}  # applied, then undone when a target was found changed at import: name -> why


def register(patch: Patch) -> Patch:
    """Add a patch to the registry (names must be unique)."""
    if patch.name in _REGISTRY:
        raise PatchError(f"patch {patch.name!r} is registered twice")
    bad = [p for p in patch.purposes if p not in PURPOSES]
    if bad:
        raise PatchError(f"patch {patch.name!r} has unknown purposes {bad}; known: {PURPOSES}")
    for target in patch.targets:
        _targets.module_relpath(_targets.split_target(target)[0])  # raises for a target outside megatron.core
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


def refusal(name: str, version: Version | str | None = None) -> str | None:
    """Why ``apply(name, version)`` would refuse the patch for the installed megatron-core: ``version`` (default:
    detected) outside its range, or a target that is not the code it was written for; ``None`` if it would not.
    (Checks of torch or of imported packages, ``check_fn``, are not included.)"""
    patch = get(name)
    ver = _version(version)
    if not patch.applies_to(ver):
        return (f"patch {name!r} applies to megatron-core {range_text(patch.versions)}, not to {ver}; refusing to "
                f"apply it. `mcore-compat doctor` lists the patches for your release.")
    if patch.targets:
        return _targets.refusal(name, patch.targets, ver, FINGERPRINTS.get(name, {}))
    return None


def apply(name: str, version: Version | str | None = None) -> bool:
    """Apply one patch. Returns ``False`` if it was already applied.

    Raises:
        PatchRefusedError: ``version`` (default: detected) is outside the patch's range, a target in the installed
            megatron-core is not the code the patch was written for, or its check failed.
        PatchError: it must precede ``import megatron.core``, which has happened.
    """
    patch = get(name)
    if name in _APPLIED:
        return False
    ver = _version(version)
    if not patch.applies_to(ver):
        raise PatchRefusedError(refusal(name, ver) or name)
    if patch.before_import:
        import sys

        if "megatron.core" in sys.modules and name not in _APPLIED:
            raise PatchError(
                f"patch {name!r} must be applied before `megatron.core` is imported; apply it first thing "
                f"(e.g. `mcore_compat.patches.apply_for(...)` before importing megatron or model code)."
            )
    problem = refusal(name, ver)
    if problem:
        raise PatchRefusedError(problem)
    if patch.check_fn is not None:
        problem = patch.check_fn()
        if problem:
            raise PatchRefusedError(f"patch {name!r} refused: {problem}")
    _SKIPPED.pop(name, None)
    undo = patch.apply_fn()
    if name in _SKIPPED:  # a target module already imported was found changed while applying: undone, refused
        undo()
        raise PatchRefusedError(_SKIPPED.pop(name))
    _APPLIED[name] = undo
    return True


def target_changed(name: str, why: str) -> None:
    """Called when a target module of the applied patch ``name`` is imported and is not the code the patch was
    written for: undo the patch and list it under :func:`skipped` instead of :func:`applied`."""
    _SKIPPED[name] = why
    undo = _APPLIED.pop(name, None)
    if undo is not None:
        undo()


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
    """Names of the applied patches, in application order. A patch of a Megatron module not imported yet is
    applied once its fingerprints were checked against the installed file (it takes effect on import). Patches
    that were refused, not needed here (``apply_for``) or undone at import (:func:`skipped`) are not listed."""
    return list(_APPLIED)


def skipped() -> dict[str, str]:
    """Patches that were applied but undone when a target module was imported and found changed: name -> why."""
    return dict(_SKIPPED)


def revert(name: str) -> None:
    """Undo one applied patch."""
    _SKIPPED.pop(name, None)
    undo = _APPLIED.pop(name, None)
    if undo is None:
        raise PatchError(f"patch {name!r} is not applied")
    undo()


def revert_all() -> None:
    """Undo every applied patch, newest first (and forget the skipped ones)."""
    for name in reversed(list(_APPLIED)):
        revert(name)
    _SKIPPED.clear()


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
