"""The Triton kernels as torch custom ops, so that `torch.compile(fullgraph=True)` sees them.

Five operators in the `linattn` namespace (`torch.ops.linattn.*`), registered when this module
is imported (`linear.py` imports it, so `import linattn_lib` is enough):

    causal_fwd      (q, k, v, g?, S0?, z0?, normalize, eps, return_state, cu_seqlens?)
                        -> (o, den, S_T, z_T)
    causal_fwd_keep (the same) -> (o, den, S_T, z_T, h, hz): also every chunk's entry state,
                        which its backward takes instead of recomputing them
    causal_bwd      (..., o, den?, S_T?, z_T?, do?, dS_T?, dz_T?, normalize, needs, cu_seqlens?,
                        h?, hz?) -> (dq, dk, dv, dg, dS0, dz0)
    noncausal_fwd   (q, k, v, S0?, z0?, normalize, eps) -> (o, den, S, z)
    noncausal_bwd   (..., o, den?, S, z?, do?, dS_T?, dz_T?, normalize, needs)
                        -> (dq, dk, dv, dS0, dz0)

Each has a fake (meta) implementation that gives the exact shapes and dtypes without running a
kernel: o has the dtype of v and shape (B, H, T, Dv); den (B, H, T), states (N, H, Dk, Dv) and
(N, H, Dk) are float32 (N = B, or the number of packed sequences with `cu_seqlens`). A custom
op cannot return None, so an output that does not exist (den without the normaliser, the
states without return_state, a gradient nobody asked for) is an empty float32 tensor of shape
(0,); the flags that decide it (normalize, return_state, needs) are arguments, so the fake
knows too. The forward ops are differentiable through `register_autograd`, whose backward calls
the backward op once: it is differentiable once (core/once.py), so asking for a second
derivative raises instead of silently treating the gradients as constants. This is what lets
`torch.compile` trace a model through the kernels without a graph break (fla instead wraps its
ops in `torch.compiler.disable`, which breaks the graph at every call).

The causal maths is `causal_forward` / `causal_backward` in triton_ops.py; the non-causal pair
is below. `cu_seqlens` (packed variable-length sequences) is part of the causal schema and
passed on only when given, so the kernels can take it without a schema change.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .once import once_differentiable
from .triton_ops import _state_grads, causal_backward, causal_forward, require_kernels


def _absent(like: Tensor) -> Tensor:
    """The stand-in for an output that does not exist: float32, shape (0,), on like's device."""
    return torch.empty(0, dtype=torch.float32, device=like.device)


def _or_absent(x: Tensor | None, like: Tensor) -> Tensor:
    return _absent(like) if x is None else x


def _present(needs: list[bool], inputs: tuple[Tensor | None, ...]) -> list[bool]:
    """Which gradients an op returns: asked for, and of an input that exists."""
    return [bool(n) and x is not None for n, x in zip(needs, inputs)]


def _grads_out(grads: tuple[Tensor | None, ...], present: list[bool], inputs: tuple[Tensor | None, ...]) -> tuple[Tensor, ...]:
    """The backward's results as tensors: each present one contiguous in its input's dtype
    (zeros if the maths gave none), every other one the empty stand-in."""
    out = []
    for grad, want, x in zip(grads, present, inputs):
        if not want:
            out.append(_absent(inputs[0]))
        elif grad is None:
            out.append(torch.zeros_like(x, memory_format=torch.contiguous_format))
        else:
            out.append(grad.to(x.dtype).contiguous())
    return tuple(out)


def _fake_grads(present: list[bool], inputs: tuple[Tensor | None, ...]) -> tuple[Tensor, ...]:
    return tuple(
        torch.empty_like(x, memory_format=torch.contiguous_format) if want else _absent(inputs[0])
        for want, x in zip(present, inputs)
    )


