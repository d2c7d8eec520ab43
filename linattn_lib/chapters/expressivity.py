"""What linear attention can express, and what it saves (chapter 7).

Two facts carry the chapter:

* **rank.** The (non-causal) linear-attention matrix D^-1 phi(Q) phi(K)^T is a product through
  an m-dimensional feature space, so its rank is at most m, however long the sequence. The
  softmax matrix exp(Q K^T / sqrt(d)) / Z is generically full rank even for a small head
  dimension d. By Eckart-Young, no rank-m matrix is closer to the T x T identity than
  sqrt(T - m) in Frobenius norm, while a sharpened softmax gets arbitrarily close.
  With a causal mask the matrix tril(phi(Q) phi(K)^T) is no longer low rank, but every block
  strictly below the diagonal still is (it is semiseparable, chapter 6).
* **cost.** Exact attention costs ~4 T^2 d FLOPs per layer, linear attention ~4 T m d: the
  ratio is ~T/m, *linear* in T. Projections and the feed-forward block cost the same in both,
  which pulls the whole-layer ratio down further. (`attention_layer_flops` and `flop_ratio`
  are defined in `linattn_lib.flops` and re-exported here.)

All functions compute in float64 where precision matters and accept (T, T) matrices or
batches (..., T, T).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ..flops import attention_layer_flops, flop_ratio  # noqa: F401  (re-exported for chapter 7)

DEFAULT_RTOL = 1e-10


def singular_values(A: Tensor) -> Tensor:
    """Singular values of the last two dimensions, in float64, largest first."""
    if A.dim() < 2:
        raise ValueError(f"singular_values: `A` must have at least 2 dimensions, got shape {tuple(A.shape)}")
    return torch.linalg.svdvals(A.to(torch.float64))


def numerical_rank(A: Tensor, *, rtol: float = DEFAULT_RTOL) -> int:
    """Number of singular values above rtol * (largest singular value), for one matrix.

    rtol = 1e-10 sits far above float64 round-off (~1e-16 relative) for the sizes used here,
    and far below the smallest singular values of the full-rank matrices the chapter shows.
    """
    if A.dim() != 2:
        raise ValueError(f"numerical_rank: `A` must be one matrix (2 dimensions), got shape {tuple(A.shape)}")
    s = singular_values(A)
    return int((s > rtol * s[0]).sum().item()) if s[0] > 0 else 0


def low_rank_error(A: Tensor, r: int) -> float:
    """Frobenius distance from A to the nearest matrix of rank <= r (Eckart-Young-Mirsky).

    It is sqrt(sum_{i > r} sigma_i^2): a lower bound on ||A - B||_F for *every* B of rank <= r.
    """
    if A.dim() != 2:
        raise ValueError(f"low_rank_error: `A` must be one matrix, got shape {tuple(A.shape)}")
    if not isinstance(r, int) or r < 0:
        raise ValueError(f"low_rank_error: `r` must be a non-negative int, got {r!r}")
    s = singular_values(A)
    return float(s[r:].pow(2).sum().sqrt())


def identity_distance_bound(T: int, m: int) -> float:
    """sqrt(T - m): no matrix of rank <= m is closer than this to the T x T identity."""
    if not (isinstance(T, int) and isinstance(m, int) and T >= 1 and m >= 0):
        raise ValueError(f"identity_distance_bound: need ints T >= 1 and m >= 0, got T={T!r}, m={m!r}")
    return math.sqrt(max(T - m, 0))


def sharpened_softmax(q: Tensor, k: Tensor, beta: float, *, causal: bool = False) -> Tensor:
    """softmax(beta * q k^T) over the last dimension, for q, k of shape (..., T, d).

    As beta grows, each row concentrates on its largest logit; with q = k = distinct unit
    vectors, that is the diagonal, so the matrix tends to the identity.
    """
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"sharpened_softmax: q {tuple(q.shape)} and k {tuple(k.shape)} must share the last dimension")
    scores = beta * (q.to(torch.float64) @ k.to(torch.float64).transpose(-1, -2))
    if causal:
        T, S = scores.shape[-2:]
        mask = torch.ones(T, S, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1)


def offdiagonal_rank(A: Tensor, *, rtol: float = DEFAULT_RTOL) -> int:
    """Largest numerical rank of a block A[i:, :i] strictly below the diagonal (over all i).

    For a causal linear-attention matrix tril(phi(Q) phi(K)^T) it is at most m: the matrix is
    m-semiseparable even though the matrix itself is full rank.
    """
    if A.dim() != 2 or A.shape[0] != A.shape[1]:
        raise ValueError(f"offdiagonal_rank: `A` must be one square matrix, got shape {tuple(A.shape)}")
    if A.shape[0] < 2:
        return 0  # a 1 x 1 matrix has no block below its diagonal
    return max(numerical_rank(A[i:, :i], rtol=rtol) for i in range(1, A.shape[0]))


# --------------------------------------------------------------------------------------
# capacity: a fixed-size state as an associative memory
# --------------------------------------------------------------------------------------


def memory_recall_accuracy(n: int, m: int, *, kind: str = "linear", vocab: int = 64, trials: int = 20, seed: int = 0,
                           beta: float = 50.0) -> float:
    """Store n key -> value pairs, read each value back with its own key, decode it; return the hit rate.

    Keys are random unit vectors in R^m; each value is one of `vocab` random unit vectors in R^m
    (a value vocabulary, drawn with replacement), so the state holds m x m numbers.
    kind="linear": the state S = sum_j k_j v_j^T, read out as k_i^T S = v_i + sum_{j != i}
    (k_i . k_j) v_j: exact when the keys are orthogonal (possible only for n <= m), blurred by
    the cross-talk otherwise, whose size grows like sqrt(n / m).
    kind="softmax": softmax(beta k_i^T K) V over all n stored keys (a cache that grows with n):
    the key's own dot product (1) is the largest, so for large beta the read-out is v_i.
    The read-out is decoded to the nearest vocabulary vector (largest dot product); a hit is the
    right value. Averaged over `trials` seeded draws.
    """
    if kind not in ("linear", "softmax"):
        raise ValueError(f"memory_recall_accuracy: kind must be 'linear' or 'softmax', got {kind!r}")
    for name, val in (("n", n), ("m", m), ("vocab", vocab), ("trials", trials)):
        if not isinstance(val, int) or val < 1:
            raise ValueError(f"memory_recall_accuracy: `{name}` must be a positive int, got {val!r}")
    g = torch.Generator().manual_seed(seed)
    unit = lambda *shape: torch.nn.functional.normalize(torch.randn(*shape, generator=g, dtype=torch.float64), dim=-1)
    hits = 0
    for _ in range(trials):
        K, codebook = unit(n, m), unit(vocab, m)
        labels = torch.randint(0, vocab, (n,), generator=g)
        V = codebook[labels]
        if kind == "linear":
            out = K @ (K.T @ V)  # read-out through the m x m state
        else:
            out = torch.softmax(beta * K @ K.T, dim=-1) @ V
        hits += ((out @ codebook.T).argmax(-1) == labels).sum().item()
    return hits / (n * trials)
