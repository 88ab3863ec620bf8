"""Self-check wall time per configuration: this tree against a baseline commit, side by side in one run.

Both trees are installed (``pip install --target``) from git (the baseline with ``git archive <ref>``, this one
from the working tree) into a temporary folder. Interleaved repetitions (baseline, current, baseline, ...):
each is a fresh interpreter that starts one group of 2 local ranks, runs the configurations once to warm up
(imports, first process groups), then times ``run_sweep`` of the same configurations again; time per
configuration = that sweep's seconds / number of configurations. Configurations: DP=2 with the distributed
optimizer on and off, TP=2, PP=2 (fp32), DP=2 bf16; each tree's own defaults otherwise (the current one adds
weight decay, the gradient reference, the optimizer oracle, replica and continuity checks).

    python3 benchmarks/selfcheck_cost.py --device cpu --baseline 5f3d2cb --reps 3
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

NAME = "selfcheck_cost"

#: Runs in the child: uses only options both trees know.
_CHILD = r"""
import json, sys, time
from mcore_compat.launch import Group
from mcore_compat.selfcheck import SelfCheckOptions, run_sweep
device = sys.argv[1]
configs = [SelfCheckOptions(tp=1, pp=1, distributed_optimizer=True), SelfCheckOptions(tp=1, pp=1, distributed_optimizer=False),
           SelfCheckOptions(tp=2, pp=1, distributed_optimizer=True), SelfCheckOptions(tp=1, pp=2, distributed_optimizer=True),
           SelfCheckOptions(tp=1, pp=1, distributed_optimizer=True, dtype="bf16")]
if __name__ == "__main__":
    with Group(2, device=device) as group:
        run_sweep(configs, 2, device=device, group=group, timeout=1200)
        t0 = time.perf_counter()
        reports = run_sweep(configs, 2, device=device, group=group, timeout=1200)
        seconds = time.perf_counter() - t0
    print("RESULT " + json.dumps({"seconds": seconds, "configs": len(configs), "ok": [r.ok for r in reports],
                                   "checks": [len(r.checks) for r in reports]}))
"""


def _install(src: Path, target: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target",
                    str(target), str(src)], check=True, stdout=subprocess.DEVNULL)


def _megatron_site() -> str:
    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("selfcheck_cost: megatron-core is not importable; put a release on PYTHONPATH")
    return str(Path(next(iter(spec.submodule_search_locations))).parent)


def main(argv: list[str] | None = None) -> int:
    p = C.parser(__doc__)
    p.add_argument("--baseline", required=True, help="git commit or ref of the baseline tree")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    site = _megatron_site()
    with tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp)
        old_src = tmpdir / "src-baseline"
        old_src.mkdir()
        archive = subprocess.run(["git", "-C", str(C.REPO), "archive", args.baseline], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old_src)], input=archive, check=True)
        trees = {"baseline": tmpdir / "baseline", "current": tmpdir / "current"}
        _install(old_src, trees["baseline"])
        _install(C.REPO, trees["current"])
        runs: dict[str, list[dict]] = {k: [] for k in trees}
        for _rep in range(args.reps):
            for name, tree in trees.items():
                env = {**os.environ, "PYTHONPATH": f"{site}:{tree}", "OMP_NUM_THREADS": "1"}
                out = subprocess.run([sys.executable, *C.python_flags(), "-c", _CHILD, args.device], env=env,
                                     capture_output=True, text=True, timeout=1800)
                line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
                if line is None:
                    print(out.stdout[-2000:], out.stderr[-4000:], file=sys.stderr)
                    raise SystemExit(f"selfcheck_cost: the {name} run failed (exit {out.returncode})")
                runs[name].append(json.loads(line[len("RESULT "):]))
                print(f"  {name}: {runs[name][-1]['seconds'] / runs[name][-1]['configs']:.3f} s per configuration",
                      flush=True)
        sys.path.insert(0, str(trees["current"]))  # the environment recorded is the current tree's
        per = {k: [r["seconds"] / r["configs"] for r in v] for k, v in runs.items()}
        ratio = statistics.median(per["current"]) / statistics.median(per["baseline"])
        pairs = [c / b for b, c in zip(per["baseline"], per["current"], strict=True)]
        headline = [
            C.metric("self-check time per configuration, current/baseline", ratio, "x", goal="<= 1.5",
                     note=f"medians {statistics.median(per['current']):.3f} vs {statistics.median(per['baseline']):.3f} s"),
            C.metric("median of paired ratios", statistics.median(pairs), "x"),
            C.metric("all verdicts ok", float(all(all(r["ok"]) for v in runs.values() for r in v)), "", goal="== 1"),
        ]
        C.write_result(NAME, args.device, args.out, config={"baseline": args.baseline, "reps": args.reps},
                       results={"per_configuration_s": {k: C.stats(v) for k, v in per.items()}, "runs": runs},
                       headline=headline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
