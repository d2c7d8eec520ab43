"""The paths that loop on the host, as torch custom ops, so that `torch.compile(fullgraph=True)`
traces a call of theirs in one graph, at any sequence length.

The torch paths of `linear_attention` and every path of `delta_rule_attention` run packed
sequences one span at a time: they read cu_seqlens on the host, which a traced graph cannot.
The causal torch paths of `linear_attention` (chunked and recurrent) loop over blocks of chunks
or tokens whose number and grouping depend on T: traced, the loop is unrolled for one length,
and a second length (which makes T symbolic) cannot be traced at all. Wrapped in an op, the
loop is opaque to the compiler: the graph holds one call whose fake (meta) implementation gives
the shapes, and the loop runs at run time as in eager mode.

    <name>_fwd (q, k, v, beta?, g?, S0?, z0?, cu_seqlens?, causal, normalize, form, eps,
                chunk_size?, backend) -> (o, S, z)
    <name>_bwd (the same inputs, do?, dS?, dz?) -> (dq, dk, dv, dbeta, dg, dS0, dz0)

o is in v's dtype, S (N, H, Dk, Dv) and z (N, H, Dk), N sequences (B without cu_seqlens), in the library's accumulation dtype
(float64 for float64 q, else float32); z is empty (shape (0,)) when not normalising, as is the
gradient of an input that is None; gradients come in their inputs' strides. The backward recomputes the forward under autograd and
differentiates it (once differentiable): a packed call costs one extra forward when compiled.
`make_host_op(name, eager)` registers one op pair; linear.py and delta.py each make theirs
from their own eager function, so this module imports neither.

The same ops carry `torch.func` (grad, vjp, vmap, per-sample gradients): under a transform
linear.py and delta.py call them instead of the library's autograd Functions, which torch.func
cannot run (they write into buffers, launch kernels, and have no setup_context). The call goes
through a Function that has one (`Transformable`), and both ops have vmap rules that fold the
mapped dim into the batch (func_rules.py).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import Tensor

from .func_rules import fold_into_batch, unfold_from_batch

Eager = Callable[..., tuple[Tensor, Tensor, Tensor | None]]
_DIFFERENTIABLE = 7  # q, k, v, beta, g, S0, z0; then cu_seqlens (or None) and the settings


def _absent(like: Tensor) -> Tensor:
    return torch.empty(0, dtype=torch.float32, device=like.device)


def _accumulation(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _autograd_inside_op() -> contextlib.AbstractContextManager:
    """Autograd back on inside a custom op's implementation, which the dispatcher runs below
    the autograd keys (torch.enable_grad alone records nothing there). Private torch API
    (dispatch-key TLS, torch 2.x); the backward op below is its only user."""
    C = torch._C
    exclude = C._dispatch_tls_local_exclude_set()
    for key in (C.DispatchKey.AutogradOther, C.DispatchKey.AutogradNestedTensor, C.DispatchKey.AutogradFunctionality):
        exclude = exclude.remove(key)
    return C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), exclude)


def func_transform_active() -> bool:
    """Whether a `torch.func` transform is running (one C call); never while torch.compile
    traces (the traced host ops are the ones compile already uses). linear.py, delta.py and
    features.py route every call through the host ops then, whatever its inputs: torch
    refuses the library's own autograd Functions under any running transform."""
    return not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is not None


def under_func_transform(*tensors: Tensor | None) -> bool:
    """Whether any of `tensors` (None skipped) is a tensor of a `torch.func` transform (grad,
    vjp, vmap, ...): an input that a transform differentiates or maps. The library's
    own autograd Functions and its loops that write into buffers cannot run on those: such
    calls go through the host ops, which torch.func takes (register_autograd) and maps
    (their vmap rules fold the mapped dim into the batch, func_rules.py)."""
    if not func_transform_active():
        return False
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return any(x is not None and wrapped(x) for x in tensors)


