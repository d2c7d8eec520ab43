"""The Triton kernels against the float64 references: outputs, final states and gradients.

On a CPU-only machine (CI) every kernel runs in the Triton interpreter: the same kernel
source a GPU compiles, executed with numpy. On a CUDA machine the same tests run the compiled
kernels on the GPU (`python -m linattn_lib.experiments.gpu_check` does that), with bfloat16 added.
LINATTN_KERNEL_TEST_DEVICE=cpu|cuda overrides the choice.

The metric is the relative RMS error rel(a, b) = ||a - b|| / ||b|| against a float64 reference
computed from the very inputs the kernel saw (fp16 inputs are rounded first, so only the
kernel's own arithmetic is measured). Tolerances:

    float32   outputs, states, dq, dk, dv, dS0, dz0: 1e-5     d(log-decay): 1e-4
    float16   outputs and states: 3e-3, gradients: 1e-2 (d(log-decay) included)
    bfloat16  (GPU only) outputs and states: 2e-2, gradients: 5e-2

d(log-decay) gets more room in float32 because it is a reverse cumulative sum of
q.dq - k.dk, whose terms largely cancel; for a per-head decay it is further summed over T.
Its error is measured against the size of those terms (see `rel_decay_grad`).

The shapes are awkward on purpose: T in {1, 17, 63, 64, 65, 200} around the chunk of 64, head
dims 16, 48, 64 and 128 (48 is padded to 64 and masked), several heads and batches, resumed
from a non-zero state, decays from none to extreme (exp(g * 64) underflows to 0). The grid
is a hand-picked cover, not the full product: each case is cheap in the interpreter.

Two corners are ill-conditioned for the *relative* metric and avoided on purpose: normalised
attention with T = 1 and no initial state, or with an extreme decay, outputs
o_t ~ (q.k_t) v_t / (q.k_t + eps) ~ v_t, whose gradients in q and k are O(eps) differences of
O(1) terms (the reference's own rounding is then of the order of the result).
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from linattn_lib import LinearAttentionState, linear_attention  # noqa: E402
from linattn_lib.core.decode import linear_attention_decode_step
from linattn_lib.core.reference import reference_linear_attention  # noqa: E402
from linattn_lib.core.triton_ops import triton_available  # noqa: E402
from linattn_lib.experiments.kernel_selftest import DECAYS as SELFTEST_DECAYS  # noqa: E402
from linattn_lib.experiments.launches import record_launches  # noqa: E402

if not triton_available():  # pragma: no cover - triton imports but the kernels do not
    pytest.skip("the Triton kernels do not import here", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from linattn_lib.kernels.chunk_fwd import chunk_log_decays  # noqa: E402
from linattn_lib.kernels.configs import launchable  # noqa: E402

DEVICE = torch.device(os.environ.get("LINATTN_KERNEL_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu"))
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])

# (outputs and states, gradients, gradient of the log-decay)
TOL = {
    torch.float32: (1e-5, 1e-5, 1e-4),
    torch.float16: (3e-3, 1e-2, 1e-2),
    torch.bfloat16: (2e-2, 5e-2, 5e-2),
}

# log-decay per token drawn from -U(lo, hi); "head" variants use one value per head: the
# self-test's table (gpu_check runs the same kinds of decay on a GPU)
DECAYS = {None: None, **SELFTEST_DECAYS}



def _reset_every_10(B, H, T):
    """Log-decay -0.01 per token and -1e5 (a reset: exp(-1e5) = 0) at every 10th token."""
    g = torch.full((B, H, T), -0.01)
    g[..., 9::10] = -1e5
    return g


def _reset_at_random(B, H, T):
    """Resets at random tokens (1 in 4), moderate decays in between, per (batch, head)."""
    gen = torch.Generator().manual_seed(3)
    g = -0.1 * torch.rand(B, H, T, generator=gen)
    return torch.where(torch.rand(B, H, T, generator=gen) < 0.25, torch.full_like(g, -1e4), g)


# Decays with a reset: a prefix sum inside a chunk reaches -1e5, so any decay taken as the
# difference of two prefix sums (gc_i - gc_j, total - prefix) keeps ~1e-2 of absolute
# precision in fp32 -- the kernels were off by 0.16 there (outputs up to 17) where every torch
# form gave 1.5e-6. "head-reset": one head decays weakly, the other resets at every token.
RESETS = {
    "token-reset10": _reset_every_10,
    "token-reset-random": _reset_at_random,
    "head-reset": lambda B, H, T: torch.tensor([-0.01, -1e5] * H)[:H],
}

# B, H, T, Dk, Dv, decay, normalize, resume from a non-zero state
CAUSAL_CASES = [
    (1, 2, 1, 16, 16, None, True, True),
    (2, 1, 1, 48, 64, "token", False, True),
    (2, 1, 17, 48, 16, "head", True, True),
    (1, 2, 63, 16, 48, "token", False, True),
    (2, 2, 64, 64, 64, "token-strong", True, True),
    (1, 3, 65, 128, 48, "head-weak", False, False),
    (1, 2, 65, 48, 48, "token-extreme", False, True),
    (1, 2, 200, 48, 128, "token", True, True),
    (2, 1, 200, 16, 64, None, False, True),
    (1, 2, 200, 64, 16, "head", True, False),
    (1, 1, 130, 128, 128, "token-strong", False, True),
    (2, 1, 100, 16, 48, None, True, True),
]
# cases also run in half precision (and bfloat16 on GPU). T = 200 with 128 value columns (7)
# only on a GPU: in the interpreter it is the slowest case (30 s), and the 16-bit rounding it
# tests is that of cases 9 (T = 200) and 10 (D = 128).
HALF_CASES = [0, 2, 3, 4, 9, 10] + ([7] if DEVICE.type == "cuda" else [])

NONCAUSAL_CASES = [
    (1, 2, 1, 16, 48, True, True),
    (2, 1, 65, 48, 16, False, True),
    (1, 2, 200, 64, 128, True, False),
    (2, 2, 63, 128, 64, True, True),
]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error ||a - b|| / ||b|| (computed in float64)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def rel_decay_grad(dg: torch.Tensor, dg_ref: torch.Tensor, x: dict, grads: dict) -> float:
    """Error of d(log-decay) relative to the size of the terms it is made of.

    dL/dg_s = sum_{t >= s} (q_t . dq_t - k_t . dk_t) (+ the final-state term at t = T). When the
    decay is extreme, the true result is exp(-20)-small while each term is O(1): a relative
    error would then compare rounding noise with nothing. So the denominator is
    ||dg_ref|| + ||reverse-cumsum(|q . dq| + |k . dk|)||, which is ||dg_ref|| up to a small
    factor in every ordinary case.
    """
    terms = (x["q"] * grads["q"]).sum(-1).abs() + (x["k"] * grads["k"]).sum(-1).abs()
    terms = terms.detach().flip(-1).cumsum(-1).flip(-1)
    if dg_ref.dim() == 1:  # per head: summed over batch and time
        terms = terms.sum((0, 2))
    scale = dg_ref.detach().double().norm() + terms.double().norm()
    return float((dg.detach().double().cpu() - dg_ref.detach().double().cpu()).norm() / scale.cpu())


def make_inputs(B, H, T, Dk, Dv, decay, normalize, resume, dtype, seed=0):
    """Inputs rounded to `dtype`, as float64 leaves (reference) and `dtype` leaves (kernel)."""
    gen = torch.Generator().manual_seed(seed)
    # Normalised attention needs positive features (a positive denominator); unnormalised
    # (RetNet / SSD style) gets signed ones, which exercises cancellation.
    if normalize:
        q = torch.rand(B, H, T, Dk, generator=gen)
        k = torch.rand(B, H, T, Dk, generator=gen)
    else:
        q = torch.randn(B, H, T, Dk, generator=gen) / Dk**0.5
        k = torch.randn(B, H, T, Dk, generator=gen)
    v = torch.randn(B, H, T, Dv, generator=gen)
    x = {"q": q.to(dtype), "k": k.to(dtype), "v": v.to(dtype)}
    if decay in RESETS:
        x["g"] = RESETS[decay](B, H, T)
    elif decay is not None:
        lo, hi = DECAYS[decay]
        shape = (H,) if decay.startswith("head") else (B, H, T)
        x["g"] = -(lo + (hi - lo) * torch.rand(shape, generator=gen))
    if resume:
        x["S0"] = torch.randn(B, H, Dk, Dv, generator=gen)
        if normalize:
            x["z0"] = torch.rand(B, H, Dk, generator=gen) * 5
    ref = {n: t.double().requires_grad_() for n, t in x.items()}
    dev = {n: t.to(DEVICE).requires_grad_() for n, t in x.items()}
    return ref, dev


def call(x, *, causal, normalize, backend):
    state = None
    if "S0" in x:
        state = LinearAttentionState(x["S0"], x.get("z0"))
    kwargs = dict(causal=causal, normalize=normalize, log_decay=x.get("g"), initial_state=state, return_state=True)
    if backend == "reference":
        return reference_linear_attention(x["q"], x["k"], x["v"], form="quadratic", **kwargs)
    return linear_attention(x["q"], x["k"], x["v"], backend="triton", **kwargs)


def loss(o, state, seed=1):
    """A random linear functional of the output and the final state (checks dS_T, dz_T paths)."""
    gen = torch.Generator().manual_seed(seed)
    w = lambda t: torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.device)  # noqa: E731
    total = (o.double() * w(o)).sum() + (state.S.double() * w(state.S)).sum()
    if state.z is not None:
        total = total + (state.z.double() * w(state.z)).sum()
    return total


def check_against_reference(case, dtype, causal):
    B, H, T, Dk, Dv, decay, normalize, resume = case
    ref_in, dev_in = make_inputs(B, H, T, Dk, Dv, decay, normalize, resume, dtype)
    o, state = call(dev_in, causal=causal, normalize=normalize, backend="triton")
    o_ref, state_ref = call(ref_in, causal=causal, normalize=normalize, backend="reference")

    assert o.dtype == dtype and o.shape == (B, H, T, Dv)
    assert state.S.dtype == torch.float32 and state.S.shape == (B, H, Dk, Dv)
    assert (state.z is None) == (not normalize)
    tol_out, tol_grad, tol_dg = TOL[dtype]
    errors = {"o": rel(o, o_ref), "S_T": rel(state.S, state_ref.S)}
    if normalize:
        errors["z_T"] = rel(state.z, state_ref.z)
    for name, err in errors.items():
        assert err < tol_out, f"{name}: rel {err:.2e} >= {tol_out:.0e}"

    names = list(dev_in)
    grads = torch.autograd.grad(loss(o, state), [dev_in[n] for n in names])
    grads_ref = torch.autograd.grad(loss(o_ref, state_ref), [ref_in[n] for n in names])
    ref_grads = dict(zip(names, grads_ref))
    for name, g, g_ref in zip(names, grads, grads_ref):
        assert g.dtype == dev_in[name].dtype and g.shape == dev_in[name].shape
        assert torch.isfinite(g).all(), f"d{name} is not finite"
        if name == "g":
            err = rel_decay_grad(g, g_ref, ref_in, ref_grads)
            tol = tol_dg
        else:
            err, tol = rel(g, g_ref), tol_grad
        assert err < tol, f"d{name}: rel {err:.2e} >= {tol:.0e}"


def _id(case):
    B, H, T, Dk, Dv, decay, normalize, resume = case
    return f"B{B}H{H}T{T}-k{Dk}v{Dv}-{decay or 'nodecay'}-{'norm' if normalize else 'unnorm'}{'-resume' if resume else ''}"


@pytest.mark.parametrize("case", CAUSAL_CASES, ids=_id)
def test_causal_fp32(case):
    check_against_reference(case, torch.float32, causal=True)


@pytest.mark.parametrize("dtype", DTYPES[1:], ids=str)
@pytest.mark.parametrize("case", [CAUSAL_CASES[i] for i in HALF_CASES], ids=_id)
def test_causal_half(case, dtype):
    check_against_reference(case, dtype, causal=True)


# Decay resets (see RESETS): T not a multiple of the chunk, with and without normaliser and
# initial state, per token and per head. Before the fix the per-token cases were off by up to
# 1e-2 relative (outputs) and 1e-1 (gradients) in float32.
RESET_CASES = [
    (1, 2, 45, 16, 16, "token-reset10", True, False),
    (2, 1, 45, 16, 32, "token-reset10", False, True),
    (1, 2, 70, 48, 16, "token-reset-random", True, True),
    (1, 2, 40, 16, 16, "head-reset", False, True),
]


@pytest.mark.parametrize("case", RESET_CASES, ids=_id)
def test_causal_decay_reset_fp32(case):
    check_against_reference(case, torch.float32, causal=True)


@pytest.mark.parametrize("dtype", DTYPES[1:], ids=str)
def test_causal_decay_reset_half(dtype):
    check_against_reference(RESET_CASES[0], dtype, causal=True)


@triton.jit
def _log_decays_probe(g_ptr, L_ptr, out_ptr, BT: tl.constexpr, REVERSE: tl.constexpr, PER_HEAD: tl.constexpr,
                      ROW_SCANS: tl.constexpr):
    """Writes what chunk_log_decays returns for one chunk's log-decays g."""
    o_t = tl.arange(0, BT)
    L, q_log, k_log, g_last = chunk_log_decays(tl.load(g_ptr + o_t), o_t, BT, REVERSE, PER_HEAD, ROW_SCANS)
    tl.store(L_ptr + o_t[:, None] * BT + o_t[None, :], L)
    tl.store(out_ptr + o_t, q_log)
    tl.store(out_ptr + BT + o_t, k_log)
    tl.store(out_ptr + 2 * BT + o_t, g_last + tl.zeros_like(q_log))


