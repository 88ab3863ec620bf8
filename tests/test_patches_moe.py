"""The MoE patches (patches/moe.py): exact undo, ranges, and on the installed release the bug and the fix.

``moe_te_gemm_name`` is checked in fresh interpreters: it patches ``transformer/moe/moe_utils.py`` when that module
is imported, which another test of this process may already have done.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from mcore_compat import patches


@pytest.fixture(autouse=True)
def _clean() -> None:
    patches.revert_all()
    yield
    patches.revert_all()


@pytest.mark.unit
def test_moe_histc_cpu_counts_integer_indices_and_reverts() -> None:
    own = torch.histc
    indices = torch.tensor([0, 1, 1, 3, 3, 3])
    with pytest.raises((RuntimeError, NotImplementedError)):
        torch.histc(indices, bins=4, min=0, max=3)
    patches.apply("moe_histc_cpu", version="0.6.0")
    counts = torch.histc(indices, bins=4, min=0, max=3)
    assert counts.tolist() == [1, 2, 0, 3] and counts.dtype == torch.int64
    assert torch.histc(indices, bins=2, min=0, max=4).tolist() == [3, 3]  # the 0.7 all-to-all form
    floats = torch.tensor([0.5, 1.5, 1.6])
    assert torch.equal(torch.histc(floats, bins=2, min=0, max=2), own(floats, bins=2, min=0, max=2))
    patches.revert("moe_histc_cpu")
    assert torch.histc is own


@pytest.mark.unit
def test_moe_patch_ranges() -> None:
    def names(purpose: str, version: str) -> list[str]:
        return [p.name for p in patches.applicable(purpose, version=version)]

    assert "moe_histc_cpu" in names("cpu", "0.5.0") and "moe_histc_cpu" in names("cpu", "0.9.0")
    assert "moe_histc_cpu" not in names("cpu", "0.4.0") + names("cpu", "0.10.0")
    assert "moe_histc_cpu" not in names("cpu", "0.8.0")  # its dispatchers count with torch.bincount
    assert "moe_histc_cpu" not in names("upstream_bug", "0.6.0")  # a CPU limit, not an upstream bug
    assert "moe_local_spec_te_names" in names("upstream_bug", "0.10.0")
    assert "moe_local_spec_te_names" not in names("upstream_bug", "0.9.0") + names("upstream_bug", "0.11.0")
    for v in ("0.13.0", "0.16.1"):
        assert "moe_te_gemm_name" in names("upstream_bug", v) and "moe_te_gemm_name" in names("cpu", v)
    assert "moe_te_gemm_name" not in names("upstream_bug", "0.12.3") + names("upstream_bug", "0.17.0")


_CPU_WITHOUT = r"""
import inspect, json
import torch
from mcore_compat import patches
for p in patches.applicable("cpu"):
    if p.name != WITHOUT and (p.needed_when is None or p.needed_when()):
        patches.apply(p.name)
"""

_ROUTER_GEMM = "WITHOUT = 'moe_te_gemm_name'" + _CPU_WITHOUT + r"""
from megatron.core.transformer.moe import moe_utils
fn = moe_utils.router_gating_linear
inp, weight = torch.randn(3, 8), torch.randn(4, 8)
with_bias = "bias" in inspect.signature(fn).parameters  # 0.15+
args = (inp, weight, None, torch.float32) if with_bias else (inp, weight, torch.float32)

def call():
    try:
        out = fn(*args)
        return ["ok", list(out.shape), bool(torch.allclose(out, inp @ weight.t(), atol=1e-5))]
    except NameError as exc:
        return ["NameError", str(exc)]

out = {"without": call()}
patches.apply("moe_te_gemm_name")  # moe_utils is imported: patched at once
out["with"] = call()
patches.revert("moe_te_gemm_name")
out["reverted"] = call()
print(json.dumps(out))
"""


def _installed_in(spec: str) -> bool:
    from mcore_compat._facts.ranges import in_range
    from mcore_compat.detect import detect

    return in_range(detect().version, spec)


def _child(code: str) -> dict:
    """Run ``code`` in a fresh interpreter (same mcore_compat and megatron); its last line is a JSON dict."""
    import mcore_compat

    # The child imports the same mcore_compat and megatron as this process (not the checkout in the cwd).
    root = os.path.dirname(os.path.dirname(os.path.abspath(mcore_compat.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *(p for p in sys.path if p)]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _skip_unless_applies(name: str) -> None:
    from mcore_compat.detect import detect

    spec = patches.get(name).versions
    if not _installed_in(spec):
        pytest.skip(f"{name} does not apply to megatron-core {detect().version}: the bug exists in {spec}")
    if not patches.get(name).needed_when():
        pytest.skip(f"TransformerEngine is installed with megatron-core {detect().version}: the bug cannot show")


@pytest.mark.mcore
def test_moe_te_gemm_name_bug_and_fix() -> None:
    _skip_unless_applies("moe_te_gemm_name")
    out = _child(_ROUTER_GEMM)
    assert out["without"][0] == "NameError" and "te_general_gemm" in out["without"][1]
    assert out["with"] == ["ok", [3, 4], True]
    assert out["reverted"][0] == "NameError"


_LOCAL_MOE_SPEC = "WITHOUT = 'moe_local_spec_te_names'" + _CPU_WITHOUT + r"""
from megatron.core.models.gpt import gpt_layer_specs

def call():
    try:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
        experts = spec.submodules.mlp.submodules.experts
        return ["ok", experts.linear_fc1.__name__, experts.linear_fc2.__name__]
    except NameError as exc:
        return ["NameError", str(exc)]

out = {"without": call()}
patches.apply("moe_local_spec_te_names")
out["with"] = call()
patches.revert("moe_local_spec_te_names")
out["reverted"] = call()
print(json.dumps(out))
"""


@pytest.mark.mcore
def test_moe_local_spec_te_names_bug_and_fix() -> None:
    _skip_unless_applies("moe_local_spec_te_names")
    out = _child(_LOCAL_MOE_SPEC)
    assert out["without"][0] == "NameError" and "TEColumnParallel" in out["without"][1]
    assert out["with"] == ["ok", "ColumnParallelLinear", "RowParallelLinear"]
    assert out["reverted"][0] == "NameError"
