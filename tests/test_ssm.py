"""SSM bridge: SSD == semiseparable matrix == token-loop scan == chunked; ZOH == matrix exponential;
GLA's three forms agree; RWKV-4's stable WKV == its softmax form, even where exp(k) overflows."""

import pytest
import torch
import torch.nn.functional as F

from linattn_lib import LinearAttentionState, linear_attention
from linattn_lib.core.ssm import (
    gla_attention,
    retnet_log_decay,
    rwkv4_wkv,
    selective_scan_reference,
    semiseparable_matrix,
    ssd,
    zoh_discretize,
)

D64 = torch.float64
TOL = 1e-10


def maxdiff(a, b):
    return (a - b).abs().max().item()


def ssd_inputs(B=2, H=3, T=37, P=4, N=5, *, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, T, P, generator=g, dtype=D64)
    dt = F.softplus(torch.randn(B, H, T, generator=g, dtype=D64))
    A = -torch.exp(torch.randn(H, generator=g, dtype=D64))
    Bm = torch.randn(B, H, T, N, generator=g, dtype=D64)
    Cm = torch.randn(B, H, T, N, generator=g, dtype=D64)
    return x, dt, A, Bm, Cm


# ------------------------------------------------------------------ SSD


@pytest.mark.parametrize("T", [1, 16, 37])
def test_ssd_forms_matrix_and_scan_agree(T):
    x, dt, A, Bm, Cm = ssd_inputs(T=T)
    M = semiseparable_matrix(Cm, Bm, dt * A.view(1, -1, 1))
    expect = M @ (x * dt.unsqueeze(-1))
    assert maxdiff(selective_scan_reference(x, dt, A, Bm, Cm), expect) < TOL
    for form in ("quadratic", "recurrent", "chunked"):
        for chunk in (8, 64):
            assert maxdiff(ssd(x, dt, A, Bm, Cm, form=form, chunk_size=chunk), expect) < TOL


def test_ssd_state_matches_scan_state_and_resumes():
    x, dt, A, Bm, Cm = ssd_inputs(T=40)
    y, state = ssd(x, dt, A, Bm, Cm, return_state=True)
    _, h = selective_scan_reference(x, dt, A, Bm, Cm, return_state=True)
    assert maxdiff(state.S, h.transpose(-1, -2)) < TOL  # S is (N, P), h is (P, N)
    cut = 23
    first = [t[:, :, :cut] for t in (x, dt)] + [A] + [t[:, :, :cut] for t in (Bm, Cm)]
    rest = [t[:, :, cut:] for t in (x, dt)] + [A] + [t[:, :, cut:] for t in (Bm, Cm)]
    y1, s1 = ssd(*first, return_state=True)
    y2 = ssd(*rest, initial_state=s1)
    assert maxdiff(torch.cat([y1, y2], dim=2), y) < TOL
    _, h1 = selective_scan_reference(*first, return_state=True)
    assert maxdiff(selective_scan_reference(*rest, initial_state=h1), y[:, :, cut:]) < TOL


def test_ssd_with_no_decay_is_causal_linear_attention():
    """Errata A31: A = 0 leaves L = the causal mask of ones, M = tril(C B^T)."""
    x, dt, A, Bm, Cm = ssd_inputs(T=20)
    zero = torch.zeros_like(A)
    M = semiseparable_matrix(Cm, Bm, torch.zeros_like(dt))
    assert maxdiff(M, (Cm @ Bm.transpose(-1, -2)).tril()) < TOL
    expect = linear_attention(Cm, Bm, x * dt.unsqueeze(-1), normalize=False, form="quadratic")
    assert maxdiff(ssd(x, dt, zero, Bm, Cm), expect) < TOL


def test_semiseparable_blocks_have_rank_at_most_N():
    x, dt, A, Bm, Cm = ssd_inputs(B=1, H=1, T=40, N=3)
    M = semiseparable_matrix(Cm, Bm, dt * A.view(1, -1, 1))[0, 0]
    for cut in (10, 20, 30):
        assert torch.linalg.matrix_rank(M[cut:, :cut]).item() <= 3
    assert M.triu(1).abs().max() == 0


def test_ssd_gradients_match_scan():
    x, dt, A, Bm, Cm = ssd_inputs(B=1, H=2, T=12)
    grads = []
    for fn in (lambda *a: ssd(*a, chunk_size=5), selective_scan_reference):
        xs = [t.clone().requires_grad_() for t in (x, dt, A, Bm, Cm)]
        fn(*xs).square().sum().backward()
        grads.append([t.grad for t in xs])
    for a, b in zip(*grads):
        assert maxdiff(a, b) < 1e-9


