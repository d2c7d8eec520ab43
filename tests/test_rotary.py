"""Rotary position embedding (RoPE) and RoFormer's linear attention with it (eq. 19 of Su et al.).

Every claim is checked in float64 against an independent computation: the rotation against
explicit 2x2 rotation matrices, the attention against its formula written as loops, the
linear-time forms against the quadratic matrix. Each check also asserts that the quantity
it compares is not trivially equal (rotated differs from unrotated), so that it can fail.
"""
import itertools
import math

import pytest
import torch

from linattn_lib import linear_attention
from linattn_lib.core.reference import FORMS
from linattn_lib.core.rotary import (
    rotary_angles,
    rotary_embedding,
    rotary_linear_attention,
    rotary_linear_attention_matrix,
)

D64 = torch.float64
TOL = 1e-10


def maxdiff(a, b):
    return (a - b).abs().max().item()


def rotation_matrix(p: float, D: int, base: float) -> torch.Tensor:
    """The paper's block-diagonal R_{Theta,p} (eq. 15), one explicit 2x2 block per pair."""
    R = torch.zeros(D, D, dtype=D64)
    for i in range(D // 2):
        a = p * base ** (-2 * i / D)
        c, s = math.cos(a), math.sin(a)
        R[2 * i, 2 * i], R[2 * i, 2 * i + 1] = c, -s
        R[2 * i + 1, 2 * i], R[2 * i + 1, 2 * i + 1] = s, c
    return R


def rotate_by_matrices(x: torch.Tensor, positions, base: float) -> torch.Tensor:
    """R_{p_t} x_t for every token, one matrix-vector product at a time."""
    D = x.shape[-1]
    out = torch.empty_like(x)
    for t, p in enumerate(positions):
        out[..., t, :] = x[..., t, :] @ rotation_matrix(float(p), D, base).T
    return out


def random_positions(T: int, seed: int = 3) -> torch.Tensor:
    """Unsorted float positions with repeats and negatives."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(T, generator=g, dtype=D64) * 20
    if T > 2:
        p[1] = p[0]
    return p


# ------------------------------------------------------------------ the rotation


def test_rotary_embedding_preserves_norms(make_qkv):
    x, _, _ = make_qkv(2, 3, 17, 8, 1, features="normal")
    for positions in (None, random_positions(17)):
        y = rotary_embedding(x, positions=positions)
        assert maxdiff(y.norm(dim=-1), x.norm(dim=-1)) < 1e-12
        pairs = lambda z: z.unflatten(-1, (4, 2)).norm(dim=-1)  # each pair keeps its own length
        assert maxdiff(pairs(y), pairs(x)) < 1e-12
        assert maxdiff(y, x) > 0.1  # and it did rotate


@pytest.mark.parametrize("base", [10000.0, 100.0, 2.5])
@pytest.mark.parametrize("kind", ["none", "int", "float"])
def test_rotary_embedding_equals_rotation_matrices(kind, base, make_qkv):
    T, D = 9, 6
    x, _, _ = make_qkv(2, 2, T, D, 1, features="normal")
    positions = {"none": None, "int": torch.tensor([4, -2, 0, 7, 7, 100, 3, 1, 2]),
                 "float": random_positions(T)}[kind]
    listed = range(T) if positions is None else positions.tolist()
    y = rotary_embedding(x, positions=positions, base=base)
    assert maxdiff(y, rotate_by_matrices(x, listed, base)) < 1e-12


def test_positions_none_is_arange(make_qkv):
    x, _, _ = make_qkv(1, 2, 11, 4, 1, features="normal")
    y = rotary_embedding(x)
    assert torch.equal(y, rotary_embedding(x, positions=torch.arange(11)))
    assert torch.equal(y, rotary_embedding(x, positions=torch.arange(11, dtype=D64)))
    assert torch.equal(y[..., 0, :], x[..., 0, :])  # position 0 is not rotated
    assert maxdiff(y, rotary_embedding(x, positions=torch.arange(1, 12))) > 0.1


def test_rotary_angles_table():
    T, D, base = 7, 6, 500.0
    table = rotary_angles(T, D, base=base)
    assert table.shape == (T, D // 2) and table.dtype == D64
    for t, i in itertools.product(range(T), range(D // 2)):
        assert abs(table[t, i].item() - t * base ** (-2 * i / D)) < 1e-14
    p = random_positions(T)
    assert maxdiff(rotary_angles(p, D, base=base), p[:, None] * base ** (-torch.arange(0, D, 2, dtype=D64) / D)) < 1e-14
    # the first pair turns at one radian per position whatever the base: a huge base does not
    # switch RoPE off, only positions that are all equal do
    assert torch.equal(rotary_angles(T, D, base=1e300)[:, 0], torch.arange(T, dtype=D64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rotary_embedding_keeps_the_dtype(dtype, make_qkv):
    x, _, _ = make_qkv(1, 2, 300, 8, 1, features="normal")
    ref = rotary_embedding(x)
    y = rotary_embedding(x.to(dtype))
    assert y.dtype == dtype
    tol = {torch.float32: 1e-6, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    assert maxdiff(y.double(), ref) < tol * x.abs().max().item()


# ------------------------------------------------------------------ relative positions


@pytest.mark.parametrize("shift", [37, 0.37, -123.25])
def test_scores_depend_on_offsets_only(shift, make_qkv):
    T = 20
    q, k, _ = make_qkv(2, 2, T, 8, 1, features="normal")
    for positions in (torch.arange(T, dtype=D64), random_positions(T)):
        scores = rotary_embedding(q, positions=positions) @ rotary_embedding(k, positions=positions).transpose(-1, -2)
        shifted = positions + shift
        again = rotary_embedding(q, positions=shifted) @ rotary_embedding(k, positions=shifted).transpose(-1, -2)
        assert maxdiff(again, scores) < 1e-12
        assert maxdiff(scores, q @ k.transpose(-1, -2)) > 0.1  # the rotation changed the scores


def test_score_is_query_against_key_rotated_by_the_offset(make_qkv):
    """(R_i q) . (R_j k) = q . (R_{p_j - p_i} k): row i equals q_i against k rotated to p - p_i."""
    T = 12
    q, k, _ = make_qkv(1, 2, T, 6, 1, features="normal")
    p = random_positions(T)
    scores = rotary_embedding(q, positions=p) @ rotary_embedding(k, positions=p).transpose(-1, -2)
    for i in range(T):
        row = (q[..., i : i + 1, :] * rotary_embedding(k, positions=p - p[i])).sum(-1)
        assert maxdiff(row, scores[..., i, :]) < 1e-12


# ------------------------------------------------------------------ RoFormer's linear attention (eq. 19)


def eq19_loops(q, k, v, positions, *, causal, eps=1e-6, base=10000.0):
    """o_i = sum_j (R_i q_i).(R_j k_j) v_j / (sum_j q_i.k_j + eps), as written, with explicit matrices."""
    B, H, T, D = q.shape
    R = [rotation_matrix(float(p), D, base) for p in positions]
    out = torch.zeros(B, H, T, v.shape[-1], dtype=D64)
    for b, h, i in itertools.product(range(B), range(H), range(T)):
        num, den = 0, 0
        for j in range(i + 1 if causal else T):
            num = num + (R[i] @ q[b, h, i]).dot(R[j] @ k[b, h, j]) * v[b, h, j]
            den = den + q[b, h, i].dot(k[b, h, j])
        out[b, h, i] = num / (den + eps)
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_matrix_matches_eq19_loops(causal, make_qkv):
    T = 6
    q, k, v = make_qkv(1, 2, T, 4, 3)
    p = random_positions(T)
    expect = eq19_loops(q, k, v, p.tolist(), causal=causal)
    A = rotary_linear_attention_matrix(q, k, causal=causal, positions=p)
    assert maxdiff(A @ v, expect) < TOL
    assert maxdiff(rotary_linear_attention(q, k, v, causal=causal, positions=p), expect) < TOL
    assert maxdiff(expect, linear_attention(q, k, v, causal=causal)) > 1e-3  # position did something
    if causal:
        assert torch.equal(A.triu(1), torch.zeros_like(A))


SHAPES = [(2, 3, 70, 6, 5), (1, 1, 1, 4, 3), (3, 2, 129, 8, 2)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("form", FORMS)
def test_forms_agree_with_the_matrix(form, causal, shape, make_qkv):
    B, H, T, Dk, Dv = shape
    q, k, v = make_qkv(B, H, T, Dk, Dv, seed=T)
    for positions in (None, random_positions(T)):
        kw = dict(causal=causal, positions=positions)
        out = rotary_linear_attention(q, k, v, form=form, **kw)
        assert out.shape == (B, H, T, Dv) and out.dtype == D64
        assert maxdiff(out, rotary_linear_attention_matrix(q, k, **kw) @ v) < TOL


@pytest.mark.parametrize("causal", [True, False])
def test_equal_positions_reduce_to_normalised_linear_attention(causal, make_qkv):
    T = 33
    q, k, v = make_qkv(2, 2, T, 6, 3)
    plain = linear_attention(q, k, v, causal=causal, normalize=True)
    for p in (torch.zeros(T, dtype=D64), torch.full((T,), 5.0, dtype=D64)):
        assert maxdiff(rotary_linear_attention(q, k, v, causal=causal, positions=p), plain) < 1e-12
        A = rotary_linear_attention_matrix(q, k, causal=causal, positions=p)
        assert maxdiff(A.sum(-1), torch.ones_like(A[..., 0])) < 1e-5  # rows sum to 1 - eps/(den+eps)
    assert torch.equal(rotary_embedding(q, positions=torch.zeros(T)), q)
    assert maxdiff(rotary_linear_attention(q, k, v, causal=causal), plain) > 1e-3


def test_the_output_ignores_a_shift_of_all_positions(make_qkv):
    T = 40
    q, k, v = make_qkv(2, 2, T, 8, 3)
    p = random_positions(T)
    for causal in (True, False):
        out = rotary_linear_attention(q, k, v, causal=causal, positions=p)
        assert maxdiff(rotary_linear_attention(q, k, v, causal=causal, positions=p + 37.5), out) < 1e-11
        assert maxdiff(rotary_linear_attention(q, k, v, causal=causal, positions=p * 2), out) > 1e-4


def test_a_rotated_denominator_can_vanish_the_unrotated_one_cannot():
    """Why eq. 19 keeps the denominator unrotated (the paper: "to avoid the risk of dividing zero").

    D = 2 and every token has the same positive feature a = (1, 0.3): the rotated score is
    |a|^2 cos(i - j) (theta_0 = 1), so the causal row sum sum_{j<=4} cos(4 - j) is negative,
    while the unrotated row sum (i + 1) |a|^2 is positive.
    """
    T = 5
    a = torch.tensor([1.0, 0.3], dtype=D64)
    q = k = a.expand(1, 1, T, 2).clone()
    v = torch.randn(1, 1, T, 3, generator=torch.Generator().manual_seed(0), dtype=D64)
    rq, rk = rotary_embedding(q), rotary_embedding(k)
    rotated_den = linear_attention(rq, rk, torch.ones(1, 1, T, 1, dtype=D64), causal=True, normalize=False)[..., 0]
    expect = a.dot(a) * torch.tensor([sum(math.cos(i - j) for j in range(i + 1)) for i in range(T)], dtype=D64)
    assert maxdiff(rotated_den[0, 0], expect) < 1e-12
    assert rotated_den[0, 0, 4].item() < -0.5  # a rotated normaliser would flip the sign of row 4
    unrotated_den = (q @ k.transpose(-1, -2)).tril().sum(-1)
    assert unrotated_den.min().item() > 1.0
    A = rotary_linear_attention_matrix(q, k, causal=True)
    assert A.min().item() < 0  # negative weights ...
    assert maxdiff(A.sum(-1) * (unrotated_den + 1e-6), rotated_den) < 1e-12  # ... rows not summing to one
    out = rotary_linear_attention(q, k, v, causal=True)
    assert torch.isfinite(out).all() and maxdiff(out, A @ v) < TOL


def test_unrotated_denominator_is_positive_for_positive_features(make_qkv):
    """For random positive features the rotated row sums go negative somewhere; eq. 19's never do."""
    q, k, v = make_qkv(4, 4, 64, 2, 1)  # D = 2: the only pair turns at one radian per token
    rq, rk = rotary_embedding(q), rotary_embedding(k)
    for causal in (True, False):
        mask = torch.ones(64, 64, dtype=torch.bool).tril() if causal else torch.ones(64, 64, dtype=torch.bool)
        rotated = torch.where(mask, rq @ rk.transpose(-1, -2), 0.0).sum(-1)
        unrotated = torch.where(mask, q @ k.transpose(-1, -2), 0.0).sum(-1)
        assert rotated.min().item() < 0 < unrotated[..., 1:].min().item()


def test_float32_is_close_to_float64(make_qkv):
    q, k, v = make_qkv(2, 2, 100, 8, 4)
    ref = rotary_linear_attention(q, k, v)
    out = rotary_linear_attention(q.float(), k.float(), v.float())
    assert out.dtype == torch.float32 and maxdiff(out.double(), ref) < 1e-5
    half = rotary_linear_attention(q.half(), k.half(), v.half(), form="recurrent")
    assert half.dtype == torch.float16 and maxdiff(half.double(), ref) < 5e-2


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_gradients(form, make_qkv):
    q, k, v = make_qkv(1, 2, 5, 4, 3)
    p = random_positions(5).requires_grad_(True)
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    f = lambda q, k, v, p: rotary_linear_attention(q, k, v, positions=p, form=form)
    assert torch.autograd.gradcheck(f, (q, k, v, p))


# ------------------------------------------------------------------ bad input


def _qkv(D=4, T=7):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.rand(1, 2, T, d, generator=g, dtype=D64) for d in (D, D, 3))


