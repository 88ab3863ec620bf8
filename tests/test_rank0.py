"""Rank-zero logging before and after torch.distributed is initialised."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_compat import launch, rank0


@pytest.fixture(autouse=True)
def _fresh() -> None:
    rank0.reset_warn_once()


def test_rank_from_launcher_env_before_init(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("RANK", "3")
    rank0.print_rank_0("hidden")
    assert capsys.readouterr().out == ""
    assert not rank0.warn_once_rank_0("hidden warning")
    monkeypatch.setenv("RANK", "0")
    rank0.print_rank_0("shown")
    assert capsys.readouterr().out == "shown\n"


def test_no_launcher_means_rank_zero(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for key in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert rank0.get_rank() == 0
    rank0.print_rank_0("x")
    assert capsys.readouterr().out == "x\n"


def test_warn_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    with pytest.warns(UserWarning, match="only once"):
        assert rank0.warn_once_rank_0("only once")
    assert not rank0.warn_once_rank_0("only once")


def test_log_rank_0(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("RANK", "0")
    with caplog.at_level(logging.INFO, logger="mcore_compat"):
        rank0.log_rank_0("step %d", 5)
    assert "step 5" in caplog.text


def _print_on_each_rank() -> int:
    import torch.distributed as dist

    rank0.print_rank_0(f"from rank {dist.get_rank()}")
    rank0.warn_once_rank_0("warned")
    return rank0.get_rank()


def test_after_init_only_rank_zero_prints(capfd: pytest.CaptureFixture[str]) -> None:
    ranks = launch.spawn(_print_on_each_rank, 2, env={"RANK": "0"}, timeout=120)
    assert ranks == [0, 1]  # the process group's rank wins over the environment
    out = capfd.readouterr()
    assert "from rank 0" in out.out and "from rank 1" not in out.out
    assert out.err.count("warned") == 1


def test_a_warning_from_a_scripts_top_level_names_the_script(tmp_path: Path) -> None:
    """Called from a script's top level, the warning points at the script's line, not at ``sys:1``."""
    script = tmp_path / "train.py"
    script.write_text("from mcore_compat import rank0\nrank0.warn_once_rank_0('bf16 without fp32 grads')\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "sys:1" not in proc.stderr and f"{script}:2: UserWarning: bf16 without fp32 grads" in proc.stderr, \
        proc.stderr
