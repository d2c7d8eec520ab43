"""The Triton kernels as torch custom ops (linattn_lib/core/custom_ops.py) and torch.compile.

* `torch.library.opcheck` on each op (schema, autograd registration, fake tensors, AOT
  dispatch with dynamic shapes, gradients included): on CPU the kernels run in the Triton
  interpreter, so the shapes are tiny;
* `torch.compile(fullgraph=True)` of `linear_attention(..., backend="triton")`, forward and
  backward, has no graph break and matches eager in values and gradients; so does a
  `LinearAttention` routed through the kernels (as on CUDA);
* `torch.compile` of `LinearAttention` on CPU (the torch chunked path) matches eager.

The `linear_attention` test compiles with inductor, which on CPU needs a C++ compiler (skipped
without one). The two `LinearAttention` tests use "aot_eager" (the same Dynamo graphs and
AOTAutograd joint graphs, run by eager kernels), to stay within the time budget: inductor
takes about a minute for each on two cores, and on the CPU path the torch chunked code breaks
the graph (it tests its chunk increments for inf on the host), so there are ten graphs to
compile. Whether there is a graph break is Dynamo's business, the same for every backend.
"""
from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("triton")

from linattn_lib import LinearAttention, LinearAttentionState, linear_attention  # noqa: E402
from linattn_lib.core import custom_ops  # noqa: E402
from linattn_lib.core.triton_ops import triton_available  # noqa: E402

if not triton_available():  # pragma: no cover - triton imports but the kernels do not
    pytest.skip("the Triton kernels do not import here", allow_module_level=True)

OPS = torch.ops.linattn
SHAPE = {"B": 1, "H": 2, "T": 40, "Dk": 16, "Dv": 16}
needs_cxx = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                               reason="inductor on CPU needs a C++ compiler")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _inputs(make_inputs, decay, state, grad=True):
    q, k, v, g, init = make_inputs(**SHAPE, decay=decay, state=state, grad=grad)
    S0, z0 = (None, None) if init is None else init
    return q, k, v, g, S0, z0


# ------------------------------------------------------------------------------ opcheck


@pytest.mark.parametrize("decay, normalize, state, return_state", [
    (None, True, False, False),
    ("head", False, True, True),
    ("token", True, True, True),
])
def test_opcheck_causal_forward(make_inputs, decay, normalize, state, return_state):
    q, k, v, g, S0, z0 = _inputs(make_inputs, decay, state)
    z0 = z0 if normalize else None
    torch.library.opcheck(OPS.causal_fwd.default, (q, k, v, g, S0, z0, normalize, 1e-6, return_state))


@pytest.mark.parametrize("decay, normalize, needs", [
    ("token", True, [True] * 6),
    (None, False, [False, True, True, False, True, False]),
])
def test_opcheck_causal_backward(make_inputs, decay, normalize, needs):
    q, k, v, g, S0, z0 = _inputs(make_inputs, decay, state=True, grad=False)
    z0 = z0 if normalize else None
    o, den, S_T, z_T = OPS.causal_fwd(q, k, v, g, S0, z0, normalize, 1e-6, True)
    gen = torch.Generator().manual_seed(3)
    do, dS_T, dz_T = (torch.randn(x.shape, generator=gen) for x in (o, S_T, z_T))
    args = (q, k, v, g, S0, z0, o, den if normalize else None, S_T, z_T if normalize else None,
            do, dS_T, dz_T if normalize else None, normalize, needs)
    torch.library.opcheck(OPS.causal_bwd.default, args)
    dq, dk, dv, dg, dS0, dz0 = OPS.causal_bwd(*args)
    for grad, need, x in zip((dq, dk, dv, dg, dS0, dz0), needs, (q, k, v, g, S0, z0)):
        want = need and x is not None
        assert grad.shape == (x.shape if want else (0,)), grad.shape


@pytest.mark.parametrize("normalize, state", [(True, False), (False, True)])
def test_opcheck_noncausal(make_inputs, normalize, state):
    q, k, v, _, S0, z0 = _inputs(make_inputs, None, state)
    z0 = z0 if normalize else None
    torch.library.opcheck(OPS.noncausal_fwd.default, (q, k, v, S0, z0, normalize, 1e-6))
    with torch.no_grad():
        o, den, S, z = OPS.noncausal_fwd(q, k, v, S0, z0, normalize, 1e-6)
    args = (q.detach(), k.detach(), v.detach(), None if S0 is None else S0.detach(),
            None if z0 is None else z0.detach(), o, den if normalize else None, S,
            z if normalize else None, torch.randn_like(o), torch.randn_like(S) if state else None, None,
            normalize, [True] * 5)
    torch.library.opcheck(OPS.noncausal_bwd.default, args)


def test_absent_outputs_are_empty_and_fakes_match(make_inputs):
    """Without the normaliser and return_state, den and the states are the (0,) stand-ins;
    the fake implementation gives the real outputs' shapes and dtypes, fp16 included."""
    q, k, v, g, _, _ = _inputs(make_inputs, "head", False, grad=False)
    q, k, v = (x.half() for x in (q, k, v))
    real = OPS.causal_fwd(q, k, v, g, None, None, False, 1e-6, False)
    with torch._subclasses.FakeTensorMode() as mode:
        fake = OPS.causal_fwd(*(mode.from_tensor(x) for x in (q, k, v, g)), None, None, False, 1e-6, False)
    assert [(x.shape, x.dtype) for x in real] == [(x.shape, x.dtype) for x in fake]
    assert real[0].dtype == torch.float16 and [x.shape for x in real[1:]] == [(0,)] * 3


