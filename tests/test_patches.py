"""Tests of the runtime patches.

Unit tests run without megatron-core (they pass ``version=`` explicitly). Tests marked ``mcore`` need the real
release on ``sys.path``: each reproduces its upstream bug first (the patch must be what makes it pass), and skips
when the installed release is outside the bug's range.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from packaging.version import Version

from mcore_compat import patches
from mcore_compat.errors import PatchError, PatchRefusedError


@pytest.fixture(autouse=True)
def _clean_registry() -> Iterator[None]:
    """Every test starts and ends with nothing applied."""
    patches.revert_all()
    yield
    patches.revert_all()


_STUB_ROOTS = ("apex", "amp_C", "transformer_engine")


def _snapshot() -> dict[str, object]:
    import torch.cuda.random as cuda_random

    return {
        "current_device": torch.cuda.current_device,
        "synchronize": torch.cuda.synchronize,
        "current_stream": torch.cuda.current_stream,
        "get_rng_state": torch.cuda.get_rng_state,
        "set_rng_state": torch.cuda.set_rng_state,
        "manual_seed": torch.cuda.manual_seed,
        "random.get_rng_state": cuda_random.get_rng_state,
        "random.manual_seed": cuda_random.manual_seed,
        "Tensor.__dict__": dict(vars(torch.Tensor)),
        "stub_modules": {m for m in sys.modules if m.split(".")[0] in _STUB_ROOTS},
        "meta_path": list(sys.meta_path),
        "env": os.environ.get("TORCH_CUDA_ARCH_LIST"),
        "modes": torch._C._len_torch_function_stack(),
    }


# ------------------------------------------------------------------------------------------ registry behaviour
@pytest.mark.unit
def test_refuses_outside_range_and_names_the_range() -> None:
    with pytest.raises(PatchError, match=r"0\.6 <= v < 0\.7.*not to 0\.7\.0"):
        patches.apply("fp32opt_abstract", version="0.7.0")
    with pytest.raises(PatchError, match=r"0\.4 <= v < 0\.10"):
        patches.apply("apex", version="0.10.0")
    assert patches.applied() == []


@pytest.mark.unit
@pytest.mark.parametrize("version", ["0.10.0", "0.12.3", "0.16.1", "0.19.2", "0.20.0rc1"])
def test_apex_stub_never_on_010_plus(version: str) -> None:
    assert "apex" not in [p.name for p in patches.applicable(version=version)]
    assert patches.apply_for("apex_less", version=version) == []
    assert "apex" not in sys.modules or importlib.util.find_spec("apex") is not None


@pytest.mark.unit
def test_ranges_per_release() -> None:
    def names(v: str) -> list[str]:
        return [p.name for p in patches.applicable("cpu", version=v)]

    assert "te_stub" in names("0.7.0") and "te_stub" not in names("0.8.0")
    assert "tensor_cuda" in names("0.7.0") and "tensor_cuda" not in names("0.6.0") + names("0.8.0")
    assert "fp8_noop" in names("0.12.0") and "fp8_noop" not in names("0.11.0") + names("0.13.0")
    assert "cuda_arch_env" in names("0.15.3") and "cuda_arch_env" not in names("0.16.0")
    assert "fp32opt_abstract" in names("0.6.0") and "fp32opt_abstract" not in names("0.7.0")
    assert "cuda_stream" in names("0.19.0") and "cuda_stream" not in names("0.18.2")
    for v in ("0.4.0", "0.10.0", "0.19.2"):
        assert {"cuda_device", "rng"} <= set(names(v))


# --------------------------------------------------------------------------------------- exact undo, one by one
@pytest.mark.unit
def test_cuda_device_apply_revert() -> None:
    before = _snapshot()
    patches.apply("cuda_device", version="0.16.1")
    assert torch.cuda.current_device() == "cpu"
    assert torch.zeros(2, device=torch.cuda.current_device()).device.type == "cpu"
    patches.revert("cuda_device")
    assert _snapshot() == before


@pytest.mark.unit
def test_tensor_type_apply_revert() -> None:
    before = _snapshot()
    assert "type" not in vars(torch.Tensor)  # inherited from TensorBase
    patches.apply("tensor_type", version="0.16.1")
    assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
    assert torch.nn.Parameter(torch.zeros(1, dtype=torch.bfloat16)).type() == "torch.cuda.BFloat16Tensor"
    assert torch.zeros(1).type(torch.float64).dtype == torch.float64  # with arguments: unchanged
    assert torch.zeros(1).type("torch.cuda.HalfTensor").dtype == torch.float16  # stays on CPU
    patches.revert("tensor_type")
    assert "type" not in vars(torch.Tensor)
    assert torch.zeros(1).type() == "torch.FloatTensor"
    assert _snapshot() == before


@pytest.mark.unit
def test_cuda_stream_apply_revert() -> None:
    before = _snapshot()
    old = (torch.cuda.current_stream, torch.cuda.default_stream)
    patches.apply("cuda_stream", version="0.19.2")
    stream = torch.cuda.current_stream()
    stream.wait_event(object())
    stream.wait_stream(torch.cuda.default_stream())
    patches.revert("cuda_stream")
    assert (torch.cuda.current_stream, torch.cuda.default_stream) == old
    assert _snapshot() == before


@pytest.mark.unit
def test_tensor_cuda_apply_revert() -> None:
    before = _snapshot()
    patches.apply("tensor_cuda", version="0.7.0")
    t = torch.zeros(1)
    assert t.cuda() is t
    patches.revert("tensor_cuda")
    assert _snapshot() == before


@pytest.mark.unit
def test_cuda_factory_apply_revert() -> None:
    before = _snapshot()
    patches.apply("cuda_factory", version="0.16.1")
    assert torch.tensor([0], dtype=torch.int, device="cuda").device.type == "cpu"
    assert torch.zeros(3, device=torch.device("cuda", 0)).device.type == "cpu"
    assert torch.empty(2, device=0).device.type == "cpu"
    t = torch.ones(2)
    assert t.to("cuda").device.type == "cpu"
    assert t.to(torch.device("cuda"), torch.float64).dtype == torch.float64
    assert t.to(device="cuda:0").device.type == "cpu"
    assert t.cuda().device.type == "cpu"
    # Known limit: torch does not keep function modes active inside autograd backward hooks (measured, torch
    # 2.13), so a hook creating device="cuda" tensors is not rewritten. Megatron's DDP hooks do not (0.4-0.19).
    w = torch.ones(2, requires_grad=True)
    seen: list[int] = []
    w.register_hook(lambda g: seen.append(torch._C._len_torch_function_stack()) or g)
    (w * 2).sum().backward()
    assert len(seen) == 1
    patches.revert("cuda_factory")
    assert _snapshot() == before


@pytest.mark.unit
def test_cuda_factory_revert_keeps_other_modes() -> None:
    from torch.overrides import TorchFunctionMode

    class Other(TorchFunctionMode):
        pass

    patches.apply("cuda_factory", version="0.16.1")
    with Other():  # entered after ours: ours is not on top when reverted
        patches.revert("cuda_factory")
        stack = torch.overrides._get_current_function_mode_stack()
        assert [type(m).__name__ for m in stack] == ["Other"]
    assert torch._C._len_torch_function_stack() == 0


@pytest.mark.unit
def test_own_tensor_math_sets_the_cuda_factory_mode_aside_and_puts_it_back() -> None:
    """mcore_compat's own tensor math runs without the mode (no per-call Python dispatch); Megatron's code keeps
    it. Set aside only when the mode is this thread's innermost one; restored on exceptions; no-op unapplied."""
    from torch.overrides import TorchFunctionMode

    from mcore_compat._util.own_math import own_tensor_math

    @own_tensor_math
    def depth() -> int:
        return torch._C._len_torch_function_stack()

    @own_tensor_math
    def fails() -> None:
        raise ValueError("inside")

    assert depth() == 0  # not applied: nothing to set aside
    patches.apply("cuda_factory", version="0.16.1")
    try:
        assert depth() == 0 and torch._C._len_torch_function_stack() == 1
        with pytest.raises(ValueError):
            fails()
        assert torch._C._len_torch_function_stack() == 1
        assert torch.zeros(1, device="cuda").device.type == "cpu"  # the mode is back and works

        class Other(TorchFunctionMode):
            pass

        with Other():  # another mode above ours: left alone (the block sees both)
            assert depth() == 2
    finally:
        patches.revert("cuda_factory")
    assert torch._C._len_torch_function_stack() == 0