def _calls():
    """The three functions with RoPE arguments, each as a callable of (q, k, v, **kw)."""
    return {
        "rotary_embedding": lambda q, k, v, **kw: rotary_embedding(q, **kw),
        "rotary_linear_attention": lambda q, k, v, **kw: rotary_linear_attention(q, k, v, **kw),
        "rotary_linear_attention_matrix": lambda q, k, v, **kw: rotary_linear_attention_matrix(q, k, **kw),
    }


@pytest.mark.parametrize("fn", list(_calls()))
def test_odd_feature_size_is_refused(fn):
    q, k, v = _qkv(D=5)
    name = "x" if fn == "rotary_embedding" else "q"
    with pytest.raises(ValueError, match=rf"{fn}: `{name}` has last dimension D=5 .*expected an even D"):
        _calls()[fn](q, k, v)
    with pytest.raises(ValueError, match=r"rotary_angles: `dim` must be even"):
        rotary_angles(4, 5)


@pytest.mark.parametrize("fn", list(_calls()))
@pytest.mark.parametrize("base", [0, -2.0, math.inf, math.nan])
def test_bad_base_is_refused(fn, base):
    with pytest.raises(ValueError, match=rf"{fn}: `base` must be a finite number"):
        _calls()[fn](*_qkv(), base=base)


