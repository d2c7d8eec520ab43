"""Input checks shared by every public function.

Each check raises an exception that names the function, the argument, what it got and what
was expected, so that a wrong shape is never silently broadcast into a wrong answer.

Checks of metadata (shapes, dtypes, devices, Python arguments) always run. Checks of tensor
values (finite, signs, ranges) run for CPU tensors in eager mode and, for CUDA tensors, only
when opted in (`CHECK_DEVICE_VALUES`, LINATTN_CHECK_VALUES=1): see `values_checked`.
"""
from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch import Tensor


def _fmt_shape(shape: Sequence[int]) -> str:
    """(2, 3) style; a 1-tuple keeps its comma, (3,), as Python writes it."""
    return str(tuple(int(s) for s in shape))


def describe(x: Tensor) -> str:
    """Shape, dtype and device of a tensor, for error messages."""
    return f"shape {_fmt_shape(x.shape)}, dtype {x.dtype}, device {x.device}"


def check_tensor(
    fn: str,
    name: str,
    x: object,
    *,
    ndim: int | None = None,
    floating: bool = True,
    layout: Sequence[str] | None = None,
) -> None:
    """`x` is a tensor (floating unless floating=False) with `ndim` axes.

    The message names the layout: `layout` axis by axis when given (("B", "H", "D") for one
    decoding token, ("B", "T") for token ids), which also sets ndim; without it only ndim=4 is
    named, as (B, H, T, D). Other ranks are not guessed: a 3-d tensor may be (B, H, D) or
    (B, T, C), a 2-d one (T, D), (m, d) or (B, T).
    """
    if layout is not None:
        ndim = len(layout)
    if not isinstance(x, Tensor):
        raise TypeError(f"{fn}: `{name}` must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        if layout is not None:
            shape = f"({', '.join(layout)})" if len(layout) != 1 else f"({layout[0]},)"
        else:
            shape = "(B, H, T, D)" if ndim == 4 else None
        laid_out = f" laid out as {shape}" if shape else ""
        raise ValueError(f"{fn}: `{name}` must be a {ndim}-d tensor{laid_out}, got {describe(x)}")
    if floating and not x.is_floating_point():
        raise TypeError(f"{fn}: `{name}` must have a floating-point dtype, got {describe(x)}")


def check_same(fn: str, tensors: Iterable[tuple[str, Tensor]]) -> None:
    """All tensors share one dtype and one device."""
    tensors = list(tensors)
    name0, t0 = tensors[0]
    for name, t in tensors[1:]:
        if t.dtype != t0.dtype:
            raise TypeError(
                f"{fn}: `{name}` has dtype {t.dtype} but `{name0}` has dtype {t0.dtype}; "
                "expected one dtype for all inputs (cast them first)"
            )
        if t.device != t0.device:
            raise ValueError(
                f"{fn}: `{name}` is on {t.device} but `{name0}` is on {t0.device}; "
                "expected all inputs on one device"
            )


def check_qkv(fn: str, q: Tensor, k: Tensor, v: Tensor) -> None:
    """q, k: (B, H, T, Dk), v: (B, H, T, Dv), one dtype, one device."""
    if _qkv_fine(q, k, v):  # the usual case, tested in one expression (hot path)
        return
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(fn, name, x, ndim=4)
    check_same(fn, [("q", q), ("k", k), ("v", v)])
    bht = tuple(q.shape[:3])
    for name, x in (("k", k), ("v", v)):
        if tuple(x.shape[:3]) != bht:
            raise ValueError(
                f"{fn}: `{name}` has shape {_fmt_shape(x.shape)} but `q` has shape "
                f"{_fmt_shape(q.shape)}; expected the same (B, H, T) = {_fmt_shape(bht)}"
            )
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"{fn}: `k` has feature size Dk={k.shape[-1]} but `q` has Dk={q.shape[-1]}; "
            f"expected q and k to share their last dimension (q {describe(q)}, k {describe(k)})"
        )
    if q.shape[2] == 0:
        raise ValueError(f"{fn}: sequence length T must be at least 1, got `q` with {describe(q)}")
    for axis, size in (("batch size B", q.shape[0]), ("number of heads H", q.shape[1]),
                       ("feature size Dk", q.shape[3]), ("value size Dv", v.shape[3])):
        if size == 0:
            raise ValueError(f"{fn}: the {axis} must be at least 1, got q {describe(q)}, v {describe(v)}")


