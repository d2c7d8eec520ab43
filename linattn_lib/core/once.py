"""Backward passes that are differentiable once, and refuse a second derivative out loud.

The library's fast paths compute their gradients with kernels or with a hand-written backward
from saved results (the chunked walk, the Triton ops, the fused FAVOR+ map): those gradients
are numbers, not functions of the inputs that autograd could differentiate again. torch's
`once_differentiable` guards such a backward only halfway. It marks the gradients as
non-differentiable when the *incoming* gradients require grad, but when they do not -- a loss
linear in the output, such as a gradient penalty behind a fixed readout -- the gradients come
back as plain tensors, and `create_graph=True` then silently differentiates everything around
the op and leaves the op out: a wrong second derivative with no error (found by a review:
0.038 against 0.082 for a penalty through the chunked form).

`once_differentiable(what, instead)` wraps such a backward: when it runs with
`create_graph=True` (grad mode on in a backward) it raises NotImplementedError at once, naming
the op and the path that has second derivatives; otherwise it is torch's decorator. Under a
torch.func transform the library's host op has its own check (packed_ops.py) and this one
stands aside: torch.func runs every backward with create_graph=True.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def once_differentiable(what: str, instead: str) -> Callable[[Callable], Callable]:
    """Decorate the backward of an autograd Function whose gradients are not differentiable:
    `what` names the op in the error, `instead` says which call has second derivatives."""

    def decorate(backward: Callable) -> Callable:
        inner = torch.autograd.function.once_differentiable(backward)

        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            if torch.is_grad_enabled() and any(ctx.needs_input_grad):
                from .packed_ops import func_transform_active

                if not func_transform_active():
                    raise NotImplementedError(
                        f"{what}: second derivatives are not implemented here (a backward with "
                        "create_graph=True reached it, e.g. a gradient penalty or a Hessian-vector "
                        "product): its gradients are computed, not differentiable again, and would "
                        f"be left out of the second derivative without a word. {instead}")
            return inner(ctx, *grads)

        return wrapper

    return decorate
