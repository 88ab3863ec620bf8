"""Write the Megatron-LM-style checkpoints tests/test_checkpoint_megatron.py loads (tests/data/megatron_checkpoints/).

    PYTHONPATH=.cache/mc/0.16.1:. .cache/base-py312/bin/python -P scripts/megatron_checkpoint_fixtures.py

Run with megatron-core 0.16.1 (and psutil, which Megatron's writer needs) on PYTHONPATH: 2 gloo ranks call
``megatron.core.dist_checkpointing.save`` with the state dict Megatron-LM's trainer writes (``model``,
``iteration``, ``checkpoint_version``, ``args``; one fixture also ``optimizer`` and ``opt_param_scheduler``), see
tests/_checkpoint_megatron_scenarios.py. The fixtures are replaced; commit them.
"""

from __future__ import annotations

import functools
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import _checkpoint_megatron_scenarios as S

    from mcore_compat.launch import Group

    shutil.rmtree(S.DATA, ignore_errors=True)
    S.DATA.mkdir(parents=True)
    with Group(2, device="cpu", destroy_subgroups=True) as group:
        versions = group.run(functools.partial(S.write_fixtures, str(S.DATA)), timeout=600)
    print(f"wrote {', '.join(S.FIXTURES)} into {S.DATA} with megatron-core {versions[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
