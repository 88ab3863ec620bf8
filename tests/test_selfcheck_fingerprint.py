"""Fingerprints tell a changed tensor from an unchanged one, without a copy (selfcheck.fingerprint)."""

from __future__ import annotations

import pytest
import torch

from mcore_compat.selfcheck import fingerprint as fp
from mcore_compat.selfcheck.fingerprint import fingerprint


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64])
def test_a_copy_matches_and_any_one_or_two_element_change_does_not(dtype: torch.dtype,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp, "_BLOCK", 1000)
    x = (torch.randn(9_001) * 100).to(dtype)  # several blocks
    assert fingerprint(x) == fingerprint(x.clone())
    for change in ("one", "swap", "negate", "zero"):
        y = x.clone()
        if change == "one":
            y[4_500] = y[4_500] + 1
        elif change == "swap":  # same multiset of values: the index-weighted sum tells
            y[3], y[8_999] = x[8_999], x[3]
            if x[3] == x[8_999]:
                continue
        elif change == "negate":
            y[7] = -y[7] if y[7] != 0 else 1
        else:
            y.zero_()
        assert fingerprint(y) != fingerprint(x), change


def test_dtype_shape_and_plain_values_count() -> None:
    x = torch.zeros(4, 6)
    assert fingerprint(x) != fingerprint(x.reshape(6, 4))
    assert fingerprint(x) != fingerprint(x.to(torch.int32))
    assert fingerprint(3) == fingerprint(3) and fingerprint(3) != fingerprint(4)
    assert fingerprint(x[:, ::2]) == fingerprint(x[:, ::2].contiguous())
