"""Rank functions for ``tests/test_legacy_optimizer.py`` (run on gloo ranks by ``mcore_compat.launch.spawn``).

Every scenario trains a small model for ``STEPS`` steps with :func:`build_legacy_optimizer` and, on each rank, the
same steps on an unsharded plain-PyTorch copy (same init, same global batch) with ``torch.optim.AdamW`` +
``clip_grad_norm_``; it returns the max abs difference, both grad norms per step and the final full params (so
the caller can check that ranks agree). Results are plain Python values: tensors sent through the result queue
would be shared by file descriptor and can vanish when the child exits.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from mcore_compat.legacy_optimizer import build_legacy_optimizer

STEPS = 2
LR = 1e-2


def _config(dtype: torch.dtype, distributed: bool) -> SimpleNamespace:
    return SimpleNamespace(optimizer="adam", lr=LR, min_lr=0.0, weight_decay=0.1, bf16=dtype == torch.bfloat16,
                           fp16=False, params_dtype=dtype, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                           use_distributed_optimizer=distributed, clip_grad=1.0, log_num_zeros_in_grad=True)


def _data(world_batch: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(STEPS, world_batch, 6, generator=g), 5.0 * torch.randn(STEPS, world_batch, 4, generator=g)


def _full_init() -> dict[str, torch.Tensor]:
    """The unsharded init of the 6 -> 8 -> 4 MLP + LayerNorm used by every scenario."""
    g = torch.Generator().manual_seed(42)
    return {"fc1.weight": 0.3 * torch.randn(8, 6, generator=g), "fc1.bias": 0.1 * torch.randn(8, generator=g),
            "fc2.weight": 0.3 * torch.randn(4, 8, generator=g), "fc2.bias": 0.1 * torch.randn(4, generator=g),
            "norm.weight": 1.0 + 0.1 * torch.randn(4, generator=g), "norm.bias": 0.1 * torch.randn(4, generator=g)}


def _forward(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(torch.nn.functional.linear(x, p["fc1.weight"], p["fc1.bias"]))
    y = torch.nn.functional.linear(h, p["fc2.weight"], p["fc2.bias"])
    return torch.nn.functional.layer_norm(y, (4,), p["norm.weight"], p["norm.bias"])


def _reference(dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain PyTorch: the full model in ``dtype``, fp32 AdamW masters, full global batch each step."""
    model = {k: v.to(dtype).requires_grad_() for k, v in _full_init().items()}
    masters = {k: v.detach().float().clone() for k, v in model.items()}
    opt = torch.optim.AdamW([{"params": [masters[k] for k in masters if masters[k].dim() > 1], "weight_decay": 0.1},
                             {"params": [masters[k] for k in masters if masters[k].dim() == 1], "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=1e-8)
    xs, ys = _data()
    norms = []
    for step in range(STEPS):
        loss = torch.nn.functional.mse_loss(_forward(model, xs[step].to(dtype)).float(), ys[step])
        grads = torch.autograd.grad(loss, list(model.values()))
        for k, g in zip(model, grads, strict=True):
            masters[k].grad = g.float()
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(masters.values()), 1.0)))
        opt.step()
        with torch.no_grad():
            for k in model:
                model[k].copy_(masters[k])
    return {k: v.detach().float() for k, v in model.items()}, norms


# ----------------------------------------------------------------------------------------------- plain torch (no megatron)
class _PlainMLP(torch.nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1, self.fc2, self.norm = torch.nn.Linear(6, 8), torch.nn.Linear(8, 4), torch.nn.LayerNorm(4)
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(_full_init()[name])
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _forward(dict(self.named_parameters()), x)


def plain_data_parallel(configs: list[tuple[str, bool]]) -> dict[str, Any]:
    """DP over the whole world without megatron: grads mean-all-reduced into fp32 ``main_grad`` by hand."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for dtype_name, distributed in configs:
        dtype = getattr(torch, dtype_name)
        model = _PlainMLP(dtype)
        opt = build_legacy_optimizer(_config(dtype, distributed), [model])
        xs, ys = _data()
        local = xs.shape[1] // world
        norms = []
        for step in range(STEPS):
            x, y = xs[step, rank * local : (rank + 1) * local], ys[step, rank * local : (rank + 1) * local]
            torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y).backward()
            for p in model.parameters():
                p.main_grad = p.grad.float() / world
                dist.all_reduce(p.main_grad)
            ok, norm, _ = opt.step()
            assert ok
            norms.append(norm)
            opt.zero_grad()
        ref, ref_norms = _reference(dtype)
        got = {k: v.detach().float() for k, v in model.named_parameters()}
        out[f"{dtype_name}-do{int(distributed)}"] = {
            "diff": max(float((got[k] - ref[k]).abs().max()) for k in ref), "norms": norms, "ref_norms": ref_norms,
            "params": torch.cat([got[k].flatten() for k in sorted(got)]).tolist()}
    return out


# ----------------------------------------------------------------------------------------------- real megatron 0.4/0.5
def _cpu_patches() -> None:
    """Make megatron's DDP allocate on CPU (our patches package when it has a 'cpu' set, else the bare fix)."""
    try:
        from mcore_compat import patches  # type: ignore[attr-defined]

        # the same purposes as every other module on the session's shared ranks (before megatron is imported)
        patches.apply_for_device("cpu")
    except Exception:
        pass
    try:
        torch.cuda.current_device()
    except Exception:
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]


