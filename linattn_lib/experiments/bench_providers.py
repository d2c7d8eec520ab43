"""The attention implementations the benchmark compares, on the same tensors (see `bench`).

* ``linattn-triton``  ``linear_attention(..., backend="triton")`` -- compiled kernels, CUDA only
* ``linattn-torch``   ``linear_attention(..., backend="torch")`` -- the chunked torch path
* ``naive-quadratic`` ``linear_attention(..., form="quadratic")`` -- materialises T x T
* ``sdpa``            ``torch.nn.functional.scaled_dot_product_attention(..., is_causal=True)``
* ``fla``             flash-linear-attention's ``chunk_linear_attn``, when it is installed (CUDA)
* ``fla-naive``       fla's torch reference ``naive_chunk_linear_attn`` (normalised), when it is
                      installed (fla-core, pure Python: the CPU benchmark's outside yardstick)

Used by the sweep (`bench`) and the CPU targets (`bench_targets`).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.linear import linear_attention
from ..core.triton_ops import triton_available
from ..flops import score_matrix_bytes

PROVIDERS = ("linattn-triton", "linattn-torch", "naive-quadratic", "sdpa", "fla", "fla-naive")
MODES = ("fwd", "fwd+bwd")


class Skip(Exception):
    """A provider that cannot run this configuration (with the reason)."""


def make_inputs(
    B: int, H: int, T: int, D: int, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    grad: bool = False, seed: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """q, k: non-negative features (what linear attention takes); v and the output gradient."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.rand(B, H, T, D, generator=g, dtype=torch.float32).to(device, dtype)
    k = torch.rand(B, H, T, D, generator=g, dtype=torch.float32).to(device, dtype)
    v = torch.randn(B, H, T, D, generator=g, dtype=torch.float32).to(device, dtype)
    do = torch.randn(B, H, T, D, generator=g, dtype=torch.float32).to(device, dtype)
    for x in (q, k, v):
        x.requires_grad_(grad)
    return q, k, v, do


def _fla_forward(q: Tensor, k: Tensor, v: Tensor) -> Callable[[], Tensor]:
    """flash-linear-attention's chunked kernel on copies of q, k, v in its (B, T, H, D) layout,
    made once, outside the timed calls; returns o in our (B, H, T, D) layout (a free view)."""
    try:
        from fla.ops.linear_attn import chunk_linear_attn
    except Exception as e:  # not installed, or no GPU build
        raise Skip(f"fla not importable ({type(e).__name__})") from e
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_(x.requires_grad) for x in (q, k, v))

    def run():
        qt.grad = kt.grad = vt.grad = None
        out = chunk_linear_attn(qt, kt, vt, scale=1.0, normalize=True)  # our features are unscaled
        o = out[0] if isinstance(out, tuple) else out
        return o.transpose(1, 2)

    return run


def _fla_naive_forward(q: Tensor, k: Tensor, v: Tensor) -> Callable[[], Tensor]:
    """fla's torch reference of the chunked algorithm (chunks of 64, normalised as ours) on
    (B, T, H, D) copies of q, k, v made once, outside the timed calls."""
    if q.shape[2] % 64:
        raise Skip("fla's naive chunk needs T a multiple of its chunk, 64")
    try:
        from fla.ops.linear_attn.naive import naive_chunk_linear_attn
    except Exception as e:  # fla-core not installed
        raise Skip(f"fla not importable ({type(e).__name__})") from e
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_(x.requires_grad) for x in (q, k, v))

    def run():
        out = naive_chunk_linear_attn(qt, kt, vt, scale=1.0, normalize=True)
        return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)

    return run


def provider_forward(
    name: str, q: Tensor, k: Tensor, v: Tensor, *, chunk_size: int, max_quadratic_bytes: float
) -> Callable[[], Tensor]:
    """A zero-argument callable running provider `name`'s forward on q, k, v (or Skip)."""
    B, H, T, D = q.shape
    if name == "linattn-torch":
        return lambda: linear_attention(q, k, v, chunk_size=chunk_size, backend="torch")
    if name == "linattn-triton":
        if not q.is_cuda:
            raise Skip("needs CUDA (on CPU the Triton backend is the interpreter)")
        if not triton_available():
            raise Skip("triton kernels not available")
        return lambda: linear_attention(q, k, v, chunk_size=chunk_size, backend="triton")
    if name == "naive-quadratic":
        need = score_matrix_bytes(T, H, dtype=q.dtype, batch=B) * 3  # scores, mask, product
        if need > max_quadratic_bytes:
            raise Skip(f"T x T matrices need ~{need / 2**30:.1f} GiB")
        return lambda: linear_attention(q, k, v, form="quadratic")
    if name == "sdpa":
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if name == "fla":
        if not q.is_cuda:
            raise Skip("needs CUDA")
        return _fla_forward(q, k, v)
    if name == "fla-naive":
        return _fla_naive_forward(q, k, v)
    raise ValueError(f"bench: unknown provider {name!r}; expected one of {', '.join(PROVIDERS)}")


def provider_call(
    name: str, mode: str, q: Tensor, k: Tensor, v: Tensor, do: Tensor, *, chunk_size: int,
    max_quadratic_bytes: float = 2**31,
) -> Callable[[], object]:
    """The callable to time: forward only, or forward + backward (gradients reset each call)."""
    fwd = provider_forward(name, q, k, v, chunk_size=chunk_size, max_quadratic_bytes=max_quadratic_bytes)
    if mode == "fwd":
        return fwd
    if name == "naive-quadratic":  # autograd keeps several T x T matrices
        B, H, T, _ = q.shape
        if score_matrix_bytes(T, H, dtype=q.dtype, batch=B) * 6 > max_quadratic_bytes:
            raise Skip("backward of the T x T form does not fit the memory limit")

    def fwd_bwd():
        fwd().backward(do)
        q.grad = k.grad = v.grad = None

    return fwd_bwd
