"""Token-by-token decoding: linear attention's constant-size state beside softmax's KV cache.

Generating token t with softmax attention needs every past key and value (the KV cache grows
by one (k, v) pair per token: O(T) memory and O(T) work per step). Causal linear attention
folds the past into S = sum_j k_j v_j^T and z = sum_j k_j: O(1) memory and work per step,
whatever T is. These two classes are the torch references for that comparison; each step
returns exactly what the parallel form computes at that position.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from . import _validate as V
from .attention import DEFAULT_EPS, LinearAttentionState


def _check_token(fn: str, name: str, x, expected: tuple[int, int, int], dtype: torch.dtype, device) -> None:
    """One token's (B, H, D) slice, matching the decoder's sizes, dtype and device."""
    V.check_shape(fn, name, x, expected, ("B", "H", "D"))
    if x.dtype != dtype:
        raise TypeError(f"{fn}: `{name}` has dtype {x.dtype} but the decoder takes {dtype}; cast it first")
    if x.device != device:
        raise ValueError(f"{fn}: `{name}` is on {x.device} but the decoder is on {device}")


def _nbytes(*tensors: Optional[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class RecurrentDecoder:
    """Causal linear attention one token at a time, with a state of constant size.

        S <- a S + k_t v_t^T,   z <- a z + k_t,   o_t = q_t S / (q_t . z + eps)

    where a = exp(log_decay_t) (1 without a decay). q_t, k_t are *features* (B, H, Dk), as for
    `linear_attention`; v_t is (B, H, Dv), all of `dtype`. The state is (B, H, Dk, Dv) + (B, H, Dk)
    numbers no matter how many tokens have been seen: that is `nbytes`. It is kept in float32
    (float64 for float64 tokens), as the parallel form keeps its sums: a float16 or bfloat16
    running sum would lose the small late increments. Outputs come back in `dtype`.
    """

    def __init__(
        self,
        batch: int,
        heads: int,
        dk: int,
        dv: int,
        *,
        normalize: bool = True,
        eps: float = DEFAULT_EPS,
        dtype: torch.dtype = torch.float32,
        device=None,
        initial_state: Optional[LinearAttentionState] = None,
    ) -> None:
        fn = "RecurrentDecoder"
        for name, value in (("batch", batch), ("heads", heads), ("dk", dk), ("dv", dv)):
            V.check_positive_int(fn, name, value)
        batch, heads, dk, dv = int(batch), int(heads), int(dk), int(dv)
        self.normalize = V.check_flag(fn, "normalize", normalize)
        self.eps = V.check_eps(fn, eps)
        self.dtype = V.check_dtype(fn, "dtype", dtype)
        state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        if initial_state is not None:
            if not isinstance(initial_state, tuple) or len(initial_state) != 2:
                raise TypeError(
                    f"{fn}: `initial_state` must be a LinearAttentionState(S, z) with S (B, H, Dk, Dv) = "
                    f"{(batch, heads, dk, dv)}, got {type(initial_state).__name__}"
                    + (f" of {V.describe(initial_state)}" if isinstance(initial_state, Tensor) else "")
                )
            S0, z0 = initial_state
            if device is None and isinstance(S0, Tensor):
                device = S0.device  # the decoder lives where its state does
            device = torch.device(device) if device is not None else torch.zeros(()).device
            V.check_state(
                fn, "initial_state", initial_state, B=batch, H=heads, Dk=dk, Dv=dv, device=device, normalize=self.normalize
            )
        self.S = torch.zeros(batch, heads, dk, dv, dtype=state_dtype, device=device)
        self.z = torch.zeros(batch, heads, dk, dtype=state_dtype, device=device) if self.normalize else None
        if initial_state is not None:
            self.S = S0.to(state_dtype)
            if self.normalize:
                self.z = z0.to(state_dtype)
        self.tokens_seen = 0

    @property
    def state(self) -> LinearAttentionState:
        """The current state, ready for `linear_attention(..., initial_state=...)`."""
        return LinearAttentionState(self.S, self.z)

    @property
    def nbytes(self) -> int:
        """Bytes held by the state: constant, independent of `tokens_seen`."""
        return _nbytes(self.S, self.z)

    def _decay(self, log_decay_t: Optional[Tensor]) -> Optional[Tensor]:
        """exp(log_decay_t) as a (B, H) factor, or None for no decay."""
        if log_decay_t is None:
            return None
        fn = "RecurrentDecoder.step"
        batch, heads = self.S.shape[:2]
        V.check_tensor(fn, "log_decay_t", log_decay_t)
        if tuple(log_decay_t.shape) not in ((heads,), (batch, heads)):
            raise ValueError(
                f"{fn}: `log_decay_t` has shape {tuple(log_decay_t.shape)}; expected (H,) = ({heads},) "
                f"or (B, H) = {(batch, heads)}"
            )
        if log_decay_t.device != self.S.device:
            raise ValueError(f"{fn}: `log_decay_t` is on {log_decay_t.device} but the decoder is on {self.S.device}")
        V.check_values(fn, "log_decay_t", log_decay_t, high=0.0, why="a decay factor exp(log_decay_t) in (0, 1]")
        return torch.exp(log_decay_t.to(self.S.dtype)).expand(batch, heads)

    def step(self, q_t: Tensor, k_t: Tensor, v_t: Tensor, log_decay_t: Optional[Tensor] = None) -> Tensor:
        """Absorb token t into the state and return its output o_t of shape (B, H, Dv)."""
        fn = "RecurrentDecoder.step"
        batch, heads, dk, dv = self.S.shape
        for name, x, d in (("q_t", q_t, dk), ("k_t", k_t, dk), ("v_t", v_t, dv)):
            _check_token(fn, name, x, (batch, heads, d), self.dtype, self.S.device)
        q_t, k_t, v_t = (x.to(self.S.dtype) for x in (q_t, k_t, v_t))
        a = self._decay(log_decay_t)
        if a is not None:
            self.S = a[..., None, None] * self.S
            self.z = a[..., None] * self.z if self.normalize else None
        self.S = self.S + k_t.unsqueeze(-1) * v_t.unsqueeze(-2)
        num = (q_t.unsqueeze(-1) * self.S).sum(-2)
        self.tokens_seen += 1
        if not self.normalize:
            return num.to(self.dtype)
        self.z = self.z + k_t
        return (num / ((q_t * self.z).sum(-1, keepdim=True) + self.eps)).to(self.dtype)


class KVCacheDecoder:
    """Causal softmax attention one token at a time, keeping every past key and value.

    The cache lives in preallocated buffers that double when full (amortised O(1) appends,
    as in a Python list), and each step attends over the `tokens_seen` filled rows:
    O(T) memory and O(T) work per step. `nbytes` counts the filled part (what a decoder must
    keep, 2 T (Dk + Dv) numbers per head); `capacity_nbytes` the allocated buffers.
    """

    def __init__(
        self,
        batch: int,
        heads: int,
        dk: int,
        dv: int,
        *,
        scale: Optional[float] = None,
        capacity: int = 16,
        dtype: torch.dtype = torch.float32,
        device=None,
    ) -> None:
        fn = "KVCacheDecoder"
        for name, value in (("batch", batch), ("heads", heads), ("dk", dk), ("dv", dv), ("capacity", capacity)):
            V.check_positive_int(fn, name, value)
        batch, heads, dk, dv, capacity = int(batch), int(heads), int(dk), int(dv), int(capacity)
        self.scale = 1.0 / math.sqrt(dk) if scale is None else V.check_finite_number(fn, "scale", scale)
        V.check_dtype(fn, "dtype", dtype)
        self.keys = torch.zeros(batch, heads, capacity, dk, dtype=dtype, device=device)
        self.values = torch.zeros(batch, heads, capacity, dv, dtype=dtype, device=device)
        self.tokens_seen = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values seen so far: grows linearly with `tokens_seen`."""
        n = self.tokens_seen
        return _nbytes(self.keys[:, :, :n], self.values[:, :, :n])

    @property
    def capacity_nbytes(self) -> int:
        """Bytes allocated, including the unused tail of the doubling buffers."""
        return _nbytes(self.keys, self.values)

    def _grow(self) -> None:
        """Double the buffers (copying the filled rows) so that appends stay amortised O(1)."""
        self.keys = torch.cat([self.keys, torch.zeros_like(self.keys)], dim=2)
        self.values = torch.cat([self.values, torch.zeros_like(self.values)], dim=2)

    def step(self, q_t: Tensor, k_t: Tensor, v_t: Tensor) -> Tensor:
        """Append (k_t, v_t) and return softmax(q_t K^T * scale) V over the cache, shape (B, H, Dv)."""
        fn = "KVCacheDecoder.step"
        batch, heads, _, dk = self.keys.shape
        dv = self.values.shape[-1]
        for name, x, d in (("q_t", q_t, dk), ("k_t", k_t, dk), ("v_t", v_t, dv)):
            _check_token(fn, name, x, (batch, heads, d), self.keys.dtype, self.keys.device)
        if self.tokens_seen == self.keys.shape[2]:
            self._grow()
        n = self.tokens_seen
        # writing into the buffer in place keeps the cache O(T) in memory; it is a decoder, not
        # a training path, so autograd through past steps is not a goal here
        self.keys[:, :, n] = k_t
        self.values[:, :, n] = v_t
        self.tokens_seen = n + 1
        K, Vs = self.keys[:, :, : n + 1], self.values[:, :, : n + 1]
        weights = torch.softmax((K @ q_t.unsqueeze(-1)).squeeze(-1) * self.scale, dim=-1)  # (B, H, n+1)
        return (weights.unsqueeze(-2) @ Vs).squeeze(-2)
