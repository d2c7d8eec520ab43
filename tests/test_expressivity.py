"""Rank of attention matrices, the Eckart-Young bound, semiseparability, and the FLOP ratio."""
import math

import pytest
import torch

from linattn_lib import elu_plus_one, softmax_attention_weights
from linattn_lib.chapters.estimators import approx_attention_weights
from linattn_lib.chapters.expressivity import (
    attention_layer_flops,
    flop_ratio,
    identity_distance_bound,
    low_rank_error,
    numerical_rank,
    offdiagonal_rank,
    sharpened_softmax,
    singular_values,
)

D = torch.float64


def test_linear_matrix_has_rank_at_most_m_softmax_is_full_rank():
    g = torch.Generator().manual_seed(0)
    T, d = 48, 6
    q, k = torch.randn(T, d, generator=g, dtype=D), torch.randn(T, d, generator=g, dtype=D)
    lin = approx_attention_weights(elu_plus_one(q), elu_plus_one(k))
    soft = softmax_attention_weights(q[None, None], k[None, None])[0, 0]
    assert numerical_rank(lin) == d
    assert numerical_rank(soft) == T
    s = singular_values(lin)
    assert s[d:].max() < 1e-12 * s[0]


def test_causal_linear_matrix_is_full_rank_but_semiseparable():
    g = torch.Generator().manual_seed(1)
    T, m = 24, 3
    fq, fk = (elu_plus_one(torch.randn(T, m, generator=g, dtype=D)) for _ in range(2))
    A = torch.tril(fq @ fk.T)
    assert numerical_rank(A) == T  # positive diagonal: triangular and invertible
    assert offdiagonal_rank(A) == m


def test_eckart_young_bound_on_the_identity():
    T, m = 20, 5
    I = torch.eye(T, dtype=D)
    assert low_rank_error(I, m) == pytest.approx(identity_distance_bound(T, m))
    assert identity_distance_bound(T, m) == pytest.approx(math.sqrt(15))
    # a random rank-m matrix is no closer
    g = torch.Generator().manual_seed(2)
    B = torch.randn(T, m, generator=g, dtype=D) @ torch.randn(m, T, generator=g, dtype=D)
    assert (I - B).norm() >= identity_distance_bound(T, m)


def test_sharpened_softmax_tends_to_the_identity():
    g = torch.Generator().manual_seed(3)
    T, d = 32, 4
    x = torch.nn.functional.normalize(torch.randn(T, d, generator=g, dtype=D), dim=-1)
    errs = [(sharpened_softmax(x, x, b) - torch.eye(T, dtype=D)).norm().item() for b in (1.0, 10.0, 100.0, 10000.0)]
    assert all(a > b for a, b in zip(errs, errs[1:]))
    assert errs[-1] < 1e-6
    assert errs[-1] < identity_distance_bound(T, d)  # beats every rank-d matrix


def test_flop_ratio_is_linear_in_T():
    r = [flop_ratio(T, 64, 1, 64, core_only=True) for T in (512, 1024, 2048, 4096)]
    for a, b in zip(r, r[1:]):
        assert b / a == pytest.approx(2.0, rel=0.01)
    assert r[0] == pytest.approx(512 / 64, rel=0.02)
    # whole layers: projections and FFN are shared, so the ratio is much smaller
    assert flop_ratio(512, 1024, 16, 64) < 1.1
    assert attention_layer_flops(512, 64, 1, m=64) < attention_layer_flops(512, 64, 1)


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="one matrix"):
        numerical_rank(torch.zeros(2, 3, 3))
    with pytest.raises(ValueError, match="divisible"):
        attention_layer_flops(8, 10, 3)
    with pytest.raises(ValueError, match="square"):
        offdiagonal_rank(torch.zeros(3, 4))
