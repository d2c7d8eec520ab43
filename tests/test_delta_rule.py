"""The delta rule (DeltaNet, Gated DeltaNet): its three forms agree with the definition and with
each other in float64, forward and backward; a gate reset is exact; the state behaves as an
online least-squares memory (it overwrites, additive linear attention sums); beta in [0, 2]
keeps it bounded; the decode step is the recurrence; bad arguments are refused by name."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from linattn_lib.core.delta import delta_rule_attention, delta_rule_decode_step
from linattn_lib.core.linear import linear_attention
from linattn_lib.core.state import LinearAttentionState

D64 = torch.float64
TOL = 1e-10


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """RMS of a - b relative to the RMS of b."""
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def inputs(B=2, H=3, T=13, Dk=5, Dv=7, *, decay=None, seed=0, dtype=D64):
    """q, k (unit keys), v, beta in (0, 2] (a few exactly 2) and a log-decay (None, "head", "token")."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, Dk, generator=g, dtype=D64)
    k = F.normalize(torch.randn(B, H, T, Dk, generator=g, dtype=D64), dim=-1)
    v = torch.randn(B, H, T, Dv, generator=g, dtype=D64)
    beta = 2.0 * (1.0 - torch.rand(B, H, T, generator=g, dtype=D64))  # in (0, 2]
    beta.view(-1)[::5] = 2.0  # reflections too
    if decay is None:
        log_decay = None
    elif decay == "head":
        log_decay = -torch.rand(H, generator=g, dtype=D64)
    else:
        log_decay = -torch.rand(B, H, T, generator=g, dtype=D64)
    cast = (lambda x: x if x is None else x.to(dtype))
    return cast(q), cast(k), cast(v), cast(beta), cast(log_decay)


def naive_gated_delta(q, k, v, beta, log_decay=None, S0=None):
    """The Gated DeltaNet paper's recurrence in its own (Dv x Dk) convention, with explicit matrices:
    M_t = M_{t-1} (alpha_t (I - beta_t k_t k_t^T)) + beta_t v_t k_t^T,  o_t = M_t q_t."""
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    if log_decay is None:
        g = torch.zeros(B, H, T, dtype=q.dtype)
    elif log_decay.dim() == 1:
        g = log_decay.view(1, H, 1).expand(B, H, T)
    else:
        g = log_decay
    M = torch.zeros(B, H, Dv, Dk, dtype=q.dtype) if S0 is None else S0.transpose(-1, -2).clone()
    eye = torch.eye(Dk, dtype=q.dtype)
    outs = []
    for t in range(T):
        kt, vt, bt = k[:, :, t], v[:, :, t], beta[:, :, t, None, None]
        transition = torch.exp(g[:, :, t, None, None]) * (eye - bt * kt.unsqueeze(-1) * kt.unsqueeze(-2))
        M = M @ transition + bt * vt.unsqueeze(-1) * kt.unsqueeze(-2)
        outs.append((M @ q[:, :, t].unsqueeze(-1)).squeeze(-1))
    return torch.stack(outs, dim=2), M.transpose(-1, -2)


SHAPES = [  # B, H, T, Dk, Dv, chunk_size
    (1, 1, 1, 4, 3, 4),  # a single token
    (2, 3, 13, 5, 7, 4),  # T not a multiple of the chunk, Dk != Dv
    (3, 2, 37, 8, 3, 16),
    (1, 2, 20, 3, 6, 1),  # chunks of one token
    (2, 1, 9, 6, 2, 64),  # one padded chunk
]


