"""linattn_lib: linear attention, exact references and fast kernels.

Layout everywhere is (B, H, T, D), like torch.nn.functional.scaled_dot_product_attention.
"""
from .attention import (
    LinearAttentionState,
    linear_attention,
    softmax_attention,
    softmax_attention_weights,
)
from .masks import causal_mask, decay_mask, segsum

__version__ = "0.1.0"

__all__ = [
    "LinearAttentionState",
    "linear_attention",
    "softmax_attention",
    "softmax_attention_weights",
    "segsum",
    "decay_mask",
    "causal_mask",
]
