"""The FAVOR+ positive feature map, fused: projection, max-stabiliser and exp in one kernel.

    phi(x)_i = exp(w_i . x' - |x'|^2 / 2 - c) / sqrt(m),     x' = input_scale * x

(Performer's positive random features; `linattn_lib.core.features.positive_random_features` is the
reference). The shift c changes nothing for normalised attention -- it cancels between the
numerator and the denominator -- and keeps exp from overflowing:

    "row"     c = max_i (w_i . x' - |x'|^2 / 2), each row's own maximum (queries)
    "global"  c = that maximum over every row of the sequence too (keys: one constant per
              (batch, head), so that it cancels across keys as well)

In torch the map is a matmul followed by five elementwise passes (scale, norm, subtract, max,
exp, divide), each reading and writing a (T, m) tensor, with m (often 256) larger than d. Here
one program owns BT rows: it loads their x once, keeps them in registers, and walks the m
features in tiles of BM, computing u = x' W^T with tl.dot and writing exp(u - c) / sqrt(m)
straight out. Memory traffic: x read once, W from cache, phi written once. The row maximum
needs every feature of a row before the first output can be written, so with a stabiliser each
program makes two sweeps over the feature tiles, x staying in registers (the first sweep only
keeps a running maximum; recomputing u costs 2 d flops per feature, cheaper than storing it).
The global maximum needs every row of the sequence: MODE 3 writes each row's maximum, the
launcher takes the maximum per sequence in torch (T numbers), and MODE 2 applies it -- two
launches, so x is read twice.

Forward only: the gradient is cheap in torch from the saved output (see
`linattn_lib/core/triton_ops.py`): d phi_i / d x' = phi_i (w_i - x'), with c held constant as the
reference does (it is detached there).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .configs import dot_precision, launchable, select_config
from .shapes import checked_grid

STABILIZE_MODES = {None: 0, "row": 1, "global": 2}


@triton.jit
def favor_kernel(
    x_ptr,                    # (BH, T, d) inputs; contiguous
    w_ptr,                    # (m, d) projection, in the dtype of x; contiguous
    out_ptr,                  # (BH, T, m) features, in the dtype of x (unused in MODE 3)
    shift_ptr,                # (BH,) fp32: the shift c of each sequence (MODE 2)
    rowmax_ptr,               # (BH, T) fp32: each row's maximum of u (written in MODE 3)
    T, d, m,
    input_scale, inv_sqrt_m,
    BT: tl.constexpr,         # rows per program
    BD: tl.constexpr,         # d rounded up to a bucket: the input dim is held whole
    BM: tl.constexpr,         # features per tile
    MODE: tl.constexpr,       # 0: c = 0; 1: c = row max; 2: c = shift[sequence]; 3: write row maxima only
    DOT_PREC: tl.constexpr,
):
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m_t = o_t < T
    m_d = o_d < d

    x = tl.load(x_ptr + i_bh * T * d + o_t[:, None] * d + o_d[None, :],
                mask=m_t[:, None] & m_d[None, :], other=0.0).to(tl.float32) * input_scale
    half_sq = 0.5 * tl.sum(x * x, axis=1)             # |x'|^2 / 2, in fp32
    x_in = x.to(x_ptr.dtype.element_ty)                # x' for the tensor cores (16-bit inputs)

    if MODE == 1 or MODE == 3:
        # First sweep: the running maximum of u over the feature tiles.
        c = tl.full([BT], float("-inf"), dtype=tl.float32)
        for m0 in range(0, m, BM):
            o_m = m0 + tl.arange(0, BM)
            m_m = o_m < m
            w_t = tl.load(w_ptr + o_m[None, :] * d + o_d[:, None], mask=m_d[:, None] & m_m[None, :], other=0.0)
            u = tl.dot(x_in, w_t, input_precision=DOT_PREC) - half_sq[:, None]
            c = tl.maximum(c, tl.max(tl.where(m_m[None, :], u, float("-inf")), axis=1))
        if MODE == 3:
            tl.store(rowmax_ptr + i_bh * T + o_t, c, mask=m_t)
    elif MODE == 2:
        c = tl.zeros([BT], dtype=tl.float32) + tl.load(shift_ptr + i_bh)
    else:
        c = tl.zeros([BT], dtype=tl.float32)

    if MODE != 3:
        # Second sweep (the only one without a stabiliser): the features, written once.
        for m0 in range(0, m, BM):
            o_m = m0 + tl.arange(0, BM)
            m_m = o_m < m
            w_t = tl.load(w_ptr + o_m[None, :] * d + o_d[:, None], mask=m_d[:, None] & m_m[None, :], other=0.0)
            u = tl.dot(x_in, w_t, input_precision=DOT_PREC) - half_sq[:, None]
            phi = tl.exp(u - c[:, None]) * inv_sqrt_m   # exp(<= 0) when stabilised
            tl.store(out_ptr + i_bh * T * m + o_t[:, None] * m + o_m[None, :],
                     phi.to(out_ptr.dtype.element_ty), mask=m_t[:, None] & m_m[None, :])


def favor_features(
    x: torch.Tensor,
    W: torch.Tensor,
    *,
    input_scale: float = 1.0,
    stabilize: str | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Launch `favor_kernel`: the positive random features of x (..., T, d) -> (..., T, m).

    W: (m, d). `stabilize`: None, "row" or "global" (see the module docstring); "global" takes
    the maximum over the last two dims, one shift per leading index, as the reference does.
    Output in the dtype of x, computed in fp32 (the projection on tensor cores for 16-bit x).
    """
    if stabilize not in STABILIZE_MODES:
        raise ValueError(f"favor_features: unknown stabilize={stabilize!r}; expected None, 'row' or 'global'")
    if x.dim() < 2:
        raise ValueError(f"favor_features: `x` must be (..., T, d), got shape {tuple(x.shape)}")
    *lead, T, d = x.shape
    m = W.shape[0]
    if tuple(W.shape) != (m, d) or m == 0:
        raise ValueError(f"favor_features: `W` has shape {tuple(W.shape)}; expected (m, d) with d={d}, m >= 1")
    BH = math.prod(lead)
    xf = x.reshape(BH, T, d).contiguous()
    Wx = W.to(device=x.device, dtype=x.dtype).contiguous()
    cfg = config or select_config("favor", d, x.dtype, x.device)
    out = torch.empty(BH, T, m, dtype=x.dtype, device=x.device)
    kernel = launchable(favor_kernel, x.device)
    grid = checked_grid("favor_features", triton.cdiv(T, cfg["BT"]), BH)

    def launch(mode, shift, rowmax):
        kernel[grid](
            xf, Wx, out, shift, rowmax, T, d, m, float(input_scale), 1.0 / math.sqrt(m),
            BT=cfg["BT"], BD=cfg["BD"], BM=cfg["BM"], MODE=mode, DOT_PREC=dot_precision(x.dtype),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )

    unused = out  # a pointer the kernel never touches in this mode
    if stabilize == "global":
        rowmax = torch.empty(BH, T, dtype=torch.float32, device=x.device)
        launch(3, unused, rowmax)
        launch(2, rowmax.amax(dim=1).contiguous(), unused)
    else:
        launch(STABILIZE_MODES[stabilize], unused, unused)
    return out.reshape(*lead, T, m)


def compile_spec(cfg: dict, dtype: str) -> tuple[dict, dict]:
    """Signature and constexprs of the heaviest variant (row-stabilised: both sweeps)."""
    signature = {
        "x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
        "shift_ptr": "*fp32", "rowmax_ptr": "*fp32",
        "T": "i32", "d": "i32", "m": "i32", "input_scale": "fp32", "inv_sqrt_m": "fp32",
    }
    constexprs = {"BT": cfg["BT"], "BD": cfg["BD"], "BM": cfg["BM"], "MODE": 1, "DOT_PREC": dot_precision(dtype)}
    for name in constexprs:
        signature[name] = "constexpr"
    return signature, constexprs