def test_second_derivative_raises(make_inputs):
    q, k, v, g, _, _ = _inputs(make_inputs, "token", False)
    o = linear_attention(q, k, v, log_decay=g, backend="triton")
    with pytest.raises(NotImplementedError, match="second derivatives"):  # core/once.py
        torch.autograd.grad(o.sum(), g, create_graph=True)
    assert custom_ops.causal_fwd is not None  # the module registered the ops it names


# ------------------------------------------------------------------------------ compile


def _attend(q, k, v, g, S, z):
    o, st = linear_attention(q, k, v, log_decay=g, initial_state=LinearAttentionState(S, z),
                             return_state=True, backend="triton")
    return o, st.S, st.z


def _loss_and_grads(f, xs):
    outs = f(*xs)
    loss = sum((w * y).sum() for w, y in zip((1.0, 0.5, 0.25), outs))
    return outs, torch.autograd.grad(loss, xs)


@needs_cxx
def test_compiled_triton_path_has_no_graph_break_and_matches_eager(make_inputs):
    xs = _inputs(make_inputs, "token", True)
    explanation = torch._dynamo.explain(_attend)(*xs)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(_attend, fullgraph=True, backend="inductor")
    outs_c, grads_c = _loss_and_grads(compiled, xs)
    outs_e, grads_e = _loss_and_grads(_attend, xs)
    for a, b in zip((*outs_c, *grads_c), (*outs_e, *grads_e)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_packed_sequences_opcheck_and_compile_without_graph_break(make_inputs):
    """Packed sequences through the custom op: opcheck (the fake gives one state per sequence),
    and `torch.compile(fullgraph=True)` traces linear_attention(..., cu_seqlens=...) without a
    break -- nothing reads cu_seqlens on the host (its value checks are off while tracing, the
    kernels size their buffers from shapes), forward and backward equal to eager."""
    q, k, v, g, _, _ = _inputs(make_inputs, "token", False)
    cu = torch.tensor([0, 1, 17, 17, 40], dtype=torch.int32)
    S0, z0 = torch.randn(4, 2, 16, 16, requires_grad=True), torch.rand(4, 2, 16, requires_grad=True)
    torch.library.opcheck(OPS.causal_fwd.default, (q, k, v, g, S0, z0, True, 1e-6, True, cu))

    def attend(q, k, v, g, S, z):
        o, st = linear_attention(q, k, v, log_decay=g, initial_state=LinearAttentionState(S, z),
                                 return_state=True, backend="triton", cu_seqlens=cu)
        return o, st.S, st.z

    xs = (q, k, v, g, S0, z0)
    explanation = torch._dynamo.explain(attend)(*xs)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    outs_c, grads_c = _loss_and_grads(torch.compile(attend, fullgraph=True, backend="aot_eager"), xs)
    outs_e, grads_e = _loss_and_grads(attend, xs)
    assert outs_c[1].shape == (4, 2, 16, 16)
    for a, b in zip((*outs_c, *grads_c), (*outs_e, *grads_e)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _module_and_input(kind):
    torch.manual_seed(0)
    return LinearAttention(32, 2, kind=kind), torch.randn(1, 40, 32, requires_grad=True)


def _module_matches(module, compiled, x, rtol, atol):
    y_c = compiled(x)
    (gx_c,) = torch.autograd.grad(y_c.square().sum(), x)
    y_e = module(x)
    (gx_e,) = torch.autograd.grad(y_e.square().sum(), x)
    torch.testing.assert_close(y_c, y_e, rtol=rtol, atol=atol)
    torch.testing.assert_close(gx_c, gx_e, rtol=rtol, atol=atol)


def test_compiled_module_through_the_kernels_is_one_graph():
    """LinearAttention on CUDA runs the kernels; routed to them here (backend="triton"), it
    compiles to one graph (data-dependent decay included), launches the kernels, and matches the
    layer on the torch path. (A review found an earlier version routing the layer through a
    patched name that its explicit backend argument overrode: it ran the torch path.)"""
    from linattn_lib.experiments.launches import record_launches

    module, x = _module_and_input("ssd")
    torch.manual_seed(0)
    on_kernels = LinearAttention(32, 2, kind="ssd", backend="triton")
    on_kernels.load_state_dict(module.state_dict())
    compiled = torch.compile(on_kernels, fullgraph=True, backend="aot_eager")
    with record_launches(stub=False) as launches:  # fp32 kernels against torch: a few ulp more
        _module_matches(module, compiled, x, rtol=1e-3, atol=5e-5)
    assert {"chunk_state_kernel", "chunk_output_kernel", "chunk_dqk_kernel"} <= {x.name for x in launches}


def test_compiled_module_on_cpu_matches_eager():
    """The default backend on CPU: the torch chunked path. It matches eager but is not one
    graph: its backward writes into preallocated workspaces (`out=` on strided views), which
    Dynamo does not trace; the Triton path above is the one for fullgraph."""
    module, x = _module_and_input("linear")
    compiled = torch.compile(module, backend="aot_eager")
    _module_matches(module, compiled, x, rtol=1e-5, atol=1e-6)


def test_value_checks_run_eagerly_only():
    """Eager calls still refuse NaN with the argument's name; traced, the check is skipped
    (a test of the data would break the graph)."""
    q = torch.rand(1, 1, 4, 8)
    bad = q.clone()
    bad[0, 0, 2, 1] = float("nan")
    with pytest.raises(ValueError, match=r"`k` has a non-finite value \(nan\) at index \(0, 0, 2, 1\)"):
        linear_attention(q, bad, q, backend="torch", form="quadratic")

    def f(q, k, v, g):
        return linear_attention(q, k, v, log_decay=g, backend="torch", form="quadratic")

    g = -torch.rand(1)
    assert torch._dynamo.explain(f)(q, q, q, g).graph_break_count == 0
