"""Ranks spanning nodes, simulated on one machine: two torchrun agents (``--nnodes 2``, a c10d rendezvous on
localhost), as a Slurm or Kubernetes job starts one per node. Node-local ranks (``LOCAL_RANK``) then repeat across
the nodes while the global ``RANK`` does not: whatever picked a rank or a device from the wrong one would collide.

* ``mcore-compat self-check --tp 2`` on 2 nodes of 2 ranks (TP inside a node, DP across the nodes): PASS;
* a user's job (tests/_multinode_job.py) on 2 nodes of 1 rank: ``check_training_step`` passes on its model, and the
  run directory it saved loads into a 1-process job of another data-parallel size with the weights exact, then
  trains.

Marked ``launcher``: torch's launcher and Python are under test, so one release per Python runs them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_compat.launch import free_port

pytestmark = [pytest.mark.mcore, pytest.mark.launcher]

ROOT = Path(__file__).resolve().parent.parent
JOB = Path(__file__).resolve().parent / "_multinode_job.py"


def _two_nodes(per_node: int, argv: list[str], tmp_path: Path, timeout: float = 420) -> list[tuple[int, str, str]]:
    """Start the two node agents at once, wait for both; ``(exit status, stdout, stderr)`` per agent. Each job
    has a rendezvous of its own (a fresh port, below the ephemeral range: :func:`free_port`, and its own id)."""
    port = free_port()
    # PYTHONFAULTHANDLER: a rank that crashes (a C++ abort in torch's teardown) prints every thread's Python stack
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    agents = []
    for node in range(2):  # both on localhost: say which one hosts the rendezvous store (else both may try)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(per_node),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"{tmp_path.name}-{port}",
               "--rdzv-conf", f"is_host={int(node == 0)}", "--max-restarts", "0", *argv]
        agents.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True))
    out = []
    for agent in agents:
        try:
            stdout, stderr = agent.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for a in agents:
                a.kill()
            raise
        out.append((agent.returncode, stdout, stderr))
    for node, (code, stdout, stderr) in enumerate(out):  # kept for a failure's post-mortem (pytest keeps tmp_path)
        (tmp_path / f"agent{node}-port{port}.log").write_text(f"exit {code}\n{stdout}\n--- stderr ---\n{stderr}")
    return out


def _assert_ran(agents: list[tuple[int, str, str]]) -> None:
    """Both agents exited 0; else fail with every line both wrote (pytest would cut an assertion's repr short, and
    a CI session's tmp_path is gone by the time one reads it)."""
    if [code for code, _, _ in agents] != [0, 0]:
        pytest.fail("\n".join(f"=== agent of node {node}: exit {code}\n--- stdout ---\n{out}\n--- stderr ---\n{err}"
                              for node, (code, out, err) in enumerate(agents)), pytrace=False)


def _result(text: str) -> dict:
    lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, text[-3000:]
    return json.loads(lines[0].removeprefix("RESULT "))


def test_selfcheck_across_two_nodes_of_two_ranks(tmp_path: Path) -> None:
    agents = _two_nodes(2, ["-m", "mcore_compat", "self-check", "--tp", "2", "--steps", "2"], tmp_path)
    _assert_ran(agents)
    reports = [out for _, out, _ in agents if "self-check:" in out]
    assert len(reports) == 1, [out[-2000:] for _, out, _ in agents]  # global rank 0 prints it, on one node
    assert "nproc=4, tp=2, pp=1, dp=2" in reports[0] and "self-check: PASS" in reports[0], reports[0][-3000:]


def test_a_user_job_on_two_nodes_checks_saves_and_resumes_on_one(tmp_path: Path) -> None:
    run = tmp_path / "run"
    agents = _two_nodes(1, [str(JOB), "train", str(run)], tmp_path)
    _assert_ran(agents)
    trained = _result("".join(out for _, out, _ in agents))
    # one rank per node: LOCAL_RANK 0 on both, global ranks 0 and 1
    assert trained["ranks"] == [[0, 0], [1, 0]] and trained["world"] == trained["dp"] == 2, trained
    assert trained["check_ok"] and trained["failed"] == [], trained
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, str(JOB), "load", str(run)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = _result(proc.stdout)
    assert loaded == {"iteration": 2, "extra": {"world": 2}, "exact": True, "trains": True, "dp": 1}, loaded


def test_a_rank_lost_mid_job_ends_it_on_every_node_and_the_next_job_starts_clean(tmp_path: Path) -> None:
    """Global rank 1 dies (SIGKILL) between two steps: rank 0, in the next step's collective with it, fails at once
    (gloo), both agents exit non-zero within the stated timeout, torchrun naming the lost rank and its signal; a new
    job then runs through."""
    import time

    start = time.monotonic()
    agents = _two_nodes(1, [str(JOB), "train-kill", str(tmp_path / "run")], tmp_path, timeout=180)
    assert time.monotonic() - start < 180
    assert all(code != 0 for code, _, _ in agents), [code for code, _, _ in agents]
    text = "".join(err for _, _, err in agents)
    assert "exitcode  : -9" in text and "rank      : 1" in text, text[-3000:]
    again = _two_nodes(1, [str(JOB), "train", str(tmp_path / "run2")], tmp_path)
    _assert_ran(again)
    assert _result("".join(out for _, out, _ in again))["check_ok"]
