"""Shape checks of the launchers' arguments: metadata only, no pass over the
data and no host sync.

A kernel computes every address from the sizes it is given (B, H, T, Dk, Dv,
read from q and v) and from its own program ids; it never sees the shapes of
the other tensors. So an initial state with one row per batch where the call
packs three sequences, a log-decay laid out (B, T, H), or a k shorter than q
would be read, or written, outside the tensor: on a GPU silent corruption or an
illegal-address error. `linear_attention` and the layers check all of this
before the launchers; these checks are for code that calls the launchers
directly (as the book's readers may), and cost well under a microsecond each.

Values are not checked here (the kernels clamp what they can): cu_seqlens must
start at 0, not decrease and end at T, which `linattn_lib.linear_attention`
checks on CPU and, opt-in, on CUDA (LINATTN_CHECK_VALUES=1).
"""
from __future__ import annotations

import torch

INDEX_DTYPES = (torch.int32, torch.int64)
# CUDA launches at most 65535 programs along a grid's second and third axes
# (2^31 - 1 along the first); beyond, the launch fails ("invalid argument").
MAX_GRID_YZ = 65535


def checked_grid(fn: str, *axes: int) -> tuple:
    """A launch grid, refused where CUDA would refuse it: on every device, so
    that a CPU run (the interpreter has no limit) refuses what a GPU would."""
    if len(axes) > 1 and (axes[1] > MAX_GRID_YZ or axes[-1] > MAX_GRID_YZ):
        raise ValueError(
            f"{fn}: a grid of {axes} programs has more than {MAX_GRID_YZ} on "
            "its second or third axis, CUDA's limit (there: batch x heads, "
            "packed sequences x heads, or chunks); split the call in two")
    return axes


def expect(fn: str, name: str, x: torch.Tensor | None, shape: tuple,
           device: torch.device | None = None) -> None:
    """x is None, or a tensor of `shape` (on `device`, when given)."""
    if x is not None and (x.shape != shape or (
            device is not None and x.device != device)):
        where = "" if device is None else f" on {device}"
        raise ValueError(
            f"{fn}: `{name}` has shape {tuple(x.shape)} on {x.device}; "
            f"expected {tuple(shape)}{where}")


def sequences(fn: str, cu_seqlens: torch.Tensor | None, B: int,
              device: torch.device) -> int:
    """The number of sequences a call holds: B, or N for packed ones
    (cu_seqlens an int32/int64 (N + 1,) tensor beside the inputs, B = 1)."""
    if cu_seqlens is None:
        return B
    if (cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or B != 1
            or cu_seqlens.dtype not in INDEX_DTYPES
            or cu_seqlens.device != device):
        raise ValueError(
            f"{fn}: `cu_seqlens` must be an int32 or int64 (N + 1,) tensor on "
            f"{device} with inputs of batch size 1, got {cu_seqlens.dtype} "
            f"{tuple(cu_seqlens.shape)} on {cu_seqlens.device}, B = {B}")
    return cu_seqlens.numel() - 1


def check_decay(fn: str, g: torch.Tensor | None, B: int, H: int, T: int,
                device: torch.device) -> None:
    """A log-decay: None, one per head (H,) or one per token (B, H, T)."""
    if g is None:
        return
    shape = g.shape
    if not ((shape == (B, H, T) or shape == (H,)) and g.device == device):
        raise ValueError(
            f"{fn}: `log_decay` has shape {tuple(g.shape)} on {g.device}; "
            f"expected (H,) = {(H,)} or (B, H, T) = {(B, H, T)} on {device}")


def check_state(fn: str, name: str, state: tuple | None, rows: int, H: int,
                Dk: int, Dv: int, device: torch.device) -> None:
    """A state pair (S, z or None): S (rows, H, Dk, Dv), z (rows, H, Dk), one
    row per sequence."""
    if state is not None:
        expect(fn, f"{name}[0]", state[0], (rows, H, Dk, Dv), device)
        expect(fn, f"{name}[1]", state[1], (rows, H, Dk), device)


