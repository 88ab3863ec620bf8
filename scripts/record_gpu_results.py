"""Record GPU runs of scripts/gpu_matrix.py into matrix/results.json and re-render matrix/README.md.

    python3 scripts/record_gpu_results.py                   # every bundle in matrix/gpu-runs/, oldest first
    python3 scripts/record_gpu_results.py --add OUT/        # store OUT/gpu-matrix.json (or a folder of
                                                            # gpu-<V>.json + environment.json) as a bundle first

Bundles are merged in date order: for each release, a configuration (GPUs, configuration label, dtype, lr) keeps
its newest run; runs of the self-check that proves every step (they carry a ``label``) supersede the older
self-check's runs of that release; the release passes on GPU only if every kept configuration passed. Each configuration is
recorded with its date, environment and per-check verdicts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "matrix" / "gpu-runs"
sys.path.insert(0, str(ROOT))


def load_bundle(path: Path) -> dict[str, Any]:
    """A bundle ``{"environment": {...}, "runs": {version: [run, ...]}}`` from a bundle file or a folder."""
    if path.is_file():
        return json.loads(path.read_text())
    env = json.loads((path / "environment.json").read_text())
    runs = {p.stem.removeprefix("gpu-"): json.loads(p.read_text())
            for p in sorted(path.glob("gpu-*.json")) if p.stem != "gpu-matrix"}
    return {"environment": env, "runs": runs}


def _key(run: dict[str, Any]) -> tuple[Any, ...]:
    c = run["config"]
    return (run["nproc"], run.get("label") or (c.get("tp", 1), c.get("pp", 1), c["distributed_optimizer"]),
            c.get("dtype"), float(c.get("lr", 1e-2)))


def _config_entry(run: dict[str, Any], env: dict[str, Any]) -> dict[str, Any]:
    c = run["config"]
    return {"date": env.get("date"), "gpus": run["nproc"], "tp": c.get("tp", 1), "pp": c.get("pp", 1),
            "distributed_optimizer": c["distributed_optimizer"], "bind": c.get("bind", False),
            "dtype": c.get("dtype"), "lr": float(c.get("lr", 1e-2)), "label": run.get("label"), "ok": run["ok"],
            "summary": run["summary"],
            "error": (run.get("error") or "").splitlines()[0] if run.get("error") else None,
            "checks": {k["name"]: k.get("status", "PASS" if k.get("passed") else "FAIL")
                       for k in run.get("checks", [])}}


def main() -> int:
    from mcore_compat import support

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--add", type=Path, action="append", default=[], help="a run's output to store first")
    args = parser.parse_args()
    RUNS.mkdir(parents=True, exist_ok=True)
    for path in args.add:
        bundle = load_bundle(path if path.is_file() or not (path / "gpu-matrix.json").is_file()
                       else path / "gpu-matrix.json")
        date = bundle["environment"].get("date") or "undated"
        n = len(list(RUNS.glob(f"{date}*.json")))
        target = RUNS / (f"{date}.json" if n == 0 else f"{date}-{n + 1}.json")
        target.write_text(json.dumps(bundle, indent=1) + "\n")
        print(f"stored {target.relative_to(ROOT)}")
    merged: dict[str, dict[tuple[Any, ...], dict[str, Any]]] = {}
    envs: dict[str, dict[str, Any]] = {}
    for path in sorted(RUNS.glob("*.json")):
        bundle = load_bundle(path)
        env = bundle["environment"]
        for version, runs in bundle["runs"].items():
            for run in runs:
                merged.setdefault(version, {})[_key(run)] = _config_entry(run, env)
            envs[version] = env
    for version in sorted(merged, key=lambda v: tuple(int(x) for x in v.split("."))):
        if any(c["label"] for c in merged[version].values()):  # runs of the per-step-proving self-check supersede
            merged[version] = {k: c for k, c in merged[version].items() if c["label"]}  # the older self-check's
        configs = sorted(merged[version].values(), key=lambda c: (c["gpus"], c["tp"], c["pp"],
                                                                  not c["distributed_optimizer"], -c["lr"]))
        env = envs[version]
        ok = all(c["ok"] for c in configs)
        support.record_result(version, "gpu", {
            "result": "pass" if ok else "fail", "date": max(c["date"] or "" for c in configs) or None,
            "python": env["python"], "torch": env["torch"], "cuda": env["cuda"], "nccl": env["nccl"],
            "device": env["device"], "passed": sum(c["ok"] for c in configs),
            "failed": sum(not c["ok"] for c in configs), "configurations": configs,
        })
        print(f"{version}: {'pass' if ok else 'FAIL'} ({len(configs)} configurations)")
    (ROOT / "matrix" / "README.md").write_text(support.render_table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
