"""The three forms of linear attention agree; softmax matches torch's SDPA; states resume exactly."""
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from linattn_lib import linear_attention, softmax_attention
from linattn_lib.core.masks import decay_mask, segsum
from linattn_lib.core.reference import reference_linear_attention

D64 = torch.float64


CASES = [
    (T, causal, normalize, dk)
    for T, causal, normalize, dk in itertools.product([1, 7, 64, 65, 200], [True, False], [True, False], [None, "head", "token"])
    if causal or dk is None
]


@pytest.mark.parametrize("T,causal,normalize,dk", CASES)
def test_three_forms_agree_float64(T, causal, normalize, dk, make_qkv, make_log_decay):
    B, H = 2, 3
    q, k, v = make_qkv(B, H, T, 5, 4)
    ld = make_log_decay(dk, B, H, T, strength=3.0)
    ref = reference_linear_attention(q, k, v, causal=causal, normalize=normalize, log_decay=ld, form="quadratic")
    for form in ("recurrent", "chunked"):
        for chunk in (16, 64):
            out = reference_linear_attention(
                q, k, v, causal=causal, normalize=normalize, log_decay=ld, form=form, chunk_size=chunk
            )
            assert (out - ref).abs().max() < 1e-10, (form, chunk)
        out = linear_attention(q, k, v, causal=causal, normalize=normalize, log_decay=ld, form=form, chunk_size=16)
        assert (out - ref).abs().max() < 1e-10


def test_matches_explicit_formula(make_qkv, make_log_decay):
    B, H, T = 1, 2, 9
    q, k, v = make_qkv(B, H, T, 3, 2)
    ld = make_log_decay("token", B, H, T)
    A = (q @ k.transpose(-1, -2)) * decay_mask(ld)
    expect = (A @ v) / (A.sum(-1, keepdim=True) + 1e-6)
    out = linear_attention(q, k, v, log_decay=ld, form="quadratic")
    assert torch.allclose(out, expect, atol=1e-12)
    # segsum is the sum over (j, i]: check one entry by hand
    s = segsum(ld)
    assert torch.allclose(s[0, 1, 5, 2], ld[0, 1, 3:6].sum())
    assert torch.isinf(s[0, 1, 2, 5])


@pytest.mark.parametrize("form", ["quadratic", "recurrent", "chunked"])
@pytest.mark.parametrize("normalize", [True, False])
def test_piecewise_with_state_resume_equals_one_pass(form, normalize, make_qkv, make_log_decay):
    B, H, T = 2, 2, 50
    q, k, v = make_qkv(B, H, T, 4, 3, seed=3)
    ld = make_log_decay("token", B, H, T, strength=0.5)
    full, full_state = linear_attention(q, k, v, normalize=normalize, log_decay=ld, form=form, chunk_size=8, return_state=True)
    state, pieces = None, []
    for a, b in [(0, 13), (13, 14), (14, 40), (40, 50)]:
        o, state = linear_attention(
            q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], normalize=normalize, log_decay=ld[:, :, a:b],
            form=form, chunk_size=8, initial_state=state, return_state=True,
        )
        pieces.append(o)
    assert (torch.cat(pieces, dim=2) - full).abs().max() < 1e-10
    assert (state.S - full_state.S).abs().max() < 1e-10
    if normalize:
        assert (state.z - full_state.z).abs().max() < 1e-10
    else:
        assert state.z is None


def test_noncausal_state_is_the_sum_of_outer_products(make_qkv):
    q, k, v = make_qkv(1, 1, 10, 3, 2)
    _, st = linear_attention(q, k, v, causal=False, return_state=True)
    assert torch.allclose(st.S[0, 0], k[0, 0].T @ v[0, 0])
    assert torch.allclose(st.z[0, 0], k[0, 0].sum(0))


@pytest.mark.parametrize("form", ["quadratic", "recurrent", "chunked"])
def test_noncausal_initial_state_is_seen_by_every_query(form, make_qkv):
    """The docstring's causal=False semantics: o = q (S0 + K^T V) / (q . (z0 + sum k) + eps),
    and the returned state is S0 + K^T V, z0 + sum k."""
    from linattn_lib import LinearAttentionState
    from linattn_lib.core.state import DEFAULT_EPS

    q, k, v = make_qkv(1, 1, 10, 3, 2)
    S0, z0 = torch.rand(1, 1, 3, 2, dtype=q.dtype), torch.rand(1, 1, 3, dtype=q.dtype)
    o, st = linear_attention(q, k, v, causal=False, form=form, initial_state=LinearAttentionState(S0, z0),
                             return_state=True)
    S, z = S0 + k.transpose(-1, -2) @ v, z0 + k.sum(2)
    want = (q @ S) / ((q * z[:, :, None]).sum(-1, keepdim=True) + DEFAULT_EPS)
    assert (o - want).abs().max() < 1e-12
    assert (st.S - S).abs().max() < 1e-12 and (st.z - z).abs().max() < 1e-12


