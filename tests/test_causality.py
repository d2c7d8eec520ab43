"""Causality, exactly: no causal function lets a later token change an earlier output.

For every causal public API (every form and backend of `linear_attention`, Performer,
cosFormer, the band bias, SSD, GLA, RWKV-4, the selective scan, softmax, the decoders,
`LinearAttention` and `TinyLM`): replace every token at positions >= t by other values and
check that the outputs before t are unchanged, to 1e-12 in float64. The replacements are
large on purpose (keys scaled by 30 become the largest keys of the sequence), which is what
moved earlier outputs when the Performer's key stabiliser was a maximum over all keys.
"""
from __future__ import annotations

import functools

import pytest
import torch

import linattn_lib as la

T, CUT = 13, 6  # positions >= CUT are replaced; T is not a multiple of the chunk size
TOL = 1e-12


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(*shape, generator=_gen(seed), dtype=torch.float64)


def _perturb(x: torch.Tensor, *, time_dim: int, seed: int, scale: float = 30.0, sign: int = 0,
             cut: int = CUT) -> torch.Tensor:
    """x with every slice at time >= cut replaced by new (large) values (sign +1: >= 0, -1: <= 0)."""
    y = x.clone()
    idx = [slice(None)] * x.dim()
    idx[time_dim] = slice(cut, None)
    new = _randn(*y[tuple(idx)].shape, seed=seed, scale=scale)
    y[tuple(idx)] = new if sign == 0 else sign * new.abs()
    return y


def _assert_prefix_unchanged(fn, inputs: dict, time_dims: dict, out_time_dim: int = 2, positive=(), cut=CUT):
    """Perturb the inputs named in time_dims (along that axis) from position `cut` on; those in
    `positive` stay >= 0 and a log-decay or log-gate stays <= 0."""
    before = fn(**inputs)

    def sign(name):
        return 1 if name in positive else -1 if name.startswith("log_") else 0

    changed = {
        name: _perturb(x, time_dim=time_dims[name], seed=100 + i, sign=sign(name), cut=cut) if name in time_dims else x
        for i, (name, x) in enumerate(inputs.items())
    }
    after = fn(**changed)
    prefix = [slice(None)] * before.dim()
    prefix[out_time_dim] = slice(0, cut)
    a, b = before[tuple(prefix)], after[tuple(prefix)]
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    # the suffix must have changed, or the check says nothing
    suffix = list(prefix)
    suffix[out_time_dim] = slice(cut, None)
    assert (before[tuple(suffix)] - after[tuple(suffix)]).abs().max() > 1e-6
    err = (a - b).abs().max().item()
    assert err <= TOL, f"outputs before t={cut} moved by {err:.2e} when tokens >= {cut} changed"


QKV_T = {"q": 2, "k": 2, "v": 2}


