"""Fast chunked linear attention on the CPU: the `backend="torch"` path of `linear_attention`.

Same semantics as `reference_linear_attention` (the recurrence is stated in `state.py`):

    S_t = exp(g_t) S_{t-1} + k_t v_t^T,   z_t = exp(g_t) z_{t-1} + k_t,
    o_t = q_t S_t / (q_t . z_t + eps)     (or q_t S_t when normalize=False),

computed in float32 (float64 for float64 input) and returned in the dtype of v. What makes it
fast, and what makes its memory O(T):

1. **Chunks, and blocks of chunks.** T is cut into chunks of C tokens. Inside a chunk the
   output is two matmuls, (q k^T * M) v + q E, where M is the causal (decay) mask and E the
   state entering the chunk. All chunks of a *block* (a few thousand tokens of one head, or
   several short heads) go through each matmul together, as one `torch.bmm` over a
   (chunks, C, D) batch; the entry states of the block's chunks come from the per-chunk
   increments k^T v (one more bmm) by a scan written as a small matmul (`_Scan`). Blocks are
   walked in order, carrying the state from one to the next, so every temporary is
   block-sized: it stays in cache, and memory does not grow with T beyond the inputs, the
   output and the gradients.

2. **The normaliser is one more column.** With v' = [v, 1] and the state S' = [S, z],
   q_t S'_t = [q_t S_t, q_t . z_t]: numerator and denominator come out of the same matmuls
   (and gradients through the denominator out of the same backward matmuls). So there is one
   engine, for the unnormalised form; normalize=True appends a ones column to v and divides by
   the last output column.

3. **The backward recomputes.** Autograd would keep every per-chunk state (T/C of them, each
   Dk x Dv) and every C x C score matrix. The custom `torch.autograd.Function` keeps only q, k,
   v, the output, the denominators and the state at each *block* boundary (a handful per
   sequence); the backward recomputes the per-chunk states and scores of one block at a time --
   the trade Katharopoulos et al. (2020) make in their kernels. It walks the blocks backwards,
   carrying dL/dS the way the forward carries S.

4. **The decay gradient comes for free.** With the cumulative log-decay c_t = g_1 + ... + g_t,
   every term depends on c only through exp(c_i - c_j), which gives
   dL/dc_t = q_t . dq_t - k_t . dk_t (+ <dS_T, S_T> at the last step), and dL/dg is its
   reverse cumulative sum (as in flash-linear-attention's GLA and Mamba-2 kernels).

Every exponent is a sum of log-decays over a forward interval, hence <= 0: nothing overflows.
What can overflow is the state itself (huge finite keys and values); the scan checks one small
tensor per block for that (`_Scan.__call__`) and redoes only such a block one chunk at a time.
(That check reads a value on the host: with CUDA tensors on this path, one sync per block.)
"""
from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from .masks import decay_mask
from .once import once_differentiable
from .state import (
    LinearAttentionState,
    compute_dtype,
    grad_in_layout,
    layout_of,
    noncausal,
    suffix_sum,
    sum_after,
)

BLOCK_TOKENS = 4096  # tokens per block: ~50 torch calls each, so not too many blocks; temporaries ~1 MiB
SCAN_ONE_LEVEL_MAX = 16  # scans over more chunks than this go in two levels (see _Scan)


# --------------------------------------------------------------------------------------
# public entry point (called by linear_attention after its input checks)
# --------------------------------------------------------------------------------------


def chunked_linear_attention(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, normalize: bool,
    log_decay: Tensor | None, eps: float, chunk_size: int,
    initial_state: LinearAttentionState | None, return_state: bool,
) -> Tensor | tuple[Tensor, LinearAttentionState]:
    """`linear_attention(..., form="chunked", backend="torch")`: same arguments and results.

    Causal inputs go through `_ChunkedLinearAttention` (blockwise forward, recomputing
    backward); non-causal ones are one global state and one product, for which plain autograd
    already keeps only O(T) tensors.
    """
    S0, z0 = (None, None) if initial_state is None else initial_state
    if not normalize:
        z0 = None
    if causal:
        o, S, z = _ChunkedLinearAttention.apply(q, k, v, log_decay, S0, z0, normalize, float(eps), int(chunk_size))
    else:
        if log_decay is not None:
            raise ValueError("chunked_linear_attention: `log_decay` needs causal=True")
        o, S, z = noncausal(q, k, v, S0, z0, normalize, float(eps))
    o = o.to(v.dtype)
    return (o, LinearAttentionState(S, z)) if return_state else o


