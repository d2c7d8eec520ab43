"""One table of bad inputs for every public name: each must raise a clear, named error.

The library's contract: bad input gets an exception that names the function, the
argument (in backticks), what it got and what was expected -- never a silent broadcast, never
a NaN that could have been an error, never an answer to a different question ("no" taken as
True). Every row below is one bad call; `test_bad_input` checks its exception type, that the
message names the function and the backticked argument, and an optional detail (the layout
it expects, the value it got).

A new public name in `linattn_lib.__all__` needs a row here (`test_every_public_name_has_a_row`
fails otherwise), or an entry in EXEMPT with the reason it takes no input.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import linattn_lib as L
from linattn_lib import LinearAttentionState as State

NAN, INF = float("nan"), float("inf")


# ---------------------------------------------------------------- small, valid inputs


def qkv(B=1, H=2, T=4, D=8):
    """(q, k, v) of shape (B, H, T, D), positive (valid features for every mechanism)."""
    g = torch.Generator().manual_seed(0)
    return tuple(torch.rand(B, H, T, D, generator=g) for _ in range(3))


def _nan_last(qkv_):
    """(q, k, v) with v's last token NaN."""
    q, k, v = qkv_
    v = v.clone()
    v[:, :, -1] = NAN
    return q, k, v


def q4():
    return qkv()[0]


def token(B=3, H=2, D=8):
    """One decoding token's (B, H, D) slice."""
    return torch.rand(B, H, D)


def decode_state(B=3, H=2, Dk=8, Dv=8):
    return State(torch.zeros(B, H, Dk, Dv), torch.zeros(B, H, Dk))


def decode(**kw):
    x = token()
    return L.linear_attention_decode_step(x, x, x, kw.pop("state", decode_state()), **kw)


def W(m=6, d=8):
    return torch.randn(m, d, generator=torch.Generator().manual_seed(1))


def ssd_args(B=1, H=2, T=4, P=3, N=5):
    return (torch.rand(B, H, T, P), torch.rand(B, H, T) + 0.1, -torch.rand(H), torch.rand(B, H, T, N), torch.rand(B, H, T, N))


def gla_args(B=1, H=2, T=4, Dk=3, Dv=5):
    q, k = torch.rand(B, H, T, Dk), torch.rand(B, H, T, Dk)
    return q, k, torch.rand(B, H, T, Dv), -torch.rand(B, H, T, Dk)


def wkv_args(B=1, T=4, C=3):
    return torch.rand(C), torch.rand(C), torch.rand(B, T, C), torch.rand(B, T, C)


def cfg(**kw):
    base = dict(vocab_size=11, block_size=16, n_layer=2, n_head=2, d_model=8)
    return L.ModelConfig(**{**base, **kw})


def lm(**kw):
    return L.TinyLM(cfg(**kw))


def ids(*shape, high=11):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(2))


def layer(**kw):
    return L.LinearAttention(16, 4, **kw)


# ---------------------------------------------------------------- the table

# row(public name, bad call, exception type, function named in the message, argument (a regex,
# shown in backticks), optional detail regex that must appear as well)


def row(name, call, exc, fn, arg, detail=None, *, id):
    return pytest.param(name, call, exc, fn, arg, detail, id=f"{name}-{id}")