@pytest.mark.parametrize("decay", [None, "head", "token"])
def test_recurrent_is_the_papers_recurrence(decay):
    q, k, v, beta, g = inputs(2, 3, 17, 5, 4, decay=decay, seed=3)
    S0 = torch.randn(2, 3, 5, 4, dtype=D64)
    o_ref, S_ref = naive_gated_delta(q, k, v, beta, g, S0)
    o, state = delta_rule_attention(q, k, v, beta, log_decay=g, form="recurrent", initial_state=S0, return_state=True)
    assert rel_rms(o, o_ref) < 1e-13
    assert rel_rms(state.S, S_ref) < 1e-13


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("decay", [None, "head", "token"])
@pytest.mark.parametrize("init", [None, "tensor", "state"])
def test_forms_agree(shape, decay, init):
    B, H, T, Dk, Dv, C = shape
    q, k, v, beta, g = inputs(B, H, T, Dk, Dv, decay=decay, seed=T + Dk)
    S0 = None
    if init is not None:
        S0 = torch.randn(B, H, Dk, Dv, dtype=D64, generator=torch.Generator().manual_seed(7))
        S0 = S0 if init == "tensor" else LinearAttentionState(S0, None)
    kw = dict(log_decay=g, initial_state=S0, return_state=True)
    o_rec, st_rec = delta_rule_attention(q, k, v, beta, form="recurrent", **kw)
    assert o_rec.shape == (B, H, T, Dv) and o_rec.dtype == D64
    assert isinstance(st_rec, LinearAttentionState) and st_rec.z is None and st_rec.S.shape == (B, H, Dk, Dv)
    for form in ("chunked", "quadratic"):
        o, st = delta_rule_attention(q, k, v, beta, form=form, chunk_size=C, **kw)
        assert rel_rms(o, o_rec) < TOL, form
        assert rel_rms(st.S, st_rec.S) < TOL, form
        assert st.z is None
    # without return_state: the output alone, the same
    o_only = delta_rule_attention(q, k, v, beta, log_decay=g, initial_state=S0, chunk_size=C)
    assert isinstance(o_only, torch.Tensor) and rel_rms(o_only, o_rec) < TOL


def test_resuming_from_the_returned_state_equals_one_call():
    q, k, v, beta, g = inputs(2, 2, 30, 4, 5, decay="token", seed=11)
    whole = delta_rule_attention(q, k, v, beta, log_decay=g, chunk_size=8)
    o1, st = delta_rule_attention(q[:, :, :11], k[:, :, :11], v[:, :, :11], beta[:, :, :11],
                                  log_decay=g[:, :, :11], chunk_size=8, return_state=True)
    o2 = delta_rule_attention(q[:, :, 11:], k[:, :, 11:], v[:, :, 11:], beta[:, :, 11:],
                              log_decay=g[:, :, 11:], chunk_size=8, initial_state=st)
    assert rel_rms(torch.cat([o1, o2], dim=2), whole) < TOL


def test_float32_inputs_give_float32_outputs_close_to_float64():
    q, k, v, beta, g = inputs(2, 2, 40, 8, 4, decay="token", seed=5)
    o64 = delta_rule_attention(q, k, v, beta, log_decay=g, form="recurrent")
    o32, st = delta_rule_attention(q.float(), k.float(), v.float(), beta.float(), log_decay=g.float(),
                                   chunk_size=16, return_state=True)
    assert o32.dtype == torch.float32 and st.S.dtype == torch.float32
    assert rel_rms(o32.double(), o64) < 1e-5


def _grads(form, q, k, v, beta, g, S0, chunk_size=4):
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, beta, g, S0)]
    o, st = delta_rule_attention(*leaves[:4], log_decay=leaves[4], initial_state=leaves[5], form=form,
                                 chunk_size=chunk_size, return_state=True)
    w = torch.randn(o.shape, dtype=D64, generator=torch.Generator().manual_seed(1))
    wS = torch.randn(st.S.shape, dtype=D64, generator=torch.Generator().manual_seed(2))
    ((o * w).sum() + (st.S * wS).sum()).backward()
    return [x.grad for x in leaves]


@pytest.mark.parametrize("decay", ["head", "token"])
def test_gradients_chunked_and_quadratic_match_recurrent(decay):
    q, k, v, beta, g = inputs(2, 2, 11, 4, 3, decay=decay, seed=2)
    S0 = torch.randn(2, 2, 4, 3, dtype=D64)
    ref = _grads("recurrent", q, k, v, beta, g, S0)
    for form in ("chunked", "quadratic"):
        got = _grads(form, q, k, v, beta, g, S0)
        for name, a, b in zip(("q", "k", "v", "beta", "log_decay", "initial_state"), got, ref):
            assert a is not None and torch.isfinite(a).all(), (form, name)
            assert rel_rms(a, b) < TOL, (form, name)


