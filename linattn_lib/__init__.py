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

__version__ = "0.1.0"

__all__ = [
    "LinearAttentionState",
    "linear_attention",
    "softmax_attention",
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
    "segsum",
    "decay_mask",
    "causal_mask",
]