def _segsum64(g: torch.Tensor) -> torch.Tensor:
    """float64 L[i, j] = g_{j+1} + ... + g_i (i > j), 0 elsewhere: summed term by term."""
    n = g.numel()
    L = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in range(i):
            L[i, j] = g[j + 1: i + 1].double().sum()
    return L


@pytest.mark.parametrize("row_scans", [False, True], ids=["compensated", "row-scans"])
@pytest.mark.parametrize("decay", ["token-reset10", "token-reset-random", "token-strong", "head", "head-reset"])
def test_chunk_log_decays_are_as_precise_as_their_own_terms(decay, row_scans):
    """chunk_log_decays takes differences of compensated prefix sums (products for a decay per
    head): after a reset each decay must still be accurate relative to itself (plain fp32
    prefix sums leave ~1e-2 of absolute error there), every one <= 0, in both directions."""
    BT, n = 64, 57  # the last 7 tokens are padding (g = 0), as at a sequence's end
    g = torch.zeros(BT)
    per_head = decay.startswith("head")
    if per_head:  # one head's value, repeated
        g[:n] = -1e5 if decay == "head-reset" else -0.37
    else:
        g[:n] = (RESETS[decay] if decay in RESETS else lambda *s: -1 - 3 * torch.rand(s))(1, 1, n).flatten()
    L64 = _segsum64(g)
    gc, total = g.double().cumsum(0), g.double().sum()
    for reverse in (False, True):
        L, out = torch.empty(BT, BT), torch.empty(3 * BT)
        launchable(_log_decays_probe, "cpu")[(1,)](g, L, out, BT=BT, REVERSE=reverse, PER_HEAD=per_head,
                                                   ROW_SCANS=row_scans)
        want_L = L64.T if reverse else L64
        q_want, k_want = (total - gc, gc) if reverse else (gc, total - gc)
        for got, want in [(L, want_L), (out[:BT], q_want), (out[BT:2 * BT], k_want),
                          (out[2 * BT:], total.expand(BT))]:
            assert (got <= 0).all()
            # the rounding of a few fp32 additions of the value's own size (plain prefix
            # sums of ~1e5 would leave ~1e-2 here), and ~1e-7 from the compensation terms
            assert ((got.double() - want).abs() <= 2e-6 * want.abs() + 1e-7).all(), \
                (got.double() - want).abs().max()


