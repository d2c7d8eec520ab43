"""Positional linear attention: every linear-time form equals its quadratic definition in float64,
each definition equals the formula written as loops, and bad input raises a clear error."""
import itertools
import math

import pytest
import torch

from linattn_lib import linear_attention
from linattn_lib.core.positional import (
    band_bias_attention,
    band_bias_matrix,
    cosformer_attention,
    cosformer_attention_matrix,
    cosformer_weights,
    key_normalized_attention,
    key_normalized_attention_matrix,
    sinusoidal_positions,
)

D64 = torch.float64
TOL = 1e-10


def maxdiff(a, b):
    return (a - b).abs().max().item()


# ------------------------------------------------------------------ sinusoidal positions


@pytest.mark.parametrize("d", [1, 6, 7])
def test_sinusoidal_matches_vaswani_formula(d):
    T = 9
    pe = sinusoidal_positions(T, d, dtype=D64)
    assert pe.shape == (T, d)
    for pos in range(T):
        for col in range(d):
            angle = pos / 10000 ** ((col - col % 2) / d)
            expect = math.sin(angle) if col % 2 == 0 else math.cos(angle)
            assert abs(pe[pos, col].item() - expect) < 1e-12


def test_sinusoidal_offset_is_a_rotation():
    """PE[pos + k] = R_k PE[pos] with one 2x2 rotation per frequency: offsets are linear maps."""
    T, d, k = 20, 8, 3
    pe = sinusoidal_positions(T + k, d, dtype=D64)
    freq = 1 / 10000 ** (torch.arange(0, d, 2, dtype=D64) / d)
    c, s = torch.cos(k * freq), torch.sin(k * freq)
    sin0, cos0 = pe[:T, 0::2], pe[:T, 1::2]
    assert maxdiff(pe[k:, 0::2], sin0 * c + cos0 * s) < 1e-12
    assert maxdiff(pe[k:, 1::2], cos0 * c - sin0 * s) < 1e-12


# ------------------------------------------------------------------ cosFormer

COS_CASES = list(itertools.product(["original", "lambda"], [True, False], ["similarity", "text"], [1, 7, 70]))


@pytest.mark.parametrize("variant,causal,normalizer,T", COS_CASES)
def test_cosformer_linear_equals_quadratic(variant, causal, normalizer, T, make_qkv):
    q, k, v = make_qkv(features="relu", T=T)
    for lam, M in [(0.7, None), (1.0, 2 * T + 3), (0.0, None)]:
        kw = dict(causal=causal, variant=variant, normalizer=normalizer, lam=lam, M=M)
        lin = cosformer_attention(q, k, v, form="linear", **kw)
        quad = cosformer_attention(q, k, v, form="quadratic", **kw)
        assert maxdiff(lin, quad) < TOL


def _cosformer_loops(q, k, v, *, variant, lam, M, causal, normalizer):
    """The formulas exactly as written, with 1-based positions and explicit sums."""
    T = q.shape[2]
    out = torch.zeros_like(v)
    for i in range(1, T + 1):
        num, den_sim, den_c = 0, 0, 0
        for j in range(1, (i if causal else T) + 1):
            if variant == "original":
                c = math.cos(math.pi / 2 * (i - j) / M)
            else:
                c = 1 - lam + lam * (1 + math.cos(math.pi * (i - j) / M)) / 2
            s = c * (q[..., i - 1, :] * k[..., j - 1, :]).sum(-1, keepdim=True)
            num = num + s * v[..., j - 1, :]
            den_sim, den_c = den_sim + s, den_c + c
        out[..., i - 1, :] = num / (den_sim + 1e-6 if normalizer == "similarity" else den_c)
    return out


