"""Autograd wrappers around the Triton kernels in `linattn_lib.kernels` (placeholder until they land)."""
from __future__ import annotations


def triton_available() -> bool:
    """True when the Triton kernels can be imported (on CUDA, or the interpreter on CPU)."""
    return False


def linear_attention_triton(q, k, v, **kwargs):
    raise RuntimeError("linear_attention: the Triton backend is not available in this build")