def check_causal(fn: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 *, log_decay: torch.Tensor | None = None,
                 initial_state: tuple | None = None,
                 cu_seqlens: torch.Tensor | None = None,
                 per_token: dict | None = None,
                 lengths: torch.Tensor | None = None) -> int:
    """A causal launcher's inputs: q, k (B, H, T, Dk) and v (B, H, T, Dv) of
    one dtype on one device, the log-decay, the initial state (one row per
    sequence), cu_seqlens, the tensors of `per_token` ({name: tensor or None},
    each (B, H, T)) and lengths ((B, H)). Returns the number of sequences.
    (Each check is guarded by a cheap test, so that the usual call, made on
    every training step, pays a few comparisons and no more.)"""
    shape, v_shape, device = q.shape, v.shape, q.device
    if len(shape) != 4:
        raise ValueError(f"{fn}: `q` must be (B, H, T, Dk), got shape "
                         f"{tuple(shape)}")
    B, H, T, Dk = shape
    Dv = v_shape[-1]
    if not (k.shape == shape and v_shape == (B, H, T, Dv)
            and k.device == device == v.device):
        expect(fn, "k", k, shape, device)
        expect(fn, "v", v, (B, H, T, Dv), device)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"{fn}: q, k and v must share a dtype, got "
                        f"{q.dtype}, {k.dtype} and {v.dtype}")
    rows = B if cu_seqlens is None else sequences(fn, cu_seqlens, B, device)
    if log_decay is not None:
        check_decay(fn, log_decay, B, H, T, device)
    if initial_state is not None:
        check_state(fn, "initial_state", initial_state, rows, H, Dk, Dv,
                    device)
    for name, x in (per_token or {}).items():
        if x is not None:
            expect(fn, name, x, (B, H, T), device)
    if lengths is not None:
        if cu_seqlens is not None:
            raise ValueError(f"{fn}: `lengths` (one per batch row) cannot be "
                             "combined with packed sequences (cu_seqlens)")
        expect(fn, "lengths", lengths, (B, H), device)
    return rows


def check_backward(fn: str, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, do: torch.Tensor, o: torch.Tensor | None,
                   den: torch.Tensor | None, log_decay: torch.Tensor | None,
                   initial_state: tuple | None, final_state_grad: tuple | None,
                   log_decay_end: torch.Tensor | None,
                   cu_seqlens: torch.Tensor | None) -> None:
    """The causal backward's inputs: the forward's (`check_causal`), dO and o
    shaped as v (dO in its dtype), den (B, H, T), the final state's gradient
    and log_decay_end ((sequences, H)) one row per sequence."""
    rows = check_causal(fn, q, k, v, log_decay=log_decay,
                        initial_state=initial_state, cu_seqlens=cu_seqlens)
    B, H, T, Dk = q.shape
    v_shape, device = v.shape, q.device
    if not (do.shape == v_shape and do.device == device
            and (o is None or o.shape == v_shape and o.device == device)
            and (den is None or den.shape == (B, H, T)
                 and den.device == device)):
        expect(fn, "do", do, v_shape, device)
        expect(fn, "o", o, v_shape, device)
        expect(fn, "den", den, (B, H, T), device)
    if do.dtype != q.dtype:
        raise TypeError(f"{fn}: `do` must have the inputs' dtype {q.dtype}, "
                        f"got {do.dtype}")
    if final_state_grad is not None:
        check_state(fn, "final_state_grad", final_state_grad, rows, H, Dk,
                    v_shape[-1], device)
    if log_decay_end is not None:
        expect(fn, "log_decay_end", log_decay_end, (rows, H), device)


def entry_states(fn: str, states: tuple, want: tuple, normalize: bool) -> tuple:
    """(h, hz), contiguous, after checking that they are the states of every
    chunk (entering it, or their gradients): h of shape `want`,
    (B, H, NT, Dk, Dv), and, when normalised, hz (B, H, NT, Dk)."""
    h, hz = states
    if h.shape != want or (normalize and (hz is None or hz.shape != want[:4])):
        raise ValueError(
            f"{fn}: entry states of shapes {tuple(h.shape)}, "
            f"{None if hz is None else tuple(hz.shape)} are not the entry "
            f"states {want}{', ' + str(want[:4]) if normalize else ''} of "
            "these chunks (the forward's chunk length differs?)")
    return h.contiguous(), (hz.contiguous() if normalize else None)
