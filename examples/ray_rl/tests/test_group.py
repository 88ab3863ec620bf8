"""The Ray worker group (``ray_rl.group``) on a local Ray instance, CPU: 2 trainer actors (gloo) and a rollout actor.

The first PPO update runs as ``check_training_step`` and passes; then three iterations of hand-off (full weights by
``iter_full`` buckets through Ray's object store), rollout (the trainers offloaded meanwhile) and a PPO update: after
every hand-off the rollout actor holds exactly the trainers' weights (checksums of each trainer's own parameters,
read from its model, not from ``iter_full``), and the weights move between hand-offs.

Marked ``launcher`` (a Ray cluster of fresh worker processes; torch, Python and Ray are under test, so one release
per Python runs it); skipped, naming why, where Ray is not installed (CI's bases pin it: ci/matrix_env.py).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = [pytest.mark.mcore, pytest.mark.launcher]

ray = pytest.importorskip("ray", reason="Ray is not installed (CI's test tools pin it: ci/matrix_env.TEST_TOOLS)")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ":".join(p for p in sys.path if p)}})
    try:
        yield ray
    finally:
        ray.shutdown()


def test_a_worker_group_checks_trains_offloads_and_hands_off(cluster: Any) -> None:
    from ray_rl.group import WorkerGroup, make_batch

    group = WorkerGroup(trainers=2)
    try:
        first = group.first_step(make_batch(0))
        assert first == {"ok": True, "failed": []}, first
        seen = []
        for i in range(3):
            held = group.hand_off()
            trainers = group.trainer_checksums()
            assert trainers[0] == trainers[1] == held, i  # both DP replicas and the rollout actor: same bytes
            seen.append(held)
            tokens = group.rollout(make_batch(1))
            assert tuple(tokens.shape) == (4, 8)
            metrics = group.train(make_batch(2 + i))
            assert all(m["actor/update_successful"] == 1.0 for m in metrics), metrics
        assert seen[0] != seen[1] != seen[2]  # the updates moved the weights the rollout actor got
    finally:
        group.shutdown()


def test_a_lost_trainer_fails_the_step_in_one_line_and_a_new_group_starts_clean(cluster: Any) -> None:
    """A trainer actor killed (as a lost node would be): the next step fails within seconds, in one line naming
    the lost rank (its peer, in a collective with it, fails too); a new group then trains as before."""
    import time

    from ray_rl.group import WorkerGroup, make_batch

    group = WorkerGroup(trainers=2)
    try:
        group.train(make_batch(0))
        ray.kill(group.trainers[1])
        start = time.monotonic()
        with pytest.raises(RuntimeError) as err:
            group.train(make_batch(1))
        text = str(err.value)
        assert time.monotonic() - start < 60 and "\n" not in text, text
        assert text.startswith("train: trainer rank(s) 1 lost; rank 0: "), text
    finally:
        group.shutdown()
    again = WorkerGroup(trainers=2)
    try:
        metrics = again.train(make_batch(0))
        assert all(m["actor/update_successful"] == 1.0 for m in metrics)
    finally:
        again.shutdown()