@pytest.mark.skipif(DEVICE.type != "cpu", reason="patches the kernel module (the interpreter reads it per launch)")
def test_decay_reset_without_tl_gather(monkeypatch):
    """Triton < 3.2 has no tl.gather: both shifts of g (forward, and back for the compensated
    prefix sums) then come from masked row sums."""
    import sys

    module = sys.modules["linattn_lib.kernels.chunk_fwd"]
    monkeypatch.setattr(module, "_shifted", module._shifted_sum)
    monkeypatch.setattr(module, "_shifted_back", module._shifted_back_sum)
    check_against_reference(RESET_CASES[1], torch.float32, causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", NONCAUSAL_CASES, ids=lambda c: f"B{c[0]}H{c[1]}T{c[2]}-k{c[3]}v{c[4]}-{'norm' if c[5] else 'unnorm'}{'-resume' if c[6] else ''}")
def test_noncausal(case, dtype):
    B, H, T, Dk, Dv, normalize, resume = case
    check_against_reference((B, H, T, Dk, Dv, None, normalize, resume), dtype, causal=False)


# --------------------------------------------------------------------------------------
# non-finite input: causality is kept (masks select, they do not multiply)
# --------------------------------------------------------------------------------------

# (what to spoil, index, value, t = first spoiled position, normalize, decay). The kernels are
# called through `linear_attention_triton` (linear_attention itself refuses NaN and inf).
NAN, INF = float("nan"), float("inf")
SPOILED = [
    ("k", (0, 0, 5, 0), NAN, 5, True, "token"),
    ("v", (0, slice(None), 7), INF, 7, True, "token"),
    ("v", (0, 1, 18, 3), -INF, 18, False, None),
    ("k", (0, 0, 5, 0), NAN, 5, False, "head"),
    ("q", (0, 1, 20), NAN, 20, True, "token"),
    ("v", (Ellipsis, slice(33, None), slice(None)), NAN, 33, False, "token"),  # right-padding
]


def _spoiled_run(x, normalize, t, loss_len, dtype=torch.float32):
    """Outputs, and gradients of a loss on the first `loss_len` outputs, of the kernels."""
    from linattn_lib.core.triton_ops import linear_attention_triton

    leaves = {n: x[n].to(dtype).clone().requires_grad_() if n != "g" else x[n].clone().requires_grad_() for n in x}
    o = linear_attention_triton(leaves["q"], leaves["k"], leaves["v"], normalize=normalize, log_decay=leaves.get("g"))
    w = torch.randn(o.shape[:2] + (64, o.shape[-1]), generator=torch.Generator().manual_seed(1))[:, :, :loss_len]
    grads = torch.autograd.grad((o[:, :, :loss_len].float() * w.to(o.device)).sum(), list(leaves.values()))
    return o.detach(), dict(zip(leaves, grads))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, on the NaN
@pytest.mark.parametrize("name,index,value,t,normalize,decay", SPOILED,
                         ids=lambda c: str(c) if isinstance(c, (str, int)) else None)
def test_nonfinite_input_does_not_reach_earlier_positions(name, index, value, t, normalize, decay):
    """A NaN or inf at position t: the outputs before t are those of the sequence cut at t, and
    so are the gradients of a loss on them (the gradients from t on are exactly 0); nothing is
    silently finite where the input was not. Before the fix every output of a chunk holding
    the NaN (and, in the backward pass, every gradient) was NaN."""
    B, H, T, D = 1, 2, 40, 16
    gen = torch.Generator().manual_seed(0)
    x = {n: torch.rand(B, H, T, D, generator=gen) for n in ("q", "k")}
    x["v"] = torch.randn(B, H, T, D, generator=gen)
    if decay == "token":
        x["g"] = -torch.rand(B, H, T, generator=gen)
    elif decay == "head":
        x["g"] = -torch.rand(H, generator=gen)
    x = {n: a.to(DEVICE) for n, a in x.items()}
    cut = {n: (a[:, :, :t] if a.dim() > 1 else a) for n, a in x.items()}
    bad = dict(x)
    bad[name] = x[name].clone()
    bad[name][index] = value
    o_cut, g_cut = _spoiled_run(cut, normalize, t, t)
    o, grads = _spoiled_run(bad, normalize, t, t)
    assert torch.isfinite(o[:, :, :t]).all()
    assert rel(o[:, :, :t], o_cut) <= 1e-6
    spoiled_head = index[:2] if index[0] is not Ellipsis else (slice(None), slice(None))
    assert not torch.isfinite(o[spoiled_head][..., t, :]).all(), "the output at t must not look valid"
    if name == "q":  # a query reaches its own output only
        o_clean, _ = _spoiled_run(x, normalize, t, t)
        assert rel(o[:, :, t + 1:], o_clean[:, :, t + 1:]) <= 1e-6
    for n, g in grads.items():
        if g.dim() == 1:  # a per-head decay: summed over the positions
            assert torch.isfinite(g).all() and rel(g, g_cut[n]) <= 1e-5, n
            continue
        assert torch.isfinite(g).all(), f"d{n} is not finite"
        assert rel(g[:, :, :t], g_cut[n]) <= 1e-6, n
        assert not g[:, :, t:].any(), f"d{n} past the loss must be exactly 0"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES[1:], ids=str)
def test_nonfinite_input_half(dtype):
    """The same in 16-bit (the tensor-core configs): k = NaN at t = 5, v = inf at t = 40."""
    B, H, T, D = 1, 2, 48, 16
    gen = torch.Generator().manual_seed(0)
    x = {n: torch.rand(B, H, T, D, generator=gen).to(DEVICE) for n in ("q", "k", "v")}
    x["g"] = -torch.rand(B, H, T, generator=gen).to(DEVICE)
    bad = dict(x, k=x["k"].clone(), v=x["v"].clone())
    bad["k"][0, 0, 5, 0] = NAN
    bad["v"][0, 1, 40] = INF
    for h, t in ((0, 5), (1, 40)):
        o, grads = _spoiled_run({n: a[:, h:h + 1] for n, a in bad.items()}, True, t, t, dtype)
        o_cut, g_cut = _spoiled_run({n: a[:, h:h + 1, :t] for n, a in x.items()}, True, t, t, dtype)
        assert torch.isfinite(o[:, :, :t]).all() and rel(o[:, :, :t], o_cut) <= 1e-3
        assert not torch.isfinite(o[:, :, t]).all()
        for n, g in grads.items():
            assert torch.isfinite(g).all() and not g[:, :, t:].any(), n
            assert rel(g[:, :, :t], g_cut[n]) <= 1e-2, n


