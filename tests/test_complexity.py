"""The complexity sweep: the methods are causal attentions of the right shape, the fitted exponents
are least-squares log-log slopes, and the T x T memory of softmax shows up as exponent 2."""
import json
import math

import pytest
import torch

from linattn_lib.experiments import complexity as C


@pytest.mark.parametrize("method", C.ALL_METHODS)
def test_methods_are_causal_attentions(method):
    f = C.make_attention(method, 8, num_features=16)
    q, k, v = (torch.randn(2, 3, 20, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    o = f(q, k, v)
    assert o.shape == (2, 3, 20, 8) and torch.isfinite(o).all()
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 12:] += 1.0
    v2[:, :, 12:] -= 1.0
    o2 = f(q, k2, v2)  # changing the future leaves the past alone
    assert torch.allclose(o[:, :, :12], o2[:, :, :12], atol=1e-5)
    assert not torch.allclose(o[:, :, 12:], o2[:, :, 12:], atol=1e-3)


def test_unknown_method_and_mode_are_errors():
    with pytest.raises(ValueError, match="unknown method"):
        C.make_attention("nope", 8)
    with pytest.raises(ValueError, match="mode"):
        C.measure_point("linear", 16, mode="backward")


def test_fit_exponents_recovers_power_laws():
    rows = []
    for T in (100, 200, 400, 800):
        for mode in C.MODES:
            rows.append({"method": "a", "T": T, "mode": mode, "seconds": 1e-9 * T**2, "peak_bytes": 3 * T})
    ex = C.fit_exponents(rows)
    assert math.isclose(ex["a"]["time_forward"], 2.0) and math.isclose(ex["a"]["memory_forward+backward"], 1.0)
    table = C.complexity_table(ex, text=False)
    assert "a" in table and "2.00" in table and "1.00" in table


def test_local_exponents_of_a_power_law_are_constant():
    Ts = [512, 4096, 16384]
    assert all(math.isclose(p, 2.0) for p in C.local_exponents(Ts, [T**2 for T in Ts]))
    # the text's softmax column: 12 -> 180 -> 2800 ms
    p1, p2 = C.local_exponents(Ts, [v[0] for v in C.TEXT_SPEED.values()])
    assert round(p1, 2) == 1.30 and round(p2, 2) == 1.98


def test_by_head_groups_is_the_same_computation():
    f = C.make_attention("softmax", 8)
    q, k, v = (torch.randn(1, 5, 30, 8) for _ in range(3))
    assert torch.allclose(C.by_head_groups(f, 2)(q, k, v), f(q, k, v), atol=1e-6)


def test_measure_point_and_softmax_memory_is_quadratic():
    rows = C.complexity_sweep(("softmax", "linear"), (512, 1024, 2048), modes=("forward",), heads=4, d=16, repeats=1)
    assert all(r["seconds"] > 0 and r["clock"] == "cpu" for r in rows)
    if any(r["peak_bytes"] is None for r in rows):
        pytest.skip("no peak-memory measurement on this OS")
    # memory from the two longer lengths: at T = 512 the extra memory is a few hundred KiB, where
    # scratch buffers and recycled pages blur the resident-set measurement (see ch. 8, §8.1)
    ex = C.fit_exponents(rows, min_T=1024)
    assert 1.7 < ex["softmax"]["memory_forward"] < 2.3  # the 4 x T x T matrix dominates
    assert ex["linear"]["memory_forward"] < 1.4
    json.dumps(rows)  # rows are JSON-ready


def test_speed_table_groups_heads_when_the_matrix_is_too_big():
    cfg = C.SpeedConfig(lengths=(64, 128), heads=4, d_head=8, num_features=8, methods=("softmax", "linear"),
                        repeats=1, max_matrix_bytes=2 * 128 * 128 * 4)
    rows = C.speed_table(cfg)
    by = {(r["method"], r["T"]): r for r in rows}
    assert by[("softmax", 64)]["heads_per_call"] == 4 and by[("softmax", 128)]["heads_per_call"] == 2
    assert by[("linear", 128)]["heads_per_call"] == 4 and all(r["ms"] > 0 for r in rows)


def test_quick_cli(tmp_path):
    out = tmp_path / "c.json"
    C.main(["--quick", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["meta"]["command"].startswith("python -m linattn_lib.experiments.complexity --quick")
    assert set(saved["sweep"]["exponents"]) == set(C.ALL_METHODS)
