"""What every form of linear attention shares: the state, the decay and its stable sums.

The causal recurrence behind every module in `core/` (g_t <= 0 is the log-decay, 0 without
decay):

    S_t = exp(g_t) S_{t-1} + k_t v_t^T          (state, Dk x Dv)
    z_t = exp(g_t) z_{t-1} + k_t                (normaliser state, Dk)
    o_t = q_t S_t / (q_t . z_t + eps)           (or q_t S_t when normalize=False)

**The numerics rule.** A decay between positions j < i is exp(g_{j+1} + ... + g_i). It is
always summed over that interval (`segsum`, `suffix_sum`, `sum_after`), never taken as a
difference of prefix sums cumsum(g)[i] - cumsum(g)[j]: after one huge step (a reset,
g = -1e4) both prefix sums are large and their difference keeps only about 1e-3 of absolute
precision in float32. Every exponent is then a sum of non-positive terms: <= 0, no overflow.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

DEFAULT_EPS = 1e-6  # as in Katharopoulos et al.'s fast-transformers: added to the denominator


class LinearAttentionState(NamedTuple):
    """Recurrent state of causal linear attention.

    * S: (B, H, Dk, Dv), the running sum of decayed outer products k_j v_j^T.
    * z: (B, H, Dk), the running sum of decayed keys (None when normalize=False).
    """

    S: Tensor
    z: Tensor | None = None


# torch.load reads only tensors and allow-listed types by default (weights_only=True, torch
# >= 2.6): a saved state (a prompt's, to continue later) loads as it was saved. A named tuple of
# tensors runs no code when it is rebuilt.
torch.serialization.add_safe_globals([LinearAttentionState])


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype the library accumulates in: float64 for float64 input, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def expand_log_decay(
    log_decay: Tensor | None, B: int, H: int, T: int, *,
    dtype: torch.dtype, device: torch.device | str,
) -> Tensor:
    """(H,) or (B, H, T) log-decay as a (B, H, T) tensor; zeros when there is no decay."""
    if log_decay is None:
        return torch.zeros(B, H, T, dtype=dtype, device=device)
    g = log_decay.to(dtype)
    if g.dim() == 1:
        g = g.view(1, H, 1).expand(B, H, T)
    return g


def suffix_sum(x: Tensor, dim: int = -1) -> Tensor:
    """x_j + x_{j+1} + ... + x_last for every j along `dim` (a reverse cumulative sum).

    Each entry is summed from its own terms, so it is as precise as they are (see the
    numerics rule at the top of this module).
    """
    return x.flip(dim).cumsum(dim).flip(dim)


def sum_after(g: Tensor) -> Tensor:
    """g_{j+1} + ... + g_last for every j along the last axis (0 at the last position).

    exp(sum_after(g)) decays each key to the end of its sequence or chunk; it is summed
    from j + 1 on, not taken as cumsum(g)[-1] - cumsum(g)[j].
    """
    return F.pad(suffix_sum(g[..., 1:]), (0, 1))


def noncausal(
    q: Tensor, k: Tensor, v: Tensor, S0: Tensor | None, z0: Tensor | None,
    normalize: bool, eps: float,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Non-causal linear attention: one global state, then one product.

    Returns (o, S, z) with S = S0 + k^T v, z = z0 + sum_t k_t (None unless normalising) and
    o = q S / (q . z + eps), computed in `compute_dtype(q)`. Plain autograd keeps only O(T)
    tensors here, so every backend uses it.
    """
    dtype = compute_dtype(q)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    S = k.transpose(-1, -2) @ v
    if S0 is not None:
        S = S + S0.to(dtype)
    o = q @ S
    z = None
    if normalize:
        z = k.sum(-2) if z0 is None else z0.to(dtype) + k.sum(-2)
        o = o / (q @ z.unsqueeze(-1) + eps)
    return o, S, z


def layout_of(x: Tensor | None) -> tuple | None:
    """(shape, strides) of an input, for `grad_in_layout`; None for None."""
    return None if x is None else (tuple(x.shape), x.stride())


def grad_in_layout(g: Tensor | None, layout: tuple | None) -> Tensor | None:
    """Under torch.compile, a custom backward's gradient in the strides of its input.

    AOT autograd compiles the graph around a custom autograd.Function assuming that the
    gradient of an input has that input's strides; a permuted input (a head split, a
    transposed decay) that gets a contiguous gradient makes the compiled backward's views
    fail. In eager mode the gradient is returned as it is (no copy on the hot path)."""
    if g is None or layout is None or not torch.compiler.is_compiling():
        return g
    shape, stride = layout  # (a gradient's own strides are unknown while Dynamo traces a backward)
    return torch.empty_strided(shape, stride, dtype=g.dtype, device=g.device).copy_(g)