def _padded_batch(garbage):
    """Two sequences of 23 and 31 tokens right-padded to 40 with `garbage` in q, k and v."""
    T, lengths = 40, (23, 31)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.rand(2, 2, T, 16, generator=gen) for _ in range(2))
    v = torch.randn(2, 2, T, 16, generator=gen)
    g = -torch.rand(2, 2, T, generator=gen)
    w = torch.randn(2, 2, T, 16, generator=gen)  # the loss weights
    real = [tuple(a[b:b + 1, :, :n] for a in (q, k, v, g, w)) for b, n in enumerate(lengths)]
    q, k, v = q.clone(), k.clone(), v.clone()
    for b, n in enumerate(lengths):
        for a, value in zip((q, k, v), garbage):
            a[b, :, n:] = value
    for b, n in enumerate(lengths):
        w[b, :, n:] = 0  # a loss masked to the real tokens
    return (q, k, v, g, w), real, lengths


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, on the garbage
@pytest.mark.parametrize("garbage", [(NAN, INF, NAN), (1e30, 1e30, -1e30)], ids=["nan-inf", "huge-finite"])
def test_right_padding_with_garbage_never_poisons_a_sequence(garbage):
    """A batch right-padded with garbage -- NaN and inf, or huge finite values whose scores
    overflow to inf -- and a loss masked to the real tokens: every output and gradient of a real
    token equals that of the unpadded sequence, and the padded tokens' gradients are exactly 0.
    The finite garbage goes through the public `linear_attention`, which refuses NaN."""
    from linattn_lib.core.triton_ops import linear_attention_triton

    batch, real, lengths = _padded_batch(garbage)
    xs = [a.to(DEVICE).requires_grad_() for a in batch[:4]]
    if all(map(lambda x: abs(x) < INF, garbage)):
        o = linear_attention(*xs[:3], log_decay=xs[3], backend="triton")
    else:
        o = linear_attention_triton(*xs[:3], log_decay=xs[3])
    grads = torch.autograd.grad((o * batch[4].to(DEVICE)).sum(), xs)
    for b, (ref, n) in enumerate(zip(real, lengths)):
        rx = [a.to(DEVICE).requires_grad_() for a in ref[:4]]
        ro = linear_attention_triton(*rx[:3], log_decay=rx[3])
        rgrads = torch.autograd.grad((ro * ref[4].to(DEVICE)).sum(), rx)
        assert torch.isfinite(o[b, :, :n]).all() and rel(o[b, :, :n], ro[0]) <= 1e-6
        for name, gr, rg in zip("qkvg", grads, rgrads):
            assert torch.isfinite(gr[b]).all(), (b, name)
            assert rel(gr[b, :, :n], rg[0]) <= 1e-6, (b, name)
            assert not gr[b, :, n:].any(), (b, name)


def test_chunked_resume_equals_one_pass():
    """Two calls, the second resumed from the first's state, equal one call on the whole."""
    _, x = make_inputs(1, 2, 150, 48, 48, "token", True, False, torch.float32)
    q, k, v, g = (x[n].detach() for n in ("q", "k", "v", "g"))
    whole, s_whole = linear_attention(q, k, v, log_decay=g, backend="triton", return_state=True)
    a, s_a = linear_attention(q[:, :, :70], k[:, :, :70], v[:, :, :70], log_decay=g[:, :, :70], backend="triton", return_state=True)
    b, s_b = linear_attention(q[:, :, 70:], k[:, :, 70:], v[:, :, 70:], log_decay=g[:, :, 70:], backend="triton",
                              initial_state=s_a, return_state=True)
    assert rel(torch.cat([a, b], dim=2), whole) < 1e-5
    assert rel(s_b.S, s_whole.S) < 1e-5 and rel(s_b.z, s_whole.z) < 1e-5


def test_matches_torch_backend_without_state():
    """The plain call (no state in or out) agrees with the torch backend, in value and grads."""
    _, x = make_inputs(2, 2, 90, 16, 48, "head", True, False, torch.float32)
    leaves = [x[n] for n in ("q", "k", "v", "g")]
    o = linear_attention(*leaves[:3], log_decay=leaves[3], backend="triton")
    o_t = linear_attention(*leaves[:3], log_decay=leaves[3], backend="torch")
    assert o.shape == o_t.shape and rel(o, o_t) < 1e-5
    w = torch.randn_like(o)
    for g1, g2 in zip(torch.autograd.grad((o * w).sum(), leaves), torch.autograd.grad((o_t * w).sum(), leaves)):
        assert rel(g1, g2) < 1e-4


def test_gradient_of_state_only():
    """A loss on the final state alone (no gradient reaches the output) still differentiates."""
    _, x = make_inputs(1, 2, 40, 16, 16, "token", True, True, torch.float32)
    ref = {n: t.detach().double().cpu().requires_grad_() for n, t in x.items()}
    _, st = call(x, causal=True, normalize=True, backend="triton")
    _, st_ref = call(ref, causal=True, normalize=True, backend="reference")
    grads = torch.autograd.grad(st.S.sum() + st.z.sum(), list(x.values()), allow_unused=True)
    grads_ref = torch.autograd.grad(st_ref.S.sum() + st_ref.z.sum(), list(ref.values()), allow_unused=True)
    for name, g, g_ref in zip(x, grads, grads_ref):
        if g_ref is None:  # q does not reach the final state
            assert name == "q" and (g is None or not g.any())
        else:
            assert rel(g, g_ref) < (1e-4 if name == "g" else 1e-5), name


@pytest.mark.skipif(DEVICE.type != "cpu", reason="checks the CPU dispatch")
def test_auto_backend_on_cpu_does_not_use_triton(monkeypatch):
    """No kernel is launched (a review found this test patching a name that linear_attention
    had imported under its own: it passed with the CPU check removed)."""
    import linattn_lib.core.linear as L

    def boom(*args, **kwargs):
        raise AssertionError("backend='auto' must not run Triton on CPU tensors")

    monkeypatch.setattr(L, "linear_attention_triton", boom)
    q = torch.rand(1, 1, 8, 16)
    with record_launches() as launches:
        linear_attention(q, q, q)
    assert launches == []