@pytest.mark.parametrize("variant,causal,normalizer", list(itertools.product(["original", "lambda"], [True, False], ["similarity", "text"])))
def test_cosformer_matches_formula_loops(variant, causal, normalizer, make_qkv):
    q, k, v = make_qkv(features="relu", B=1, H=2, T=9)
    M, lam = 11, 0.6
    expect = _cosformer_loops(q, k, v, variant=variant, lam=lam, M=M, causal=causal, normalizer=normalizer)
    got = cosformer_attention(q, k, v, causal=causal, variant=variant, lam=lam, M=M, normalizer=normalizer)
    assert maxdiff(got, expect) < TOL


@pytest.mark.parametrize("causal", [True, False])
def test_cosformer_original_equals_one_linear_attention_on_concatenated_features(causal, make_qkv):
    """The original code's form: q_ = [q sin(pi i/2M), q cos(pi i/2M)], one normalised linear attention."""
    q, k, v = make_qkv(features="relu", T=31)
    M = 40
    idx = math.pi / 2 * torch.arange(1, 32, dtype=D64)[:, None] / M
    q_ = torch.cat([q * torch.sin(idx), q * torch.cos(idx)], -1)
    k_ = torch.cat([k * torch.sin(idx), k * torch.cos(idx)], -1)
    expect = linear_attention(q_, k_, v, causal=causal, form="quadratic")
    assert maxdiff(cosformer_attention(q, k, v, causal=causal, M=M), expect) < TOL


@pytest.mark.parametrize("causal", [True, False])
def test_cosformer_row_sums(causal, make_qkv):
    """The original's (and the similarity normaliser's) rows sum to one; the texts' do not."""
    q, k, _ = make_qkv(features="relu", T=40)
    orig = cosformer_attention_matrix(q, k, causal=causal, eps=0.0)
    fixed = cosformer_attention_matrix(q, k, causal=causal, variant="lambda", lam=0.8, normalizer="similarity", eps=0.0)
    text = cosformer_attention_matrix(q, k, causal=causal, variant="lambda", lam=0.8)
    assert maxdiff(orig.sum(-1), torch.ones(())) < 1e-12
    assert maxdiff(fixed.sum(-1), torch.ones(())) < 1e-12
    rows = text.sum(-1)
    assert (rows - 1).abs().max() > 0.1  # the texts' normaliser omits phi(q).phi(k)
    # and the texts' output scale follows the feature norms: doubling q doubles the weights
    assert maxdiff(cosformer_attention_matrix(2 * q, k, causal=causal, variant="lambda", lam=0.8), 2 * text) < 1e-12


def test_cosformer_weights_ranges():
    T, lam = 30, 0.7
    orig = cosformer_weights(T, causal=False)
    assert orig.min() > 0 and maxdiff(orig.diagonal(), torch.ones(())) < 1e-15
    lamw = cosformer_weights(T, causal=False, variant="lambda", lam=lam)
    assert lamw.min() >= 1 - lam - 1e-12 and lamw.max() <= 1 + 1e-12  # never decays below 1 - lam
    causal = cosformer_weights(T, variant="lambda", lam=lam)
    assert causal.triu(1).abs().max() == 0 and maxdiff(causal.tril(), lamw.tril()) < 1e-15
    # locality: the original weight decreases with distance
    assert bool((orig[0, 1:] < orig[0, :-1]).all())


def test_cosformer_streaming_with_fixed_M(make_qkv):
    """With M fixed in advance, outputs on a prefix equal the full sequence's first outputs."""
    q, k, v = make_qkv(features="relu", T=50)
    full = cosformer_attention(q, k, v, M=64)
    for t in (1, 17, 49):
        part = cosformer_attention(q[:, :, :t], k[:, :, :t], v[:, :, :t], M=64)
        assert maxdiff(part, full[:, :, :t]) < TOL
    # with the default M = T the prefix sees another re-weighting
    assert maxdiff(cosformer_attention(q[:, :, :17], k[:, :, :17], v[:, :, :17]), full[:, :, :17]) > 1e-6


