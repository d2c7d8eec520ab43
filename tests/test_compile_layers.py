"""Every layer kind as one graph: `torch.compile(fullgraph=True)` of `LinearAttention`, forward
and backward, equal to eager mode (float64, CPU, the default torch path).

Both backends for every kind: aot_eager (AOT autograd without code generation: the graph that
inductor would receive) and inductor, which generates C++ on CPU (up to about 40 s a kind on
2 cores with a cold cache). Three things used to break here: an `out=` into a non-contiguous slice in the chunked backward,
gradients of permuted inputs (a head split, a transposed decay) returned in other strides by the
chunked Function, and softplus's backward after a cumsum under AOT autograd. Packed batches
(`cu_seqlens`) compile through the custom ops of core/packed_ops.py, the delta rule on the Triton
kernels through those of core/delta_ops.py; both are checked here with torch.library.opcheck.
"""
from __future__ import annotations

import pytest
import torch

from linattn_lib import LinearAttention
from linattn_lib.nn.models import LINEAR_KINDS


def _run(fn, x):
    y = fn(x)
    (g,) = torch.autograd.grad(y.square().sum(), x)
    return y.detach(), g


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("kind", LINEAR_KINDS)
def test_layer_compiles_as_one_graph(kind, backend):
    torch.manual_seed(0)
    layer = LinearAttention(16, 2, kind=kind, chunk_size=16).double()
    x = torch.randn(2, 40, 16, dtype=torch.float64, requires_grad=True)  # T = 40: a partial chunk
    torch._dynamo.reset()
    y, g = _run(layer, x)
    yc, gc = _run(torch.compile(layer, fullgraph=True, backend=backend), x)
    assert (yc - y).abs().max() < 1e-12 and (gc - g).abs().max() < 1e-12


class _Compiles:
    """A torch.compile backend that counts the graphs it is given (then runs `backend`)."""

    def __init__(self, backend: str):
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs, self._backend = 0, lookup_backend(backend)

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return self._backend(gm, example_inputs)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind", LINEAR_KINDS)
def test_layer_compiles_once_for_every_length(kind, backend, monkeypatch):
    """A training loop meets several lengths (the last batch, evaluation). The layer compiled
    with fullgraph must trace each, equal to eager, and stop recompiling once T is symbolic
    (no new graph at the third length). The torch path's block loops broke the
    trace at the second length; a delta kind compiled before any eager call failed to import
    the kernels inside the trace, and returned head dims the kernels pad (8 here) in strides
    its fake did not announce (opcheck below). Triton: the interpreter, float32, traced by
    Dynamo alone (aot_eager trips there on a stride that torch's fake elu_backward and its CPU
    kernel lay out differently: (512, 16, 32, 1) against (512, 256, 16, 1) for a contiguous
    gradient and a head-split input, the "view size is not compatible" of pytorch/pytorch
    #120035, which aot_eager runs verbatim and inductor rewrites; inductor runs it, at about
    40 s a kind); torch: float64, aot_eager."""
    if backend == "triton":
        pytest.importorskip("triton")
        from linattn_lib.core import triton_ops

        monkeypatch.setattr(triton_ops, "_kernels", None)  # as in a fresh process: not imported yet
        monkeypatch.setattr(triton_ops, "_import_error", None)
    dtype = torch.float64 if backend == "torch" else torch.float32
    torch.manual_seed(0)
    layer = LinearAttention(16, 2, kind=kind, chunk_size=16, backend=backend).to(dtype)
    torch._dynamo.reset()
    counted = _Compiles("aot_eager" if backend == "torch" else "eager")
    compiled = torch.compile(layer, fullgraph=True, backend=counted)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    graphs = []
    for T in (40, 64, 100):
        x = torch.randn(2, T, 16, dtype=dtype, requires_grad=True)
        (y, g), (yc, gc) = _run(layer, x), _run(compiled, x)
        assert (yc - y).abs().max() < tol and (gc - g).abs().max() < tol, T
        graphs.append(counted.graphs)
    assert graphs[2] == graphs[1], graphs  # T symbolic since the second length: no new graph