@pytest.mark.skipif(DEVICE.type != "cpu" or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs compiled-kind kernels next to the interpreter")
def test_interpreter_leaves_the_compiler_intact():
    """Running a kernel in the interpreter patches triton.language only for the duration of the
    launch: afterwards the same process still compiles kernels for a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from linattn_lib.core.triton_ops import load_kernels

    K = load_kernels()
    call_before = JITFunction.__call__
    state = LinearAttentionState(torch.zeros(1, 1, 16, 16), torch.zeros(1, 1, 16))
    x = torch.rand(1, 1, 16)
    linear_attention_decode_step(x, x, x, state, backend="triton")
    assert JITFunction.__call__ is call_before
    cfg = K.CONFIGS["decode"][0]
    signature, constexprs = K.KERNELS["decode"][1](cfg, "fp32")
    compiled = triton.compile(ASTSource(fn=K.decode_kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 80, 32), options={"num_warps": cfg["num_warps"]})
    assert len(compiled.asm["cubin"]) > 0


def test_auto_dispatch_knows_what_the_kernels_take():
    """backend='auto' sends CUDA tensors to Triton only when the kernels support them."""
    from linattn_lib.core.triton_ops import triton_supports

    x = torch.rand(1, 1, 4, 64)
    assert triton_supports(x, x) and triton_supports(x.half(), x.half()) and triton_supports(x.bfloat16(), x.bfloat16())
    assert not triton_supports(x.double(), x.double())
    assert not triton_supports(x, torch.rand(1, 1, 4, 257))


@pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU-only restrictions")
def test_unsupported_dtypes_raise_clear_errors():
    q = torch.rand(1, 1, 8, 16)
    with pytest.raises(TypeError, match="bfloat16 on CPU"):
        linear_attention(q.bfloat16(), q.bfloat16(), q.bfloat16(), backend="triton")
    with pytest.raises(TypeError, match="float64"):
        linear_attention(q.double(), q.double(), q.double(), backend="triton")
    big = torch.rand(1, 1, 4, 300)
    with pytest.raises(ValueError, match="head dims up to"):
        linear_attention(big, big, big, backend="triton")


@pytest.mark.skipif(DEVICE.type != "cpu", reason="fakes the GPU generation on CPU")
@pytest.mark.parametrize("dtype", [torch.float16], ids=str)
def test_sm75_configs(monkeypatch, dtype):
    """The configs a T4 (sm_75) would pick run in the interpreter when told the GPU is an
    sm_75: the two-phase engine's (linear_attention's, forward and backward), and the one-pass
    forward's (`chunk_fwd`), whose chunks are 16 tokens at a head dim above 128. In float16, the
    T4's dtype: float32 there picks the very same configs (one table for every dtype), and
    float32's arithmetic is tested at the sm_80+ configs. (A review found the one-pass kernel
    checked for its config but never run with it.)"""
    from linattn_lib.core.triton_ops import load_kernels

    K = load_kernels()
    configs = K.configs
    monkeypatch.setattr(configs, "device_capability", lambda device: (7, 5))
    picked = configs.select_config("chunk_fwd", 200, dtype, torch.device("cpu"))
    assert picked["BT"] == 16 and picked in configs.CONFIGS["chunk_fwd"]
    check_against_reference((1, 1, 40, 200, 136, "token", True, True), dtype, causal=True)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.rand(1, 2, 40, 200, generator=gen) for _ in range(2))
    v = torch.randn(1, 2, 40, 136, generator=gen)
    g = -torch.rand(1, 2, 40, generator=gen) / 4
    with record_launches(stub=False) as launches:
        o = K.chunk_fwd(q.to(dtype), k.to(dtype), v.to(dtype), log_decay=g)[0]
    assert [x.kwargs["BT"] for x in launches] == [16]
    want = reference_linear_attention(q.double(), k.double(), v.double(), log_decay=g.double())
    assert (o.double() - want).abs().max() < 2e-2 * want.abs().max()


@pytest.mark.skipif(DEVICE.type != "cpu", reason="fakes the GPU generation on CPU")
def test_sm90_configs(monkeypatch):
    """Hopper's wider blocks (dqk 64 x 32 on 8 warps, output and dv 128 value columns) run
    in the interpreter when told the GPU is an sm_90: head dims that leave a partial block in
    each (output and dv: one tile, then two), a decay, the normaliser and a resumed state, forward and
    backward; and dq, dk, dv in one kernel (the GPU check's candidate) with those blocks."""
    from linattn_lib.core.triton_ops import load_kernels

    configs = load_kernels().configs
    monkeypatch.setattr(configs, "device_capability", lambda device: (9, 0))
    for kernel in ("chunk_dqk", "chunk_output", "chunk_dv"):
        picked = configs.select_config(kernel, 80, torch.float16, torch.device("cpu"))
        assert picked == configs._config(kernel, "sm90", 128) != configs._config(kernel, "mma16", 128)
    check_against_reference((1, 1, 70, 80, 72, "token", True, True), torch.float16, causal=True)
    check_against_reference((1, 1, 70, 80, 136, "token", False, False), torch.float16, causal=True)
    with load_kernels().overridden({"chunk_dqk": {"fused_dqkv": True}}):  # the GPU check's candidate
        check_against_reference((1, 1, 70, 80, 136, "token", True, True), torch.float16, causal=True)


# --------------------------------------------------------------------------------------
# decoding
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize(
    "normalize,decay,dtype",
    [(True, None, torch.float32), (True, "token", torch.float32), (False, "head", torch.float32), (True, "token", torch.float16)],
    ids=["norm", "norm-token", "unnorm-head", "norm-token-fp16"],
)
def test_decode_steps_match_parallel_form(backend, normalize, decay, dtype):
    """Prefill with the chunked kernel, then decode token by token: every step equals the
    parallel form at that position, and the state is updated in place."""
    B, H, T, Dk, Dv, T0 = 2, 3, 24, 48, 80, 10
    ref, x = make_inputs(B, H, T, Dk, Dv, decay, normalize, False, dtype)
    q, k, v = (x[n].detach() for n in ("q", "k", "v"))
    g = x["g"].detach() if "g" in x else None
    full = reference_linear_attention(*(ref[n].detach() for n in ("q", "k", "v")), normalize=normalize,
                                      log_decay=ref["g"].detach() if "g" in ref else None)
    g_pre = None if g is None else (g if g.dim() == 1 else g[:, :, :T0])
    _, state = linear_attention(q[:, :, :T0], k[:, :, :T0], v[:, :, :T0], normalize=normalize, log_decay=g_pre,
                                backend="triton", return_state=True)
    S_ptr = state.S.data_ptr()
    outs = []
    for t in range(T0, T):
        g_t = None if g is None else (g if g.dim() == 1 else g[:, :, t])
        o_t = linear_attention_decode_step(q[:, :, t], k[:, :, t], v[:, :, t], state, log_decay_t=g_t,
                                           normalize=normalize, backend=backend)
        assert o_t.shape == (B, H, Dv) and o_t.dtype == dtype
        outs.append(o_t)
    assert state.S.data_ptr() == S_ptr  # in place
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    assert rel(torch.stack(outs, dim=2), full[:, :, T0:]) < tol
    _, final = reference_linear_attention(*(ref[n].detach() for n in ("q", "k", "v")), normalize=normalize,
                                          log_decay=ref["g"].detach() if "g" in ref else None, return_state=True)
    assert rel(state.S, final.S) < tol


@pytest.mark.parametrize("normalize", [True, False])
def test_decode_step_takes_the_torch_paths_state(normalize):
    """The state that linear_attention's torch path returns (a transposed, non-contiguous view)
    decodes on the Triton kernel: the kernel works on a copy and writes it back in place, so both
    backends give the same outputs and the same state."""
    B, H, T, Dk, Dv = 2, 2, 9, 16, 8
    g = torch.Generator().manual_seed(5)
    q, k = (torch.rand(B, H, T, Dk, generator=g) for _ in range(2))
    v = torch.randn(B, H, T, Dv, generator=g)
    states = {}
    for backend in ("torch", "triton"):
        _, st = linear_attention(q[:, :, :-1], k[:, :, :-1], v[:, :, :-1], normalize=normalize,
                                 backend="torch", return_state=True)
        st = LinearAttentionState(st.S.transpose(-1, -2).contiguous().transpose(-1, -2), st.z)
        assert not st.S.is_contiguous()
        ptr = st.S.data_ptr()
        o = linear_attention_decode_step(q[:, :, -1], k[:, :, -1], v[:, :, -1], st, normalize=normalize,
                                         backend=backend)
        assert st.S.data_ptr() == ptr
        states[backend] = (o, st)
    (o_t, st_t), (o_k, st_k) = states["torch"], states["triton"]
    assert rel(o_k, o_t) < 1e-5 and rel(st_k.S, st_t.S) < 1e-5


def test_decode_step_checks_its_inputs():
    q = torch.rand(1, 2, 16)
    state = LinearAttentionState(torch.zeros(1, 2, 16, 8), torch.zeros(1, 2, 16))
    with pytest.raises(ValueError, match="state.S"):
        linear_attention_decode_step(q, q, torch.rand(1, 2, 9), state)
    with pytest.raises(ValueError, match="state.z"):
        linear_attention_decode_step(q, q, torch.rand(1, 2, 8), LinearAttentionState(state.S, None))
    with pytest.raises(ValueError, match="log_decay_t"):
        linear_attention_decode_step(q, q, torch.rand(1, 2, 8), state, log_decay_t=torch.ones(2))
    with pytest.raises(ValueError, match="backend"):
        linear_attention_decode_step(q, q, torch.rand(1, 2, 8), state, backend="cuda")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_step_validates_its_arguments(backend):
    """eps must be a finite number >= 0 (NaN made every output NaN, inf made them 0, True passed
    as 1), normalize a bool, the state must own its memory (an expanded state was updated in
    place through one shared row), and a 3-d input is named (B, H, Dk), not (B, H, T). A refused
    call leaves the state untouched."""
    import numpy as np

    fn = "linear_attention_decode_step"
    q = torch.rand(3, 2, 8)
    v = torch.rand(3, 2, 8)
    state = LinearAttentionState(torch.rand(3, 2, 8, 8), torch.rand(3, 2, 8))
    before = (state.S.clone(), state.z.clone())

    def step(*args, **kw):
        return linear_attention_decode_step(*args, backend=backend, **kw)

    for eps, exc in ((float("nan"), ValueError), (float("inf"), ValueError), (-1.0, ValueError), (True, TypeError),
                     ("1e-6", TypeError), (torch.tensor(1e-6), TypeError)):
        with pytest.raises(exc, match=rf"{fn}: .*`eps`"):
            step(q, q, v, state, eps=eps)
    for flag in ("no", 1, None, torch.tensor(True)):
        with pytest.raises(TypeError, match=rf"{fn}: `normalize` must be True or False"):
            step(q, q, v, state, normalize=flag)
    expanded = LinearAttentionState(torch.zeros(1, 2, 8, 8).expand(3, 2, 8, 8), torch.zeros(1, 2, 8).expand(3, 2, 8))
    with pytest.raises(ValueError, match=rf"{fn}: `state\.S` is updated in place but axis 0 has stride 0"):
        step(q, q, v, expanded)
    with pytest.raises(ValueError, match=rf"{fn}: `state\.z` is updated in place"):
        step(q, q, v, LinearAttentionState(state.S, torch.zeros(1, 2, 8).expand(3, 2, 8)))
    with pytest.raises(ValueError, match=rf"{fn}: `q_t` must be a 3-d tensor laid out as \(B, H, Dk\)"):
        step(q[0], q, v, state)
    with pytest.raises(ValueError, match=rf"{fn}: `v_t` must be a 3-d tensor laid out as \(B, H, Dv\)"):
        step(q, q, v[:, :, None], state)
    assert torch.equal(state.S, before[0]) and torch.equal(state.z, before[1])
    # what passes: eps = 0 (an int), a numpy bool, an unnormalised step with a state lacking z
    o = step(q, q, v, state, eps=0, normalize=np.bool_(True))
    assert o.shape == (3, 2, 8) and torch.isfinite(o).all()
    o = step(q, q, v, LinearAttentionState(state.S, None), normalize=False)
    assert o.shape == (3, 2, 8)


# --------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------


def test_selected_configs_come_from_the_table():
    """Whatever the head dim, dtype or GPU, a launcher picks a config listed in CONFIGS (the
    list the ahead-of-time compile test builds and checks)."""
    from linattn_lib.core.triton_ops import load_kernels

    K = load_kernels()
    for kernel, table in K.CONFIGS.items():
        for cap in [None, *K.TARGETS.values()]:
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                for d in range(1, K.MAX_HEAD_DIM + 1):
                    assert K.select_config(kernel, d, dtype, cap) in table, (kernel, cap, dtype, d)


# ------------------------------------------------------------------ the fused FAVOR+ feature map

# (input shape (..., T, d), m features, stabiliser): d padded and masked (48, 17), m not a
# multiple of the feature tile (70, 266 = floor(64 ln 64), the Performer default), T = 1,
# three leading dims, and the two-launch global stabiliser.
FAVOR_CASES = [
    ((2, 3, 17, 48), 70, None),
    ((1, 2, 65, 64), 256, "row"),
    ((2, 1, 200, 16), 33, "global"),
    ((1, 1, 1, 64), 266, "global"),
    ((3, 40, 128), 64, "row"),
    ((2, 2, 33, 17), 16, "global"),
]


def _favor_inputs(shape, m, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 1.5).to(dtype)  # |x'|^2/2 well away from 0
    W = torch.randn(m, shape[-1], generator=gen).to(dtype)
    return x, W


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", FAVOR_CASES, ids=lambda c: f"{'x'.join(map(str, c[0]))}-m{c[1]}-{c[2]}")
def test_favor_features_and_gradients(case, dtype):
    """The fused kernel against the torch map in float64 on the same (rounded) inputs: values,
    and gradients in x and W through the kernel's autograd wrapper."""
    from linattn_lib.core.features import positive_random_features

    shape, m, stabilize = case
    x, W = _favor_inputs(shape, m, dtype)
    s = shape[-1] ** -0.25
    x_ref, W_ref = x.double().requires_grad_(), W.double().requires_grad_()
    x_dev, W_dev = x.to(DEVICE).requires_grad_(), W.to(DEVICE).requires_grad_()
    ref = positive_random_features(x_ref, W_ref, input_scale=s, stabilize=stabilize)
    got = positive_random_features(x_dev, W_dev, input_scale=s, stabilize=stabilize, backend="triton")
    assert got.dtype == dtype and got.shape == ref.shape
    tol_out, tol_grad, _ = TOL[dtype]
    assert rel(got, ref) < tol_out
    if stabilize is not None:  # the largest feature of a row (or of a sequence) is exactly 1/sqrt(m)
        peak = got.float().amax(-1) if stabilize == "row" else got.float().amax((-1, -2))
        assert torch.allclose(peak.cpu(), torch.full_like(peak.cpu(), m**-0.5), rtol=tol_out * 10)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (ref * w).sum().backward()
    (got.double() * w.to(DEVICE)).sum().backward()
    assert rel(x_dev.grad, x_ref.grad) < tol_grad
    assert rel(W_dev.grad, W_ref.grad) < tol_grad


def test_favor_feature_backend_in_performer_attention():
    """performer_attention(feature_backend="triton") gives the torch-feature result."""
    from linattn_lib import performer_attention

    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 40, 32, generator=gen).to(DEVICE) for _ in range(3))
    kw = dict(num_features=48, seed=5, causal=True, backend="torch")
    want = performer_attention(q, k, v, feature_backend="torch", **kw)
    got = performer_attention(q, k, v, feature_backend="triton", **kw)
    assert rel(got, want) < 1e-5


