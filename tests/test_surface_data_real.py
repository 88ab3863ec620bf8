"""The generated surface data (mcore_compat/_facts/surface_data.py) against the ONE installed megatron-core's files (runs
inside a matrix session; static read, nothing of Megatron imported).

* the public modules the data lists for the installed release are exactly those of its files;
* the names (and kinds) of the key modules (``surface.KEY_MODULES``: the package, parallel_state, the optimizer,
  DDP, ...) and of a sample of other modules chosen by the release are exactly what the files bind;
* with a wrong row injected (a name removed, a name added, a kind changed), the check names each.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mcore_compat import surface
from mcore_compat._facts import surface_data as DATA
from mcore_compat.detect import detect

pytestmark = pytest.mark.mcore


@pytest.fixture(scope="module")
def installed() -> tuple[Path, str]:
    info = detect()
    version = str(info.version)
    if version not in DATA.RELEASES:
        pytest.skip(f"megatron-core {version} is not a release of the generated data")
    return Path(info.path).parents[1], version


def test_the_data_matches_the_installed_files(installed: tuple[Path, str]) -> None:
    problems = surface.drift(*installed)
    assert problems == [], "\n".join(problems)


@pytest.fixture
def wrong_rows(installed: tuple[Path, str]) -> Iterator[None]:
    """parallel_state's data for the installed release: one function dropped, a made-up one added, and
    ``megatron.core``'s ``parallel_state`` said to be a class."""
    _, version = installed
    saved = {m: DATA.NAMES[m] for m in ("megatron.core.parallel_state", "megatron.core")}
    ps = dict(saved["megatron.core.parallel_state"])
    key = next(k for k, v in ps.items() if "get_tensor_model_parallel_rank" in v.split())
    ps[key] = " ".join(n for n in ps[key].split() if n != "get_tensor_model_parallel_rank")
    ps[f"function >={version}"] = "made_up_function"
    DATA.NAMES["megatron.core.parallel_state"] = ps
    DATA.NAMES["megatron.core"] = dict(saved["megatron.core"], **{f"class >={version}": "parallel_state"})
    surface._names.cache_clear()
    try:
        yield
    finally:
        DATA.NAMES.update(saved)
        surface._names.cache_clear()


@pytest.mark.usefixtures("wrong_rows")
def test_the_check_names_injected_wrong_rows(installed: tuple[Path, str]) -> None:
    problems = surface.drift(*installed, sample=0)
    _, version = installed
    assert len(problems) == 3, problems
    assert "get_tensor_model_parallel_rank: the data says absent" in problems[1] and "function" in problems[1]
    assert "made_up_function: the data says function" in problems[2] and "files say absent" in problems[2]
    assert "megatron.core.parallel_state: the data says class" in problems[0]
    assert all(version in p and "scripts/gen_surface.py" in p for p in problems)