def test_gradcheck_chunked():
    q, k, v, beta, g = inputs(1, 1, 5, 3, 2, decay="token", seed=4)
    beta = beta.clamp(0.2, 1.8)  # gradcheck's finite differences step around beta: stay inside (0, 2]
    g = g.clamp(max=-0.1)
    leaves = tuple(x.clone().requires_grad_(True) for x in (q, k, v, beta, g))
    fn = lambda q, k, v, b, g: delta_rule_attention(q, k, v, b, log_decay=g, chunk_size=2)
    assert torch.autograd.gradcheck(fn, leaves)


def test_decay_reset_is_exact():
    """g = -1e4 at one token forgets everything before it: chunked == recurrent, all finite, and
    from the reset on the output equals a fresh run started at that token."""
    B, H, T, t0 = 2, 2, 29, 10  # the reset falls inside a chunk of 8
    q, k, v, beta, g = inputs(B, H, T, 4, 3, decay="token", seed=9)
    g = g.clone()
    g[:, :, t0] = -1e4
    S0 = torch.randn(B, H, 4, 3, dtype=D64)
    o_rec = delta_rule_attention(q, k, v, beta, log_decay=g, form="recurrent", initial_state=S0)
    o_chk = delta_rule_attention(q, k, v, beta, log_decay=g, chunk_size=8, initial_state=S0)
    o_quad = delta_rule_attention(q, k, v, beta, log_decay=g, form="quadratic", initial_state=S0)
    assert torch.isfinite(o_chk).all() and torch.isfinite(o_quad).all()
    assert rel_rms(o_chk, o_rec) < TOL and rel_rms(o_quad, o_rec) < TOL
    fresh = delta_rule_attention(q[:, :, t0:], k[:, :, t0:], v[:, :, t0:], beta[:, :, t0:],
                                 log_decay=g[:, :, t0:], form="recurrent")
    assert rel_rms(o_chk[:, :, t0:], fresh) < TOL
    assert rel_rms(o_chk[:, :, :t0], o_rec[:, :, :t0]) < TOL and o_chk[:, :, :t0].abs().max() > 0.1
    grads = _grads("chunked", q, k, v, beta, g, S0, chunk_size=8)
    assert all(torch.isfinite(x).all() for x in grads)


def test_decay_reset_in_float32_keeps_the_interval_sums_precise():
    """In float32 a decay taken as a difference of prefix sums, cumsum(g)[i] - cumsum(g)[j], keeps
    about 1e-3 of absolute precision after a -1e4 step; summed over the interval it stays exact."""
    B, H, T, t0 = 2, 2, 29, 3  # the reset early in a chunk of 16, decays after it in the same chunk
    q, k, v, beta, g = inputs(B, H, T, 4, 3, decay="token", seed=14)
    g = g.clone()
    g[:, :, t0] = -1e4
    o64 = delta_rule_attention(q, k, v, beta, log_decay=g, form="recurrent")
    for form in ("chunked", "quadratic"):
        o32 = delta_rule_attention(q.float(), k.float(), v.float(), beta.float(), log_decay=g.float(),
                                   form=form, chunk_size=16)
        assert torch.isfinite(o32).all() and rel_rms(o32.double(), o64) < 1e-5, form


# --- the online least-squares memory -------------------------------------------------------