def test_favor_backend_rejects_what_it_cannot_do():
    from linattn_lib.core.features import RandomFeatureMap, positive_random_features

    x = torch.randn(2, 5, 8, device=DEVICE)
    W = torch.randn(6, 8, device=DEVICE)
    with pytest.raises(ValueError, match="stabilize"):
        positive_random_features(x, W, stabilize="column", backend="triton")
    with pytest.raises(ValueError, match="backend"):
        positive_random_features(x, W, backend="cuda")
    with pytest.raises(ValueError, match="up to 256"):
        positive_random_features(torch.randn(3, 300, device=DEVICE), torch.randn(4, 300, device=DEVICE), backend="triton")
    with pytest.raises(ValueError, match="kind='positive' only"):
        RandomFeatureMap(8, 6, kind="trig", seed=0).to(DEVICE)(x, backend="triton")
    with pytest.raises(TypeError, match="float64"):
        positive_random_features(x.double(), W.double(), backend="triton")


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CUDA run is gpu_check itself")
def test_gpu_check_favor_rows_run_on_cpu():
    """gpu_check's FAVOR+ comparison, with a stand-in timer and the interpreter: every row runs
    forward and backward and names what it timed."""
    from linattn_lib.experiments.gpu_check import run_favor_benchmark

    calls = []

    def fake_do_bench(fn, **kw):
        fn()
        calls.append(1)
        return 1.0

    rows = run_favor_benchmark(1, 2, 20, d=16, m=24, do_bench=fake_do_bench, device="cpu")
    assert [r.get("error") for r in rows] == [None] * 4
    assert {r["name"].split(", ")[-1] for r in rows} == {"torch", "triton"}
    assert all(r["forward_ms"] == 1.0 and r["forward_backward_ms"] == 1.0 for r in rows)
    assert len(calls) == 8


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CUDA run is gpu_check itself")
def test_gpu_check_config_sweep_runs_every_candidate_on_cpu():
    """gpu_check's launch-config sweep, with a stand-in timer and the interpreter: every
    candidate of every two-phase kernel is launched, the chosen one is among them and marked."""
    from linattn_lib.experiments.gpu_check import run_config_sweep

    rows = run_config_sweep(1, 1, 40, 16, do_bench=lambda fn, **kw: (fn(), 0.5)[1], device="cpu")
    assert [r.get("error") for r in rows] == [None] * len(rows)
    for kernel in ("chunk_state", "chunk_output", "chunk_dqk", "chunk_dv"):
        mine = [r for r in rows if r["kernel"] == kernel]
        assert len(mine) > 1 and sum(r["chosen"] for r in mine) == 1 and mine[0]["chosen"]
        assert len({str(r["config"]) for r in mine}) == len(mine)
    split = [r for r in rows if r["kernel"].startswith("chunk_state split-T")]
    # two chunks: split_count keeps one run, the sweep also times two
    assert [r["config"]["splits"] for r in split] == [1, 2] and [r["chosen"] for r in split] == [1, 0]


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CUDA run is gpu_check itself")
def test_gpu_check_resumed_sweeps_launch_every_depth_and_split():
    """A GPU check's later sweeps (stand-in timer, interpreter): each two-phase kernel at three
    pipelining depths, the parallel ones with and without rounded operands, and the state pass
    walked in each asked-for number of runs."""
    from linattn_lib.experiments.gpu_check import run_operand_sweep, run_split_sweep, run_stage_sweep

    bench = lambda fn, **kw: (fn(), 0.5)[1]
    rows = run_stage_sweep(1, 1, 40, 16, do_bench=bench, device="cpu")
    assert [r.get("error") for r in rows] == [None] * 12
    assert [r["config"]["num_stages"] for r in rows] == [1, 3, 4] * 4
    rows = run_operand_sweep(1, 1, 40, 16, do_bench=bench, device="cpu")
    assert [(r["kernel"], r["chosen"], r["config"].get("round_operands", False), r.get("error")) for r in rows] == [
        (k, c, not c, None) for k in ("chunk_output", "chunk_dqk", "chunk_dv") for c in (True, False)]
    split = run_split_sweep(1, 2, 200, 16, dtype=torch.float32, do_bench=bench, device="cpu",
                            splits=(1, 2, 4))
    assert [(r["config"]["splits"], r.get("error")) for r in split] == [(1, None), (2, None), (4, None)]


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CUDA run is gpu_check itself")
def test_rounded_operands_change_the_products_by_16_bit_rounding_only():
    """The experiment `rounds_operands` (off by default): each parallel kernel with its fp32
    operands rounded to the input dtype (fp16 here: the interpreter has no bf16) gives what the
    fp32 products give up to fp16 rounding, and not exactly that (the flag reaches the kernel)."""
    from linattn_lib import kernels as K
    from linattn_lib.experiments.gpu_extras import _sweep_calls

    calls = _sweep_calls(1, 2, 80, 32, torch.float16, "cpu")
    outputs = {"chunk_output": 1, "chunk_dqk": 2, "chunk_dv": 1}  # o; dq, dk; dv
    for kernel, n in outputs.items():
        cfg = K.select_config(kernel, 32, torch.float16, None)
        plain, rounded = (calls[kernel](c) for c in (cfg, dict(cfg, round_operands=True)))
        plain, rounded = ((x,) if torch.is_tensor(x) else x for x in (plain, rounded))
        for a, b in zip(plain[:n], rounded[:n]):
            err = ((a.float() - b.float()).norm() / a.float().norm()).item()
            assert 0 < err < 1e-2, (kernel, err)
    assert not K.rounds_operands({}, torch.bfloat16)
    assert not K.rounds_operands({"round_operands": True}, torch.float32)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CUDA run is gpu_check itself")
