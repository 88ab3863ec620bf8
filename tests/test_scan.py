"""``mcore-compat scan`` on a small fake client tree: what it reads (imports at any depth, attribute uses of
imported modules), how it classifies each name per release (from the surface data), ``--fix`` (round trip,
idempotence, comments and formatting kept), ``--check``, and bad input (one line each, non-zero exit)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from mcore_compat.cli import main
from mcore_compat.scan import adapter_for, classify, scan_paths
from mcore_compat.scan.fix import fix_source

pytestmark = pytest.mark.unit

CLIENT = '''\
"""A client's trainer."""
import os  # not Megatron

from megatron.core import parallel_state as mpu  # the usual alias
from megatron.core.optimizer import (
    OptimizerConfig,  # moved? no: 0.6.0+
    get_megatron_optimizer,
)
import megatron.core.tensor_parallel as tp

try:
    from megatron.core.transformer.custom_layers.transformer_engine import TENorm
except ImportError:  # a feature check
    TENorm = None


def build():
    from megatron.core.distributed import DistributedDataParallelConfig
    return mpu.get_tensor_model_parallel_rank(), tp.VocabParallelEmbedding, DistributedDataParallelConfig
'''

HELPER = '''\
import megatron.core.parallel_state
from megatron.core import tensor_parallel

