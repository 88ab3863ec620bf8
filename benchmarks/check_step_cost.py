"""What ``check_training_step`` costs on the benchmark GPT, in training steps and in bytes.

One rank trains the benchmark GPT (``_gpt.py``; bf16, distributed optimizer, weight decay, clipping) through
``mcore_compat.training``. Interleaved: plain training steps and ``check_training_step`` calls (each is a real,
verified training step), with the reference copy (``reference=True``) and without it. Reported:

* time of one ``check_training_step`` / median time of one plain step (``x`` training steps), with and without
  the reference;
* with ``--finite-differences on`` (the default) also ``check_training_step(..., finite_differences=True)``: its
  time above the default check in plain steps, its float64 copy (8 bytes per param element; the copy's gradient
  is reduced to dot products as it arrives, never held whole) and on CUDA its peak above the default check's,
  as multiples of the parameter bytes (the cost goal: <= 1 plain step and <= 2x the
  param bytes on top of the default check), and the status of its checks (N/A with the reason where it cannot
  run);
* bytes: the reference copy (``reference_bytes``), the pre-step snapshot (``snapshot_bytes``: at its largest;
  with ``--stream on``, the default, the copied fp32 gradients plus the largest part of the state checked inside
  the optimizer step), and on CUDA the peak allocated memory during the check above the peak of a plain step,
  next to the model's parameter bytes.

    python3 benchmarks/check_step_cost.py --device cuda      # 8 layers, hidden 1024, seq 512, bf16
    python3 benchmarks/check_step_cost.py --device cpu       # tiny GPT (smoke)
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C
import _gpt as G

NAME = "check_step_cost"
LR = 1e-5


def main(argv: list[str] | None = None) -> int:
    p = C.parser(__doc__)
    G.add_args(p)
    p.add_argument("--reps", type=int, default=None, help="checks per variant (default: 5 on cuda, 3 on cpu)")
    p.add_argument("--host-snapshot", default=None,
                   help="comma-separated parts of the pre-step snapshot kept in pinned host memory on CUDA "
                        "('main', optimizer state keys; '' for none; default: selfcheck.verify.HOST_SNAPSHOT, "
                        "where it fits on the device, else HOST_WHEN_SHORT)")
    p.add_argument("--stream", choices=("on", "off"), default="on",
                   help="check the update inside the optimizer step, part by part (on, the default), or from a "
                        "snapshot of the whole pre-step state (off: MCORE_COMPAT_STREAM=0)")
    p.add_argument("--finite-differences", choices=("on", "off"), default="on",
                   help="also time check_training_step(finite_differences=True) (on, the default)")
    args = p.parse_args(argv)
    if args.stream == "off":
        import os

        os.environ["MCORE_COMPAT_STREAM"] = "0"
    spec = G.spec_from_args(args)
    reps = args.reps or (5 if args.device == "cuda" else 3)
    patches, _ps = C.single_rank_megatron(args.device)
    import torch

    from mcore_compat.selfcheck import check_training_step, verify

    if args.host_snapshot is not None:
        verify.HOST_SNAPSHOT = tuple(k for k in args.host_snapshot.split(",") if k)

    module, chunks, optimizer = G.train_setup(spec, args.seed, lr=LR)
    batches = G.make_batches(spec, args.seed, spec.microbatches)
    kw = dict(seq_length=spec.seq, micro_batch_size=spec.micro_batch)

    def plain() -> None:
        G.train_step(spec, chunks, optimizer, batches)

    def check(reference: bool, fd: bool = False) -> Any:
        return check_training_step(chunks, optimizer, G.forward_step, iter(batches),
                                   num_microbatches=spec.microbatches, reference=reference,
                                   finite_differences=fd, **kw)

    def peak_of(fn: Any) -> tuple[float, int, Any]:
        if args.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        seconds, result = C.timed(fn, args.device)
        peak = torch.cuda.max_memory_allocated() if args.device == "cuda" else 0
        return seconds, peak, result

    for _ in range(2):  # warm-up
        plain()
    check(True)
    plain_t, plain_peak, ref_t, ref_peak, noref_t, noref_peak = [], [], [], [], [], []
    fd_t: list[float] = []
    fd_peak: list[int] = []
    with_fd = args.finite_differences == "on"
    if with_fd:
        check(True, fd=True)  # warm-up of the float64 path
    reports: dict[str, Any] = {}
    for _ in range(reps):
        for _ in range(3):
            t, peak, _r = peak_of(plain)
            plain_t.append(t)
            plain_peak.append(peak)
        t, peak, rep = peak_of(lambda: check(True))
        ref_t.append(t)
        ref_peak.append(peak)
        reports["reference"] = rep
        t, peak, rep = peak_of(lambda: check(False))
        noref_t.append(t)
        noref_peak.append(peak)
        reports["no_reference"] = rep
        if with_fd:
            t, peak, rep = peak_of(lambda: check(True, fd=True))
            fd_t.append(t)
            fd_peak.append(peak)
            reports["finite_differences"] = rep
    step = statistics.median(plain_t)
    params = G.param_bytes(module)
    ref_settings = reports["reference"].settings
    results = {
        "plain_step_s": C.stats(plain_t), "check_reference_s": C.stats(ref_t), "check_no_reference_s":
        C.stats(noref_t), "param_bytes": params, "reference_bytes": ref_settings["reference_bytes"],
        "snapshot_bytes": ref_settings["snapshot_bytes"],
        "snapshot_host_bytes": ref_settings.get("snapshot_host_bytes", 0),
        "peak_plain_bytes": max(plain_peak), "peak_check_reference_bytes": max(ref_peak),
        "peak_check_no_reference_bytes": max(noref_peak),
        "update_checked": ref_settings.get("update_checked"),
        "reports_ok": {k: r.ok for k, r in reports.items()},
        "summaries": {k: r.summary_line() for k, r in reports.items()}, "patches": patches,
    }
    fd_headline = []
    if with_fd:
        numel = sum(p.numel() for p in module.parameters())
        fd_checks = {k.name: [k.status, k.detail[:1500], k.numbers] for k in reports["finite_differences"].checks
                     if k.name in ("grads_match_directional_derivatives", "loss_matches_float64")}
        results.update({"check_finite_differences_s": C.stats(fd_t), "float64_copy_bytes": numel * 8,
                        "peak_check_finite_differences_bytes": max(fd_peak), "finite_difference_checks": fd_checks})
        extra_fd_peak = (max(fd_peak) - max(ref_peak)) if args.device == "cuda" else None
        fd_headline = [
            C.metric("finite differences: time above check_training_step (reference)",
                     (statistics.median(fd_t) - statistics.median(ref_t)) / step, "steps", goal="<= 1",
                     note=f"median of {reps}; checks: " + ", ".join(f"{k} {v[0]}" for k, v in fd_checks.items())),
            C.metric("finite differences: float64 copy", numel * 8 / params, "x param bytes",
                     note=C.fmt_bytes(numel * 8)),
            C.metric("finite differences: peak above check_training_step (reference)",
                     None if extra_fd_peak is None else extra_fd_peak / params, "x param bytes",
                     goal="<= 2" if args.device == "cuda" else None,
                     note="" if extra_fd_peak is None else C.fmt_bytes(extra_fd_peak)),
        ]
    extra_peak = (max(ref_peak) - max(plain_peak)) if args.device == "cuda" else None
    headline = [
        C.metric("check_training_step (reference) / plain step", statistics.median(ref_t) / step, "steps",
                 goal="<= 4" if args.device == "cuda" else None,
                 note=f"median of {reps}; plain step {step * 1e3:.1f} ms"),
        C.metric("check_training_step (reference=False) / plain step", statistics.median(noref_t) / step, "steps"),
        C.metric("reference copy", ref_settings["reference_bytes"] / params, "x param bytes",
                 note=C.fmt_bytes(ref_settings["reference_bytes"])),
        C.metric("pre-step snapshot on the device (at its largest)", ref_settings["snapshot_bytes"] / params,
                 "x param bytes", note=f"{C.fmt_bytes(ref_settings['snapshot_bytes'])}; update checked "
                                       f"{ref_settings.get('update_checked')}"),
        C.metric("pre-step snapshot in pinned host memory", ref_settings.get("snapshot_host_bytes", 0) / params,
                 "x param bytes", note=C.fmt_bytes(ref_settings.get("snapshot_host_bytes", 0))),
        C.metric("peak memory above a plain step (reference)",
                 None if extra_peak is None else extra_peak / params, "x param bytes",
                 goal="<= 4" if args.device == "cuda" else None,
                 note="" if extra_peak is None else C.fmt_bytes(extra_peak)),
        C.metric("verdicts", float(all(r.ok for r in reports.values())), "all ok", goal="== 1"),
        *fd_headline,
    ]
    C.write_result(NAME, args.device, args.out, config={"spec": spec.as_dict(), "reps": reps, "lr": LR,
                                                        "stream": args.stream,
                                                        "finite_differences": args.finite_differences,
                                                        "host_snapshot": "auto" if verify.HOST_SNAPSHOT is None
                                                        else list(verify.HOST_SNAPSHOT)},
                   results=results, headline=headline)
    return 0 if all(r.ok for r in reports.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