def _outer_grad_levels(tensors) -> set[int]:
    """The running torch.func grad levels that track one of `tensors` (the backward's saved
    inputs and cotangents) from outside the level whose backward this is: what would
    differentiate it. That level's wrapper is each tensor's first grad wrapper (a vmap's may
    sit above it); a wrapper under it whose level is still running is an outer grad level.
    (A wrapper of a level that has ended, such as a vjp's once vjp returned, is dead.)"""
    F = torch._C._functorch
    running = {level.level() for level in F.get_interpreter_stack() or ()
               if level.key() in (F.TransformType.Grad, F.TransformType.Jvp)}
    levels = set()
    for x in tensors:
        inner = True
        while x is not None and F.is_functorch_wrapped_tensor(x):
            if F.is_gradtrackingtensor(x):
                if not inner and F.maybe_get_level(x) in running:
                    levels.add(F.maybe_get_level(x))
                inner = False
            x = F.get_unwrapped(x)
    return levels


def _refuse_second_derivatives(name: str, tensors) -> None:
    """Raise when a torch.func transform differentiates this backward (grad of grad, hessian,
    jacrev of jacrev): when an outer grad level tracks one of its inputs or cotangents. The
    backward is differentiable once: under plain autograd a second derivative raises
    (once_differentiable), but torch.func would take it for a constant and return zeros."""
    if func_transform_active() and _outer_grad_levels(tensors):
        raise NotImplementedError(
            f"linattn::{name}: second derivatives under torch.func (grad of grad, hessian, jacrev "
            "of jacrev) are not implemented for the paths that loop or launch kernels (the chunked "
            "and recurrent forms, the Triton backend, packed sequences): their backward is "
            "differentiable once; form='quadratic' is plain torch and has them")


def _refuse_packed(name: str, cu_seqlens: Tensor | None) -> None:
    if cu_seqlens is not None:
        raise NotImplementedError(
            f"linattn::{name}: torch.vmap over packed sequences (cu_seqlens) is not supported: "
            "map over a padded batch instead")


