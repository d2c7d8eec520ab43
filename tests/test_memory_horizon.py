"""Memory horizon of a decay: closed forms == what the decay mask and the state actually do."""

import math

import pytest
import torch

from linattn_lib import decay_mask, linear_attention, retnet_log_decay
from linattn_lib.chapters.memory_horizon import (
    bounded_state_norm,
    continuous_horizon,
    effective_window,
    half_life,
    horizon_from_mask,
    horizon_table,
    lag_weights,
    memory_horizon,
    state_norm_trajectory,
)


@pytest.mark.parametrize("gamma", [0.5, 0.8, 0.9, 0.95, 0.99, 0.999])
@pytest.mark.parametrize("threshold", [0.5, 0.1, 0.01, 1e-4])
def test_horizon_is_the_first_lag_below_threshold(gamma, threshold):
    h = memory_horizon(gamma, threshold)
    assert h == int(h) and h >= 1
    w = lag_weights(math.log(gamma), int(h) + 1)
    assert w[int(h)] < threshold <= w[int(h) - 1]


def test_exact_boundaries_and_no_decay():
    # gamma**1 == threshold exactly: the weight is not *below* it, so the horizon is 2
    assert memory_horizon(0.5, 0.5) == 2.0
    assert memory_horizon(0.5, 0.25) == 3.0
    assert memory_horizon(1.0) == math.inf
    assert effective_window(1.0) == math.inf and half_life(1.0) == math.inf


def test_effective_window_is_the_sum_of_weights_and_retnet_is_a_power_of_two():
    for gamma in (0.5, 0.9, 0.99):
        total = lag_weights(math.log(gamma), 20000).sum().item()
        assert abs(total - effective_window(gamma)) < 1e-9 * effective_window(gamma)
    gammas = torch.exp(retnet_log_decay(8, dtype=torch.float64))
    for h, g in enumerate(gammas.tolist()):
        assert abs(effective_window(g) - 2.0 ** (5 + h)) < 1e-9 * 2.0 ** (5 + h)


def test_half_life_halves():
    for gamma in (0.5, 0.9, 0.97):
        assert abs(gamma ** half_life(gamma) - 0.5) < 1e-12


def test_horizon_from_mask_matches_closed_form_and_censors_short_rows():
    gamma, thr, T = 0.9, 0.01, 100
    L = decay_mask(torch.full((T,), math.log(gamma), dtype=torch.float64))
    h = horizon_from_mask(L, thr)
    expect = int(memory_horizon(gamma, thr))
    assert torch.all(h[expect:] == expect)
    assert torch.equal(h[:expect], torch.arange(1, expect + 1))  # history too short: i + 1
    # no decay: every row keeps its whole prefix
    assert torch.equal(horizon_from_mask(decay_mask(torch.zeros(T, dtype=torch.float64)), thr), torch.arange(1, T + 1))


def test_horizon_from_mask_follows_a_data_dependent_decay():
    g = torch.full((40,), math.log(0.99), dtype=torch.float64)
    g[20] = -50.0  # a "reset" token: everything before position 20 is forgotten
    h = horizon_from_mask(decay_mask(g), 0.01)
    assert torch.equal(h[20:], torch.arange(1, 21))  # rows after the reset see back to it only
    assert h.dim() == 1 and horizon_from_mask(decay_mask(g.expand(3, 40)), 0.01).shape == (3, 40)


def test_continuous_horizon_matches_discrete_steps_for_small_dt():
    A, thr = -2.0, 0.01
    tau = continuous_horizon(A, thr)
    for dt in (0.1, 0.01, 0.001):
        steps = memory_horizon(math.exp(dt * A), thr)
        assert abs(steps * dt - tau) <= dt + 1e-12  # within one step


def test_state_norm_grows_without_decay_and_stays_bounded_with_it():
    torch.manual_seed(0)
    T = 2048
    k = torch.nn.functional.elu(torch.randn(1, 2, T, 4, dtype=torch.float64)) + 1
    v = torch.randn(1, 2, T, 3, dtype=torch.float64)
    ts, S, z = state_norm_trajectory(k, v, every=256)
    assert ts[-1] == T and S.shape == (T // 256, 1, 2)
    assert torch.all(z[-1] > 6 * z[0])  # the normaliser grows linearly (8x the tokens)
    gamma = 0.95
    log_decay = torch.full((2,), math.log(gamma), dtype=torch.float64)
    _, S_d, z_d = state_norm_trajectory(k, v, log_decay=log_decay, every=256)
    bound = bounded_state_norm((k.norm(dim=-1) * v.norm(dim=-1)).max().item(), gamma)
    assert S_d.max().item() <= bound
    assert torch.all(z_d[-1] < 1.5 * z_d[0])  # flat once past the effective window
    # and the trajectory is the state linear_attention returns in one call
    _, state = linear_attention(torch.ones_like(k), k, v, log_decay=log_decay, form="quadratic", return_state=True)
    assert torch.allclose(torch.linalg.matrix_norm(state.S), S_d[-1], rtol=1e-12, atol=0)


def test_table_and_errors():
    rows = horizon_table([0.5, 1.0])
    assert rows[0] == (0.5, 1.0, 7.0, 2.0) and rows[1][2] == math.inf
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="gamma"):
            memory_horizon(bad)
    with pytest.raises(ValueError, match="threshold"):
        memory_horizon(0.9, 1.0)
    with pytest.raises(ValueError, match="log_decay"):
        lag_weights(0.1, 3)
    with pytest.raises(ValueError, match="A"):
        continuous_horizon(0.0)
    with pytest.raises(ValueError, match="T, T"):
        horizon_from_mask(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="every"):
        state_norm_trajectory(torch.ones(1, 1, 4, 2), torch.ones(1, 1, 4, 2), every=0)


def test_lag_weights_with_a_full_reset():
    from linattn_lib.chapters.memory_horizon import lag_weights

    assert lag_weights(float("-inf"), 3).tolist() == [1.0, 0.0, 0.0, 0.0]