@pytest.mark.unit
def test_rng_apply_revert_and_semantics() -> None:
    before = _snapshot()
    patches.apply("rng", version="0.16.1")
    torch.cuda.manual_seed(7)
    state = torch.cuda.get_rng_state()
    a = torch.rand(3)
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.rand(3), a)
    torch.manual_seed(7)
    assert torch.equal(torch.rand(3), a)  # it is the CPU generator
    # the megatron hook waits in sys.meta_path until megatron.core.tensor_parallel.random is imported
    assert len(sys.meta_path) == len(before["meta_path"]) + (
        0 if "megatron.core.tensor_parallel.random" in sys.modules else 1
    )
    patches.revert("rng")
    assert _snapshot() == before


@pytest.mark.unit
def test_cuda_arch_env_apply_revert(monkeypatch: pytest.MonkeyPatch) -> None:
    from mcore_compat.patches import cpu

    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    undo = cpu._apply_cuda_arch_env()  # apply_fn directly: the check needs a 0.15 source tree
    assert os.environ["TORCH_CUDA_ARCH_LIST"]
    undo()
    assert "TORCH_CUDA_ARCH_LIST" not in os.environ
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0")
    assert not cpu._cuda_arch_env_needed()
    undo = cpu._apply_cuda_arch_env()
    undo()
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0"


