"""The length-based dispatcher: its stated rule, the crossover interpolation, and both branches."""
import math

import pytest
import torch
import torch.nn.functional as F

from linattn_lib import elu_plus_one, linear_attention
from linattn_lib.dispatch import (
    FALLBACK_CROSSOVER,
    MEASURED_CROSSOVER,
    Crossover,
    crossover_table,
    auto_attention,
    choose_attention,
    choose_form,
    crossover_from_times,
    crossover_length,
    measure_crossover,
)


def test_rule_interpolates_the_measured_crossovers():
    table = MEASURED_CROSSOVER["cpu"]
    for d, t_star in table.items():
        assert crossover_length(d, "cpu") == t_star
        assert choose_attention(t_star - 1, d, "cpu") == "softmax"
        assert choose_attention(t_star, d, "cpu") == "linear"
    # log-linear between measured head dimensions, constant outside them
    assert crossover_length(8, table={16: 100, 64: 300}) == 100
    assert crossover_length(32, table={16: 100, 64: 300}) == 200
    assert crossover_length(512, table={16: 100, 64: 300}) == 300
    assert crossover_length(64, "cuda" if "cuda" not in MEASURED_CROSSOVER else "meta") == FALLBACK_CROSSOVER
    assert choose_attention(100, 64, crossover=100) == "linear"
    c = [Crossover("cpu", 32, 4, 1, True, t_star=300.0), Crossover("cpu", 64, 4, 1, True, t_star=None)]
    assert crossover_table(c) == {32: 300.0}


def test_crossover_interpolation():
    L = [64, 128, 256, 512]
    # linear is 2x slower at 128 and 2x faster at 256: crossing in the geometric middle
    assert crossover_from_times(L, [1, 1, 1, 1], [4, 2, 0.5, 0.25]) == pytest.approx(math.sqrt(128 * 256))
    assert crossover_from_times(L, [1, 1, 1, 1], [2, 2, 2, 2]) is None
    assert crossover_from_times(L, [1, 1, 1, 1], [0.5] * 4) == 64.0
    # a noisy early flip does not count: the last change from slower to faster does
    assert crossover_from_times(L, [1, 1, 1, 1], [0.9, 2, 0.5, 0.5]) == pytest.approx(math.sqrt(128 * 256))


def test_auto_attention_branches():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))
    o, choice = auto_attention(q, k, v, crossover=17, return_choice=True)
    assert choice == "softmax"
    torch.testing.assert_close(o, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    o, choice = auto_attention(q, k, v, crossover=16, return_choice=True)
    assert choice == "linear"
    torch.testing.assert_close(o, linear_attention(elu_plus_one(q), elu_plus_one(k), v))


def test_choose_form_and_measure_smoke():
    assert choose_form(64, 16, 16) == "quadratic"
    assert choose_form(65, 16, 16) == "chunked"
    before = torch.get_num_threads()
    c = measure_crossover(8, lengths=(16, 32), heads=1, repeats=1, threads=1)
    assert torch.get_num_threads() == before and c.threads == 1
    assert len(c.softmax_s) == len(c.linear_s) == 2 and all(t > 0 for t in c.softmax_s + c.linear_s)
    assert c.to_dict()["d"] == 8


def test_cli_writes_json(tmp_path):
    from linattn_lib.dispatch import main

    out = tmp_path / "x.json"
    payload = main(["--d", "8", "--lengths", "8", "16", "--heads", "1", "--repeats", "1", "--out", str(out)])
    assert out.is_file() and payload["meta"]["command"].startswith("python -m linattn_lib.dispatch")
    assert payload["crossovers"][0]["d"] == 8 and payload["meta"]["timing_threads"] == 1


def test_bad_input():
    with pytest.raises(ValueError, match="T"):
        choose_attention(0, 64)
    with pytest.raises(ValueError, match="same"):
        crossover_from_times([1, 2], [1.0], [1.0, 2.0])
