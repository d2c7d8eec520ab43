"""Performer / FAVOR+: softmax attention approximated by random features, in linear time."""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from . import _validate as V
from .attention import linear_attention
from .features import RandomFeatureMap


def performer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    feature_map: Optional[RandomFeatureMap] = None,
    num_features: Optional[int] = None,
    kind: str = "positive",
    orthogonal: bool = True,
    seed: Optional[int] = None,
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
    overflow in fp16/fp32.

    `eps` defaults to 0: positive features give positive denominators, and the stabiliser
    rescales them (by exp(-max) over all keys), so a fixed eps = 1e-6 added after rescaling
    would no longer be negligible and would bias the output.

    `backend` picks the linear attention engine (see `linear_attention`); `feature_backend`
    computes the map: "torch", or "triton" for the fused FAVOR+ kernel (kind="positive" only).
    """
    fn = "performer_attention"
    V.check_qkv(fn, q, k, v)
    V.check_choice(fn, "feature_backend", feature_backend, ("torch", "triton"))
    if feature_map is None:
        feature_map = RandomFeatureMap(q.shape[-1], num_features, kind=kind, orthogonal=orthogonal, seed=seed)
    elif feature_map.d != q.shape[-1]:
        raise ValueError(f"{fn}: `feature_map` expects d={feature_map.d} but `q` has d={q.shape[-1]}")
    feature_map = feature_map.to(q.device)
    phi_q = feature_map(q, is_query=True, stabilize=stabilize, backend=feature_backend)
    phi_k = feature_map(k, is_query=False, stabilize=stabilize, backend=feature_backend)
    return linear_attention(
        phi_q, phi_k, v, causal=causal, normalize=True, form=form, chunk_size=chunk_size, eps=eps, backend=backend
    )