def _fake_forward(q: Tensor, v: Tensor, normalize: bool, with_state: bool, N: int) -> tuple[Tensor, ...]:
    """(o, den, S, z) as a forward returns them (see the module docstring)."""
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    f32 = {"dtype": torch.float32, "device": q.device}
    o = torch.empty(B, H, T, Dv, dtype=v.dtype, device=q.device)
    den = torch.empty(B, H, T, **f32) if normalize else _absent(q)
    S = torch.empty(N, H, Dk, Dv, **f32) if with_state else _absent(q)
    z = torch.empty(N, H, Dk, **f32) if (with_state and normalize) else _absent(q)
    return o, den, S, z


def _seqlens(cu_seqlens: Tensor | None) -> dict[str, Tensor]:
    """The keyword that passes `cu_seqlens` on, only when there is one."""
    return {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}


# ------------------------------------------------------------------------------ causal


@torch.library.custom_op("linattn::causal_fwd", mutates_args=())
def causal_fwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, S0: Tensor | None, z0: Tensor | None,
    normalize: bool, eps: float, return_state: bool, cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The causal forward (o, den, S_T, z_T); den, S_T and z_T empty where absent."""
    o, den, S_T, z_T = causal_forward(q, k, v, g, S0, z0, normalize, eps, return_state, **_seqlens(cu_seqlens))
    return o, _or_absent(den, q), _or_absent(S_T, q), _or_absent(z_T, q)


@causal_fwd.register_fake
def _causal_fwd_fake(q, k, v, g, S0, z0, normalize, eps, return_state, cu_seqlens=None):
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return _fake_forward(q, v, normalize, return_state, N)


@torch.library.custom_op("linattn::causal_bwd", mutates_args=())
def causal_bwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, S0: Tensor | None, z0: Tensor | None,
    o: Tensor, den: Tensor | None, S_T: Tensor | None, z_T: Tensor | None,
    do: Tensor | None, dS_T: Tensor | None, dz_T: Tensor | None,
    normalize: bool, needs: list[bool], cu_seqlens: Tensor | None = None,
    h: Tensor | None = None, hz: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dg, dS0, dz0) of `causal_fwd`; empty where `needs` is False or the input None.
    h, hz: the entry states from `causal_fwd_keep` (hz empty unless normalize), or None to
    recompute them."""
    inputs = (q, k, v, g, S0, z0)
    present = _present(needs, inputs)
    states = None if h is None else (h, hz if normalize else None)
    grads = causal_backward(q, k, v, g, S0, z0, o, den, S_T, z_T, do, dS_T, dz_T, normalize,
                            tuple(present), **_seqlens(cu_seqlens), entry_states=states)
    return _grads_out(grads, present, inputs)


@causal_bwd.register_fake
def _causal_bwd_fake(q, k, v, g, S0, z0, o, den, S_T, z_T, do, dS_T, dz_T, normalize, needs, cu_seqlens=None,
                     h=None, hz=None):
    inputs = (q, k, v, g, S0, z0)
    return _fake_grads(_present(needs, inputs), inputs)


