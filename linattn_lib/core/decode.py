"""Token-by-token decoding: linear attention's constant-size state beside softmax's KV cache.

Generating token t with softmax attention needs every past key and value (the KV cache grows
by one (k, v) pair per token: O(T) memory and O(T) work per step). Causal linear attention
folds the past into S = sum_j k_j v_j^T and z = sum_j k_j: O(1) memory and work per step,
whatever T is. These two classes are the torch references for that comparison; each step
returns exactly what the parallel form computes at that position.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import _validate as V
from . import triton_ops
from .state import DEFAULT_EPS, LinearAttentionState, compute_dtype


def _check_token(fn: str, name: str, x, expected: tuple[int, int, int], dtype: torch.dtype, device) -> None:
    """One token's (B, H, D) slice, matching the decoder's sizes, dtype and device."""
    V.check_shape(fn, name, x, expected, ("B", "H", "D"))
    if x.dtype != dtype:
        raise TypeError(f"{fn}: `{name}` has dtype {x.dtype} but the decoder takes {dtype}; cast it first")
    if x.device != device:
        raise ValueError(f"{fn}: `{name}` is on {x.device} but the decoder is on {device}")


def _nbytes(*tensors: Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def decode_update(
    q: Tensor, k: Tensor, v: Tensor, S: Tensor, z: Tensor | None,
    decay: Tensor | None, eps: float,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """One step of the recurrence, the one torch definition every decoder uses.

        S <- a S + k v^T,   z <- a z + k,   o = q S / (q . z + eps)   (o = q S without z)

    q, k: (B, H, Dk), v: (B, H, Dv), S: (B, H, Dk, Dv), z: (B, H, Dk) or None, decay a:
    (B, H) or None for no decay. Computed in float32 (float64 for a float64 state), whatever
    the dtypes of the inputs; returns (o, new S, new z) in that dtype.
    """
    dtype = compute_dtype(S)
    q, k, v, S = (x.to(dtype) for x in (q, k, v, S))
    if decay is not None:
        S = decay.to(dtype)[..., None, None] * S
    S = S + k.unsqueeze(-1) * v.unsqueeze(-2)
    o = (q.unsqueeze(-1) * S).sum(-2)
    if z is None:
        return o, S, None
    z = z.to(dtype)
    if decay is not None:
        z = decay.to(dtype)[..., None] * z
    z = z + k
    return o / ((q * z).sum(-1, keepdim=True) + eps), S, z


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
        device: torch.device | str | None = None,
        initial_state: LinearAttentionState | None = None,
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
        """Bytes held by the state; constant, independent of `tokens_seen`."""
        return _nbytes(self.S, self.z)

    def _decay(self, log_decay_t: Tensor | None) -> Tensor | None:
        """exp(log_decay_t) as a (B, H) factor, or None for no decay."""
        if log_decay_t is None:
            return None
        batch, heads = self.S.shape[:2]
        V.check_step_log_decay(
            "RecurrentDecoder.step", "log_decay_t", log_decay_t, B=batch, H=heads, device=self.S.device)
        return torch.exp(log_decay_t.to(self.S.dtype)).expand(batch, heads)

    def step(self, q_t: Tensor, k_t: Tensor, v_t: Tensor, log_decay_t: Tensor | None = None) -> Tensor:
        """Absorb token t into the state and return its output o_t of shape (B, H, Dv)."""
        fn = "RecurrentDecoder.step"
        batch, heads, dk, dv = self.S.shape
        for name, x, d in (("q_t", q_t, dk), ("k_t", k_t, dk), ("v_t", v_t, dv)):
            _check_token(fn, name, x, (batch, heads, d), self.dtype, self.S.device)
        o, self.S, z = decode_update(
            q_t, k_t, v_t, self.S, self.z, self._decay(log_decay_t), self.eps)
        if self.normalize:
            self.z = z
        self.tokens_seen += 1
        return o.to(self.dtype)


class KVCacheDecoder:
    """Causal softmax attention one token at a time, keeping every past key and value.

    The cache lives in preallocated buffers that double when full (amortised O(1) appends,
    as in a Python list), and each step attends over the `tokens_seen` filled rows:
    O(T) memory and O(T) work per step. `nbytes` counts the filled part (what a decoder must
    keep, T (Dk + Dv) numbers per head, 2 T d when Dk = Dv = d); `capacity_nbytes` the allocated buffers.
    """

    def __init__(
        self,
        batch: int,
        heads: int,
        dk: int,
        dv: int,
        *,
        scale: float | None = None,
        capacity: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
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
        """Bytes of the keys and values seen so far; grows linearly with `tokens_seen`."""
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


# --------------------------------------------------------------------------------------
# the functional step: one token, state updated in place (a Triton kernel on CUDA)
# --------------------------------------------------------------------------------------


def _check_decode(fn, q, k, v, state, log_decay, normalize):
    V.check_tensor(fn, "q_t", q, layout=("B", "H", "Dk"))
    V.check_tensor(fn, "k_t", k, layout=("B", "H", "Dk"))
    V.check_tensor(fn, "v_t", v, layout=("B", "H", "Dv"))
    V.check_same(fn, [("q_t", q), ("k_t", k), ("v_t", v)])
    B, H, Dk = q.shape
    Dv = v.shape[-1]
    if tuple(k.shape) != (B, H, Dk):
        raise ValueError(f"{fn}: `k_t` has shape {tuple(k.shape)}; expected (B, H, Dk) = {(B, H, Dk)} like `q_t`")
    if tuple(v.shape[:2]) != (B, H):
        raise ValueError(f"{fn}: `v_t` has shape {tuple(v.shape)}; expected (B, H, Dv) with (B, H) = {(B, H)}")
    V.check_state(fn, "state", state, B=B, H=H, Dk=Dk, Dv=Dv, device=q.device, normalize=normalize)
    # The state is updated in place: an expanded view (stride 0, e.g. from .expand()) would
    # have every batch row (or head) write the same memory.
    V.check_no_overlap(fn, "state.S", state[0])
    if normalize:
        V.check_no_overlap(fn, "state.z", state[1])
    if log_decay is not None:
        V.check_step_log_decay(fn, "log_decay_t", log_decay, B=B, H=H, device=q.device)
    _refuse_gradients(fn, q_t=q, k_t=k, v_t=v, log_decay_t=log_decay, state_S=state[0],
                      state_z=state[1] if normalize else None)


def _refuse_gradients(fn: str, **inputs: Tensor | None) -> None:
    """A RuntimeError when a gradient is being recorded for any of `inputs`: the step writes the
    state in place and returns an output cut off from the graph, so a loss through it would
    silently miss those gradients."""
    if not torch.is_grad_enabled():
        return
    wanting = [name.replace("_", ".", 1) if name.startswith("state") else name
               for name, x in inputs.items() if x is not None and x.requires_grad]
    if wanting:
        names = ", ".join(f"`{n}`" for n in wanting)
        raise RuntimeError(
            f"{fn}: {names} {'requires' if len(wanting) == 1 else 'require'} grad, but the decode step "
            "is inference only (it overwrites the state in place, and its output carries no "
            "gradient). Generate under torch.no_grad() or torch.inference_mode(); to train "
            "through a step, call linear_attention(q, k, v, initial_state=state, "
            "return_state=True) on the one token, which returns a new state and is "
            "differentiable.")


def _decode_torch(q, k, v, S, z, log_decay, eps):
    """`decode_update`, writing the new state into S and z in place."""
    B, H, _ = q.shape
    a = None if log_decay is None else torch.exp(log_decay.to(compute_dtype(S))).expand(B, H)
    o, S_new, z_new = decode_update(q, k, v, S, z, a, eps)
    S.copy_(S_new)
    if z is not None:
        z.copy_(z_new)
    return o.to(v.dtype)


def step_uses_kernel(q_t: Tensor, v_t: Tensor, state_dtypes: tuple[torch.dtype, ...], backend: str, *,
                     contiguous: bool = True) -> bool:
    """Whether `linear_attention_decode_step` runs the Triton kernel: backend "triton", or "auto"
    for CUDA inputs it takes (float32, float16 or bfloat16 tokens and state, head dims up to
    256, a contiguous state), as linear_attention decides; torch for the rest (e.g. a Performer
    layer's 266 features, a float64 state)."""
    fits = triton_ops.SUPPORTED_DTYPES
    return backend == "triton" or (
        backend == "auto" and q_t.is_cuda and contiguous and triton_ops.triton_supports(q_t, v_t)
        and all(dtype in fits for dtype in state_dtypes))


def decode_to_new_state(q_t: Tensor, k_t: Tensor, v_t: Tensor, state: LinearAttentionState,
                        log_decay_t: Tensor | None, normalize: bool, backend: str,
                        dtype: torch.dtype) -> tuple[Tensor, LinearAttentionState]:
    """(o_t, new state in `dtype`): `linear_attention_decode_step` for a caller that has checked
    its inputs (the layers) and keeps `state` as it was. Where the kernel runs, it updates a
    copy in place; torch computes the new state as a function (`decode_update`): no copy, no
    write back, none of the step's checks."""
    if step_uses_kernel(q_t, v_t, (dtype,), backend):
        new = LinearAttentionState(*(None if s is None else s.to(dtype, copy=True) for s in state[:2]))
        o = linear_attention_decode_step(q_t, k_t, v_t, new, log_decay_t=log_decay_t, normalize=normalize,
                                         backend=backend)
        return o, new
    S, z = (None if s is None else s.to(dtype) for s in state[:2])
    a = None if log_decay_t is None else torch.exp(log_decay_t.to(dtype)).expand(q_t.shape[:2])
    o, S, z_new = decode_update(q_t, k_t, v_t, S, z if normalize else None, a, DEFAULT_EPS)
    return o.to(v_t.dtype), LinearAttentionState(S, z_new if normalize else z)


def linear_attention_decode_step(
    q_t: Tensor,
    k_t: Tensor,
    v_t: Tensor,
    state: LinearAttentionState,
    *,
    log_decay_t: Tensor | None = None,
    normalize: bool = True,
    eps: float = DEFAULT_EPS,
    backend: str = "auto",
) -> Tensor:
    """One generation step of causal linear attention; updates `state` in place.

        S <- exp(g) S + k_t v_t^T,   z <- exp(g) z + k_t,   o_t = q_t S / (q_t . z + eps)

    Args:
        q_t, k_t: (B, H, Dk) features of the new token; v_t: (B, H, Dv).
        state: LinearAttentionState(S (B, H, Dk, Dv), z (B, H, Dk) or None), e.g. the state
            returned by `linear_attention(..., return_state=True)` on the prompt. S and z are
            overwritten with the new state (keep them in float32 for long generations); with
            normalize=False only S is read and written, and a z the state may hold is left
            as it was (an unnormalised call's state has none).
        log_decay_t: optional log-decay (<= 0) of this step, (H,) or (B, H).
        normalize: divide by q_t . z + eps (needs state.z).
        backend: "auto" (the Triton kernel for CUDA tensors it takes: float32, float16 or
            bfloat16 inputs and state, head dims up to 256; torch otherwise), "torch", or
            "triton" (on CPU: the interpreter; refuses what the kernel does not take).

    Returns:
        o_t of shape (B, H, Dv) in the dtype of v_t: exactly what the parallel form gives at
        this position. The new state is `state` itself, updated in place (unlike
        `delta_rule_decode_step`, which returns (o, new_state) and leaves its input as it was):
        to keep a prompt's state for several continuations, step from a copy of it. Inference only: inputs that require grad are refused (RuntimeError) while
        gradients are recorded; call it under torch.no_grad() or torch.inference_mode().
    """
    fn = "linear_attention_decode_step"
    V.check_choice(fn, "backend", backend, ("auto", "torch", "triton"))
    normalize = V.check_flag(fn, "normalize", normalize)
    eps = V.check_eps(fn, eps)  # a number (not a bool), finite, >= 0
    _check_decode(fn, q_t, k_t, v_t, state, log_decay_t, normalize)
    S, z = state[0], (state[1] if normalize else None)
    contiguous = S.is_contiguous() and (z is None or z.is_contiguous())
    use_triton = step_uses_kernel(q_t, v_t, (S.dtype, z.dtype if z is not None else S.dtype), backend,
                                  contiguous=contiguous)
    with torch.no_grad():
        if not use_triton:
            return _decode_torch(q_t, k_t, v_t, S, z, log_decay_t, eps)
        triton_ops._check_inputs(fn, q_t, v_t)
        for name, x in (("state.S", S), ("state.z", z)):
            if x is not None and x.dtype not in triton_ops.SUPPORTED_DTYPES:
                raise TypeError(f"{fn}: backend='triton' needs a float32/float16/bfloat16 `{name}`, got {x.dtype}")
        if contiguous:
            return triton_ops.load_kernels().decode_step(q_t, k_t, v_t, S, z, log_decay=log_decay_t, eps=eps)
        # the kernel updates a contiguous state in place: work on a copy, write it back (any
        # state the library returns is accepted, e.g. a transposed view from the torch path)
        S_c, z_c = S.contiguous(), (None if z is None else z.contiguous())
        o = triton_ops.load_kernels().decode_step(q_t, k_t, v_t, S_c, z_c, log_decay=log_decay_t, eps=eps)
        S.copy_(S_c)
        if z is not None:
            z.copy_(z_c)
        return o