@pytest.mark.parametrize("kind", LINEAR_KINDS)
def test_layer_compiles_once_with_dynamic_shapes(kind):
    """compile(dynamic=True) makes the layer's Python floats symbolic too (eps, the feature
    map's scale): the checks of those numbers used math.isfinite, which cannot take one. No
    new graph for the second length, equal to eager."""
    torch.manual_seed(0)
    layer = LinearAttention(16, 2, kind=kind, chunk_size=16).double()
    torch._dynamo.reset()
    counted = _Compiles("aot_eager")
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend=counted)
    graphs = []
    for T in (40, 70):
        x = torch.randn(2, T, 16, dtype=torch.float64, requires_grad=True)
        (y, g), (yc, gc) = _run(layer, x), _run(compiled, x)
        assert (yc - y).abs().max() < 1e-12 and (gc - g).abs().max() < 1e-12, T
        graphs.append(counted.graphs)
    assert graphs[1] == graphs[0], graphs


@pytest.mark.parametrize("kind", LINEAR_KINDS)
def test_layer_exports_with_a_symbolic_length(kind):
    """torch.export (deployment) with B and T symbolic (T up to cosFormer's max_len): the exported
    program equals eager at another length. Export runs the library's Python as written (no
    Dynamo), which caught a call that passed chunk_size twice on the compiled torch path."""
    from torch.export import Dim, export

    torch.manual_seed(0)
    layer = LinearAttention(16, 2, kind=kind, chunk_size=16).double().eval()
    B, T = Dim("B", min=2, max=64), Dim("T", min=2, max=layer.max_len)
    program = export(layer, (torch.randn(4, 40, 16, dtype=torch.float64),), dynamic_shapes={"x": {0: B, 1: T}})
    x = torch.randn(2, 77, 16, dtype=torch.float64)  # B = H = 2: the decay's shape check once guarded B != H
    assert (program.module()(x) - layer(x)).abs().max() < 1e-12


def test_short_convolution_compiles_once_for_every_length_under_inductor():
    """Written as F.conv1d, the convolution's backward made inductor guard on T (torch 2.13):
    a compiled model with short_conv recompiled at every length and, with fullgraph, failed at
    the ninth. As shifted multiply-adds: no new graph after the second length."""
    from linattn_lib.nn.conv import ShortConvolution

    torch.manual_seed(0)
    conv = ShortConvolution(6, 4, bias=True)
    torch._dynamo.reset()
    counted = _Compiles("inductor")
    compiled = torch.compile(conv, fullgraph=True, backend=counted)
    graphs = []
    for T in (5, 8, 11):
        x = torch.randn(2, T, 6, requires_grad=True)
        (y, cache), (yc, cache_c) = conv(x), compiled(x)
        (g,), (gc,) = torch.autograd.grad(y.sum(), x), torch.autograd.grad(yc.sum(), x)
        assert (y - yc).abs().max() < 1e-5 and (g - gc).abs().max() < 1e-5 and torch.equal(cache, cache_c)
        graphs.append(counted.graphs)
    assert graphs[2] == graphs[1], graphs


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


@pytest.mark.parametrize("decay, state, D", [(None, False, 16), ("token", True, 16), ("token", False, 8)])
def test_opcheck_delta_ops(decay, state, D):
    """torch.library.opcheck on linattn::delta_fwd and delta_bwd: schema, fake tensors,
    autograd registration and AOT dispatch agree with the real kernels (interpreter on CPU).
    D = 8: the kernels pad it to 16 and slice their outputs, which must still come back
    contiguous, as the fake says (inductor asserts the strides)."""
    pytest.importorskip("triton")
    import torch.nn.functional as F

    from linattn_lib.core import delta_ops  # noqa: F401 - registers the ops

    gen = torch.Generator().manual_seed(0)
    B, H, T = 1, 2, 24
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