def test_overridden_configs_reach_the_launches_and_go_away(monkeypatch):
    """kernels.overridden: inside the block launch_config returns the changed config and the
    op's output moves by the rounding it asks for; after it, the chosen config again. The GPU
    check's whole-op sweep runs every set (fp16 stand-in for bf16, interpreter, stand-in timer)."""
    from linattn_lib import kernels as K
    from linattn_lib.experiments import gpu_bench
    from linattn_lib.experiments.gpu_check import run_override_sweep
    from linattn_lib.kernels.chunk_decay import launch_config

    chosen = launch_config("chunk_dqk", 32, torch.float16, "cpu")
    with K.overridden({"chunk_dqk": {"maxnreg": 128}}):
        assert launch_config("chunk_dqk", 32, torch.float16, "cpu") == {**chosen, "maxnreg": 128}
        assert "maxnreg" not in launch_config("chunk_dv", 32, torch.float16, "cpu")  # only the kernel named
    assert launch_config("chunk_dqk", 32, torch.float16, "cpu") == chosen and K.configs.OVERRIDES == {}
    q, k, v = (torch.rand(1, 2, 40, 32, dtype=torch.float16) for _ in range(3))
    plain = linear_attention(q, k, v, backend="triton")
    with K.overridden({"chunk_output": {"round_operands": True}}):
        rounded = linear_attention(q, k, v, backend="triton")
    err = ((plain.float() - rounded.float()).norm() / plain.float().norm()).item()
    assert 0 < err < 1e-2
    monkeypatch.setattr(gpu_bench, "DTYPE", torch.float16)
    rows = run_override_sweep(B=1, T=40, H=1, D=16, device="cpu", do_bench=lambda fn, **kw: (fn(), 0.5)[1])
    assert [(r["variant"], r["override"], r.get("error")) for r in rows] == [
        (v, name, None) for v in ("per-token decay", "unnormalised", "normalised") for name in K_OVERRIDE_NAMES]


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CUDA run is gpu_check itself")
def test_gpu_check_graph_benchmark_compares_the_replay_with_the_call(monkeypatch):
    """The GPU check's CUDA-graph row times linear_attention's forward+backward as called and as
    replayed from the captured graphs (here a stand-in capture that hands the function back:
    interpreter, fp16 for bf16, stand-in timer), compares their gradients, and records a capture
    that fails instead of raising."""
    from linattn_lib.experiments import gpu_bench
    from linattn_lib.experiments.gpu_extras import run_graph_benchmark

    monkeypatch.setattr(gpu_bench, "DTYPE", torch.float16)
    bench = lambda fn, **kw: (fn(), 0.5)[1]
    captured = []

    def capture(fn, args):
        captured.append(args)
        return fn

    row = run_graph_benchmark(shape=(1, 40, 2, 16), do_bench=bench, device="cpu", capture=capture, host_calls=1)
    assert "error" not in row and row["eager_ms"] == row["graphed_ms"] == 0.5
    assert row["eager_host_ms"] > 0 and row["graphed_host_ms"] > 0  # the CPU time of each call
    assert row["max_rel_diff"] == 0.0 and [tuple(a.shape) for a in captured[0]] == [(1, 2, 40, 16)] * 3 + [(1, 2, 40)]

    def refuse(fn, args):
        raise RuntimeError("operation not permitted when stream is capturing")

    row = run_graph_benchmark(shape=(1, 40, 2, 16), do_bench=bench, device="cpu", capture=refuse)
    assert row["error"].startswith("capture: RuntimeError: operation not permitted") and "graphed_ms" not in row


K_OVERRIDE_NAMES = ("as chosen", "operands not rounded (before the fitted model)", "plain state walks at 2 stages",
                    "plain state walks at 4 stages", "chunk_dv in two value tiles (before)", "chunk_output in two value tiles (before)",
                    "chunk_dqk in one key tile",
                    "decayed walks read their keys transposed", "dq, dk, dv in one kernel", "operands rounded to bf16",
                    "chunk_dqk without its register cap")


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CUDA run is gpu_check itself")
def test_gpu_check_decode_benchmark_counts_the_state_traffic():
    """The decode benchmark's bandwidth is the state bytes (read + write, fp32) over the time."""
    from linattn_lib.experiments.gpu_check import run_decode_benchmark

    row = run_decode_benchmark(2, 3, 16, do_bench=lambda fn, **kw: (fn(), 0.25)[1], device="cpu")
    assert row["state_bytes"] == 2 * 4 * (2 * 3 * 16 * 16 + 2 * 3 * 16)
    assert row["GB_per_s"] == round(row["state_bytes"] / 0.25e-3 / 1e9, 1)


