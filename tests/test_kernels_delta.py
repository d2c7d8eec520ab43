"""The chunked delta rule's kernels (kernels/delta_rule.py) against the float64 recurrence.

    test_forward_matches_recurrence   o and the final state against `delta_rule_attention(...,
                                      form="recurrent")` in float64 on the very inputs the kernels
                                      saw (fp16 rounded first): relative RMS < 1e-5 (fp32), 3e-3 (fp16)
    test_stored_pieces                the entry state of every chunk (delta_state_kernel's h) and the
                                      pseudo-values V_new against a float64 token loop
    test_chunk_size                   the same forward with 16-token chunks
    test_bad_shapes                   the launcher's messages
    test_gradients_match_autograd     backend="triton" of `delta_rule_attention` (the kernels' forward
                                      and backward, core/delta_triton.py): the gradients of q, k, v,
                                      beta, the log-decay and the initial state for a loss on o and
                                      the final state, against float64 autograd through the
                                      recurrence on the same inputs: relative RMS < 1e-4 (fp32),
                                      5e-3 (fp16); gradcheck is too slow in the interpreter
    test_backend_choice               "auto" is torch on CPU; what backend="triton" refuses

The interpreter runs the kernels on CPU tensors (`launchable`). The cases are a hand-picked
cover of T in {1, 65, 130} (around chunks of 32 and 64; T = 65 leaves a one-token chunk),
Dk in {16, 20, 48} and Dv in {8, 16, 24} (head dims padded to a power of two in the
kernels, and the odd ones to a multiple of 16 by the launchers, `pad_head_dims`), B and H > 1, no decay, a decay per head,
per token, strong (exp(g BT) underflows) and a reset (g = -1e4 mid-chunk), with and without an
initial state; keys are unit (F.normalize), beta in (0, 2).

The kernels are in `linattn_lib.kernels.KERNELS` with their configs in kernels/configs.py, so
tests/test_kernels_compile.py compiles every config they can pick for every GPU target (sm_75 to
sm_90) and holds them to the same gates as the other kernels (no spills, shared memory).
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent


def _delta_module():
    """linattn_lib.kernels.delta_rule, installed or from this checkout."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from linattn_lib.core.triton_ops import load_kernels

    if load_kernels() is None:
        return None
    return importlib.import_module("linattn_lib.kernels.delta_rule")


pytest.importorskip("triton")
D = _delta_module()
if D is None:  # pragma: no cover - triton imports but the kernels do not
    pytest.skip("the Triton kernels do not import here", allow_module_level=True)

from linattn_lib.core.delta import _delta_step, delta_rule_attention  # noqa: E402
from linattn_lib.experiments.kernel_selftest import draw_log_decay  # noqa: E402

DEVICE = torch.device(os.environ.get("LINATTN_KERNEL_TEST_DEVICE")
                      or ("cuda" if torch.cuda.is_available() else "cpu"))
TOL = {torch.float32: 1e-5, torch.float16: 3e-3}

def make_inputs(B, H, T, Dk, Dv, decay, resume, dtype, seed=0) -> dict:
    """q, k (unit), v, beta in (0, 2) in `dtype`; g and S0 fp32."""
    gen = torch.Generator().manual_seed(seed)
    k = F.normalize(torch.randn(B, H, T, Dk, generator=gen), dim=-1)
    x = {"q": torch.randn(B, H, T, Dk, generator=gen).to(dtype), "k": k.to(dtype),
         "v": torch.randn(B, H, T, Dv, generator=gen).to(dtype),
         "beta": (0.02 + 1.96 * torch.rand(B, H, T, generator=gen)).to(dtype),
         "g": draw_log_decay(decay, B, H, T, gen), "S0": None}
    if resume:
        x["S0"] = torch.randn(B, H, Dk, Dv, generator=gen)
    return x

def _double(x: dict) -> dict:
    return {n: (t.double() if t is not None else None) for n, t in x.items()}

def _on_device(x: dict) -> dict:
    return {n: (t.to(DEVICE) if t is not None else None) for n, t in x.items()}

def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error ||a - b|| / ||b|| (float64)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))

def run_kernels(x: dict, chunk_size: int | None = None, pieces: bool = False):
    d = _on_device(x)
    fwd = D.delta_rule_fwd_pieces if pieces else D.delta_rule_fwd
    return fwd(d["q"], d["k"], d["v"], d["beta"], log_decay=d["g"], initial_state=d["S0"],
               store_final_state=True, chunk_size=chunk_size)