@pytest.mark.parametrize("form", ["chunked", "quadratic", "recurrent"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("decay", [None, "head", "token"])
def test_linear_attention_torch(form, normalize, decay, make_qkv):
    q, k, v = make_qkv(B=2, H=2, T=T, Dv=3, features="abs")
    inputs = {"q": q, "k": k, "v": v}
    dims = dict(QKV_T)
    if decay == "head":
        inputs["log_decay"] = -_randn(2, seed=4).abs()
    elif decay == "token":
        inputs["log_decay"] = -_randn(2, 2, T, seed=4).abs()
        dims["log_decay"] = 2
    fn = functools.partial(la.linear_attention, form=form, normalize=normalize, chunk_size=4, backend="torch")
    _assert_prefix_unchanged(fn, inputs, dims, positive=("q", "k"))


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("t_cut", [(T, CUT), (150, 70)], ids=["in-chunk", "across-chunks"])
def test_linear_attention_triton_interpreter(normalize, t_cut, make_qkv):
    """Within one chunk (T = 13), and across chunks (T = 150 cut at 70, past the first chunk of
    32 or 64 tokens, so that the earlier chunks' states are involved: a review found the short
    case passing with every chunk reading the last chunk's state)."""
    T, CUT = t_cut
    pytest.importorskip("triton")
    from linattn_lib.core.triton_ops import triton_available

    if not triton_available():
        pytest.skip("Triton kernels unavailable")
    # float32 (the interpreter's kernels take fp16/fp32): exact prefix equality still holds,
    # since masked-out entries contribute exact zeros
    q, k, v = (x.float() for x in make_qkv(B=2, H=2, T=T, Dv=3, features="abs"))
    g = -_randn(2, 2, T, seed=4).abs().float()

    def fn(q, k, v, log_decay):
        return la.linear_attention(q, k, v, log_decay=log_decay, normalize=normalize, backend="triton").double()

    _assert_prefix_unchanged(fn, {"q": q, "k": k, "v": v, "log_decay": g}, {**QKV_T, "log_decay": 2}, positive=("q", "k"),
                             cut=CUT)


@pytest.mark.parametrize("kind", ["positive", "hyperbolic"])
@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_performer(kind, eps, make_qkv):
    q, k, v = make_qkv(B=2, H=2, T=T, Dv=3, features="normal", Dk=8)
    fm = la.RandomFeatureMap(8, 16, kind=kind, seed=0).double()
    fn = functools.partial(la.performer_attention, feature_map=fm, causal=True, eps=eps, chunk_size=4)
    _assert_prefix_unchanged(fn, {"q": q, "k": k, "v": v}, QKV_T)


def test_performer_decodes_token_by_token(make_qkv):
    """The causal stabiliser is a running maximum: a decoder can keep it one token at a time."""
    q, k, v = make_qkv(B=2, H=2, T=T, Dv=3, features="normal", Dk=8)
    k = k * 3
    fm = la.RandomFeatureMap(8, 16, seed=0).double()
    want = la.performer_attention(q, k, v, feature_map=fm, eps=1e-6)
    phi_q = fm(q, is_query=True)
    phi_k, g = fm.causal_key_features(k)
    dec = la.RecurrentDecoder(2, 2, fm.out_features, 3, eps=1e-6, dtype=torch.float64)
    got = torch.stack([dec.step(phi_q[:, :, t], phi_k[:, :, t], v[:, :, t], g[:, :, t]) for t in range(T)], dim=2)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("variant", ["original", "lambda"])
def test_cosformer(variant, make_qkv):
    q, k, v = make_qkv(B=2, H=2, T=T, Dv=3, features="abs")
    fn = functools.partial(la.cosformer_attention, causal=True, variant=variant, M=T)
    _assert_prefix_unchanged(fn, {"q": q, "k": k, "v": v}, QKV_T, positive=("q", "k"))


def test_band_bias(make_qkv):
    q, k, v = make_qkv(B=2, H=2, T=T, Dv=3, features="abs")
    w = _randn(2, 3, seed=5).abs()
    fn = functools.partial(la.band_bias_attention, w=w, causal=True)
    _assert_prefix_unchanged(fn, {"q": q, "k": k, "v": v}, QKV_T, positive=("q", "k"))


def test_softmax(make_qkv):
    q, k, v = make_qkv(B=2, H=2, T=T, Dv=3, features="normal")
    _assert_prefix_unchanged(functools.partial(la.softmax_attention, causal=True), {"q": q, "k": k, "v": v}, QKV_T)


@pytest.mark.parametrize("form", ["chunked", "quadratic", "recurrent"])
def test_ssd(form):
    x, Bm, C = _randn(2, 2, T, 3, seed=1), _randn(2, 2, T, 4, seed=2), _randn(2, 2, T, 4, seed=3)
    dt = _randn(2, 2, T, seed=4).abs() + 0.1
    A = -_randn(2, seed=5).abs()
    fn = functools.partial(la.ssd, form=form, chunk_size=4)
    inputs = {"x": x, "dt": dt, "A": A, "B": Bm, "C": C}
    _assert_prefix_unchanged(fn, inputs, {"x": 2, "dt": 2, "B": 2, "C": 2}, positive=("dt",))


@pytest.mark.parametrize("form", ["chunked", "quadratic", "recurrent"])
def test_gla(form, make_qkv):
    q, k, v = make_qkv(B=2, H=2, T=T, Dv=3, features="normal")
    g = -_randn(2, 2, T, 5, seed=4).abs()
    fn = functools.partial(la.gla_attention, form=form, chunk_size=4)
    _assert_prefix_unchanged(fn, {"q": q, "k": k, "v": v, "log_gates": g}, {**QKV_T, "log_gates": 2})


@pytest.mark.parametrize("form", ["recurrent", "quadratic", "naive"])
def test_rwkv4(form):
    k, v = _randn(2, T, 4, seed=1), _randn(2, T, 4, seed=2)
    w, u = _randn(4, seed=3).abs(), _randn(4, seed=4)
    fn = functools.partial(la.rwkv4_wkv, form=form)
    # the naive loop overflows for large k: keep the perturbation moderate there
    scale = 3.0 if form == "naive" else 30.0
    before = fn(w, u, k, v)
    after = fn(w, u, _perturb(k, time_dim=1, seed=7, scale=scale), _perturb(v, time_dim=1, seed=8))
    assert (before[:, CUT:] - after[:, CUT:]).abs().max() > 1e-6
    assert (before[:, :CUT] - after[:, :CUT]).abs().max() <= TOL


def test_selective_scan():
    x = _randn(2, 2, T, 3, seed=1)
    dt = _randn(2, 2, T, seed=2).abs() + 0.1
    A = -_randn(2, seed=3).abs()
    Bm, C = _randn(2, 2, T, 4, seed=4), _randn(2, 2, T, 4, seed=5)
    fn = la.selective_scan_reference
    inputs = {"x": x, "dt": dt, "A": A, "B": Bm, "C": C}
    _assert_prefix_unchanged(fn, inputs, {"x": 2, "dt": 2, "B": 2, "C": 2}, positive=("dt",))


def _decode(decoder, q, k, v):
    return torch.stack([decoder.step(q[:, :, t], k[:, :, t], v[:, :, t]) for t in range(q.shape[2])], dim=2)


def test_decoders(make_qkv):
    q, k, v = make_qkv(B=2, H=2, T=T, Dv=3, features="abs")

    def recurrent(q, k, v):
        return _decode(la.RecurrentDecoder(2, 2, 5, 3, dtype=torch.float64), q, k, v)

    def kv_cache(q, k, v):
        return _decode(la.KVCacheDecoder(2, 2, 5, 3, dtype=torch.float64), q, k, v)

    for fn in (recurrent, kv_cache):
        _assert_prefix_unchanged(fn, {"q": q, "k": k, "v": v}, QKV_T, positive=("q", "k"))


@pytest.mark.parametrize("kind", la.nn.LINEAR_KINDS)
def test_linear_attention_layer(kind):
    layer = la.LinearAttention(16, 2, kind=kind, max_len=32).double()
    x = _randn(2, T, 16, seed=1)
    with torch.no_grad():
        _assert_prefix_unchanged(lambda x: layer(x), {"x": x}, {"x": 1}, out_time_dim=1)


@pytest.mark.parametrize("attention", la.nn.ATTENTION_KINDS)
def test_tiny_lm(attention):
    cfg = la.ModelConfig(vocab_size=11, block_size=32, n_layer=2, n_head=2, d_model=16, attention=attention)
    model = la.TinyLM(cfg).double().eval()
    idx = torch.randint(0, 11, (2, T), generator=_gen(1))
    changed = idx.clone()
    changed[:, CUT:] = (idx[:, CUT:] + 1 + torch.randint(0, 9, (2, T - CUT), generator=_gen(2))) % 11
    with torch.no_grad():
        a, b = model(idx), model(changed)
    logits_a, logits_b = (x[0] if isinstance(x, tuple) else x for x in (a, b))
    assert (logits_a[:, CUT:] - logits_b[:, CUT:]).abs().max() > 1e-6
    assert (logits_a[:, :CUT] - logits_b[:, :CUT]).abs().max() <= TOL


# --------------------------------------------------------------------------------------
# non-finite and garbage input: refused, or harmless
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["chunked", "quadratic", "recurrent"])
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_non_finite_input_is_refused(form, name, make_qkv):
    """A NaN at t would reach outputs before t through 0 * NaN in a masked matmul."""
    q, k, v = (x.float() for x in make_qkv(B=2, H=2, T=T, Dv=3, features="abs"))
    inputs = {"q": q, "k": k, "v": v}
    inputs[name] = inputs[name].clone()
    inputs[name][0, 0, 5, 0] = float("nan")
    with pytest.raises(ValueError, match=rf"linear_attention: `{name}` has a non-finite value \(nan\) at index \(0, 0, 5, 0\)"):
        la.linear_attention(**inputs, form=form, chunk_size=4)


@pytest.mark.parametrize("form", ["chunked", "quadratic", "recurrent"])
@pytest.mark.parametrize("decay", [False, True])
def test_right_padding_with_garbage_is_harmless(form, decay, make_qkv):
    """Huge finite garbage after the real tokens (scores overflow to inf in float32) leaves
    the real tokens' outputs as they are without the padding."""
    q, k, v = (x.float() for x in make_qkv(B=2, H=2, T=T, Dv=3, features="abs"))
    g = -_randn(2, 2, T, seed=4).abs().float() if decay else None
    kp, vp = k.clone(), v.clone()
    kp[:, :, CUT:], vp[:, :, CUT:] = 1e30, -1e30
    padded = la.linear_attention(q, kp, vp, log_decay=g, form=form, chunk_size=4)
    alone = la.linear_attention(
        q[:, :, :CUT], k[:, :, :CUT], v[:, :, :CUT], log_decay=None if g is None else g[..., :CUT],
        form=form, chunk_size=4,
    )
    assert torch.isfinite(padded[:, :, :CUT]).all()
    torch.testing.assert_close(padded[:, :, :CUT], alone, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------
# Performer: a finite answer at any scale, and the stabilisers change nothing
# --------------------------------------------------------------------------------------


def test_performer_finite_at_large_scales():
    """Exponents spread over thousands: a stabiliser per feature keeps every denominator >= 1.

    The issue's case (seed 0, q and k scaled by 10, eps=0) gave 4 non-finite outputs; the
    non-causal map broke from a scale of 100.
    """
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 8, 4) * 10, torch.randn(1, 2, 8, 4) * 10, torch.randn(1, 2, 8, 4)
    assert torch.isfinite(la.performer_attention(q, k, v, causal=True, seed=0)).all()
    for scale in (30, 100, 300):
        q, k, v = (torch.randn(1, 2, 64, 16, generator=_gen(s)) for s in range(3))
        for causal in (True, False):
            o = la.performer_attention(q * scale, k * scale, v, causal=causal, seed=0)
            assert torch.isfinite(o).all(), (scale, causal)
            # still a convex combination of the values
            assert (o <= v.amax(-2, keepdim=True) + 1e-4).all() and (o >= v.amin(-2, keepdim=True) - 1e-4).all()


@pytest.mark.parametrize("kind", ["positive", "hyperbolic"])
@pytest.mark.parametrize("causal", [True, False])
def test_performer_stabilisers_are_exact(kind, causal, make_qkv):
    """In float64 the stabilised forms (running max, per-feature max) equal the raw features."""
    from linattn_lib.core.performer import _causal_per_feature

    q, k, v = (2 * x for x in make_qkv(B=2, H=2, T=T, Dv=3, features="normal", Dk=8))
    fm = la.RandomFeatureMap(8, 20, kind=kind, seed=0).double()
    raw = la.performer_attention(q, k, v, feature_map=fm, causal=causal, stabilize=False)
    torch.testing.assert_close(la.performer_attention(q, k, v, feature_map=fm, causal=causal), raw, rtol=1e-12, atol=1e-12)
    if causal:
        for form in ("chunked", "recurrent"):
            got = _causal_per_feature(fm, q, k, v, form=form, chunk_size=4)
            torch.testing.assert_close(got, raw, rtol=1e-12, atol=1e-12)
