"""GLA's chunkwise form with secondary chunking (`core/gla.py`) against `gla_attention` and a
token loop: awkward shapes, carried state, strong gates where the naive factorisation
overflows, a reset, gradients and bad arguments. float64 throughout, so agreement is ~1e-13."""

import pytest
import torch
import torch.nn.functional as F

from linattn_lib import LinearAttentionState
from linattn_lib.core.gla import gla_chunkwise
from linattn_lib.core.ssm import gla_attention

D64 = torch.float64
TOL = 1e-12


def maxdiff(a, b):
    return (a - b).abs().max().item()


def inputs(B=2, H=3, T=37, Dk=5, Dv=4, *, seed=0, dtype=D64):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, T, Dk, generator=gen, dtype=D64) for _ in range(2))
    v = torch.randn(B, H, T, Dv, generator=gen, dtype=D64)
    g = F.logsigmoid(torch.randn(B, H, T, Dk, generator=gen, dtype=D64) + 1)  # log-gates < 0
    S0 = torch.randn(B, H, Dk, Dv, generator=gen, dtype=D64)
    return tuple(x.to(dtype) for x in (q, k, v, g, S0))


def token_loop(q, k, v, g, S):
    """S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t, one token at a time."""
    outs = []
    for t in range(q.shape[2]):
        S = torch.exp(g[:, :, t, :, None]) * S + torch.einsum("bhd,bhe->bhde", k[:, :, t], v[:, :, t])
        outs.append(torch.einsum("bhd,bhde->bhe", q[:, :, t], S))
    return torch.stack(outs, dim=2), S


def naive_factorised(q, k, v, g):
    """One chunk with the decay split as exp(b_i) exp(-b_j): exact algebra, overflowing arithmetic."""
    b = torch.cumsum(g, dim=-2)
    P = torch.tril((q * torch.exp(b)) @ (k * torch.exp(-b)).transpose(-1, -2))
    return P @ v


SHAPES = [  # B, H, T, Dk, Dv, chunk_size, sub_chunk
    (1, 1, 1, 3, 2, 64, 16),
    (2, 3, 37, 5, 4, 64, 16),
    (2, 2, 130, 4, 6, 64, 16),
    (1, 2, 130, 3, 5, 16, 4),
    (2, 1, 37, 4, 3, 8, 1),
    (1, 2, 50, 6, 2, 12, 12),
    (1, 1, 130, 2, 3, 32, 8),
]


@pytest.mark.parametrize("B, H, T, Dk, Dv, C, c", SHAPES)
def test_matches_gla_attention_and_token_loop(B, H, T, Dk, Dv, C, c):
    q, k, v, g, S0 = inputs(B, H, T, Dk, Dv)
    o = gla_chunkwise(q, k, v, g, chunk_size=C, sub_chunk=c)
    loop, _ = token_loop(q, k, v, g, torch.zeros_like(S0))
    assert o.shape == (B, H, T, Dv) and o.dtype == D64
    assert maxdiff(o, gla_attention(q, k, v, g)) < TOL
    assert maxdiff(o, gla_attention(q, k, v, g, form="recurrent")) < TOL
    assert maxdiff(o, loop) < TOL


@pytest.mark.parametrize("B, H, T, Dk, Dv, C, c", SHAPES[1:4])
def test_initial_state_and_return_state(B, H, T, Dk, Dv, C, c):
    q, k, v, g, S0 = inputs(B, H, T, Dk, Dv, seed=1)
    state = LinearAttentionState(S0, None)
    o, final = gla_chunkwise(q, k, v, g, chunk_size=C, sub_chunk=c, initial_state=state, return_state=True)
    ref, ref_final = gla_attention(q, k, v, g, initial_state=state, return_state=True)
    loop, loop_S = token_loop(q, k, v, g, S0)
    assert isinstance(final, LinearAttentionState) and final.z is None
    assert maxdiff(o, ref) < TOL and maxdiff(o, loop) < TOL
    assert maxdiff(final.S, ref_final.S) < TOL and maxdiff(final.S, loop_S) < TOL
    # carrying the state across a split (mid-chunk) gives the same as one call
    s = T // 3
    o1, mid = gla_chunkwise(q[:, :, :s], k[:, :, :s], v[:, :, :s], g[:, :, :s], chunk_size=C,
                            sub_chunk=c, initial_state=state, return_state=True)
    o2, end = gla_chunkwise(q[:, :, s:], k[:, :, s:], v[:, :, s:], g[:, :, s:], chunk_size=C,
                            sub_chunk=c, initial_state=mid, return_state=True)
    assert maxdiff(torch.cat([o1, o2], dim=2), o) < TOL and maxdiff(end.S, final.S) < TOL