x = megatron.core.parallel_state.get_data_parallel_rank
y = tensor_parallel.ColumnParallelLinear
'''


@pytest.fixture
def client(tmp_path: Path) -> Path:
    root = tmp_path / "client"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "train.py").write_text(CLIENT)
    (root / "pkg" / "helper.py").write_text(HELPER)
    return root


def _pairs(root: Path) -> set[tuple[str, str, str]]:
    return {(u.module, u.name, u.how) for u in scan_paths([root]).uses}


def test_reads_imports_at_any_depth_and_attribute_uses(client: Path) -> None:
    pairs = _pairs(client)
    assert ("megatron.core.optimizer", "OptimizerConfig", "from") in pairs
    assert ("megatron.core.transformer.custom_layers.transformer_engine", "TENorm", "from") in pairs  # in try
    assert ("megatron.core.distributed", "DistributedDataParallelConfig", "from") in pairs  # in a function
    assert ("megatron.core.parallel_state", "get_tensor_model_parallel_rank", "attribute") in pairs  # mpu.x
    assert ("megatron.core.tensor_parallel", "VocabParallelEmbedding", "attribute") in pairs  # import ... as tp
    assert ("megatron.core.parallel_state", "get_data_parallel_rank", "attribute") in pairs  # full dotted path
    assert ("megatron.core.tensor_parallel", "ColumnParallelLinear", "attribute") in pairs  # from-imported module
    assert not any(m == "os" for m, _, _ in pairs)


def test_classifies_raw_moved_absent_per_release(client: Path) -> None:
    report = classify(scan_paths([client]), ["0.4.0", "0.19.2"])
    old, new = report["releases"]["0.4.0"], report["releases"]["0.19.2"]
    absent_old = {a["name"]: a["releases"] for a in old["absent"]}
    assert absent_old["megatron.core.optimizer.OptimizerConfig"].startswith("0.6.0")  # no optimizer in 0.4.0
    assert "megatron.core.parallel_state.get_tensor_model_parallel_rank" in old["raw"]
    moved = {m["name"]: m for m in new["moved"]}
    te = moved["megatron.core.transformer.custom_layers.transformer_engine.TENorm"]
    assert te["at"] == "megatron.core.extensions.transformer_engine"
    assert te["mirror"] == "from mcore_compat.core.transformer.custom_layers.transformer_engine import TENorm"
    c = new["counts"]
    assert c["mirror"] == c["raw"] + c["moved"] and c["names"] == c["mirror"] + c["absent"]
    adapters = {n["name"]: n["adapter"] for n in report["names"]}
    assert adapters["get_megatron_optimizer"].startswith("mcore_compat.training.get_megatron_optimizer")
    assert adapters["DistributedDataParallelConfig"] == "mcore_compat.ddp_config(**fields)"
    assert adapters["get_tensor_model_parallel_rank"] is None


def test_adapter_table_names_real_mcore_compat_calls() -> None:
    import importlib

    from mcore_compat.scan.adapters import ADAPTERS

    for name, (prefix, call) in ADAPTERS.items():
        assert adapter_for(prefix, name) == call
        assert adapter_for("megatron.core.other_thing", name) is None or prefix == "megatron.core"
        owner, _, attr = call.partition("(")[0].rpartition(".")
        assert hasattr(importlib.import_module(owner), attr), call


def test_fix_round_trip_keeps_everything_but_the_module_names(client: Path) -> None:
    train = client / "pkg" / "train.py"
    assert main(["scan", str(client), "--fix", "--release", "0.16.1"]) == 0
    fixed = train.read_text()
    assert fixed == CLIENT.replace("from megatron.core", "from mcore_compat.core").replace(
        "import megatron.core.tensor_parallel as tp", "import mcore_compat.core.tensor_parallel as tp")
    assert "# the usual alias" in fixed and "OptimizerConfig,  # moved? no: 0.6.0+" in fixed
    helper = (client / "pkg" / "helper.py").read_text()
    assert helper.startswith("import megatron.core.parallel_state\n")  # binds `megatron`: left for a hand edit
    assert fix_source(fixed) == fixed  # idempotent
    assert main(["scan", str(client), "--fix", "--release", "0.16.1"]) == 0
    assert train.read_text() == fixed


def test_check_fails_while_raw_imports_remain(client: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["scan", str(client), "--check", "--release", "0.16.1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "raw megatron.core import lines remain" in err[0]
    clean = tmp_path / "clean.py"
    clean.write_text(fix_source(CLIENT))
    assert main(["scan", str(clean), "--check", "--release", "0.16.1"]) == 0


def test_check_after_fix_says_what_to_edit_by_hand(client: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """After --fix only the line --fix leaves remains: --check names it and the hand edit, not --fix again."""
    assert main(["scan", str(client), "--fix", "--release", "0.16.1"]) == 0
    assert capsys.readouterr().err.strip().splitlines()[-1] == "mcore-compat scan: rewrote 2 files"
    one = client / "one.py"
    one.write_text("from megatron.core import parallel_state\n")
    assert main(["scan", str(one), "--fix", "--release", "0.16.1"]) == 0
    assert capsys.readouterr().err.strip().splitlines()[-1] == "mcore-compat scan: rewrote 1 file"
    assert main(["scan", str(client), "--check", "--release", "0.16.1"]) == 1
    [err] = capsys.readouterr().err.strip().splitlines()
    assert "--fix" not in err.replace("which --fix leaves", ""), err
    assert "edit 1 by hand" in err and "helper.py:1" in err
    assert "'import mcore_compat.core.parallel_state as <name>'" in err


def test_fix_without_libcst_says_so_in_one_line_before_anything(client: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "libcst", None)  # `import libcst` raises ImportError
    before = (client / "pkg" / "train.py").read_text()
    assert main(["scan", str(client), "--fix", "--release", "0.16.1"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert "needs libcst" in err and "pip install libcst" in err and "'.[scan]'" in err
    assert "does not parse" not in err and (client / "pkg" / "train.py").read_text() == before


def test_json_report(client: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["scan", str(client), "--json", "--release", "0.8.0", "--release", "0.12.3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["releases"]) == ["0.8.0", "0.12.3"] and report["files"] == 2
    assert {r["fixable"] for r in report["raw_imports"]} == {True, False}


def test_missing_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["scan", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such file or folder" in err[0]


def test_unknown_release(client: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["scan", str(client), "--release", "9.9.9"]) == 2
    assert "unknown release '9.9.9'" in capsys.readouterr().err


def test_a_file_that_does_not_parse_is_named_and_the_rest_scanned(client: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    (client / "pkg" / "broken.py").write_text("from megatron.core import (\n")
    assert main(["scan", str(client), "--json", "--release", "0.16.1"]) == 1
    out = capsys.readouterr()
    err = out.err.strip().splitlines()
    assert len(err) == 1 and "broken.py: does not parse" in err[0]
    assert json.loads(out.out)["files"] == 3 and _pairs(client)


def test_fix_refuses_a_read_only_file(client: Path, capsys: pytest.CaptureFixture[str]) -> None:
    train = client / "pkg" / "train.py"
    os.chmod(train, stat.S_IRUSR | stat.S_IRGRP)
    try:
        assert main(["scan", str(client), "--fix", "--release", "0.16.1"]) == 1
    finally:
        os.chmod(train, stat.S_IRUSR | stat.S_IWUSR)
    err = [line for line in capsys.readouterr().err.splitlines() if "not rewritten" in line]
    assert len(err) == 1 and "train.py" in err[0] and "read-only" in err[0]
    assert train.read_text() == CLIENT


def test_readme_client_table_and_the_recorded_imports_agree() -> None:
    """The client table of docs/support.md (scripts/measure_clients.py) names each client of the data file with as many
    names as the data file records for it (the script writes both from one scan; no download here)."""
    import re

    root = Path(__file__).resolve().parents[1]
    data = json.loads((root / "tests" / "data" / "client_mirror_imports.json").read_text())
    readme = (root / "docs" / "support.md").read_text()
    block = readme.split("<!-- clients:begin")[1].split("<!-- clients:end -->")[0]
    header = dict(re.findall(r"\| (\S+==\S+) \((\d+) names\)", block))
    assert header == {client: str(len(pairs)) for client, pairs in data.items()}
