"""Variable-length batches: packed sequences with `cu_seqlens`, as in flash-attn's varlen and fla.

**The packed convention.** N sequences of lengths L_0, ..., L_{N-1} are laid end to end along
T in a single batch row:

    q, k: (1, H, T_total, Dk),  v: (1, H, T_total, Dv),  T_total = L_0 + ... + L_{N-1}
    cu_seqlens: (N + 1,) int32 or int64, cu[0] = 0, cu[i+1] = cu[i] + L_i, cu[N] = T_total
    log_decay: (H,) per head, or (1, H, T_total) per token (packed like q)
    initial_state, final state: LinearAttentionState with S (N, H, Dk, Dv) and z (N, H, Dk),
        one row per sequence (z is None when normalize=False)

Sequence i is tokens cu[i] ... cu[i+1] - 1; a zero-length sequence (cu[i] = cu[i+1]) is
allowed: it has no outputs and its final state is its initial state (zeros without one).
The promise: each sequence's output and final state equal running it alone (with its own
initial state) -- `varlen_by_splitting` is that definition, and what the fast path is
tested against. Non-causal attention works the same way: each sequence alone. The layout
is the kernels'.

**Why pad-and-batch, not a decay reset.** One could run the packed row as one sequence and
cut the state at every sequence start with a huge negative log-decay there. -inf is refused
by the library (and -inf - -inf = NaN in any difference of cumulative sums); a finite reset
such as -1e5 does give exp(-1e5) = 0 exactly, but it is still not the definition:

* it can only *zero* the state: a per-sequence initial state S0 (a full Dk x Dv matrix, not
  one k v^T) cannot be injected mid-row, and the true first-token decay g_0, which scales
  S0, would be overwritten by the reset (so would its gradient);
* the engines return only the state after T_total, not the state at each sequence's end;
* the torch chunked path takes prefix-sum differences b_i - b_j inside a chunk (in float64,
  `torch_chunked._Decay`): after a -1e5 step they keep ~1e5 * 2**-53 = 1e-11 of absolute
  precision, above this module's 1e-12 promise in float64.

Chunks that never straddle two sequences, with the state reset and S0 loaded per sequence,
are what the Triton kernels do (`linattn_lib.kernels.sequences`); on the torch side that
would be a second engine.

So `pad_and_batch` gathers the packed tokens into zero-padded (n, H, T_max, D) batches and
runs the ordinary batched engine once per bucket (below), with the sequences' initial
states as its batch of initial states. It is exact, not approximately so:

* *outputs*: padding goes at the end of each sequence and attention is causal, so a real
  token never sees a padded one (non-causal: a zero key adds nothing to k^T v or to z);
* *final states*: a padded token has k = v = 0 and log_decay = 0, so the step
  S <- exp(0) S + 0 0^T leaves the state unchanged: the state after T_max *is* the state at
  the sequence's own end;
* *gradients*: the padded function equals the unpadded one composed with the padding, so
  autograd through the gathers (padding slots read a constant zero row) is exact too; the
  custom backward of the torch chunked path runs once per batch.

Padding costs work: n * T_max token slots instead of the real tokens. To bound it the
sequences are sorted by length and cut greedily into *buckets* of at most
`MAX_PADDING_FACTOR` (1.25) slots per real token (`_buckets`); one bucket when the lengths are
alike. A sequence at least 1 / 1.25 as long as its bucket's longest always fits, so the longest
length shrinks by that factor from one bucket to the next: at most log_1.25(L_max) + 1
buckets, and the Python loop runs over buckets, never over sequences. (On a CPU, a factor of 2
was up to 1.4x slower on mixed lengths, 1.125 no faster than 1.25.)
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .. import _validate as V
from .state import LinearAttentionState

MAX_PADDING_FACTOR = 1.25  # a bucket holds at most this many (padded) token slots per real token

AttentionFn = Callable[..., Tensor | tuple[Tensor, LinearAttentionState]]


# --------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------


def check_cu_seqlens(fn: str, cu_seqlens: object, T_total: int, device: torch.device) -> int:
    """`cu_seqlens` is a valid (N + 1,) int32/int64 tensor of cumulative sequence starts; returns N.

    Always checked (metadata, free): a tensor, int32 or int64, 1-d with N + 1 >= 2 entries, on
    `device`. Its *values* -- cu[0] = 0, cu[-1] = T_total, non-decreasing (zero-length
    sequences allowed) -- are checked as every other value check is (`_validate.values_checked`):
    for CPU tensors in eager mode; for CUDA tensors only when opted in (`CHECK_DEVICE_VALUES`,
    LINATTN_CHECK_VALUES=1), since reading them is a device-to-host sync. Unchecked, the
    kernels clamp the starts into [0, T_total] and make them non-decreasing
    (`kernels.sequences.packed_starts`): a bad cu_seqlens gives wrong outputs (tokens outside
    every span are not written), never an access outside the tensors.
    """
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"{fn}: `cu_seqlens` must be a torch.Tensor of int32 or int64, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{fn}: `cu_seqlens` must have dtype torch.int32 or torch.int64, got {V.describe(cu_seqlens)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"{fn}: `cu_seqlens` must be a 1-d tensor (N + 1,) of cumulative sequence starts with N >= 1, "
            f"got {V.describe(cu_seqlens)}"
        )
    if cu_seqlens.device != device:
        raise ValueError(f"{fn}: `cu_seqlens` is on {cu_seqlens.device} but `q` is on {device}")
    if V.values_checked(cu_seqlens):
        _check_starts(fn, [int(c) for c in cu_seqlens.tolist()], T_total)
    return cu_seqlens.numel() - 1


def _check_starts(fn: str, cu: list[int], T_total: int) -> None:
    """The value checks of `check_cu_seqlens`, on the starts as Python ints."""
    if cu[0] != 0:
        raise ValueError(f"{fn}: `cu_seqlens` must start at 0, got cu_seqlens[0] = {cu[0]}")
    if cu[-1] != T_total:
        raise ValueError(
            f"{fn}: `cu_seqlens` must end at the packed length T_total = {T_total} (q.shape[2]), "
            f"got cu_seqlens[-1] = {cu[-1]}"
        )
    bad = next((i for i in range(len(cu) - 1) if cu[i + 1] < cu[i]), None)
    if bad is not None:
        raise ValueError(
            f"{fn}: `cu_seqlens` must be non-decreasing (lengths >= 0), got cu_seqlens[{bad}] = {cu[bad]} "
            f"> cu_seqlens[{bad + 1}] = {cu[bad + 1]}"
        )


def sequence_spans(cu_seqlens: Tensor, T_total: int | None = None, fn: str = "sequence_spans",
                   ) -> list[tuple[int, int]]:
    """The N spans (start, end) of `cu_seqlens` (its metadata checked), as Python ints: what the
    padding paths (`pad_and_batch`, `varlen_by_splitting`) loop and gather over. One host read
    of the starts -- a device-to-host sync for a CUDA tensor, which the Triton kernels' causal
    path never makes (they take the packed layout as it is). With T_total, the values are
    checked too (as `check_cu_seqlens` does; free, they are on the host now), whatever the
    device: the padding paths never run on unchecked starts."""
    cu = [int(c) for c in cu_seqlens.tolist()]
    if T_total is not None:
        _check_starts(fn, cu, T_total)
    return list(zip(cu[:-1], cu[1:]))


def check_varlen(
    fn: str, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: object, *,
    log_decay: Tensor | None, initial_state: LinearAttentionState | None, normalize: bool,
) -> int:
    """Packed inputs (see the module docstring): q, k, v with B = 1, a valid `cu_seqlens`, a
    log-decay of shape (H,) or (1, H, T_total) and one initial state per sequence.

    Returns the number of sequences N. No host sync unless values are checked (see
    `check_cu_seqlens`); `sequence_spans` gives the spans. (The log-decay's values, <= 0 and
    finite, are `linear_attention`'s check; here only its shape.)
    """
    V.check_qkv(fn, q, k, v)
    B, H, T, Dk = q.shape
    if B != 1:
        raise ValueError(
            f"{fn}: with `cu_seqlens` the sequences are packed along T of one batch row: expected q of shape "
            f"(1, H, T_total, Dk), got {V.describe(q)}"
        )
    N = check_cu_seqlens(fn, cu_seqlens, T, q.device)
    if log_decay is not None:
        V.check_tensor(fn, "log_decay", log_decay)
    if log_decay is not None and tuple(log_decay.shape) not in ((H,), (1, H, T)):
        raise ValueError(
            f"{fn}: `log_decay` has shape {tuple(log_decay.shape)}; with `cu_seqlens` expected (H,) = ({H},) "
            f"per head or (1, H, T_total) = {(1, H, T)} per token"
        )
    if initial_state is not None:
        try:
            V.check_state(fn, "initial_state", initial_state, B=N, H=H, Dk=Dk, Dv=v.shape[-1],
                          device=q.device, normalize=normalize)
        except ValueError as err:
            raise ValueError(f"{err} (with `cu_seqlens`, B is the number of sequences N = {N}: "
                             "one initial state per sequence)") from None
    return N


# --------------------------------------------------------------------------------------
# the definition: each sequence alone
# --------------------------------------------------------------------------------------


def varlen_by_splitting(
    attn_fn: AttentionFn, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, *,
    log_decay: Tensor | None = None, initial_state: LinearAttentionState | None = None,
    return_state: bool = False, **kw: object,
) -> Tensor | tuple[Tensor, LinearAttentionState]:
    """Packed linear attention by definition: `attn_fn` on each sequence alone, one at a time.

    attn_fn: a function with `linear_attention`'s signature (linear_attention itself, or
    functools.partial of it with form=..., backend=...); `kw` goes to it unchanged (causal,
    normalize, eps, chunk_size, form, ...). Outputs are concatenated along T, final states
    stacked along the sequence axis (see the module docstring for the layout). A Python loop
    over sequences: the readable reference the packed fast path is tested against.
    """
    fn = "varlen_by_splitting"
    normalize = bool(kw.get("normalize", True))
    check_varlen(fn, q, k, v, cu_seqlens, log_decay=log_decay, initial_state=initial_state, normalize=normalize)
    outs, states, like = [], [], None
    for i, (s, e) in enumerate(sequence_spans(cu_seqlens, q.shape[2], fn)):
        init = _select_state(initial_state, slice(i, i + 1), normalize)
        if e == s:  # no tokens: the state passes through
            states.append(init)
            continue
        g = log_decay if log_decay is None or log_decay.dim() == 1 else log_decay[:, :, s:e]
        o, state = attn_fn(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], log_decay=g, initial_state=init,
                           return_state=True, **kw)
        outs.append(o)
        states.append(state)
        like = state if like is None else like
    o = torch.cat(outs, dim=2)
    if not return_state:
        return o
    states = [_state_or_zeros(st, like, normalize, 1) for st in states]
    S = torch.cat([st.S for st in states])
    z = torch.cat([st.z for st in states]) if normalize else None
    return o, LinearAttentionState(S, z)


# --------------------------------------------------------------------------------------
# the fast path: pad, batch, run once per bucket, gather back
# --------------------------------------------------------------------------------------


def varlen_by_padding(
    attn_fn: AttentionFn, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, *,
    log_decay: Tensor | None = None, initial_state: LinearAttentionState | None = None,
    return_state: bool = False, **kw: object,
) -> Tensor | tuple[Tensor, LinearAttentionState]:
    """Packed linear attention, exact, by pad-and-batch: `check_varlen`, then `pad_and_batch`.

    Same arguments and results as `varlen_by_splitting` (attn_fn gets zero-padded batches of
    whole sequences, so it may be any batched implementation: the references, the torch
    chunked path, the Triton kernels).
    """
    normalize = bool(kw.get("normalize", True))
    fn = "varlen_by_padding"
    check_varlen(fn, q, k, v, cu_seqlens, log_decay=log_decay, initial_state=initial_state, normalize=normalize)
    return pad_and_batch(attn_fn, q, k, v, sequence_spans(cu_seqlens, q.shape[2], fn), log_decay=log_decay,
                         initial_state=initial_state, return_state=return_state, **kw)


def pad_and_batch(
    attn_fn: AttentionFn, q: Tensor, k: Tensor, v: Tensor, spans: list[tuple[int, int]], *,
    log_decay: Tensor | None = None, initial_state: LinearAttentionState | None = None,
    return_state: bool = False, **kw: object,
) -> Tensor | tuple[Tensor, LinearAttentionState]:
    """The engine of `varlen_by_padding`, for inputs already checked (`check_varlen`; `spans`
    from `sequence_spans`).

    Per bucket of similar lengths (`_buckets`): gather its n sequences into (n, H, T_b, D),
    zeros after each sequence's end (log-decay 0 there), and call `attn_fn` once with their
    initial states. Every packed (head, token) row then comes back from its bucket's output
    by one gather (`_output_rows`), and the states to sequence order by another. `kw` goes
    to attn_fn unchanged (`normalize`, default True, also says whether states carry z).
    """
    normalize = bool(kw.get("normalize", True))
    H, T = q.shape[1], q.shape[2]
    rows = [_rows(x[0]) for x in (q, k, v)]  # (H T + 1, D): head-major token rows, then a zero row
    g_rows = None if log_decay is None else _rows(log_decay.view(H, 1).expand(H, T) if log_decay.dim() == 1
                                                  else log_decay[0])
    lengths = [e - s for s, e in spans]
    first = torch.empty(len(spans), dtype=torch.long, device=q.device)  # output row of a sequence's head 0, token 0
    width = torch.empty_like(first)  # its bucket's T_b: the row step from one head to the next
    outs, order, states, filled = [], [], [], 0
    for ids, T_b in _buckets(lengths):
        ids_t, idx = _bucket(ids, T_b, spans, H, T, q.device)
        res = attn_fn(
            *(x[idx] for x in rows), log_decay=None if g_rows is None else g_rows[idx],
            initial_state=_select_state(initial_state, ids_t, normalize), return_state=return_state, **kw,
        )
        o, state = res if return_state else (res, None)
        outs.append(o.reshape(idx.numel(), -1))
        first[ids_t] = filled + torch.arange(len(ids), device=q.device) * (H * T_b)
        width[ids_t] = T_b
        filled += idx.numel()
        order.append(ids_t)
        states.append(state)
    o = (outs[0] if len(outs) == 1 else torch.cat(outs))[_output_rows(spans, first, width, H, T)].view(1, H, T, -1)
    if not return_state:
        return o
    empty = [i for i, L in enumerate(lengths) if L == 0]
    if empty:  # no tokens: the state passes through
        ids_t = torch.tensor(empty, dtype=torch.long, device=q.device)
        states.append(_state_or_zeros(_select_state(initial_state, ids_t, normalize), states[0], normalize, len(empty)))
        order.append(ids_t)
    order_t = torch.cat(order)
    S = _unpermute(torch.cat([st.S.to(states[0].S.dtype) for st in states]), order_t)
    z = _unpermute(torch.cat([st.z.to(states[0].z.dtype) for st in states]), order_t) if normalize else None
    return o, LinearAttentionState(S, z)


def _buckets(lengths: list[int]) -> list[tuple[list[int], int]]:
    """Non-empty sequences grouped for padding: [(sequence ids, padded length T_b), ...].

    Longest first; a sequence joins the current bucket while the bucket keeps at most
    f = MAX_PADDING_FACTOR slots (n * T_b) per real token. One of at least T_b / f tokens always
    joins (n T_b <= f real before, so (n + 1) T_b <= f (real + T_b / f)): T_b shrinks by at
    least f from one bucket to the next, so there are at most log_f(max length) + 1 buckets.
    (Integer bookkeeping only; the attention runs once per bucket.)
    """
    order = sorted((i for i, L in enumerate(lengths) if L > 0), key=lambda i: -lengths[i])
    buckets: list[tuple[list[int], int, int]] = []  # (ids, T_b, real tokens)
    for i in order:
        L = lengths[i]
        if buckets:
            ids, T_b, real = buckets[-1]
            if (len(ids) + 1) * T_b <= MAX_PADDING_FACTOR * (real + L):
                ids.append(i)
                buckets[-1] = (ids, T_b, real + L)
                continue
        buckets.append(([i], L, L))
    return [(ids, T_b) for ids, T_b, _ in buckets]


def _rows(x: Tensor) -> Tensor:
    """(H, T, *D) -> (H T + 1, *D): row h T + t is token t of head h; the last row is zero, the
    source of every padding slot (a constant: no gradient reaches the inputs from padding)."""
    flat = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    return torch.cat([flat, flat.new_zeros((1, *flat.shape[1:]))])


def _bucket(
    ids: list[int], T_b: int, spans: list[tuple[int, int]], H: int, T: int, device: torch.device,
) -> tuple[Tensor, Tensor]:
    """(sequence ids (n,), idx (n, H, T_b)): idx[i, h, t] is the `_rows` row of token t of head h
    of sequence ids[i], or H T (the zero row) past that sequence's end."""
    starts = torch.tensor([spans[i][0] for i in ids], dtype=torch.long, device=device)
    lens = torch.tensor([spans[i][1] - spans[i][0] for i in ids], dtype=torch.long, device=device)
    t = torch.arange(T_b, device=device)
    heads = torch.arange(H, device=device).view(1, H, 1) * T
    idx = torch.where((t < lens[:, None]).unsqueeze(1), heads + (starts[:, None] + t).unsqueeze(1), H * T)
    return torch.tensor(ids, dtype=torch.long, device=device), idx


