"""Self-check settings, validated up front so that bad input is a usage error, not a traceback."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["FAULTS", "SelfCheckOptions", "UsageError"]

#: Deliberate faults the self-check can inject to prove that its checks catch them (negative controls).
FAULTS = {
    "rebind_after_optimizer": "param.data rebound to an outside flat buffer after the optimizer is built",
    "rebind_before_optimizer": "param.data rebound to an outside flat buffer after DDP, before the optimizer",
    "no_finalize_hook": "config.finalize_model_grads_func left unset (raw Megatron schedules skip it silently)",
    "lr_zero": "the optimizer built with learning rate 0",
    "perturb_dp_rank": "the last data-parallel rank's weights perturbed after the first step",
    "rebind_after_bind": "param.data rebound to an outside flat buffer after bind_params (needs bind=True)",
}


class UsageError(ValueError):
    """Options that cannot work together; the message says what to change."""


@dataclass(frozen=True)
class SelfCheckOptions:
    """What to check.

    Attributes:
        nproc: local processes to spawn; ``None`` under ``torchrun`` (world size from the environment) or 1.
        tp, pp, dp: tensor/pipeline/data-parallel sizes; ``None`` = derived (tp=pp=1, dp=world/(tp*pp)).
        distributed_optimizer: use Megatron's distributed optimizer (0.6+; ours on 0.4/0.5).
        dtype: ``"fp32"`` or ``"bf16"`` parameters.
        bind: bind parameters to flat buffers (``bind_params``) and check the binding.
        device: ``"cpu"`` (gloo, CPU patches) or ``"cuda"`` (nccl); ``None`` = cuda if available.
        model: ``"mlp"`` (tensor-parallel linear layers) or ``"gpt"`` (tiny GPT, Megatron's local spec).
        steps: optimizer steps (>= 2 to see the loss go down).
        lr: learning rate.
        seed: seed of init and data.
        timeout: seconds before a hung run is stopped (ranks named).
        fault: a deliberate fault for negative controls (the checks must then FAIL): one of :data:`FAULTS`.
    """

    nproc: int | None = None
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    distributed_optimizer: bool = True
    dtype: str = "fp32"
    bind: bool = True
    device: str | None = None
    model: str = "gpt"
    steps: int = 3
    lr: float = 1e-2
    seed: int = 1234
    timeout: float = 300.0
    fault: str | None = None

    def world_size(self) -> int:
        """The world size these options run on."""
        if self.nproc is not None:
            return self.nproc
        return int(os.environ.get("WORLD_SIZE", "1"))

    def resolved(self) -> SelfCheckOptions:
        """Fill in derived values and validate; raises :class:`UsageError` naming the bad option."""
        from dataclasses import replace

        world = self.world_size()
        if world < 1:
            raise UsageError(f"--nproc must be >= 1, got {world}")
        tp, pp = self.tp or 1, self.pp or 1
        if tp < 1 or pp < 1:
            raise UsageError(f"--tp and --pp must be >= 1, got tp={tp} pp={pp}")
        if world % (tp * pp):
            raise UsageError(f"world size {world} is not divisible by tp*pp = {tp}*{pp}; change --nproc/--tp/--pp")
        dp = self.dp if self.dp is not None else world // (tp * pp)
        if tp * pp * dp != world:
            raise UsageError(f"tp*pp*dp = {tp}*{pp}*{dp} = {tp * pp * dp} does not equal the world size {world}")
        if self.dtype not in ("fp32", "bf16"):
            raise UsageError(f"--dtype must be fp32 or bf16, got {self.dtype!r}")
        if self.model not in ("mlp", "gpt"):
            raise UsageError(f"--model must be mlp or gpt, got {self.model!r}")
        if self.steps < 1:
            raise UsageError(f"--steps must be >= 1, got {self.steps}")
        if self.fault is not None and self.fault not in FAULTS:
            raise UsageError(f"unknown fault {self.fault!r}; known: {', '.join(FAULTS)}")
        if self.fault == "rebind_after_bind" and not self.bind:
            raise UsageError("fault rebind_after_bind needs bind=True (--bind)")
        if self.timeout <= 0:
            raise UsageError(f"--timeout must be > 0, got {self.timeout}")
        device = self.device
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in ("cpu", "cuda"):
            raise UsageError(f"--device must be cpu or cuda, got {device!r}")
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise UsageError("--device cuda but torch sees no GPU; use --device cpu")
            if self.nproc and self.nproc > torch.cuda.device_count():
                raise UsageError(f"--nproc {self.nproc} > {torch.cuda.device_count()} visible GPUs")
        return replace(self, tp=tp, pp=pp, dp=dp, device=device)

    def as_dict(self) -> dict[str, Any]:
        """The options as a plain dict (for reports)."""
        return asdict(self)
