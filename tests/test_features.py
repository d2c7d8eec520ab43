"""Random feature estimators: unbiased where they should be, biased where the texts went wrong."""
import math

import pytest
import torch

from linattn_lib import linear_attention, softmax_attention
from linattn_lib.core.features import (
    RandomFeatureMap,
    clipped_trig_features,
    elu_plus_one,
    gaussian_kernel,
    gaussian_matrix,
    hyperbolic_random_features,
    orthogonal_gaussian_matrix,
    positive_random_features,
    relu,
    rff_features,
    softmax_kernel,
    trig_softmax_features,
)
from linattn_lib.core.performer import performer_attention

D64 = torch.float64


def pair(d=4, seed=0, norm=0.8):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(2, d, generator=g, dtype=D64)
    return x / x.norm() * norm, y / y.norm() * norm


def per_feature_products(phi_x, phi_y, m):
    """phi(x) . phi(y) written as the mean of m i.i.d. per-direction samples."""
    prod = phi_x * phi_y * m
    if prod.shape[-1] == 2 * m:  # (sin, cos) or (+w, -w) pairs belong to the same direction
        prod = prod[..., :m] + prod[..., m:]
    return prod


def assert_unbiased(samples, target, n_se=4.0):
    mean, se = samples.mean().item(), samples.std().item() / math.sqrt(samples.numel())
    assert abs(mean - target) < n_se * se, (mean, target, se)


M = 200_000


def test_rff_unbiased_for_gaussian_kernel_with_sqrt2_scaling():
    x, y = pair()
    W = gaussian_matrix(M, 4, seed=1, dtype=D64)
    b = 2 * math.pi * torch.rand(M, generator=torch.Generator().manual_seed(2), dtype=D64)
    s = per_feature_products(rff_features(x, W, b), rff_features(y, W, b), M)
    target = gaussian_kernel(x[None], y[None]).item()
    assert_unbiased(s, target)
    # the texts' 1/sqrt(m) scaling estimates half of it
    half = s.mean().item() / 2
    assert abs(half / target - 0.5) < 0.02


@pytest.mark.parametrize("fmap", [trig_softmax_features, positive_random_features, hyperbolic_random_features])
def test_softmax_estimators_unbiased(fmap):
    x, y = pair()
    W = gaussian_matrix(M, 4, seed=3, dtype=D64)
    s = per_feature_products(fmap(x, W), fmap(y, W), M)
    assert_unbiased(s, softmax_kernel(x[None], y[None]).item())


def test_positive_features_are_positive_trig_are_not():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(50, 8, generator=g, dtype=D64)
    W = gaussian_matrix(64, 8, seed=1, dtype=D64)
    assert (positive_random_features(X, W) > 0).all()
    assert (hyperbolic_random_features(X, W) > 0).all()
    est = trig_softmax_features(X, W) @ trig_softmax_features(X, W).T
    assert (est < 0).any()  # some pairwise estimates of exp(x.y) > 0 come out negative


def test_clipped_map_is_biased():
    x, y = pair()
    W = gaussian_matrix(M, 4, seed=4, dtype=D64)
    b = 2 * math.pi * torch.rand(M, generator=torch.Generator().manual_seed(5), dtype=D64)
    s = per_feature_products(clipped_trig_features(x, W, b), clipped_trig_features(y, W, b), M)
    for target in (softmax_kernel(x[None], y[None]).item(), gaussian_kernel(x[None], y[None]).item()):
        mean, se = s.mean().item(), s.std().item() / math.sqrt(M)
        assert abs(mean - target) > 10 * se
    # k(x, x) = 1/2 for the clipped map, whatever x is
    sxx = per_feature_products(clipped_trig_features(x, W, b), clipped_trig_features(x, W, b), M)
    assert abs(sxx.mean().item() - 0.5) < 0.01


def test_orthogonal_matrix_structure():
    d, m = 16, 40
    W = orthogonal_gaussian_matrix(m, d, seed=0, dtype=D64)
    assert W.shape == (m, d)
    for a in range(0, m, d):
        blk = W[a : a + d]
        blk = blk / blk.norm(dim=1, keepdim=True)
        assert torch.allclose(blk @ blk.T, torch.eye(blk.shape[0], dtype=D64), atol=1e-10)
    Wd = orthogonal_gaussian_matrix(m, d, scaling="sqrt_d", seed=0, dtype=D64)
    assert torch.allclose(Wd.norm(dim=1), torch.full((m,), 4.0, dtype=D64))


