"""The delta rule's Triton backend: `delta_rule_attention(..., backend="triton")` lands here.

The kernels are in kernels/delta_rule.py (its module docstring has the maths of both passes).
The forward is `delta_rule_fwd`; the backward, `delta_rule_bwd` below, recomputes what the
forward did not keep and runs three kernels:

    delta_wy, delta_states          W, U, the entry states h and V_new again (forward kernels)
    delta_bwd_state_kernel          sequential, from the last chunk back: dS_{n+1} of every
                                    chunk, dV_new, and the initial state's gradient
    delta_bwd_dqk_kernel            parallel: dq, the dk of the outputs and states, dW, and
                                    their part of the log-decay's gradient
    delta_bwd_wy_kernel             parallel: the UT transform backward (through A^-1) into
                                    dk, dv, dbeta and its part of the log-decay's gradient
    torch, O(B H T)                 the log-decay's parts summed (over B and T for a decay
                                    per head)

On CUDA tensors the kernels are compiled; on CPU tensors they run in the Triton interpreter
(slow, but the same source). Gradients flow to q, k, v, beta, the log-decay and the initial
state; the final state's cotangent is taken into account.
"""
from __future__ import annotations

import importlib
from types import ModuleType

import torch
from torch import Tensor

from .once import once_differentiable
from .triton_ops import require_kernels

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _kernels() -> ModuleType:
    """kernels/delta_rule.py (imported as linattn_lib.kernels.delta_rule), or a RuntimeError."""
    require_kernels("delta_rule_attention(backend='triton')")
    return importlib.import_module("linattn_lib.kernels.delta_rule")


def delta_rule_bwd(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, do: Tensor, dS_final: Tensor | None, *,
                   log_decay: Tensor | None = None, initial_state: Tensor | None = None,
                   chunk_size: int | None = None) -> dict[str, Tensor | None]:
    """Gradients of the chunked delta rule (`delta_rule_fwd`'s arguments) for the cotangents dO
    (B, H, T, Dv) and dS_final (B, H, Dk, Dv) or None. Returns a dict: dq, dk, dv, dbeta (input
    dtypes), dg (fp32, the log-decay's shape, None without one), dS0 (fp32, None without an
    initial state)."""
    K = _kernels()
    import triton

    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    if (K.aligned_dim(Dk), K.aligned_dim(Dv)) != (Dk, Dv):  # as the forward: head dims padded to 16
        q, k, v, do, dS_final, initial_state = K.pad_head_dims(Dk, Dv, (q, k), (v, do), (dS_final, initial_state))
        out = delta_rule_bwd(q, k, v, beta, do, dS_final, log_decay=log_decay, initial_state=initial_state,
                             chunk_size=chunk_size)
        out["dq"], out["dk"], out["dv"] = out["dq"][..., :Dk], out["dk"][..., :Dk], out["dv"][..., :Dv]
        if out["dS0"] is not None:
            out["dS0"] = out["dS0"][..., :Dk, :Dv]
        return out
    cfgs = {name: K.delta_config(name, Dk, q.dtype, chunk_size, q.device) for name in K.DELTA_KERNELS}
    BT = cfgs["delta_wy"]["BT"]
    NT = triton.cdiv(T, BT)
    g, decay = K._decay_args(log_decay, B, H, T)
    q, k, v, do = (x.contiguous() for x in (q, k, v, do.to(v.dtype)))
    b = beta.to(q.dtype).contiguous()
    w, u = K.delta_wy(k, v, b, log_decay=log_decay, config=cfgs["delta_wy"])
    h, vn, _ = K.delta_states(k, w, u, log_decay=log_decay, initial_state=initial_state, config=cfgs["delta_state"])
    f32 = dict(dtype=torch.float32, device=q.device)
    dh, dvn = torch.empty(B, H, NT, Dk, Dv, **f32), torch.empty(B, H, T, Dv, **f32)
    dS0 = torch.empty(B, H, Dk, Dv, **f32) if initial_state is not None else None
    dST = dS_final.to(torch.float32).contiguous() if dS_final is not None else None
    out = {"dq": torch.empty_like(q), "dk": torch.empty_like(k), "dv": torch.empty_like(v),
           "dbeta": torch.empty_like(b), "dg": None, "dS0": dS0}
    if B * H * T == 0:
        return _zero_grads(out, log_decay, dST)
    cfg = cfgs["delta_bwd_state"]
    K.launch("delta_bwd_state", q.device, (triton.cdiv(Dv, cfg["BV"]), B * H), cfg, q, k, w, do,
            g if g is not None else w, dh, dvn, dST if dST is not None else dh, dS0 if dS0 is not None else dh,
            T, H, Dk, Dv, NT, DECAY=decay, HAS_DST=dST is not None, STORE_DS0=dS0 is not None,
            DOT_PREC=K.dot_precision(q.dtype))
    cfg = cfgs["delta_bwd_dqk"]
    NK = triton.cdiv(Dk, cfg["BK"])
    dk0, dw = torch.empty(B, H, T, Dk, **f32), torch.empty(B, H, T, Dk, **f32)
    dg_parts = torch.empty(NK + 1, B, H, T, **f32) if decay else dw
    K.launch("delta_bwd_dqk", q.device, (NK, NT, B * H), cfg, q, k, vn, dvn, do, g if g is not None else w, h,
            dh, out["dq"], dk0, dw, dg_parts, T, H, Dk, Dv, NT, B * H * T, DECAY=decay,
            DOT_PREC=K.dot_precision(q.dtype))
    cfg = cfgs["delta_bwd_wy"]
    K.launch("delta_bwd_wy", q.device, (NT, B * H), cfg, k, v, b, g if g is not None else w, dw, dvn, dk0,
            out["dk"], out["dv"], out["dbeta"], dg_parts[NK] if decay else dw, T, H, Dk, Dv, DECAY=decay,
            DOT_PREC=K.dot_precision(q.dtype))
    if decay:
        dg = dg_parts.sum(0)
        out["dg"] = dg.sum((0, 2)) if decay == 1 else dg
    return out