@pytest.mark.parametrize("kind", LINEAR_KINDS)
def test_packed_layer_compiles_as_one_graph(kind):
    """A packed batch (cu_seqlens, one sequence of length 0) under fullgraph, forward and backward,
    with an initial state per sequence: the host loop of the torch path runs as one custom op
    (core/packed_ops.py); equal to eager, outputs, states and gradients."""
    torch.manual_seed(0)
    layer = LinearAttention(16, 2, kind=kind, chunk_size=8).double()
    cu = torch.tensor([0, 9, 9, 30])
    x = torch.randn(1, 30, 16, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        _, start = layer(torch.randn(3, 5, 16, dtype=torch.float64), return_state=True)
    start = type(start)(*(None if t is None else t.requires_grad_() for t in start))

    def run(fn):
        y, st = fn(x, cu_seqlens=cu, state=start, return_state=True)
        loss = y.square().sum() + st.S.square().sum() + (0 if st.z is None else st.z.sum())
        wrt = [x] + [t for t in start if t is not None]
        return (y.detach(), st.S.detach(), *torch.autograd.grad(loss, wrt))

    if kind == "cosformer":  # its positions restart per sequence: a state cannot carry them
        with pytest.raises(ValueError, match="restart at 0 in every packed sequence"):
            run(layer)
        return
    torch._dynamo.reset()
    eager = run(layer)
    compiled = run(torch.compile(layer, fullgraph=True, backend="aot_eager"))
    assert all((a - b).abs().max() < 1e-12 for a, b in zip(eager, compiled))


def test_tiny_lm_compiles_as_one_graph_and_without_warnings():
    """The quickstart's `torch.compile(model, fullgraph=True)` on a TinyLM (a reader found its
    token-id check, `bool(tensor)`, breaking the graph), forward and backward, equal to eager;
    and no warning from the trace (the plain kinds' scan cache warned at every compile)."""
    import warnings

    from linattn_lib import ModelConfig, TinyLM

    torch.manual_seed(0)
    model = TinyLM(ModelConfig(vocab_size=11, block_size=16, n_layer=2, n_head=2, d_model=16,
                               attention="linear", softmax_layers=(1,))).double()
    idx = torch.randint(0, 11, (2, 12))

    def run(fn):
        logits, loss = fn(idx, idx)
        return (logits.detach(), *torch.autograd.grad(loss, list(model.parameters())))

    torch._dynamo.reset()
    eager = run(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = run(torch.compile(model, fullgraph=True, backend="eager"))
    assert all((a - b).abs().max() < 1e-12 for a, b in zip(eager, compiled))
    assert [str(w.message)[:80] for w in caught] == []


@pytest.mark.parametrize("rule", ["linear", "delta"])
def test_opcheck_packed_ops(rule):
    """opcheck on linattn::linear_host_fwd / delta_host_fwd (schema, fake tensors, autograd)."""
    import torch.nn.functional as F

    from linattn_lib.core import delta, linear

    gen = torch.Generator().manual_seed(0)
    H, T, D = 2, 20, 8
    q = torch.randn(1, H, T, D, generator=gen, dtype=torch.float64, requires_grad=True)
    k = F.normalize(torch.randn(1, H, T, D, generator=gen, dtype=torch.float64), dim=-1).requires_grad_()
    v = torch.randn(1, H, T, D, generator=gen, dtype=torch.float64, requires_grad=True)
    g = (-torch.rand(1, H, T, generator=gen, dtype=torch.float64)).requires_grad_()
    cu = torch.tensor([0, 7, 20])
    if rule == "linear":
        args = (q.exp(), k.exp(), v, None, g, None, None, cu, True, True, "chunked", 1e-6, 8, "torch")
        op = linear._host_op.op
    else:
        beta = torch.rand(1, H, T, generator=gen, dtype=torch.float64, requires_grad=True)
        S0 = torch.randn(2, H, D, D, generator=gen, dtype=torch.float64, requires_grad=True)
        args = (q, k, v, beta, g, S0, None, cu, True, False, "chunked", 0.0, 8, "torch")
        op = delta._host_op.op
    torch.library.opcheck(op, args)


def test_checkpointed_layers_compile_with_dynamic_shapes_and_specialized_floats():
    """The quickstart's workaround for pytorch#193194: two checkpointed layers under
    torch.compile(dynamic=True) fail to compile in torch 2.13 (a Python float, the default
    eps, reused by sibling checkpoint regions); with specialize_float = True they compile,
    equal to eager mode (aot_eager: the graph inductor would get)."""
    from torch.utils.checkpoint import checkpoint

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(LinearAttention(16, 2, chunk_size=16) for _ in range(2))

        def forward(self, x):
            for layer in self.layers:
                x = x + checkpoint(layer, x, use_reentrant=False)
            return x

    torch.manual_seed(0)
    model = Stack().double()
    x = torch.randn(2, 40, 16, dtype=torch.float64, requires_grad=True)
    torch._dynamo.reset()
    y, g = _run(model, x)
    # torch's own patch, restored after (monkeypatch's undo deletes the option: dynamo's config
    # then hides it, and every later compile in the process fails)
    with torch._dynamo.config.patch(specialize_float=True):
        yc, gc = _run(torch.compile(model, dynamic=True, backend="aot_eager"), x)
    torch._dynamo.reset()
    assert (yc - y).abs().max() < 1e-12 and (gc - g).abs().max() < 1e-12