@pytest.mark.unit
@pytest.mark.skipif(importlib.util.find_spec("apex") is not None, reason="real apex installed")
def test_apex_stub_apply_revert() -> None:
    before = _snapshot()
    patches.apply("apex", version="0.9.0")
    import amp_C
    from apex.multi_tensor_apply import multi_tensor_applier
    from apex.normalization.fused_layer_norm import FusedLayerNormAffineFunction
    from apex.optimizers import FusedAdam, FusedSGD

    assert issubclass(FusedAdam, torch.optim.AdamW) and issubclass(FusedSGD, torch.optim.SGD)
    with pytest.raises(ModuleNotFoundError):
        import apex.contrib.layer_norm.layer_norm  # noqa: F401  (optional fused paths stay off)
    ts = [torch.tensor([3.0, 4.0]), torch.tensor([12.0])]
    flag = torch.zeros(1, dtype=torch.int)
    norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [ts], False)
    assert torch.allclose(norm, torch.tensor([13.0]))
    out = [torch.zeros(2), torch.zeros(1)]
    multi_tensor_applier(amp_C.multi_tensor_scale, flag, [ts, out], 0.5)
    assert out[1].item() == 6.0 and flag.item() == 0
    multi_tensor_applier(amp_C.multi_tensor_scale, flag, [[torch.tensor([float("inf")])], [torch.zeros(1)]], 1.0)
    assert flag.item() == 1
    x, w, b = torch.randn(2, 4), torch.randn(4), torch.randn(4)
    assert torch.allclose(
        FusedLayerNormAffineFunction.apply(x, w, b, 4, 1e-5), torch.nn.functional.layer_norm(x, (4,), w, b)
    )
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    FusedAdam([p], lr=0.1).step()
    assert not torch.equal(p.detach(), torch.ones(2))
    patches.revert("apex")
    assert _snapshot() == before
    assert importlib.util.find_spec("apex") is None


@pytest.mark.unit
@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="real TE installed")
def test_te_stub_apply_revert() -> None:
    before = _snapshot()
    patches.apply("te_stub", version="0.7.0")
    import transformer_engine as te

    assert importlib.metadata.version("transformer-engine") == "0.0.0"
    assert importlib.metadata.version("transformer_engine") == "0.0.0"
    ln = te.pytorch.LayerNorm(hidden_size=8, eps=1e-5, sequence_parallel=True, params_dtype=torch.float32)
    assert ln.weight.sequence_parallel is True
    x = torch.randn(2, 8)
    assert torch.allclose(ln(x), torch.nn.functional.layer_norm(x, (8,)))
    zc = te.pytorch.RMSNorm(hidden_size=8, zero_centered_gamma=True)
    assert zc(x).shape == x.shape
    with pytest.raises(RuntimeError, match="te_stub"):
        te.pytorch.Linear(4, 4)

    class Sub(te.pytorch.DotProductAttention):  # megatron subclasses these at import time
        pass

    with pytest.raises(ModuleNotFoundError):
        import transformer_engine.pytorch.attention  # noqa: F401  (megatron falls back when it is absent)
    patches.revert("te_stub")
    assert _snapshot() == before
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("transformer-engine")


