"""torch.func support for the library's autograd Functions: the vmap rule they share.

`torch.func` transforms -- `grad`, `vjp`, `vmap` and their compositions, such as per-sample
gradients `vmap(grad(loss), in_dims=(None, 0, 0))` for DP-SGD -- call an autograd.Function
through its `setup_context` (every Function here has one) and, under `vmap`, through its
`vmap` staticmethod. A Function's own forward cannot run on batched tensors: it writes into
buffers and launches kernels. But every causal op here treats each (batch, head) row on its
own, so a mapped dimension is one more batch dimension: the rule moves it in front, folds it
into the batch ((V, B, H, T, D) -> (V B, H, T, D)), calls the Function once, and unfolds
its outputs. An input that is not mapped is repeated V times (`vmap` semantics: the same
tensor for every mapped slice).

A log-decay per head, (H,), stays one when it is not mapped; mapped ((V, H)), it differs
between the slices of the folded batch and becomes a log-decay per token, (V B, H, T).
Packed sequences (`cu_seqlens`) are one row already: they are refused under vmap.
"""
from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor


def _front(x: Tensor, dim: int | None, size: int) -> Tensor:
    """x with its mapped dim first, or repeated `size` times in front when it has none."""
    return x.movedim(dim, 0) if dim is not None else x.expand(size, *x.shape)


def fold_into_batch(size: int, in_dims: Sequence[int | None], args: Sequence,
                    batched: Sequence[int], decay: int | None = None,
                    decay_per_token: bool = False) -> list:
    """`args` of an op's call under vmap (`size` mapped slices), with the mapped dim folded
    into the batch.

    batched: the positions of the tensors whose first dim is the batch (B, ...), a None
    skipped; the first must hold q, (B, H, T, D). decay: the position of the log-decay ((H,)
    or (B, H, T)), if any. A per-head decay stays (H,) when it is not mapped, unless
    decay_per_token (a backward, whose gradient of it must be one per mapped slice); else
    it becomes one per token of each folded row. Returns the new argument list (the other
    arguments as they were)."""
    V = size
    out = list(args)
    for i in batched:
        if args[i] is not None:
            x = _front(args[i], in_dims[i], V)
            out[i] = x.reshape(V * x.shape[1], *x.shape[2:])
    g = None if decay is None else args[decay]
    if g is None:
        return out
    mapped = in_dims[decay] is not None
    per_head = g.dim() - mapped == 1
    if per_head and not (mapped or decay_per_token):
        return out  # (H,): the same for every row
    g = _front(g, in_dims[decay], V)
    if per_head:  # (V, H) -> (V, B, H, T)
        q = out[batched[0]]
        g = g[:, None, :, None].expand(V, q.shape[0] // V, g.shape[1], q.shape[2])
    out[decay] = g.reshape(V * g.shape[1], *g.shape[2:])
    return out


def unfold_from_batch(outputs: Sequence, size: int) -> tuple[tuple, tuple]:
    """(outputs, out_dims) of a vmap rule: each output's folded batch split back into
    (size, B, ...), mapped at dim 0; a None, or the empty (0,) stand-in of an absent output,
    unmapped."""
    values, dims = [], []
    for x in outputs:
        mapped = isinstance(x, Tensor) and x.dim() >= 2
        values.append(x.unflatten(0, (size, -1)) if mapped else x)
        dims.append(0 if mapped else None)
    return tuple(values), tuple(dims)