def _qkv_fine(q: object, k: object, v: object) -> bool:
    """Everything `check_qkv` asks, in one expression: True when the inputs pass, False when
    `check_qkv` has to look at them one by one to say what is wrong."""
    return (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
            and q.dim() == 4 and k.dim() == 4 and v.dim() == 4 and q.is_floating_point()
            and q.dtype == k.dtype == v.dtype and q.device == k.device == v.device
            and q.shape[:3] == k.shape[:3] == v.shape[:3] and k.shape[3] == q.shape[3]
            and all(q.shape) and v.shape[3] > 0)


def check_choice(fn: str, name: str, value: object, choices: Sequence[object]) -> None:
    """`value` is one of `choices` (compared with ==, so a string, None or a number)."""
    try:
        ok = bool(value in choices)
    except Exception:  # e.g. a multi-element tensor, whose == gives no single truth value
        ok = False
    if not ok:
        raise ValueError(
            f"{fn}: unknown {name}={value!r}; expected one of {', '.join(map(repr, choices))} for `{name}`"
        )


def check_positive_int(fn: str, name: str, value: object) -> None:
    """A positive integer: a Python int or any other integral number (numpy's too), not a bool."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{fn}: `{name}` must be a positive int, got {value!r}")


def check_flag(fn: str, name: str, value: object) -> bool:
    """A switch: True or False; returns it as a Python bool.

    Only `bool` and numpy's `np.bool_` (what comparisons on arrays give) pass. Everything else
    is refused with a TypeError, because Python's truthiness would silently pick a branch:
    "no" and "False" count as True, 1 and 0 hide a mix-up with a count, None looks like a
    default and a tensor needs a device sync. Returns bool(value).
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{fn}: `{name}` must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def check_log_decay(fn: str, log_decay: Tensor, q: Tensor, *, causal: bool) -> None:
    """log_decay: (H,) per head or (B, H, T) per token, floating, finite and <= 0 (the values
    as `check_values` checks them: CPU tensors, CUDA ones when opted in)."""
    B, H, T = q.shape[:3]
    check_tensor(fn, "log_decay", log_decay)
    if not causal:
        raise ValueError(
            f"{fn}: `log_decay` needs causal=True (a decay is defined from the past to the "
            "present; with causal=False there is no order to decay along)"
        )
    if log_decay.device != q.device:
        raise ValueError(f"{fn}: `log_decay` is on {log_decay.device} but `q` is on {q.device}")
    # by rank first: comparing (B, H, T) with (H,) would guard B != H under torch.export
    if tuple(log_decay.shape) != ((H,) if log_decay.dim() == 1 else (B, H, T)):
        raise ValueError(
            f"{fn}: `log_decay` has shape {_fmt_shape(log_decay.shape)}; expected (H,) = ({H},) "
            f"per head or (B, H, T) = {_fmt_shape((B, H, T))} per token"
        )
    check_values(fn, "log_decay", log_decay, high=0.0, why="a decay factor exp(log_decay) in (0, 1]")


def check_step_log_decay(fn: str, name: str, x: Tensor, *, B: int, H: int, device: torch.device) -> None:
    """One decoding step's log-decay: (H,) per head or (B, H), on `device`, finite, <= 0."""
    check_tensor(fn, name, x)
    if tuple(x.shape) != ((H,) if x.dim() == 1 else (B, H)):
        raise ValueError(
            f"{fn}: `{name}` has shape {_fmt_shape(x.shape)}; expected (H,) = ({H},) per head "
            f"or (B, H) = {_fmt_shape((B, H))} for this token"
        )
    if x.device != device:
        raise ValueError(f"{fn}: `{name}` is on {x.device} but the state is on {device}")
    check_values(fn, name, x, high=0.0, why=f"a decay factor exp({name}) in (0, 1]")