@pytest.mark.unit
def test_before_import_patch_refused_after_megatron_import(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    monkeypatch.setitem(sys.modules, "megatron.core", types.ModuleType("megatron.core"))
    with pytest.raises(PatchError, match=r"before `megatron\.core` is imported"):
        patches.apply("te_stub", version="0.7.0")


# ------------------------------------------------------------------------------------------------- apply_for
@pytest.mark.unit
def test_apply_for_order_and_idempotence() -> None:
    before = _snapshot()
    # The stand-ins come in only where the real package is missing (needed_when, evaluated in this process).
    stubs = [n for n, pkg in (("apex", "apex"), ("te_stub", "transformer_engine")) if not importlib.util.find_spec(pkg)]
    first = patches.apply_for("cpu", version="0.7.0")
    # tensor_cuda is skipped: cuda_factory covers Tensor.cuda(); cuda_arch_env is 0.15 only; moe_histc_cpu is
    # the MoE dispatchers' torch.histc on 0.5-0.9.
    expected = ["cuda_device", "cuda_factory", "tensor_type", "rng", "cuda_sync", "moe_histc_cpu", *stubs]
    assert first == expected
    assert patches.applied() == first
    assert patches.apply_for("cpu", version="0.7.0") == []  # second call: nothing new
    assert patches.applied() == first
    patches.revert_all()
    assert _snapshot() == before


@pytest.mark.unit
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_apply_for_device_is_apply_for_of_its_purposes(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a run on a device applies: the CPU harness only on a CPU, the rest everywhere."""
    from mcore_compat.patches import _registry

    purposes = patches.purposes_for_device(device)
    assert ("cpu" in purposes) is (device == "cpu")
    assert {"apex_less", "te_less", "upstream_bug"} <= set(purposes)
    calls: list[tuple[tuple[str, ...], object]] = []
    monkeypatch.setattr(_registry, "apply_for", lambda *p, version=None: calls.append((p, version)) or ["x"])
    assert patches.apply_for_device(device, version="0.7.0") == ["x"]
    assert calls == [(purposes, "0.7.0")]


@pytest.mark.unit
def test_apply_for_device_refuses_an_unknown_device() -> None:
    with pytest.raises(PatchError, match="'cpu' or 'cuda'"):
        patches.apply_for_device("tpu")
    assert patches.applied() == []


@pytest.mark.unit
def test_patched_context_manager_reverts() -> None:
    before = _snapshot()
    te_less = ["moe_local_spec_te_names"] if not importlib.util.find_spec("transformer_engine") else []
    with patches.patched("cpu", version="0.10.0") as names:
        assert names == ["cuda_device", "cuda_factory", "tensor_type", "rng", "cuda_sync", *te_less]
        assert torch.cuda.current_device() == "cpu"
    assert patches.applied() == []
    assert _snapshot() == before


@pytest.mark.unit
def test_apply_for_purpose_filter() -> None:
    assert patches.apply_for("te_less", version="0.16.1") == []
    names = [p.name for p in patches.applicable("apex_less", version="0.6.0")]
    assert names == ["apex"]
    assert [p.name for p in patches.applicable("upstream_bug", version="0.12.3")] == ["fp8_noop",
                                                                                       "stale_embedding_ranks"]
    assert [p.name for p in patches.applicable("upstream_bug", version="0.13.0")] == ["moe_te_gemm_name"]
    assert [p.name for p in patches.applicable("upstream_bug", version="0.17.0")] == []


# ============================================================================ with a real megatron-core (mcore)
# Each scenario runs in a fresh interpreter: patches such as the apex / TE stand-ins must be applied before
# `megatron.core` is imported, which another test in this process may already have done.

_SCENARIO_LIB = r"""
import dataclasses, inspect, json, socket, sys
import torch
from mcore_compat import patches

def cpu_patches_without(*names):
    done = []
    for p in patches.applicable("cpu"):
        if p.name in names or (p.needed_when is not None and not p.needed_when()):
            continue
        if patches.apply(p.name):
            done.append(p.name)
    return done

def world1():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel()

def ddp_linear(use_distributed_optimizer):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True)
    class Linear(MegatronModule):
        def __init__(self):
            super().__init__(config)
            init = torch.nn.init.xavier_normal_
            self.l1 = ColumnParallelLinear(8, 16, config=config, init_method=init, bias=True, gather_output=False)
            self.l2 = RowParallelLinear(16, 8, config=config, init_method=init, bias=True, input_is_parallel=True,
                                        skip_bias_add=False)
        def forward(self, x):
            return self.l2(torch.relu(self.l1(x)[0]))[0]
    sig = inspect.signature(DistributedDataParallel.__init__).parameters
    if "ddp_config" not in sig:  # 0.6
        return DistributedDataParallel(config, Linear(), data_parallel_group=ps.get_data_parallel_group(),
                                       accumulate_allreduce_grads_in_fp32=True, overlap_grad_reduce=False,
                                       use_distributed_optimizer=use_distributed_optimizer)
    from megatron.core.distributed import DistributedDataParallelConfig
    names = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    kw = {"grad_reduce_in_fp32": True, "use_distributed_optimizer": use_distributed_optimizer}
    ddp_config = DistributedDataParallelConfig(**{k: v for k, v in kw.items() if k in names})
    extra = {"data_parallel_group": ps.get_data_parallel_group()} if "data_parallel_group" in sig else {}
    return DistributedDataParallel(config, ddp_config, Linear(), **extra)

def optimizer(model, use_distributed_optimizer):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    cfg = OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=use_distributed_optimizer)
    return get_megatron_optimizer(cfg, [model])

def train_step(model, opt):
    from megatron.core.distributed import finalize_model_grads
    params = list(model.module.parameters())
    before = [p.detach().clone() for p in params]
    model.zero_grad_buffer()
    opt.zero_grad()
    model(torch.randn(4, 2, 8)).pow(2).mean().backward()
    finalize_model_grads([model])
    opt.step()
    return sum(int(not torch.equal(b, p.detach())) for b, p in zip(before, params)), len(params)

def attempt(fn):
    try:
        return ["ok", fn()]
    except Exception as exc:
        return [type(exc).__name__, str(exc)[:300]]
"""


def _run_code(code: str) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter; it prints its result as ``RESULT=<json>``, which is returned."""
    import json
    import subprocess

    import mcore_compat

    # The child must import the same mcore_compat (and megatron) as this process: its root first, then sys.path.
    root = os.path.dirname(os.path.dirname(os.path.abspath(mcore_compat.__file__)))
    path = os.pathsep.join([root, *(p for p in sys.path if p)])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT=")]
    assert lines, f"scenario failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}"
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT=") :])
    return result


