"""Input checks used by positional.py, ssm.py and decoding.py on top of `_validate`.

`_validate.check_tensor` names a layout only for the (B, H, T, D) family; the SSM and RWKV
inputs have other layouts ((H,), (B, T, C), (B, H, T, N), ...), so these checks take the
layout as a string and keep the same message style: function, argument, what it got, what
was expected.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from . import _validate as V


def check_layout(fn: str, name: str, x, layout: Sequence[str]) -> None:
    """`x` is a floating tensor with one axis per name in `layout`, e.g. ("B", "H", "T", "N")."""
    V.check_tensor(fn, name, x)
    if x.dim() != len(layout):
        raise ValueError(
            f"{fn}: `{name}` must be a {len(layout)}-d tensor laid out as ({', '.join(layout)}), "
            f"got {V.describe(x)}"
        )


def check_shape(fn: str, name: str, x: Tensor, expected: Sequence[int], layout: Sequence[str]) -> None:
    """`x` has exactly the shape `expected` (named axis by axis by `layout`)."""
    check_layout(fn, name, x, layout)
    if tuple(x.shape) != tuple(expected):
        named = ", ".join(f"{a}={s}" for a, s in zip(layout, expected))
        raise ValueError(f"{fn}: `{name}` has shape {tuple(x.shape)}; expected ({named})")


def check_values(
    fn: str,
    name: str,
    x: Tensor,
    *,
    low: Optional[float] = None,
    high: Optional[float] = None,
    strict: bool = False,
    why: str = "",
) -> None:
    """All entries of `x` are finite and lie in [low, high] (or (low, high) when strict)."""
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{fn}: `{name}` contains NaN or infinite values ({V.describe(x)})")
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
    fn: str, name: str, value, *, low: Optional[float] = None, high: Optional[float] = None, strict_low: bool = False
) -> float:
    """A real number (not a bool, not a tensor) in [low, high]; returns it as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
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


def check_eps(fn: str, eps) -> float:
    return check_number(fn, "eps", eps, low=0.0)


def check_same_shape(fn: str, named: Sequence[tuple[str, Tensor]]) -> None:
    """All tensors have the shape of the first one."""
    name0, t0 = named[0]
    for name, t in named[1:]:
        if t.shape != t0.shape:
            raise ValueError(
                f"{fn}: `{name}` has shape {tuple(t.shape)} but `{name0}` has shape {tuple(t0.shape)}; expected them equal"
            )
