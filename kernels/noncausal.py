"""Non-causal linear attention: one global state, then one product per token.

Without a causal mask every query sees every key, so the whole sequence folds into one state

    S = S0 + sum_t k_t v_t^T   (Dk x Dv)        z = z0 + sum_t k_t   (Dk)

and o_t = q_t S / (q_t . z + eps). That is two kernels: `noncausal_state_kernel` sums the
state (a reduction over T), and `noncausal_output_kernel` multiplies every query by it (fully
parallel over T). The backward pass uses the same two kernels with other arguments:

    dS = dS_T + sum_t q_t dnum_t^T,  dz = dz_T + sum_t dden_t q_t      (state kernel)
    dq = dnum S^T + dden z^T,  dk = v dS^T + 1 dz^T,  dv = k dS          (output kernel)

where dnum = dO / den and dden = -(dO . o) / den come from the normaliser, and S^T is read
through swapped strides rather than copied. dnum is never formed: 1 / den (r) and dden are
fp32 (`chunk_bwd_prep` of chunk_grad_prep.py), the state kernel scales the keys by r in fp32
(dS = sum_t (r_t q_t) dO_t^T) and the output kernel its product's rows (dq = r (dO S^T) +
dden z^T): dO / den, below fp16's range for a mean loss over a long sequence, never meets a
16-bit number, so no loss scaling is needed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import dot_precision, launchable, select_config
from .shapes import check_causal, checked_grid, expect


@triton.jit
def noncausal_state_kernel(
    k_ptr, v_ptr,            # (B, H, T, Dk), (B, H, T, Dv); contiguous
    w_ptr,                   # (B, H, T) fp32 weights of the keys in z (HAS_W), else 1
    r_ptr,                   # (B, H, T) fp32 scales of the keys in S (HAS_R), else 1
    s0_ptr, z0_ptr,          # initial state (B, H, Dk, Dv), (B, H, Dk) fp32 (HAS_S0)
    st_ptr, zt_ptr,          # output state, same shapes, fp32
    T, Dk, Dv,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_Z: tl.constexpr, HAS_W: tl.constexpr, HAS_R: tl.constexpr, HAS_S0: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < Dk
    m_v = o_v < Dv
    s_off = i_bh * Dk * Dv + o_k[:, None] * Dv + o_v[None, :]

    S = tl.zeros([BK, BV], dtype=tl.float32)
    z = tl.zeros([BK], dtype=tl.float32)
    if HAS_S0:
        S = tl.load(s0_ptr + s_off, mask=m_k[:, None] & m_v[None, :], other=0.0)
        if HAS_Z:
            z = tl.load(z0_ptr + i_bh * Dk + o_k, mask=m_k, other=0.0)
    for t0 in range(0, T, BT):
        t = t0 + o_t
        m_t = t < T
        k = tl.load(k_ptr + i_bh * T * Dk + t[:, None] * Dk + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        v = tl.load(v_ptr + i_bh * T * Dv + t[:, None] * Dv + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
        if HAS_R:  # (r k)^T v with r k in fp32 (r = 1 / den may take it below fp16's range)
            kr = k.to(tl.float32) * tl.load(r_ptr + i_bh * T + t, mask=m_t, other=0.0)[:, None]
            S = tl.dot(tl.trans(kr), v.to(tl.float32), acc=S, input_precision=DOT_PREC)
        else:  # k^T v: products of two inputs, accumulated in fp32 (the accumulator is S itself)
            S = tl.dot(tl.trans(k), v, acc=S, input_precision=DOT_PREC)
        if HAS_Z:
            if HAS_W:
                w = tl.load(w_ptr + i_bh * T + t, mask=m_t, other=0.0)
                z += tl.sum(k.to(tl.float32) * w[:, None], axis=0)
            else:
                z += tl.sum(k.to(tl.float32), axis=0)
    tl.store(st_ptr + s_off, S, mask=m_k[:, None] & m_v[None, :])
    if HAS_Z:
        tl.store(zt_ptr + i_bh * Dk + o_k, z, mask=m_k & (i_v == 0))


@triton.jit
def noncausal_output_kernel(
    a_ptr,                   # (B, H, T, Da) rows to multiply (q in the forward pass); contiguous
    s_ptr,                   # state, read as (Da x Dc) through strides: (B, H, ...) fp32
    z_ptr,                   # (B, H, Da) fp32 normaliser state (NORMALIZE)
    e_ptr, u_ptr,            # rank-one term e_t u^T: e (B, H, T) fp32 (EXTRA == 2, else e = 1), u (B, H, Dc) fp32
    r_ptr,                   # (B, H, T) fp32 row scales of a S (HAS_R)
    out_ptr,                 # (B, H, T, Dc)
    den_ptr,                 # (B, H, T) fp32 d + eps (NORMALIZE)
    T, Da, Dc, stride_sa, stride_sc, eps,
    BT: tl.constexpr, BA: tl.constexpr, BC: tl.constexpr,
    NORMALIZE: tl.constexpr,  # out = a S / (a . z + eps)
    EXTRA: tl.constexpr,      # 0: none, 1: out += 1 u^T, 2: out += e u^T
    HAS_R: tl.constexpr,      # out = r (a S) (+ the rank-one term)
    DOT_PREC: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_t = tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    t = i_t * BT + tl.arange(0, BT)
    o_a = tl.arange(0, BA)
    o_c = i_c * BC + tl.arange(0, BC)
    m_t = t < T
    m_a = o_a < Da
    m_c = o_c < Dc

    a = tl.load(a_ptr + i_bh * T * Da + t[:, None] * Da + o_a[None, :], mask=m_t[:, None] & m_a[None, :], other=0.0)
    a = a.to(tl.float32)
    S = tl.load(s_ptr + i_bh * Da * Dc + o_a[:, None] * stride_sa + o_c[None, :] * stride_sc,
                mask=m_a[:, None] & m_c[None, :], other=0.0)
    out = tl.dot(a, S, input_precision=DOT_PREC)
    if NORMALIZE:
        z = tl.load(z_ptr + i_bh * Da + o_a, mask=m_a, other=0.0)
        d = tl.sum(a * z[None, :], axis=1) + eps
        out = out / d[:, None]
        tl.store(den_ptr + i_bh * T + t, d, mask=m_t & (i_c == 0))
    if HAS_R:
        out = out * tl.load(r_ptr + i_bh * T + t, mask=m_t, other=0.0)[:, None]
    if EXTRA > 0:
        u = tl.load(u_ptr + i_bh * Dc + o_c, mask=m_c, other=0.0)
        if EXTRA == 2:
            e = tl.load(e_ptr + i_bh * T + t, mask=m_t, other=0.0)
            out += e[:, None] * u[None, :]
        else:
            out += u[None, :]
    tl.store(out_ptr + i_bh * T * Dc + t[:, None] * Dc + o_c[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m_t[:, None] & m_c[None, :])


def noncausal_state(
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    track_z: bool,
    weights: torch.Tensor | None = None,
    key_scales: torch.Tensor | None = None,
    initial_state: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    config: dict | None = None,
):
    """S = S0 + sum_t r_t k_t v_t^T and z = z0 + sum_t w_t k_t, both fp32 (r = key_scales,
    w = weights, (B, H, T), 1 when None; with r the product is taken in fp32/tf32). Returns
    (S, z or None)."""
    check_causal("noncausal_state", k, k, v, initial_state=initial_state,
                 per_token={"weights": weights, "key_scales": key_scales})
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    k, v = k.contiguous(), v.contiguous()
    cfg = config or select_config("noncausal_state", Dk, k.dtype, k.device)
    f32 = dict(dtype=torch.float32, device=k.device)
    S = torch.empty(B, H, Dk, Dv, **f32)
    z = torch.empty(B, H, Dk, **f32) if track_z else None
    w = weights.to(torch.float32).contiguous() if weights is not None else None
    r = key_scales.to(torch.float32).contiguous() if key_scales is not None else None
    S0 = z0 = None
    if initial_state is not None:
        S0 = initial_state[0].to(torch.float32).contiguous()
        if track_z:  # no z0 given: the keys before summed to 0
            z0 = (initial_state[1].to(torch.float32).contiguous()
                  if initial_state[1] is not None
                  else torch.zeros(B, H, Dk, **f32))
    dummy = S
    grid = checked_grid("noncausal_states", triton.cdiv(Dv, cfg["BV"]), B * H)
    launchable(noncausal_state_kernel, k.device)[grid](
        k, v, w if w is not None else dummy, r if r is not None else dummy, S0 if S0 is not None else dummy,
        z0 if z0 is not None else dummy, S, z if z is not None else dummy,
        T, Dk, Dv, BT=cfg["BT"], BK=cfg["BK"], BV=cfg["BV"],
        HAS_Z=track_z, HAS_W=w is not None, HAS_R=r is not None, HAS_S0=S0 is not None,
        DOT_PREC=dot_precision(k.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return S, z


def noncausal_output(
    a: torch.Tensor,
    S: torch.Tensor,
    *,
    z: torch.Tensor | None = None,
    eps: float = 0.0,
    u: torch.Tensor | None = None,
    e: torch.Tensor | None = None,
    row_scales: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: dict | None = None,
):
    """out = r (a S) [/ (a . z + eps)] [+ e u^T], r = row_scales (B, H, T) fp32 (1 when
    None). Returns (out, den or None).

    a: (B, H, T, Da); S: (B, H, Da, Dc) fp32, any strides in its last two dims (pass
    `X.transpose(-1, -2)` to multiply by X^T without a copy); z: (B, H, Da) normaliser;
    u: (B, H, Dc) with optional per-token e: (B, H, T) (e = 1 when None).
    """
    if a.dim() != 4 or S.dim() != 4:
        raise ValueError(f"noncausal_output: `a` and `S` must be (B, H, T, Da) and (B, H, Da, Dc), got shapes "
                         f"{tuple(a.shape)} and {tuple(S.shape)}")
    B, H, T, Da = a.shape
    Dc = S.shape[-1]
    for name, x, shape in (("S", S, (B, H, Da, Dc)), ("z", z, (B, H, Da)), ("u", u, (B, H, Dc)),
                           ("e", e, (B, H, T)), ("row_scales", row_scales, (B, H, T))):
        expect("noncausal_output", name, x, shape, a.device)
    a = a.contiguous()
    if S.stride(0) != H * Da * Dc or S.stride(1) != Da * Dc:
        S = S.contiguous()
    cfg = config or select_config("noncausal_output", Da, a.dtype, a.device)
    out = torch.empty(B, H, T, Dc, dtype=out_dtype or a.dtype, device=a.device)
    den = torch.empty(B, H, T, dtype=torch.float32, device=a.device) if z is not None else None
    dummy = out
    grid = checked_grid("noncausal_output", triton.cdiv(Dc, cfg["BC"]), triton.cdiv(T, cfg["BT"]), B * H)
    launchable(noncausal_output_kernel, a.device)[grid](
        a, S, z.contiguous() if z is not None else dummy,
        e.to(torch.float32).contiguous() if e is not None else dummy,
        u.contiguous() if u is not None else dummy,
        row_scales.to(torch.float32).contiguous() if row_scales is not None else dummy,
        out, den if den is not None else dummy,
        T, Da, Dc, S.stride(2), S.stride(3), float(eps),
        BT=cfg["BT"], BA=cfg["BA"], BC=cfg["BC"], NORMALIZE=z is not None,
        EXTRA=0 if u is None else (2 if e is not None else 1), HAS_R=row_scales is not None,
        DOT_PREC=dot_precision(a.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out, den


def compile_spec_state(cfg: dict, dtype: str) -> tuple[dict, dict]:
    """Signature and constexprs of `noncausal_state_kernel`'s heaviest variant."""
    signature = {
        "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "w_ptr": "*fp32", "r_ptr": "*fp32", "s0_ptr": "*fp32",
        "z0_ptr": "*fp32", "st_ptr": "*fp32", "zt_ptr": "*fp32", "T": "i32", "Dk": "i32", "Dv": "i32",
    }
    constexprs = {"BT": cfg["BT"], "BK": cfg["BK"], "BV": cfg["BV"], "HAS_Z": True, "HAS_W": True,
                  "HAS_R": True, "HAS_S0": True, "DOT_PREC": dot_precision(dtype)}
    for name in constexprs:
        signature[name] = "constexpr"
    return signature, constexprs


def compile_spec_output(cfg: dict, dtype: str) -> tuple[dict, dict]:
    """Signature and constexprs of `noncausal_output_kernel`'s heaviest variant."""
    signature = {
        "a_ptr": f"*{dtype}", "s_ptr": "*fp32", "z_ptr": "*fp32", "e_ptr": "*fp32", "u_ptr": "*fp32", "r_ptr": "*fp32",
        "out_ptr": f"*{dtype}", "den_ptr": "*fp32", "T": "i32", "Da": "i32", "Dc": "i32",
        "stride_sa": "i32", "stride_sc": "i32", "eps": "fp32",
    }
    constexprs = {"BT": cfg["BT"], "BA": cfg["BA"], "BC": cfg["BC"], "NORMALIZE": True, "EXTRA": 2,
                  "HAS_R": True, "DOT_PREC": dot_precision(dtype)}
    for name in constexprs:
        signature[name] = "constexpr"
    return signature, constexprs
