"""torch.func: grad, vmap and per-sample gradients (vmap of grad) through the library's ops.

The causal paths that loop or launch kernels run under a transform as the host ops of
packed_ops.py, whose vmap rules fold the mapped dim into the batch (func_rules.py). Each
test compares a transform with the same computation done slice by slice in eager autograd,
in float64 (the Triton interpreter in float32).
"""
from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, grad, jacrev, vmap

from linattn_lib import delta_rule_attention, linear_attention
from linattn_lib.core.state import LinearAttentionState
from linattn_lib.core.triton_ops import triton_available
from linattn_lib.nn.layers import FLA_PRESETS, LINEAR_KINDS, LinearAttention

S, B, H, T, D = 3, 2, 2, 20, 4  # mapped slices, batch, heads, tokens (3 chunks of 8), head dim


def _rand(*shape, dtype=torch.float64, positive=False):
    x = torch.randn(*shape, dtype=dtype)
    return x.sigmoid() if positive else x


def _decay(kind: str | None, mapped: bool = True):
    lead = (S,) if mapped else ()
    if kind == "head":
        return -torch.rand(*lead, H, dtype=torch.float64)
    if kind == "token":
        return -torch.rand(*lead, B, H, T, dtype=torch.float64)
    return None


def _eager_grads(loss, args, wrt):
    """Gradients of loss(*args) with respect to the arguments at positions `wrt`, in eager
    autograd."""
    args = list(args)
    for i in wrt:
        args[i] = args[i].clone().requires_grad_()
    loss(*args).backward()
    return [args[i].grad for i in wrt]


CASES = [(form, normalize, decay) for form in ("chunked", "recurrent", "quadratic")
         for normalize, decay in ((True, None), (False, None), (False, "head"), (False, "token"))]


@pytest.mark.parametrize("form,normalize,decay", CASES)
def test_linear_attention_vmap_and_per_sample_grads(form, normalize, decay):
    q, k = _rand(S, B, H, T, D, positive=True), _rand(S, B, H, T, D, positive=True)
    v, g = _rand(S, B, H, T, D), _decay(decay)

    def attend(q, k, v, g):
        return linear_attention(q, k, v, log_decay=g, normalize=normalize, form=form, chunk_size=8)

    def loss(q, k, v, g):
        return attend(q, k, v, g).square().sum()

    dims = (0, 0, 0, None if g is None else 0)
    mapped = vmap(attend, in_dims=dims)(q, k, v, g)
    for i in range(S):
        one = attend(q[i], k[i], v[i], None if g is None else g[i])
        torch.testing.assert_close(mapped[i], one, rtol=0, atol=1e-12)
    wrt = (0, 1, 2) if g is None else (0, 1, 2, 3)
    per_sample = vmap(grad(loss, argnums=wrt), in_dims=dims)(q, k, v, g)
    for i in range(S):
        args = (q[i], k[i], v[i], None if g is None else g[i])
        for got, want in zip(per_sample, _eager_grads(loss, args, wrt)):
            torch.testing.assert_close(got[i], want, rtol=0, atol=1e-11)


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_a_shared_decay_per_head_gets_a_gradient_per_sample(form):
    """The decay is not mapped, the inputs are: its per-sample gradient sums each slice's
    tokens, not all slices' (the backward's vmap rule makes it a decay per token)."""
    q, k, v = (_rand(S, B, H, T, D, positive=True) for _ in range(3))
    g = _decay("head", mapped=False)
    initial = LinearAttentionState(_rand(B, H, D, D), None)

    def loss(q, g):
        o, st = linear_attention(q, k[0], v[0], log_decay=g, normalize=False, form=form, chunk_size=8,
                                 initial_state=initial, return_state=True)
        return o.square().sum() + st.S.sum()

    per_sample = vmap(grad(loss, argnums=1), in_dims=(0, None))(q, g)
    assert per_sample.shape == (S, H)
    for i in range(S):
        (want,) = _eager_grads(loss, (q[i], g), (1,))
        torch.testing.assert_close(per_sample[i], want, rtol=0, atol=1e-11)


