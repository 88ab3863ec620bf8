"""A Ray worker group as RL frameworks run Megatron (an example client, not library API).

``Trainer`` actors (one process each, ranks of one ``torch.distributed`` group: gloo on CPU, NCCL on GPUs) build the
PPO actor of ``examples/ppo_actor`` through mcore_compat; the first update runs as ``check_training_step`` (a real
step, proved); between updates the trainers offload their weights, gradients and optimizer state while the
``Rollout`` actor generates, reload, and hand the full weights to the rollout actor through ``mc.iter_full`` (one
object per bucket) and Ray's object store::

    import ray
    from ray_rl.group import WorkerGroup

    ray.init(num_cpus=4)
    group = WorkerGroup(trainers=2)             # Trainer actors + one Rollout actor
    report = group.first_step(batch)            # check_training_step on every trainer: {"ok": ..., "failed": [...]}
    for _ in range(3):
        held = group.hand_off()                 # full weights: trainers -> object store -> rollout
        group.rollout(batch)                    # trainers offloaded meanwhile, the rollout samples
        group.train(batch)                      # one PPO update on every trainer
    group.shutdown()

``hand_off`` returns the checksums of the tensors the rollout actor now holds; ``trainer_checksums`` those of each
trainer's own parameters (compare them: the test does after every hand-off). Nothing here is Ray-specific to mcore_compat: the trainers are torchrun-like ranks (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` set before ``launch.init_from_env()``), as verl and NeMo-RL set up
their Megatron workers.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import torch

#: the batch every trainer trains on (per data-parallel rank): samples and sequence length
BATCH, SEQ = 4, 8


def make_batch(seed: int, vocab: int = 64) -> dict[str, torch.Tensor]:
    """A PPO batch of ``BATCH`` sequences: tokens, next tokens, mask, advantages, old log-probs set later."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": torch.ones(BATCH, SEQ),
            "advantages": torch.randn(BATCH, SEQ, generator=g)}


def checksums(weights: dict[str, torch.Tensor]) -> dict[str, int]:
    """A CRC32 of every tensor's bytes (compared on both sides of a hand-off). Of a copy: ``.numpy()`` of a
    parameter itself would mark its storage not resizable, and ``mc.offload`` then refuses to free it."""
    return {n: zlib.crc32(t.detach().clone().view(torch.uint8).numpy().tobytes())
            for n, t in sorted(weights.items())}