def _run_scenario(body: str) -> dict[str, Any]:
    """Run ``body`` (after the helpers above) in a fresh interpreter; it must set ``out`` (a JSON-able dict)."""
    import textwrap

    return _run_code(_SCENARIO_LIB + textwrap.dedent(body) + "\nprint('RESULT=' + json.dumps(out))\n")


def _skip_unless_bug_exists(patch: str) -> None:
    """Skip (a release limit) unless the installed release has the upstream bug ``patch`` fixes."""
    from mcore_compat._facts.ranges import range_text
    from mcore_compat.detect import detect

    version = detect().version
    if not patches.get(patch).applies_to(version):
        pytest.skip(f"release limit: megatron-core {version} does not have the bug that {patch!r} fixes (it exists "
                    f"in {range_text(patches.get(patch).versions)})")


def _skip_unless_core_optimizer() -> None:
    """Skip (a release limit) on releases without ``megatron.core.optimizer``."""
    from mcore_compat.capabilities import has
    from mcore_compat.detect import detect

    version = detect().version
    if not has("core_optimizer", version):
        pytest.skip(f"release limit: megatron-core {version} has no megatron.core.optimizer (this test steps "
                    f"Megatron's own optimizer)")


@pytest.mark.mcore
def test_fp32opt_abstract_bug_and_fix() -> None:
    _skip_unless_bug_exists("fp32opt_abstract")
    out = _run_scenario(
        """
        cpu_patches_without("fp32opt_abstract")
        world1()
        model = ddp_linear(False)
        out = {"without": attempt(lambda: optimizer(model, False))}
        patches.apply("fp32opt_abstract")
        out["with"] = attempt(lambda: type(optimizer(model, False)).__name__)
        out["state_dict"] = attempt(lambda: optimizer(model, False).sharded_state_dict({}))
        try:
            optimizer(model, False).sharded_state_dict({})
        except Exception as exc:
            out["state_dict_bases"] = [c.__name__ for c in type(exc).__mro__]
        out["step"] = attempt(lambda: train_step(model, optimizer(model, False)))
        patches.revert("fp32opt_abstract")
        out["reverted"] = attempt(lambda: optimizer(model, False))
        """
    )
    assert out["without"][0] == "TypeError" and "abstract" in out["without"][1]  # the upstream bug, reproduced
    assert out["with"] == ["ok", "FP32Optimizer"]
    assert out["state_dict"][0] == "UnsupportedFeatureError" and "sharded_state_dict" in out["state_dict"][1]
    assert {"NotImplementedError", "McoreCompatError"} <= set(out["state_dict_bases"])  # except NotImplementedError
    assert out["step"] == ["ok", [4, 4]]
    assert out["reverted"][0] == "TypeError"  # undone exactly


@pytest.mark.mcore
def test_fp8_noop_bug_and_fix() -> None:
    _skip_unless_bug_exists("fp8_noop")
    if not patches.get("fp8_noop").needed_when():
        from mcore_compat.detect import detect

        pytest.skip(f"TransformerEngine is installed: megatron-core {detect().version} does not take the no-TE "
                    f"fallback that has the bug")
    out = _run_scenario(
        """
        cpu_patches_without("fp8_noop")
        world1()
        model = ddp_linear(True)
        out = {"without": attempt(lambda: train_step(model, optimizer(model, True)))}
        patches.apply("fp8_noop")
        model = ddp_linear(True)
        out["with"] = attempt(lambda: train_step(model, optimizer(model, True)))
        """
    )
    assert out["without"][0] == "RuntimeError" and "Invalid Transformer Engine version" in out["without"][1]
    assert out["with"] == ["ok", [4, 4]]


# The scenarios that start from the whole CPU set (``patches.apply_for("cpu")``) in a world of one rank share
# ONE fresh interpreter (the module's ``cpu_world``): each body runs in its own function, in this order (the
# stale-embedding one destroys the model-parallel state, so it comes last), and sets ``out``.
_CPU_WORLD: dict[str, str] = {
    "cpu_harness": """
        model = ddp_linear(True)
        out = {"step": attempt(lambda: train_step(model, optimizer(model, True))), "applied": applied}
        """,
    "rng_tracker": """
        from megatron.core import tensor_parallel
        tensor_parallel.model_parallel_cuda_manual_seed(123)
        tracker = tensor_parallel.get_cuda_rng_tracker()
        import logging
        seen = []
        class Seen(logging.Handler):
            def emit(self, record):
                seen.append(record.getMessage())
        logger = logging.getLogger("megatron.core.tensor_parallel.random")
        logger.addHandler(Seen())
        outside = torch.get_rng_state()
        with tracker.fork():
            a = torch.rand(4)
        restored = torch.equal(torch.get_rng_state(), outside)
        with tracker.fork():
            b = torch.rand(4)
        out = {"restored": restored, "advanced": not torch.equal(a, b), "logged": seen}
        patches.revert("rng")  # the filter goes with the patch
        out["filters_after_revert"] = [type(f).__name__ for f in logger.filters]
        patches.apply("rng")
        """,
    "stale_embedding_ranks": """
        from megatron.core import parallel_state as ps

        def after_destroy():
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
            ps.initialize_model_parallel()
            ps.destroy_model_parallel()
            return [ps.is_rank_in_position_embedding_group(),
                    attempt(lambda: ps.get_position_embedding_group())[0]]

        out = {"without": after_destroy()}
        patches.apply("stale_embedding_ranks")
        out["with"] = after_destroy()
        patches.revert("stale_embedding_ranks")
        out["reverted"] = after_destroy()
        """,
}