def test_mapped_initial_state_and_returned_state():
    q, k, v = (_rand(S, B, H, T, D, positive=True) for _ in range(3))
    S0, z0 = _rand(S, B, H, D, D), _rand(S, B, H, D, positive=True)

    def run(q, S0, z0):
        o, st = linear_attention(q, k[0], v[0], initial_state=LinearAttentionState(S0, z0), return_state=True,
                                 chunk_size=8)
        return o, st.S, st.z

    mapped = vmap(run)(q, S0, z0)
    per_sample = vmap(grad(lambda *a: sum(x.square().sum() for x in run(*a)), argnums=(1, 2)))(q, S0, z0)
    for i in range(S):
        for got, want in zip(mapped, run(q[i], S0[i], z0[i])):
            torch.testing.assert_close(got[i], want, rtol=0, atol=1e-12)
        wants = _eager_grads(lambda *a: sum(x.square().sum() for x in run(*a)), (q[i], S0[i], z0[i]), (1, 2))
        for got, want in zip(per_sample, wants):
            torch.testing.assert_close(got[i], want, rtol=0, atol=1e-11)


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_delta_rule_vmap_and_per_sample_grads(form):
    q, v = _rand(S, B, H, T, D), _rand(S, B, H, T, D)
    k = torch.nn.functional.normalize(_rand(S, B, H, T, D), dim=-1)
    beta, g = torch.rand(S, B, H, T, dtype=torch.float64), _decay("token")

    def attend(q, k, v, beta, g):
        return delta_rule_attention(q, k, v, beta, log_decay=g, form=form, chunk_size=8)

    def loss(*args):
        return attend(*args).square().sum()

    mapped = vmap(attend)(q, k, v, beta, g)
    per_sample = vmap(grad(loss, argnums=(0, 3, 4)))(q, k, v, beta, g)
    for i in range(S):
        args = (q[i], k[i], v[i], beta[i], g[i])
        torch.testing.assert_close(mapped[i], attend(*args), rtol=0, atol=1e-12)
        for got, want in zip(per_sample, _eager_grads(loss, args, (0, 3, 4))):
            torch.testing.assert_close(got[i], want, rtol=0, atol=1e-11)


def test_grad_and_jacrev_without_vmap():
    q, k = _rand(1, H, 12, D, positive=True), _rand(1, H, 12, D, positive=True)
    v = _rand(1, H, 12, D)
    dq = grad(lambda q: linear_attention(q, k, v, chunk_size=8).square().sum())(q)
    (want,) = _eager_grads(lambda q: linear_attention(q, k, v, chunk_size=8).square().sum(), (q,), (0,))
    torch.testing.assert_close(dq, want, rtol=0, atol=1e-12)
    jac = jacrev(lambda v: linear_attention(q, k, v, chunk_size=8)[0, 0, -1])(v)
    # the last token's output depends on every earlier value: o_T = sum_s w_s v_s, w >= 0
    assert jac.shape == (D, 1, H, 12, D)
    assert (jac[:, 0, 1] == 0).all() and (jac[:, 0, 0].diagonal(dim1=0, dim2=2) > 0).all()


LAYERS = ([(kind, {}) for kind in LINEAR_KINDS] + [(kind, {"short_conv": True}) for kind in LINEAR_KINDS]
          + [(kind, FLA_PRESETS[kind]) for kind in ("deltanet", "gated_deltanet")])


@pytest.mark.parametrize("kind,options", LAYERS, ids=str)
def test_layer_per_sample_gradients(kind, options):
    """DP-SGD's per-sample gradients of every parameter of a layer: vmap(grad) of a
    functional call on one example, against a backward per example."""
    layer = LinearAttention(16, 2, kind=kind, max_len=64, seed=1, **options).double()
    params = {name: p.detach() for name, p in layer.named_parameters()}
    x = _rand(S, 10, 16)

    def loss(params, x):
        return functional_call(layer, params, (x[None],)).square().sum()

    per_sample = vmap(grad(loss), in_dims=(None, 0))(params, x)
    for i in range(S):
        layer.zero_grad()
        layer(x[i:i + 1]).square().sum().backward()
        for name, p in layer.named_parameters():
            torch.testing.assert_close(per_sample[name][i], p.grad, rtol=0, atol=1e-11, msg=name)


