"""Monte-Carlo statistics of the feature maps, the clipped kernel, Taylor features, FLOP counts."""
import math

import pytest
import torch

from linattn_lib import softmax_attention_weights
from linattn_lib.chapters import estimators as E

D64 = torch.float64


def unit_pair(dot=-0.2488, d=4, seed=0):
    """Two unit vectors with a given dot product (-0.2488: Gaussian kernel 0.2868, exp 0.7797)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(d, generator=g, dtype=D64)
    x = x / x.norm()
    u = torch.randn(d, generator=g, dtype=D64)
    u = u - (u @ x) * x
    return x, dot * x + math.sqrt(1 - dot * dot) * u / u.norm()


@pytest.mark.parametrize("kind", ["positive", "hyperbolic", "trig", "rff", "clipped"])
def test_samples_are_unbiased_and_match_lemma2(kind):
    x, y = unit_pair()
    s = E.per_direction_samples(x, y, kind=kind, n=200_000, seed=1)[:, 0]
    target = E.exact_kernel(x, y, kind=kind).item()
    se = s.std().item() / math.sqrt(s.numel())
    assert abs(s.mean().item() - target) < 4 * se
    if kind != "clipped":
        assert s.var().item() == pytest.approx(E.lemma2_mse(x, y, kind=kind, m=1).item(), rel=0.06)


def test_known_values_of_the_errata():
    x, y = unit_pair()
    assert E.exact_kernel(x, y, kind="rff").item() == pytest.approx(0.2868, abs=1e-4)
    assert E.exact_kernel(x, y, kind="positive").item() == pytest.approx(0.7797, abs=1e-4)
    assert E.clipped_kernel(x, y).item() == pytest.approx(0.2746, abs=1e-4)


def test_clipped_g_and_kernel():
    d = torch.linspace(-3 * math.pi, 3 * math.pi, 101, dtype=D64)
    assert torch.allclose(E.clipped_g(d), E.clipped_g(d + 2 * math.pi))  # periodic
    assert torch.allclose(E.clipped_g(d), E.clipped_g(-d))  # even
    assert E.clipped_g(torch.tensor(0.0)).item() == pytest.approx(0.5)
    assert E.clipped_g(torch.tensor(math.pi)).item() == pytest.approx(0.0, abs=1e-12)
    x = torch.randn(3, 5, dtype=D64)
    assert torch.allclose(E.clipped_kernel(x, x), torch.full((3,), 0.5, dtype=D64))
    # shift invariance
    y = torch.randn(3, 5, dtype=D64)
    assert torch.allclose(E.clipped_kernel(x, y), E.clipped_kernel(x + 1.0, y + 1.0))


def test_estimates_shape_and_mean():
    x, y = unit_pair(d=8)
    est = E.estimates(x, y, kind="positive", m=24, n_draws=3000, orthogonal=True, seed=0, max_rows=1000)
    assert est.shape == (3000, 1)
    target = E.exact_kernel(x, y, kind="positive")
    assert abs(est.mean().item() - target.item()) < 4 * est.std().item() / math.sqrt(3000)
    # an m-feature estimate has the i.i.d. MSE of Lemma 2 divided by m
    iid = E.estimates(x, y, kind="positive", m=24, n_draws=3000, seed=1)
    assert E.mse(iid, target).item() == pytest.approx(E.lemma2_mse(x, y, kind="positive", m=24).item(), rel=0.15)


def test_orthogonal_lowers_the_mse():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(16, 16, generator=g, dtype=D64) * 0.2
    x, y = X[:8], X[8:]
    target = E.exact_kernel(x, y, kind="positive")
    iid = E.mse(E.estimates(x, y, kind="positive", m=16, n_draws=4000, seed=1), target).mean()
    orf = E.mse(E.estimates(x, y, kind="positive", m=16, n_draws=4000, orthogonal=True, seed=1), target).mean()
    assert orf < 0.9 * iid


def test_taylor_features():
    x = torch.randn(3, 4, dtype=D64) * 0.5
    y = torch.randn(3, 4, dtype=D64) * 0.5
    for N in range(6):
        f, h = E.taylor_features(x, N), E.taylor_features(y, N)
        assert f.shape == (3, E.taylor_feature_dim(4, N))
        partial = sum((x * y).sum(-1) ** n / math.factorial(n) for n in range(N + 1))
        assert torch.allclose((f * h).sum(-1), partial)
    assert E.taylor_feature_dim(4, 3) == 1 + 4 + 16 + 64
    # high order features reproduce softmax attention weights
    q, k = torch.randn(1, 1, 6, 3, dtype=D64) * 0.4, torch.randn(1, 1, 6, 3, dtype=D64) * 0.4
    A = E.approx_attention_weights(E.taylor_features(q, 10), E.taylor_features(k, 10), causal=True)
    assert torch.allclose(A, softmax_attention_weights(q, k, causal=True, scale=1.0), atol=1e-9)
    with pytest.raises(ValueError, match="order"):
        E.taylor_features(x, -1)


def test_flops_and_crossover():
    assert E.attention_flops(10, 4, 3, order="quadratic", normalize=False) == 2 * 100 * 4 + 2 * 100 * 3
    assert E.attention_flops(10, 4, 3, order="associative", normalize=False) == 4 * 10 * 4 * 3
    for m, dv in ((64, 64), (16, 64), (256, 64), (1, 1)):
        for norm in (True, False):
            T = E.flop_crossover(m, dv, normalize=norm)
            fq = lambda t, m=m, dv=dv, norm=norm: E.attention_flops(t, m, dv, order="quadratic", normalize=norm)
            fa = lambda t, m=m, dv=dv, norm=norm: E.attention_flops(t, m, dv, order="associative", normalize=norm)
            assert fa(T) < fq(T)
            assert T == 1 or fa(T - 1) >= fq(T - 1)
    assert E.flop_crossover(64, 64) == 65
    with pytest.raises(ValueError, match="order"):
        E.attention_flops(4, 4, 4, order="cubic")


def test_attention_helpers():
    A = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    B = torch.tensor([[0.0, 1.0], [0.5, 0.5]])
    assert torch.equal(E.attention_row_tv(A, B), torch.tensor([1.0, 0.0]))
    assert E.relative_error(B, B) == 0.0
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 32, 8, generator=g) * 0.7 for _ in range(3))
    small = E.performer_output_error(q, k, v, m=8, seeds=range(3))
    large = E.performer_output_error(q, k, v, m=512, seeds=range(3))
    assert large < small


def test_theorem4_and_input_checks():
    m1 = E.performer_theorem4_num_features(64, 8.0, 0.1)
    assert m1 > 1e6 and E.performer_theorem4_num_features(64, 16.0, 0.1) > m1
    with pytest.raises(ValueError, match="R"):
        E.performer_theorem4_num_features(64, -1.0, 0.1)
    with pytest.raises(ValueError, match="kind"):
        E.per_direction_samples(torch.ones(3), torch.ones(3), kind="fourier", n=4)
    with pytest.raises(ValueError, match="paired"):
        E.estimates(torch.ones(2, 3), torch.ones(3, 3), kind="positive", m=4, n_draws=2)
    with pytest.raises(ValueError, match="kind"):
        E.lemma2_mse(torch.ones(3), torch.ones(3), kind="clipped", m=4)


def test_feature_attention_view_and_plot():
    import matplotlib

    matplotlib.use("Agg")
    from linattn_lib.chapters.plots import plot_attention_approximations

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(12, 8, generator=g) * 0.5 for _ in range(3))
    views = {kind: E.feature_attention_view(q, k, v, m=256, kind=kind, seed=1, causal=True) for kind in ("trig", "positive")}
    for view in views.values():
        assert view["approx"].shape == (12, 12) and view["row_tv"].shape == (12,)
        assert torch.allclose(view["approx"].sum(-1), torch.ones(12), atol=1e-5)
        assert torch.equal(view["approx"].triu(1), torch.zeros(12, 12))
    assert views["positive"]["negative"] == 0.0
    small = E.feature_attention_view(q, k, v, m=4, kind="positive", seed=1)
    assert views["positive"]["output_error"] < small["output_error"]
    fig = plot_attention_approximations(
        views["positive"]["exact"],
        {kind: view["approx"] for kind, view in views.items()},
        row_errors={kind: view["row_tv"] for kind, view in views.items()},
        suptitle="m = 256",
    )
    assert len(fig.axes) == 4
    matplotlib.pyplot.close(fig)
    with pytest.raises(ValueError, match="q"):
        E.feature_attention_view(q[None], k, v, m=4)
