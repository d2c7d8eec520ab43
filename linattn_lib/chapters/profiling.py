"""What generation and training cost: per-token decode time and memory, and what backward keeps.

Chapter 4 of the book compares linear attention with softmax attention in the two places where
the sequence length shows up in practice:

* **Decoding** token by token: `profile_decoding` runs a decoder (`RecurrentDecoder` or
  `KVCacheDecoder` from `linattn_lib.core.decode`, or anything with `step(q_t, k_t, v_t)` and
  `nbytes`) over a sequence and records, at chosen context lengths, the median time of the steps
  just before that length and the bytes the decoder holds.
* **Training**: `saved_tensor_bytes` counts the bytes autograd keeps alive for the backward pass
  (a deterministic memory measure, unlike the process's resident set), and
  `profile_forward_backward` measures forward+backward time, saved bytes and peak memory over
  a range of sequence lengths.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..measure import (
    peak_memory_bytes,
    settle_cpu_allocator,
    timed_calls,
    torch_threads,
)


def _check_lengths(fn: str, name: str, lengths: Sequence[int], limit: int | None = None) -> list[int]:
    lengths = [int(t) for t in lengths]
    if not lengths or any(t < 1 for t in lengths):
        raise ValueError(f"{fn}: `{name}` must be a non-empty list of positive lengths, got {lengths!r}")
    if sorted(lengths) != lengths or len(set(lengths)) != len(lengths):
        raise ValueError(f"{fn}: `{name}` must be strictly increasing, got {lengths!r}")
    if limit is not None and lengths[-1] > limit:
        raise ValueError(f"{fn}: `{name}` goes up to {lengths[-1]} but the inputs have only T={limit} tokens")
    return lengths


# --------------------------------------------------------------------------------------
# decoding
# --------------------------------------------------------------------------------------


@dataclass
class DecodeProfile:
    """Result of `profile_decoding`: one entry per requested context length.

    contexts: the context lengths t (tokens seen after the step).
    step_seconds: median wall time of the `window` steps ending at each context.
    nbytes: the decoder's `nbytes` right after the step that reached each context.
    """

    contexts: list[int] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)


def profile_decoding(
    decoder: object,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    at: Sequence[int],
    window: int = 32,
    device: torch.device | str | None = None,
    threads: int | None = None,
) -> DecodeProfile:
    """Feed tokens 1..max(at) to `decoder.step` one at a time; time and size it at the contexts `at`.

    Args:
        decoder: an object with `step(q_t, k_t, v_t)` (token slices of shape (B, H, D)) and an
            `nbytes` property, e.g. `RecurrentDecoder` or `KVCacheDecoder`. It must be fresh
            (no tokens seen): the context length is counted from the first step here.
        q, k, v: (B, H, T, D) inputs (features for a linear-attention decoder), T >= max(at).
        at: increasing context lengths, each >= window.
        window: how many consecutive steps (ending at each context) the median is taken over;
            a median over a window is robust to the odd slow step on a busy machine.
        device: synchronised around each step when it is a CUDA device (default: q's device).
        threads: CPU threads for the run (`torch_threads`); None keeps torch's setting.

    Only the steps inside the windows are timed; the others just advance the decoder.
    """
    fn = "profile_decoding"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor) or x.dim() != 4:
            raise ValueError(f"{fn}: `{name}` must be a (B, H, T, D) tensor, got {getattr(x, 'shape', type(x))}")
    if not q.shape[2] == k.shape[2] == v.shape[2]:
        raise ValueError(f"{fn}: `q`, `k`, `v` must have the same T, got {q.shape[2]}, {k.shape[2]}, {v.shape[2]}")
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"{fn}: `window` must be a positive int, got {window!r}")
    at = _check_lengths(fn, "at", at, limit=q.shape[2])
    if at[0] < window:
        raise ValueError(f"{fn}: every context in `at` must be >= window={window}, got {at[0]}")
    if getattr(decoder, "tokens_seen", 0):
        raise ValueError(f"{fn}: `decoder` has already seen {decoder.tokens_seen} tokens; pass a fresh one")
    device = q.device if device is None else device
    timed = {t for c in at for t in range(c - window + 1, c + 1)}
    times: dict[int, float] = {}
    profile = DecodeProfile()
    with torch.no_grad(), torch_threads(threads):
        for t in range(1, at[-1] + 1):
            args = (q[:, :, t - 1], k[:, :, t - 1], v[:, :, t - 1])
            if t in timed:
                times[t] = timed_calls(lambda args=args: decoder.step(*args), warmup=0, repeats=1, device=device)[0]
            else:
                decoder.step(*args)
            if t in at:
                profile.contexts.append(t)
                profile.step_seconds.append(statistics.median(times[s] for s in range(t - window + 1, t + 1)))
                profile.nbytes.append(int(decoder.nbytes))
    return profile


# --------------------------------------------------------------------------------------
# training: what the backward pass keeps, and what forward+backward costs
# --------------------------------------------------------------------------------------


def saved_tensor_bytes(fn: Callable[[], Tensor]) -> int:
    """Bytes of the tensor storages autograd saves for the backward pass of `fn()`.

    `fn` runs the forward pass under `torch.autograd.graph.saved_tensors_hooks`; every tensor
    saved for backward (by built-in ops and by custom `autograd.Function`s through
    `ctx.save_for_backward`) is recorded, and each underlying storage is counted once, at its
    full size (a view keeps its whole storage alive). Leaf inputs that are saved count too.
    Tensors a Function keeps as plain `ctx` attributes are invisible to the hooks: the fast
    chunked path keeps its few block-boundary states that way (about 1% of the total at
    T = 16384, growing with T / 4096), so its count is a slight underestimate. The result is deterministic for
    given shapes and code path, unlike a process's peak memory, which is why the book asserts
    on it. The returned tensors are dropped, so nothing is kept.
    """
    storages: dict[tuple[torch.device, int], int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        storages[(t.device, storage.data_ptr())] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(storages.values())


@dataclass
class ForwardBackwardProfile:
    """Result of `profile_forward_backward`, one entry per length.

    lengths: the sequence lengths T.
    seconds: median wall time of one forward + backward pass.
    saved_bytes: `saved_tensor_bytes` of the forward pass.
    peak_bytes: peak extra memory of one forward + backward (`measure.peak_memory_bytes`;
        None where the platform cannot measure it).
    """

    lengths: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    saved_bytes: list[int] = field(default_factory=list)
    peak_bytes: list[int | None] = field(default_factory=list)


def profile_forward_backward(
    attention: Callable[[Tensor, Tensor, Tensor], Tensor],
    make_inputs: Callable[[int], tuple[Tensor, Tensor, Tensor]],
    lengths: Sequence[int],
    *,
    repeats: int = 3,
    warmup: int = 1,
    device: torch.device | str | None = None,
    threads: int | None = None,
) -> ForwardBackwardProfile:
    """Time and memory of `attention(q, k, v).sum().backward()` for each T in `lengths`.

    Args:
        attention: maps leaf tensors (q, k, v) to an output; apply feature maps inside it.
        make_inputs: T -> (q, k, v), tensors with requires_grad=True (fresh leaves each call).
        lengths: increasing sequence lengths.
        repeats, warmup: timed and untimed repetitions per length (median of the timed ones).
        device: synchronised around each pass when CUDA (default: the device of q).
        threads: CPU threads for the run (`torch_threads`); None keeps torch's setting.
    """
    fn = "profile_forward_backward"
    lengths = _check_lengths(fn, "lengths", lengths)
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"{fn}: `repeats` must be a positive int, got {repeats!r}")
    profile = ForwardBackwardProfile()
    settle_cpu_allocator()  # all lengths timed under the allocator the memory readings leave behind
    with torch_threads(threads):
        for T in lengths:
            _profile_one(profile, attention, make_inputs, T, repeats=repeats, warmup=warmup, device=device)
    return profile


def _profile_one(profile: ForwardBackwardProfile, attention: Callable, make_inputs: Callable, T: int, *, repeats: int,
                 warmup: int, device: torch.device | str | None) -> None:
    """Measure one length T and append the results to `profile`."""
    fn = "profile_forward_backward"
    q, k, v = make_inputs(T)
    if not all(isinstance(x, Tensor) and x.requires_grad for x in (q, k, v)):
        raise ValueError(f"{fn}: `make_inputs({T})` must return tensors (q, k, v) with requires_grad=True")
    dev = q.device if device is None else device

    def step():
        for x in (q, k, v):
            x.grad = None
        attention(q, k, v).sum().backward()

    seconds = timed_calls(step, warmup=warmup, repeats=repeats, device=dev)
    profile.lengths.append(T)
    profile.seconds.append(statistics.median(seconds))
    profile.saved_bytes.append(saved_tensor_bytes(lambda: attention(q, k, v)))
    profile.peak_bytes.append(peak_memory_bytes(step, device=dev))