@pytest.mark.parametrize("form", ["recurrent", "chunked", "quadratic"])
@pytest.mark.parametrize("decay", [None, "token"])
def test_beta_one_stores_the_pair_exactly(form, decay):
    """With beta = 1 and a unit key the correction is complete: S_t^T k_t = v_t, whatever the
    state held before. Reading with q = k therefore returns every value."""
    q, k, v, _, g = inputs(2, 2, 23, 4, 3, decay=decay, seed=6)
    ones = torch.ones(2, 2, 23, dtype=D64)
    S0 = torch.randn(2, 2, 4, 3, dtype=D64)
    o = delta_rule_attention(k, k, v, ones, log_decay=g, form=form, chunk_size=8, initial_state=S0,
                             check_unit_keys=True)
    assert (o - v).abs().max() < 1e-12
    # additive linear attention, read the same way, returns v_t plus everything stored before
    o_add = linear_attention(k, k, v, normalize=False, log_decay=g, form="recurrent")
    assert (o_add - v).abs().max() > 0.5


def orthonormal_keys(B, H, T, Dk, seed=0):
    """(B, H, T, Dk) keys, orthonormal within each head (T <= Dk)."""
    A = torch.randn(B, H, Dk, Dk, dtype=D64, generator=torch.Generator().manual_seed(seed))
    Q, _ = torch.linalg.qr(A)
    return Q.transpose(-1, -2)[..., :T, :].contiguous()


def test_orthonormal_keys_both_recall_every_pair():
    B, H, T, Dk, Dv = 2, 2, 6, 6, 3
    k = orthonormal_keys(B, H, T, Dk, seed=1)
    v = torch.randn(B, H, T, Dv, dtype=D64)
    ones = torch.ones(B, H, T, dtype=D64)
    _, st = delta_rule_attention(k, k, v, ones, return_state=True)
    _, st_add = linear_attention(k, k, v, normalize=False, return_state=True)
    recall = k @ st.S  # row j: (S^T k_j)^T
    recall_add = k @ st_add.S
    assert (recall - v).abs().max() < 1e-12
    assert (recall_add - v).abs().max() < 1e-12


def test_repeated_keys_delta_keeps_the_latest_value_additive_sums():
    B, H, Dk, Dv = 2, 3, 4, 5
    basis = orthonormal_keys(B, H, 3, Dk, seed=2)  # k1, k2, k3
    order = [0, 1, 0, 2, 0]  # k1 comes back twice with new values
    k = basis[:, :, order]
    v = torch.randn(B, H, len(order), Dv, dtype=D64)
    ones = torch.ones(B, H, len(order), dtype=D64)
    _, st = delta_rule_attention(k, k, v, ones, chunk_size=2, return_state=True)
    _, st_add = linear_attention(k, k, v, normalize=False, return_state=True)
    recall, recall_add = basis @ st.S, basis @ st_add.S  # (B, H, 3, Dv)
    latest = v[:, :, [4, 1, 3]]
    assert (recall - latest).abs().max() < 1e-12
    summed = torch.stack([v[:, :, 0] + v[:, :, 2] + v[:, :, 4], v[:, :, 1], v[:, :, 3]], dim=2)
    assert (recall_add - summed).abs().max() < 1e-12
    assert (recall_add[:, :, 0] - latest[:, :, 0]).abs().max() > 0.5  # the two memories differ


