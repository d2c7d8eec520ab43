"""Character n-gram baselines for the char-LM experiment (chapter 8): what counting alone
reaches on the same split, scored on the same validation characters as the models.

Smoothing is interpolated Witten-Bell (Witten & Bell 1991; the interpolated form of Chen &
Goodman 1999, eq. 16). For a context h of k characters and its shorter context h' (the last
k - 1 of them),

    p(w | h) = (c(h, w) + N1+(h) p(w | h')) / (c(h) + N1+(h)),

where c(h, w) counts h followed by w in the training text, c(h) = sum_w c(h, w), and N1+(h)
is the number of distinct characters seen after h; a context never seen in training
(c(h) = 0) falls back to p(w | h'). The recursion starts from the uniform distribution over
the vocabulary, so every character, even one the training text never has, gets a non-zero
probability, and every p(. | h) sums to one. It has no parameter to tune.

Order n means n - 1 characters of context: order 1 is a (smoothed) unigram, order 2 a bigram.
The training text is one stream (contexts run across docstring boundaries, as the models'
random windows do). Scoring (`bits_per_char`) uses exactly the targets of
`charlm.validation_loss` at a context length ctx: val[1 : n*ctx + 1] with n = (len(val) - 1)
// ctx. With `window_context=False` (the default) a target's context is its n - 1 previous
validation characters, also across the models' window boundaries (only the first few
targets of the split have fewer); with `window_context=True` the context is cut at the start
of the target's window, so the n-gram sees no character the model does not see.

The char-LM sweep (`python -m linattn_lib.experiments.charlm`) stores `baselines(...)` for
its context lengths with its results; a fit and a score take well under a second per order.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MAX_ORDER = 9  # contexts are coded as base-V integers in int64: V**MAX_ORDER < 2**63 for V <= 100


class WittenBellLM:
    """An interpolated Witten-Bell character n-gram model over ids 0 .. vocab_size - 1."""

    def __init__(self, order: int, vocab_size: int) -> None:
        if not isinstance(order, int) or not 1 <= order <= MAX_ORDER:
            raise ValueError(f"WittenBellLM: `order` must be an int in 1..{MAX_ORDER}, got {order!r}")
        if not isinstance(vocab_size, int) or not 1 <= vocab_size <= 100:
            raise ValueError(f"WittenBellLM: `vocab_size` must be an int in 1..100, got {vocab_size!r}")
        self.order, self.V = order, vocab_size
        # per context length k = 0 .. order-1: sorted keys h*V + w with counts, and per context
        # h: sorted codes, c(h) and N1+(h)
        self.tables: list[tuple[np.ndarray, ...]] = []

    def fit(self, train: Sequence[int] | np.ndarray) -> WittenBellLM:
        """Count every (context, next character) pair of the training stream, for every k."""
        x = self._ids("fit", train)
        self.tables = []
        for k in range(self.order):
            h = _context_codes(x, k, self.V)[k:]
            full = h * self.V + x[k:]
            keys, counts = np.unique(full, return_counts=True)
            hs, starts, n_follow = np.unique(keys // self.V, return_index=True, return_counts=True)
            self.tables.append((keys, counts, hs, np.add.reduceat(counts, starts), n_follow))
        return self

    def _ids(self, fn: str, seq: Sequence[int] | np.ndarray) -> np.ndarray:
        x = np.asarray(seq, dtype=np.int64).reshape(-1)
        if x.size and (x.min() < 0 or x.max() >= self.V):
            raise ValueError(f"WittenBellLM.{fn}: ids must lie in [0, {self.V}), got [{x.min()}, {x.max()}]")
        return x

    def probs(self, codes: Sequence[np.ndarray], lengths: np.ndarray, targets: np.ndarray) -> np.ndarray:
        """p(target | context) for many targets at once.

        codes[k]: the code of each target's k-character context (`_context_codes`), for
        k < order; lengths: how many context characters each target may use (<= order - 1).
        """
        if not self.tables:
            raise RuntimeError("WittenBellLM.probs: call fit() first")
        p = np.full(targets.shape, 1.0 / self.V)
        for k, (keys, counts, hs, c_h, n_follow) in enumerate(self.tables):
            h = codes[k]
            c_hw = _lookup(keys, counts, h * self.V + targets)
            ch, n1 = _lookup(hs, c_h, h), _lookup(hs, n_follow, h)
            use = (lengths >= k) & (ch > 0)
            p = np.where(use, (c_hw + n1 * p) / np.maximum(ch + n1, 1), p)
        return p

    def distribution(self, context: Sequence[int]) -> np.ndarray:
        """p(. | context) over the whole vocabulary (the last order - 1 characters are used)."""
        ctx = self._ids("distribution", context)[-(self.order - 1) :] if self.order > 1 else np.zeros(0, np.int64)
        seq = np.concatenate([ctx, np.zeros(1, np.int64)])
        t = len(ctx)
        codes = [np.repeat(_context_codes(seq, k, self.V)[t], self.V) for k in range(self.order)]
        return self.probs(codes, np.full(self.V, t), np.arange(self.V))


def _context_codes(x: np.ndarray, k: int, V: int) -> np.ndarray:
    """codes[t] = sum_{j=1..k} x[t-j] V^(j-1): the k characters before t as one integer (the
    most recent is the lowest digit); entries t < k hold the part that exists, with zeros."""
    codes = np.zeros(len(x), dtype=np.int64)
    for j in range(1, k + 1):
        codes[j:] += x[:-j] * V ** (j - 1)
    return codes


def _lookup(keys: np.ndarray, values: np.ndarray, query: np.ndarray) -> np.ndarray:
    """values[i] where keys[i] == query (keys sorted), 0 where the key is absent."""
    if len(keys) == 0:
        return np.zeros(query.shape, dtype=np.int64)
    i = np.minimum(np.searchsorted(keys, query), len(keys) - 1)
    return np.where(keys[i] == query, values[i], 0)


def bits_per_char(lm: WittenBellLM, val: Sequence[int] | np.ndarray, ctx: int, *, window_context: bool = False) -> float:
    """Mean -log2 p of the targets `charlm.validation_loss` scores at context length `ctx`."""
    v = lm._ids("bits_per_char", val)
    n = (len(v) - 1) // ctx
    if n < 1:
        raise ValueError(f"bits_per_char: the validation split ({len(v)} ids) holds no window of ctx={ctx}")
    i = np.arange(1, n * ctx + 1)  # target positions in the split
    have = i - ((i - 1) // ctx) * ctx if window_context else i  # context characters available
    lengths = np.minimum(have, lm.order - 1)
    codes = [_context_codes(v, k, lm.V)[i] for k in range(lm.order)]
    return float(-np.log2(lm.probs(codes, lengths, v[i])).mean())


def baselines(
    train: Sequence[int] | np.ndarray, val: Sequence[int] | np.ndarray, vocab_size: int,
    ctxs: Sequence[int], orders: Sequence[int] = (1, 2, 3, 4, 5, 6, 7),
) -> dict:
    """{"smoothing", "orders": {n: {"stream": {ctx: bpc}, "window": {ctx: bpc}}}} for the book."""
    out: dict = {"smoothing": "interpolated Witten-Bell", "orders": {}}
    for n in orders:
        lm = WittenBellLM(int(n), vocab_size).fit(train)
        out["orders"][str(n)] = {
            how: {str(c): bits_per_char(lm, val, c, window_context=how == "window") for c in ctxs}
            for how in ("stream", "window")
        }
    return out
