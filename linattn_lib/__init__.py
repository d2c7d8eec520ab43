"""linattn_lib: linear attention, exact references and fast kernels.

Layout everywhere is (B, H, T, D), like torch.nn.functional.scaled_dot_product_attention.
"""
from .attention import (
    LinearAttentionState,
    linear_attention,
    softmax_attention,
    softmax_attention_weights,
)
from .features import (
    RandomFeatureMap,
    clipped_trig_features,
    default_num_features,
    elu_plus_one,
    gaussian_kernel,
    gaussian_matrix,
    hyperbolic_random_features,
    orthogonal_gaussian_matrix,
    positive_random_features,
    random_projection,
    relu,
    rff_features,
    softmax_kernel,
    trig_softmax_features,
)
from .masks import causal_mask, decay_mask, segsum
from .performer import performer_attention
from .positional import (
    band_bias_attention,
    band_bias_matrix,
    cosformer_attention,
    cosformer_attention_matrix,
    cosformer_weights,
    key_normalized_attention,
    key_normalized_attention_matrix,
    sinusoidal_positions,
)
from .ssm import (
    gla_attention,
    retnet_log_decay,
    rwkv4_wkv,
    selective_scan_reference,
    semiseparable_matrix,
    ssd,
    zoh_discretize,
)
from .decoding import KVCacheDecoder, RecurrentDecoder
from .models import LinearAttention, ModelConfig, TinyLM
from ._triton import linear_attention_decode_step

__version__ = "0.1.0"

# imported on first use: `python -m linattn_lib.distributed` must not find it imported already
_LAZY = {
    "sequence_parallel_linear_attention": "distributed",
    "ring_attention": "distributed",
    "launch": "distributed",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'linattn_lib' has no attribute {name!r}")

__all__ = [
    "LinearAttentionState",
    "linear_attention",
    "softmax_attention",
    "linear_attention_decode_step",
    "softmax_attention_weights",
    "RandomFeatureMap",
    "clipped_trig_features",
    "default_num_features",
    "elu_plus_one",
    "gaussian_kernel",
    "gaussian_matrix",
    "hyperbolic_random_features",
    "orthogonal_gaussian_matrix",
    "positive_random_features",
    "random_projection",
    "relu",
    "rff_features",
    "softmax_kernel",
    "trig_softmax_features",
    "performer_attention",
    "band_bias_attention",
    "band_bias_matrix",
    "cosformer_attention",
    "cosformer_attention_matrix",
    "cosformer_weights",
    "key_normalized_attention",
    "key_normalized_attention_matrix",
    "sinusoidal_positions",
    "gla_attention",
    "retnet_log_decay",
    "rwkv4_wkv",
    "selective_scan_reference",
    "semiseparable_matrix",
    "ssd",
    "zoh_discretize",
    "KVCacheDecoder",
    "RecurrentDecoder",
    "LinearAttention",
    "ModelConfig",
    "TinyLM",
    "sequence_parallel_linear_attention",
    "ring_attention",
    "launch",
    "segsum",
    "decay_mask",
    "causal_mask",
]