def check_state(
    fn: str, name: str, state: object, *, B: int, H: int, Dk: int, Dv: int,
    device: torch.device, normalize: bool,
) -> None:
    """A LinearAttentionState(S, z): S (B, H, Dk, Dv), z (B, H, Dk) when normalising, on `device`."""
    if not isinstance(state, tuple) or len(state) != 2:
        raise TypeError(f"{fn}: `{name}` must be a LinearAttentionState(S, z), got {type(state).__name__}")
    S, z = state
    check_layout(fn, f"{name}.S", S, ("B", "H", "Dk", "Dv"))
    if tuple(S.shape) != (B, H, Dk, Dv):
        raise ValueError(f"{fn}: `{name}.S` has shape {tuple(S.shape)}; expected (B, H, Dk, Dv) = {(B, H, Dk, Dv)}")
    if S.device != device:
        raise ValueError(f"{fn}: `{name}.S` is on {S.device} but the inputs are on {device}")
    check_values(fn, f"{name}.S", S)
    if normalize:
        if z is None:
            raise ValueError(f"{fn}: normalize=True needs `{name}.z` of shape (B, H, Dk) = {(B, H, Dk)}, got None")
        check_layout(fn, f"{name}.z", z, ("B", "H", "Dk"))
        if tuple(z.shape) != (B, H, Dk):
            raise ValueError(f"{fn}: `{name}.z` has shape {tuple(z.shape)}; expected (B, H, Dk) = {(B, H, Dk)}")
        if z.device != device:
            raise ValueError(f"{fn}: `{name}.z` is on {z.device} but the inputs are on {device}")
        check_values(fn, f"{name}.z", z)


# --- checks for the other layouts of the SSM, RWKV and decoding inputs ((H,), (B, T, C), ...):
# the layout is named axis by axis, in the same message style.


def check_layout(fn: str, name: str, x: object, layout: Sequence[str]) -> None:
    """`x` is a floating tensor with one axis per name in `layout`, e.g. ("B", "H", "T", "N")."""
    check_tensor(fn, name, x)
    if x.dim() != len(layout):
        raise ValueError(
            f"{fn}: `{name}` must be a {len(layout)}-d tensor laid out as ({', '.join(layout)}), "
            f"got {describe(x)}"
        )


def check_shape(fn: str, name: str, x: Tensor, expected: Sequence[int], layout: Sequence[str]) -> None:
    """`x` has exactly the shape `expected` (named axis by axis by `layout`)."""
    check_layout(fn, name, x, layout)
    if tuple(x.shape) != tuple(expected):
        named = ", ".join(f"{a}={s}" for a, s in zip(layout, expected))
        raise ValueError(f"{fn}: `{name}` has shape {tuple(x.shape)}; expected ({named})")


# Opt-in: also check the values of tensors that are not on the CPU (CUDA), at the price of a
# pass over each checked tensor and a device-to-host sync per check. Off by default; on when
# the environment sets LINATTN_CHECK_VALUES=1 (read at import) or a program sets this to True.
CHECK_DEVICE_VALUES = os.environ.get("LINATTN_CHECK_VALUES", "") not in ("", "0")


def values_checked(x: Tensor | None = None) -> bool:
    """Whether the checks of tensor *values* (finite, signs, ranges) run for `x`.

    * CPU tensors, eager mode: yes. They cost a reduction per tensor (a sum, a min and max:
      see `check_values`), a few percent of the cheapest computation that reads the tensor.
    * CUDA (any tensor not on the CPU): no, unless opted in (`CHECK_DEVICE_VALUES`, or
      LINATTN_CHECK_VALUES=1 in the environment). A check needs the answer on the host:
      a device-to-host synchronisation and a pass over the data at every call, as much time
      as the kernels it guards on a training step's hot path.
      Not checked, a NaN or inf goes into the kernels, which propagate it as the recurrence
      does: every output that depends on it is NaN, none that does not (the kernels' masks
      select, they never multiply). Meta tensors have no values: never checked.
    * Tensors of `torch.func` transforms (grad, vmap, ...): no. Under vmap `bool(tensor)`
      cannot be answered for all the mapped slices at once.
    * While `torch.compile` traces: no. `bool(tensor)` would break the graph at every call,
      and a device-side assert cannot name the argument and the offending index.

    Checks of shapes, dtypes, devices and Python arguments always run: they read metadata
    (and compile into guards). x=None asks about the mode alone (is anything checked).
    """
    if torch.compiler.is_compiling():
        return False
    if x is None:
        return True
    # a torch.func transform's tensor is not: vmap cannot branch on values
    if x.is_cpu:
        return not torch._C._functorch.is_functorch_wrapped_tensor(x)
    return CHECK_DEVICE_VALUES and not x.is_meta and not torch._C._functorch.is_functorch_wrapped_tensor(x)