class _TPMLP(torch.nn.Module):
    """fc1 = ColumnParallelLinear, fc2 = RowParallelLinear, norm = LayerNorm (TP-duplicated), init = _full_init."""

    def __init__(self, mp_config: Any, tp_rank: int, tp: int) -> None:
        from megatron.core import tensor_parallel

        super().__init__()
        full, dtype = _full_init(), mp_config.params_dtype
        self.fc1 = tensor_parallel.ColumnParallelLinear(6, 8, config=mp_config, init_method=torch.nn.init.zeros_,
                                                        bias=True, gather_output=False)
        self.fc2 = tensor_parallel.RowParallelLinear(8, 4, config=mp_config, init_method=torch.nn.init.zeros_,
                                                     bias=True, input_is_parallel=True, skip_bias_add=False)
        self.norm = torch.nn.LayerNorm(4, dtype=dtype)
        rows = slice(tp_rank * 8 // tp, (tp_rank + 1) * 8 // tp)
        with torch.no_grad():
            self.fc1.weight.copy_(full["fc1.weight"][rows])
            self.fc1.bias.copy_(full["fc1.bias"][rows])
            self.fc2.weight.copy_(full["fc2.weight"][:, rows])
            for name in ("fc2.bias", "norm.weight", "norm.bias"):
                self.get_parameter(name).copy_(full[name])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.fc1(x)
        y, _ = self.fc2(torch.tanh(h))
        return self.norm(y)

    def full_params(self, tp_group: Any, tp: int) -> dict[str, torch.Tensor]:
        """The unsharded params (fp32), gathered over the tensor-parallel group."""
        out = {}
        for name, p in self.named_parameters():
            t = p.detach().float()
            if name.startswith("fc1.") or name == "fc2.weight":
                parts = [torch.empty_like(t) for _ in range(tp)]
                dist.all_gather(parts, t.contiguous(), group=tp_group)
                t = torch.cat(parts, dim=1 if name == "fc2.weight" else 0)
            out[name] = t
        return out


def megatron_all(configs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each config: ``tp``, ``dtype``, ``distributed``, ``overlap`` (with bucket_size 20: several buckets),
    ``bf16_grads`` (grad buffer in the param dtype instead of fp32: bf16 reduce-scatter and all-gather)."""
    _cpu_patches()
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.model_parallel_config import ModelParallelConfig

    out = {}
    for cfg in configs:
        tp, dtype, distributed = cfg["tp"], getattr(torch, cfg["dtype"]), cfg["distributed"]
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        try:
            tp_rank, dp_rank, dp = (ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(),
                                    ps.get_data_parallel_world_size())
            mp_config = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True,
                                            params_dtype=dtype, bf16=dtype == torch.bfloat16)
            model = DistributedDataParallel(mp_config, _TPMLP(mp_config, tp_rank, tp), ps.get_data_parallel_group(),
                                            accumulate_allreduce_grads_in_fp32=not cfg.get("bf16_grads", False),
                                            overlap_grad_reduce=cfg.get("overlap", False),
                                            use_distributed_optimizer=distributed, bucket_size=20)
            opt = build_legacy_optimizer(_config(dtype, distributed), [model])
            xs, ys = _data()
            local = xs.shape[1] // dp
            norms = []
            for step in range(STEPS):
                model.zero_grad_buffer(True)
                opt.zero_grad()
                x, y = xs[step, dp_rank * local : (dp_rank + 1) * local], ys[step, dp_rank * local : (dp_rank + 1) * local]
                torch.nn.functional.mse_loss(model(x[None].to(dtype))[0].float(), y).backward()  # [s=1, b, h]
                model.finish_grad_sync()
                ok, norm, _ = opt.step(None, None)
                assert ok
                norms.append(norm)
            ref, ref_norms = _reference(dtype)
            got = model.module.full_params(ps.get_tensor_model_parallel_group(), tp)
            name = (f"tp{tp}-dp{dp}-{cfg['dtype']}-do{int(distributed)}" + ("-buckets" if cfg.get("overlap") else "")
                    + ("-bf16grads" if cfg.get("bf16_grads") else ""))
            out[name] = {"diff": max(float((got[k] - ref[k]).abs().max()) for k in ref), "norms": norms,
                         "ref_norms": ref_norms, "params": torch.cat([got[k].flatten() for k in sorted(got)]).tolist(),
                         "buckets": sum(len(b.buckets) for b in model.grad_buffers.values())}
        finally:
            ps.destroy_model_parallel()
    return out
