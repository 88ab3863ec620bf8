"""Training-step overhead of mcore_compat.training vs the raw Megatron-Core calls (same process, same model).

Two copies of one GPT (same seed, weights copied exactly, same micro-batches) are trained side by side on one
rank: ``shim`` is built and stepped through ``mcore_compat.training`` (``wrap_ddp``, ``get_megatron_optimizer``,
``install_training_hooks``, ``zero_grad_buffer``, ``forward_backward``, ``optimizer_step``); ``raw`` with the
megatron-core 0.16-0.19 API directly (``DistributedDataParallel(config=, ddp_config=, module=)``,
``get_megatron_optimizer(OptimizerConfig(...), [ddp])``, the hooks set on the config as Megatron-LM's
``training.py`` does, ``get_forward_backward_func()(...)``, ``optimizer.step()``). After warm-up, blocks of
steps alternate (shim, raw, shim, raw, ...); every step is timed (``torch.cuda.synchronize`` around it on CUDA).
Reported: median step time of each and the ratio shim/raw (goal <= 1.01), plus the loss and weight differences
between the two (both must do the same work).

    python3 benchmarks/step_overhead.py --device cuda            # 8 layers, hidden 1024, seq 512, bf16
    python3 benchmarks/step_overhead.py --device cpu             # 2 layers, hidden 128, seq 64, fp32
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C
import _gpt as G

NAME = "step_overhead"

#: Per-device defaults of the timing schedule: warm-up steps per side, blocks per side, steps per block.
SCHEDULE = {"cuda": (5, 15, 8), "cpu": (3, 15, 2)}

LR = 1e-4


def _dtype(spec: G.GPTSpec) -> Any:
    import torch

    return torch.bfloat16 if spec.dtype == "bf16" else torch.float32


class ShimStep:
    """A GPT trained through ``mcore_compat.training``."""

    def __init__(self, spec: G.GPTSpec, seed: int, distopt: bool, overlap: bool) -> None:
        from mcore_compat import training as mt

        self.mt, self.spec = mt, spec
        self.module = G.build_gpt(spec, seed, raw=False)
        self.chunks = mt.wrap_ddp([self.module], ddp_config=mt.DDPConfig(
            use_distributed_optimizer=distopt, grad_reduce_in_fp32=spec.dtype == "bf16",
            overlap_grad_reduce=overlap))
        self.optimizer = mt.get_megatron_optimizer(mt.OptimConfig(
            optimizer="adam", lr=LR, weight_decay=0.0, clip_grad=1.0, bf16=spec.dtype == "bf16",
            params_dtype=_dtype(spec), use_distributed_optimizer=distopt), self.chunks)
        mt.install_training_hooks(self.chunks, self.optimizer)

    def step(self, batches: list[dict[str, Any]]) -> tuple[list[Any], float | None]:
        """One training step; returns the per-microbatch losses (tensors) and the grad norm."""
        mt, s = self.mt, self.spec
        mt.zero_grad_buffer(self.chunks, self.optimizer)
        stored = mt.forward_backward(G.forward_step, iter(batches), self.chunks, s.microbatches,
                                     seq_length=s.seq, micro_batch_size=s.micro_batch)
        _ok, norm, _zeros = mt.optimizer_step(self.optimizer)
        return [d["loss"] for d in stored], norm


class RawStep:
    """The same GPT trained with raw megatron-core 0.16-0.19 calls."""

    def __init__(self, spec: G.GPTSpec, seed: int, distopt: bool, overlap: bool) -> None:
        from megatron.core import package_info
        from packaging.version import Version

        version = Version(package_info.__version__)
        if not (0, 16) <= version.release[:2] <= (0, 19):
            raise SystemExit(f"step_overhead: the raw-Megatron side is written for the megatron-core 0.16-0.19 API; "
                             f"installed: {version}. Run it with a 0.16.x-0.19.x wheel.")
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

        self.spec, self.get_forward_backward_func = spec, get_forward_backward_func
        self.module = G.build_gpt(spec, seed, raw=True)
        config = self.module.config
        self.ddp = DistributedDataParallel(
            config=config,
            ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=distopt,
                                                     grad_reduce_in_fp32=spec.dtype == "bf16",
                                                     overlap_grad_reduce=overlap),
            module=self.module)
        self.optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=LR, weight_decay=0.0, clip_grad=1.0, bf16=spec.dtype == "bf16",
            params_dtype=_dtype(spec), use_distributed_optimizer=distopt), [self.ddp])
        # As Megatron-LM's training.py sets them.
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss
        if overlap:
            config.no_sync_func = self.ddp.no_sync
            config.grad_sync_func = self.ddp.start_grad_sync

    def step(self, batches: list[dict[str, Any]]) -> tuple[list[Any], float | None]:
        """One training step; returns the per-microbatch losses (tensors) and the grad norm."""
        s = self.spec
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        stored = self.get_forward_backward_func()(
            forward_step_func=G.forward_step, data_iterator=iter(batches), model=[self.ddp],
            num_microbatches=s.microbatches, seq_length=s.seq, micro_batch_size=s.micro_batch, forward_only=False)
        _ok, norm, _zeros = self.optimizer.step()
        return [d["loss"] for d in stored], (None if norm is None else float(norm))


def main() -> int:
    p = C.parser(__doc__)
    G.add_args(p)
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per side")
    p.add_argument("--blocks", type=int, default=None, help="timed blocks per side")
    p.add_argument("--block-steps", type=int, default=None, help="steps per block")
    p.add_argument("--no-distopt", action="store_true", help="without the distributed optimizer")
    p.add_argument("--no-overlap", action="store_true", help="without overlap_grad_reduce")
    args = p.parse_args()
    patches, ps = C.single_rank_megatron(args.device)
    import torch

    spec = G.spec_from_args(args)
    warmup, blocks, block_steps = SCHEDULE[args.device]
    warmup = args.warmup if args.warmup is not None else warmup
    blocks = args.blocks if args.blocks is not None else blocks
    block_steps = args.block_steps if args.block_steps is not None else block_steps
    distopt, overlap = not args.no_distopt, not args.no_overlap

    sides: dict[str, Any] = {"shim": ShimStep(spec, args.seed, distopt, overlap),
                             "raw": RawStep(spec, args.seed, distopt, overlap)}
    # Same seed gives the same weights; copy anyway (exactly equal by construction), then let the raw side's
    # optimizer re-read them into its main (fp32 / sharded) copies.
    G.copy_weights(sides["shim"].module, sides["raw"].module)
    sides["raw"].optimizer.reload_model_params()
    batches = G.make_batches(spec, args.seed, spec.microbatches)
    times: dict[str, list[float]] = {"shim": [], "raw": []}
    losses: dict[str, list[float]] = {"shim": [], "raw": []}
    norms: dict[str, list[float | None]] = {"shim": [], "raw": []}

    def run(side: str, steps: int, record: bool) -> None:
        for _ in range(steps):
            t, (step_losses, norm) = C.timed(sides[side].step, args.device, batches)
            losses[side].append(sum(float(x) for x in step_losses) / len(step_losses))
            norms[side].append(norm)
            if record:
                times[side].append(t)

    for side in ("shim", "raw"):
        run(side, warmup, record=False)
    for _ in range(blocks):
        for side in ("shim", "raw"):
            run(side, block_steps, record=True)
    # Drift-robust cross-check: the median over adjacent (shim block, raw block) pairs of their median ratio.
    pairs = [statistics.median(times["shim"][i:i + block_steps]) / statistics.median(times["raw"][i:i + block_steps])
             for i in range(0, len(times["raw"]), block_steps)]

    loss_diff = max(abs(a - b) for a, b in zip(losses["shim"], losses["raw"], strict=True))
    raw_params = dict(sides["raw"].module.named_parameters())
    weight_diff = max(float((p.detach().float() - raw_params[n].detach().float()).abs().max())
                      for n, p in sides["shim"].module.named_parameters())
    shim_s, raw_s = C.stats(times["shim"]), C.stats(times["raw"])
    ratio = shim_s["median"] / raw_s["median"]
    n_params = sum(p.numel() for p in sides["raw"].module.parameters())
    results = {
        "step_time_s": {"shim": shim_s, "raw": raw_s},
        "raw_step_times_s": times,
        "losses": losses,
        "grad_norms": norms,
        "block_pair_ratios": pairs,
        "median_block_pair_ratio": statistics.median(pairs),
        "max_loss_diff": loss_diff,
        "max_weight_diff_after": weight_diff,
        "parameters": n_params,
        "tokens_per_step": spec.micro_batch * spec.seq * spec.microbatches,
    }
    headline = [
        C.metric("median step, mcore_compat", shim_s["median"] * 1e3, "ms"),
        C.metric("median step, raw megatron", raw_s["median"] * 1e3, "ms"),
        C.metric("step time ratio mcore_compat/raw", ratio, "x", goal="<= 1.01"),
        C.metric("median of per-block-pair ratios", statistics.median(pairs), "x",
                 note="adjacent shim/raw blocks; robust to drift"),
        C.metric("max abs loss difference shim vs raw (same work)", loss_diff, "",
                 note="identical init and data; nonzero only from nondeterministic kernels"),
    ]
    config = {**spec.as_dict(), "distributed_optimizer": distopt, "overlap_grad_reduce": overlap,
              "warmup_steps_per_side": warmup, "blocks_per_side": blocks, "steps_per_block": block_steps,
              "order": "shim block, raw block, alternating", "patches": patches, "world_size": 1,
              "threads": torch.get_num_threads()}
    C.write_result(NAME, args.device, args.out, config=config, results=results, headline=headline)
    ps.destroy_model_parallel()
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
