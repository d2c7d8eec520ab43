"""Shared test inputs: one factory for random q, k, v and one for log-decays.

The repository's top-level conftest.py holds the notebook machinery (nbval, the portability
gate); this one holds what the library tests share. Factories are fixtures returning
functions, so a test asks for `make_qkv` and calls it with the sizes it needs.
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

FEATURES = ("uniform", "normal", "relu", "abs")


def random_qkv(
    B: int = 2, H: int = 3, T: int = 21, Dk: int = 5, Dv: int = 4, *, seed: int = 0,
    features: str = "uniform", dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k (B, H, T, Dk) and v (B, H, T, Dv) from one generator, drawn in that order.

    features: how q and k are drawn: "uniform" U[0, 1) (positive, like phi(x) features),
    "normal" N(0, 1) (signed), "relu" ReLU(N(0, 1)) + 0.05 (non-negative, never all zero),
    "abs" |N(0, 1)|. v is always N(0, 1).
    """
    if features not in FEATURES:
        raise ValueError(f"random_qkv: features must be one of {FEATURES}, got {features!r}")
    g = torch.Generator().manual_seed(seed)

    def feature() -> torch.Tensor:
        if features == "uniform":
            return torch.rand(B, H, T, Dk, generator=g, dtype=torch.float64)
        x = torch.randn(B, H, T, Dk, generator=g, dtype=torch.float64)
        return {"normal": x, "relu": torch.relu(x) + 0.05, "abs": x.abs()}[features]

    q, k = feature(), feature()
    v = torch.randn(B, H, T, Dv, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def random_log_decay(
    kind: str | None, B: int, H: int, T: int, *, seed: int = 1, strength: float = 1.0,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor | None:
    """None, a per-head (H,) or a per-token (B, H, T) log-decay in [-strength, 0]."""
    if kind is None:
        return None
    g = torch.Generator().manual_seed(seed)
    if kind == "head":
        return (-strength * torch.rand(H, generator=g, dtype=torch.float64)).to(dtype)
    if kind == "token":
        return (-strength * torch.rand(B, H, T, generator=g, dtype=torch.float64)).to(dtype)
    raise ValueError(f"random_log_decay: kind must be None, 'head' or 'token', got {kind!r}")


@pytest.fixture
def make_qkv() -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The factory `random_qkv`."""
    return random_qkv


@pytest.fixture
def make_log_decay() -> Callable[..., torch.Tensor | None]:
    """The factory `random_log_decay`."""
    return random_log_decay


def random_inputs(
    B: int = 2, H: int = 3, T: int = 65, Dk: int = 8, Dv: int = 5, *, decay: str | None = None,
    state: bool = False, dtype: torch.dtype = torch.float32, seed: int = 0, grad: bool = False,
) -> tuple:
    """(q, k, v, log_decay, initial_state) for `linear_attention`, drawn in float64, cast.

    q, k: features in [0.1, 1.1); v: N(0, 1); decay: None, "head" (H,) in [-0.5, 0] or
    "token" (B, H, T) in [-1, 0]; state: a random LinearAttentionState (z >= 1) or None.
    """
    from linattn_lib import LinearAttentionState

    q, k, v = random_qkv(B, H, T, Dk, Dv, seed=seed)
    q, k = q + 0.1, k + 0.1
    log_decay = random_log_decay(decay, B, H, T, seed=seed + 1, strength=0.5 if decay == "head" else 1.0)
    init = None
    if state:
        g = torch.Generator().manual_seed(seed + 2)
        init = LinearAttentionState(
            torch.randn(B, H, Dk, Dv, generator=g, dtype=torch.float64),
            torch.rand(B, H, Dk, generator=g, dtype=torch.float64) + 1.0,
        )
    q, k, v = (x.to(dtype).requires_grad_(grad) for x in (q, k, v))
    if log_decay is not None:
        log_decay = log_decay.to(dtype).requires_grad_(grad)
    if init is not None:
        init = LinearAttentionState(*(x.to(dtype).requires_grad_(grad) for x in init))
    return q, k, v, log_decay, init


@pytest.fixture
def make_inputs() -> Callable[..., tuple]:
    """The factory `random_inputs`."""
    return random_inputs


@pytest.fixture
def one_thread():
    """One torch thread for the test: on tiny shapes extra threads only add synchronisation,
    which stalls badly when the machine is busy (benchmarks leave the thread count alone)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
