"""What attention knows about token order: permutation equivariance and invariance, checked.

A sequence map f sends X (T tokens along `dim`) to Y of the same length. Reorder the tokens
with a permutation P:

* f is **permutation-equivariant** when f(PX) = P f(X): reordering the input reorders the
  output the same way and changes nothing else. Non-causal attention without positions,
  softmax or linear, is equivariant: it sees a *set* of tokens.
* f is **permutation-invariant** when f(PX) = f(X). No per-token attention output is, but a
  pooled quantity can be: the final state of causal linear attention, sum_j phi(k_j) v_j^T.
* A causal mask breaks both: the output at position i depends on which tokens come before i.

`self_attention` builds small single-head self-attention layers from token embeddings (so the
permutation acts on X, as in the texts), and `order_report` checks each property numerically.
Once positions are put back, `local_mass` measures how much of the attention mass stays near the
diagonal (the locality that cosFormer's re-weighting is meant to add).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.features import elu_plus_one
from ..core.linear import linear_attention
from ..core.softmax import softmax_attention

SequenceMap = Callable[[Tensor], Tensor]
ATTENTION_KINDS = ("softmax", "linear")


def random_permutation(T: int, *, seed: int = 0, device: torch.device | str | None = None) -> Tensor:
    """A random permutation of 0..T-1 (a LongTensor) that is never the identity for T >= 2."""
    if not isinstance(T, int) or T < 1:
        raise ValueError(f"random_permutation: `T` must be a positive int, got {T!r}")
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(T, generator=g)
    if T >= 2 and bool((perm == torch.arange(T)).all()):
        perm = perm.roll(1)
    return perm.to(device)


def permute(x: Tensor, perm: Tensor, *, dim: int = -2) -> Tensor:
    """(P x): the tokens of x along `dim` reordered so that position i holds old token perm[i]."""
    if perm.dim() != 1 or perm.numel() != x.shape[dim]:
        raise ValueError(
            f"permute: `perm` must be a 1-d permutation of the {x.shape[dim]} positions along dim={dim}, "
            f"got shape {tuple(perm.shape)}"
        )
    if not bool((perm.sort().values == torch.arange(perm.numel(), device=perm.device)).all()):
        raise ValueError("permute: `perm` is not a permutation (every position 0..T-1 exactly once)")
    return x.index_select(dim, perm.to(x.device))


def equivariance_error(f: SequenceMap, x: Tensor, perm: Tensor, *, dim: int = -2) -> float:
    """max |f(P x) - P f(x)|: zero (up to rounding) exactly when f commutes with this reordering."""
    return float((f(permute(x, perm, dim=dim)) - permute(f(x), perm, dim=dim)).abs().max())


def invariance_error(f: SequenceMap, x: Tensor, perm: Tensor, *, dim: int = -2) -> float:
    """max |f(P x) - f(x)|: zero exactly when reordering the input leaves f's output unchanged."""
    return float((f(permute(x, perm, dim=dim)) - f(x)).abs().max())


@dataclass
class OrderCheck:
    """One row of `order_report`: the two errors and what they mean at the tolerance used."""

    name: str
    equivariance_error: float | None
    invariance_error: float
    equivariant: bool | None
    invariant: bool


def order_report(
    maps: Mapping[str, SequenceMap],
    x: Tensor,
    perm: Tensor,
    *,
    dim: int = -2,
    atol: float = 1e-10,
    pooled: tuple[str, ...] = (),
) -> list[OrderCheck]:
    """Check each named map for equivariance and invariance under `perm`.

    Maps named in `pooled` return something without a token axis (a final state, a mean):
    only invariance applies to them, and their equivariance fields are None.
    `atol` should sit far above rounding (float64 rounding is ~1e-15) and far below the
    O(1) errors that a genuine order dependence produces.
    """
    rows = []
    for name, f in maps.items():
        inv = invariance_error(f, x, perm, dim=dim)
        eqv = None if name in pooled else equivariance_error(f, x, perm, dim=dim)
        rows.append(OrderCheck(name, eqv, inv, None if eqv is None else eqv <= atol, inv <= atol))
    return rows


