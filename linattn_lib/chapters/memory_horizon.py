"""How far back a decayed recurrence remembers: the memory horizon of a decay (chapter 6).

With a per-step decay gamma = exp(g) <= 1 (RetNet's gamma_h, SSD's a_t = exp(dt A)), the
mixing weight of a token seen `lag` steps ago is gamma**lag. Three numbers summarise it:

* `effective_window(gamma)` = sum_{lag >= 0} gamma**lag = 1 / (1 - gamma): the total weight,
  i.e. "how many tokens' worth" the state holds; infinite without decay;
* `half_life(gamma)` = ln 2 / -ln gamma: the lag at which the weight has halved;
* `memory_horizon(gamma, threshold)`: the first lag whose weight is below `threshold`.

`horizon_from_mask` measures the same thing on a materialised (T, T) decay mask, which also
covers data-dependent decays, where the horizon differs from row to row.
`state_norm_trajectory` measures the state that these weights sum into (is it bounded?).
Everything takes plain floats or tensors of log-decays; nothing here is model-specific.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..core.linear import linear_attention
from ..core.state import LinearAttentionState

__all__ = [
    "effective_window",
    "half_life",
    "memory_horizon",
    "lag_weights",
    "horizon_from_mask",
    "continuous_horizon",
    "state_norm_trajectory",
    "bounded_state_norm",
    "horizon_table",
]


def _check_gamma(fn: str, gamma: float) -> float:
    gamma = float(gamma)
    if not (0.0 < gamma <= 1.0) or math.isnan(gamma):
        raise ValueError(f"{fn}: `gamma` must be a decay factor in (0, 1], got {gamma!r}")
    return gamma


def _check_threshold(fn: str, threshold: float) -> float:
    threshold = float(threshold)
    if not (0.0 < threshold < 1.0):
        raise ValueError(f"{fn}: `threshold` must lie in (0, 1) (a fraction of the lag-0 weight), got {threshold!r}")
    return threshold


def effective_window(gamma: float) -> float:
    """Total mixing weight sum_{lag >= 0} gamma**lag = 1 / (1 - gamma); inf for gamma = 1.

    For RetNet's gamma_h = 1 - 2^(-5-h) this is exactly 2^(5+h) tokens.
    """
    gamma = _check_gamma("effective_window", gamma)
    return math.inf if gamma == 1.0 else 1.0 / (1.0 - gamma)


def half_life(gamma: float) -> float:
    """The lag ln 2 / (-ln gamma) at which gamma**lag = 1/2 (not rounded); inf for gamma = 1."""
    gamma = _check_gamma("half_life", gamma)
    return math.inf if gamma == 1.0 else math.log(2.0) / -math.log(gamma)


def memory_horizon(gamma: float, threshold: float = 0.01) -> float:
    """The smallest integer lag whose weight gamma**lag is below `threshold`; inf for gamma = 1.

    Equal to floor(ln threshold / ln gamma) + 1, computed with a check of the boundary so that
    rounding in the logarithms cannot move it by one. Returned as a float so that the
    no-decay case can be math.inf; finite results are whole numbers.
    """
    fn = "memory_horizon"
    gamma = _check_gamma(fn, gamma)
    threshold = _check_threshold(fn, threshold)
    if gamma == 1.0:
        return math.inf
    lag = math.floor(math.log(threshold) / math.log(gamma)) + 1
    while lag > 0 and gamma ** (lag - 1) < threshold:  # rounding put us one too far
        lag -= 1
    while gamma**lag >= threshold:  # or one too short
        lag += 1
    return float(lag)


def lag_weights(log_decay: float, max_lag: int, *, dtype: torch.dtype = torch.float64) -> Tensor:
    """Weights exp(lag * log_decay) for lag = 0..max_lag: one row of a constant decay mask, read backwards."""
    fn = "lag_weights"
    if not isinstance(max_lag, int) or max_lag < 0:
        raise ValueError(f"{fn}: `max_lag` must be a non-negative int, got {max_lag!r}")
    log_decay = float(log_decay)
    if log_decay > 0 or math.isnan(log_decay):
        raise ValueError(f"{fn}: `log_decay` must be <= 0 (a decay exp(log_decay) <= 1), got {log_decay!r}")
    lags = torch.arange(max_lag + 1, dtype=dtype)
    w = torch.exp(lags * log_decay)
    w[0] = 1.0  # lag 0 is the token itself, whatever the decay (0 * -inf would be NaN)
    return w


def horizon_from_mask(L: Tensor, threshold: float = 0.01) -> Tensor:
    """Per-row memory horizon of a lower-triangular decay mask L (..., T, T), as a long tensor (..., T).

    Row i's horizon is the smallest lag l with L[i, i - l] < threshold * L[i, i]. Since a decay
    mask's row is non-increasing going back in time, that is the number of entries at or
    above the threshold. When row i never drops below it (the history is too short to
    tell), the result is i + 1: a lower bound, "at least the whole prefix".
    """
    fn = "horizon_from_mask"
    threshold = _check_threshold(fn, threshold)
    if not isinstance(L, Tensor) or L.dim() < 2 or L.shape[-1] != L.shape[-2]:
        shape = tuple(L.shape) if isinstance(L, Tensor) else type(L).__name__
        raise ValueError(f"{fn}: `L` must be a (..., T, T) tensor, got {shape}")
    T = L.shape[-1]
    diag = torch.diagonal(L, dim1=-2, dim2=-1).unsqueeze(-1)  # (..., T, 1)
    causal = torch.ones(T, T, dtype=torch.bool, device=L.device).tril()
    kept = (L >= threshold * diag) & causal
    return kept.sum(-1)


def continuous_horizon(A: float, threshold: float = 0.01) -> float:
    """Memory horizon in continuous time of dh/dt = A h (A < 0): ln(1/threshold) / -A time units.

    A ZOH step of size dt turns it into gamma = exp(dt A), so the horizon in *steps* is about
    this divided by dt: a large step (Mamba's selective dt) forgets in few steps, a small one
    remembers for many.
    """
    fn = "continuous_horizon"
    threshold = _check_threshold(fn, threshold)
    A = float(A)
    if not A < 0:
        raise ValueError(f"{fn}: `A` must be < 0 (a decaying mode), got {A!r}")
    return math.log(1.0 / threshold) / -A


def state_norm_trajectory(
    k: Tensor,
    v: Tensor,
    *,
    log_decay: Tensor | None = None,
    every: int = 64,
) -> tuple[list[int], Tensor, Tensor]:
    """Frobenius norms of the linear-attention state S_t and of the normaliser z_t along a sequence.

    Runs `linear_attention` piece by piece (`every` tokens at a time, each piece in the
    quadratic form), resuming each piece from the previous piece's state, and records the
    state after each piece:

        S_t = gamma S_{t-1} + k_t v_t^T,    z_t = gamma z_{t-1} + k_t.

    Args:
        k: (B, H, T, Dk) key features; v: (B, H, T, Dv).
        log_decay: None (no decay) or (H,) per-head log decay <= 0.
        every: how many tokens between two measurements.

    Returns (ts, S_norms, z_norms): the positions t (1-based counts of tokens seen) and two
    tensors of shape (len(ts), B, H).
    """
    fn = "state_norm_trajectory"
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"{fn}: `every` must be a positive int, got {every!r}")
    if log_decay is not None and log_decay.dim() != 1:
        raise ValueError(f"{fn}: `log_decay` must have shape (H,) here, got {tuple(log_decay.shape)}")
    T = k.shape[2]
    state: LinearAttentionState | None = None
    ts: list[int] = []
    S_norms, z_norms = [], []
    q_dummy = torch.ones_like(k[:, :, :every])
    for start in range(0, T, every):
        piece = slice(start, min(start + every, T))
        n = piece.stop - piece.start
        _, state = linear_attention(
            q_dummy[:, :, :n], k[:, :, piece], v[:, :, piece], causal=True, normalize=True,
            log_decay=log_decay, form="quadratic",
            initial_state=state, return_state=True,
        )
        ts.append(piece.stop)
        S_norms.append(torch.linalg.matrix_norm(state.S))
        z_norms.append(torch.linalg.vector_norm(state.z, dim=-1))
    return ts, torch.stack(S_norms), torch.stack(z_norms)


def bounded_state_norm(max_outer_norm: float, gamma: float) -> float:
    """Upper bound max_t ||k_t v_t^T|| / (1 - gamma) on ||S_t|| for any t (inf for gamma = 1).

    From ||S_t|| <= sum_{lag} gamma**lag ||k_{t-lag} v_{t-lag}^T||: the effective window times
    the largest single update.
    """
    return float(max_outer_norm) * effective_window(gamma)


def horizon_table(gammas: Sequence[float], threshold: float = 0.01) -> list[tuple[float, float, float, float]]:
    """(gamma, half-life, memory horizon, effective window) for each gamma: a sweep in one table."""
    return [(g, half_life(g), memory_horizon(g, threshold), effective_window(g)) for g in gammas]