def _cpu_world_runs(name: str) -> bool:
    """Whether the installed release runs the ``_CPU_WORLD`` scenario ``name`` (its test skips otherwise)."""
    from mcore_compat.capabilities import has
    from mcore_compat.detect import detect

    version = detect().version
    if name == "cpu_harness":
        return has("core_optimizer", version)
    if name == "stale_embedding_ranks":
        return patches.get("stale_embedding_ranks").applies_to(version)
    return True


@pytest.fixture(scope="module")
def cpu_world() -> dict[str, Any]:
    """The ``_CPU_WORLD`` scenarios this release runs, in one fresh interpreter: ``{name: {"out": ...}}``, or
    ``{name: {"error": traceback}}`` for a scenario that raised (the next ones still run)."""
    import textwrap

    code = [_SCENARIO_LIB, 'applied = patches.apply_for("cpu")\nworld1()\nresults = {}\n']
    for name, body in _CPU_WORLD.items():
        if not _cpu_world_runs(name):
            continue
        function = "def _scenario():\n" + textwrap.indent(textwrap.dedent(body).strip() + "\n", "    ") + "    return out\n"
        code.append(f"{function}\ntry:\n    results[{name!r}] = {{'out': _scenario()}}\nexcept Exception:\n"
                    f"    import traceback\n    results[{name!r}] = {{'error': traceback.format_exc()}}\n")
    code.append("print('RESULT=' + json.dumps(results))\n")
    return _run_code("".join(code))


def _cpu_world_out(cpu_world: dict[str, Any], name: str) -> Any:
    """Scenario ``name``'s ``out``; the test fails with its traceback if it raised."""
    assert name in cpu_world, f"the cpu_world run did not include {name!r} (ran: {sorted(cpu_world)})"
    if "error" in cpu_world[name]:
        pytest.fail(f"scenario {name} raised:\n{cpu_world[name]['error']}")
    return cpu_world[name]["out"]


@pytest.mark.mcore
def test_stale_embedding_ranks_bug_and_fix(cpu_world: dict[str, Any]) -> None:
    """destroy_model_parallel() must forget the embedding ranks; before 0.13 it does not (reproduced first)."""
    _skip_unless_bug_exists("stale_embedding_ranks")
    out = _cpu_world_out(cpu_world, "stale_embedding_ranks")
    assert out["without"] == [True, "AssertionError"]  # the upstream bug: "in" a group that no longer exists
    assert out["with"] == [False, "AssertionError"]
    assert out["reverted"] == [True, "AssertionError"]


@pytest.mark.mcore
def test_cpu_harness_trains(cpu_world: dict[str, Any]) -> None:
    """The whole CPU harness: DDP + DistributedOptimizer step moves every parameter (0.6+)."""
    _skip_unless_core_optimizer()
    out = _cpu_world_out(cpu_world, "cpu_harness")
    assert out["step"] == ["ok", [4, 4]], out


@pytest.mark.mcore
def test_rng_tracker_forks_cpu_generator(cpu_world: dict[str, Any]) -> None:
    """With ``rng``, Megatron's CUDA RNG tracker really switches generator states (on the CPU generator)."""
    out = _cpu_world_out(cpu_world, "rng_tracker")
    # a draw inside a fork moves the CPU generator by design here (it is the fork's generator): Megatron's
    # 'CPU RNG state changed within GPU RNG context' (0.9+) is filtered, and only while the patch is applied
    assert out == {"restored": True, "advanced": True, "logged": [], "filters_after_revert": []}, out


# ================================================================================= fingerprints of the targets
_CHANGED_SOURCE = """
def destroy_model_parallel():
    global _EMBEDDING_GLOBAL_RANKS
    _EMBEDDING_GLOBAL_RANKS = None  # upstream now resets it itself: the patch is not written for this code
"""


def _installed_as(monkeypatch: pytest.MonkeyPatch, source: str, where: str = "/site/megatron/core/x.py") -> None:
    """Make every target module of the installed megatron-core read as ``source``."""
    from mcore_compat.patches import _targets

    monkeypatch.setattr(_targets, "_installed_source", lambda module: (source, where))


def _nothing_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """No megatron-core on ``sys.path`` when the patch is applied (its targets are checked when imported)."""
    from mcore_compat.patches import _targets

    def not_installed(module: str) -> Any:
        raise _targets._NotInstalled("no megatron-core on sys.path yet")

    monkeypatch.setattr(_targets, "_installed_source", not_installed)