def make_host_op(name: str, eager: Eager) -> Callable[..., tuple[Tensor, Tensor, Tensor]]:
    """Register `linattn::<name>_fwd` / `_bwd` around `eager(q, k, v, beta, g, S0, z0, cu_seqlens,
    causal=, normalize=, form=, eps=, chunk_size=, backend=) -> (o, S, z or None)`; return a
    function of the forward op's arguments that calls it (through a Function that torch.func
    takes when one of its tensors is a transform's)."""

    @torch.library.custom_op(f"linattn::{name}_fwd", mutates_args=())
    def fwd(q: Tensor, k: Tensor, v: Tensor, beta: Tensor | None, g: Tensor | None, S0: Tensor | None,
            z0: Tensor | None, cu_seqlens: Tensor | None, causal: bool, normalize: bool, form: str, eps: float,
            chunk_size: int | None, backend: str) -> tuple[Tensor, Tensor, Tensor]:
        o, S, z = eager(q, k, v, beta, g, S0, z0, cu_seqlens, causal=causal, normalize=normalize, form=form,
                        eps=eps, chunk_size=chunk_size, backend=backend)
        return o.contiguous(), S.to(_accumulation(q)).contiguous(), _absent(q) if z is None else z.contiguous()

    @fwd.register_fake
    def _fwd_fake(q, k, v, beta, g, S0, z0, cu_seqlens, causal, normalize, form, eps, chunk_size, backend):
        B, H, T, Dk = q.shape
        N, dtype = B if cu_seqlens is None else cu_seqlens.shape[0] - 1, _accumulation(q)
        o = torch.empty(B, H, T, v.shape[-1], dtype=v.dtype, device=q.device)
        S = torch.empty(N, H, Dk, v.shape[-1], dtype=dtype, device=q.device)
        return o, S, torch.empty(N, H, Dk, dtype=dtype, device=q.device) if normalize else _absent(q)

    @torch.library.custom_op(f"linattn::{name}_bwd", mutates_args=())
    def bwd(q: Tensor, k: Tensor, v: Tensor, beta: Tensor | None, g: Tensor | None, S0: Tensor | None,
            z0: Tensor | None, cu_seqlens: Tensor | None, causal: bool, normalize: bool, form: str, eps: float,
            chunk_size: int | None, backend: str, do: Tensor | None, dS: Tensor | None, dz: Tensor | None,
            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        inputs = [None if t is None else t.detach().requires_grad_() for t in (q, k, v, beta, g, S0, z0)]
        with _autograd_inside_op(), torch.enable_grad():
            o, S, z = eager(*inputs, cu_seqlens, causal=causal, normalize=normalize, form=form, eps=eps,
                            chunk_size=chunk_size, backend=backend)
        pairs = [(out, grad) for out, grad in ((o, do), (S, dS), (z, dz)) if out is not None and grad is not None]
        wanted = [t for t in inputs if t is not None]
        grads = torch.autograd.grad([p[0] for p in pairs], wanted, [p[1].to(p[0].dtype) for p in pairs],
                                    allow_unused=True) if pairs else [None] * len(wanted)
        it = iter(grads)
        out = []
        for t in inputs:
            grad = None if t is None else next(it)
            # each gradient in its input's strides (a head split's q is a transposed view)
            out.append(_absent(q) if t is None else torch.zeros_like(t) if grad is None else
                       torch.empty_like(t).copy_(grad))
        return tuple(out)

    @bwd.register_fake
    def _bwd_fake(q, k, v, beta, g, S0, z0, *rest):
        return tuple(_absent(q) if t is None else torch.empty_like(t) for t in (q, k, v, beta, g, S0, z0))

    def setup(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs[:_DIFFERENTIABLE + 1])
        ctx.settings = inputs[_DIFFERENTIABLE + 1:]  # causal, normalize, form, eps, chunk_size, backend
        ctx.set_materialize_grads(False)

    @torch.autograd.function.once_differentiable
    def gradients(ctx, do, dS, dz):
        *saved, cu_seqlens = ctx.saved_tensors
        _refuse_second_derivatives(f"{name}_bwd", (*saved, do, dS, dz))
        grads = bwd(*saved, cu_seqlens, *ctx.settings, do, dS, dz if ctx.settings[1] else None)
        return (*(None if t is None else d for t, d in zip(saved, grads)), *([None] * (1 + len(ctx.settings))))

    fwd.register_autograd(gradients, setup_context=setup)
    _register_vmap_rules(name, fwd, bwd)
    return _with_func_transforms(fwd, setup, gradients)


def _register_vmap_rules(name: str, fwd, bwd) -> None:
    """vmap rules of an op pair: the mapped dim folded into the batch (func_rules.py)."""

    @fwd.register_vmap
    def _fwd_vmap(info, in_dims, q, k, v, beta, g, S0, z0, cu_seqlens, *settings):
        _refuse_packed(f"{name}_fwd", cu_seqlens)
        args = fold_into_batch(info.batch_size, in_dims, (q, k, v, beta, g, S0, z0), (0, 1, 2, 3, 5, 6), decay=4)
        return unfold_from_batch(fwd(*args, cu_seqlens, *settings), info.batch_size)

    @bwd.register_vmap
    def _bwd_vmap(info, in_dims, q, k, v, beta, g, S0, z0, cu_seqlens, *rest):
        # rest: the six settings, then do, dS, dz (each batch first, or None)
        _refuse_packed(f"{name}_bwd", cu_seqlens)
        args = fold_into_batch(info.batch_size, in_dims, (q, k, v, beta, g, S0, z0, cu_seqlens, *rest),
                               (0, 1, 2, 3, 5, 6, 14, 15, 16), decay=4, decay_per_token=True)
        grads, dims = unfold_from_batch(bwd(*args), info.batch_size)
        if g is not None and g.dim() - (in_dims[4] is not None) == 1:  # per head: sum its tokens
            grads = (*grads[:4], grads[4].sum((1, 3)), *grads[5:])
        return grads, dims


def _with_func_transforms(fwd, setup, gradients) -> Callable[..., tuple[Tensor, Tensor, Tensor]]:
    """A function of `fwd`'s arguments that calls it, through a Function that torch.func takes
    when one of its tensors is a transform's; `.op` is `fwd`."""

    class Transformable(torch.autograd.Function):
        """The op pair as a Function that torch.func takes (the autograd that register_autograd
        generates has no setup_context, which torch.func needs); its vmap rule is vmap of
        forward and backward, which map through the ops' own rules."""

        generate_vmap_rule = True
        forward = staticmethod(fwd)
        setup_context = staticmethod(setup)
        backward = staticmethod(gradients)

    def call(*args):
        if under_func_transform(*args[:_DIFFERENTIABLE]):
            return Transformable.apply(*args)
        return fwd(*args)

    call.op = fwd  # the registered op itself (opcheck)
    return call