def _initial(S0, z0, B, H, Dk, Dv, normalize, dtype, device) -> Tensor:
    """The state S' = [S, z] as one (B*H, Dk, Dv') tensor (Dv' = Dv + 1 when normalising; zeros if absent)."""
    S = torch.zeros(B * H, Dk, Dv, dtype=dtype, device=device) if S0 is None else S0.to(dtype).reshape(B * H, Dk, Dv)
    if not normalize:
        return S
    z = torch.zeros(B * H, Dk, dtype=dtype, device=device) if z0 is None else z0.to(dtype).reshape(B * H, Dk)
    return torch.cat([S, z.unsqueeze(-1)], dim=-1)


def _split_state(Sa: Tensor, B, H, Dv, normalize):
    """(B*H, Dk, Dv') -> S (B, H, Dk, Dv) and z (B, H, Dk) (None when not normalising)."""
    S = Sa[..., :Dv].reshape(B, H, -1, Dv)
    return S, (Sa[..., Dv].reshape(B, H, -1) if normalize else None)


# --------------------------------------------------------------------------------------
# causal: the chunked engine
# --------------------------------------------------------------------------------------


def _blocks(BH: int, N: int, n_block: int) -> Iterator[tuple[int, int, list[tuple[int, int]]]]:
    """Split (heads, chunks) into blocks of about n_block chunks.

    Yields (h0, h1, chunk_ranges): heads h0..h1-1 are processed together, their chunks in the
    listed (n0, n1) ranges, in order. Long sequences get one head and many chunk ranges; short
    ones get several whole heads at once, so that every block has enough work for a bmm.
    """
    if N <= n_block:
        per = max(1, n_block // N)
        for h0 in range(0, BH, per):
            yield h0, min(h0 + per, BH), [(0, N)]
    else:
        ranges = [(n0, min(n0 + n_block, N)) for n0 in range(0, N, n_block)]
        for h in range(BH):
            yield h, h + 1, ranges


class _Workspace:
    """Scratch tensors that every block of one call reuses.

    Fresh memory from the operating system costs a page fault per 4 KiB page; for block-sized
    temporaries that is as much time as the arithmetic on them. So each buffer is allocated
    once per call and shape, and every block of that shape writes into it.
    """

    def __init__(self, like: Tensor):
        self.like, self.buffers = like, {}

    def __call__(self, name: str, *shape: int, dtype: torch.dtype | None = None) -> Tensor:
        return self.get(name, *shape, dtype=dtype)[0]

    def get(self, name: str, *shape: int, dtype: torch.dtype | None = None) -> tuple[Tensor, bool]:
        """The buffer `name` of this shape (and dtype: by default the inputs'), and whether it
        was just allocated."""
        key = (name, dtype) + shape
        fresh = key not in self.buffers
        if fresh:
            self.buffers[key] = self.like.new_empty(shape, dtype=dtype)
        return self.buffers[key], fresh


class _Decay:
    """The decay factors of a block of chunks. g: (G, C) log-decays, G = h heads x n chunks."""

    def __init__(self, g: Tensor, h: int, ws: _Workspace):
        b = g.cumsum(-1)  # b_i = g_1 + ... + g_i: decay from the chunk start, <= 0
        self.q_scale = b.exp().unsqueeze(-1)  # exp(b_i): the entry state as seen by query i
        # exp(g_{j+1} + ... + g_C): key j decayed to the chunk end, summed from j + 1 on rather
        # than taken as b_C - b_j, which would cancel catastrophically after one huge step
        # (a "reset" g = -1e4 early in the chunk leaves b_C - b_j with float32's 1e-3 spacing).
        self.k_scale = sum_after(g).exp().unsqueeze(-1)
        # (G, C, C): exp(b_i - b_j) for i >= j, 0 above the diagonal. The same cancellation
        # threatens b_i - b_j, so the differences are taken in float64 (C prefix sums per chunk:
        # cheap), then rounded once; the reference builds its mask with `segsum` instead.
        C = g.shape[-1]
        upper = torch.ones(C, C, dtype=torch.bool, device=g.device).triu_(1)
        mask = ws("mask", *g.shape, C)
        if g.dtype == torch.float64:
            torch.sub(b.unsqueeze(-1), b.unsqueeze(-2), out=mask)
        else:
            b64 = g.double().cumsum(-1)
            mask.copy_(torch.sub(b64.unsqueeze(-1), b64.unsqueeze(-2), out=ws("mask64", *g.shape, C, dtype=torch.float64)))
        self.mask = mask.masked_fill_(upper, -math.inf).exp_()
        self.gamma = b[:, -1].view(h, -1)  # (h, n): the decay across each whole chunk


def _apply_mask(A: Tensor, decay: _Decay | None) -> Tensor:
    """The causal (decay) mask inside a chunk, applied in place.

    tril_ *writes* zeros above the diagonal: a score that overflowed to inf (or a garbage
    future key) multiplied by the mask's 0 would be NaN and reach earlier outputs.
    """
    return A.tril_() if decay is None else A.mul_(decay.mask).tril_()


class _Scan:
    """The state passing between the n chunks of a block, for h heads, in either direction.

    Forwards, E_0 = carry and E_{i+1} = exp(gamma_i) E_i + inc_i: the state entering each chunk.
    Unrolled, E = c carry + L inc with c_i = exp(gamma_0 + ... + gamma_{i-1}) and the strictly
    lower-triangular L_im = exp(gamma_{m+1} + ... + gamma_{i-1}) (without decay: c = 1, L = ones,
    a cumulative sum). So all n entry states come out of one `baddbmm` (torch's cumsum over a
    non-last axis is a slow strided loop; a small matmul runs at full speed) -- Mamba-2's
    "state passing" step.

    Backwards (reverse=True), F_{n-1} = carry and F_{i-1} = exp(gamma_i) F_i + inc_i: how dL/dS
    flows from the end of the block to its start. It is the same matrix transposed,
    F = c' carry + L^T inc with c'_i = exp(gamma_{i+1} + ... + gamma_{n-1}).

    The matmul costs 2 n^2 per state entry. Long blocks are scanned in two levels instead (the
    classic blocked prefix sum): inside groups of s <= 8 chunks from a zero state, then over the
    groups' totals (itself a scan, in levels again if long), then each group adds its entry
    state times its decay: about 2 n (s + 1) per state entry.
    """

    def __init__(self, gamma: Tensor | None, h: int, n: int, dtype, device):
        self.h, self.n, self.gamma = h, n, gamma
        s = min(8, math.isqrt(n))
        while n % s:
            s -= 1  # s: the largest divisor of n up to 8 (1 when n is prime); long outer scans recurse
        self.two_level = n > SCAN_ONE_LEVEL_MAX and s > 1
        if self.two_level:
            self.s, self.g = s, n // s
            self.inner = _Scan(None if gamma is None else gamma.reshape(h * self.g, s), h * self.g, s, dtype, device)
            totals = None if gamma is None else gamma.view(h, self.g, s).sum(-1)  # decay across a group
            self.outer = _Scan(totals, h, self.g, dtype, device)
            return
        if gamma is None:
            self.L = torch.ones(1, n, n, dtype=dtype, device=device).tril_(-1).expand(h, n, n)
            self.c = self.c_rev = self.first = self.last = None
        else:
            self.L = F.pad(decay_mask(gamma)[:, :-1], (0, 0, 1, 0))  # row i: decay_mask row i - 1
            self.c = F.pad(gamma[:, :-1].cumsum(1), (1, 0)).exp().unsqueeze(-1)  # (h, n, 1)
            self.c_rev = sum_after(gamma).exp().unsqueeze(-1)
            self.first, self.last = gamma[:, :1].exp(), gamma[:, -1:].exp()  # (h, 1)

    def __call__(
        self, carry: Tensor | None, inc: Tensor, reverse: bool = False, out: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """carry: (h, *F) or None (zero); inc: (h*n, *F), one increment per chunk.

        Returns the n states (h*n, *F; written into `out` if given) -- entering each chunk, or
        with reverse=True leaving it -- and the state past the block's far end (h, *F): after
        its last chunk, or before its first.

        Overflow safety at the cost of one small check: in the matmul, a later chunk's inf
        meets L's zeros (0 * inf = NaN) and would reach the states of *earlier* chunks. Every
        increment and the carry reach the far-end state with a coefficient that is a number
        (0 * inf is NaN too), so that state is finite exactly when nothing non-finite went in
        (or the sum itself overflowed). Only then is the scan redone one chunk at a time,
        which keeps an inf or NaN after its chunk (under torch.compile, where value checks
        are off, the matmul's answer stands).
        """
        E, beyond = self._matmul(carry, inc, reverse, out)
        if torch.compiler.is_compiling() or math.isfinite(float(beyond.sum())):
            return E, beyond
        h, n = self.h, self.n
        inc3 = inc.reshape(h, n, -1)
        E3 = self._sequential(carry, inc3, reverse, None if out is None else out.view(h, n, -1))
        end, decay = (0, self.first_decay()) if reverse else (-1, self.last_decay())
        beyond = (E3[:, end] if decay is None else E3[:, end] * decay) + inc3[:, end]
        return E3.view(inc.shape), beyond.view((h,) + inc.shape[1:])

    def first_decay(self) -> Tensor | None:
        return None if self.gamma is None else self.gamma[:, :1].exp()

    def last_decay(self) -> Tensor | None:
        return None if self.gamma is None else self.gamma[:, -1:].exp()

    def _matmul(
        self, carry: Tensor | None, inc: Tensor, reverse: bool = False, out: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """The scan as matmuls (two levels for long blocks); arguments and results as `__call__`."""
        h, n = self.h, self.n
        inc3 = inc.reshape(h, n, -1)
        out3 = None if out is None else out.view(h, n, -1)
        if self.two_level:
            inner = self.inner
            E, totals = inner._matmul(None, inc3.view(h * n, -1), reverse, out3)  # each group from zero
            G, beyond = self.outer._matmul(carry, totals, reverse)  # the state at each group's near end
            E3, G3 = E.view(h * self.g, self.s, -1), G.view(h * self.g, 1, -1)
            coef = inner.c_rev if reverse else inner.c  # decay from the group's near end
            if coef is None:
                E3.add_(G3)
            else:
                E3.addcmul_(coef, G3)
        else:
            L = self.L.transpose(1, 2) if reverse else self.L
            if carry is None:
                E = torch.bmm(L, inc3, out=out3)
            else:
                start, coef = carry.reshape(h, 1, -1), self.c_rev if reverse else self.c
                E = torch.baddbmm(start.expand(h, n, -1) if coef is None else start * coef, L, inc3, out=out3)
            end, decay = (0, self.first) if reverse else (-1, self.last)
            beyond = (E[:, end] if decay is None else E[:, end] * decay) + inc3[:, end]
        return E.view(inc.shape), beyond.view((h,) + inc.shape[1:])

    def _sequential(self, carry, inc3: Tensor, reverse: bool, out3: Tensor | None) -> Tensor:
        """The same scan one chunk at a time, for increments that overflowed to inf: the loop
        keeps an inf or NaN where it belongs, in the states after its chunk."""
        h, n = self.h, self.n
        E = torch.empty_like(inc3) if out3 is None else out3
        state = inc3.new_zeros(h, inc3.shape[-1]) if carry is None else carry.reshape(h, -1).to(inc3.dtype)
        a = None if self.gamma is None else self.gamma.exp().to(inc3.dtype)  # (h, n)
        order = range(n - 1, -1, -1) if reverse else range(n)
        for i in order:
            E[:, i] = state
            state = (state if a is None else a[:, i, None] * state) + inc3[:, i]
        return E


@functools.lru_cache(maxsize=64)
def _plain_scan(h: int, n: int, dtype: torch.dtype, device: torch.device) -> _Scan:
    """The no-decay scan depends only on the block's shape: build it once."""
    return _Scan(None, h, n, dtype, device)


def _scan_for(decay: _Decay | None, h: int, n: int, like: Tensor) -> _Scan:
    if decay is None and not torch.compiler.is_compiling():  # compile traces it each time
        return _plain_scan(h, n, like.dtype, like.device)
    if decay is None:
        return _Scan(None, h, n, like.dtype, like.device)
    return _Scan(decay.gamma, h, n, like.dtype, like.device)


def _prepare(q, k, v, log_decay, C):
    """Inputs as (B*H*N, C, D) chunk batches in the compute dtype, T padded to a multiple of C."""
    B, H, T, Dk = q.shape
    dtype = compute_dtype(q)
    pad = (-T) % C
    g = None
    if log_decay is not None:
        g = log_decay.to(dtype)
        g = g.view(1, H, 1).expand(B, H, T) if g.dim() == 1 else g
        g = F.pad(g, (0, pad)).reshape(B * H, -1, C)  # g = 0 on padding: no decay there
    q, k, v = (x.to(dtype) for x in (q, k, v))
    if pad:  # zero keys add nothing to the state
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    N = (T + pad) // C
    q, k, v = (x.reshape(B * H * N, C, x.shape[-1]).contiguous() for x in (q, k, v))
    return q, k, v, g, N


class _ChunkedLinearAttention(torch.autograd.Function):
    """Causal chunked linear attention; forward and backward walk the sequence block by block."""

    @staticmethod
    def forward(ctx, q, k, v, log_decay, S0, z0, normalize: bool, eps: float, chunk_size: int):
        B, H, T, Dk = q.shape
        Dv = v.shape[-1]
        C = min(chunk_size, T)  # a chunk longer than the sequence would only add padding
        qc, kc, vc, gc, N = _prepare(q, k, v, log_decay, C)
        BH = B * H
        S = _initial(S0, z0, B, H, Dk, Dv, normalize, qc.dtype, qc.device)  # (BH, Dk, Dv')

        out = qc.new_empty(BH * N, C, Dv)
        den = qc.new_empty(BH * N, C) if normalize else None
        checkpoints = []  # the state entering every block: all the backward keeps besides q, k, v, o
        ws = _Workspace(qc)
        S_T = torch.empty_like(S)
        for h0, h1, ranges in _blocks(BH, N, max(1, BLOCK_TOKENS // C)):
            carry = S[h0:h1]
            for n0, n1 in ranges:
                checkpoints.append(carry)
                rows = slice(h0 * N + n0, (h1 - 1) * N + n1)  # the block's chunks, in (B*H*N) order
                decay = None if gc is None else _Decay(gc[h0:h1, n0:n1].reshape(-1, C), h1 - h0, ws)
                carry = _forward_block(
                    qc[rows], kc[rows], vc[rows], decay, carry, h1 - h0, out[rows],
                    None if den is None else den[rows], eps, ws,
                )
            S_T[h0:h1] = carry

        ctx.save_for_backward(qc, kc, vc, out, den, log_decay, S0, z0)
        ctx.gc, ctx.checkpoints, ctx.S_T = gc, checkpoints, S_T
        ctx.shape = (B, H, T, Dk, Dv, C, N)
        ctx.layouts = tuple(layout_of(x) for x in (q, k, v, log_decay))
        o = out.view(B, H, N * C, Dv)[:, :, :T]
        S_out, z_out = _split_state(S_T.clone(), B, H, Dv, normalize)
        return o, S_out, z_out

    @staticmethod
    @once_differentiable("linear_attention(form='chunked')", "form='quadratic' and form='recurrent' "
                         "(also LinearAttention(form=...)) are plain torch and have them.")
    def backward(ctx, do, dS_T, dz_T):
        qc, kc, vc, out, den, log_decay, S0, z0 = ctx.saved_tensors
        B, H, T, Dk, Dv, C, N = ctx.shape
        BH, dtype, gc, normalize = B * H, qc.dtype, ctx.gc, den is not None
        do = do.to(dtype)
        if N * C > T:
            do = F.pad(do, (0, 0, 0, N * C - T))
        do = do.reshape(BH * N, C, Dv)
        dS_T = _initial(dS_T, dz_T, B, H, Dk, Dv, normalize, dtype, qc.device)  # dL/dS' after the sequence

        dq, dk, dv = torch.empty_like(qc), torch.empty_like(kc), torch.empty_like(vc)
        dc = None if gc is None else qc.new_empty(BH * N, C)
        dS0 = torch.empty_like(dS_T)
        ws = _Workspace(qc)
        i = len(ctx.checkpoints)
        for h0, h1, ranges in reversed(list(_blocks(BH, N, max(1, BLOCK_TOKENS // C)))):  # the forward's walk, backwards
            dcarry = dS_T[h0:h1]
            for n0, n1 in reversed(ranges):
                i -= 1
                rows = slice(h0 * N + n0, (h1 - 1) * N + n1)
                decay = None if gc is None else _Decay(gc[h0:h1, n0:n1].reshape(-1, C), h1 - h0, ws)
                dcarry = _backward_block(
                    qc[rows], kc[rows], vc[rows], decay, ctx.checkpoints[i], h1 - h0,
                    do[rows], out[rows], None if den is None else den[rows], dcarry,
                    dq[rows], dk[rows], dv[rows], None if dc is None else dc[rows], ws,
                )
            dS0[h0:h1] = dcarry

        dlog = None
        if dc is not None and ctx.needs_input_grad[3]:
            # dL/dg_s = sum_{t >= s} dL/dc_t; the final state depends on every g: + <dS_T, S_T>
            dc = suffix_sum(dc.view(BH, N * C))
            dc += (dS_T * ctx.S_T).sum((-1, -2)).unsqueeze(-1)
            dlog = dc.view(B, H, N * C)[:, :, :T]
            dlog = (dlog.sum((0, 2)) if log_decay.dim() == 1 else dlog).to(log_decay.dtype)

        def unchunk(x, like):
            return x.view(B, H, N * C, -1)[:, :, :T].to(like.dtype)

        dS0_, dz0_ = _split_state(dS0, B, H, Dv, normalize)
        grads = (unchunk(dq, qc), unchunk(dk, kc), unchunk(dv, vc), dlog)
        return (
            *(grad_in_layout(g, layout) for g, layout in zip(grads, ctx.layouts)),
            None if S0 is None else dS0_.to(S0.dtype),
            None if z0 is None else dz0_.to(z0.dtype),
            None, None, None,
        )


def _with_ones(v: Tensor, ws: _Workspace, name: str) -> Tensor:
    """v' = [v, 1] in a workspace buffer whose last column was set to one when allocated."""
    G, C, Dv = v.shape
    buf, fresh = ws.get(name, G, C, Dv + 1)
    if fresh:
        buf[..., Dv] = 1.0
    buf[..., :Dv].copy_(v)
    return buf


def _forward_block(q, k, v, decay, S, h, out, den, eps, ws):
    """One block: h heads x n chunks. q, k: (h*n, C, Dk), v: (h*n, C, Dv), S: (h, Dk, Dv').

    Writes the block's output (and denominators) in place; returns the state after the block.
    """
    G, C, Dk = q.shape
    Dv = v.shape[-1]
    va = v if den is None else _with_ones(v, ws, "va")  # v' = [v, 1]: the last column is the normaliser
    Dva = va.shape[-1]
    scan = _scan_for(decay, h, G // h, q)
    k_in = k if decay is None else torch.mul(k, decay.k_scale, out=ws("k_in", G, C, Dk))  # decayed to the chunk end
    # 1. the state entering each chunk: per-chunk increments k^T v' (one bmm), then the scan
    inc = torch.bmm(k_in.transpose(1, 2), va, out=ws("inc", G, Dk, Dva))
    E, S = scan(S, inc, out=ws("E", G, Dk, Dva))
    # 2. the past through the state, y = q E, then this chunk: y += (q k^T * M) v'
    y = torch.bmm(q, E, out=out if den is None else ws("y", G, C, Dva))
    if decay is not None:
        y.mul_(decay.q_scale)
    A = _apply_mask(torch.bmm(q, k.transpose(1, 2), out=ws("A", G, C, C)), decay)
    y.baddbmm_(A, va)
    if den is not None:  # y = [numerator, denominator - eps]
        torch.add(y[..., Dv], eps, out=den)
        torch.div(y[..., :Dv], den.unsqueeze(-1), out=out)
    return S


def _backward_block(q, k, v, decay, S, h, do, o, den, dS, dq, dk, dv, dc, ws):
    """Gradients of one block, from the state entering it (`S`, the forward's checkpoint) and
    dL/d(state after it) (`dS`). Writes dq, dk, dv (and dc) in place; returns dL/d(state before it)."""
    G, C, Dk = q.shape
    Dv = v.shape[-1]
    scan = _scan_for(decay, h, G // h, q)
    if den is None:
        va, dy = v, do
    else:
        # o = y[:Dv] / den with den = y[Dv] + eps: dy = [do / den, -(do . o) / den]
        va = _with_ones(v, ws, "va")
        dy = ws("dy", G, C, Dv + 1)
        rden = den.reciprocal().unsqueeze(-1)
        if torch.compiler.is_compiling():  # functionalisation takes no non-contiguous out=
            dy[..., :Dv] = do * rden
            dy[..., Dv:] = (do * o).sum(-1, keepdim=True)
        else:
            torch.mul(do, rden, out=dy[..., :Dv])
            torch.sum(torch.mul(do, o, out=ws("do_o", G, C, Dv)), -1, keepdim=True, out=dy[..., Dv:])
        dy[..., Dv:].mul_(rden).neg_()
    Dva = va.shape[-1]
    k_in = k if decay is None else torch.mul(k, decay.k_scale, out=ws("k_in", G, C, Dk))
    q_in = q if decay is None else torch.mul(q, decay.q_scale, out=ws("q_in", G, C, Dk))
    # recompute the state entering every chunk, as the forward did ...
    inc = torch.bmm(k_in.transpose(1, 2), va, out=ws("inc", G, Dk, Dva))
    E, _ = scan(S, inc, out=ws("E", G, Dk, Dva))
    # ... and dL/d(state leaving every chunk): the same scan, transposed (run backwards)
    dinc = torch.bmm(q_in.transpose(1, 2), dy, out=ws("dinc", G, Dk, Dva))
    dE, dS = scan(dS, dinc, reverse=True, out=ws("dE", G, Dk, Dva))
    # the intra-chunk matrices, recomputed: A = q k^T * M and dA = (dy v'^T) * M
    A = _apply_mask(torch.bmm(q, k.transpose(1, 2), out=ws("A", G, C, C)), decay)
    dA = _apply_mask(torch.bmm(dy, va.transpose(1, 2), out=ws("dA", G, C, C)), decay)
    # dq = dA k + exp(b) * (dy E^T)
    torch.bmm(dy, E.transpose(1, 2), out=dq)
    if decay is not None:
        dq.mul_(decay.q_scale)
    dq.baddbmm_(dA, k)
    # dk = dA^T q + exp(b_C - b) * (v' dE^T)
    torch.bmm(va, dE.transpose(1, 2), out=dk)
    if decay is not None:
        dk.mul_(decay.k_scale)
    dk.baddbmm_(dA.transpose(1, 2), q)
    # dv = A^T dy + exp(b_C - b) * (k dE)   (the first Dv columns: the ones column is constant)
    torch.bmm(k_in, dE[..., :Dv], out=dv)
    dv.baddbmm_(A.transpose(1, 2), dy[..., :Dv])
    if dc is not None:
        # dL/dc_t = q_t . dq_t - k_t . dk_t  (the caller reverse-cumsums it into dL/dg)
        torch.sub((q * dq).sum(-1), (k * dk).sum(-1), out=dc)
    return dS