def test_strong_gates_naive_overflows_secondary_chunking_exact():
    q, k, v, _, _ = inputs(1, 2, 130, 4, 3, seed=2)
    g = torch.full_like(q, -30.0)  # b_j = -30 (j + 1): exp(-b_j) passes exp(709) at j = 23
    with torch.no_grad():
        naive = naive_factorised(q[:, :, :64], k[:, :, :64], v[:, :, :64], g[:, :, :64])
    assert not torch.isfinite(naive).all()  # inf, and inf * 0 = NaN
    loop, _ = token_loop(q, k, v, g, q.new_zeros(1, 2, 4, 3))
    for C, c in ((64, 16), (64, 64), (16, 1)):
        o = gla_chunkwise(q, k, v, g, chunk_size=C, sub_chunk=c)
        assert torch.isfinite(o).all() and maxdiff(o, loop) < TOL
    # float32: the naive form fails after three tokens, the chunkwise form stays accurate
    q32, k32, v32, g32 = (x.float() for x in (q, k, v, g))
    assert not torch.isfinite(naive_factorised(q32[:, :, :16], k32[:, :, :16], v32[:, :, :16], g32[:, :, :16])).all()
    o32 = gla_chunkwise(q32, k32, v32, g32)
    assert o32.dtype == torch.float32 and torch.isfinite(o32).all()
    assert maxdiff(o32.double(), loop) < 1e-4 * loop.abs().max().item()


@pytest.mark.parametrize("at", [0, 15, 16, 40, 64, 129])
def test_reset_forgets_everything_before_it(at):
    q, k, v, g, S0 = inputs(2, 2, 130, 4, 3, seed=3)
    g = g.clone()
    g[:, :, at] = -1e4  # exp(-1e4) = 0: the state is wiped at token `at`
    state = LinearAttentionState(S0, None)
    o = gla_chunkwise(q, k, v, g, initial_state=state)
    loop, _ = token_loop(q, k, v, g, S0)
    assert torch.isfinite(o).all() and maxdiff(o, loop) < TOL
    # different keys, values and state before the reset change nothing from `at` on
    k2, v2 = k.clone(), v.clone()
    k2[:, :, :at] += 1.0
    v2[:, :, :at] -= 2.0
    o2 = gla_chunkwise(q, k2, v2, g, initial_state=LinearAttentionState(2 * S0, None))
    assert maxdiff(o2[:, :, at:], o[:, :, at:]) < TOL


def test_gradients_match_gla_attention():
    q, k, v, g, S0 = inputs(2, 2, 45, 4, 3, seed=4)
    g = g.clone()
    g[:, :, 20] = -1e4
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, S0)]
    w = torch.randn(2, 2, 45, 3, generator=torch.Generator().manual_seed(5), dtype=D64)

    def grads(fn, **kw):
        qq, kk, vv, gg, SS = leaves
        o, st = fn(qq, kk, vv, gg, initial_state=LinearAttentionState(SS, None), return_state=True, **kw)
        loss = (o * w).sum() + st.S.square().sum()
        return torch.autograd.grad(loss, leaves)

    for got, want in zip(grads(gla_chunkwise, chunk_size=16, sub_chunk=4), grads(gla_attention), strict=True):
        assert torch.isfinite(got).all() and maxdiff(got, want) < 1e-10


def test_gradcheck_small():
    q, k, v, g, _ = inputs(1, 1, 7, 2, 2, seed=6)
    args = [x.clone().requires_grad_() for x in (q, k, v, g)]
    assert torch.autograd.gradcheck(lambda *a: gla_chunkwise(*a, chunk_size=4, sub_chunk=2), args)


@pytest.mark.parametrize("kwargs, name", [
    ({"chunk_size": 64, "sub_chunk": 12}, "sub_chunk"),
    ({"chunk_size": 8, "sub_chunk": 16}, "sub_chunk"),
    ({"chunk_size": 0}, "chunk_size"),
    ({"chunk_size": -64}, "chunk_size"),
    ({"chunk_size": 2.0}, "chunk_size"),
    ({"chunk_size": True}, "chunk_size"),
    ({"sub_chunk": 0}, "sub_chunk"),
    ({"sub_chunk": -4}, "sub_chunk"),
])
def test_bad_sizes_raise_naming_the_argument(kwargs, name):
    q, k, v, g, _ = inputs(1, 1, 10, 2, 2)
    with pytest.raises(ValueError, match=f"`{name}`"):
        gla_chunkwise(q, k, v, g, **kwargs)


def test_bad_inputs_raise():
    q, k, v, g, S0 = inputs(1, 2, 10, 3, 2)
    with pytest.raises(ValueError, match="`g`"):
        gla_chunkwise(q, k, v, -g)  # gates above 1
    with pytest.raises(ValueError, match="`g`"):
        gla_chunkwise(q, k, v, g[..., :2])
    with pytest.raises(TypeError, match="`g`"):
        gla_chunkwise(q, k, v, g.float())
    with pytest.raises(ValueError, match="`v`"):
        gla_chunkwise(q, k, v[:, :, :5], g)
    with pytest.raises(TypeError, match="`return_state`"):
        gla_chunkwise(q, k, v, g, return_state=1)
    with pytest.raises(ValueError, match="initial_state"):
        gla_chunkwise(q, k, v, g, initial_state=LinearAttentionState(S0, S0[..., 0]))
    with pytest.raises(ValueError, match="initial_state"):
        gla_chunkwise(q, k, v, g, initial_state=LinearAttentionState(S0[..., :1], None))
