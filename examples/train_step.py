"""A few training steps of a tensor-parallel MLP through mcore_compat, unchanged on megatron-core 0.4 ... 0.19.

    python examples/train_step.py                         # 2 CPU ranks (gloo), DP=2, fp32
    python examples/train_step.py --tp 2 --bf16 --distopt # TP=2, bf16 params, distributed optimizer (0.6+)
    torchrun --nproc-per-node 8 examples/train_step.py --device cuda --tp 2

Everything Megatron-specific goes through ``mcore_compat`` (symbols, patches, DDP, optimizer, hooks, schedules);
on a CPU-only machine the CPU harness patches are applied in each rank before megatron is imported.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

H, F, STEPS, MICROBATCHES = 16, 32, 5, 2


def train(tp: int, distopt: bool, bf16: bool, device: str) -> list[float]:
    """Run on every rank; returns the losses of this rank."""
    from mcore_compat import patches

    patches.apply_for_device(device)  # before megatron is imported: apex-/TE-less releases, the CPU harness
    import torch

    import mcore_compat as mc
    from mcore_compat import training as mt

    mc.parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = mc.TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=tp,
                                  tensor_model_parallel_size=tp, use_cpu_initialization=True,
                                  params_dtype=dtype, bf16=bf16)

    class MLP(mc.MegatronModule):
        def __init__(self) -> None:
            super().__init__(config=config)
            self.model_type = mc.ModelType.encoder_or_decoder
            init = torch.nn.init.xavier_normal_
            self.fc1 = mc.ColumnParallelLinear(H, F, config=config, init_method=init, bias=True,
                                               gather_output=False)
            self.fc2 = mc.RowParallelLinear(F, H, config=config, init_method=init, bias=True,
                                            input_is_parallel=True, skip_bias_add=False)

        def set_input_tensor(self, tensor: Any) -> None:  # the schedules call it
            self.input_tensor = tensor

        def forward(self, x: Any) -> Any:
            h, _ = self.fc1(x)
            y, _ = self.fc2(torch.nn.functional.gelu(h))
            return y

    torch.manual_seed(1234)  # same full weights on every rank (TP ranks take their slice of them)
    model = mt.wrap_ddp([MLP().to(device)],
                        ddp_config=mt.DDPConfig(grad_reduce_in_fp32=bf16, use_distributed_optimizer=distopt))
    optimizer = mt.get_megatron_optimizer(
        mt.OptimConfig(lr=1e-2, weight_decay=0.1, bf16=bf16, params_dtype=dtype, use_distributed_optimizer=distopt),
        model)
    mt.install_training_hooks(model, optimizer)  # finalize_model_grads_func & co. on the model's real config
    # The same learning rate and weight decay per parameter on every release (biases: no decay), no scheduler needed.
    settings = mt.effective_lr_and_weight_decay(optimizer, model)
    mc.print_rank_0("effective (lr, weight decay): " + ", ".join(f"{name} ({lr:g}, {wd:g})"
                                                                   for name, (lr, wd) in sorted(settings.items())))

    dp_rank = mc.parallel_state.get_data_parallel_rank()
    gen = torch.Generator().manual_seed(1000 + dp_rank)
    weights = torch.randn(H, H, generator=torch.Generator().manual_seed(7)) / H**0.5  # same on every rank

    fixed = [torch.randn(4, 2, H, generator=gen) for _ in range(MICROBATCHES)]  # [seq, batch, hidden]

    def batches() -> Any:  # the same microbatches every step, so the loss should fall
        while True:
            for x in fixed:
                yield x.to(device), torch.tanh(x @ weights).to(device)

    data = batches()

    def forward_step(data_iterator: Any, module: Any) -> Any:
        x, y = next(data_iterator)
        out = module(x.to(dtype))

        def loss_func(output: Any) -> Any:
            loss = ((output.float() - y) ** 2).mean()
            return loss, {"loss": loss.detach().clone()}

        return out, loss_func

    losses = []
    for step in range(STEPS):
        mt.zero_grad_buffer(model, optimizer)
        stored = mt.forward_backward(forward_step, data, model, MICROBATCHES, seq_length=4, micro_batch_size=2)
        ok, grad_norm, _ = mt.optimizer_step(optimizer)
        loss = sum(float(s["loss"]) for s in stored) / len(stored)
        losses.append(loss)
        mc.print_rank_0(f"megatron-core {mc.MCORE_VERSION} step {step}: loss {loss:.4f} grad_norm {grad_norm} "
                        f"update_successful {ok}")
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--distopt", action="store_true", help="distributed optimizer (0.6+, or legacy on 0.4/0.5)")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    from mcore_compat import launch

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        launch.init_from_env(device=args.device)
        train(args.tp, args.distopt, args.bf16, args.device)
        launch.end_job()  # the last call of a torchrun rank (docs/launch.md: why not just return)
    per_rank = launch.spawn(train, args.nproc, args=(args.tp, args.distopt, args.bf16, args.device),
                            device=args.device, timeout=300)
    print("losses per rank:", [[round(v, 4) for v in r] for r in per_rank])


if __name__ == "__main__":
    main()