def reference(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    d = _double(x)
    o, st = delta_rule_attention(d["q"], d["k"], d["v"], d["beta"], log_decay=d["g"], form="recurrent",
                                 initial_state=d["S0"], return_state=True)
    return o, st.S

def token_loop(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 states before every token (B, H, T, Dk, Dv) and the pseudo-values
    u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t) (B, H, T, Dv)."""
    d = _double(x)
    B, H, T, Dk = d["k"].shape
    g = torch.zeros(B, H, T, dtype=torch.float64)
    if d["g"] is not None:
        g = g + (d["g"] if d["g"].dim() == 3 else d["g"].view(1, H, 1))
    S = torch.zeros(B, H, Dk, d["v"].shape[-1], dtype=torch.float64) if d["S0"] is None else d["S0"]
    before, pseudo = [], []
    for t in range(T):
        k_t, b_t = d["k"][:, :, t], d["beta"][:, :, t]
        before.append(S)
        pred = (k_t.unsqueeze(-1) * S).sum(-2) * torch.exp(g[:, :, t])[..., None]
        pseudo.append(b_t[..., None] * (d["v"][:, :, t] - pred))
        S = _delta_step(S, k_t, d["v"][:, :, t], b_t, g[:, :, t])
    return torch.stack(before, 2), torch.stack(pseudo, 2)

# B, H, T, Dk, Dv, decay, initial state, dtype
CASES = [
    (2, 2, 1, 16, 16, None, False, torch.float32),
    (2, 2, 65, 48, 24, "token", True, torch.float32),
    (1, 3, 130, 16, 24, "head", True, torch.float32),
    (2, 2, 130, 48, 16, "token-reset", False, torch.float32),
    (2, 1, 65, 16, 16, None, True, torch.float32),
    (1, 2, 130, 48, 24, "token-steep", True, torch.float32),
    (2, 2, 1, 48, 24, "token", True, torch.float16),
    (2, 2, 65, 16, 16, "head", False, torch.float16),
    (1, 2, 130, 48, 24, "token", True, torch.float16),
    (2, 1, 130, 16, 24, "token-reset", True, torch.float16),
    (2, 2, 65, 48, 16, None, True, torch.float16),
    (1, 2, 65, 20, 24, "token", True, torch.float32),   # Dk and Dv padded to 32 by the launcher
    (1, 2, 65, 20, 8, "head", True, torch.float16),
]

def _case_id(c) -> str:
    B, H, T, Dk, Dv, decay, resume, dtype = c
    return f"{str(dtype)[6:]}-B{B}H{H}T{T}-Dk{Dk}Dv{Dv}-{decay or 'nodecay'}{'-S0' if resume else ''}"

@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_forward_matches_recurrence(case):
    *shape, decay, resume, dtype = case
    x = make_inputs(*shape, decay, resume, dtype)
    o, S_T = run_kernels(x)
    o_ref, S_ref = reference(x)
    assert o.dtype == dtype and o.shape == o_ref.shape
    assert S_T.dtype == torch.float32 and S_T.shape == S_ref.shape
    assert rel(o, o_ref) < TOL[dtype], rel(o, o_ref)
    assert rel(S_T, S_ref) < TOL[dtype], rel(S_T, S_ref)

@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[8], CASES[9]], ids=_case_id)
def test_stored_pieces(case):
    *shape, decay, resume, dtype = case
    x = make_inputs(*shape, decay, resume, dtype, seed=1)
    p = run_kernels(x, pieces=True)
    before, pseudo = token_loop(x)
    BT, T = p["BT"], shape[2]
    h_ref = before[:, :, torch.arange(0, T, BT)]       # the state before each chunk's first token
    assert p["h"].shape == h_ref.shape
    assert rel(p["h"], h_ref) < TOL[dtype], rel(p["h"], h_ref)
    assert rel(p["V_new"], pseudo) < TOL[dtype], rel(p["V_new"], pseudo)

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_chunk_size(dtype):
    x = make_inputs(2, 2, 65, 48, 24, "token", True, dtype, seed=2)
    o, S_T = run_kernels(x, chunk_size=16)
    o_ref, S_ref = reference(x)
    assert rel(o, o_ref) < TOL[dtype] and rel(S_T, S_ref) < TOL[dtype]

def test_bad_shapes():
    x = _on_device(make_inputs(1, 2, 5, 16, 16, None, False, torch.float32))
    with pytest.raises(ValueError, match="beta"):
        D.delta_rule_fwd(x["q"], x["k"], x["v"], x["beta"][..., :4])
    with pytest.raises(ValueError, match="log_decay"):
        D.delta_rule_fwd(x["q"], x["k"], x["v"], x["beta"], log_decay=-torch.rand(3, device=DEVICE))
    with pytest.raises(ValueError, match="chunk_size"):
        D.delta_rule_fwd(x["q"], x["k"], x["v"], x["beta"], chunk_size=24)
    with pytest.raises(ValueError, match="initial_state"):
        D.delta_rule_fwd(x["q"], x["k"], x["v"], x["beta"], initial_state=torch.zeros(1, 2, 16, 8, device=DEVICE))

GRAD_TOL = {torch.float32: 1e-4, torch.float16: 5e-3}
GRAD_CASES = [
    (1, 2, 65, 48, 24, "token", True, torch.float32),
    (2, 2, 1, 16, 16, "head", True, torch.float32),
    (2, 1, 40, 16, 24, None, False, torch.float32),
    (1, 2, 40, 16, 16, "token-reset", True, torch.float32),
    (1, 3, 65, 16, 16, "head", False, torch.float16),
    (2, 1, 65, 48, 24, "token", True, torch.float16),
    (1, 2, 40, 20, 24, "token", True, torch.float32),
]
LEAVES = ("q", "k", "v", "beta", "g", "S0")

def _loss_grads(x: dict, dtype: torch.dtype, cot: tuple, **kw) -> tuple[dict, torch.Tensor]:
    """Gradients of sum(o * dO) + sum(S_final * dS) w.r.t. every leaf of x (cast to dtype)."""
    leaves = {n: (x[n].to(dtype if n not in ("g", "S0") or dtype == torch.float64 else torch.float32)
                  .detach().clone().requires_grad_()) for n in LEAVES if x[n] is not None}
    o, st = delta_rule_attention(leaves["q"], leaves["k"], leaves["v"], leaves["beta"], log_decay=leaves.get("g"),
                                 initial_state=leaves.get("S0"), return_state=True, **kw)
    loss = (o.double() * cot[0].to(o.device).double()).sum() + (st.S.double() * cot[1].to(o.device)).sum()
    loss.backward()
    return {n: t.grad for n, t in leaves.items()}, o

@pytest.mark.parametrize("case", GRAD_CASES, ids=_case_id)
def test_gradients_match_autograd(case):
    *shape, decay, resume, dtype = case
    x = make_inputs(*shape, decay, resume, dtype, seed=3)
    gen = torch.Generator().manual_seed(4)
    cot = (torch.randn(*x["v"].shape, generator=gen).to(dtype), torch.randn(*x["S0"].shape if resume else
           (shape[0], shape[1], shape[3], shape[4]), generator=gen).double())
    got, o = _loss_grads(_on_device(x), dtype, (cot[0].to(DEVICE), cot[1].to(DEVICE)), backend="triton")
    want, _ = _loss_grads(_double(x), torch.float64, cot, form="recurrent", backend="torch")
    assert o.dtype == dtype and set(got) == set(want)
    errs = {n: rel(got[n], want[n]) for n in want}
    assert all(got[n].dtype == x[n].dtype and got[n].shape == want[n].shape for n in want)
    assert max(errs.values()) < GRAD_TOL[dtype], errs

def test_backend_choice():
    x = make_inputs(1, 2, 20, 16, 16, "head", True, torch.float32)
    args = (x["q"], x["k"], x["v"], x["beta"])
    auto = delta_rule_attention(*args, log_decay=x["g"], initial_state=x["S0"])  # CPU: torch
    torch_ = delta_rule_attention(*args, log_decay=x["g"], initial_state=x["S0"], backend="torch")
    assert torch.equal(auto, torch_)
    tri = delta_rule_attention(*args, log_decay=x["g"], initial_state=x["S0"], backend="triton")
    assert rel(tri, torch_) < 1e-5
    with pytest.raises(ValueError, match="backend='triton'.*form='chunked'"):
        delta_rule_attention(*args, form="recurrent", backend="triton")
    with pytest.raises(ValueError, match="backend='triton'.*chunk_size"):
        delta_rule_attention(*args, chunk_size=24, backend="triton")
    with pytest.raises(ValueError, match="backend='triton'.*float32"):
        delta_rule_attention(*(t.double() for t in args), backend="triton")
    with pytest.raises(ValueError, match="backend"):
        delta_rule_attention(*args, backend="cuda")
    # the interpreter has no bf16 arithmetic (it returned all-NaN): refused, as linear_attention does
    with pytest.raises(TypeError, match="delta_rule_attention: bfloat16 on CPU"):
        delta_rule_attention(*(t.bfloat16() for t in args), backend="triton")
    # beta = 0 (a no-op write) through the kernels equals the torch path
    beta0 = x["beta"].clone()
    beta0[:, :, ::3] = 0.0
    tri0 = delta_rule_attention(x["q"], x["k"], x["v"], beta0, log_decay=x["g"], backend="triton")
    assert rel(tri0, delta_rule_attention(x["q"], x["k"], x["v"], beta0, log_decay=x["g"])) < 1e-5
    # packed sequences (cu_seqlens) on the kernels equal the torch path's
    cu = torch.tensor([0, 7, 7, 20])
    packed = [t[:1] for t in args]
    tri_p = delta_rule_attention(*packed, log_decay=x["g"], cu_seqlens=cu, backend="triton")
    assert rel(tri_p, delta_rule_attention(*packed, log_decay=x["g"], cu_seqlens=cu, backend="torch")) < 1e-5
