"""Decode profiling and saved-for-backward accounting (linattn_lib.chapters.profiling)."""
import pytest
import torch

from linattn_lib import (
    KVCacheDecoder,
    RecurrentDecoder,
    elu_plus_one,
    linear_attention,
    softmax_attention,
)
from linattn_lib.chapters.profiling import (
    profile_decoding,
    profile_forward_backward,
    saved_tensor_bytes,
)


def test_profile_decoding_bytes(make_qkv):
    q, k, v = make_qkv(B=1, H=2, Dk=4, Dv=4, features="normal", dtype=torch.float32, T=40)
    rec = profile_decoding(RecurrentDecoder(1, 2, 4, 4), elu_plus_one(q), elu_plus_one(k), v, at=[8, 16, 40], window=4)
    kv = profile_decoding(KVCacheDecoder(1, 2, 4, 4), q, k, v, at=[8, 16, 40], window=4)
    assert rec.contexts == kv.contexts == [8, 16, 40]
    assert rec.nbytes == [(2 * 4 * 4 + 2 * 4) * 4] * 3  # S and z, float32
    assert kv.nbytes == [2 * 2 * t * 4 * 4 for t in (8, 16, 40)]  # keys and values
    assert all(s > 0 for s in rec.step_seconds + kv.step_seconds)


def test_profile_decoding_checks_arguments(make_qkv):
    q, k, v = make_qkv(B=1, H=2, Dk=4, Dv=4, features="normal", dtype=torch.float32, T=10)
    with pytest.raises(ValueError, match="only T=10"):
        profile_decoding(KVCacheDecoder(1, 2, 4, 4), q, k, v, at=[20])
    with pytest.raises(ValueError, match="window"):
        profile_decoding(KVCacheDecoder(1, 2, 4, 4), q, k, v, at=[2], window=4)
    with pytest.raises(ValueError, match="increasing"):
        profile_decoding(KVCacheDecoder(1, 2, 4, 4), q, k, v, at=[8, 4], window=1)
    dec = KVCacheDecoder(1, 2, 4, 4)
    dec.step(q[:, :, 0], k[:, :, 0], v[:, :, 0])
    with pytest.raises(ValueError, match="fresh"):
        profile_decoding(dec, q, k, v, at=[4], window=1)


def test_saved_tensor_bytes_softmax_quadratic_linear_linear(make_qkv):
    def softmax_bytes(T):
        q, k, v = (x.requires_grad_() for x in make_qkv(B=1, H=2, Dk=4, Dv=4, features="normal", dtype=torch.float32, T=T))
        return saved_tensor_bytes(lambda: softmax_attention(q, k, v, causal=True))

    def linear_bytes(T):
        q, k, v = (x.requires_grad_() for x in make_qkv(B=1, H=2, Dk=4, Dv=4, features="normal", dtype=torch.float32, T=T))
        return saved_tensor_bytes(lambda: linear_attention(elu_plus_one(q), elu_plus_one(k), v, chunk_size=16))

    # the T x T softmax matrix dominates: 4x the bytes for 2x the length (plus O(T) terms)
    assert 3.5 < softmax_bytes(512) / softmax_bytes(256) <= 4.0
    assert 1.6 < linear_bytes(512) / linear_bytes(256) < 2.4


def test_saved_tensor_bytes_counts_storage_once():
    x = torch.randn(100, requires_grad=True)
    # x * x saves x twice (as both operands): one storage
    assert saved_tensor_bytes(lambda: x * x) == 400


def test_profile_forward_backward(make_qkv):
    def make(T):
        return [x.requires_grad_() for x in make_qkv(B=1, H=2, Dk=4, Dv=4, features="normal", dtype=torch.float32, T=T)]

    p = profile_forward_backward(lambda q, k, v: softmax_attention(q, k, v), make, [16, 32], repeats=1, warmup=0)
    assert p.lengths == [16, 32] and len(p.seconds) == 2 and p.saved_bytes[1] > p.saved_bytes[0]
    with pytest.raises(ValueError, match="requires_grad"):
        profile_forward_backward(lambda q, k, v: q, lambda T: make_qkv(B=1, H=2, Dk=4, Dv=4, features="normal", dtype=torch.float32, T=T), [4])