def test_gpu_check_puts_the_model_beside_the_measurement():
    """On an H100 or H200 the benchmark rows carry the committed model's predictions (the same
    shape: B=1, H=16, T=16384, D=128); on other GPUs they carry none."""
    from linattn_lib.experiments.gpu_check import PREDICTED_AS, _markdown, attach_predictions
    from linattn_lib.results import load_result

    pred = load_result("perf_model.json")["ms"]["H200 SXM, B=1"]
    rows = [{"name": name, "shape": "", "forward_ms": 1.0, "forward_backward_ms": 2.0} for name in PREDICTED_AS]
    attach_predictions(rows, "NVIDIA H200")
    for row in rows:
        assert row["predicted_forward_backward_ms"] == pred[PREDICTED_AS[row["name"]]]["total"]
    assert f"{rows[0]['predicted_forward_ms']:.2f} / " in _markdown({}, {}, rows)
    others = attach_predictions([{"name": rows[0]["name"]}], "Tesla T4")
    assert "predicted_forward_ms" not in others[0]


# ------------------------------------------------------------------ float16 range


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_fp16_gradients_do_not_underflow(causal):
    """A mean loss over 32k outputs and denominators in the thousands make dO / den ~ 1e-8,
    below the smallest float16: rounded to fp16, dv came out all zeros. The backward keeps
    1 / den and dL/dden in fp32 and applies them in fp32 inside the kernels (no loss
    scaling), so the kernels' float16 gradients are as accurate as the torch path's, measured
    against float64 on the same inputs."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.nn.functional.elu(torch.randn(2, 4, 64, 64, generator=g)) + 1 for _ in range(2))
    v = torch.randn(2, 4, 64, 64, generator=g)
    q, k, v = (x.half() for x in (q, k, v))
    grads = {}
    for name, backend, dtype, device in (("triton", "triton", torch.float16, DEVICE), ("torch", "torch", torch.float16, "cpu"),
                                         ("exact", "torch", torch.float64, "cpu")):
        xs = [x.detach().to(device=device, dtype=dtype).clone().requires_grad_() for x in (q, k, v)]
        linear_attention(*xs, causal=causal, backend=backend).double().mean().backward()
        grads[name] = [x.grad for x in xs]
    for name, got, ref, exact in zip("qkv", grads["triton"], grads["torch"], grads["exact"]):
        assert got.abs().amax() > 0, name
        assert rel(got, exact) <= 1.5 * rel(ref, exact) + 1e-3, (name, rel(got, exact), rel(ref, exact))


def test_fp16_forward_with_scores_beyond_the_fp16_range():
    """q . k = 32 * 32 * 64 = 65536 > 65504, the largest float16: the kernel normalises the scores
    before they meet the tensor cores, so the output is the plain average of the values."""
    q = torch.full((1, 1, 4, 64), 32.0, dtype=torch.float16, device=DEVICE)
    v = torch.randn(1, 1, 4, 8, generator=torch.Generator().manual_seed(0)).half().to(DEVICE)
    o = linear_attention(q, q, v, backend="triton")
    assert torch.isfinite(o).all()
    want = v.double().cumsum(2) / torch.arange(1, 5, device=DEVICE, dtype=torch.float64).view(1, 1, 4, 1)
    assert rel(o, want) < 3e-3


def test_triton_backward_refuses_double_backward():
    """The kernels' gradients are not themselves differentiable: asking for a second derivative
    raises instead of silently treating dq and dk as constants (which gave wrong answers)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.rand(1, 1, 8, 16, generator=g).to(DEVICE).requires_grad_() for _ in range(3))
    ld = (-torch.rand(1, 1, 8, generator=g)).to(DEVICE).requires_grad_()
    o = linear_attention(q, k, v, log_decay=ld, backend="triton")
    with pytest.raises(NotImplementedError, match="second derivatives"):  # at once (core/once.py)
        torch.autograd.grad(o.sum(), ld, create_graph=True)


# ------------------------------------------------------------------ gpu_check's self-test


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CUDA run is gpu_check itself")
def test_gpu_check_selftest_runs_in_the_interpreter():
    """gpu_check's built-in kernel self-test (what an installed copy runs on a GPU), its quick
    subset in the interpreter: every kind of check runs and passes in float32 and float16."""
    from linattn_lib.experiments.kernel_selftest import run_kernel_selftest

    res = run_kernel_selftest("cpu", quick=True)
    assert res["status"] == "passed", [c for c in res["checks"] if c["status"] != "passed"]
    assert {c["name"].split()[0] for c in res["checks"]} == {"causal", "noncausal", "decode", "favor"}
    assert {c["dtype"] for c in res["checks"]} == {"float32", "float16"}
    causal = next(c for c in res["checks"] if c["name"].startswith("causal") and "resumed" in c["name"])
    assert {"o", "S_T", "dq", "dk", "dv", "dS0"} <= set(causal["errors"])


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CUDA run is gpu_check itself")
def test_gpu_check_selftest_reports_a_failure(monkeypatch):
    """A check outside its tolerance (here: a tolerance of 0) fails the self-test and names
    what was off, and a check that raises does not stop the others."""
    from linattn_lib.experiments import gpu_check, kernel_selftest

    case = (1, 1, 8, 16, 16, "token", True, False)
    monkeypatch.setattr(kernel_selftest, "selftest_plan", lambda device, quick=False: [
        ("causal", case, torch.float32), ("causal", (1, 1, 8, 16, 16, "no-such-decay", True, False), torch.float32),
        ("causal", case, torch.float16)])
    monkeypatch.setitem(kernel_selftest.TOLERANCES, "float32", (0.0, 0.0, 0.0))
    res = kernel_selftest.run_kernel_selftest("cpu")
    assert res["status"] == "failed" and [c["status"] for c in res["checks"]] == ["failed", "failed", "passed"]
    assert any(p.startswith("o: rel") for p in res["checks"][0]["problems"])
    assert "KeyError" in res["checks"][1]["problems"][0]
    assert gpu_check.exit_status({"kernel self-test": res}) == 1


def test_an_interpreter_that_cannot_run_says_why(monkeypatch):
    """Triton <= 3.6's interpreter calls int() on one-element arrays, an error from NumPy 2.4
    on: every kernel failed with an InterpreterError naming neither. The check reads the
    interpreter's line; launchable raises its message before an interpreted launch (CPU
    tensors), never on the CUDA path."""
    import inspect

    from triton.runtime import interpreter

    from linattn_lib.kernels import configs, devices

    old = "    scope.set_attr(tensor, \"__index__\", lambda self: int(self.handle.data))\n"
    assert "triton>=3.7.1" in devices.interpreter_problem(old, True)
    assert devices.interpreter_problem(old, False) is None  # NumPy < 2.4: a warning only
    # the installed Triton's own interpreter (CI: 3.7.1, which squeezes the array first)
    if "squeeze()" in inspect.getsource(interpreter):
        assert devices.interpreter_problem(inspect.getsource(interpreter), True) is None

    def broken():
        raise RuntimeError("cannot interpret")

    monkeypatch.setattr(configs, "interpreter_check", broken)
    kernel = configs._interpreted_type  # any object: the check comes first
    with pytest.raises(RuntimeError, match="cannot interpret"):
        configs.launchable(kernel, "cpu")
    assert configs.launchable(kernel, torch.device("cuda", 0)) is kernel