def _output_rows(spans: list[tuple[int, int]], first: Tensor, width: Tensor, H: int, T: int) -> Tensor:
    """(H, T): for head h and packed token p, its row in the buckets' stacked outputs.

    Token p of sequence i, t = p - start_i tokens in, sits at first[i] + h width[i] + t (a
    gather, so every row is read once: no scatter with colliding indices, deterministic)."""
    device = first.device
    starts = torch.tensor([s for s, _ in spans], dtype=torch.long, device=device)
    lens = torch.tensor([e - s for s, e in spans], dtype=torch.long, device=device)
    seq = torch.repeat_interleave(torch.arange(len(spans), device=device), lens, output_size=T)
    t = torch.arange(T, device=device) - starts[seq]
    return first[seq] + torch.arange(H, device=device).view(H, 1) * width[seq] + t


def _unpermute(x: Tensor, pos: Tensor) -> Tensor:
    """y with y[pos[j]] = x[j] along the first axis (pos a permutation), as one gather."""
    inv = torch.empty_like(pos).scatter_(0, pos, torch.arange(len(pos), device=pos.device))
    return x[inv]


def _select_state(
    state: LinearAttentionState | None, rows: slice | Tensor, normalize: bool,
) -> LinearAttentionState | None:
    """The initial states of some sequences (z dropped when not normalising); None stays None."""
    if state is None:
        return None
    return LinearAttentionState(state.S[rows], state.z[rows] if normalize else None)


def _state_or_zeros(
    state: LinearAttentionState | None, like: LinearAttentionState, normalize: bool, n: int,
) -> LinearAttentionState:
    """`state` (in the dtype of `like`), or n zero states shaped like one row of `like`."""
    dtype = like.S.dtype
    if state is None:
        S = like.S.new_zeros((n, *like.S.shape[1:]), dtype=dtype)
        z = like.S.new_zeros((n, *like.S.shape[1:3]), dtype=dtype) if normalize else None
        return LinearAttentionState(S, z)
    return LinearAttentionState(state.S.to(dtype), state.z.to(dtype) if normalize else None)


__all__ = ["MAX_PADDING_FACTOR", "check_cu_seqlens", "check_varlen", "pad_and_batch", "sequence_spans",
           "varlen_by_padding", "varlen_by_splitting"]