# ------------------------------------------------------------------ ZOH and the per-channel scan


def van_loan(a, b, dt):
    """exp([[dt A, dt B], [0, 0]]) = [[A_bar, B_bar], [0, 1]]: ZOH without inverting A."""
    N = a.shape[0]
    M = torch.zeros(N + 1, N + 1, dtype=D64)
    M[:N, :N] = torch.diag(a * dt)
    M[:N, N] = b * dt
    E = torch.linalg.matrix_exp(M)
    return E[:N, :N], E[:N, N]


@pytest.mark.parametrize("dt", [1e-9, 1e-3, 0.1, 1.0, 7.0])
def test_zoh_matches_matrix_exponential(dt):
    g = torch.Generator().manual_seed(1)
    a = torch.cat([-torch.exp(torch.randn(6, generator=g, dtype=D64)), torch.zeros(1, dtype=D64), torch.tensor([0.3], dtype=D64)])
    b = torch.randn(8, generator=g, dtype=D64)
    A_bar, B_bar = zoh_discretize(a, b, torch.tensor(dt, dtype=D64))
    E_A, E_B = van_loan(a, b, dt)
    assert maxdiff(torch.diag(A_bar), E_A) < 1e-13
    # also the textbook formula (dt A)^{-1} (exp(dt A) - I) dt B, where dt A is invertible
    direct = torch.linalg.solve(torch.diag(a[:6] * dt), (E_A[:6, :6] - torch.eye(6, dtype=D64)) @ (b[:6] * dt))
    assert maxdiff(B_bar, E_B) < 1e-13 * max(1.0, dt)
    if dt >= 1e-3:
        assert maxdiff(B_bar[:6], direct) < 1e-10


def test_zoh_small_step_limit_and_mamba_simplification():
    a = torch.tensor([-2.0, -0.5, 0.0], dtype=D64)
    b = torch.tensor([1.0, -3.0, 0.5], dtype=D64)
    for dt in (1e-2, 1e-4, 1e-6, 1e-12):
        dt_ = torch.tensor(dt, dtype=D64)
        _, B_zoh = zoh_discretize(a, b, dt_)
        _, B_mamba = zoh_discretize(a, b, dt_, method="mamba")
        assert maxdiff(B_mamba, dt * b) == 0
        # B_bar = dt B (1 + dt a / 2 + O(dt^2)): relative gap ~ |dt a| / 2
        assert maxdiff(B_zoh / (dt * b), 1 + dt * a / 2) < dt**2 + 1e-15
    _, B0 = zoh_discretize(a, b, torch.tensor(0.5, dtype=D64))
    assert B0[2].item() == 0.5 * 0.5  # A = 0 exactly: B_bar = dt B, no 0/0


def test_zoh_gradient_is_finite_at_zero():
    a = torch.tensor([0.0, -1e-6, -1.0], dtype=D64, requires_grad=True)
    b = torch.ones(3, dtype=D64, requires_grad=True)
    dt = torch.tensor(0.5, dtype=D64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, dt: zoh_discretize(a, b, dt)[1], (a, b, dt))


def _per_channel_loops(x, dt, A, Bm, Cm):
    """y_tp = sum_n C_tn sum_{j<=t} exp(sum_{s=j+1..t} dt_sp A_pn) dt_jp B_jn x_jp (Mamba's B_bar = dt B)."""
    Bt, H, T, P = x.shape
    y = torch.zeros_like(x)
    for t in range(T):
        for j in range(t + 1):
            decay = torch.exp((dt[:, :, j + 1 : t + 1].sum(2)).unsqueeze(-1) * A)  # (B, H, P, N)
            contrib = decay * (dt[:, :, j].unsqueeze(-1) * Bm[:, :, j].unsqueeze(2)) * x[:, :, j].unsqueeze(-1)
            y[:, :, t] += (contrib * Cm[:, :, t].unsqueeze(2)).sum(-1)
    return y