@torch.library.custom_op("linattn::causal_fwd_keep", mutates_args=())
def causal_fwd_keep(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, S0: Tensor | None, z0: Tensor | None,
    normalize: bool, eps: float, return_state: bool, cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`causal_fwd` that also returns every chunk's entry state (h, hz; hz empty unless
    normalize), kept for its backward."""
    o, den, S_T, z_T, h, hz = causal_forward(q, k, v, g, S0, z0, normalize, eps, return_state,
                                             **_seqlens(cu_seqlens), keep_states=True)
    return o, _or_absent(den, q), _or_absent(S_T, q), _or_absent(z_T, q), h, _or_absent(hz, q)


@causal_fwd_keep.register_fake
def _causal_fwd_keep_fake(q, k, v, g, S0, z0, normalize, eps, return_state, cu_seqlens=None):
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return (*_fake_forward(q, v, normalize, return_state, N), *_fake_entry_states(q, v, normalize, cu_seqlens))


def _fake_entry_states(q: Tensor, v: Tensor, normalize: bool, cu_seqlens: Tensor | None) -> tuple[Tensor, Tensor]:
    """(h, hz) as `chunk_fwd_two_phase` makes them: (B, H, NT, Dk, Dv) in bf16 for bf16 inputs
    (fp32 otherwise) and (B, H, NT, Dk) fp32, NT the chunks of the state pass's config (their
    bound ceil(T / BT) + N - 1 for N packed sequences)."""
    K = require_kernels("linear_attention")
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    # every state config shares the output pass's chunk length (chunk_fwd_two_phase refuses
    # two), which depends on no shape but Dk: state_config would hash B * H, a SymInt
    # under dynamic shapes
    BT = K.chunk_decay.launch_config("chunk_output", Dk, q.dtype, q.device)["BT"]
    NT = -(-T // BT) + (0 if cu_seqlens is None else max(N - 1, 0))
    state_dtype = torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32
    h = torch.empty(B, H, NT, Dk, Dv, dtype=state_dtype, device=q.device)
    hz = torch.empty(B, H, NT, Dk, dtype=torch.float32, device=q.device) if normalize else _absent(q)
    return h, hz


def _causal_setup(ctx, inputs, output) -> None:
    q, k, v, g, S0, z0, normalize, _eps, return_state, cu_seqlens = inputs
    o, den, S_T, z_T, *states = output  # states: (h, hz) from causal_fwd_keep
    ctx.save_for_backward(q, k, v, g, S0, z0, o, den, S_T, z_T, cu_seqlens, *states)
    ctx.normalize, ctx.return_state = normalize, return_state
    # internal: saved for the backward, never handed out
    ctx.mark_non_differentiable(den, *states)
    ctx.set_materialize_grads(False)  # unused outputs get None (the backward skips them), not zeros


@once_differentiable("linear_attention(backend='triton')", "backend='torch' with form='quadratic' or "
                     "form='recurrent' is plain torch and has them.")
def _causal_backward(ctx, do, _dden, dS_T, dz_T, *_dstates):
    q, k, v, g, S0, z0, o, den, S_T, z_T, cu_seqlens, *states = ctx.saved_tensors
    normalize, state = ctx.normalize, ctx.return_state
    needs = [bool(n) for n in ctx.needs_input_grad[:6]]
    grads = torch.ops.linattn.causal_bwd(
        q, k, v, g, S0, z0, o, den if normalize else None, S_T if state else None,
        z_T if (state and normalize) else None, do, dS_T if state else None,
        dz_T if (state and normalize) else None, normalize, needs, cu_seqlens, *states,
    )
    return *(d if n else None for d, n in zip(grads, needs)), None, None, None, None


causal_fwd.register_autograd(_causal_backward, setup_context=_causal_setup)
causal_fwd_keep.register_autograd(_causal_backward, setup_context=_causal_setup)


# --------------------------------------------------------------------------- non-causal


def noncausal_forward(q: Tensor, k: Tensor, v: Tensor, S0: Tensor | None, z0: Tensor | None,
                      normalize: bool, eps: float) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
    """Non-causal forward: the global state (S, z), then one product. Returns (o, den, S, z);
    den and z are None unless normalize; S and z include the initial state."""
    K = require_kernels("linear_attention")
    init = (S0, z0) if S0 is not None else None
    S, z = K.noncausal_state(k, v, track_z=normalize, initial_state=init)
    o, den = K.noncausal_output(q, S, z=z if normalize else None, eps=eps, out_dtype=v.dtype)
    return o, den, S, z


def noncausal_backward(q: Tensor, k: Tensor, v: Tensor, S0: Tensor | None, z0: Tensor | None,
                       o: Tensor, den: Tensor | None, S: Tensor, z: Tensor | None,
                       do: Tensor | None, dS_T: Tensor | None, dz_T: Tensor | None,
                       normalize: bool, needs: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    """Gradients (dq, dk, dv, dS0, dz0) of `noncausal_forward`, None where `needs` is False."""
    K = require_kernels("linear_attention")
    need_q, need_k, need_v, need_S0, need_z0 = needs
    if do is None:
        do = torch.zeros_like(o)
    # r = 1 / den and dden = -(dO . o) / den in fp32, from one read of dO and o (a zero
    # cotangent selects 0); the kernels take dO as it is and apply r in fp32: no loss scaling
    r = dden = None
    if normalize:
        r, dden, _ = K.chunk_bwd_prep(do, o, den)
    dS_T, dz_T = _state_grads(dS_T, dz_T, S, z)
    end_state = (dS_T, dz_T) if dS_T is not None else None
    # dS = dS_T + sum_t r_t q_t dO_t^T and dz = dz_T + sum_t dden_t q_t: the state kernel with
    # (k, v) = (q, dO), keys scaled by r
    dS, dz = K.noncausal_state(q, do, track_z=normalize, weights=dden, key_scales=r, initial_state=end_state)
    dq = dk = dv = None
    if need_q:  # dq = r (dO S^T) + dden z^T
        dq, _ = K.noncausal_output(do, S.transpose(-1, -2), u=z if normalize else None, e=dden, row_scales=r,
                                   out_dtype=q.dtype)
    if need_k:  # dk = v dS^T + 1 dz^T
        dk, _ = K.noncausal_output(v, dS.transpose(-1, -2), u=dz if normalize else None, out_dtype=k.dtype)
    if need_v:  # dv = k dS
        dv, _ = K.noncausal_output(k, dS, out_dtype=v.dtype)
    dS0 = dS.to(S0.dtype) if need_S0 else None
    dz0 = dz.to(z0.dtype) if (need_z0 and dz is not None) else None
    return dq, dk, dv, dS0, dz0


@torch.library.custom_op("linattn::noncausal_fwd", mutates_args=())
def noncausal_fwd(
    q: Tensor, k: Tensor, v: Tensor, S0: Tensor | None, z0: Tensor | None, normalize: bool, eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The non-causal forward (o, den, S, z); den and z empty unless normalize."""
    o, den, S, z = noncausal_forward(q, k, v, S0, z0, normalize, eps)
    return o, _or_absent(den, q), S, _or_absent(z if normalize else None, q)