@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_triton_backend_under_grad_and_vmap():
    """The kernels (the interpreter here) run inside the host op, on the folded batch."""
    q, k = _rand(S, 1, H, 16, D, dtype=torch.float32, positive=True), _rand(1, H, 16, D, dtype=torch.float32)
    v = _rand(1, H, 16, D, dtype=torch.float32)

    def attend(q):
        return linear_attention(q, k.sigmoid(), v, backend="triton")

    mapped = vmap(attend)(q)
    per_sample = vmap(grad(lambda q: attend(q).square().sum()))(q)
    for i in range(S):
        torch.testing.assert_close(mapped[i], attend(q[i]), rtol=0, atol=1e-6)
        (want,) = _eager_grads(lambda q: attend(q).square().sum(), (q[i],), (0,))
        torch.testing.assert_close(per_sample[i], want, rtol=0, atol=1e-5)


def test_vmap_over_packed_sequences_is_refused():
    q, k, v = (_rand(S, 1, H, 12, D, positive=True) for _ in range(3))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="packed sequences"):
        vmap(lambda q: linear_attention(q, k[0], v[0], cu_seqlens=cu))(q)


def test_value_checks_still_run_outside_transforms():
    q, k, v = (_rand(1, H, 12, D) for _ in range(3))
    q[0, 0, 3, 1] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        linear_attention(q, k, v)


SECOND_ORDER = [(attend, form) for attend in ("linear", "delta") for form in ("chunked", "recurrent")]


def _attention(which: str, form: str):
    if which == "linear":
        return lambda q, k, v: linear_attention(q, k, v, form=form, chunk_size=4)
    beta = _rand(1, H, 10, positive=True)
    return lambda q, k, v: delta_rule_attention(q, k / k.norm(dim=-1, keepdim=True), v, beta, form=form,
                                                chunk_size=4)


@pytest.mark.parametrize("which,form", SECOND_ORDER)
def test_second_derivatives_under_func_raise_instead_of_zeros(which, form):
    """The host op's backward is differentiable once: grad of grad and a Hessian by
    jacrev(jacrev) through it raise (torch.func would otherwise take that backward for a
    constant and return zeros); the quadratic form, plain torch, has them."""
    torch.manual_seed(0)
    q, k, v = (_rand(1, H, 10, D, positive=True) for _ in range(3))
    attend = _attention(which, form)

    def loss(q):
        return attend(q, k, v).square().sum()

    with pytest.raises(NotImplementedError, match="second derivatives"):
        grad(lambda q: grad(loss)(q).square().sum())(q)
    with pytest.raises(NotImplementedError, match="second derivatives"):
        jacrev(jacrev(loss))(q)
    quadratic = _attention(which, "quadratic")
    hessian = jacrev(jacrev(lambda q: quadratic(q, k, v).square().sum()))(q)
    want = torch.autograd.functional.hessian(lambda q: quadratic(q, k, v).square().sum(), q)
    torch.testing.assert_close(hessian, want, rtol=0, atol=1e-10)
    assert hessian.abs().max() > 1e-3  # not the zeros torch.func made of it before