def test_per_channel_scan_matches_closed_form_and_reduces_to_ssd():
    x, _, _, Bm, Cm = ssd_inputs(B=1, H=2, T=9, P=3, N=4)
    g = torch.Generator().manual_seed(5)
    A = -torch.rand(2, 3, 4, generator=g, dtype=D64)
    dt = torch.rand(1, 2, 9, 3, generator=g, dtype=D64) + 0.1
    assert maxdiff(selective_scan_reference(x, dt, A, Bm, Cm), _per_channel_loops(x, dt, A, Bm, Cm)) < TOL
    # one rate per head and one dt per head: the scan is SSD again
    A_head, dt_head = A[:, 0, 0], dt[..., 0]
    same_A = A_head.view(2, 1, 1).expand(2, 3, 4)
    same_dt = dt_head.unsqueeze(-1).expand(1, 2, 9, 3)
    expect = ssd(x, dt_head, A_head, Bm, Cm)
    assert maxdiff(selective_scan_reference(x, same_dt, same_A, Bm, Cm), expect) < TOL
    # exact ZOH differs from Mamba's B_bar = dt B by a factor 1 + dt A / 2 + ...: small for small dt
    zoh = selective_scan_reference(x, dt_head * 1e-3, A_head, Bm, Cm, discretization="zoh")
    mamba = selective_scan_reference(x, dt_head * 1e-3, A_head, Bm, Cm)
    assert 0 < maxdiff(zoh, mamba) < 1e-3 * mamba.abs().max().item()


# ------------------------------------------------------------------ RetNet and GLA


def test_retnet_log_decay_values():
    g = retnet_log_decay(8, dtype=D64)
    expect = torch.tensor([1 - 2.0 ** (-5 - h) for h in range(8)], dtype=D64)
    assert maxdiff(torch.exp(g), expect) < 1e-15
    fla = (1 - torch.tensor(2.0, dtype=D64).pow(-5.0 - torch.arange(8, dtype=D64))).log()  # fla's g_gamma
    assert maxdiff(g, fla) < 1e-15
    assert retnet_log_decay(3).dtype == torch.float32


def gla_inputs(B=2, H=2, T=37, Dk=6, Dv=3, *, seed=0, strength=2.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, Dk, generator=g, dtype=D64)
    k = torch.randn(B, H, T, Dk, generator=g, dtype=D64)
    v = torch.randn(B, H, T, Dv, generator=g, dtype=D64)
    gates = F.logsigmoid(torch.randn(B, H, T, Dk, generator=g, dtype=D64)) * strength
    return q, k, v, gates


@pytest.mark.parametrize("T", [1, 16, 37])
def test_gla_forms_agree_with_state(T):
    q, k, v, gates = gla_inputs(T=T)
    S0 = LinearAttentionState(torch.randn(2, 2, 6, 3, dtype=D64), None)
    ref, ref_state = gla_attention(q, k, v, gates, form="recurrent", initial_state=S0, return_state=True)
    for form, chunk in (("quadratic", 64), ("chunked", 8), ("chunked", 64)):
        out, state = gla_attention(q, k, v, gates, form=form, chunk_size=chunk, initial_state=S0, return_state=True)
        assert maxdiff(out, ref) < TOL and maxdiff(state.S, ref_state.S) < TOL


def test_gla_with_equal_gates_is_linear_attention_with_decay():
    q, k, v, _ = gla_inputs(T=30)
    scalar = -torch.rand(2, 2, 30, dtype=D64)
    gates = scalar.unsqueeze(-1).expand(-1, -1, -1, 6)
    expect = linear_attention(q, k, v, normalize=False, log_decay=scalar, form="quadratic")
    assert maxdiff(gla_attention(q, k, v, gates), expect) < TOL
    plain = linear_attention(q, k, v, normalize=False, form="quadratic")
    assert maxdiff(gla_attention(q, k, v, torch.zeros_like(gates), form="recurrent"), plain) < TOL


def test_gla_strong_gates_and_gradients():
    q, k, v, gates = gla_inputs(T=20, strength=40.0)  # exp(-40 * 20) underflows a naive q exp(G)
    out = gla_attention(q, k, v, gates, chunk_size=7)
    assert torch.isfinite(out).all()
    assert maxdiff(out, gla_attention(q, k, v, gates, form="recurrent")) < TOL
    grads = []
    for form in ("recurrent", "chunked"):
        xs = [t.clone().requires_grad_() for t in gla_inputs(T=13)]
        gla_attention(*xs, form=form, chunk_size=4).square().sum().backward()
        grads.append([t.grad for t in xs])
    for a, b in zip(*grads):
        assert maxdiff(a, b) < 1e-9


# ------------------------------------------------------------------ RWKV-4


def wkv_inputs(B=2, T=33, C=5, *, seed=0, scale=1.0, dtype=D64):
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(C, generator=g, dtype=D64).to(dtype)
    u = torch.randn(C, generator=g, dtype=D64).to(dtype)
    k = (scale * torch.randn(B, T, C, generator=g, dtype=D64)).to(dtype)
    v = torch.randn(B, T, C, generator=g, dtype=D64).to(dtype)
    return w, u, k, v