def _zero_grads(out: dict, log_decay: Tensor | None, dST: Tensor | None) -> dict:
    """The gradients of an empty sequence: zeros, and dS0 = dS_final (the state passes through)."""
    for name in ("dq", "dk", "dv", "dbeta"):
        out[name].zero_()
    if log_decay is not None:
        out["dg"] = torch.zeros(log_decay.shape, dtype=torch.float32, device=log_decay.device)
    if out["dS0"] is not None:
        out["dS0"] = dST.clone() if dST is not None else out["dS0"].zero_()
    return out


class _DeltaRuleTriton(torch.autograd.Function):
    """(o, S_final) = the chunked delta rule on the Triton kernels, differentiable in q, k, v,
    beta, the log-decay and the initial state."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_decay: Tensor | None,
                initial_state: Tensor | None, chunk_size: int | None) -> tuple[Tensor, Tensor]:
        K = _kernels()
        o, S_T = K.delta_rule_fwd(q, k, v, beta, log_decay=log_decay, initial_state=initial_state,
                                  store_final_state=True, chunk_size=chunk_size)
        ctx.save_for_backward(q, k, v, beta, log_decay, initial_state)
        ctx.chunk_size = chunk_size
        return o, S_T

    @staticmethod
    @once_differentiable("delta_rule_attention(backend='triton')", "backend='torch' is plain torch "
                         "and has them.")
    def backward(ctx, do: Tensor | None, dS_T: Tensor | None) -> tuple:
        q, k, v, beta, log_decay, initial_state = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(v)
        gr = delta_rule_bwd(q, k, v, beta, do, dS_T, log_decay=log_decay, initial_state=initial_state,
                            chunk_size=ctx.chunk_size)
        dg = gr["dg"].to(log_decay.dtype) if log_decay is not None else None
        dS0 = gr["dS0"].to(initial_state.dtype) if initial_state is not None else None
        return gr["dq"], gr["dk"], gr["dv"], gr["dbeta"].to(beta.dtype), dg, dS0, None


def delta_rule_triton(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, *, log_decay: Tensor | None = None,
                      initial_state: Tensor | None = None,
                      chunk_size: int | None = None) -> tuple[Tensor, Tensor]:
    """(o in the dtype of v, S_final fp32) of the chunked delta rule on the Triton kernels, with
    autograd. log_decay: None, (H,) or (B, H, T); initial_state: (B, H, Dk, Dv) or None;
    chunk_size: None (the kernels' own: 64 for 16-bit inputs, 32 for fp32) or a power of two >= 16."""
    if torch.compiler.is_compiling():  # the custom op (delta_ops.py, registered by delta.py)
        return torch.ops.linattn.delta_fwd(q, k, v, beta, log_decay, initial_state, chunk_size)
    return _DeltaRuleTriton.apply(q, k, v, beta, log_decay, initial_state, chunk_size)
