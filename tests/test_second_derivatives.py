"""Second derivatives: the paths whose backward is computed (the chunked walk, the Triton
ops) refuse them at once (core/once.py) instead of leaving themselves out of a gradient
penalty; the plain-torch forms give them exactly; first derivatives and checkpointing are
untouched."""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from linattn_lib import (
    LinearAttention,
    delta_rule_attention,
    elu_plus_one,
    gaussian_matrix,
    linear_attention,
    positive_random_features,
)
from linattn_lib.core.state import DEFAULT_EPS
from linattn_lib.core.triton_ops import triton_available

D64 = torch.float64
needs_triton = pytest.mark.skipif(not triton_available(), reason="needs the Triton kernels")


def _inputs(dtype=D64, T=12, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, T, d, generator=g, dtype=dtype).requires_grad_() for _ in range(3)]


def _penalty(attend, q, k, v):
    """A gradient penalty behind a fixed linear readout: the incoming gradient of the op
    does not require grad, the case torch's once_differentiable let through silently."""
    c = torch.ones_like(v)
    o = attend(elu_plus_one(q), elu_plus_one(k), v)
    (gq,) = torch.autograd.grad((o * c).sum(), q, create_graph=True)
    gq.pow(2).sum().backward()
    return [x.grad for x in (q, k, v)]


def _dense(q, k, v):
    """Causal normalised linear attention written out: (tril(Q K^T) V) / (row sums + eps)."""
    scores = (q @ k.transpose(-1, -2)).tril()
    return (scores @ v) / (scores.sum(-1, keepdim=True) + DEFAULT_EPS)


@pytest.mark.parametrize("decay", [None, "token"])
def test_chunked_form_refuses_a_second_derivative(decay):
    q, k, v = _inputs()
    g = None if decay is None else -torch.rand(1, 2, 12, dtype=D64)
    with pytest.raises(NotImplementedError, match=r"form='chunked'.*second derivatives.*form='quadratic'"):
        _penalty(lambda a, b, c: linear_attention(a, b, c, log_decay=g, chunk_size=4), q, k, v)


def test_layer_refuses_a_second_derivative_behind_a_frozen_projection():
    torch.manual_seed(0)
    layer = LinearAttention(16, 2, kind="linear").double()
    layer.proj.weight.requires_grad_(False)
    x = torch.randn(1, 10, 16, dtype=D64, requires_grad=True)
    with pytest.raises(NotImplementedError, match="second derivatives"):
        torch.autograd.grad(layer(x).sum(), x, create_graph=True)
    layer(x).sum().backward()  # a first derivative as before
    assert layer.qkv.weight.grad is not None and torch.isfinite(layer.qkv.weight.grad).all()


@pytest.mark.parametrize("form", ["quadratic", "recurrent"])
def test_plain_torch_forms_have_exact_second_derivatives(form):
    q, k, v = _inputs(T=6, d=3)
    g = -torch.rand(1, 2, 6, dtype=D64, requires_grad=True)

    def f(q, k, v, g):
        return linear_attention(elu_plus_one(q), elu_plus_one(k), v, log_decay=g, form=form)

    assert torch.autograd.gradgradcheck(f, (q, k, v, g))
    got = _penalty(lambda a, b, c: linear_attention(a, b, c, form=form), *_inputs())
    want = _penalty(_dense, *_inputs())  # not a form of the library (a review: "quadratic" was its own want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_first_derivatives_and_checkpointing_are_unchanged():
    q, k, v = _inputs()

    def attend(q, k, v):
        return linear_attention(elu_plus_one(q), elu_plus_one(k), v, chunk_size=4)

    want = torch.autograd.grad(attend(q, k, v).square().sum(), (q, k, v))
    for reentrant in (True, False):  # the reentrant one runs a backward inside a backward
        for x in (q, k, v):
            x.grad = None
        checkpoint(attend, q, k, v, use_reentrant=reentrant).square().sum().backward()
        for x, w in zip((q, k, v), want):
            torch.testing.assert_close(x.grad, w, rtol=0, atol=0)


@needs_triton
def test_triton_ops_refuse_a_second_derivative():
    q, k, v = _inputs(torch.float32, T=16, d=16)
    with pytest.raises(NotImplementedError, match=r"backend='triton'.*second derivatives"):
        _penalty(lambda a, b, c: linear_attention(a, b, c, backend="triton"), q, k, v)
    # the non-causal kernels run as the custom op even in eager mode: its backward is guarded too
    with pytest.raises(NotImplementedError, match=r"causal=False, backend='triton'"):
        _penalty(lambda a, b, c: linear_attention(a, b, c, causal=False, backend="triton"), *_inputs(
            torch.float32, T=16, d=16))
    beta = torch.rand(1, 2, 16).requires_grad_()
    kn = torch.nn.functional.normalize(k.detach(), dim=-1).requires_grad_()
    o = delta_rule_attention(q, kn, v, beta, backend="triton")
    with pytest.raises(NotImplementedError, match=r"delta_rule_attention\(backend='triton'\)"):
        torch.autograd.grad(o.sum(), beta, create_graph=True)
    x = torch.randn(5, 16, requires_grad=True)
    phi = positive_random_features(x, gaussian_matrix(8, 16, seed=0), backend="triton")
    with pytest.raises(NotImplementedError, match=r"positive_random_features\(backend='triton'\)"):
        torch.autograd.grad(phi.sum(), x, create_graph=True)
    # the first derivatives as before
    (gx,) = torch.autograd.grad(
        positive_random_features(x, gaussian_matrix(8, 16, seed=0), backend="triton").sum(), x)
    (want,) = torch.autograd.grad(positive_random_features(x, gaussian_matrix(8, 16, seed=0)).sum(), x)
    torch.testing.assert_close(gx, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["linear", "retnet", "gated_deltanet"])
def test_layer_forms_agree_and_the_plain_ones_have_second_derivatives(kind):
    torch.manual_seed(0)
    forms = ("chunked", "recurrent", "quadratic")
    layers = {f: LinearAttention(16, 2, kind=kind, form=f, chunk_size=4).double() for f in forms}
    for layer in layers.values():
        layer.load_state_dict(layers["chunked"].state_dict())
    x = torch.randn(2, 9, 16, dtype=D64, requires_grad=True)
    want = layers["chunked"](x)
    for f in forms[1:]:
        torch.testing.assert_close(layers[f](x), want, rtol=1e-10, atol=1e-12)
    # the delta rule's torch forms are all plain autograd; linear attention's chunked walk is not
    twice = forms if kind == "gated_deltanet" else forms[1:]
    penalty = {}
    for f in twice:  # a gradient penalty on the input, through the layer's weights
        (gx,) = torch.autograd.grad(layers[f](x).sum(), x, create_graph=True)
        (penalty[f],) = torch.autograd.grad(gx.pow(2).sum(), layers[f].qkv.weight)
    assert penalty["recurrent"].abs().max() > 0
    for f in twice:
        torch.testing.assert_close(penalty[f], penalty["quadratic"], rtol=1e-9, atol=1e-11)
    if "chunked" not in twice:
        with pytest.raises(NotImplementedError, match=r"LinearAttention\(form=\.\.\.\)"):
            torch.autograd.grad(layers["chunked"](x).sum(), x, create_graph=True)
    with pytest.raises(ValueError, match="form"):
        LinearAttention(16, 2, kind=kind, form="fast")