class Trainer:
    """One training rank (a Ray actor: ``ray.remote(Trainer)``)."""

    def __init__(self, rank: int, world: int, port: int, tp: int = 1, device: str = "cpu",
                 model: dict[str, int] | None = None) -> None:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        from mcore_compat import patches

        if device == "cpu":
            patches.apply_for_device("cpu")
        from mcore_compat import launch

        launch.init_from_env(device=device)
        from ppo_actor import ActorConfig, PPOActor, setup_parallel
        from ppo_actor.model import TinyGPTSpec

        setup_parallel(tp=tp)
        self.rank = rank
        self.actor = PPOActor(ActorConfig(tp=tp, use_distributed_optimizer=True, lr=1e-3, micro_batch_size=2,
                                          model=TinyGPTSpec(**(model or {}))), verbose=False)
        self.binding = self.actor.bind_params()

    def _with_old_log_probs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**batch, "old_log_probs": self.actor.compute_log_prob(batch)["log_probs"]}

    def first_step(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The first update as ``check_training_step`` (a real PPO step, every part of it proved)."""
        from ppo_actor.loss import compute_ppo_loss
        from ppo_actor.model import logprobs_and_entropy

        from mcore_compat.selfcheck import check_training_step

        actor = self.actor
        micro = actor._micro_batches(self._with_old_log_probs(batch))

        def forward_step(data_iterator: Any, chunk: Any) -> Any:
            mb = next(data_iterator)
            logits = actor._forward(chunk, mb)
            return logits, lambda output: compute_ppo_loss(logprobs_and_entropy(output, mb["labels"]), mb,
                                                           actor.config.loss)

        report = check_training_step(actor.model, actor.optimizer, forward_step, iter(micro),
                                     num_microbatches=len(micro), seq_length=SEQ,
                                     micro_batch_size=actor.config.micro_batch_size, binding=self.binding)
        return {"ok": report.ok, "failed": [c.name for c in report.checks if c.failed]}

    def train(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        return self.actor.update_policy(self._with_old_log_probs(batch))

    def offload(self) -> None:
        import mcore_compat as mc

        mc.offload(self.actor.model, self.actor.optimizer)

    def reload(self) -> None:
        import mcore_compat as mc

        mc.reload(self.actor.model, self.actor.optimizer)

    def bucket_refs(self, bucket_bytes: int = 1 << 26) -> list[Any]:
        """The full weights as one object-store object per ``mc.iter_full`` bucket (rank 0; ``[]`` elsewhere;
        collective)."""
        import ray

        import mcore_compat as mc

        refs, names, tensors, size = [], [], [], 0
        for name, tensor in mc.iter_full(self.binding, dst=0, bucket_bytes=bucket_bytes):
            names.append(name)
            # a copy: the tensors of a bucket are views of one tensor, and Ray's serializer writes a view's whole
            # storage for each view (the 53 views of a 20 MiB bucket: 1 GiB, 12 s instead of 0.2 s)
            tensors.append(tensor.clone())
            size += tensor.numel() * tensor.element_size()
            if size >= bucket_bytes:
                refs.append(ray.put(dict(zip(names, tensors, strict=True))))
                names, tensors, size = [], [], 0
        if names:
            refs.append(ray.put(dict(zip(names, tensors, strict=True))))
        return refs

    def tensor_refs(self) -> list[Any]:
        """The weights one object per parameter, as a client without ``gather_full`` passes them (rank 0 of a
        TP=1 group holds every parameter whole; ``[]`` elsewhere)."""
        import ray

        from mcore_compat.selfcheck.wrappers import core_module

        if self.rank != 0:
            return []
        return [ray.put({n: p.detach().clone()}) for n, p in core_module(self.actor.model[0]).named_parameters()]

    def local_checksums(self) -> dict[str, int]:
        """This rank's own parameters (whole at TP=1), read from the model, not from ``iter_full``."""
        from mcore_compat.selfcheck.wrappers import core_module

        return checksums(dict(core_module(self.actor.model[0]).named_parameters()))

    def ready(self) -> bool:
        return True


class Rollout:
    """The inference side (a Ray actor): holds the weights it was handed and samples from them."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.loads = 0

    def load(self, weights: dict[str, torch.Tensor]) -> dict[str, int]:
        self.weights = {n: t.clone() for n, t in weights.items()}
        self.loads += 1
        return checksums(self.weights)

    def load_refs(self, refs: list[Any]) -> dict[str, int]:
        """The weights from a list of object-store objects, each a ``{name: tensor}`` part."""
        import ray

        weights: dict[str, torch.Tensor] = {}
        for part in ray.get(refs):
            weights.update(part)
        return self.load(weights)

    def generate(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """A stand-in for generation: greedy next tokens from the handed word embeddings (tied output layer)."""
        emb = self.weights["embedding.word_embeddings.weight"]
        return (emb[batch["input_ids"]] @ emb.t()).argmax(-1)


class WorkerGroup:
    """``trainers`` Trainer actors and one Rollout actor (``ray.init`` first)."""

    def __init__(self, trainers: int = 2, tp: int = 1, device: str = "cpu", model: dict[str, int] | None = None
                 ) -> None:
        import ray

        from mcore_compat.launch import free_port

        port = free_port()
        resources = {"num_cpus": 1} if device == "cpu" else {"num_gpus": 1}
        trainer_cls = ray.remote(**resources)(Trainer)
        self.trainers = [trainer_cls.remote(r, trainers, port, tp, device, model) for r in range(trainers)]
        self.rollout_actor = ray.remote(num_cpus=0)(Rollout).remote()
        ray.get([t.ready.remote() for t in self.trainers])

    def _all(self, method: str, *args: Any, timeout: float = 300.0) -> list[Any]:
        """``method`` on every trainer. A trainer that died (a killed process, a lost node) fails the call in
        one line naming its rank, within ``timeout`` seconds: its peers, stuck in a collective with it, get the
        process group's error (gloo at once; NCCL at its timeout) and are named as failed after it."""
        import ray

        refs = [getattr(t, method).remote(*args) for t in self.trainers]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        lost, failed, out = [], [], []
        for rank, ref in enumerate(refs):
            if ref in pending:
                failed.append(f"rank {rank} did not answer within {timeout:g} s")
                continue
            try:
                out.append(ray.get(ref))
            except ray.exceptions.ActorDiedError:
                lost.append(rank)
            except ray.exceptions.RayTaskError as exc:
                failed.append(f"rank {rank}: {str(exc.cause).splitlines()[0][:200] if exc.cause else exc}")
        if lost or failed:
            raise RuntimeError(f"{method}: trainer rank(s) {', '.join(map(str, lost)) or 'none'} lost"
                               + (f"; {'; '.join(failed)}" if failed else ""))
        return out

    def first_step(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        reports = self._all("first_step", batch)
        return {"ok": all(r["ok"] for r in reports), "failed": sorted({n for r in reports for n in r["failed"]})}

    def train(self, batch: dict[str, torch.Tensor]) -> list[dict[str, float]]:
        return self._all("train", batch)

    def hand_off(self) -> dict[str, int]:
        """The trainers' full weights to the rollout actor (rank 0 gathers them bucket by bucket with
        ``mc.iter_full``, the object store carries one object per bucket); returns the checksums of what the
        rollout actor now holds."""
        return self.hand_off_via("bucket_refs")

    def hand_off_via(self, method: str) -> dict[str, int]:
        """The hand-off through ``Trainer.<method>`` (``bucket_refs``: one object per ``iter_full`` bucket;
        ``tensor_refs``: one per parameter); the checksums the rollout actor holds after it."""
        import ray

        parts = self._all(method)
        return ray.get(self.rollout_actor.load_refs.remote(parts[0]))

    def trainer_checksums(self) -> list[dict[str, int]]:
        """Every trainer's own parameters' checksums (TP=1: each holds them whole)."""
        return self._all("local_checksums")

    def rollout(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Generation while the trainers' memory is offloaded."""
        import ray

        self._all("offload")
        try:
            return ray.get(self.rollout_actor.generate.remote(batch))
        finally:
            self._all("reload")

    def shutdown(self) -> None:
        import ray

        for actor in [*self.trainers, self.rollout_actor]:
            ray.kill(actor)