ROWS = [
    # --- core/linear.py
    row("linear_attention", lambda: L.linear_attention(q4()[0], q4(), q4()), ValueError, "linear_attention", "q",
        r"\(B, H, T, D\)", id="3d-q"),
    row("linear_attention", lambda: L.linear_attention(*qkv(), causal="no"), TypeError, "linear_attention", "causal",
        id="causal-str"),
    row("linear_attention", lambda: L.linear_attention(*qkv(), eps=NAN), ValueError, "linear_attention", "eps", id="eps-nan"),
    row("linear_attention", lambda: L.linear_attention(*qkv(), return_state="yes"), TypeError, "linear_attention",
        "return_state", id="return_state-str"),
    row("softmax_attention", lambda: L.softmax_attention(*qkv(), causal="no"), TypeError, "softmax_attention", "causal",
        id="causal-str"),
    row("softmax_attention", lambda: L.softmax_attention(*qkv(), scale="x"), TypeError, "softmax_attention", "scale",
        id="scale-str"),
    row("softmax_attention", lambda: L.softmax_attention(*qkv(), scale=NAN), ValueError, "softmax_attention", "scale",
        id="scale-nan"),
    row("softmax_attention", lambda: L.softmax_attention(q4(), q4(), q4()[..., :3, :]), ValueError, "softmax_attention",
        "v", r"\(B, H, T\)", id="short-v"),
    row("softmax_attention_weights", lambda: L.softmax_attention_weights(q4(), q4(), causal="no"), TypeError,
        "softmax_attention_weights", "causal", id="causal-str"),
    row("softmax_attention_weights", lambda: L.softmax_attention_weights(q4(), q4()[0]), ValueError,
        "softmax_attention_weights", "k", id="3d-k"),
    # --- the decode step (core/decode.py)
    row("linear_attention_decode_step", lambda: decode(eps=NAN), ValueError, "linear_attention_decode_step", "eps",
        id="eps-nan"),
    row("linear_attention_decode_step", lambda: decode(eps=INF), ValueError, "linear_attention_decode_step", "eps",
        id="eps-inf"),
    row("linear_attention_decode_step", lambda: decode(eps=True), TypeError, "linear_attention_decode_step", "eps",
        id="eps-bool"),
    row("linear_attention_decode_step", lambda: decode(normalize="no"), TypeError, "linear_attention_decode_step",
        "normalize", id="normalize-str"),
    row("linear_attention_decode_step",
        lambda: decode(state=State(torch.zeros(1, 2, 8, 8).expand(3, 2, 8, 8), torch.zeros(1, 2, 8).expand(3, 2, 8))),
        ValueError, "linear_attention_decode_step", r"state(\.S)?", "stride", id="stride0-state"),
    row("linear_attention_decode_step", lambda: L.linear_attention_decode_step(token()[0], token(), token(), decode_state()),
        ValueError, "linear_attention_decode_step", "q_t", r"\(B, H, Dk?\)", id="2d-q_t-names-BHD"),
    # --- features.py
    row("RandomFeatureMap", lambda: L.RandomFeatureMap(8, 0), ValueError, "RandomFeatureMap", "m", id="m-0"),
    row("RandomFeatureMap", lambda: L.RandomFeatureMap(8, orthogonal=1), TypeError, "RandomFeatureMap", "orthogonal",
        id="orthogonal-int"),
    row("RandomFeatureMap", lambda: L.RandomFeatureMap(8, seed="a"), TypeError, "RandomFeatureMap", "seed", id="seed-str"),
    row("RandomFeatureMap", lambda: L.RandomFeatureMap(8, scaling="unit"), ValueError, "RandomFeatureMap", "scaling",
        id="scaling"),
    row("RandomFeatureMap", lambda: L.RandomFeatureMap(8, seed=0)(torch.rand(4, 5)), ValueError, "RandomFeatureMap", "x",
        r"d=8", id="x-wrong-d"),
    row("RandomFeatureMap", lambda: L.RandomFeatureMap(8, seed=0)(torch.rand(4, 8), stabilize="no"), TypeError,
        "RandomFeatureMap", "stabilize", id="stabilize-str"),
    row("clipped_trig_features", lambda: L.clipped_trig_features(torch.rand(4, 8), W(), torch.rand(5)), ValueError,
        "clipped_trig_features", "b", r"\(m,\) = \(6,\)", id="b-shape"),
    row("default_num_features", lambda: L.default_num_features(0), ValueError, "default_num_features", "d", id="d-0"),
    row("elu_plus_one", lambda: L.elu_plus_one([1.0, 2.0]), TypeError, "elu_plus_one", "x", id="list"),
    row("gaussian_kernel", lambda: L.gaussian_kernel(torch.rand(3, 4), torch.rand(2, 4), sigma=0.0), ValueError,
        "gaussian_kernel", "sigma", id="sigma-0"),
    row("gaussian_kernel", lambda: L.gaussian_kernel(torch.rand(3, 4), torch.rand(2, 5)), ValueError, "gaussian_kernel",
        "y", id="d-mismatch"),
    row("gaussian_matrix", lambda: L.gaussian_matrix(4, 3, seed="a"), TypeError, "gaussian_matrix", "seed", id="seed-str"),
    row("hyperbolic_random_features", lambda: L.hyperbolic_random_features(torch.rand(4, 8), W(), stabilize="yes"),
        ValueError, "hyperbolic_random_features", "stabilize", id="stabilize-str"),
    row("orthogonal_gaussian_matrix", lambda: L.orthogonal_gaussian_matrix(4, 3, scaling="unit"), ValueError,
        "orthogonal_gaussian_matrix", "scaling", id="scaling"),
    row("orthogonal_gaussian_matrix", lambda: L.orthogonal_gaussian_matrix(4, 3, dtype="float32"), TypeError,
        "orthogonal_gaussian_matrix", "dtype", id="dtype-str"),
    row("positive_random_features", lambda: L.positive_random_features(torch.rand(4, 8), W(), input_scale=NAN),
        ValueError, "positive_random_features", "input_scale", id="input_scale-nan"),
    row("positive_random_features", lambda: L.positive_random_features(torch.rand(4, 8), torch.rand(8)), ValueError,
        "positive_random_features", "W", r"\(m, d\)", id="1d-W"),
    row("random_projection", lambda: L.random_projection(4, 3, orthogonal="yes"), TypeError, "random_projection",
        "orthogonal", id="orthogonal-str"),
    row("relu", lambda: L.relu(np.ones(3)), TypeError, "relu", "x", id="ndarray"),
    row("rff_features", lambda: L.rff_features(torch.rand(4, 8), W(), torch.rand(6), sigma=-1.0), ValueError,
        "rff_features", "sigma", id="sigma-negative"),
    row("rff_features", lambda: L.rff_features(torch.rand(4, 8), W(), [0.0] * 6), TypeError, "rff_features", "b",
        id="b-list"),
    row("softmax_kernel", lambda: L.softmax_kernel(torch.rand(3, 4), torch.rand(2, 5)), ValueError, "softmax_kernel", "y",
        id="d-mismatch"),
    row("trig_softmax_features", lambda: L.trig_softmax_features(torch.rand(4, 5), W()), ValueError,
        "trig_softmax_features", "W", id="W-wrong-d"),
    # --- performer.py
    row("performer_attention", lambda: L.performer_attention(*qkv(), seed="a"), TypeError, "performer_attention", "seed",
        id="seed-str"),
    row("performer_attention", lambda: L.performer_attention(*qkv(), feature_map="x"), TypeError, "performer_attention",
        "feature_map", id="feature_map-str"),
    row("performer_attention", lambda: L.performer_attention(*qkv(), stabilize="yes"), TypeError, "performer_attention",
        "stabilize", id="stabilize-str"),
    row("performer_attention", lambda: L.performer_attention(*qkv(), orthogonal=1), TypeError, "performer_attention",
        "orthogonal", id="orthogonal-int"),
    row("performer_attention", lambda: L.performer_attention(*qkv(), causal="no"), TypeError, "performer_attention",
        "causal", id="causal-str"),
    # the engine options it passes on to linear_attention are refused in its own name
    row("performer_attention", lambda: L.performer_attention(*qkv(), backend="cuda"), ValueError,
        "performer_attention", "backend", id="backend-unknown"),
    row("performer_attention", lambda: L.performer_attention(*qkv(), form="scan"), ValueError,
        "performer_attention", "form", id="form-unknown"),
    row("performer_attention", lambda: L.performer_attention(*qkv(), chunk_size=0), ValueError,
        "performer_attention", "chunk_size", id="chunk_size-0"),
    # --- positional.py
    row("band_bias_attention", lambda: L.band_bias_attention(*qkv(), torch.zeros(2, 3), normalize="no"), TypeError,
        "band_bias_attention", "normalize", id="normalize-str"),
    row("band_bias_attention", lambda: L.band_bias_attention(*qkv(), torch.zeros(3, 3)), ValueError,
        "band_bias_attention", "w", r"H=2", id="w-rows"),
    row("band_bias_matrix", lambda: L.band_bias_matrix(torch.zeros(2, 3), 4, causal="no"), TypeError, "band_bias_matrix",
        "causal", id="causal-str"),
    row("band_bias_matrix", lambda: L.band_bias_matrix(torch.zeros(2, 3), 0), ValueError, "band_bias_matrix", "T",
        id="T-0"),
    row("cosformer_attention", lambda: L.cosformer_attention(*qkv(), causal="no"), TypeError, "cosformer_attention",
        "causal", id="causal-str"),
    row("cosformer_attention", lambda: L.cosformer_attention(*qkv(), variant="lambda", lam=2.0), ValueError,
        "cosformer_attention", "lam", id="lam-2"),
    row("cosformer_attention_matrix", lambda: L.cosformer_attention_matrix(q4(), q4(), causal=0), TypeError,
        "cosformer_attention_matrix", "causal", id="causal-int"),
    row("cosformer_weights", lambda: L.cosformer_weights(4, dtype="float64"), TypeError, "cosformer_weights", "dtype",
        id="dtype-str"),
    row("cosformer_weights", lambda: L.cosformer_weights(4, M=3), ValueError, "cosformer_weights", "M", id="M-below-T"),
    row("cosformer_weights", lambda: L.cosformer_weights(4, M=INF), ValueError, "cosformer_weights", "M", id="M-inf"),
    row("key_normalized_attention", lambda: L.key_normalized_attention(*qkv(), causal="no"), TypeError,
        "key_normalized_attention", "causal", id="causal-str"),
    row("key_normalized_attention", lambda: L.key_normalized_attention(-q4(), q4(), q4()), ValueError,
        "key_normalized_attention", "q", "non-negative", id="negative-q"),
    row("key_normalized_attention_matrix", lambda: L.key_normalized_attention_matrix(q4(), q4(), eps=NAN), ValueError,
        "key_normalized_attention_matrix", "eps", id="eps-nan"),
    row("sinusoidal_positions", lambda: L.sinusoidal_positions(4, 6, base=1.0), ValueError, "sinusoidal_positions",
        "base", id="base-1"),
    row("sinusoidal_positions", lambda: L.sinusoidal_positions(4, 6, base=INF), ValueError, "sinusoidal_positions",
        "base", id="base-inf"),
    row("sinusoidal_positions", lambda: L.sinusoidal_positions(4, 6, dtype=torch.int64), TypeError,
        "sinusoidal_positions", "dtype", id="dtype-int"),
    # --- ssm.py
    row("gla_attention", lambda: L.gla_attention(*gla_args(), initial_state=State(torch.full((1, 2, 3, 5), NAN))),
        ValueError, "gla_attention", r"initial_state\.S", "NaN", id="nan-state"),
    row("gla_attention", lambda: L.gla_attention(*gla_args(), initial_state=torch.zeros(1, 2, 3, 5)), TypeError,
        "gla_attention", "initial_state", id="state-tensor"),
    row("gla_attention", lambda: L.gla_attention(*gla_args(), return_state="yes"), TypeError, "gla_attention",
        "return_state", id="return_state-str"),
    row("gla_attention",
        lambda: L.gla_attention(*gla_args(), initial_state=State(torch.zeros(1, 2, 3, 5), torch.zeros(1, 2, 3))),
        ValueError, "gla_attention", r"initial_state\.z", "None", id="state-with-z"),
    row("retnet_log_decay", lambda: L.retnet_log_decay(0), ValueError, "retnet_log_decay", "H", id="H-0"),
    row("retnet_log_decay", lambda: L.retnet_log_decay(4, dtype=torch.long), TypeError, "retnet_log_decay", "dtype",
        id="dtype-int"),
    row("rwkv4_wkv", lambda: L.rwkv4_wkv(-torch.ones(3), *wkv_args()[1:]), ValueError, "rwkv4_wkv", "w", id="w-negative"),
    row("selective_scan_reference",
        lambda: L.selective_scan_reference(*ssd_args(), initial_state=torch.full((1, 2, 3, 5), NAN)), ValueError,
        "selective_scan_reference", "initial_state", "NaN", id="nan-state"),
    row("selective_scan_reference", lambda: L.selective_scan_reference(*ssd_args(), return_state="no"), TypeError,
        "selective_scan_reference", "return_state", id="return_state-str"),
    row("semiseparable_matrix", lambda: L.semiseparable_matrix(torch.rand(1, 2, 4, 3), torch.rand(1, 2, 4, 3),
                                                               torch.ones(2)), ValueError, "semiseparable_matrix", "log_a",
        id="log_a-positive"),
    row("ssd", lambda: L.ssd(*ssd_args(), return_state="no"), TypeError, "ssd", "return_state", id="return_state-str"),
    row("ssd", lambda: L.ssd(*ssd_args(), initial_state=State(torch.full((1, 2, 5, 3), NAN))), ValueError, "ssd",
        r"initial_state\.S", "NaN", id="nan-state"),
    row("ssd", lambda: L.ssd(*ssd_args(), chunk_size=0), ValueError, "ssd", "chunk_size", id="chunk_size-0"),
    row("zoh_discretize", lambda: L.zoh_discretize(-torch.rand(2, 3), torch.rand(2, 3), -torch.rand(2)), ValueError,
        "zoh_discretize", "dt", id="dt-negative"),
    # --- core/decode.py
    row("KVCacheDecoder", lambda: L.KVCacheDecoder(1, 2, 3, 4, scale=NAN), ValueError, "KVCacheDecoder", "scale",
        id="scale-nan"),
    row("KVCacheDecoder", lambda: L.KVCacheDecoder(1, 2, 3, 4, dtype="float32"), TypeError, "KVCacheDecoder", "dtype",
        id="dtype-str"),
    row("KVCacheDecoder", lambda: L.KVCacheDecoder(3, 2, 8, 8).step(token()[0], token(), token()), ValueError,
        "KVCacheDecoder.step", "q_t", r"\(B, H, D\)", id="2d-q_t-names-BHD"),
    row("RecurrentDecoder", lambda: L.RecurrentDecoder(1, 2, 3, 4, normalize="no"), TypeError, "RecurrentDecoder",
        "normalize", id="normalize-str"),
    row("RecurrentDecoder", lambda: L.RecurrentDecoder(1, 2, 3, 4, initial_state=torch.zeros(1, 2, 3, 4)), TypeError,
        "RecurrentDecoder", "initial_state", "LinearAttentionState", id="state-tensor"),
    row("RecurrentDecoder",
        lambda: L.RecurrentDecoder(1, 2, 3, 4, initial_state=State(torch.full((1, 2, 3, 4), NAN), torch.zeros(1, 2, 3))),
        ValueError, "RecurrentDecoder", r"initial_state\.S", "NaN", id="nan-state"),
    row("RecurrentDecoder", lambda: L.RecurrentDecoder(1, 2, 3, 4, eps=INF), ValueError, "RecurrentDecoder", "eps",
        id="eps-inf"),
    row("RecurrentDecoder", lambda: L.RecurrentDecoder(3, 2, 8, 8).step(token()[0], token(), token()), ValueError,
        "RecurrentDecoder.step", "q_t", r"\(B, H, D\)", id="2d-q_t-names-BHD"),
    # --- nn/models.py
    row("LinearAttention", lambda: L.LinearAttention(16, 0), ValueError, "LinearAttention", "n_heads", id="heads-0"),
    row("LinearAttention", lambda: L.LinearAttention(16, -4), ValueError, "LinearAttention", "n_heads",
        id="heads-negative"),
    row("LinearAttention", lambda: L.LinearAttention(16, 3), ValueError, "LinearAttention", "d_model", "divisible",
        id="not-divisible"),
    row("LinearAttention", lambda: layer(seed="a"), TypeError, "LinearAttention", "seed", id="seed-str"),
    row("LinearAttention", lambda: layer()(torch.rand(5, 16)), ValueError, "LinearAttention", "x", r"\(B, T, d_model\)",
        id="2d-x"),
    row("LinearAttention", lambda: layer()(torch.rand(1, 2, 5, 16)), ValueError, "LinearAttention", "x",
        r"\(B, T, d_model\)", id="4d-x"),
    row("LinearAttention", lambda: layer()(torch.rand(1, 5, 12)), ValueError, "LinearAttention", "x", "d_model=16",
        id="x-wrong-width"),
    row("LinearAttention", lambda: layer()(torch.rand(1, 5, 16), return_state="no"), TypeError, "LinearAttention",
        "return_state", id="return_state-str"),
    row("LinearAttention", lambda: layer()(torch.rand(1, 5, 16), pos_offset=-1), ValueError, "LinearAttention",
        "pos_offset", id="pos_offset-negative"),
    row("LinearAttention",
        lambda: layer()(torch.rand(1, 5, 16), state=State(torch.zeros(1, 4, 4, 5), torch.zeros(1, 4, 4))), ValueError,
        "LinearAttention", r"state\.S", id="state-shape"),
    row("LinearAttention", lambda: layer()(torch.rand(2, 5, 16), attention_mask=torch.ones(2, 4)), ValueError,
        "LinearAttention", "attention_mask", r"\(B, T\) = \(2, 5\)", id="mask-shape"),
    row("LinearAttention", lambda: layer()(torch.rand(2, 5, 16), attention_mask=torch.full((2, 5), 2)), ValueError,
        "LinearAttention", "attention_mask", "0 .padding. and 1", id="mask-values"),
    row("LinearAttention",
        lambda: layer()(torch.rand(1, 5, 16), attention_mask=torch.ones(1, 5),
                        cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32)),
        ValueError, "LinearAttention", "attention_mask", "no `cu_seqlens`", id="mask-with-cu_seqlens"),
    row("LinearAttention",
        lambda: layer(kind="cosformer")(torch.rand(1, 5, 16), attention_mask=torch.ones(1, 5), return_state=True),
        ValueError, "LinearAttention(cosformer)", "attention_mask", "no state is returned",
        id="cosformer-mask-state"),
    row("ModelConfig", lambda: cfg(softmax_layers=(5,)), ValueError, "ModelConfig", "softmax_layers", id="layer-5-of-2"),
    row("ModelConfig", lambda: cfg(softmax_layers=0), TypeError, "ModelConfig", "softmax_layers", id="layers-int"),
    row("ModelConfig", lambda: cfg(vocab_size=0), ValueError, "ModelConfig", "vocab_size", id="vocab-0"),
    row("ModelConfig", lambda: cfg(d_model=9), ValueError, "ModelConfig", "d_model", "divisible", id="not-divisible"),
    row("ModelConfig", lambda: cfg(n_head=0), ValueError, "ModelConfig", "n_head", id="n_head-0"),
    row("ModelConfig", lambda: cfg(attention="flash"), ValueError, "ModelConfig", "attention", id="attention"),
    row("TinyLM", lambda: L.TinyLM({"vocab_size": 11}), TypeError, "TinyLM", "cfg", id="cfg-dict"),
    row("TinyLM", lambda: lm()(ids(5)), ValueError, "TinyLM", "idx", r"\(B, T\)", id="1d-idx-names-BT"),
    row("TinyLM", lambda: lm()(torch.zeros(1, 5)), TypeError, "TinyLM", "idx", "integer", id="float-idx"),
    row("TinyLM", lambda: lm()(ids(1, 5) + 11), ValueError, "TinyLM", "idx", "vocab_size", id="id-out-of-range"),
    row("TinyLM", lambda: lm()(ids(1, 5), ids(1, 4)), ValueError, "TinyLM", "targets", id="targets-shape"),
    row("TinyLM", lambda: lm()(ids(1, 5), states=[None]), ValueError, "TinyLM", "states", "n_layer=2",
        id="states-too-few"),
    row("TinyLM", lambda: lm().generate(ids(1, 3), 4, temperature=-1), ValueError, "TinyLM.generate", "temperature",
        id="temperature-negative"),
    row("TinyLM", lambda: lm().generate(ids(1, 3), 4, temperature=NAN), ValueError, "TinyLM.generate", "temperature",
        id="temperature-nan"),
    row("TinyLM", lambda: lm().generate(ids(1, 3), -3), ValueError, "TinyLM.generate", "max_new_tokens",
        id="max_new_tokens-negative"),
    row("TinyLM", lambda: lm().generate(ids(1, 3), 2, greedy="yes"), TypeError, "TinyLM.generate", "greedy",
        id="greedy-str"),
    # --- distributed/: the argument checks run before any collective, so no process group
    row("sequence_parallel_linear_attention", lambda: L.sequence_parallel_linear_attention(q4()[0], q4(), q4()),
        ValueError, "sequence_parallel_linear_attention", "q", r"\(B, H, T, D\)", id="3d-q"),
    row("ring_attention", lambda: L.ring_attention(q4()[0], q4(), q4(), seq_len=4), ValueError, "ring_attention", "q",
        r"\(B, H, T, D\)", id="3d-q"),
    row("launch", lambda: L.launch(print, 0), ValueError, "launch", "world_size", id="world_size-0"),
    # --- core/features.py: Based's Taylor map
    row("taylor_features", lambda: L.taylor_features(torch.rand(3, 4), scale=0.0), ValueError, "taylor_features",
        "scale", id="scale-0"),
    row("taylor_kernel", lambda: L.taylor_kernel(torch.rand(3, 4), torch.rand(2, 5)), ValueError, "taylor_kernel", "k",
        id="d-mismatch"),
    # --- core/rotary.py
    row("rotary_angles", lambda: L.rotary_angles(4, 5), ValueError, "rotary_angles", "dim", id="odd-dim"),
    row("rotary_embedding", lambda: L.rotary_embedding(torch.rand(1, 2, 4, 5)), ValueError, "rotary_embedding", "x",
        id="odd-D"),
    row("rotary_linear_attention", lambda: L.rotary_linear_attention(-q4(), q4(), q4()), ValueError,
        "rotary_linear_attention", "q", id="negative-features"),
    row("rotary_linear_attention_matrix", lambda: L.rotary_linear_attention_matrix(q4(), q4(), base=-1.0), ValueError,
        "rotary_linear_attention_matrix", "base", id="base-negative"),
    # --- core/ssm.py: RWKV-5/6
    row("rwkv6_attention", lambda: L.rwkv6_attention(*qkv(), torch.rand(1, 2, 4, 8), torch.zeros(2, 8)), ValueError,
        "rwkv6_attention", "log_w", id="log_w-positive"),
    # --- core/gla.py: a NaN in v at the last token would reach every earlier output through the
    # chunk's masked matmuls (0 * NaN), so every form refuses it, as linear_attention does
    row("gla_chunkwise", lambda: L.gla_chunkwise(*_nan_last(qkv()), -torch.rand(1, 2, 4, 8)),
        ValueError, "gla_chunkwise", "v", "non-finite", id="nan-v"),
    row("gla_attention", lambda: L.gla_attention(*_nan_last(gla_args()[:3]), gla_args()[3]),
        ValueError, "gla_attention", "v", "non-finite", id="nan-v-chunked"),
    row("gla_attention", lambda: L.gla_attention(*_nan_last(gla_args()[:3]), gla_args()[3], form="quadratic"),
        ValueError, "gla_attention", "v", "non-finite", id="nan-v-quadratic"),
    row("gla_chunkwise", lambda: L.gla_chunkwise(*qkv(), -torch.rand(1, 2, 4, 8), chunk_size=8, sub_chunk=3),
        ValueError, "gla_chunkwise", "sub_chunk", id="sub_chunk-not-dividing"),
    # --- core/delta.py
    row("delta_rule_attention", lambda: L.delta_rule_attention(*qkv(), torch.full((1, 2, 4), 2.5)), ValueError,
        "delta_rule_attention", "beta", id="beta-above-2"),
    row("delta_rule_attention", lambda: L.delta_rule_attention(*qkv(), torch.rand(1, 2, 4), check_unit_keys=True),
        ValueError, "delta_rule_attention", "k", id="keys-not-unit"),
    row("delta_rule_decode_step", lambda: L.delta_rule_decode_step(token(), token(), token(), torch.rand(3), None),
        ValueError, "delta_rule_decode_step", "beta", id="beta-shape"),
    # --- core/masks.py
    row("segsum", lambda: L.segsum(torch.tensor(1.0)), ValueError, "segsum", "g", id="0d-g"),
    row("decay_mask", lambda: L.decay_mask(torch.tensor([0.5, -0.1])), ValueError, "decay_mask", "log_decay",
        id="positive"),
    row("causal_mask", lambda: L.causal_mask(3.5), ValueError, "causal_mask", "T", id="T-float"),
]

