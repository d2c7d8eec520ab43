"""Performer / FAVOR+: softmax attention approximated by random features, in linear time."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import _validate as V
from .features import EXPONENTIAL_KINDS, RandomFeatureMap
from .linear import check_engine, linear_attention
from .ssm import gla_attention


def performer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    feature_map: RandomFeatureMap | None = None,
    num_features: int | None = None,
    kind: str = "positive",
    orthogonal: bool = True,
    seed: int | None = None,
    stabilize: bool = True,
    form: str = "chunked",
    chunk_size: int = 64,
    eps: float = 0.0,
    backend: str = "auto",
    feature_backend: str = "torch",
) -> Tensor:
    """Approximate softmax(q k^T / sqrt(d)) v with random features (FAVOR+ by default).

    q, k are raw queries and keys (B, H, T, d), not features. The map phi is `feature_map`, or a
    fresh `RandomFeatureMap(d, num_features, kind=..., orthogonal=..., seed=...)`; its inputs are
    scaled by d^(-1/4) so phi(q) . phi(k) estimates exp(q . k / sqrt(d)). The max-stabiliser
    (`stabilize`) changes nothing mathematically for the normalised output and prevents exp
    overflow in fp16/fp32. Queries subtract their own row maximum. Causal keys subtract a
    *running* maximum (the largest exponent of keys 0..t), applied as a per-token log-decay
    that rescales the state when the maximum grows, so no output depends on a later token
    and token-by-token decoding gives the same result (`RandomFeatureMap.causal_key_features`);
    non-causal keys subtract the maximum of each feature over all keys. Where exponents
    spread so far that causal denominators underflow (eps=0), the causal case is recomputed
    with a running maximum per feature (a gate per feature, `gla_attention`): every
    denominator then has a term equal to 1 and the output is finite at any scale.

    `eps` defaults to 0: positive features give positive denominators, and the stabiliser
    rescales them (by exp(-max) over all keys), so a fixed eps = 1e-6 added after rescaling
    would no longer be negligible and would bias the output.

    `backend` picks the linear attention engine (see `linear_attention`); `feature_backend`
    computes the map: "torch", or "triton" for the fused FAVOR+ kernel (kind="positive" only).
    """
    fn = "performer_attention"
    V.check_qkv(fn, q, k, v)
    check_engine(fn, form, backend, chunk_size, q, v)
    V.check_choice(fn, "feature_backend", feature_backend, ("torch", "triton"))
    causal = V.check_flag(fn, "causal", causal)
    stabilize = V.check_flag(fn, "stabilize", stabilize)
    eps = V.check_eps(fn, eps)
    if feature_map is not None:
        V.check_instance(fn, "feature_map", feature_map, RandomFeatureMap, "a RandomFeatureMap or None")
    else:
        orthogonal = V.check_flag(fn, "orthogonal", orthogonal)
        seed = V.check_seed(fn, "seed", seed)
        if num_features is not None:
            V.check_positive_int(fn, "num_features", num_features)
    if feature_map is None:
        feature_map = RandomFeatureMap(q.shape[-1], num_features, kind=kind, orthogonal=orthogonal, seed=seed)
    elif feature_map.d != q.shape[-1]:
        raise ValueError(f"{fn}: `feature_map` expects d={feature_map.d} but `q` has d={q.shape[-1]}")
    feature_map = feature_map.to(q.device)
    phi_q = feature_map(q, is_query=True, stabilize=stabilize, backend=feature_backend)
    engine = dict(form=form, chunk_size=chunk_size, eps=eps, backend=backend)
    if not (stabilize and feature_map.kind in EXPONENTIAL_KINDS):
        phi_k = feature_map(k, is_query=False, stabilize=stabilize, backend=feature_backend)
        return linear_attention(phi_q, phi_k, v, causal=causal, normalize=True, **engine)
    if not causal:
        if feature_backend == "triton":  # the fused kernel's stabilisers: row and global
            phi_k = feature_map(k, is_query=False, stabilize=True, backend="triton")
            return linear_attention(phi_q, phi_k, v, causal=False, normalize=True, **engine)
        return _noncausal_per_feature(feature_map, q, k, v, **engine)
    # a running maximum over the keys so far, never a later key's
    phi_k, log_decay = feature_map.causal_key_features(k)
    o = linear_attention(phi_q, phi_k, v, causal=True, normalize=True, log_decay=log_decay, **engine)
    if eps == 0 and not torch.isfinite(o).all() and all(torch.isfinite(x).all() for x in (q, k, v)):
        # some denominators underflowed (exponents spread over more than float's range)
        o = _causal_per_feature(feature_map, q, k, v, form=form, chunk_size=chunk_size)
    return o


# --------------------------------------------------------------------------------------
# per-feature stabilisers: a denominator >= 1 whatever the scale of q and k
# --------------------------------------------------------------------------------------
#
# With exponents u^q_if, u^k_jf (features exp(u)), let M_f be the largest key exponent of
# feature f (over all keys, or over keys j <= i when causal) and c_i = max_f (u^q_if + M_f).
# Then exp(u^q_if + M_f - c_i) <= 1, exp(u^k_jf - M_f) <= 1, and the one pair (f, j) that
# attains both maxima contributes exactly 1 to the denominator of query i: nothing
# overflows and no denominator underflows. Every constant cancels between numerator and
# denominator, and all of them are detached (they are constants of the normalised output).


def _noncausal_per_feature(fm: RandomFeatureMap, q, k, v, **engine) -> Tensor:
    uq, uk = fm.exponents(q), fm.exponents(k)
    M = uk.detach().amax(dim=-2, keepdim=True)  # (B, H, 1, m)
    c = (uq.detach() + M).amax(dim=-1, keepdim=True)
    scale = 1.0 / math.sqrt(fm.out_features)
    phi_q, phi_k = torch.exp(uq + M - c) * scale, torch.exp(uk - M) * scale
    return linear_attention(phi_q, phi_k, v, causal=False, normalize=True, **engine)


def _causal_per_feature(fm: RandomFeatureMap, q, k, v, *, form: str, chunk_size: int) -> Tensor:
    """The causal case: M_if = max_{j <= i} u^k_jf is a running maximum per feature.

    When M_f grows, the state's feature row f is rescaled by exp(M_{i-1,f} - M_if): a gate
    per feature, i.e. gated linear attention with a ones column in v for the denominator.
    """
    uq, uk = fm.exponents(q), fm.exponents(k)
    M = uk.detach().cummax(dim=-2).values  # (B, H, T, m)
    gates = torch.cat([torch.zeros_like(M[..., :1, :]), M[..., :-1, :] - M[..., 1:, :]], dim=-2)
    c = (uq.detach() + M).amax(dim=-1, keepdim=True)
    phi_q, phi_k = torch.exp(uq + M - c), torch.exp(uk - M)
    v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    out = gla_attention(phi_q, phi_k, v1, gates, form=form, chunk_size=chunk_size)
    return (out[..., :-1] / out[..., -1:]).to(v.dtype)
