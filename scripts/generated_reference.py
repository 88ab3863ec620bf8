"""The reference release's observations of the committed generated-settings cases (the third oracle).

    python scripts/generated_reference.py            # write tests/data/generated/reference.json
    python scripts/generated_reference.py --check    # observe again and compare with the committed file

tests/_generated_scenarios.py keeps a few committed cases (``COMMITTED``: the settings that broke a release and a
spread of what users train with). Every release session replays them and compares each with the spec, raw Megatron
and what the reference release (``REFERENCE_RELEASE``) recorded here: every parameter's (lr, weight decay) at every
step of the schedule, and the main params before and after 1-3 training steps. This script runs them on the
reference release (2 gloo ranks, its tree .cache/mc/<V> on PYTHONPATH, as a nox session has it: run
``nox -s mcore-<V>`` once first) and writes or checks the record; ``--check`` exits 1 when the committed record
is not what the release observes now (then write it again, look at the diff, and commit).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import _generated_scenarios as S  # noqa: E402  (tests/, the cases and the record's format)


def _python(release: str) -> str:
    minor = int(release.split(".")[1])
    return str(ROOT / ".cache" / ("base-py312" if minor >= 17 else "base-py311") / "bin" / "python")


def _observe(release: str) -> dict[str, Any]:
    tree = ROOT / ".cache" / "mc" / release
    if not tree.is_dir():
        raise SystemExit(f"no tree of megatron-core {release} in {tree}: run `nox -s mcore-{release}` once first")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(ROOT), str(ROOT / "tests")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([_python(release), "-P", __file__, "--worker"], env=env, capture_output=True, text=True,
                          timeout=900, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT=")]
    if proc.returncode or not lines:
        raise SystemExit(f"megatron-core {release} failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    record: dict[str, Any] = json.loads(lines[-1][len("RESULT="):])
    return record


def _worker() -> None:
    from mcore_compat.launch import Group

    with Group(2, device="cpu", destroy_subgroups=True, warm=("mcore_compat._warm_cpu",)) as group:
        per_rank = group.run(S.observe_committed, timeout=800)
    print("RESULT=" + json.dumps(S.reference_record(per_rank[0])))


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    out = [f"release {old.get('release')} -> {new.get('release')}"] if old.get("release") != new.get("release") else []
    for name in sorted(set(old.get("cases", {})) | set(new.get("cases", {}))):
        if old.get("cases", {}).get(name) != new.get("cases", {}).get(name):
            out.append(f"case {name!r}")
    return out


def main() -> None:
    if sys.argv[1:] == ["--worker"]:
        _worker()
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed record (exit 1 if not "
                                                             "the same)")
    args = parser.parse_args()
    record = _observe(S.REFERENCE_RELEASE)
    if args.check:
        if not S.REFERENCE.is_file():
            print(f"{S.REFERENCE.relative_to(ROOT)} is missing: run python scripts/generated_reference.py")
            raise SystemExit(1)
        diff = _differences(json.loads(S.REFERENCE.read_text(encoding="utf-8")), record)
        if diff:
            print(f"{S.REFERENCE.relative_to(ROOT)} differs from what megatron-core {S.REFERENCE_RELEASE} observes "
                  f"now: {', '.join(diff)}; run python scripts/generated_reference.py and commit")
            raise SystemExit(1)
        print(f"{S.REFERENCE.relative_to(ROOT)}: current ({len(record['cases'])} cases)")
        return
    S.REFERENCE.parent.mkdir(parents=True, exist_ok=True)
    S.REFERENCE.write_text(json.dumps(record, indent=None, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {S.REFERENCE.relative_to(ROOT)} ({len(record['cases'])} cases, megatron-core {record['release']})")


if __name__ == "__main__":
    main()
