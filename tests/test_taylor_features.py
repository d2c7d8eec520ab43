"""Based's second-order Taylor feature map: its exact kernel, its error against exp, its use in attention."""
from __future__ import annotations

import math

import pytest
import torch

from linattn_lib.core.features import positive_random_features, random_projection, taylor_features, taylor_kernel
from linattn_lib.core.linear import linear_attention

F64 = torch.float64


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


@pytest.mark.parametrize("d, scale", [(1, None), (5, None), (8, 0.3), (16, 1.0)])
def test_feature_inner_product_is_the_second_order_polynomial(d, scale):
    q, k = randn(2, 7, d, seed=1), randn(2, 9, d, seed=2)
    phi_q, phi_k = taylor_features(q, scale=scale), taylor_features(k, scale=scale)
    assert phi_q.shape == (2, 7, 1 + d + d * d) and phi_q.dtype == F64
    s = (q @ k.transpose(-1, -2)) * (d**-0.5 if scale is None else scale)
    expect = 1 + s + s * s / 2
    assert (phi_q @ phi_k.transpose(-1, -2) - expect).abs().max() < 1e-12
    assert (taylor_kernel(q, k, scale=scale) - expect).abs().max() < 1e-12


def test_kernel_is_positive_with_minimum_one_half():
    s = torch.arange(-50_000, 50_001, dtype=F64).unsqueeze(-1) / 1000  # d = 1, scale = 1: s = q . k, step 1e-3
    kern = taylor_kernel(s, torch.ones(1, 1, dtype=F64), scale=1.0).squeeze(-1)
    assert kern.min() == 0.5 and s[kern.argmin()].item() == -1.0  # (1 + s)^2 / 2 + 1/2, minimal at s = -1
    q, k = 10 * randn(200, 6, seed=3), 10 * randn(300, 6, seed=4)  # large |s|, either sign
    gram = taylor_features(q) @ taylor_features(k).T
    assert gram.min() >= 0.5 - 1e-9


def test_error_against_exp_is_the_cubic_taylor_remainder():
    s = 2 * torch.rand(10_000, generator=torch.Generator().manual_seed(5), dtype=F64) - 1
    x, y = s.view(-1, 1, 1), torch.ones(1, 1, dtype=F64)
    err = (torch.exp(s) - taylor_kernel(x, y, scale=1.0).view(-1)).abs()
    cube = s.abs() ** 3 / 6
    # Lagrange: exp(s) - (1 + s + s^2/2) = exp(xi) s^3 / 6 for some xi between 0 and s
    assert (err <= cube * torch.exp(s.clamp_min(0)) * (1 + 1e-9) + 1e-15).all()
    assert (err >= cube * torch.exp(s.clamp_max(0)) * (1 - 1e-9) - 1e-15).all()
    nonzero = s.abs() > 1e-3
    first_order = (torch.exp(s) - 1 - s).abs()
    third_order = (torch.exp(s) - 1 - s - s**2 / 2 - s**3 / 6).abs()
    assert (err[nonzero] < first_order[nonzero]).all()  # one order better than 1 + s ...
    assert (err[nonzero] > third_order[nonzero]).all()  # ... and one order worse than the cubic
    small = torch.tensor([1e-2, -1e-2], dtype=F64)
    ratio = (torch.exp(small) - taylor_kernel(small.view(-1, 1, 1), y, scale=1.0).view(-1)) / small**3
    assert torch.allclose(ratio, torch.full_like(ratio, 1 / 6), rtol=2e-2)


@pytest.mark.parametrize("form", ["quadratic", "recurrent", "chunked"])
def test_as_features_of_linear_attention_gives_row_normalised_taylor_weights(form):
    q, k, v = randn(2, 3, 13, 4, seed=6), randn(2, 3, 13, 4, seed=7), randn(2, 3, 13, 5, seed=8)
    o = linear_attention(taylor_features(q), taylor_features(k), v, causal=True, normalize=True, form=form,
                         chunk_size=5, eps=0.0)
    weights = torch.tril(taylor_kernel(q, k))
    expect = (weights @ v) / weights.sum(-1, keepdim=True)
    assert (o - expect).abs().max() < 1e-12


def test_more_accurate_than_favor_plus_at_equal_feature_count_for_small_scores():
    d, n = 8, 64
    m = 1 + d + d * d  # 73
    g = torch.Generator().manual_seed(9)

    def points() -> torch.Tensor:  # |x| <= d^(1/4), so |s| = |q . k| / sqrt(d) <= 1
        x = torch.randn(n, d, generator=g, dtype=F64)
        radius = (0.5 + 0.5 * torch.rand(n, 1, generator=g, dtype=F64)) * d**0.25
        return x / x.norm(dim=-1, keepdim=True) * radius

    q, k = points(), points()
    exact = torch.exp(q @ k.T / math.sqrt(d))
    assert (q @ k.T / math.sqrt(d)).abs().max() <= 1 + 1e-12
    taylor_err = ((taylor_kernel(q, k) - exact).abs() / exact).mean()
    favor_errs = []
    for seed in range(5):
        W = random_projection(m, d, seed=seed, dtype=F64)
        phi_q, phi_k = (positive_random_features(x, W, input_scale=d**-0.25) for x in (q, k))
        favor_errs.append(((phi_q @ phi_k.T - exact).abs() / exact).mean())
    # measured: Taylor ~0.003, FAVOR+ ~0.1-0.2 per seed (a factor of ~50); asserted with room to spare
    assert taylor_err < 0.1 * torch.stack(favor_errs).mean()


def test_bad_inputs_are_refused_naming_the_argument():
    x = randn(3, 4)
    with pytest.raises(TypeError, match=r"taylor_features: `x` must have a floating-point dtype"):
        taylor_features(torch.ones(3, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"`x` must be a torch.Tensor"):
        taylor_features([[1.0, 2.0]])
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"taylor_features: `scale`"):
            taylor_features(x, scale=bad)
        with pytest.raises(ValueError, match=r"taylor_kernel: `scale`"):
            taylor_kernel(x, x, scale=bad)
    with pytest.raises(TypeError, match=r"`scale` must be a number"):
        taylor_features(x, scale="0.5")
    with pytest.raises(ValueError, match=r"`x` must be laid out as \(\.\.\., d\)"):
        taylor_features(torch.tensor(1.0, dtype=F64))
    with pytest.raises(ValueError, match=r"taylor_kernel: `k` has d=5 but `q` has d=4"):
        taylor_kernel(x, randn(3, 5))
    with pytest.raises(ValueError, match=r"taylor_kernel: `q` must be laid out as \(\.\.\., n, d\)"):
        taylor_kernel(randn(4), x)
    with pytest.raises(TypeError, match=r"`k` has dtype torch.float32"):
        taylor_kernel(x, x.float())
