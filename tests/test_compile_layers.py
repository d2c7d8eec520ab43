"""Every layer kind as one graph: `torch.compile(fullgraph=True)` of `LinearAttention`, forward
and backward, equal to eager mode (float64, CPU, the default torch path).

aot_eager (AOT autograd without code generation: the graph that inductor would receive) for
every kind; inductor, which generates C++ on CPU (about 40 s a kind on 2 cores), for the kind
that uses most of the library (gated_deltanet: decay, delta rule, output norm). Three things used to break here: an `out=` into a non-contiguous
slice in the chunked backward, gradients of permuted inputs (a head split, a transposed decay)
returned in other strides by the chunked Function, and softplus's backward after a cumsum
under AOT autograd. The Triton paths and packed batches are compiled in test_custom_ops.py.
"""
from __future__ import annotations

import pytest
import torch

from linattn_lib import LinearAttention
from linattn_lib.nn.models import LINEAR_KINDS

INDUCTOR_KINDS = ("gated_deltanet",)


def _run(fn, x):
    y = fn(x)
    (g,) = torch.autograd.grad(y.square().sum(), x)
    return y.detach(), g


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("kind", LINEAR_KINDS)
def test_layer_compiles_as_one_graph(kind, backend):
    if backend == "inductor" and kind not in INDUCTOR_KINDS:
        pytest.skip("inductor: one kind (aot_eager covers every kind)")
    torch.manual_seed(0)
    layer = LinearAttention(16, 2, kind=kind, chunk_size=16).double()
    x = torch.randn(2, 40, 16, dtype=torch.float64, requires_grad=True)  # T = 40: a partial chunk
    torch._dynamo.reset()
    y, g = _run(layer, x)
    yc, gc = _run(torch.compile(layer, fullgraph=True, backend=backend), x)
    assert (yc - y).abs().max() < 1e-12 and (gc - g).abs().max() < 1e-12


def test_delta_rule_on_the_kernels_compiles_as_one_graph():
    """delta_rule_attention(backend="triton") under fullgraph (the custom ops of delta_ops.py;
    its autograd Function used to break the graph), forward and backward, equal to eager."""
    pytest.importorskip("triton")
    import torch.nn.functional as F

    from linattn_lib import delta_rule_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 16, requires_grad=True) for _ in range(3))
    x = torch.randn(1, 40, 2, requires_grad=True)

    def attend(q, k, v, x):
        beta, g = torch.sigmoid(x).transpose(1, 2), F.logsigmoid(-x).transpose(1, 2)
        o, st = delta_rule_attention(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, beta, log_decay=g,
                                     backend="triton", return_state=True)
        return o.square().sum() + st.S.sum()

    torch._dynamo.reset()
    grads = torch.autograd.grad(attend(q, k, v, x), (q, k, v, x))
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    grads_c = torch.autograd.grad(compiled(q, k, v, x), (q, k, v, x))
    assert all((a - b).abs().max() < 1e-6 for a, b in zip(grads, grads_c))


@pytest.mark.parametrize("decay, state", [(None, False), ("token", True)])
def test_opcheck_delta_ops(decay, state):
    """torch.library.opcheck on linattn::delta_fwd and delta_bwd: schema, fake tensors,
    autograd registration and AOT dispatch agree with the real kernels (interpreter on CPU)."""
    pytest.importorskip("triton")
    import torch.nn.functional as F

    from linattn_lib.core import delta_ops  # noqa: F401 - registers the ops

    gen = torch.Generator().manual_seed(0)
    B, H, T, D = 1, 2, 24, 16
    q = torch.randn(B, H, T, D, generator=gen, requires_grad=True)
    k = F.normalize(torch.randn(B, H, T, D, generator=gen), dim=-1).requires_grad_()
    v = torch.randn(B, H, T, D, generator=gen, requires_grad=True)
    beta = torch.rand(B, H, T, generator=gen, requires_grad=True)
    g = -torch.rand(B, H, T, generator=gen) if decay else None
    S0 = torch.randn(B, H, D, D, generator=gen) if state else None
    torch.library.opcheck(torch.ops.linattn.delta_fwd.default, (q, k, v, beta, g, S0, None))
    do, dS = torch.randn(B, H, T, D, generator=gen), torch.randn(B, H, D, D, generator=gen)
    args = (q.detach(), k.detach(), v.detach(), beta.detach(), g, S0, do, dS, None)
    torch.library.opcheck(torch.ops.linattn.delta_bwd.default, args)


def test_production_layer_compiles_as_one_graph():
    """Gated DeltaNet with SiLU, Mamba-2's gate and the output gate (fla's layer without its
    short convolution), fullgraph with aot_eager, equal to eager."""
    torch.manual_seed(0)
    layer = LinearAttention(16, 2, kind="gated_deltanet", chunk_size=16, activation="silu", gate="mamba",
                            output_gate=True).double()
    x = torch.randn(2, 40, 16, dtype=torch.float64, requires_grad=True)
    torch._dynamo.reset()
    y, g = _run(layer, x)
    yc, gc = _run(torch.compile(layer, fullgraph=True, backend="aot_eager"), x)
    assert (yc - y).abs().max() < 1e-12 and (gc - g).abs().max() < 1e-12
