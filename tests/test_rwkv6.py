"""RWKV-5/6 (Eagle/Finch) WKV: the matrix-state recurrence, its parallel form and its place beside linear attention."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from linattn_lib.core.linear import linear_attention
from linattn_lib.core.ssm import gla_attention, rwkv4_wkv, rwkv6_attention
from linattn_lib.core.state import LinearAttentionState

F64 = torch.float64


def inputs(B=2, H=3, T=11, Dk=5, Dv=4, *, seed=0, shared=False):
    """r, k, v, log_w (Finch's -exp(.), per token and channel, or one per token if shared), u."""
    g = torch.Generator().manual_seed(seed)
    r, k = (torch.randn(B, H, T, Dk, generator=g, dtype=F64) for _ in range(2))
    v = torch.randn(B, H, T, Dv, generator=g, dtype=F64)
    d = torch.randn(B, H, T, 1 if shared else Dk, generator=g, dtype=F64) - 1
    log_w = (-torch.exp(d)).expand(B, H, T, Dk)
    u = torch.randn(H, Dk, generator=g, dtype=F64)
    return r, k, v, log_w, u


def state(B=2, H=3, Dk=5, Dv=4, seed=1):
    return LinearAttentionState(torch.randn(B, H, Dk, Dv, generator=torch.Generator().manual_seed(seed), dtype=F64))


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def test_parallel_form_is_the_stated_sum():
    r, k, v, log_w, u = inputs(1, 2, 6, 3, 2)
    expect = torch.zeros(1, 2, 6, 2, dtype=F64)
    for i in range(6):  # o_i = sum_{j<i} (r_i o w_{j+1} ... w_{i-1}) . k_j v_j + (r_i o u) . k_i v_i
        expect[:, :, i] = ((r[:, :, i] * u * k[:, :, i]).sum(-1, keepdim=True)) * v[:, :, i]
        for j in range(i):
            decay = torch.exp(log_w[:, :, j + 1:i].sum(2))
            expect[:, :, i] += (r[:, :, i] * decay * k[:, :, j]).sum(-1, keepdim=True) * v[:, :, j]
    for form in ("recurrent", "parallel"):
        assert rel(rwkv6_attention(r, k, v, log_w, u, form=form), expect) < 1e-12


@pytest.mark.parametrize("shape", [(1, 1, 1, 3, 2), (2, 3, 37, 5, 4), (1, 2, 16, 7, 3), (2, 1, 9, 2, 6)])
@pytest.mark.parametrize("with_state", [False, True])
def test_recurrent_and_parallel_forms_agree(shape, with_state):
    B, H, T, Dk, Dv = shape
    r, k, v, log_w, u = inputs(*shape, seed=T)
    s0 = state(B, H, Dk, Dv) if with_state else None
    o1, st1 = rwkv6_attention(r, k, v, log_w, u, initial_state=s0, return_state=True, form="recurrent")
    o2, st2 = rwkv6_attention(r, k, v, log_w, u, initial_state=s0, return_state=True, form="parallel")
    assert o1.shape == (B, H, T, Dv) and st1.S.shape == (B, H, Dk, Dv) and st1.z is None
    assert rel(o2, o1) < 1e-10 and rel(st2.S, st1.S) < 1e-10


@pytest.mark.parametrize("form", ["recurrent", "parallel"])
def test_state_round_trip_two_halves_equal_one_run(form):
    r, k, v, log_w, u = inputs(T=23)
    s0 = state()
    o, st = rwkv6_attention(r, k, v, log_w, u, initial_state=s0, return_state=True, form=form)
    cut = 10
    o_a, st_a = rwkv6_attention(r[:, :, :cut], k[:, :, :cut], v[:, :, :cut], log_w[:, :, :cut], u,
                                initial_state=s0, return_state=True, form=form)
    o_b, st_b = rwkv6_attention(r[:, :, cut:], k[:, :, cut:], v[:, :, cut:], log_w[:, :, cut:], u,
                                initial_state=st_a, return_state=True, form=form)
    assert rel(torch.cat([o_a, o_b], dim=2), o) < 1e-12 and rel(st_b.S, st.S) < 1e-12


def test_constant_eagle_decay_equals_its_broadcast():
    r, k, v, _, u = inputs()
    w5 = -torch.rand(3, 5, generator=torch.Generator().manual_seed(2), dtype=F64)  # (H, Dk), RWKV-5
    full = w5.view(1, 3, 1, 5).expand(2, 3, 11, 5)
    for form in ("recurrent", "parallel"):
        assert rel(rwkv6_attention(r, k, v, w5, u, form=form), rwkv6_attention(r, k, v, full, u)) < 1e-12


def test_gradients_agree_between_forms():
    r, k, v, log_w, u = inputs(T=17)
    s0 = state().S
    wo, ws = torch.randn(2, 3, 17, 4, dtype=F64), torch.randn(2, 3, 5, 4, dtype=F64)
    grads = []
    for form in ("recurrent", "parallel"):
        xs = [t.clone().requires_grad_() for t in (r, k, v, log_w.contiguous(), u, s0)]
        o, st = rwkv6_attention(*xs[:5], initial_state=LinearAttentionState(xs[5]), return_state=True, form=form)
        ((o * wo).sum() + (st.S * ws).sum()).backward()
        grads.append([x.grad for x in xs])
    for ga, gb in zip(*grads):
        assert torch.isfinite(ga).all() and rel(gb, ga) < 1e-10
    small = [t.clone().requires_grad_() for t in inputs(1, 1, 5, 3, 2)]
    small[3] = small[3].detach().contiguous().requires_grad_()
    assert torch.autograd.gradcheck(lambda *a: rwkv6_attention(*a, form="parallel"), small)


def test_shared_decay_is_linear_attention_shifted_by_one_token():
    B, H, T, Dk, Dv = 2, 3, 19, 5, 4
    r, k, v, log_w, u = inputs(B, H, T, Dk, Dv, shared=True)
    g = log_w[..., 0]  # (B, H, T): one decay per token, shared by all channels
    zero_u = torch.zeros_like(u)
    o, st = rwkv6_attention(r, k, v, log_w, zero_u, return_state=True)
    # (1) the same state S_t; linear attention reads S_t, RWKV reads S_{t-1}: move r_t to t - 1
    r_early = F.pad(r[:, :, 1:], (0, 0, 0, 1))
    o_la, st_la = linear_attention(r_early, k, v, causal=True, normalize=False, log_decay=g, chunk_size=4,
                                   return_state=True)
    assert rel(o[:, :, 1:], o_la[:, :, :-1]) < 1e-12 and o[:, :, 0].abs().max() == 0
    assert rel(st.S, st_la.S) < 1e-12
    # (2) equivalently keep r and delay k, v and the decay by one token; the bonus is a diagonal term
    k_late, v_late = (F.pad(x, (0, 0, 1, 0))[:, :, :-1] for x in (k, v))
    g_late = F.pad(g, (1, 0))[..., :-1]
    bonus = (r * u.unsqueeze(1) * k).sum(-1, keepdim=True) * v
    for form in ("quadratic", "recurrent", "chunked"):
        o_la = linear_attention(r, k_late, v_late, causal=True, normalize=False, log_decay=g_late, form=form,
                                chunk_size=6)
        assert rel(rwkv6_attention(r, k, v, log_w, u, form="parallel"), o_la + bonus) < 1e-12
    # (3) per-channel decays: the same shift onto GLA, which also reads S_t
    r, k, v, log_w, u = inputs(B, H, T, Dk, Dv, seed=3)
    o_gla = gla_attention(F.pad(r[:, :, 1:], (0, 0, 0, 1)), k, v, log_w.contiguous())
    assert rel(rwkv6_attention(r, k, v, log_w, zero_u)[:, :, 1:], o_gla[:, :, :-1]) < 1e-12


def test_receptance_acts_as_a_query_unlike_rwkv4():
    r, k, v, log_w, u = inputs(T=12)
    o = rwkv6_attention(r, k, v, log_w, u)
    t0 = 5
    r2 = r.clone()
    r2[:, :, t0] = 3 * r[:, :, t0] + 1
    diff = (rwkv6_attention(r2, k, v, log_w, u) - o).abs().amax(dim=(0, 1, 3))
    assert diff[t0] > 1e-3 and torch.cat([diff[:t0], diff[t0 + 1:]]).max() == 0  # r_t reaches o_t only
    r3 = r.clone()
    r3[:, :, t0] *= 2
    assert rel(rwkv6_attention(r3, k, v, log_w, u)[:, :, t0], 2 * o[:, :, t0]) < 1e-14  # linear in its query
    k2 = k.clone()
    k2[:, :, t0] += 1  # a key reaches its own token (bonus) and later ones, never earlier ones
    diff_k = (rwkv6_attention(r, k2, v, log_w, u) - o).abs().amax(dim=(0, 1, 3))
    assert diff_k[:t0].max() == 0 and (diff_k[t0:] > 0).all()
    # RWKV-4 has no query: its WKV is a normalised average, so constant values come back unchanged,
    # whatever the keys; RWKV-6 has no normaliser and returns r-dependent multiples of them
    kk = torch.randn(2, 12, 6, dtype=F64)
    c = torch.full((2, 12, 6), 2.5, dtype=F64)
    assert (rwkv4_wkv(torch.rand(6, dtype=F64), torch.randn(6, dtype=F64), kk, c) - 2.5).abs().max() < 1e-12
    assert (rwkv6_attention(r, k, torch.full_like(v, 2.5), log_w, u) - 2.5).abs().max() > 1.0


def test_errors_name_the_argument():
    r, k, v, log_w, u = inputs()
    call = rwkv6_attention
    cases = [
        (lambda: call(r, k, v, log_w.abs(), u), r"rwkv6_attention: `log_w` must be <= 0"),
        (lambda: call(r, k, v, log_w[..., 0], u), r"`log_w` has shape \(2, 3, 11\); expected \(B, H, T, Dk\)"),
        (lambda: call(r, k, v, log_w[:, :, :5], u), r"`log_w` has shape \(2, 3, 5, 5\)"),
        (lambda: call(r, k, v, log_w, u[:, :4]), r"`u` has shape \(3, 4\); expected \(H=3, Dk=5\)"),
        (lambda: call(r, k, v, log_w, u[0]), r"`u` must be a 2-d tensor laid out as \(H, Dk\)"),
        (lambda: call(r, k, v, log_w, u, form="chunked"), r"unknown form='chunked'"),
        (lambda: call(r, k[..., :4], v, log_w, u), r"`k` has shape \(2, 3, 11, 4\)"),
        (lambda: call(r, k, v[:, :, :5], log_w, u), r"`v` has shape \(2, 3, 5, 4\)"),
        (lambda: call(r[0], k, v, log_w, u), r"`r` must be a 4-d tensor laid out as \(B, H, T, Dk\)"),
        (lambda: call(r[:, :, :0], k[:, :, :0], v[:, :, :0], log_w[:, :, :0], u), r"T must be at least 1"),
        (lambda: call(r.index_fill(2, torch.tensor([3]), float("nan")), k, v, log_w, u), r"`r` has a non-finite"),
        (lambda: call(r, k, v, log_w, u, initial_state=LinearAttentionState(state().S[:, :, :4])),
         r"`initial_state.S` has shape"),
        (lambda: call(r, k, v, log_w, u, initial_state=LinearAttentionState(state().S, state().S[..., 0])),
         r"`initial_state.z` must be None"),
    ]
    for fn, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            fn()
    with pytest.raises(TypeError, match=r"`return_state` must be True or False"):
        call(r, k, v, log_w, u, return_state="yes")
    with pytest.raises(TypeError, match=r"`u` has dtype torch.float32"):
        call(r, k, v, log_w, u.float())