def test_state_stays_bounded_for_beta_up_to_two():
    """Unit keys, beta in (0, 2] (a quarter exactly 2): every transition is non-expansive and the
    state's norm stays of the order of the values' over 512 tokens; with beta = 2.5 the same
    recurrence (run by the test's own loop, the library refuses it) explodes."""
    B, H, T, Dk, Dv = 1, 2, 512, 8, 4
    q, k, v, beta, _ = inputs(B, H, T, Dk, Dv, seed=8)
    beta.view(-1)[::4] = 2.0
    _, st = delta_rule_attention(q, k, v, beta, return_state=True)
    state = None
    norms = []
    for t in range(T):
        _, state = delta_rule_decode_step(q[:, :, t], k[:, :, t], v[:, :, t], beta[:, :, t], state)
        norms.append(torch.linalg.matrix_norm(state.S).max().item())
    vmax = v.norm(dim=-1).max().item()
    assert max(norms) < 3 * Dk**0.5 * vmax
    assert rel_rms(state.S, st.S) < TOL
    _, S_bad = naive_gated_delta(q, k, v, torch.full_like(beta, 2.5))
    assert torch.linalg.matrix_norm(S_bad).max() > 1e6 * max(norms)
    with pytest.raises(ValueError, match=r"`beta` must be <= 2"):
        delta_rule_attention(q, k, v, torch.full_like(beta, 2.5))


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
@pytest.mark.parametrize("decay", [None, "head", "token"])
def test_beta_zero_writes_nothing(form, decay):
    """beta = 0 is accepted (fp16's sigmoid is exactly 0 below -18) and is a no-op write: the
    token's key and value then change no output and no state, and with beta = 0 everywhere the
    state only decays. The same for the decode step."""
    B, H, T, Dk, Dv = 2, 3, 11, 4, 5
    q, k, v, beta, g = inputs(B, H, T, Dk, Dv, decay=decay, seed=21)
    S0 = torch.randn(B, H, Dk, Dv, dtype=D64)
    silent = torch.zeros(T, dtype=torch.bool)
    silent[[0, 4, 5, 10]] = True
    beta[:, :, silent] = 0.0
    kw = dict(log_decay=g, form=form, chunk_size=4, initial_state=S0, return_state=True)
    o, st = delta_rule_attention(q, k, v, beta, **kw)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, silent] = F.normalize(torch.randn_like(k2[:, :, silent]), dim=-1)
    v2[:, :, silent] = 100.0 * torch.randn_like(v2[:, :, silent])
    o2, st2 = delta_rule_attention(q, k2, v2, beta, **kw)
    assert (o - o2).abs().max() < 1e-12 and (st.S - st2.S).abs().max() < 1e-12
    _, st0 = delta_rule_attention(q, k, v, torch.zeros_like(beta), **kw)
    total = torch.zeros(B, H, dtype=D64) if g is None else (T * g if decay == "head" else g.sum(-1))
    total = total.expand(B, H)
    assert (st0.S - total.exp()[..., None, None] * S0).abs().max() < 1e-12
    state = LinearAttentionState(S0, None)
    for t in range(T):
        g_t = None if g is None else (g if decay == "head" else g[:, :, t])
        o_t, state = delta_rule_decode_step(q[:, :, t], k2[:, :, t], v2[:, :, t], beta[:, :, t], state,
                                            log_decay=g_t)
        assert (o_t - o[:, :, t]).abs().max() < 1e-12
    assert (state.S - st.S).abs().max() < 1e-12


@pytest.mark.parametrize("decay", [None, "head", "token"])
def test_decode_step_equals_recurrent(decay):
    B, H, T, Dk, Dv = 2, 3, 12, 4, 5
    q, k, v, beta, g = inputs(B, H, T, Dk, Dv, decay=decay, seed=10)
    S0 = torch.randn(B, H, Dk, Dv, dtype=D64)
    o_ref, st_ref = delta_rule_attention(q, k, v, beta, log_decay=g, form="recurrent", initial_state=S0,
                                         return_state=True)
    state = LinearAttentionState(S0, None)
    for t in range(T):
        g_t = None if g is None else (g if decay == "head" else g[:, :, t])
        o_t, state = delta_rule_decode_step(q[:, :, t], k[:, :, t], v[:, :, t], beta[:, :, t], state, log_decay=g_t)
        assert o_t.shape == (B, H, Dv) and state.z is None
        assert (o_t - o_ref[:, :, t]).abs().max() < 1e-12
    assert (state.S - st_ref.S).abs().max() < 1e-12


# --- refused arguments ---------------------------------------------------------------------

B0, H0, T0, DK0, DV0 = 2, 3, 7, 4, 5


def _call(**changes):
    q, k, v, beta, _ = inputs(B0, H0, T0, DK0, DV0, seed=12)
    args = dict(q=q, k=k, v=v, beta=beta)
    args.update({n: changes.pop(n) for n in list(changes) if n in args})
    return delta_rule_attention(args["q"], args["k"], args["v"], args["beta"], **changes)