@pytest.mark.unit
def test_fingerprint_ignores_docstrings_comments_and_layout_not_code() -> None:
    from mcore_compat.patches._targets import fingerprint

    base = 'def f(x, y=1):\n    """Doc."""\n    return x + y\n\nclass C:\n    def m(self):\n        return 1\n'
    same = ('# comment\ndef f(x,\n      y=1):  # more\n    """Other doc."""\n    return (x + y)\n\nclass C:\n'
            '    """Doc."""\n    def m(self):\n        return 1\n')
    assert fingerprint(base, "f") == fingerprint(same, "f") is not None
    assert fingerprint(base, "C.m") == fingerprint(same, "C.m") is not None
    assert fingerprint(base, "f") != fingerprint(base.replace("x + y", "x - y"), "f")
    assert fingerprint(base, "f") != fingerprint(base.replace("y=1", "y=2"), "f")
    assert fingerprint(base, "g") is None and fingerprint(base, "C.n") is None and fingerprint(None, "f") is None
    # definitions inside top-level if/try blocks (Megatron's fallbacks) all count
    cond = "try:\n    import te\n    def f():\n        return 1\nexcept ImportError:\n    def f():\n        return 2\n"
    assert fingerprint(cond, "f") != fingerprint(cond.replace("return 2", "return 3"), "f")
    assert fingerprint(base, None) == fingerprint(same, None) != fingerprint(cond, None)


@pytest.mark.unit
def test_fingerprint_table_covers_each_targeted_patch_per_release() -> None:
    """patches/_fingerprints.py has exactly the targets each patch names, for every matrix release in its range."""
    from mcore_compat.patches._fingerprints import FINGERPRINTS

    from mcore_compat import support

    releases = [str(r.version) for r in support.releases()]
    targeted = {p.name: p for p in patches.list_patches() if p.targets}
    assert set(FINGERPRINTS) == set(targeted)
    for name, patch in targeted.items():
        assert list(FINGERPRINTS[name]) == list(patch.targets), name
        in_range = [v for v in releases if patch.applies_to(v)]
        for target, per_release in FINGERPRINTS[name].items():
            assert list(per_release) == in_range, (name, target)
            assert any(per_release.values()), f"{name}: {target} exists in none of its releases"