@dataclass
class SelfAttentionWeights:
    """Projection matrices of a single-head self-attention layer: X (T, d) -> Q, K, V."""

    W_q: Tensor
    W_k: Tensor
    W_v: Tensor

    @classmethod
    def random(cls, d: int, dk: int, dv: int, *, seed: int = 0, dtype: torch.dtype = torch.float64) -> SelfAttentionWeights:
        """Gaussian projections scaled by 1/sqrt(d) (so that q, k, v have O(1) entries)."""
        g = torch.Generator().manual_seed(seed)
        return cls(*(torch.randn(d, n, generator=g, dtype=dtype) / d**0.5 for n in (dk, dk, dv)))


def self_attention(
    weights: SelfAttentionWeights,
    *,
    kind: str = "softmax",
    causal: bool = False,
    feature_map: Callable[[Tensor], Tensor] = elu_plus_one,
    return_state: bool = False,
) -> SequenceMap:
    """A map X -> Y for X of shape (T, d) (or (B, T, d)): one head, no positions.

    kind="softmax": softmax(Q K^T / sqrt(dk)) V;  kind="linear": linear attention over
    feature_map(Q), feature_map(K) (elu + 1 by default), normalised, in the chunked form.
    With return_state=True (kind="linear" only) the map returns the final state
    S = sum_j phi(k_j) v_j^T instead of the outputs (the same for causal and non-causal).
    """
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"self_attention: `kind` must be one of {ATTENTION_KINDS}, got {kind!r}")
    if return_state and kind != "linear":
        raise ValueError("self_attention: return_state=True needs kind='linear' (softmax has no fixed-size state)")

    def f(X: Tensor) -> Tensor:
        if X.dim() not in (2, 3):
            raise ValueError(f"self_attention: X must be (T, d) or (B, T, d), got shape {tuple(X.shape)}")
        Xb = X.reshape(-1, 1, X.shape[-2], X.shape[-1])  # (B, 1, T, d): one head
        q, k, v = (Xb @ W for W in (weights.W_q, weights.W_k, weights.W_v))
        if kind == "softmax":
            y = softmax_attention(q, k, v, causal=causal)
        else:
            out = linear_attention(feature_map(q), feature_map(k), v, causal=causal, return_state=return_state)
            if return_state:
                S = out[1].S  # (B, 1, Dk, Dv)
                return S.reshape(*X.shape[:-2], *S.shape[-2:])
            y = out
        return y.reshape(*X.shape[:-1], y.shape[-1])

    return f


def local_mass(A: Tensor, widths: int | Sequence[int], *, first_row: int = 0) -> Tensor:
    """Share of each row's attention mass within distance w of the diagonal, averaged over rows.

    For every width w: mean over rows i >= first_row of sum_{|i-j| <= w} |A_ij| / sum_j |A_ij|.
    Magnitudes are used so that weights of either sign count as mass. Rows whose total is zero
    are skipped. Starting at a later row (e.g. T // 2) avoids the early rows of a causal matrix,
    which are local whatever the mechanism because they have few keys.

    Args:
        A: (..., T, T) attention weights (leading dimensions are averaged over too).
        widths: one width or a sequence of widths (non-negative ints).
        first_row: the first query row included.
    Returns a float64 tensor with one share in [0, 1] per width.
    """
    if A.dim() < 2 or A.shape[-1] != A.shape[-2]:
        raise ValueError(f"local_mass: `A` must be (..., T, T), got shape {tuple(A.shape)}")
    T = A.shape[-1]
    if not isinstance(first_row, int) or not 0 <= first_row < T:
        raise ValueError(f"local_mass: `first_row` must be an int in [0, {T - 1}], got {first_row!r}")
    ws = [widths] if isinstance(widths, int) else list(widths)
    if not ws or any(not isinstance(w, int) or w < 0 for w in ws):
        raise ValueError(f"local_mass: `widths` must be non-negative ints, got {widths!r}")
    i = torch.arange(T, device=A.device)
    dist = (i[:, None] - i[None, :]).abs()[first_row:]
    mag = A.detach().abs().to(torch.float64).reshape(-1, T, T)[:, first_row:]
    total = mag.sum(-1)
    keep = total > 0
    if not bool(keep.any()):
        raise ValueError(f"local_mass: every row of `A` from row {first_row} on is zero: there is no mass to share")
    shares = [((mag * (dist <= w)).sum(-1)[keep] / total[keep]).mean() for w in ws]
    return torch.stack(shares)
