"""Three training steps of a small MLP through mcore_compat, on one CPU rank, on every release 0.4 ... 0.19."""

import torch

from mcore_compat import launch


def train() -> list[float]:
    from mcore_compat import patches

    patches.apply_for_device("cpu")  # before Megatron is imported: the CPU harness, apex-/TE-less releases
    import mcore_compat as mc
    from mcore_compat import training as mt

    mc.parallel_state.initialize_model_parallel()  # TP = PP = 1; launch.spawn made the process group
    config = mc.TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)

    class MLP(mc.MegatronModule):
        def __init__(self) -> None:
            super().__init__(config=config)
            self.model_type = mc.ModelType.encoder_or_decoder
            self.fc1 = mc.ColumnParallelLinear(8, 16, config=config, init_method=torch.nn.init.xavier_normal_,
                                               bias=True, gather_output=True)

        def set_input_tensor(self, tensor: torch.Tensor) -> None:  # the schedules call it
            self.input_tensor = tensor

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc1(x)[0].sum(-1, keepdim=True)

    torch.manual_seed(0)
    model = mt.wrap_ddp([MLP()], ddp_config=mt.DDPConfig())
    optimizer = mt.get_megatron_optimizer(mt.OptimConfig(lr=1e-2), model)
    mt.install_training_hooks(model, optimizer)
    x, y = torch.randn(4, 2, 8), torch.zeros(4, 2, 1)  # [sequence, micro-batch, hidden]

    def forward_step(data_iterator, module):  # Megatron's contract: (output, loss function)
        def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict]:
            loss = ((output - y) ** 2).mean()
            return loss, {"loss": loss.detach()}

        return module(next(data_iterator)), loss_func

    losses = []
    for _ in range(3):
        mt.zero_grad_buffer(model, optimizer)
        stored = mt.forward_backward(forward_step, iter([x]), model, 1, seq_length=4, micro_batch_size=2)
        mt.optimizer_step(optimizer)
        losses.append(float(stored[0]["loss"]))  # the loss before this step's update
    return losses


if __name__ == "__main__":
    [losses] = launch.spawn(train, 1, device="cpu", timeout=300)
    print("loss after each step:", [round(v, 4) for v in losses])
    assert losses[-1] < losses[0], "the loss should fall"
