"""Fast chunked linear attention for the torch backend (placeholder: the reference chunked form)."""
from __future__ import annotations


def chunked_linear_attention(q, k, v, *, causal, normalize, log_decay, eps, chunk_size, initial_state, return_state):
    from .attention import reference_linear_attention

    return reference_linear_attention(
        q, k, v, causal=causal, normalize=normalize, log_decay=log_decay, form="chunked",
        chunk_size=chunk_size, eps=eps, initial_state=initial_state, return_state=return_state,
    )