# Public names that take no input of their own, with the reason.
EXEMPT = {
    "LinearAttentionState": "a NamedTuple container (S, z); its fields are checked where a state is used "
    "(the `initial_state` / `state` rows above)",
}


@pytest.mark.parametrize("name, call, exc, fn, arg, detail", ROWS)
def test_bad_input(name, call, exc, fn, arg, detail):
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    named = rf"{re.escape(fn)}: .*`(?:{arg})`"
    assert re.search(named, message, flags=re.S), f"the message should name {fn} and `{arg}`: {message!r}"
    if detail is not None:
        assert re.search(detail, message, flags=re.S), f"the message should say {detail!r}: {message!r}"


def test_every_public_name_has_a_row():
    covered = {p.values[0] for p in ROWS}
    public = set(L.__all__)
    missing = sorted(public - covered - set(EXEMPT))
    assert not missing, f"public names without a bad-input row in tests/test_bad_inputs.py: {missing}"
    assert not covered - public, f"rows for names that are not public: {sorted(covered - public)}"
    assert not set(EXEMPT) & covered, "a name is exempt and has a row: drop it from EXEMPT"
    assert set(EXEMPT) <= public, f"stale exemptions: {sorted(set(EXEMPT) - public)}"


def test_good_calls_still_pass():
    """The checks refuse the bad values only: numpy integers, numpy bools and 0-dim sizes pass."""
    q, k, v = qkv()
    assert L.softmax_attention(q, k, v, causal=np.bool_(True), scale=np.float32(0.5)).shape == v.shape
    assert L.RandomFeatureMap(np.int64(8), np.int64(6), seed=np.int64(3))(torch.rand(4, 8)).shape == (4, 6)
    model = lm(softmax_layers=(1,))
    out = model.generate(ids(1, 3), np.int64(2), temperature=0.5, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 5)
    assert model.generate(ids(1, 3), 0).shape == (1, 3)
    logits, loss = model(ids(1, 4), torch.tensor([[1, -100, 2, 3]]))
    assert torch.isfinite(loss)
    dec = L.RecurrentDecoder(3, 2, 8, 8, initial_state=decode_state())
    assert dec.step(token(), token(), token()).shape == (3, 2, 8)


def test_wrappers_name_themselves_when_the_triton_backend_refuses_the_inputs():
    """bf16 on CPU would run in the Triton interpreter, which has no bf16 arithmetic: a wrapper
    that passes backend="triton" on says so in its own name, before computing its features."""
    q = torch.rand(1, 2, 16, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"^performer_attention: bfloat16 on CPU"):
        L.performer_attention(q, q, q, backend="triton")
