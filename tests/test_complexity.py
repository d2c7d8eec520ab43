"""The complexity sweep: the methods are causal attentions of the right shape, the fitted exponents
are least-squares log-log slopes, and the T x T memory of softmax shows up as exponent 2."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

from linattn_lib.core.features import RandomFeatureMap
from linattn_lib.experiments import complexity as C


def reference(method, q, k, v, *, num_features=16):
    """Each method's output from its definition (float64, quadratic form, written out here)."""
    T, d = q.shape[2], q.shape[-1]
    i = torch.arange(T, dtype=torch.float64)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    if method in ("softmax", "softmax_fused"):
        s = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(~causal, -math.inf)
        return s.softmax(-1) @ v
    if method == "decayed":  # unnormalised, log a_t = -softplus(mean_c q_t), q and k scaled by d^-1/2
        cum = -F.softplus(q.mean(-1)).cumsum(-1)
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, -math.inf).exp()
        return ((q @ k.transpose(-1, -2)) / d * decay) @ v
    if method == "performer":  # FAVOR+ with the map make_attention draws (seed 0), no eps
        W = RandomFeatureMap(d, num_features, kind="positive", seed=0).W.double()

        def phi(x):
            x = x * d**-0.25
            return (x @ W.T - 0.5 * (x * x).sum(-1, keepdim=True)).exp()

        A, eps = phi(q) @ phi(k).transpose(-1, -2), 0.0
    elif method == "linear":  # elu + 1
        A, eps = (F.elu(q) + 1) @ (F.elu(k) + 1).transpose(-1, -2), 1e-6
    else:  # cosformer: relu features, cos(pi/2 (i - j) / M) with M = T
        A = (F.relu(q) @ F.relu(k).transpose(-1, -2)) * torch.cos(math.pi / 2 * (i[:, None] - i[None, :]) / T)
        eps = 1e-6
    A = A.masked_fill(~causal, 0.0)
    return (A @ v) / (A.sum(-1, keepdim=True) + eps)


@pytest.mark.parametrize("method", C.ALL_METHODS)
def test_methods_are_causal_attentions(method):
    f = C.make_attention(method, 8, num_features=16)
    q, k, v = (torch.randn(2, 3, 20, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    o = f(q, k, v)
    assert o.shape == (2, 3, 20, 8) and o.dtype == torch.float32
    want = reference(method, q.double(), k.double(), v.double())
    err = ((o.double() - want).norm() / want.norm()).item()
    assert err < 1e-5, (method, err)  # float32 round-off
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 12:] += 1.0
    v2[:, :, 12:] -= 1.0
    o2 = f(q, k2, v2)  # changing the future leaves the past alone
    assert torch.allclose(o[:, :, :12], o2[:, :, :12], atol=1e-5)
    assert not torch.allclose(o[:, :, 12:], o2[:, :, 12:], atol=1e-3)


def test_performer_with_many_features_approximates_softmax():
    """FAVOR+ is an estimator of softmax attention: with 4096 features the Performer method's
    output is within a few percent of the softmax method's (with 16: tens of percent)."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (0.5 * torch.randn(1, 2, 20, 8, generator=g, dtype=torch.float64) for _ in range(3))
    exact = C.make_attention("softmax", 8)(q, k, v)
    errs = {m: ((C.make_attention("performer", 8, num_features=m)(q, k, v) - exact).norm() / exact.norm()).item()
            for m in (16, 4096)}
    assert errs[4096] < 0.05 and errs[4096] < errs[16] / 3, errs


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