@pytest.mark.parametrize("which,form", SECOND_ORDER)
def test_inputs_a_transform_does_not_see(which, form):
    """q, k, v captured from outside the transformed function (constants to it): the call runs
    as it would without the transform (torch refuses the library's own autograd Functions
    whenever a transform is running, whatever their inputs)."""
    q, k, v = (_rand(1, H, 10, D, positive=True) for _ in range(3))
    w = _rand(S, D)
    attend = _attention(which, form)
    want = attend(q, k, v)
    torch.testing.assert_close(vmap(lambda w: attend(q, k, v) @ w)(w), torch.stack([want @ x for x in w]),
                               rtol=0, atol=1e-12)
    torch.testing.assert_close(grad(lambda w: (attend(q, k, v) @ w).sum())(w[0]), want.sum((0, 1, 2)),
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("packed", [False, True])
def test_non_causal_state_through_the_host_op(packed):
    """A non-causal call's returned state (its keys' and values' sums) through the host op:
    under grad (has_aux) and compiled, as eager, and differentiable."""
    q, k, v = (_rand(1, H, 12, D, positive=True) for _ in range(3))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32) if packed else None

    def attend(k):
        o, st = linear_attention(q, k, v, causal=False, cu_seqlens=cu, return_state=True)
        return (o.sum() + st.S.square().sum() + st.z.sum()), (st.S, st.z)

    S_want, z_want = attend(k)[1]
    assert S_want.abs().max() > 0.1
    dk, (S_got, z_got) = grad(attend, has_aux=True)(k)
    torch.testing.assert_close((S_got, z_got), (S_want, z_want), rtol=0, atol=1e-12)
    (dk_want,) = _eager_grads(lambda k: attend(k)[0], (k,), (0,))
    torch.testing.assert_close(dk, dk_want, rtol=0, atol=1e-11)
    torch._dynamo.reset()
    compiled = torch.compile(lambda k: attend(k)[1], backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(k), (S_want, z_want), rtol=0, atol=1e-12)


def test_first_derivatives_in_nestings_that_look_like_second_ones():
    """What the second-derivative refusal must let through: grad of a vmap (the backward then
    runs under the vmap rule, below the grad level) and a jacrev (its vjp level has ended when
    the backward runs); and what it must catch: a mixed derivative through the cotangent."""
    q, k, v = (_rand(1, H, 10, D, positive=True) for _ in range(3))
    gs, w = -torch.rand(S, H, dtype=torch.float64), _rand(S, 1, H, 10, D)

    def attend(g):
        return linear_attention(q, k, v, log_decay=g, normalize=False, chunk_size=4)

    dg = grad(lambda gs: (vmap(attend)(gs) * w).sum())(gs)
    for i in range(S):
        (want,) = _eager_grads(lambda g, wi=w[i]: (attend(g) * wi).sum(), (gs[i],), (0,))
        torch.testing.assert_close(dg[i], want, rtol=0, atol=1e-11)
    jac = jacrev(lambda g: attend(g)[0, :, -1].sum(-1))(gs[0])
    want = torch.autograd.functional.jacobian(lambda g: attend(g)[0, :, -1].sum(-1), gs[0])
    torch.testing.assert_close(jac, want, rtol=0, atol=1e-11)
    with pytest.raises(NotImplementedError, match="second derivatives"):  # d/dw of dL/dq, L = <o(q), w>
        grad(lambda w: grad(lambda q: (linear_attention(q, k, v, chunk_size=4) * w).sum())(q).sum())(w[0])


@pytest.mark.parametrize("attention", ["linear", "softmax"])
def test_per_sample_gradients_of_tinylm_own_loss(attention):
    """vmap(grad) of TinyLM's own loss (targets=, its value check skipped under the transform:
    its boolean indexing cannot be mapped), on a padded batch: each row's gradients are those
    of the row alone, unpadded."""
    from linattn_lib.nn.models import ModelConfig, TinyLM

    torch.manual_seed(3)
    model = TinyLM(ModelConfig(vocab_size=11, block_size=16, n_layer=2, n_head=2, d_model=8,
                               attention=attention)).double()
    params = {name: p.detach() for name, p in model.named_parameters()}
    idx, targets = torch.randint(0, 11, (3, 6)), torch.randint(0, 11, (3, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])

    def loss(params, idx, targets, mask):
        return functional_call(model, params, (idx[None], targets[None]), {"attention_mask": mask[None]})[1]

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0, 0))(params, idx, targets, mask)
    for b in range(3):
        keep = mask[b].bool()
        model.zero_grad()
        model(idx[b:b + 1, keep], targets[b:b + 1, keep])[1].backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(per_sample[name][b], p.grad, rtol=0, atol=1e-12, msg=name)
