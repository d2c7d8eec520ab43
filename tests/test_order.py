"""Permutation equivariance / invariance checks (linattn_lib.chapters.order)."""
import pytest
import torch

from linattn_lib.chapters.order import (
    SelfAttentionWeights,
    equivariance_error,
    invariance_error,
    order_report,
    permute,
    random_permutation,
    self_attention,
)


@pytest.fixture
def setup():
    torch.manual_seed(0)
    X = torch.randn(12, 8, dtype=torch.float64)
    W = SelfAttentionWeights.random(8, 6, 5, seed=1)
    return X, W, random_permutation(12, seed=3)


def test_random_permutation_is_not_identity():
    for seed in range(20):
        p = random_permutation(5, seed=seed)
        assert sorted(p.tolist()) == list(range(5))
        assert p.tolist() != list(range(5))


def test_permute_rejects_non_permutations():
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match="not a permutation"):
        permute(x, torch.tensor([0, 0, 1, 2]))
    with pytest.raises(ValueError, match="1-d permutation"):
        permute(x, torch.tensor([0, 1, 2]))


def test_noncausal_equivariant_causal_not(setup):
    X, W, perm = setup
    for kind in ("softmax", "linear"):
        assert equivariance_error(self_attention(W, kind=kind, causal=False), X, perm) < 1e-12
        assert equivariance_error(self_attention(W, kind=kind, causal=True), X, perm) > 1e-3
        for causal in (False, True):
            assert invariance_error(self_attention(W, kind=kind, causal=causal), X, perm) > 1e-3


def test_final_state_invariant_for_both_masks(setup):
    X, W, perm = setup
    for causal in (False, True):
        f = self_attention(W, kind="linear", causal=causal, return_state=True)
        assert f(X).shape == (6, 5)
        assert invariance_error(f, X, perm) < 1e-12


def test_order_report_and_batched_input(setup):
    X, W, perm = setup
    maps = {
        "softmax": self_attention(W, kind="softmax"),
        "state": self_attention(W, kind="linear", causal=True, return_state=True),
    }
    rows = order_report(maps, X.expand(2, -1, -1), perm, pooled=("state",))
    assert rows[0].equivariant and not rows[0].invariant
    assert rows[1].equivariant is None and rows[1].invariant


def test_self_attention_rejects_bad_kind(setup):
    _, W, _ = setup
    with pytest.raises(ValueError, match="kind"):
        self_attention(W, kind="cos")
    with pytest.raises(ValueError, match="return_state"):
        self_attention(W, kind="softmax", return_state=True)


def test_local_mass():
    from linattn_lib.chapters.order import local_mass

    T = 6
    eye = torch.eye(T)
    assert torch.allclose(local_mass(eye, [0, 2]), torch.ones(2, dtype=torch.float64))
    uniform = torch.ones(T, T).tril() / torch.arange(1, T + 1)[:, None]  # causal average
    # row i (0-based) has i + 1 keys, min(w + 1, i + 1) of them within distance w
    expected = torch.tensor([sum(min(w + 1, i + 1) / (i + 1) for i in range(3, T)) / 3 for w in (0, 1, 5)], dtype=torch.float64)
    assert torch.allclose(local_mass(uniform, (0, 1, 5), first_row=3), expected)
    assert local_mass(-eye, 0).item() == 1.0  # magnitudes count
    with pytest.raises(ValueError, match="first_row"):
        local_mass(eye, 0, first_row=T)
    with pytest.raises(ValueError, match="widths"):
        local_mass(eye, [-1])


def test_local_mass_of_an_all_zero_matrix_is_an_error_not_nan():
    import pytest
    import torch

    from linattn_lib.chapters.order import local_mass

    with pytest.raises(ValueError, match="no mass"):
        local_mass(torch.zeros(3, 3), 1)
