"""The delta rule's Triton kernels as torch custom ops, so that `torch.compile(fullgraph=True)`
traces `delta_rule_attention(backend="triton")` (and the delta-rule layers on CUDA) in one graph.

    delta_fwd  (q, k, v, beta, g?, S0?, chunk_size?) -> (o, S_T)
    delta_bwd  (q, k, v, beta, g?, S0?, do?, dS_T?, chunk_size?) -> (dq, dk, dv, dbeta, dg, dS0)

As in custom_ops.py: the fake (meta) implementations give shapes and dtypes without a kernel
(o in v's dtype, S_T float32; each gradient in its input's shape and dtype), a gradient of an
input that is None is an empty float32 stand-in of shape (0,), and the forward's autograd
calls the backward op once (once-differentiable). Eager calls keep the plain autograd
Function of delta_triton.py, which skips the dispatcher.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .delta_triton import _kernels, delta_rule_bwd
from .once import once_differentiable


def _absent(like: Tensor) -> Tensor:
    return torch.empty(0, dtype=torch.float32, device=like.device)


@torch.library.custom_op("linattn::delta_fwd", mutates_args=())
def delta_fwd(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor | None, S0: Tensor | None,
              chunk_size: int | None) -> tuple[Tensor, Tensor]:
    """(o, S_T) of the chunked delta rule on the kernels, contiguous as the fake says (head dims
    the kernels pad, e.g. 8, come back as slices of the padded outputs)."""
    o, S_T = _kernels().delta_rule_fwd(q, k, v, beta, log_decay=g, initial_state=S0, store_final_state=True,
                                       chunk_size=chunk_size)
    return o.contiguous(), S_T.contiguous()


@delta_fwd.register_fake
def _delta_fwd_fake(q, k, v, beta, g, S0, chunk_size):
    B, H, T, Dk = q.shape
    o = torch.empty(B, H, T, v.shape[-1], dtype=v.dtype, device=q.device)
    return o, torch.empty(B, H, Dk, v.shape[-1], dtype=torch.float32, device=q.device)


@torch.library.custom_op("linattn::delta_bwd", mutates_args=())
def delta_bwd(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor | None, S0: Tensor | None,
              do: Tensor | None, dS_T: Tensor | None, chunk_size: int | None,
              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dbeta, dg, dS0) of `delta_fwd`; dg and dS0 empty when g or S0 is None."""
    gr = delta_rule_bwd(q, k, v, beta, torch.zeros_like(v) if do is None else do, dS_T, log_decay=g,
                        initial_state=S0, chunk_size=chunk_size)
    dg = _absent(q) if g is None else gr["dg"].to(g.dtype)
    dS0 = _absent(q) if S0 is None else gr["dS0"].to(S0.dtype)
    return gr["dq"].contiguous(), gr["dk"].contiguous(), gr["dv"].contiguous(), \
        gr["dbeta"].to(beta.dtype).contiguous(), dg, dS0


@delta_bwd.register_fake
def _delta_bwd_fake(q, k, v, beta, g, S0, do, dS_T, chunk_size):
    def like(x):
        return _absent(q) if x is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    return like(q), like(k), like(v), like(beta), like(g), like(S0)


def _setup(ctx, inputs, output) -> None:
    q, k, v, beta, g, S0, chunk_size = inputs
    ctx.save_for_backward(q, k, v, beta, g, S0)
    ctx.chunk_size = chunk_size
    ctx.set_materialize_grads(False)


@once_differentiable("delta_rule_attention(backend='triton')", "backend='torch' is plain torch and has them.")
def _backward(ctx, do, dS_T):
    q, k, v, beta, g, S0 = ctx.saved_tensors
    dq, dk, dv, dbeta, dg, dS0 = torch.ops.linattn.delta_bwd(q, k, v, beta, g, S0, do, dS_T, ctx.chunk_size)
    return dq, dk, dv, dbeta, None if g is None else dg, None if S0 is None else dS0, None


delta_fwd.register_autograd(_backward, setup_context=_setup)