def _wkv_formula(w, u, k, v):
    """The paper's sums, term by term."""
    out = torch.zeros_like(v)
    for t in range(k.shape[1]):
        num = torch.exp(u + k[:, t]) * v[:, t]
        den = torch.exp(u + k[:, t])
        for i in range(t):
            e = torch.exp(-(t - 1 - i) * w + k[:, i])
            num, den = num + e * v[:, i], den + e
        out[:, t] = num / den
    return out


@pytest.mark.parametrize("T", [1, 2, 33])
def test_wkv_forms_agree_with_formula(T):
    w, u, k, v = wkv_inputs(T=T)
    expect = _wkv_formula(w, u, k, v)
    for form in ("recurrent", "quadratic", "naive"):
        assert maxdiff(rwkv4_wkv(w, u, k, v, form=form), expect) < TOL


def test_wkv_stable_where_naive_overflows():
    w, u, k, v = wkv_inputs(scale=300.0)  # exp(k) reaches e^900: beyond float64's e^709
    assert k.max() > 710
    stable = rwkv4_wkv(w, u, k, v)
    assert maxdiff(stable, rwkv4_wkv(w, u, k, v, form="quadratic")) < TOL
    assert not torch.isfinite(rwkv4_wkv(w, u, k, v, form="naive")).all()
    # float32 overflows at e^88; the running max keeps the float32 loop close to float64
    w32, u32, k32, v32 = (t.float() for t in wkv_inputs(scale=60.0))
    assert not torch.isfinite(rwkv4_wkv(w32, u32, k32, v32, form="naive")).all()
    ref = rwkv4_wkv(*(t.double() for t in (w32, u32, k32, v32)), form="quadratic")
    assert maxdiff(rwkv4_wkv(w32, u32, k32, v32).double(), ref) < 1e-4


def test_wkv_is_an_average_and_differentiable():
    w, u, k, v = wkv_inputs(scale=50.0)
    # a weighted average of values: constant values come back unchanged
    assert maxdiff(rwkv4_wkv(w, u, k, torch.full_like(v, 2.5)), torch.full_like(v, 2.5)) < 1e-12
    grads = []
    for form in ("recurrent", "quadratic"):
        xs = [t.clone().requires_grad_() for t in (w, u, k, v)]
        rwkv4_wkv(*xs, form=form).square().sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in xs)
        grads.append([t.grad for t in xs])
    for a, b in zip(*grads):
        assert maxdiff(a, b) < 1e-8


# ------------------------------------------------------------------ errors


def test_ssm_errors():
    x, dt, A, Bm, Cm = ssd_inputs(T=6)
    with pytest.raises(ValueError, match=r"`dt` must be > 0 \(a step size.*got a minimum of -1"):
        ssd(x, dt - dt - 1, A, Bm, Cm)
    with pytest.raises(ValueError, match=r"`dt` must be > 0"):
        ssd(x, torch.zeros_like(dt), A, Bm, Cm)
    with pytest.raises(ValueError, match=r"`A` must be <= 0.*got a maximum of 0.5"):
        ssd(x, dt, torch.full_like(A, 0.5), Bm, Cm)
    with pytest.raises(ValueError, match=r"`x` must be a 4-d tensor laid out as \(B, H, T, P\)"):
        ssd(x[0], dt, A, Bm, Cm)
    with pytest.raises(ValueError, match=r"`dt` has shape \(2, 3, 5\); expected \(B=2, H=3, T=6\)"):
        ssd(x, dt[:, :, :5], A, Bm, Cm)
    with pytest.raises(ValueError, match=r"`C` has shape \(2, 3, 6, 4\); expected \(B=2, H=3, T=6, N=5\)"):
        ssd(x, dt, A, Bm, Cm[..., :4])
    with pytest.raises(ValueError, match=r"`A` has shape \(2,\); expected \(H=3\)"):
        ssd(x, dt, A[:2], Bm, Cm)
    with pytest.raises(TypeError, match=r"`A` has dtype torch.float32 but `x` has dtype torch.float64"):
        ssd(x, dt, A.float(), Bm, Cm)
    with pytest.raises(ValueError, match=r"`dt` contains NaN"):
        ssd(x, dt * float("nan"), A, Bm, Cm)
    with pytest.raises(ValueError, match=r"unknown form='fast'"):
        ssd(x, dt, A, Bm, Cm, form="fast")
    with pytest.raises(ValueError, match=r"`log_a` must be <= 0"):
        semiseparable_matrix(Cm, Bm, torch.ones_like(dt))
    with pytest.raises(ValueError, match=r"`log_a` has shape \(6,\)"):
        semiseparable_matrix(Cm, Bm, dt[0, 0])
    with pytest.raises(ValueError, match=r"`A` has shape \(3, 4\); expected \(H,\) = \(3,\) \(Mamba-2\) or \(H, P, N\)"):
        selective_scan_reference(x, dt, torch.zeros(3, 4, dtype=D64), Bm, Cm)
    with pytest.raises(ValueError, match=r"unknown discretization='euler'"):
        selective_scan_reference(x, dt, A, Bm, Cm, discretization="euler")
    a, b = torch.full((4,), -1.0, dtype=D64), torch.ones(4, dtype=D64)
    with pytest.raises(ValueError, match=r"`dt` must be > 0"):
        zoh_discretize(a, b, torch.tensor(0.0, dtype=D64))
    with pytest.raises(ValueError, match=r"`B` has shape \(3,\) but `A` has shape \(4,\)"):
        zoh_discretize(a, b[:3], torch.tensor(1.0, dtype=D64))
    with pytest.raises(ValueError, match=r"`dt` has shape \(4,\); expected A.shape\[:-1\] = \(\)"):
        zoh_discretize(a, b, torch.ones(4, dtype=D64))
    with pytest.raises(ValueError, match=r"`H` must be a positive int, got 0"):
        retnet_log_decay(0)