def _screened(x: Tensor, low: float | None, high: float | None, strict: bool) -> bool:
    """True when a cheap screen proves every entry finite and within the bounds: a sum
    (non-finite if any entry is inf or NaN) and a min / max (NaN if any entry is). False means
    "look closer", not "bad": a sum of finite values can overflow."""
    x = x.detach()
    total = x.sum(dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
    if not math.isfinite(float(total)):
        return False
    if low is None and high is None:
        return True
    lo, hi = (float(t) for t in torch.aminmax(x))
    return ((low is None or (lo > low if strict else lo >= low))
            and (high is None or (hi < high if strict else hi <= high)))


def check_values(
    fn: str,
    name: str,
    x: Tensor,
    *,
    low: float | None = None,
    high: float | None = None,
    strict: bool = False,
    why: str = "",
) -> None:
    """All entries of `x` are finite and lie in [low, high] (or (low, high) when strict).

    Where it runs is `values_checked(x)`'s rule: CPU tensors in eager mode; CUDA tensors only
    when opted in (CHECK_DEVICE_VALUES / LINATTN_CHECK_VALUES=1). A screen of one sum and one
    min/max pass clears good input; the exact element-wise test runs only when it fails."""
    if x.numel() == 0 or not values_checked(x) or _screened(x, low, high, strict):
        return
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{fn}: `{name}` contains NaN or infinite values ({describe(x)})")
    hint = f" ({why})" if why else ""
    if low is not None:
        bad = (x <= low) if strict else (x < low)
        if bool(bad.any()):
            op = ">" if strict else ">="
            raise ValueError(f"{fn}: `{name}` must be {op} {low:g}{hint}; got a minimum of {float(x.min()):.4g}")
    if high is not None:
        bad = (x >= high) if strict else (x > high)
        if bool(bad.any()):
            op = "<" if strict else "<="
            raise ValueError(f"{fn}: `{name}` must be {op} {high:g}{hint}; got a maximum of {float(x.max()):.4g}")


def check_number(
    fn: str, name: str, value: object, *, low: float | None = None, high: float | None = None, strict_low: bool = False
) -> float:
    """A real number (not a bool, not a tensor) in [low, high]; returns it as a float."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{fn}: `{name}` must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    too_low = low is not None and (value <= low if strict_low else value < low)
    too_high = high is not None and value > high
    if too_low or too_high or value != value:
        lo = "-inf" if low is None else f"{low:g}"
        hi = "inf" if high is None else f"{high:g}"
        bracket = "(" if strict_low else "["
        raise ValueError(f"{fn}: `{name}` must lie in {bracket}{lo}, {hi}], got {value!r}")
    return value


def check_eps(fn: str, eps: object) -> float:
    """A finite, non-negative eps (NaN or inf would silently turn every output into NaN or 0)."""
    value = check_number(fn, "eps", eps, low=0.0)
    if value == math.inf:  # not math.isfinite: compile(dynamic=True) makes eps a SymFloat
        raise ValueError(f"{fn}: `eps` must be finite, got {eps!r}")
    return value


def check_same_shape(fn: str, named: Sequence[tuple[str, Tensor]]) -> None:
    """All tensors have the shape of the first one."""
    name0, t0 = named[0]
    for name, t in named[1:]:
        if t.shape != t0.shape:
            raise ValueError(
                f"{fn}: `{name}` has shape {tuple(t.shape)} but `{name0}` has shape {tuple(t0.shape)}; expected them equal"
            )


# --- scalar arguments: numbers, integers, seeds, dtypes and objects of a given type


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def check_finite_number(fn: str, name: str, value: object, *, positive: bool = False, nonnegative: bool = False) -> float:
    """A finite real number (a Python or numpy int/float; not a bool, a string or a tensor).

    NaN and +-inf are refused (they turn every output into NaN or 0 without an error);
    positive=True also refuses <= 0, nonnegative=True refuses < 0. Raises TypeError for a
    wrong type and ValueError for a wrong value; returns the value as a float.
    """
    if not _is_real(value):
        raise TypeError(f"{fn}: `{name}` must be a number (a finite int or float), got {type(value).__name__} {value!r}")
    out = float(value)
    if out != out or abs(out) == math.inf:  # a SymFloat under compile(dynamic=True) has no math.isfinite
        raise ValueError(f"{fn}: `{name}` must be a finite number, got {value!r}")
    if positive and out <= 0:
        raise ValueError(f"{fn}: `{name}` must be a finite number > 0, got {value!r}")
    if nonnegative and out < 0:
        raise ValueError(f"{fn}: `{name}` must be a finite number >= 0, got {value!r}")
    return out


def check_int(fn: str, name: str, value: object, *, low: int | None = None, high: int | None = None) -> int:
    """An integer (Python or numpy, not a bool, not a float such as 2.0) in [low, high]; returns int."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{fn}: `{name}` must be an int, got {type(value).__name__} {value!r}")
    out = int(value)
    if (low is not None and out < low) or (high is not None and out > high):
        lo = "-inf" if low is None else str(low)
        hi = "inf" if high is None else str(high)
        raise ValueError(f"{fn}: `{name}` must be an int in [{lo}, {hi}], got {value!r}")
    return out