def test_sqrt_d_scaling_is_biased_as_its_docstring_says():
    """At d = 1 a sqrt_d row is +1 or -1, each with probability 1/2 (Haar on O(1)): the
    positive map's expectation is exact, cosh(x + y) exp(-(x^2 + y^2)/2), not exp(x y)."""
    rows = {orthogonal_gaussian_matrix(1, 1, scaling="sqrt_d", seed=s, dtype=D64).item()
            for s in range(40)}
    assert rows == {1.0, -1.0}
    x, y = torch.tensor([[1.0]], dtype=D64), torch.tensor([[0.5]], dtype=D64)
    mean = sum(positive_random_features(x, torch.tensor([[w]], dtype=D64))
               @ positive_random_features(y, torch.tensor([[w]], dtype=D64)).T for w in rows) / 2
    want = math.cosh(1.5) * math.exp(-(1.0 + 0.25) / 2)
    assert abs(mean.item() - want) < 1e-12
    assert mean.item() < 0.8 * math.exp(0.5)  # low by 24%: biased


def test_orthogonal_features_have_lower_mse():
    d, m, trials = 16, 16, 400
    g = torch.Generator().manual_seed(7)
    X = torch.randn(20, d, generator=g, dtype=D64) * 0.35
    exact = softmax_kernel(X, X)
    mse = {}
    for orth in (False, True):
        errs = []
        for t in range(trials):
            W = orthogonal_gaussian_matrix(m, d, seed=t, dtype=D64) if orth else gaussian_matrix(m, d, seed=t, dtype=D64)
            P = positive_random_features(X, W)
            errs.append(((P @ P.T - exact) ** 2).mean())
        mse[orth] = torch.stack(errs).mean().item()
    assert mse[True] < 0.9 * mse[False], mse


def test_stabiliser_leaves_normalised_output_unchanged():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 30, 8, generator=g, dtype=D64) * 2 for _ in range(3))
    fm = RandomFeatureMap(8, 32, seed=0).double()
    outs = [
        linear_attention(fm(q, is_query=True, stabilize=s), fm(k, is_query=False, stabilize=s), v, causal=c, eps=0.0)
        for c in (True, False)
        for s in (True, False)
    ]
    assert torch.allclose(outs[0], outs[1], atol=1e-10)
    assert torch.allclose(outs[2], outs[3], atol=1e-10)


def test_stabiliser_prevents_overflow_and_underflow():
    fm = RandomFeatureMap(64, 16, seed=0, orthogonal=False, softmax_temperature=False)
    # a query along w_0 with |x| = 8: exponent w_0.x - |x|^2/2 ~ 8*8 - 32 = 32, beyond fp16's e^11
    big = (fm.W[0] / fm.W[0].norm() * 8.0).view(1, 1, 1, 64).half()
    assert not torch.isfinite(fm(big, stabilize=False)).all()
    stable = fm(big, stabilize=True)
    assert torch.isfinite(stable).all() and stable.max() == 0.25  # the row maximum becomes 1/sqrt(m)
    # a large-norm input the other way round: -|x|^2/2 dominates and every feature underflows to 0
    far = torch.full((1, 1, 1, 64), 4.0)
    assert (fm(far, stabilize=False) == 0).all()
    assert (fm(far, stabilize=True) > 0).any()


def test_performer_approximates_softmax():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g) * 0.5 for _ in range(3))
    exact = softmax_attention(q, k, v, causal=True)
    err = {}
    for m in (16, 1024):
        out = performer_attention(q, k, v, num_features=m, seed=0)
        err[m] = ((out - exact).norm() / exact.norm()).item()
    assert err[1024] < 0.1 and err[1024] < err[16]


def test_redraw_changes_projection_and_seed_reproduces():
    fm = RandomFeatureMap(8, 16, seed=3)
    W0 = fm.W.clone()
    fm.redraw()
    assert not torch.equal(W0, fm.W)
    fm.redraw(seed=3)
    assert torch.equal(W0, fm.W)


def test_deterministic_maps():
    x = torch.linspace(-3, 3, 13)
    assert (elu_plus_one(x) > 0).all()
    assert torch.equal(relu(x), x.clamp_min(0))


def test_feature_shape_errors():
    with pytest.raises(ValueError, match="W"):
        positive_random_features(torch.randn(3, 4), torch.randn(5, 6))
    with pytest.raises(ValueError, match="kind"):
        RandomFeatureMap(4, 4, kind="fourier")


def test_performer_default_eps_does_not_bias_stabilised_output():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 64, generator=g, dtype=torch.float64) for _ in range(3))
    fm = RandomFeatureMap(64, 256, seed=0).double()
    stabilised = performer_attention(q, k, v, feature_map=fm)
    raw = performer_attention(q, k, v, feature_map=fm, stabilize=False)
    assert ((stabilised - raw).norm() / raw.norm()) < 1e-10


def test_feature_map_input_checks_found_in_review():
    from linattn_lib.core.features import RandomFeatureMap, positive_random_features

    with pytest.raises(ValueError, match="scaling"):
        RandomFeatureMap(4, 8, orthogonal=False, scaling="bogus")
    with pytest.raises(ValueError, match="stabilize='global' needs x of shape"):
        positive_random_features(torch.randn(4), torch.randn(8, 4), stabilize="global")