def test_gla_and_wkv_errors():
    q, k, v, gates = gla_inputs(T=6)
    with pytest.raises(ValueError, match=r"`log_gates` must be <= 0 \(a gate exp\(g\) in \(0, 1\]\)"):
        gla_attention(q, k, v, -gates)
    with pytest.raises(ValueError, match=r"`log_gates` must be a 4-d tensor laid out as \(B, H, T, Dk\)"):
        gla_attention(q, k, v, gates[..., 0])
    with pytest.raises(ValueError, match=r"`log_gates` has shape \(2, 2, 6, 5\); expected \(B=2, H=2, T=6, Dk=6\)"):
        gla_attention(q, k, v, gates[..., :5])
    with pytest.raises(TypeError, match=r"`initial_state` must be a LinearAttentionState"):
        gla_attention(q, k, v, gates, initial_state=torch.zeros(2, 2, 6, 3, dtype=D64))
    with pytest.raises(ValueError, match=r"`initial_state.S` has shape \(2, 2, 3, 6\)"):
        gla_attention(q, k, v, gates, initial_state=LinearAttentionState(torch.zeros(2, 2, 3, 6, dtype=D64)))
    w, u, kk, vv = wkv_inputs(T=6)
    with pytest.raises(ValueError, match=r"`w` must be >= 0 \(a decay rate"):
        rwkv4_wkv(-w, u, kk, vv)
    with pytest.raises(ValueError, match=r"`k` must be a 3-d tensor laid out as \(B, T, C\)"):
        rwkv4_wkv(w, u, kk.unsqueeze(0), vv)
    with pytest.raises(ValueError, match=r"`v` has shape \(2, 5, 5\); expected \(B=2, T=6, C=5\)"):
        rwkv4_wkv(w, u, kk, vv[:, :5])
    with pytest.raises(ValueError, match=r"`u` has shape \(4,\); expected \(C=5\)"):
        rwkv4_wkv(w, u[:4], kk, vv)
    with pytest.raises(ValueError, match=r"unknown form='chunked'"):
        rwkv4_wkv(w, u, kk, vv, form="chunked")


def test_gla_chunked_state_is_exact_after_a_reset():
    """A reset (log-gate -1e4) early in a chunk, in float32: every key's decay to the chunk end
    is summed from the next token on. Taken as G_end - G_j, a difference of two prefix sums
    near -1e4, it would keep only about 1e-3 of absolute precision in float32 and move the
    final state by about that much relatively."""
    g = torch.Generator().manual_seed(0)
    B, H, T, Dk, Dv = 1, 2, 48, 4, 3
    q, k = (torch.rand(B, H, T, Dk, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, H, T, Dv, generator=g, dtype=torch.float64)
    log_gates = -0.01 * torch.rand(B, H, T, Dk, generator=g, dtype=torch.float64)
    log_gates[:, :, 3] = -1e4  # the reset: everything before it is forgotten
    _, exact = gla_attention(q, k, v, log_gates, form="recurrent", return_state=True)
    f32 = [x.float() for x in (q, k, v, log_gates)]
    _, state = gla_attention(*f32, form="chunked", chunk_size=32, return_state=True)
    rel = ((state.S.double() - exact.S).norm() / exact.S.norm()).item()
    assert rel < 1e-5, rel
