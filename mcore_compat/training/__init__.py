"""The training-step API: DDP, optimizer, hooks and schedules with one signature on every Megatron-Core release.

::

    from mcore_compat import training as mt

    model = mt.wrap_ddp(model_chunks, ddp_config=mt.DDPConfig(use_distributed_optimizer=True))
    mt.broadcast_params(model)                     # every DP replica starts from the first rank's weights
    opt = mt.get_megatron_optimizer(mt.OptimConfig(lr=1e-3, bf16=True, use_distributed_optimizer=True), model)
    mt.install_training_hooks(model, opt)          # finalize_model_grads_func & co. on the real config
    mt.zero_grad_buffer(model, opt)
    losses = mt.forward_backward(forward_step, data_iter, model, num_microbatches=4)
    sched = mt.optimizer_param_scheduler(opt, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=10,
                                         lr_decay_steps=1000, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                         wd_incr_steps=1000, wd_incr_style="constant")
    ok, grad_norm, num_zeros = mt.optimizer_step(opt)
    sched.step(1)
"""

from __future__ import annotations

from .broadcast import broadcast_params
from .ddp import DDPConfig, ddp_config_of, wrap_ddp, zero_grad_buffer
from .finalize import (
    MissingTrainingHookError,
    check_training_hooks,
    finalize_model_grads,
    install_training_hooks,
)
from .optim_build import get_megatron_optimizer
from .optim_config import OptimConfig, check_optimizer_config, optimizer_config_of
from .optim_step import optimizer_step, set_lr_and_weight_decay
from .param_groups import effective_lr_and_weight_decay
from .param_sync import finish_param_sync
from .scheduler import ParamScheduler, optimizer_param_scheduler
from .schedules import forward_backward, get_forward_backward_func

__all__ = [
    "DDPConfig",
    "MissingTrainingHookError",
    "OptimConfig",
    "ParamScheduler",
    "broadcast_params",
    "check_optimizer_config",
    "check_training_hooks",
    "ddp_config_of",
    "effective_lr_and_weight_decay",
    "finalize_model_grads",
    "finish_param_sync",
    "forward_backward",
    "get_forward_backward_func",
    "get_megatron_optimizer",
    "install_training_hooks",
    "optimizer_config_of",
    "optimizer_param_scheduler",
    "optimizer_step",
    "set_lr_and_weight_decay",
    "wrap_ddp",
    "zero_grad_buffer",
]
