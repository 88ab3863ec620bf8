"""Checkpoints across releases: save on A, load on B (weights and optimizer), recorded in matrix/checkpoint_cross.json.

    python scripts/checkpoint_matrix.py                       # every release of RELEASES (2 gloo ranks each)
    python scripts/checkpoint_matrix.py --releases 0.8.0 0.19.2
    python scripts/checkpoint_matrix.py --write-fixtures            # tests/data/checkpoints/<A>/, one per release
    python scripts/checkpoint_matrix.py --check                     # the committed fixtures are what A writes

For each release A: train the DP=2 distributed-optimizer bf16 GPT of tests/_checkpoint_scenarios.py 2 steps, save
it with mcore_compat.save_checkpoint and keep the full values as reference. For each B: load every A's checkpoint
into a fresh build, once with the optimizer and once weights only, and compare the weights, every param's main
param, both Adam moments and the step with A's reference ("exact", "differs: ...", or "refused: <error>"), then
take a step. Each release runs in its own interpreter (.cache/base-py311, or py312 for 0.17+) with its tree
.cache/mc/<V> on PYTHONPATH; about 20 s per release and pass on 2 idle cores.

The fixtures that tests/test_checkpoint_cross.py loads in every release session are generated data:
``--write-fixtures`` writes each release's (tests/_checkpoint_cross_scenarios.py: a one-layer GPT of hidden 8,
2 steps, saved with mcore_compat.save_checkpoint, and its reference values) into tests/data/checkpoints/<A>/;
``--check`` writes them again into a temporary directory on each release and compares them with the committed
ones: the manifest's fields (but the writers' mcore_compat and torch versions and the shard sizes, which depend
on the torch that wrote the zip files, and so the checksums file, which the fixtures predate), the TP record, and
every value of every shard and of the reference (names, dtypes, shapes and integers exactly; floating values within
FLOAT_ULPS units in the last place at the tensor's scale, the spread of CPU kernels between instruction sets).
Exit status 1 when one differs (then --write-fixtures, and commit).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RELEASES = ["0.4.0", "0.8.0", "0.12.3", "0.14.0", "0.16.1", "0.19.2"]
OUT = ROOT / "matrix" / "checkpoint_cross.json"
FIXTURES = ROOT / "tests" / "data" / "checkpoints"


def _python(release: str) -> str:
    minor = int(release.split(".")[1])
    return str(ROOT / ".cache" / ("base-py312" if minor >= 17 else "base-py311") / "bin" / "python")


def _run(release: str, *args: str) -> Any:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / ".cache" / "mc" / release), str(ROOT),
                                                        str(ROOT / "tests")]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([_python(release), "-P", __file__, "--worker", *args], env=env, capture_output=True,
                          text=True, timeout=900, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT=")]
    if proc.returncode or not lines:
        raise SystemExit(f"{release} {args[0]} failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT="):])


def _write_fixtures(releases: list[str]) -> None:
    """Each release's fixture written into :data:`FIXTURES` (the old one removed first)."""
    for release in releases:
        shutil.rmtree(FIXTURES / release, ignore_errors=True)
        written = _run(release, "fixture-save", str(FIXTURES))[0]
        assert written == release, (written, release)
        size = sum(f.stat().st_size for f in (FIXTURES / release).rglob("*") if f.is_file())
        print(f"{release}: {FIXTURES.relative_to(ROOT) / release} ({size} bytes)")


def _check_fixtures(releases: list[str]) -> int:
    """Each release's fixture written again and compared with the committed one; 1 when one differs."""
    bad = 0
    for release in releases:
        if not (FIXTURES / release).is_dir():
            print(f"{release}: no committed fixture in {FIXTURES.relative_to(ROOT)} (run --write-fixtures)")
            bad += 1
            continue
        diff = _run(release, "fixture-check", str(FIXTURES))[0]["cases"]["regenerate"]
        if diff["status"] != "ok":
            print(f"{release}: failed\n{diff.get('error', diff)}")
            bad += 1
        elif diff["diff"]:
            print(f"{release}: differs from the committed fixture: {diff['diff'][:10]}")
            bad += 1
        else:
            print(f"{release}: the same as the committed fixture")
    return 1 if bad else 0


def _worker(argv: list[str]) -> None:
    import functools

    import _checkpoint_cross_scenarios as X  # type: ignore[import-not-found]  # tests/, on PYTHONPATH in the worker
    import _checkpoint_scenarios as S  # type: ignore[import-not-found]

    from mcore_compat.launch import Group

    what, root, *sources = argv
    fn = {"save": functools.partial(S.cross_save, root), "load": functools.partial(S.cross_load, root, sources),
          "fixture-save": functools.partial(X.save_fixture, root),
          "fixture-check": functools.partial(X.regenerate, root)}[what]
    with Group(2, device="cpu", destroy_subgroups=True, warm=("mcore_compat._util.warm_cpu",)) as group:
        results = group.run(fn, timeout=800)
    print("RESULT=" + json.dumps(results))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--releases", nargs="+", default=RELEASES)
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--write-fixtures", action="store_true", help=f"write each release's fixture into {FIXTURES}")
    what.add_argument("--check", action="store_true", help="check that the committed fixtures are what each "
                                                           "release writes")
    args = parser.parse_args()
    if args.write_fixtures:
        _write_fixtures(args.releases)
        return
    if args.check:
        raise SystemExit(_check_fixtures(args.releases))
    with tempfile.TemporaryDirectory(prefix="mcc-ckpt-cross-") as root:
        saved = [_run(r, "save", root)[0] for r in args.releases]
        table: dict[str, dict[str, Any]] = {a: {} for a in saved}
        for b in args.releases:
            per_rank = _run(b, "load", root, *saved)
            assert isinstance(per_rank, list)
            for a in saved:
                entries = [r["from"][a] for r in per_rank]
                table[a][b] = entries[0] if all(e == entries[0] for e in entries) else {"per_rank": entries}
    record = {"what": "saved on A (rows), loaded on B (columns): DP=2 distributed optimizer, bf16 GPT, 2 steps; "
                      "'full' = model + optimizer, 'weights' = model only; exact = every weight, main param, Adam "
                      "moment and step equal to A's values",
              "format": "mcore_compat.torch v1", "recorded": datetime.date.today().isoformat(),
              "releases": args.releases, "results": table}
    OUT.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    for a in saved:
        print(a, " ".join(f"{b}:{'ok' if v.get('full') == 'exact' else 'X'}" for b, v in table[a].items()))


if __name__ == "__main__":
    main()
