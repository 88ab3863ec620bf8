"""``matrix/README.md``: the support table and the base environments, rendered from the matrix's data."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from packaging.version import Version

from .model import Release

__all__ = ["render"]


_HEADER = """\
<!-- Generated from matrix/versions.toml and matrix/results.json by `python -m mcore_compat.support render`.
     Do not edit by hand: edit versions.toml (releases) or run `python3 -m nox -s matrix` (CPU results)
     or scripts/record_gpu_results.py (GPU results). -->
# Supported Megatron-Core releases

Every release below has its own nox session (`nox -s mcore-<version>`, `nox -l` lists them) that runs the
`mcore`-marked tests against that exact release on a CPU-only torch. **min**/**latest** mark the earliest and
latest tested patch of each minor. A version that is not listed (a release candidate, a source checkout, a newer
release) is looked up by `mcore-compat doctor`, which names the nearest tested releases.

**CPU**: the release's nox session (pytest counts) and its `mcore-compat self-check --nproc 2 --sweep --bind`
(run through the CLI with freshly spawned ranks in the sessions tagged `launcher`, in the others the same
configurations built by the CLI's option handling inside the suite's warm ranks; the standard configurations the release can run: DP=2 with the distributed optimizer on and off, TP=2 with
sequence parallelism, the same with dropout 0.1, PP=2 with tied embeddings and linear biases, PP=2 with
virtual stages, overlapped DP, MoE with expert parallelism; each with two offload/reload cycles between its
first two steps), on gloo. **Faults caught**: the
fault-injection suite (`tests/test_selfcheck_real.py`), every fault that can exist on the release injected where
the real bug acts, in bf16 and, where the param dtype changes the code it acts in (the optimizer and its
buffers, the update rule, the fp32 gradient tolerance), in fp32 too; a fault counts as caught when the self-check
FAILS naming the right check (and the clean configurations PASS). **Megatron faults caught/acting**: faults
injected inside Megatron-Core itself (`tests/test_megatron_faults.py`: a Megatron function replaced in the ranks,
e.g. DDP's gradient reduction, the param all-gather, unscaling, the grad norm, clipping, the optimizer step, the
tied-embedding and sequence-parallel all-reduces, a layer's forward), caught over those that act on the release
(a fault whose target does not exist or run there is not acting, never counted as caught). Both fault suites run
in the session of each minor's latest listed patch; an earlier patch names it ("run on ...": versions.toml's header).
**Loads checkpoints of**: `tests/test_checkpoint_cross.py` in the release's session loads the committed
checkpoints (`tests/data/checkpoints/<A>/`) that `mcore_compat.save_checkpoint` wrote on each release A, with and
without the optimizer; "exact": every weight, main param, both Adam moments and the step equal to A's values bit for
bit, and a step trains after the load (a refusal is named by its error).
**Generated settings**: `tests/test_generated_settings.py`, the examples Hypothesis drew per property (a fixed
seed: every release draws the same): `committed` (5 committed cases against the formulas, raw Megatron and
0.16.1's record), `schedule` (every parameter's lr and weight decay over a drawn schedule,
resumed mid-way, against the formulas in float64 and Megatron's own scheduler), `invalid` (44 invalid settings
refused in one line naming the setting, groups unchanged), `update` (1-3 training steps with drawn DDP settings:
gradients against a float64 replica, the grad norm, the main params against Adam in float64); "n/m drawn compared
with 0.16.1": the drawn examples of schedule, resume, overrides, invalid and update whose observation was compared
with the reference release's committed record of the same example (the rest: settings this release refuses).
**GPU**: `scripts/gpu_matrix.py` on NVIDIA
H200 with NCCL: the self-check in bf16 with `--bind` and two offload cycles on 1 GPU (distributed optimizer on
and off, lr 1e-2 and 1e-6; runs before 2026-12-01-9 had no offload cycle) and, where a 2-GPU machine was
lent, the standard sweep on 2 GPUs; per-configuration results are in `results.json`, the raw runs in
`gpu-runs/` (`python3 scripts/record_gpu_results.py` re-records them).
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ") if text else "—"


def _limits_cell(release: Release) -> str:
    names = {"requires_python": "python", "torch": "torch", "numpy": "numpy", "setuptools": "setuptools"}
    return ", ".join(f"{names[k]}{v}" for k, v in release.limits().items()) or "—"


def _install_cell(release: Release) -> str:
    if release.install == "unpack-wheel":
        return f"cp{release.wheel_python.replace('.', '')} wheel's `megatron/` on sys.path (no metadata)"
    return "`pip install megatron-core==" + str(release.version) + "`"


def _result_cell(result: Mapping[str, Any] | None) -> str:
    if not result:
        return "—"
    text = f"{result.get('result', '?')} ({result.get('date', '?')})"
    configs = result.get("configurations")
    if isinstance(configs, list) and configs and all(isinstance(c, Mapping) for c in configs):
        gpus = sorted({int(c.get("gpus", 1)) for c in configs})
        good = sum(bool(c.get("ok")) for c in configs)
        where = "/".join(map(str, gpus)) + " GPU" + ("s" if gpus != [1] else "")
        return _cell(f"{text}: {good}/{len(configs)} configurations on {where}")
    counts = [f"{result[k]} {k}" for k in ("passed", "failed", "errors", "skipped") if result.get(k)]
    if counts:
        text += ": " + ", ".join(counts)
    check = result.get("self_check")
    if isinstance(check, Mapping) and check.get("summary"):
        text += f"; self-check {check['summary']}"
    return _cell(text)


def _faults_cell(result: Mapping[str, Any] | None) -> str:
    """``28/28 (100 %)`` from a CPU result's ``fault_detection`` (``—`` when not recorded)."""
    faults = (result or {}).get("fault_detection")
    if not isinstance(faults, Mapping) or not faults.get("faults"):
        return "—"
    caught, total = int(faults.get("caught", 0)), int(faults["faults"])
    text = f"{caught}/{total} ({100.0 * caught / total:.0f} %)"
    if faults.get("clean") and faults.get("clean_pass") != faults.get("clean"):
        text += f"; clean {faults.get('clean_pass')}/{faults.get('clean')}"
    return text


def _megatron_faults_cell(result: Mapping[str, Any] | None) -> str:
    """``17/17; 2 not acting`` from a CPU result's ``megatron_fault_detection`` (``—`` when not recorded)."""
    faults = (result or {}).get("megatron_fault_detection")
    if not isinstance(faults, Mapping) or "acting" not in faults:
        return "—"
    text = f"{int(faults.get('caught', 0))}/{int(faults['acting'])}"
    if faults.get("not_acting"):
        text += f"; {int(faults['not_acting'])} not acting"
    if faults.get("clean") and faults.get("clean_pass") != faults.get("clean"):
        text += f"; clean {faults.get('clean_pass')}/{faults.get('clean')}"
    return text


def _checkpoints_cell(result: Mapping[str, Any] | None) -> str:
    """``0.4.0-0.19.2: exact`` from a CPU result's ``checkpoint_cross`` (tests/test_checkpoint_cross.py: per
    saving release, the ``full`` and ``weights`` loads); the saving releases that did not load exactly are named
    with the first word of their outcome. ``—`` when not recorded."""
    loads = (result or {}).get("checkpoint_cross")
    if not isinstance(loads, Mapping) or not loads:
        return "—"
    sources = sorted(loads, key=Version)
    span = f"{sources[0]}-{sources[-1]}" if len(sources) > 1 else sources[0]
    bad = []
    for src in sources:
        entry = loads[src] if isinstance(loads[src], Mapping) else {}
        full, weights = str(entry.get("full", "?")), str(entry.get("weights", "?"))
        if full != "exact" or weights != "exact":
            bad.append(f"{src} {_cross_cell(entry)}")
    return f"{span}: exact" if not bad else _cell(f"{span}: {len(sources) - len(bad)}/{len(sources)} exact; "
                                                  + "; ".join(bad))


def _generated_cell(result: Mapping[str, Any] | None) -> str:
    """``schedule 12, invalid 72, update 10; 70/80 drawn compared with 0.16.1`` from a CPU result's
    ``generated_settings`` (examples per property, the failed ones marked; the drawn examples compared with the
    reference release's record); ``—`` when not recorded."""
    generated = (result or {}).get("generated_settings")
    if not isinstance(generated, Mapping) or not isinstance(generated.get("examples"), Mapping):
        return "—"
    failed = set(generated.get("failed") or ())
    text = ", ".join(f"{name} {count}" + (" FAILED" if name in failed else "")
                     for name, count in generated["examples"].items())
    reference = generated.get("reference")
    if isinstance(reference, Mapping) and reference:
        compared = sum(int(c.get("compared", 0)) for c in reference.values())
        drawn = sum(int(c.get("drawn", 0)) for c in reference.values())
        text += f"; {compared}/{drawn} drawn compared with {generated.get('reference_release', 'the reference')}"
    return _cell(text)


def _timing_row(version: str, result: Mapping[str, Any] | None) -> str | None:
    """One row of the time table from a CPU result's ``timing`` (``None`` when not recorded)."""
    timing = (result or {}).get("timing")
    if not isinstance(timing, Mapping):
        return None

    def sec(key: str) -> str:
        return f"{timing[key]:.0f}" if isinstance(timing.get(key), (int, float)) else "—"

    starts = timing.get("rank_starts") or []
    start_text = ", ".join(f"{s['nprocs']} {'forked' if s['method'] == 'forkserver' else 'spawned'} "
                           f"{s['seconds']:.1f} s" for s in starts) or "—"
    sub = timing.get("subprocesses") or {}
    sub_text = f"{sub['count']}: {sub['seconds']:.0f} s" if sub else "—"
    slow = ", ".join(f"{m.rsplit('/', 1)[-1]} {v:.0f}" for m, v in (timing.get("slowest_modules") or {}).items())
    total = (result or {}).get("seconds")
    return (f"| {version} | {total:.0f} | {sec('prepare')} | {sec('pytest')} | {sec('collect')} | {start_text} | "
            f"{sub_text} | {sec('selfcheck')} | {slow or '—'} |" if isinstance(total, (int, float)) else None)


_TIMING_HEADER = """## Where a release session's time goes

Seconds of the last recorded CPU run (two sessions at a time on a 2-core machine; the matrix prints the same
table at the end of every run). **prepare**: base check, release tree, mcore-compat install; **pytest**: the
whole test run, of which **collect** is collection, **rank starts** the groups of ranks the suite started
(forked from one warm fork server that imported torch, the CPU patches and Megatron once: see
`mcore_compat.launch.Group(warm=...)`) and **subprocesses** the fresh interpreters the tests ran (CLI, doctor,
patches that must precede Megatron's import); **self-check**: the CLI sweep as a user runs it (fresh processes;
the `launcher` sessions only, the others run its configurations inside pytest).
"""


def _cross_cell(entry: Mapping[str, Any]) -> str:
    full, weights = str(entry.get("full", "?")), str(entry.get("weights", "?"))
    if full == "exact":
        return "exact"
    if weights == "exact":
        return "weights exact; optimizer " + _cell(full.split(":")[0])
    return _cell(weights.split(":")[0])


def _checkpoint_section(cross: Mapping[str, Any]) -> list[str]:
    """The "saved on A, loaded on B" table of ``checkpoint_cross.json``."""
    results: Mapping[str, Mapping[str, Any]] = cross.get("results", {})
    loaders = list(cross.get("releases", []))
    lines = ["", "## Checkpoints across releases", "",
             f"`mcore_compat.save_checkpoint` on the row's release, `load_checkpoint` on the column's "
             f"({cross.get('format', '?')}; {cross.get('what', '')}). Recorded {cross.get('recorded', '?')} by "
             "`scripts/checkpoint_matrix.py` (by hand: each release saves its own freshly trained checkpoint).", "",
             "Checked in CI: every release session loads the committed checkpoints written on these releases "
             "(`tests/data/checkpoints/`, a smaller model of the same kind, 1 layer of hidden size 8) with "
             "`tests/test_checkpoint_cross.py`: every pair (saved on one of them, loaded on any release of the "
             "table above), its result in the column **loads checkpoints of**. The sessions of the releases that "
             "wrote them also check that they still write the same values.", "",
             "| saved on \\ loaded on | " + " | ".join(loaders) + " |", "|---|" + "---|" * len(loaders)]
    for saver in [r for r in loaders if r in results] + [r for r in results if r not in loaders]:
        lines.append(f"| {saver} | " + " | ".join(_cross_cell(results[saver].get(b, {})) for b in loaders) + " |")
    return lines


def render(releases: Iterable[Release], recorded: Mapping[str, Mapping[str, Any]],
           bases: Mapping[str, list[str]], checkpoint_cross: Mapping[str, Any] | None = None) -> str:
    """The text of ``matrix/README.md``.

    Args:
        releases: the listed releases, oldest first.
        recorded: recorded results by release and kind (``{"0.16.1": {"cpu": {...}}}``).
        bases: the base environments' requirements by Python version.
        checkpoint_cross: the recorded checkpoint matrix (``checkpoint_cross.json``), shown after the timings.
    """
    releases = list(releases)
    lines = [_HEADER, "| megatron-core | tags | Python | limits | install | CPU | faults caught | "
                      "Megatron faults caught/acting | loads checkpoints of | generated settings | GPU | notes |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in releases:
        res = recorded.get(str(r.version), {})
        tags = ", ".join(t for t in r.tags if t in ("min", "latest", "oldest", "newest"))
        faults, megatron_faults = _faults_cell(res.get("cpu")), _megatron_faults_cell(res.get("cpu"))
        if "latest" not in r.tags:  # the fault suites run on the minor's latest listed patch (versions.toml)
            latest = max(o.version for o in releases if o.minor == r.minor)
            faults = megatron_faults = f"run on {latest} (the minor's latest patch)"
        lines.append(f"| {r.version} | {tags} | {r.python} | {_limits_cell(r)} | {_install_cell(r)} | "
                     f"{_result_cell(res.get('cpu'))} | {faults} | "
                     f"{megatron_faults} | {_checkpoints_cell(res.get('cpu'))} | "
                     f"{_generated_cell(res.get('cpu'))} | "
                     f"{_result_cell(res.get('gpu'))} | {_cell(r.notes)} |")
    timing_rows = [row for r in releases
                   if (row := _timing_row(str(r.version), recorded.get(str(r.version), {}).get("cpu")))]
    if timing_rows:
        lines += ["", _TIMING_HEADER,
                  "| megatron-core | total | prepare | pytest | collect | rank starts | subprocesses | self-check "
                  "| slowest test modules |", "|---|---|---|---|---|---|---|---|---|", *timing_rows]
    if checkpoint_cross:
        lines += _checkpoint_section(checkpoint_cross)
    lines += ["", "## Base environments", "",
              "Each Python has one shared environment; a release's limits must hold in its base "
              "(the noxfile checks this before running a session).", ""]
    lines += [f"* Python {p}: " + ", ".join(f"`{req}`" for req in reqs) for p, reqs in bases.items()]
    return "\n".join(lines) + "\n"
