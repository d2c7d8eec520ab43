"""`measure.below`: the portable way to print a round-off-level error."""
import math

import pytest
import torch

from linattn_lib.measure import below


def test_below_prints_the_bound():
    assert below(3.6e-16, 1e-14) == "< 10⁻¹⁴"
    assert below(torch.tensor(1.9e-16, dtype=torch.float64), 1e-12) == "< 10⁻¹²"
    assert below(1e-6, 5e-5) == "< 5×10⁻⁵" and below(0.01, 0.05) == "< 0.05"


@pytest.mark.parametrize("error", [1e-12, 2e-12, math.nan, math.inf])
def test_below_fails_loudly(error):
    with pytest.raises(AssertionError, match="is not below the bound 1e-12"):
        below(error, 1e-12)


@pytest.mark.parametrize("threads", [1, 2])
def test_device_name_counts_threads_in_english(threads):
    from linattn_lib.measure import device_name

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        name = device_name("cpu")
    finally:
        torch.set_num_threads(before)
    assert name.endswith("(1 thread)" if threads == 1 else f"({threads} threads)"), name
