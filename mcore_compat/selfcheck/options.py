"""Self-check settings, validated up front so that bad input is a usage error, not a traceback."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import McoreCompatError

__all__ = ["FAULTS", "SelfCheckOptions", "UsageError"]

#: Deliberate faults the self-check can inject to prove that its checks catch them (negative controls).
FAULTS = {
    "rebind_after_optimizer": "param.data rebound to an outside flat buffer after the optimizer is built",
    "rebind_before_optimizer": "param.data rebound to an outside flat buffer after DDP, before the optimizer",
    "no_finalize_hook": "config.finalize_model_grads_func left unset (raw Megatron schedules skip it silently)",
    "lr_zero": "the optimizer built with learning rate 0",
    "perturb_dp_rank": "the last data-parallel rank's weights perturbed after the first step",
    "rebind_after_bind": "param.data rebound to an outside flat buffer after bind_params (needs bind=True)",
    "negate_norm_grads": "the norms' gradients negated after finalize_model_grads (a subset moves the wrong way)",
    "scale_grads": "every gradient x3 after finalize_model_grads (a sum where a mean belongs)",
    "unreduced_dp_rank": "the last data-parallel rank keeps its own unreduced gradients after finalize_model_grads",
    "decay_no_decay_params": "weight decay applied to the biases and norms",
    "wrong_group_lr": "one param group's learning rate x10",
    "group_not_stepped": "one param group left out of the optimizer's step",
    "maximize_in_step": "the optimizer's param groups switched to maximize=True inside the step (every update goes "
                        "up the gradient)",
    "swap_betas_in_step": "Adam's betas swapped in the optimizer's param groups inside the step",
    "decay_no_decay_in_step": "weight decay applied to the biases' and norms' group inside the step",
    "loss_not_averaged": "the loss not divided by the number of micro-batches",
    "stale_binding": "the binding's flat buffers are copies taken at bind time (needs bind=True)",
    "gather_full_wrong_stride": "the binding records a wrong TP partition stride for one parameter at bind time "
                                "(needs bind=True and tp > 1)",
    "reload_recreates_storage": "reload copies the params' bytes into new memory and rebinds param.data instead "
                                "of refilling their storage (needs offload_cycles >= 1)",
    "offload_misses_optimizer_state": "offload finds no optimizer state, so it stays on the device (needs "
                                      "offload_cycles >= 1)",
    "offload_reallocates_host": "offload allocates a new host buffer every cycle while the old one is still "
                                "referenced (needs offload_cycles >= 2)",
}

#: The faults that act inside offload/reload, with the cycles they need.
_OFFLOAD_FAULTS = {"reload_recreates_storage": 1, "offload_misses_optimizer_state": 1, "offload_reallocates_host": 2}


class UsageError(McoreCompatError, ValueError):
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
        sequence_parallel: Megatron's sequence parallelism (needs tp > 1); ``None`` = on when tp > 1.
        tie_embeddings: GPT input embedding and output layer share one weight (Megatron-LM's default); at
            pp > 1 the first and last stage each hold a copy, kept equal by ``finalize_model_grads``.
        vpp: virtual pipeline stages (model chunks) per pipeline rank; ``None`` = 1 (needs pp > 1).
        overlap: ``overlap_grad_reduce`` and, with the distributed optimizer, ``overlap_param_gather``.
        experts: MoE experts per MoE layer (0 = dense GPT); ``ep`` = expert-parallel size (default 1).
        weight_decay: decoupled weight decay of the weights; biases and norms (1-D params) get none, as
            Megatron-LM sets the groups.
        clip_grad: global gradient-norm clipping threshold (0 = off).
        decoupled_weight_decay: Adam's weight decay decoupled (AdamW: ``p*(1 - lr*wd)``) or, when ``False``, L2
            decay through the moments (``g + wd*p`` enters them; needs an ``OptimizerConfig`` with the field,
            0.15+).
        grad_reduce_in_fp32: keep and reduce gradients in fp32; ``None`` = on for bf16.
        offload_cycles: offload/reload cycles (:func:`mcore_compat.offload`, :func:`mcore_compat.reload`)
            between the steps, each proved (memory freed, everything back in place, host buffers reused) and
            followed by a verified step; even cycles move params, grads and optimizer state, odd ones keep the
            params (needs steps >= 2; :func:`~.runner.standard_sweep` runs 2).
        dropout: the GPT's hidden and attention dropout probability (0 = off, the default); the gradient
            reference replays the real step's random state, so it draws the same masks.
        bias: the GPT's linear layers have biases (``add_bias_linear``; off by default). With a tied embedding
            and the distributed optimizer on 0.7-0.12 some sizes are refused before anything is built
            (:mod:`mcore_compat.training.tied_buckets`); the standard sweep's PP configuration uses biases.
        loss_scale: a constant loss scale (``OptimizerConfig.loss_scale``; ``None`` = none): with bf16 the
            release's optimizer then multiplies the loss by it and unscales the gradients inside its step, as it
            does for fp16; the checks compare against the reference with the same scale.
        finite_differences: also check the second step's gradients against the forward alone
            (:mod:`.directional`: ``grads_match_directional_derivatives``, ``loss_matches_float64``; off by
            default: a float64 copy of the model, one float64 backward and nine float64 forwards of the step).
            Runs through pipeline stages and with MoE experts (the routing held at the step's choices); not
            applicable with TransformerEngine layers, context parallelism or dropout the float64 copy cannot
            replay, each report saying why.
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
    sequence_parallel: bool | None = None
    tie_embeddings: bool = True
    vpp: int | None = None
    overlap: bool = False
    experts: int = 0
    ep: int | None = None
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    decoupled_weight_decay: bool = True
    grad_reduce_in_fp32: bool | None = None
    offload_cycles: int = 0
    dropout: float = 0.0
    bias: bool = False
    loss_scale: float | None = None
    finite_differences: bool = False

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
        if self.fault in ("rebind_after_bind", "stale_binding", "gather_full_wrong_stride") and not self.bind:
            raise UsageError(f"fault {self.fault} needs bind=True (--bind)")
        if self.offload_cycles < 0:
            raise UsageError(f"--offload-cycles must be >= 0, got {self.offload_cycles}")
        if self.offload_cycles and self.steps < 2:
            raise UsageError("--offload-cycles needs --steps >= 2 (a verified step follows every reload)")
        need = _OFFLOAD_FAULTS.get(self.fault or "", 0)
        if self.offload_cycles < need:
            raise UsageError(f"fault {self.fault} needs --offload-cycles >= {need}")
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
        sp = self.sequence_parallel if self.sequence_parallel is not None else tp > 1
        if sp and tp < 2:
            raise UsageError("--sequence-parallel needs --tp >= 2")
        vpp = self.vpp or 1
        if vpp < 1 or (vpp > 1 and pp < 2):
            raise UsageError(f"--vpp {vpp} needs --pp >= 2 (virtual stages split each pipeline rank's layers)")
        ep = self.ep or 1
        if self.experts < 0 or ep < 1:
            raise UsageError(f"--experts must be >= 0 and --ep >= 1, got experts={self.experts} ep={ep}")
        if ep > 1 and (not self.experts or self.experts % ep or (tp * dp) % ep):
            raise UsageError(f"--ep {ep} needs --experts divisible by it and dividing tp*dp = {tp * dp}")
        if self.experts and self.model != "gpt":
            raise UsageError("--experts needs --model gpt")
        if not 0.0 <= self.dropout < 1.0:
            raise UsageError(f"--dropout must be in [0, 1), got {self.dropout}")
        if self.dropout and self.model != "gpt":
            raise UsageError("--dropout needs --model gpt")
        if self.loss_scale is not None and not self.loss_scale > 0:
            raise UsageError(f"loss_scale must be > 0, got {self.loss_scale}")
        if self.weight_decay < 0 or self.clip_grad < 0 or self.lr < 0:
            raise UsageError("--lr, --weight-decay and --clip-grad must be >= 0")
        fp32_grads = self.grad_reduce_in_fp32 if self.grad_reduce_in_fp32 is not None else self.dtype == "bf16"
        return replace(self, tp=tp, pp=pp, dp=dp, device=device, sequence_parallel=sp, vpp=vpp, ep=ep,
                       grad_reduce_in_fp32=fp32_grads)

    def label(self) -> str:
        """A short name of the configuration, e.g. ``tp2-sp-pp1-distopt-bf16`` (parallel sizes as given)."""
        parts = [f"tp{self.tp or 1}"]
        if self.sequence_parallel or (self.sequence_parallel is None and (self.tp or 1) > 1):
            parts.append("sp")
        parts.append(f"pp{self.pp or 1}")
        if (self.vpp or 1) > 1:
            parts.append(f"vpp{self.vpp}")
        if self.experts:
            parts.append(f"moe{self.experts}-ep{self.ep or 1}")
        if self.dropout:
            parts.append(f"drop{self.dropout:g}")
        if self.bias:
            parts.append("bias")
        if self.loss_scale:
            parts.append(f"ls{self.loss_scale:g}")
        if self.overlap:
            parts.append("overlap")
        parts.append("distopt" if self.distributed_optimizer else "plain")
        parts.append(self.dtype)
        return "-".join(parts)

    def as_dict(self) -> dict[str, Any]:
        """The options as a plain dict (for reports)."""
        return asdict(self)