def test_base_of_the_wrong_type_is_refused():
    with pytest.raises(TypeError, match="`base` must be a number"):
        rotary_embedding(_qkv()[0], base="10000")
    with pytest.raises(ValueError, match="rotary_angles: `base` must be a finite number > 0"):
        rotary_angles(4, 4, base=0.0)


@pytest.mark.parametrize("fn", list(_calls()))
def test_bad_positions_are_refused(fn):
    q, k, v = _qkv(T=7)
    call = _calls()[fn]
    with pytest.raises(ValueError, match=r"`positions` has shape \(6,\); expected \(T,\) = \(7,\)"):
        call(q, k, v, positions=torch.arange(6))
    with pytest.raises(ValueError, match=r"`positions` has shape \(1, 7\)"):
        call(q, k, v, positions=torch.arange(7)[None])
    with pytest.raises(ValueError, match="`positions` contains NaN or infinite values"):
        call(q, k, v, positions=torch.tensor([0.0, 1, 2, math.nan, 4, 5, 6]))
    with pytest.raises(ValueError, match="`positions` is on meta"):
        call(q, k, v, positions=torch.arange(7, device="meta"))
    with pytest.raises(TypeError, match="`positions` must hold real numbers"):
        call(q, k, v, positions=torch.ones(7, dtype=torch.bool))
    with pytest.raises(TypeError, match="`positions` must be None or a 1-d torch.Tensor"):
        call(q, k, v, positions=list(range(7)))