@pytest.mark.parametrize("variant", ["original", "lambda"])
def test_cosformer_gradients_agree(variant, make_qkv):
    q, k, v = make_qkv(features="relu", T=20)
    grads = []
    for form in ("linear", "quadratic"):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        cosformer_attention(qq, kk, vv, variant=variant, form=form).square().sum().backward()
        grads.append([x.grad for x in (qq, kk, vv)])
    for a, b in zip(*grads):
        assert maxdiff(a, b) < 1e-9


# ------------------------------------------------------------------ key-normalised ("RFA-KN")


@pytest.mark.parametrize("T", [1, 9, 50])
def test_key_normalized_linear_equals_quadratic_and_formula(T, make_qkv):
    q, k, v = make_qkv(features="relu", T=T)
    lin = key_normalized_attention(q, k, v)
    quad = key_normalized_attention(q, k, v, form="quadratic")
    assert maxdiff(lin, quad) < TOL
    # the formula: z_j = sum_{i >= j} q_i . k_j, o_i = sum_j (q_i . k_j) v_j / z_j
    s = torch.einsum("bhid,bhjd->bhij", q, k)
    z = torch.stack([s[..., j:, j].sum(-1) for j in range(T)], dim=-1)
    expect = torch.einsum("bhij,bhjd->bhid", s / (z.unsqueeze(-2) + 1e-6), v)
    assert maxdiff(lin, expect) < TOL


def test_key_normalized_rows_do_not_sum_to_one(make_qkv):
    q, k, _ = make_qkv(features="relu", T=30)
    rows = key_normalized_attention_matrix(q, k, eps=0.0).sum(-1)
    assert (rows - 1).abs().max() > 0.1


def test_key_normalized_refuses_causal(make_qkv):
    q, k, v = make_qkv(features="relu", T=5)
    with pytest.raises(ValueError, match=r"causal=True is impossible.*future\* queries"):
        key_normalized_attention(q, k, v, causal=True)
    with pytest.raises(ValueError, match=r"causal=True is impossible"):
        key_normalized_attention_matrix(q, k, causal=True)


# ------------------------------------------------------------------ relative-position band bias

BAND_CASES = list(itertools.product([True, False], [True, False], [0, 2, 40], [1, 13, 33]))


def _band_w(H, K, causal, seed=3):
    g = torch.Generator().manual_seed(seed)
    return 0.3 * torch.rand(H, K + 1 if causal else 2 * K + 1, generator=g, dtype=D64)


@pytest.mark.parametrize("causal,normalize,K,T", BAND_CASES)
def test_band_bias_linear_equals_quadratic(causal, normalize, K, T, make_qkv):
    q, k, v = make_qkv(features="relu", T=T)
    w = _band_w(3, K, causal)
    lin = band_bias_attention(q, k, v, w, causal=causal, normalize=normalize)
    quad = band_bias_attention(q, k, v, w, causal=causal, normalize=normalize, form="quadratic")
    assert maxdiff(lin, quad) < TOL


@pytest.mark.parametrize("causal", [True, False])
def test_band_bias_matches_formula_loops(causal, make_qkv):
    q, k, v = make_qkv(features="relu", B=1, H=2, T=8)
    K = 2
    w = _band_w(2, K, causal)
    beta = band_bias_matrix(w, 8, causal=causal)
    for h in range(2):
        for i in range(8):
            for j in range(8):
                d = i - j
                inside = (0 <= d <= K) if causal else (abs(d) <= K)
                expect = (w[h, d] if causal else w[h, d + K]) if inside else 0.0
                assert beta[h, i, j].item() == float(expect)
    A = torch.einsum("bhid,bhjd->bhij", q, k)
    A = (A.tril() if causal else A) + beta
    expect = (A @ v) / (A.sum(-1, keepdim=True) + 1e-6)
    assert maxdiff(band_bias_attention(q, k, v, w, causal=causal), expect) < TOL


def test_band_bias_zero_w_is_linear_attention(make_qkv):
    q, k, v = make_qkv(features="relu", T=19)
    for causal, width in ((True, 4), (False, 7)):
        w = torch.zeros(3, width, dtype=D64)
        assert maxdiff(band_bias_attention(q, k, v, w, causal=causal), linear_attention(q, k, v, causal=causal)) < TOL


