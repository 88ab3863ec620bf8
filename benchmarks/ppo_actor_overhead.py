"""Step time of the PPO actor (examples/ppo_actor) through mcore_compat vs the same step on raw Megatron-Core APIs.

Two copies of one tiny GPT (same weights, same batch, same loss code) are trained side by side in one process
group: ``mcore_compat`` is ``PPOActor.update_policy`` (``wrap_ddp``, ``get_megatron_optimizer``,
``install_training_hooks``, ``zero_grad_buffer``, ``forward_backward``, ``optimizer_step``); ``raw`` is a copy of
that step written against the installed release's own API (megatron-core 0.16-0.19:
``DistributedDataParallel(config=, ddp_config=, module=)``, ``get_megatron_optimizer(OptimizerConfig(...),
[model])``, ``finalize_model_grads`` / ``scale_loss`` set on the model config, ``get_forward_backward_func()``,
``optimizer.step()``). After warm-up, blocks of steps alternate (A B A B ...) and every step is timed
(``torch.cuda.synchronize`` around it on CUDA). Reported: the median step time of each side and their ratio
mcore_compat / raw, the raw per-step times, and the final weight difference of the two copies (they must do the
same work), in ``benchmarks/results/ppo_actor_overhead-<device>.json``.

    python benchmarks/ppo_actor_overhead.py --nproc 1 --device cpu
    python benchmarks/ppo_actor_overhead.py --nproc 2 --device cuda --distopt
    torchrun --nproc-per-node 8 benchmarks/ppo_actor_overhead.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))  # ppo_actor (also reaches the spawned ranks)

NAME = "ppo_actor_overhead"
RAW_RELEASES = ">=0.16"  # the raw step below is written for these releases' API
#: Model / batch sizes per device: (vocab, hidden, ffn, layers, heads, seq, batch per DP rank, micro-batch).
SIZES = {"cpu": (128, 64, 256, 2, 4, 32, 8, 2), "cuda": (2048, 512, 2048, 4, 8, 256, 16, 4)}
NOISE = (".*reduce_scatter_tensor.*", ".*all_gather_into_tensor.*", ".*is not a leaf Tensor.*",
         ".*requires_grad=True to a scalar.*", ".*Apex is not installed.*", ".*cuda_graph_scope.*")


# --------------------------------------------------------------------------------------------------------------
# the raw side: the actor's update_policy, written against megatron-core 0.16-0.19 directly
# --------------------------------------------------------------------------------------------------------------

class RawActor:
    """The same model, optimizer and step as ``PPOActor``, built and run with raw megatron-core calls."""

    def __init__(self, config: Any, init_from: Any) -> None:
        import torch
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.utils import get_model_config
        from ppo_actor.model import build_gpt, copy_weights

        self.config = config
        module = build_gpt(config.model, config.tp, config.device)
        copy_weights(init_from, module)
        model_config = get_model_config(module)
        self.ddp = DistributedDataParallel(
            config=model_config, module=module,
            ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=config.use_distributed_optimizer))
        self.module = module
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=config.lr, weight_decay=config.weight_decay,
                            clip_grad=config.clip_grad, params_dtype=torch.float32,
                            use_distributed_optimizer=config.use_distributed_optimizer), [self.ddp])
        model_config.finalize_model_grads_func = finalize_model_grads  # as Megatron-LM's training.py does
        model_config.grad_scale_func = self.optimizer.scale_loss
        self.forward_backward = get_forward_backward_func()

    def update_policy(self, batch: dict[str, Any]) -> dict[str, float]:
        """What ``PPOActor.update_policy`` does (split, schedule, step, metric reduction), raw."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state
        from ppo_actor.actor import split_micro_batches
        from ppo_actor.loss import compute_ppo_loss
        from ppo_actor.model import logprobs_and_entropy

        micro = split_micro_batches(batch, self.config.micro_batch_size, self.config.device)
        loss_config = self.config.loss

        def forward_step(data_iterator: Any, model: Any) -> Any:
            mb = next(data_iterator)
            logits = model(mb["input_ids"], mb["position_ids"], mb["attention_mask"])

            def loss_func(output: Any) -> Any:
                return compute_ppo_loss(logprobs_and_entropy(output, mb["labels"]), mb, loss_config)

            return logits, loss_func

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        stored = self.forward_backward(
            forward_step_func=forward_step, data_iterator=iter(micro), model=[self.ddp],
            num_microbatches=len(micro), seq_length=micro[0]["input_ids"].shape[1],
            micro_batch_size=self.config.micro_batch_size, forward_only=False)
        ok, grad_norm, _ = self.optimizer.step()
        keys = sorted(stored[0])
        values = torch.stack([torch.stack([d[k].float() for d in stored]).mean() for k in keys])
        group = parallel_state.get_data_parallel_group()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(values, group=group)
            values /= dist.get_world_size(group)
        metrics = dict(zip(keys, values.tolist(), strict=True))
        metrics["actor/grad_norm"] = float(grad_norm)
        metrics["actor/update_successful"] = float(ok)
        return metrics


