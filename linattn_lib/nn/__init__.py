"""torch.nn modules built on `linattn_lib.core`: the attention layers, a small model zoo."""
from .conv import ConvLayerState, ShortConvolution
from .layers import FLA_PRESETS, fla_layer
from .models import ATTENTION_KINDS, LINEAR_KINDS, LinearAttention, ModelConfig, TinyLM

__all__ = ["ATTENTION_KINDS", "LINEAR_KINDS", "ConvLayerState", "FLA_PRESETS", "LinearAttention", "ModelConfig",
           "ShortConvolution", "TinyLM", "fla_layer"]