@pytest.mark.unit
def test_changed_target_refuses_the_patch(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _snapshot()
    _installed_as(monkeypatch, _CHANGED_SOURCE, "/site/megatron/core/parallel_state.py")
    with pytest.raises(PatchRefusedError) as info:
        patches.apply("stale_embedding_ranks", version="0.12.3")
    message = str(info.value)
    assert "\n" not in message
    for part in ("patch 'stale_embedding_ranks' refused", "megatron.core.parallel_state:destroy_model_parallel",
                 "megatron-core 0.12.3", "/site/megatron/core/parallel_state.py", "scripts/fingerprint_patches.py",
                 "run without the patch"):
        assert part in message, (part, message)
    assert patches.refusal("stale_embedding_ranks", version="0.12.3") == message
    assert patches.applied() == [] and patches.skipped() == {}
    assert _snapshot() == before


@pytest.mark.unit
def test_recorded_target_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same code, recorded for the patch (as the generator records a release's code): applied."""
    from mcore_compat.patches import _fingerprints, _targets

    _installed_as(monkeypatch, _CHANGED_SOURCE)
    table = {t: {"0.12.3": _targets.fingerprint(_CHANGED_SOURCE, _targets.split_target(t)[1])}
             for t in patches.get("stale_embedding_ranks").targets}
    monkeypatch.setitem(_fingerprints.FINGERPRINTS, "stale_embedding_ranks", table)
    assert patches.refusal("stale_embedding_ranks", version="0.12.3") is None
    assert patches.apply("stale_embedding_ranks", version="0.12.3")
    assert patches.applied() == ["stale_embedding_ranks"]


@pytest.mark.unit
def test_apply_for_is_all_or_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused patch (here: a changed target) reverts what the same call applied before it."""
    before = _snapshot()
    _installed_as(monkeypatch, _CHANGED_SOURCE)
    with pytest.raises(PatchRefusedError, match="'rng' refused"):
        patches.apply_for("cpu", version="0.12.3")  # cuda_device, cuda_factory, tensor_type, then rng
    assert patches.applied() == []
    assert _snapshot() == before


@pytest.fixture
def fake_release(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A ``megatron/core`` tree with a changed ``fp8_utils``, to put on ``sys.path`` after applying (no megatron
    module stays imported meanwhile; the real ones come back afterwards)."""
    for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        monkeypatch.delitem(sys.modules, name)
    core = tmp_path / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "__init__.py").write_text("")
    (core / "fp8_utils.py").write_text(
        "def _quantize_param_shard_impl(model_params, *args):\n    raise RuntimeError('changed')\n\n"
        "def quantize_param_shard(model_params, *args):\n    return _quantize_param_shard_impl(model_params)\n")
    _nothing_installed(monkeypatch)
    yield tmp_path
    for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        del sys.modules[name]


def _import_fake_fp8_utils(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    import importlib

    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return importlib.import_module("megatron.core.fp8_utils")


@pytest.mark.unit
def test_target_changed_at_import_undoes_the_patch(fake_release: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Applied before its module is imported, checked again against the loaded file: changed, so undone and
    listed as skipped, not applied."""
    assert patches.apply("fp8_noop", version="0.12.3")
    assert patches.applied() == ["fp8_noop"]
    with pytest.warns(RuntimeWarning, match="'fp8_noop' was not applied"):
        module = _import_fake_fp8_utils(fake_release, monkeypatch)
    assert patches.applied() == []
    assert "megatron.core.fp8_utils:_quantize_param_shard_impl" in patches.skipped()["fp8_noop"]
    assert module._quantize_param_shard_impl.__module__ == "megatron.core.fp8_utils"  # not wrapped
    with pytest.raises(RuntimeError, match="changed"):
        module.quantize_param_shard([])


@pytest.mark.unit
def test_recorded_target_at_import_is_patched(fake_release: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from mcore_compat.patches import _fingerprints, _targets

    source = (fake_release / "megatron" / "core" / "fp8_utils.py").read_text()
    table = {t: {"0.12.3": _targets.fingerprint(source, _targets.split_target(t)[1])}
             for t in patches.get("fp8_noop").targets}
    monkeypatch.setitem(_fingerprints.FINGERPRINTS, "fp8_noop", table)
    assert patches.apply("fp8_noop", version="0.12.3")
    module = _import_fake_fp8_utils(fake_release, monkeypatch)
    assert patches.applied() == ["fp8_noop"] and patches.skipped() == {}
    assert module.quantize_param_shard([]) is None  # the empty call is a no-op now
    patches.revert("fp8_noop")
    with pytest.raises(RuntimeError, match="changed"):
        module.quantize_param_shard([])


@pytest.mark.unit
def test_doctor_reports_skipped_and_refused_patches_as_not_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    from mcore_compat.patches import _registry

    from mcore_compat.cli import doctor

    patches.apply("cuda_sync", version="0.12.3")
    _installed_as(monkeypatch, _CHANGED_SOURCE)
    monkeypatch.setitem(_registry._SKIPPED, "rng", "its target changed")
    rows = {r["name"]: r for r in doctor._patches(Version("0.12.3"))}
    assert rows["cuda_sync"]["applied"] and not rows["cuda_sync"]["refused"]
    assert not rows["rng"]["applied"] and rows["rng"]["skipped"] == "its target changed"
    assert not rows["stale_embedding_ranks"]["applied"]
    assert "destroy_model_parallel" in rows["stale_embedding_ranks"]["refused"]
    lines = doctor.render(_doctor_report(rows), verbose=True).splitlines()
    states = {line.split()[0]: line for line in lines[lines.index(next(ln for ln in lines if
                                                                        ln.startswith("patches for"))) + 1:]}
    assert "APPLIED" in states["cuda_sync"]
    assert "SKIPPED, not applied (its target changed)" in states["rng"] and "APPLIED" not in states["rng"]
    assert "REFUSED (patch 'stale_embedding_ranks' refused" in states["stale_embedding_ranks"]


def _doctor_report(rows: dict[str, Any]) -> dict[str, Any]:
    """The smallest report ``doctor.render`` accepts, with ``rows`` as its patches."""
    return {"mcore_compat": "x", "python": {"version": "3", "executable": "python"}, "torch": {"present": False},
            "apex": {"present": False}, "transformer_engine": {"present": False},
            "megatron_core": {"found": True, "version": "0.12.3", "source": "test", "checkout": True, "path": "/x",
                              "warnings": []},
            "facts": [], "symbols": [], "patches": list(rows.values())}


@pytest.mark.mcore
def test_fingerprint_table_matches_the_installed_release() -> None:
    """Every patch in scope for the installed release finds, for each target, exactly the fingerprint recorded for
    this release (the table was generated from this release's code; nothing here would be refused)."""
    from mcore_compat.patches import _targets
    from mcore_compat.patches._fingerprints import FINGERPRINTS

    from mcore_compat.detect import detect

    version = detect().version
    release = version.public
    checked = []
    for patch in patches.list_patches():
        if not patch.applies_to(version) or not patch.targets:
            continue
        for target in patch.targets:
            fp, where = _targets.installed_fingerprint(target)
            recorded = FINGERPRINTS[patch.name][target]
            assert release in recorded, f"{patch.name}: no fingerprint of {target} for {release}"
            assert fp == recorded[release], (f"{patch.name}: {target} in {where} has fingerprint {fp}, the table "
                                             f"records {recorded[release]} for {release}")
        assert patches.refusal(patch.name) is None
        checked.append(patch.name)
    assert "rng" in checked  # in scope for every release