BAD = [
    (dict(beta=torch.ones(B0, H0, dtype=D64)), r"`beta`.*\(2, 3\)"),
    (dict(beta=torch.ones(B0, H0, T0 + 1, dtype=D64)), r"`beta` has shape \(2, 3, 8\).*T=7"),
    (dict(beta=-torch.ones(B0, H0, T0, dtype=D64)), r"`beta` must be >= 0"),
    (dict(beta=torch.full((B0, H0, T0), -1e-9, dtype=D64)), r"`beta` must be >= 0"),
    (dict(beta=torch.full((B0, H0, T0), 2.0 + 1e-9, dtype=D64)), r"`beta` must be <= 2"),
    (dict(beta=torch.full((B0, H0, T0), float("nan"), dtype=D64)), r"`beta` contains NaN"),
    (dict(k=torch.ones(B0, H0, T0, DK0, dtype=D64), check_unit_keys=True), r"check_unit_keys.*`k`.*norm 2"),
    (dict(form="wy"), r"form='wy'.*`form`"),
    (dict(chunk_size=0), r"`chunk_size`"),
    (dict(chunk_size=-4), r"`chunk_size`"),
    (dict(chunk_size=2.0), r"`chunk_size`"),
    (dict(log_decay=torch.full((H0,), 0.1, dtype=D64)), r"`log_decay` must be <= 0"),
    (dict(log_decay=torch.zeros(B0, H0, dtype=D64)), r"`log_decay` has shape \(2, 3\)"),
    (dict(log_decay=torch.zeros(H0 + 1, dtype=D64)), r"`log_decay` has shape \(4,\)"),
    (dict(initial_state=torch.zeros(B0, H0, DV0, DK0, dtype=D64)), r"`initial_state.S` has shape"),
    (dict(initial_state=LinearAttentionState(torch.zeros(B0, H0, DK0, DV0, dtype=D64),
                                             torch.zeros(B0, H0, DK0, dtype=D64))), r"`initial_state.z` must be None"),
]


@pytest.mark.parametrize("changes, match", BAD, ids=[m for _, m in BAD])
def test_bad_arguments_are_refused_by_name(changes, match):
    with pytest.raises(ValueError, match=match):
        _call(**changes)


def test_unit_key_check_names_the_worst_key_and_is_opt_in():
    _, k, _, _, _ = inputs(B0, H0, T0, DK0, DV0, seed=12)
    k = k.clone()
    k[1, 2, 5] *= 1.01
    k[0, 1, 3] *= 1.001
    with pytest.raises(ValueError, match=r"norm 1\.01 at index \(1, 2, 5\)"):
        _call(k=k, check_unit_keys=True)
    assert torch.isfinite(_call(k=k)).all()  # without the flag the caller's keys are taken as they are
    _call(check_unit_keys=True)  # normalised keys pass


def test_beta_of_another_dtype_is_refused():
    with pytest.raises(TypeError, match=r"`beta` has dtype torch.float32"):
        _call(beta=torch.ones(B0, H0, T0, dtype=torch.float32))


def test_decode_step_refuses_bad_arguments():
    q, k, v, beta, _ = inputs(B0, H0, 1, DK0, DV0, seed=13)
    q, k, v, beta = q[:, :, 0], k[:, :, 0], v[:, :, 0], beta[:, :, 0]
    S = torch.zeros(B0, H0, DK0, DV0, dtype=D64)
    with pytest.raises(ValueError, match=r"`beta`"):
        delta_rule_decode_step(q, k, v, beta[:, :1], S)
    with pytest.raises(ValueError, match=r"`beta` must be <= 2"):
        delta_rule_decode_step(q, k, v, beta + 2.0, S)
    with pytest.raises(ValueError, match=r"`log_decay` has shape"):
        delta_rule_decode_step(q, k, v, beta, S, log_decay=torch.zeros(B0, H0, 1, dtype=D64))
    with pytest.raises(ValueError, match=r"`log_decay` must be <= 0"):
        delta_rule_decode_step(q, k, v, beta, S, log_decay=torch.ones(H0, dtype=D64))
    with pytest.raises(ValueError, match=r"`state.S` has shape"):
        delta_rule_decode_step(q, k, v, beta, S[..., :2])
    with pytest.raises(ValueError, match=r"`k` has shape"):
        delta_rule_decode_step(q, k[..., :2], v, beta, S)