def test_strong_decay_stays_finite(make_qkv):
    q, k, v = make_qkv(1, 2, 300, 4, 4)
    ld = torch.full((2,), -50.0, dtype=D64)  # exp(-50 * 300) would underflow if computed as a ratio
    outs = [linear_attention(q, k, v, log_decay=ld, form=f, normalize=False, chunk_size=64) for f in ("quadratic", "recurrent", "chunked")]
    for o in outs:
        assert torch.isfinite(o).all()
    assert (outs[0] - outs[2]).abs().max() < 1e-10
    # with such a decay each output is just its own token: (q_i . k_i) v_i
    own = (q * k).sum(-1, keepdim=True) * v
    assert (outs[0] - own).abs().max() < 1e-10


def test_gradcheck_chunked_with_decay(make_qkv, make_log_decay):
    q, k, v = make_qkv(1, 2, 11, 3, 2, seed=5)
    ld = make_log_decay("token", 1, 2, 11, seed=6)
    args = [t.clone().requires_grad_() for t in (q, k, v, ld)]
    f = lambda q, k, v, g: reference_linear_attention(q, k, v, log_decay=g, form="chunked", chunk_size=4)
    assert torch.autograd.gradcheck(f, args)


@pytest.mark.parametrize("causal", [True, False])
def test_softmax_matches_sdpa(causal):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 17, 8, generator=g) for _ in range(3))
    ours = softmax_attention(q, k, v, causal=causal)
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert torch.allclose(ours, theirs, atol=1e-5)
    assert torch.allclose(softmax_attention(q, k, v, scale=0.3), F.scaled_dot_product_attention(q, k, v, scale=0.3), atol=1e-5)


def test_softmax_is_safe_for_large_logits():
    """Scores of order 1e4 in float32: a naive exp overflows to inf/nan; the safe softmax gives
    the float64 answer, which here is (nearly) a one-hot pick of each row's best key."""
    q = torch.full((1, 1, 4, 2), 100.0)
    v = torch.arange(8.0).view(1, 1, 4, 2)
    out = softmax_attention(q, q, v)  # equal scores: the plain average of the values
    assert torch.allclose(out, v.mean(2, keepdim=True).expand_as(v), atol=1e-6)
    out = softmax_attention(q, q, v, causal=True)  # causal: the average of the values so far
    assert torch.allclose(out, v.cumsum(2) / torch.arange(1, 5.0).view(1, 1, 4, 1), atol=1e-5)
    g = torch.Generator().manual_seed(4)
    q, k = (100 * torch.randn(2, 3, 12, 8, generator=g, dtype=D64) for _ in range(2))
    v = torch.randn(2, 3, 12, 5, generator=g, dtype=D64)
    for causal in (False, True):
        s = (q @ k.transpose(-1, -2)) / math.sqrt(8)
        if causal:
            s = s.masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), -math.inf)
        w = (s - s.amax(-1, keepdim=True)).exp()
        want = (w / w.sum(-1, keepdim=True)) @ v
        got = softmax_attention(q.float(), k.float(), v.float(), causal=causal)
        assert torch.isfinite(got).all()
        assert (got.double() - want).abs().max() < 1e-4, causal
        # one best key per row: the output is (nearly) that key's value
        best = s.argmax(-1, keepdim=True).expand(-1, -1, -1, 5)
        picked = (w.max(-1).values > 0.999 * w.sum(-1)).unsqueeze(-1).expand_as(want)
        assert picked.float().mean() > 0.5
        assert torch.allclose(got.double()[picked], v.gather(2, best)[picked], atol=1e-2)


def test_dtype_is_preserved(make_qkv, make_log_decay):
    """float16 in, float16 out; float32 in, float32 out; each equal to the float64 result to the
    precision of its dtype."""
    q, k, v = make_qkv(1, 2, 70, 4, 4)  # T = 70 > one chunk of 64
    ld = make_log_decay("token", 1, 2, 70, strength=0.3)
    for normalize in (True, False):
        want = reference_linear_attention(q, k, v, normalize=normalize, log_decay=ld, form="quadratic")
        for form in ("quadratic", "recurrent", "chunked"):
            for dtype, tol in ((torch.float16, 3e-3), (torch.float32, 1e-6)):
                out = linear_attention(q.to(dtype), k.to(dtype), v.to(dtype), normalize=normalize, log_decay=ld.to(dtype), form=form)
                assert out.dtype == dtype, (form, dtype)
                err = ((out.double() - want).norm() / want.norm()).item()
                assert err < tol, (form, dtype, normalize, err)