# --------------------------------------------------------------------------------------------------------------
# one rank
# --------------------------------------------------------------------------------------------------------------

def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any], device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _batch(config: Any, dp_rank: int, seed: int) -> dict[str, Any]:
    import torch

    vocab, seq, size = config.model.vocab_size, config.model.max_seq_len, SIZES[config.device][6]
    g = torch.Generator().manual_seed(seed + 17 * dp_rank)
    tokens = torch.randint(0, vocab, (size, seq + 1), generator=g)
    mask = torch.ones(size, seq)
    mask[:, : seq // 4] = 0.0  # prompt
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(), "loss_mask": mask,
            "advantages": torch.randn(size, seq, generator=g),
            "noise": 0.1 * torch.randn(size, seq, generator=g), "multi_modal_inputs": []}


def _environment(device: str, nproc: int, patches: list[str]) -> dict[str, Any]:
    import torch

    import mcore_compat as mc

    if device == "cuda":
        device_name = torch.cuda.get_device_name()
    else:
        device_name = platform.processor() or platform.machine()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    device_name = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
    return {"python": platform.python_version(), "torch": torch.__version__,
            "megatron_core": str(mc.MCORE_VERSION), "mcore_compat": mc.__version__, "device": device,
            "device_name": device_name, "nproc": nproc, "cpu_count": os.cpu_count(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "patches": patches}


def run_rank(opts: dict[str, Any]) -> dict[str, Any]:
    """Build both sides on this rank, warm up, time ABAB blocks; returns raw numbers (rank 0's are reported)."""
    from mcore_compat import patches

    device = opts["device"]
    applied = patches.apply_for(*(["apex_less", "te_less", "upstream_bug"] + (["cpu"] if device == "cpu" else [])))
    for pattern in NOISE:
        warnings.filterwarnings("ignore", message=pattern)
    import torch
    from packaging.specifiers import SpecifierSet
    from ppo_actor import ActorConfig, LossConfig, PPOActor, TinyGPTSpec, setup_parallel
    from ppo_actor.model import build_gpt

    import mcore_compat as mc

    if mc.MCORE_VERSION not in SpecifierSet(RAW_RELEASES):
        raise SystemExit(f"the raw side of this benchmark is written for megatron-core {RAW_RELEASES}; "
                         f"installed {mc.MCORE_VERSION}")
    vocab, hidden, ffn, layers, heads, seq, _size, micro = SIZES[device]
    setup_parallel(opts["tp"], opts["seed"])
    config = ActorConfig(
        tp=opts["tp"], use_distributed_optimizer=opts["distopt"], lr=1e-4, micro_batch_size=micro, device=device,
        model=TinyGPTSpec(vocab, hidden, ffn, layers, heads, seq),
        loss=LossConfig(clip_ratio_c=3.0, entropy_coeff=0.01, use_kl_loss=True, kl_loss_type="k3"))
    init = build_gpt(config.model, config.tp, device)
    sides: dict[str, Any] = {"mcore_compat": PPOActor(config, init_from=init, verbose=False),
                             "raw": RawActor(config, init_from=init)}
    batch = _batch(config, mc.parallel_state.get_data_parallel_rank(), opts["seed"])
    with torch.no_grad():  # reference log-probs: those of the initial weights
        batch["ref_log_probs"] = sides["mcore_compat"].compute_log_prob(batch, model=init)["log_probs"].cpu()
    batch["old_log_probs"] = batch["ref_log_probs"] + batch.pop("noise")

    times: dict[str, list[float]] = {name: [] for name in sides}
    norms: dict[str, list[float]] = {name: [] for name in sides}
    for name, side in sides.items():  # warm-up
        for _ in range(opts["warmup"]):
            norms[name].append(side.update_policy(batch)["actor/grad_norm"])
    for _block in range(opts["blocks"]):  # A B A B ...
        for name, side in sides.items():
            for _ in range(opts["steps_per_block"]):
                out: dict[str, Any] = {}
                times[name].append(_timed(lambda s=side, o=out: o.update(s.update_policy(batch)), device))
                norms[name].append(out["actor/grad_norm"])
    a = dict(sides["mcore_compat"].module.named_parameters())
    weight_diff = max(float((a[n] - p).abs().max()) for n, p in sides["raw"].module.named_parameters())
    mc.parallel_state.destroy_model_parallel()
    return {"times": times, "grad_norms": norms, "max_weight_diff": weight_diff,
            "environment": _environment(device, opts["nproc"], applied),
            "config": {"tp": config.tp, "distopt": config.use_distributed_optimizer, "vocab": vocab,
                       "hidden": hidden, "ffn": ffn, "layers": layers, "heads": heads, "seq": seq,
                       "batch_per_dp_rank": _size, "micro_batch_size": micro, "warmup": opts["warmup"],
                       "blocks": opts["blocks"], "steps_per_block": opts["steps_per_block"]}}


# --------------------------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------------------------

def _report(rank0: dict[str, Any], out_dir: Path) -> Path:
    times = rank0["times"]
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["mcore_compat"] / med["raw"]
    n = rank0["config"]["steps_per_block"]
    blocks = {k: [statistics.median(v[i:i + n]) for i in range(0, len(v), n)] for k, v in times.items()}
    paired = statistics.median(a / b for a, b in zip(blocks["mcore_compat"], blocks["raw"], strict=True))
    result = {
        "benchmark": NAME, "environment": rank0["environment"], "config": rank0["config"],
        "results": {"median_step_s": med, "mean_step_s": {k: statistics.fmean(v) for k, v in rank0["times"].items()},
                    "median_of_block_pair_ratios": paired, "step_times_s": times,
                    "grad_norms": rank0["grad_norms"],
                    "max_weight_diff": rank0["max_weight_diff"]},
        "headline": [{"metric": "step_time_ratio_mcore_compat_over_raw", "value": ratio, "unit": "x",
                      "note": "median step time, ABAB blocks in one run, rank 0"},
                     {"metric": "median_of_block_pair_ratios", "value": paired, "unit": "x",
                      "note": "per adjacent (mcore_compat, raw) block pair: ratio of block medians; median"}],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{NAME}-{rank0['environment']['device']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"megatron-core {rank0['environment']['megatron_core']} on {rank0['environment']['device_name']}: "
          f"mcore_compat {med['mcore_compat'] * 1e3:.2f} ms, raw {med['raw'] * 1e3:.2f} ms per step, "
          f"ratio {ratio:.4f} (block pairs: {paired:.4f}); max weight difference "
          f"{rank0['max_weight_diff']:.3g}\n-> {path}")
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=1, help="ranks to spawn (ignored under torchrun)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--distopt", action="store_true", help="distributed optimizer")
    p.add_argument("--warmup", type=int, default=5, help="warm-up steps per side")
    p.add_argument("--blocks", type=int, default=20, help="timed blocks per side (alternating)")
    p.add_argument("--steps-per-block", type=int, default=3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = p.parse_args()
    opts = {"device": args.device, "tp": args.tp, "distopt": args.distopt, "warmup": args.warmup,
            "blocks": args.blocks, "steps_per_block": args.steps_per_block, "seed": args.seed,
            "nproc": int(os.environ.get("WORLD_SIZE", args.nproc))}
    from mcore_compat import launch

    env = {"NCCL_NVLS_ENABLE": "0"} if args.device == "cuda" else {}
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        os.environ.update(env)
        rank, _ = launch.init_from_env(device=args.device)
        result = run_rank(opts)
        if rank == 0:
            _report(result, args.out)
        return
    per_rank = launch.spawn(run_rank, args.nproc, args=(opts,), device=args.device, timeout=600, env=env)
    _report(per_rank[0], args.out)


if __name__ == "__main__":
    main()