def check_seed(fn: str, name: str, value: object) -> int | None:
    """None (fresh randomness) or an int seed that torch.Generator.manual_seed takes; returns it."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{fn}: `{name}` must be None or an int seed, got {type(value).__name__} {value!r}")
    out = int(value)
    if not -(2**63) <= out < 2**64:
        raise ValueError(f"{fn}: `{name}` must lie in [-2**63, 2**64) to seed a torch.Generator, got {value!r}")
    return out


def check_dtype(fn: str, name: str, value: object, *, floating: bool = True) -> torch.dtype:
    """A torch.dtype (not a string such as "float32"), floating-point unless floating=False."""
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{fn}: `{name}` must be a torch.dtype such as torch.float32, got {type(value).__name__} {value!r}")
    if floating and not value.is_floating_point:
        raise TypeError(f"{fn}: `{name}` must be a floating-point torch.dtype, got {value}")
    return value


def check_instance(fn: str, name: str, value: object, types: type | tuple[type, ...], expected: str) -> None:
    """isinstance(value, types), else a TypeError that says what was `expected` (in words)."""
    if not isinstance(value, types):
        raise TypeError(f"{fn}: `{name}` must be {expected}, got {type(value).__name__} {value!r:.80}")


def check_no_overlap(fn: str, name: str, x: Tensor) -> None:
    """`x` owns one memory location per element, as a tensor updated in place must.

    An expanded tensor (a stride-0 axis of size > 1, what .expand() and broadcasting views
    give) would make every entry along that axis one shared number: an in-place update would
    write all of them into the same place.
    """
    for axis, (size, stride) in enumerate(zip(x.shape, x.stride())):
        if size > 1 and stride == 0:
            raise ValueError(
                f"{fn}: `{name}` is updated in place but axis {axis} has stride 0 (an expanded view, "
                f"{describe(x)}, strides {tuple(x.stride())}); expected a tensor that owns its memory: "
                "pass .clone() or .contiguous()"
            )
def check_all_finite(fn: str, named: Sequence[tuple[str, Tensor]]) -> None:
    """Refuse NaN and inf in q, k, v.

    In the chunked and quadratic forms a value at position t meets the causal mask's zeros
    in a matmul (0 * NaN = NaN) and would poison outputs *before* t, which the recurrent
    form keeps; so every form refuses it instead, naming the first position. (Finite
    garbage, e.g. in right-padding, is harmless: masks select, they do not multiply.)
    CPU tensors in eager mode only; CUDA tensors when opted in (see `values_checked`: the
    Triton kernels keep a NaN to the outputs that depend on it). A sum per tensor screens
    good input; the element-wise search runs only when the sum is not finite.
    """
    for name, x in named:
        if x.numel() == 0 or not values_checked(x) or _screened(x, None, None, False):
            continue
        bad = ~torch.isfinite(x)
        if bad.any():
            where = tuple(int(i) for i in bad.nonzero()[0])
            value = x[where].item()
            raise ValueError(
                f"{fn}: `{name}` has a non-finite value ({value}) at index {where} ({describe(x)}); "
                "expected finite values (pad with zeros, not NaN or inf)"
            )


def check_attention_mask(fn: str, mask: object, like: Tensor) -> Tensor:
    """An `attention_mask` for a batch shaped as `like` ((B, T, ...), or token ids (B, T)):
    (B, T) on its device, bool or 0/1 (Hugging Face's); returned as bool (True: a token)."""
    check_tensor(fn, "attention_mask", mask, floating=False, layout=("B", "T"))
    if tuple(mask.shape) != tuple(like.shape[:2]) or mask.device != like.device:
        raise ValueError(f"{fn}: `attention_mask` must be (B, T) = {tuple(like.shape[:2])} on {like.device}, "
                         f"got {describe(mask)}")
    if values_checked(mask) and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"{fn}: `attention_mask` must hold 0 (padding) and 1 (tokens), got {describe(mask)}")
    return mask != 0
