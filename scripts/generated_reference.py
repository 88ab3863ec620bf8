"""The reference release's observations of the generated-settings cases (the cross-release oracle).

    python scripts/generated_reference.py            # write tests/data/generated/{reference,drawn}.json
    python scripts/generated_reference.py --check    # observe again and compare with the committed files

tests/_generated_scenarios.py keeps a few committed cases (``COMMITTED``: the settings that broke a release and a
spread of what users train with). Every release session replays them and compares each with the spec, raw Megatron
and what the reference release (``REFERENCE_RELEASE``) recorded here: every parameter's (lr, weight decay) at every
step of the schedule, and the main params before and after 1-3 training steps. The drawn examples of the
properties in ``tests/_generated_reference.COMPARED`` (the same draws on every release) are recorded the same way,
keyed by each example's digest, in ``drawn.json``. This script runs them on the
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

import _generated_reference as R  # noqa: E402  (tests/, the drawn examples' record)
import _generated_scenarios as S  # noqa: E402  (tests/, the cases and the record's format)


def _python(release: str) -> str:
    minor = int(release.split(".")[1])
    return str(ROOT / ".cache" / ("base-py312" if minor >= 17 else "base-py311") / "bin" / "python")


def _observe(release: str) -> dict[str, Any]:
    tree = ROOT / ".cache" / "mc" / release
    if not tree.is_dir():
        raise SystemExit(f"no tree of megatron-core {release} in {tree}: run `nox -s mcore-{release}` once first")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(ROOT), str(ROOT / "tests")]),
           "OMP_NUM_THREADS": "1", R.RECORD_ENV: "1"}
    proc = subprocess.run([_python(release), "-P", __file__, "--worker"], env=env, capture_output=True, text=True,
                          timeout=900, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT=")]
    if proc.returncode or not lines:
        raise SystemExit(f"megatron-core {release} failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    record: dict[str, Any] = json.loads(lines[-1][len("RESULT="):])
    return record


def _worker() -> None:
    from mcore_compat.launch import Group

    with Group(2, device="cpu", destroy_subgroups=True, warm=("mcore_compat._util.warm_cpu",)) as group:
        per_rank = group.run(S.observe_committed, timeout=800)
        drawn = group.run(S.record_drawn, timeout=800)[0]
    print("RESULT=" + json.dumps({"committed": S.reference_record(per_rank[0]), "drawn": drawn}))


def _differences(old: dict[str, Any], new: dict[str, Any], what: str) -> list[str]:
    out = [f"release {old.get('release')} -> {new.get('release')}"] if old.get("release") != new.get("release") else []
    for name in sorted(set(old.get(what, {})) | set(new.get(what, {}))):
        if old.get(what, {}).get(name) != new.get(what, {}).get(name):
            out.append(f"{what[:-1] if what == 'cases' else 'property'} {name!r}")
    return out


def _size(record: dict[str, Any]) -> str:
    return ", ".join(f"{p} {len(v)}" for p, v in record["properties"].items())


def main() -> None:
    if sys.argv[1:] == ["--worker"]:
        _worker()
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed records (exit 1 if not "
                                                             "the same)")
    args = parser.parse_args()
    both = _observe(S.REFERENCE_RELEASE)
    files = ((S.REFERENCE, both["committed"], "cases"), (R.DRAWN, both["drawn"], "properties"))
    if args.check:
        stale = []
        for path, record, what in files:
            if not path.is_file():
                stale.append(f"{path.relative_to(ROOT)} is missing")
                continue
            diff = _differences(json.loads(path.read_text(encoding="utf-8")), record, what)
            if diff:
                stale.append(f"{path.relative_to(ROOT)} differs from what megatron-core {S.REFERENCE_RELEASE} "
                             f"observes now: {', '.join(diff)}")
        if stale:
            print("; ".join(stale) + "; run python scripts/generated_reference.py and commit")
            raise SystemExit(1)
        print(f"{S.REFERENCE.relative_to(ROOT)}: current ({len(both['committed']['cases'])} cases); "
              f"{R.DRAWN.relative_to(ROOT)}: current ({_size(both['drawn'])} examples)")
        return
    for path, record, _ in files:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=None, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {S.REFERENCE.relative_to(ROOT)} ({len(both['committed']['cases'])} cases) and "
          f"{R.DRAWN.relative_to(ROOT)} ({_size(both['drawn'])} examples), megatron-core {S.REFERENCE_RELEASE}")


if __name__ == "__main__":
    main()