def test_bad_angle_positions_are_refused():
    with pytest.raises(ValueError, match="rotary_angles: `positions` must be a length T >= 0"):
        rotary_angles(-1, 4)
    with pytest.raises(ValueError, match=r"rotary_angles: `positions` has shape \(2, 3\); expected a 1-d tensor"):
        rotary_angles(torch.zeros(2, 3), 4)
    with pytest.raises(ValueError, match="rotary_angles: pass `device` only with an int"):
        rotary_angles(torch.zeros(3), 4, device="cpu")


@pytest.mark.parametrize("fn", ["rotary_linear_attention", "rotary_linear_attention_matrix"])
@pytest.mark.parametrize("name", ["q", "k"])
def test_negative_features_are_refused(fn, name):
    q, k, v = _qkv()
    bad = {"q": q, "k": k}
    bad[name] = bad[name] - 0.5
    with pytest.raises(ValueError, match=rf"{fn}: `{name}` must hold non-negative features phi\({name}\)"):
        _calls()[fn](bad["q"], bad["k"], v)


def test_other_bad_arguments_are_refused():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="rotary_linear_attention: `v` has a non-finite value"):
        rotary_linear_attention(q, k, v.clone().fill_(math.inf))
    with pytest.raises(ValueError, match="unknown form='linear'"):
        rotary_linear_attention(q, k, v, form="linear")
    with pytest.raises(ValueError, match="`eps` must lie in"):
        rotary_linear_attention_matrix(q, k, eps=-1.0)
    with pytest.raises(TypeError, match="`causal` must be True or False"):
        rotary_linear_attention(q, k, v, causal=1)
    with pytest.raises(ValueError, match=r"rotary_embedding: `x` must be a 4-d tensor laid out as \(B, H, T, D\)"):
        rotary_embedding(q[0])
    with pytest.raises(ValueError, match="`k` has shape"):
        rotary_linear_attention(q, k[:, :, :3], v)
