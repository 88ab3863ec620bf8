"""Fingerprints tell a changed tensor from an unchanged one, without a copy (selfcheck.fingerprint)."""

from __future__ import annotations

import pytest
import torch

from mcore_compat.selfcheck import fingerprint as fp
from mcore_compat.selfcheck.fingerprint import changed, fingerprint, fingerprints


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64])
def test_a_copy_matches_and_any_one_or_two_element_change_does_not(dtype: torch.dtype) -> None:
    x = (torch.randn(9_001) * 100).to(dtype)  # several rows and a partial last row
    assert changed([(fingerprint(x), fingerprint(x.clone()))]) == [False]
    for change in ("one", "swap", "negate", "zero"):
        y = x.clone()
        if change == "one":
            y[4_500] = 12345  # no randn*100 value rounds to it in any dtype here
        elif change == "swap":  # same multiset of values: the index-weighted sum tells
            y[3], y[8_999] = x[8_999], x[3]
            if x[3] == x[8_999]:
                continue
        elif change == "negate":
            y[7] = -y[7] if y[7] != 0 else 1
        else:
            y.zero_()
        assert changed([(fingerprint(y), fingerprint(x))]) == [True], change


def test_dtype_shape_and_plain_values_count() -> None:
    x = torch.zeros(4, 6)
    assert changed([(fingerprint(x), fingerprint(x.reshape(6, 4))), (fingerprint(x), fingerprint(x.to(torch.int32))),
                    (fingerprint(3), fingerprint(4))]) == [True, True, True]
    assert changed([(fingerprint(3), fingerprint(3)),
                    (fingerprint(x[:, ::2]), fingerprint(x[:, ::2].contiguous()))]) == [False, False]


def test_fingerprints_together_equal_one_by_one_and_see_a_change() -> None:
    items = [torch.randn(100), torch.randn(3, 4).bfloat16(), torch.tensor(2.0), 5, torch.randn(7, 5).t(),
             torch.zeros(0), torch.ones(3, dtype=torch.bool), torch.randn(300_000)]
    together = fingerprints(items)
    assert not any(changed(list(zip([fingerprint(x) for x in items], together, strict=True))))
    items[1][2, 3] = 12345
    assert changed(list(zip(together, fingerprints(items), strict=True))) == [i == 1 for i in range(len(items))]


@pytest.mark.parametrize("n", [1, 1023, 1024, 5_000, 70_001])
def test_row_and_column_sums_give_the_index_weighted_sum_exactly(n: int) -> None:
    """The sums equal ``sum(v_i)`` and ``sum((i + 1) * v_i)`` modulo 2**64, computed here directly in Python."""
    x = torch.randn(n) * 1e30  # large bit patterns: the weighted sum wraps modulo 2**64
    ints = x.view(torch.int32).tolist()
    want = [sum(ints), sum((i + 1) * v for i, v in enumerate(ints))]
    got = fingerprint(x)[1].tolist()
    assert [g % 2**64 for g in got] == [w % 2**64 for w in want]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.uint8])
def test_the_definition_gives_the_same_sums(dtype: torch.dtype) -> None:
    x = (torch.randn(70_001) * 1e30).to(dtype) if dtype != torch.uint8 else torch.randint(0, 255, (70_001,),
                                                                                            dtype=dtype)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    assert torch.equal(fp._direct_sums(x.view(width)), fingerprint(x)[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel runs on CUDA only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.uint8, torch.bool])
@pytest.mark.parametrize("n", [1, 4095, 4096, 70_001, 3_000_001])
def test_the_gpu_kernel_gives_the_definition_s_sums(dtype: torch.dtype, n: int) -> None:
    from mcore_compat.selfcheck import triton_sums

    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * 1e30).to(dtype) if dtype.is_floating_point else \
        torch.randint(0, 2 if dtype == torch.bool else 255, (n,), generator=g).to(dtype)
    ints = (x.to(torch.uint8) if dtype == torch.bool else x).view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])
    assert triton_sums.enabled(torch.device("cuda"))
    got = fingerprint(x.cuda())[1].cpu()
    assert torch.equal(got, fp._direct_sums(ints)), (got, fp._direct_sums(ints))
    y = x.clone()
    y[n // 2] = 0 if dtype.is_floating_point and y[n // 2] != 0 else (1 - y[n // 2].int()).to(dtype)
    assert changed([(fingerprint(x.cuda()), fingerprint(y.cuda()))]) == [True]
