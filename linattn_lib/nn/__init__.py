"""torch.nn modules built on `linattn_lib.core`: one attention layer, a small model zoo."""
from .models import ATTENTION_KINDS, LINEAR_KINDS, LinearAttention, ModelConfig, TinyLM

__all__ = ["ATTENTION_KINDS", "LINEAR_KINDS", "LinearAttention", "ModelConfig", "TinyLM"]
