"""One step of generation: update the recurrent state in place and read out one token.

    S <- exp(g) S + k v^T        z <- exp(g) z + k        o = q S / (q . z + eps)

This is what makes linear attention an RNN at inference time: the state has a fixed size
(Dk x Dv per head) however long the context, where softmax attention's KV cache grows by one
row per token. The step is memory-bound (every state entry is read once and written once, with
two flops each), so there is no tl.dot here: one program per (batch, head) streams its state
through registers tile by tile.

One program owns the whole state of its head, z included, so the in-place update of z cannot
race with another program reading the old z.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import launchable, select_config
from .shapes import expect


@triton.jit
def decode_kernel(
    q_ptr, k_ptr, v_ptr,      # (B, H, Dk), (B, H, Dk), (B, H, Dv); contiguous
    g_ptr,                    # log-decay: (H,) if DECAY == 1, (B, H) if DECAY == 2 (fp32)
    s_ptr, z_ptr,             # state (B, H, Dk, Dv), (B, H, Dk); updated in place; contiguous
    o_ptr,                    # (B, H, Dv) output
    H, Dk, Dv, eps,
    BK: tl.constexpr,         # Dk rounded up to a power of two
    BV: tl.constexpr,         # value columns per step of the loop
    DECAY: tl.constexpr,      # 0: none, 1: per head, 2: per (batch, head)
    NORMALIZE: tl.constexpr,
):
    i_bh = tl.program_id(0).to(tl.int64)
    o_k = tl.arange(0, BK)
    m_k = o_k < Dk
    q = tl.load(q_ptr + i_bh * Dk + o_k, mask=m_k, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + i_bh * Dk + o_k, mask=m_k, other=0.0).to(tl.float32)
    if DECAY == 1:
        a = tl.exp(tl.load(g_ptr + i_bh % H).to(tl.float32))
    elif DECAY == 2:
        a = tl.exp(tl.load(g_ptr + i_bh).to(tl.float32))
    else:
        a = 1.0

    if NORMALIZE:
        z = a * tl.load(z_ptr + i_bh * Dk + o_k, mask=m_k, other=0.0).to(tl.float32) + k
        tl.store(z_ptr + i_bh * Dk + o_k, z.to(z_ptr.dtype.element_ty), mask=m_k)
        d = tl.sum(q * z, axis=0) + eps

    for v0 in range(0, Dv, BV):
        o_v = v0 + tl.arange(0, BV)
        m_v = o_v < Dv
        s_ptrs = s_ptr + i_bh * Dk * Dv + o_k[:, None] * Dv + o_v[None, :]
        m_kv = m_k[:, None] & m_v[None, :]
        v = tl.load(v_ptr + i_bh * Dv + o_v, mask=m_v, other=0.0).to(tl.float32)
        S = tl.load(s_ptrs, mask=m_kv, other=0.0).to(tl.float32)
        S = a * S + k[:, None] * v[None, :]
        tl.store(s_ptrs, S.to(s_ptr.dtype.element_ty), mask=m_kv)
        o = tl.sum(q[:, None] * S, axis=0)
        if NORMALIZE:
            o = o / d
        tl.store(o_ptr + i_bh * Dv + o_v, o.to(o_ptr.dtype.element_ty), mask=m_v)


def decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    S: torch.Tensor,
    z: torch.Tensor | None,
    *,
    log_decay: torch.Tensor | None = None,
    eps: float = 1e-6,
    config: dict | None = None,
) -> torch.Tensor:
    """Launch `decode_kernel`: update S (and z when given) in place, return o (B, H, Dv).

    q, k: (B, H, Dk), v: (B, H, Dv); S: (B, H, Dk, Dv) and z: (B, H, Dk), contiguous (the
    kernel writes into them); log_decay: None, (H,) or (B, H). z = None means unnormalised.
    """
    _check_step(q, k, v, S, z, log_decay)
    B, H, Dk = q.shape
    Dv = v.shape[-1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    cfg = config or select_config("decode", Dk, q.dtype, q.device)
    o = torch.empty(B, H, Dv, dtype=v.dtype, device=q.device)
    decay_kind = 0 if log_decay is None else (1 if log_decay.dim() == 1 else 2)
    g = log_decay.to(torch.float32).contiguous() if log_decay is not None else None
    launchable(decode_kernel, q.device)[(B * H,)](
        q, k, v, g if g is not None else o, S, z if z is not None else o, o,
        H, Dk, Dv, float(eps), BK=cfg["BK"], BV=cfg["BV"], DECAY=decay_kind,
        NORMALIZE=z is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return o


def _check_step(q, k, v, S, z, log_decay) -> None:
    """decode_step's arguments have the shapes it documents, and S and z, which the kernel
    updates in place, are contiguous: it addresses them from (B, H, Dk, Dv), ignoring strides."""
    fn = "decode_step"
    if q.dim() != 3:
        raise ValueError(f"{fn}: `q` must be (B, H, Dk), one token, got shape {tuple(q.shape)}")
    B, H, Dk = q.shape
    Dv = v.shape[-1]
    for name, x, shape in (("k", k, (B, H, Dk)), ("v", v, (B, H, Dv)), ("S", S, (B, H, Dk, Dv)),
                           ("z", z, (B, H, Dk))):
        expect(fn, name, x, shape, q.device)
    if not S.is_contiguous() or (z is not None and not z.is_contiguous()):
        raise ValueError(f"{fn}: the state S (and z) must be contiguous: it is updated in place")
    if log_decay is not None and (log_decay.shape not in ((H,), (B, H)) or log_decay.device != q.device):
        raise ValueError(f"{fn}: `log_decay` has shape {tuple(log_decay.shape)} on {log_decay.device}; "
                         f"expected (H,) = {(H,)} or (B, H) = {(B, H)} on {q.device}")


def compile_spec(cfg: dict, dtype: str) -> tuple[dict, dict]:
    """Signature and constexprs of the heaviest variant (fp32 state, normalised, decayed)."""
    signature = {
        "q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "g_ptr": "*fp32",
        "s_ptr": "*fp32", "z_ptr": "*fp32", "o_ptr": f"*{dtype}",
        "H": "i32", "Dk": "i32", "Dv": "i32", "eps": "fp32",
    }
    constexprs = {"BK": cfg["BK"], "BV": cfg["BV"], "DECAY": 2, "NORMALIZE": True}
    for name in constexprs:
        signature[name] = "constexpr"
    return signature, constexprs