def test_band_bias_does_not_limit_the_receptive_field(make_qkv):
    """Errata A30: the linear-attention term stays global, so o_T depends on v_1 even with K = 1."""
    q, k, v = make_qkv(features="relu", T=30)
    v = v.clone().requires_grad_()
    band_bias_attention(q, k, v, _band_w(3, 1, True))[:, :, -1].sum().backward()
    assert v.grad[:, :, 0].abs().min() > 0


def test_band_bias_gradients_agree(make_qkv):
    q, k, v = make_qkv(features="relu", T=16)
    w = _band_w(3, 3, False)
    grads = []
    for form in ("linear", "quadratic"):
        xs = [x.clone().requires_grad_() for x in (q, k, v, w)]
        band_bias_attention(*xs, causal=False, form=form).square().sum().backward()
        grads.append([x.grad for x in xs])
    for a, b in zip(*grads):
        assert maxdiff(a, b) < 1e-9


# ------------------------------------------------------------------ errors


def test_positional_errors(make_qkv):
    q, k, v = make_qkv(features="relu", T=6)
    with pytest.raises(ValueError, match=r"`q` must hold non-negative features.*torch.relu\(q\)"):
        cosformer_attention(q - 1, k, v)
    with pytest.raises(ValueError, match=r"`k` must hold non-negative features"):
        key_normalized_attention(q, k - 1, v)
    with pytest.raises(ValueError, match=r"`M` must be >= the sequence length T=6, got M=5"):
        cosformer_attention(q, k, v, M=5)
    with pytest.raises(ValueError, match=r"`lam` must lie in \[0, 1\], got 1.5"):
        cosformer_attention(q, k, v, variant="lambda", lam=1.5)
    with pytest.raises(TypeError, match=r"`M` must be a number"):
        cosformer_attention(q, k, v, M=torch.tensor(8.0))
    with pytest.raises(ValueError, match=r"unknown variant='rope'"):
        cosformer_attention(q, k, v, variant="rope")
    with pytest.raises(ValueError, match=r"unknown normalizer='none'"):
        cosformer_attention(q, k, v, normalizer="none")
    with pytest.raises(ValueError, match=r"unknown form='chunked'; expected one of 'linear', 'quadratic'"):
        cosformer_attention(q, k, v, form="chunked")
    with pytest.raises(ValueError, match=r"`q` must be a 4-d tensor"):
        cosformer_attention(q[0], k, v)
    with pytest.raises(ValueError, match=r"`v` has shape \(2, 3, 5, 4\)"):
        cosformer_attention(q, k, v[:, :, :5])
    with pytest.raises(ValueError, match=r"`eps` must lie in \[0, inf\]"):
        cosformer_attention(q, k, v, eps=-1.0)
    with pytest.raises(ValueError, match=r"`w` has 2 rows but there are H=3 heads"):
        band_bias_attention(q, k, v, torch.zeros(2, 3, dtype=D64))
    with pytest.raises(ValueError, match=r"non-causal `w` must have an odd width 2K\+1"):
        band_bias_attention(q, k, v, torch.zeros(3, 4, dtype=D64), causal=False)
    with pytest.raises(ValueError, match=r"`w` must be a 2-d tensor laid out as \(H, W\)"):
        band_bias_attention(q, k, v, torch.zeros(3, dtype=D64))
    with pytest.raises(TypeError, match=r"`w` has dtype torch.float32 but `q` has dtype torch.float64"):
        band_bias_attention(q, k, v, torch.zeros(3, 3))
    with pytest.raises(ValueError, match=r"`w` contains NaN"):
        band_bias_attention(q, k, v, torch.full((3, 3), float("nan"), dtype=D64))
    with pytest.raises(ValueError, match=r"`T` must be a positive int, got 0"):
        sinusoidal_positions(0, 4)
    with pytest.raises(ValueError, match=r"`d` must be a positive int"):
        sinusoidal_positions(4, 2.5)