@noncausal_fwd.register_fake
def _noncausal_fwd_fake(q, k, v, S0, z0, normalize, eps):
    return _fake_forward(q, v, normalize, True, q.shape[0])


@torch.library.custom_op("linattn::noncausal_bwd", mutates_args=())
def noncausal_bwd(
    q: Tensor, k: Tensor, v: Tensor, S0: Tensor | None, z0: Tensor | None,
    o: Tensor, den: Tensor | None, S: Tensor, z: Tensor | None,
    do: Tensor | None, dS_T: Tensor | None, dz_T: Tensor | None, normalize: bool, needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dS0, dz0) of `noncausal_fwd`; empty where `needs` is False or the input None."""
    inputs = (q, k, v, S0, z0)
    present = _present(needs, inputs)
    grads = noncausal_backward(q, k, v, S0, z0, o, den, S, z, do, dS_T, dz_T, normalize, tuple(present))
    return _grads_out(grads, present, inputs)


@noncausal_bwd.register_fake
def _noncausal_bwd_fake(q, k, v, S0, z0, o, den, S, z, do, dS_T, dz_T, normalize, needs):
    inputs = (q, k, v, S0, z0)
    return _fake_grads(_present(needs, inputs), inputs)


def _noncausal_setup(ctx, inputs, output) -> None:
    q, k, v, S0, z0, normalize, _eps = inputs
    o, den, S, z = output
    ctx.save_for_backward(q, k, v, S0, z0, o, den, S, z)
    ctx.normalize = normalize
    ctx.mark_non_differentiable(den)
    ctx.set_materialize_grads(False)


@once_differentiable("linear_attention(causal=False, backend='triton')", "backend='torch' is plain "
                     "torch and has them.")
def _noncausal_backward(ctx, do, _dden, dS_T, dz_T):
    q, k, v, S0, z0, o, den, S, z = ctx.saved_tensors
    normalize = ctx.normalize
    needs = [bool(n) for n in ctx.needs_input_grad[:5]]
    grads = torch.ops.linattn.noncausal_bwd(
        q, k, v, S0, z0, o, den if normalize else None, S, z if normalize else None,
        do, dS_T, dz_T if normalize else None, normalize, needs,
    )
    return *(d if n else None for d, n in zip(grads, needs)), None, None


noncausal_fwd.register_autograd(_noncausal_backward, setup_context=_noncausal_setup)