# --- packed sequences (cu_seqlens) ---------------------------------------------------------


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
@pytest.mark.parametrize("decay", [None, "head", "token"])
def test_packed_sequences_equal_separate_runs(form, decay):
    """cu_seqlens: each packed sequence equals its own call (outputs, per-sequence final states
    and gradients), from its own initial state; a sequence of length 0 passes its state on."""
    lengths = [5, 0, 9, 1]
    H, Dk, Dv, T = 2, 4, 3, sum(lengths)
    q, k, v, beta, g = inputs(1, H, T, Dk, Dv, decay=decay, seed=31)
    S0 = torch.randn(len(lengths), H, Dk, Dv, dtype=D64)
    leaves = [x.requires_grad_() for x in (q, k, v, beta, S0)]
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)))
    o, st = delta_rule_attention(q, k, v, beta, log_decay=g, form=form, chunk_size=4, initial_state=S0,
                                 return_state=True, cu_seqlens=cu)
    outs, states = [], []
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if s == e:
            states.append(S0[i:i + 1])
            continue
        g_i = None if g is None else (g if decay == "head" else g[:, :, s:e])
        o_i, st_i = delta_rule_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], beta[:, :, s:e], log_decay=g_i,
                                         form=form, chunk_size=4, initial_state=S0[i:i + 1], return_state=True)
        outs.append(o_i)
        states.append(st_i.S)
    o_ref, S_ref = torch.cat(outs, dim=2), torch.cat(states)
    assert (o - o_ref).abs().max() < 1e-12 and (st.S - S_ref).abs().max() < 1e-12
    w = torch.randn_like(o)
    grads = torch.autograd.grad((o * w).sum() + st.S.sum(), leaves)
    grads_ref = torch.autograd.grad((o_ref * w).sum() + S_ref.sum(), leaves)
    assert all((a - b).abs().max() < 1e-12 for a, b in zip(grads, grads_ref))


def test_packed_sequences_are_checked():
    q, k, v, beta, _ = inputs(2, 2, 6, 4, 3, seed=32)
    with pytest.raises(ValueError, match=r"delta_rule_attention: with `cu_seqlens`.*B must be 1"):
        delta_rule_attention(q, k, v, beta, cu_seqlens=torch.tensor([0, 6]))
    with pytest.raises(ValueError, match=r"delta_rule_attention: `cu_seqlens` must end at"):
        delta_rule_attention(q[:1], k[:1], v[:1], beta[:1], cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"delta_rule_attention: `initial_state\.S` has shape \(1, 2, 4, 3\).*\(2, 2, 4, 3\)"):
        delta_rule_attention(q[:1], k[:1], v[:1], beta[:1], cu_seqlens=torch.tensor([0, 2, 6]),
                             initial_state=torch.zeros(1, 2, 4, 3, dtype=D64))


@pytest.mark.parametrize("form", ["chunked", "recurrent", "quadratic"])
def test_delta_rule_keeps_its_sums_in_float32_under_autocast(form):
    """torch.autocast would run the torch path's matmuls in bf16 (errors of 2e-2 against
    7e-7): the docstring's float32 sums must hold inside an autocast region too."""
    gen = torch.Generator().manual_seed(0)
    q, k = (F.normalize(torch.randn(1, 2, 40, 8, generator=gen), dim=-1) for _ in range(2))
    v, beta = torch.randn(1, 2, 40, 8, generator=gen), torch.rand(1, 2, 40, generator=gen)
    plain = delta_rule_attention(q, k, v, beta, form=form, chunk_size=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = delta_rule_attention(q, k, v, beta, form=form, chunk_size=16)
    assert inside.dtype == torch.float32 and torch.equal(inside, plain)
