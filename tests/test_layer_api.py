"""The layer's API for real models (issue 32): packed batches, the backend, the one-token
decode path and reset_parameters, for every kind of `LinearAttention`.

* cu_seqlens: a packed batch (B = 1, sequences end to end, one of length 0) equals each
  sequence run alone, outputs and per-sequence states; cosFormer's positions restart;
* the one-token call under no_grad (generation) uses the decode steps and equals the
  parallel form, token by token, for every kind;
* backend="triton" (the interpreter on CPU) equals backend="torch";
* reset_parameters restores what a host model's init overwrote (nanoGPT's `_init_weights`
  zeroes biases: the decay then starts at 0.5 a token instead of 0.95).
"""
from __future__ import annotations

import math

import pytest
import torch
from decode_steps import decode_stepwise
from torch import nn

from linattn_lib import LinearAttention
from linattn_lib.nn import fla_layer
from linattn_lib.nn.models import LINEAR_KINDS, SoftmaxAttention

D64 = torch.float64


def _layer(kind, **kw):
    torch.manual_seed(0)
    return LinearAttention(16, 2, kind=kind, chunk_size=8, **kw).double()


@pytest.mark.parametrize("kind", LINEAR_KINDS)
def test_packed_batch_equals_separate_sequences(kind):
    layer = _layer(kind)
    lengths = [7, 0, 12, 3]
    cu = torch.tensor([0, 7, 7, 19, 22])
    x = torch.randn(1, sum(lengths), 16, dtype=D64)
    y, st = layer(x, cu_seqlens=cu, return_state=True)
    assert st.S.shape[0] == len(lengths)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if s == e:
            assert st.S[i].abs().max() == 0  # no tokens: the (zero) state passes through
            continue
        y_i, st_i = layer(x[:, s:e], return_state=True)
        assert (y[:, s:e] - y_i).abs().max() < 1e-10
        assert (st.S[i] - st_i.S[0]).abs().max() < 1e-10
    with pytest.raises(ValueError, match=r"LinearAttention: with `cu_seqlens`.*B must be 1"):
        layer(x.expand(2, -1, -1), cu_seqlens=cu)


@pytest.mark.parametrize("kind", LINEAR_KINDS)
def test_one_token_decode_equals_the_parallel_form(kind, monkeypatch):
    """The one-token calls run the decode step, once a token (a review found equal outputs
    alone passing with the decode branch switched off: the chunked form at T = 1 agrees)."""
    import linattn_lib.nn.layers as layers

    steps_run = []
    for name in ("decode_to_new_state", "delta_rule_decode_step"):
        step = getattr(layers, name)
        monkeypatch.setattr(layers, name, lambda *a, _step=step, **kw: steps_run.append(1) or _step(*a, **kw))
    layer = _layer(kind)
    x = torch.randn(2, 12, 16, dtype=D64)
    with torch.no_grad():
        full = layer(x)
        steps, _ = decode_stepwise(layer, x, 5)
    assert (steps - full).abs().max() < 1e-10
    assert len(steps_run) == 12 - 5


def test_one_token_decode_leaves_the_callers_state_alone():
    layer = _layer("linear")
    x = torch.randn(1, 6, 16, dtype=D64)
    with torch.no_grad():
        _, state = layer(x[:, :5], return_state=True)
        S, z = state.S.clone(), state.z.clone()
        layer(x[:, 5:], state=state, pos_offset=5, return_state=True)
    assert torch.equal(state.S, S) and torch.equal(state.z, z)


@pytest.mark.parametrize("kind", ["linear", "retnet"])
def test_one_token_decode_on_the_kernel_leaves_the_callers_state_alone(kind):
    """backend="triton": the step's kernel (the interpreter here) updates a copy of the state in
    place, and gives the torch step's outputs and states."""
    pytest.importorskip("triton")
    torch.manual_seed(0)
    layers = {b: LinearAttention(32, 2, kind=kind, backend=b) for b in ("torch", "triton")}
    layers["triton"].load_state_dict(layers["torch"].state_dict())
    x = torch.randn(1, 8, 32)
    with torch.no_grad():
        _, state = layers["torch"](x[:, :6], return_state=True)
        before = [t.clone() for t in state if t is not None]
        out = {b: layers[b](x[:, 6:7], state=state, pos_offset=6, return_state=True) for b in layers}
    assert all(torch.equal(t, u) for t, u in zip([t for t in state if t is not None], before))
    (y_t, s_t), (y_k, s_k) = out["torch"], out["triton"]
    assert (y_t - y_k).abs().max() < 1e-5 and (s_t.S - s_k.S).abs().max() < 1e-5


@pytest.mark.parametrize("kind", ["linear", "gated_deltanet"])
def test_returned_state_has_one_dtype_on_every_path(kind):
    """A float64 state given to a float32 layer comes back float32 from the one-token step
    too (it came back float64 there, float32 from the chunked form)."""
    layer = _layer(kind).float()
    x = torch.randn(2, 6, 16)
    _, state = layer(x[:, :3], return_state=True)
    wide = type(state)(*(None if s is None else s.double() for s in state))
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            for T in (1, 3):
                y, new = layer(x[:, 3:3 + T], state=wide, pos_offset=3, return_state=True)
                assert y.dtype == torch.float32 and new.S.dtype == torch.float32
                assert new.z is None or new.z.dtype == torch.float32


@pytest.mark.parametrize("kind", ["linear", "retnet", "gated_deltanet"])
def test_triton_backend_equals_torch(kind):
    pytest.importorskip("triton")
    torch.manual_seed(0)
    x = torch.randn(1, 40, 32)
    layers = {b: LinearAttention(32, 2, kind=kind, backend=b) for b in ("torch", "triton")}
    layers["triton"].load_state_dict(layers["torch"].state_dict())
    y_t, y_k = (layers[b](x) for b in ("torch", "triton"))
    assert ((y_t - y_k).norm() / y_t.norm()).item() < 1e-5
    with pytest.raises(ValueError, match=r"LinearAttention: unknown backend=.cuda."):
        LinearAttention(32, 2, kind=kind, backend="cuda")


def _nanogpt_init(module):  # karpathy/nanoGPT's model.py, _init_weights
    if isinstance(module, nn.Linear):
        torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            torch.nn.init.zeros_(module.bias)


@pytest.mark.parametrize("kind", LINEAR_KINDS)
def test_reset_parameters_restores_the_initialisation(kind):
    layer = _layer(kind)
    init = {n: p.detach().clone() for n, p in layer.named_parameters()}
    layer.apply(_nanogpt_init)
    if hasattr(layer, "decay_proj"):
        assert math.exp(-torch.nn.functional.softplus(layer.decay_proj.bias).max().item()) == pytest.approx(0.5)
    layer.reset_parameters()
    for name, p in layer.named_parameters():
        assert p.shape == init[name].shape
        if name.startswith(("decay_proj", "out_norm")):
            assert torch.allclose(p, init[name], rtol=1e-6), name  # the constructor's values
        else:
            assert p.std() > 0.05, name  # nn.Linear's default init again, not std 0.02
    if hasattr(layer, "decay_proj"):
        decay = torch.exp(-torch.nn.functional.softplus(layer.decay_proj.bias))
        assert torch.allclose(decay, torch.full_like(decay, 0.95))
    softmax = SoftmaxAttention(16, 2)
    softmax.apply(_nanogpt_init)
    softmax.reset_parameters()
    assert softmax.qkv.weight.std() > 0.05


@pytest.mark.parametrize("kind", LINEAR_KINDS)
def test_a_layer_built_on_the_meta_device_is_whole_after_reset_parameters(kind):
    """Deferred initialisation (FSDP, torchtitan): build on the meta device, `to_empty`, then
    `reset_parameters`. The buffers (RetNet's decays, the Performer projection) must come back
    as the constructor made them; they were left as uninitialised memory (inf, a positive
    'log-decay')."""
    def build():  # float32, as built: .double() would round a float32 draw first
        torch.manual_seed(0)
        return LinearAttention(16, 2, kind=kind, chunk_size=8)

    reference = build()
    with torch.device("meta"):
        layer = build()
    layer = layer.to_empty(device="cpu")
    layer.reset_parameters()
    buffers = dict(reference.named_buffers())
    for name, b in layer.named_buffers():
        assert torch.equal(b, buffers[name]), name
    assert torch.isfinite(layer(torch.randn(2, 9, 16))).all()


@pytest.mark.parametrize("parents_first", [True, False])
def test_deferred_initialisation_in_any_order_of_resets(parents_first):
    """FSDP materialises a meta-device model by calling every submodule's own
    reset_parameters, parents before children. The softplus gate's decay (an nn.Linear the
    layer initialised itself) was then overwritten by nn.Linear's random init (a decay of
    about 0.5 instead of 0.95), and the Performer's feature map had no reset_parameters."""
    for kind in ("performer", "retnet", "ssd", "gated_deltanet"):
        torch.manual_seed(0)
        reference = LinearAttention(16, 2, kind=kind)
        with torch.device("meta"):
            layer = LinearAttention(16, 2, kind=kind)
        layer = layer.to_empty(device="cpu")
        modules = list(layer.modules())
        for module in modules if parents_first else reversed(modules):
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        for name, b in layer.named_buffers():
            assert torch.equal(b, dict(reference.named_buffers())[name]), (kind, name)
        if hasattr(layer, "decay_proj"):
            assert torch.equal(layer.decay_proj.bias, reference.decay_proj.bias), kind
            assert not layer.decay_proj.weight.any(), kind


def test_a_performer_without_a_seed_is_drawn_afresh_after_a_deferred_initialisation():
    with torch.device("meta"):
        layer = LinearAttention(16, 2, kind="performer", seed=None)
    layer = layer.to_empty(device="cpu")
    layer.reset_parameters()
    W = layer.feature_map.W
    assert torch.isfinite(W).all() and 0.5 < W.std() < 2  # N(0, 1) rows, not leftover memory


def test_autocast_activations_of_another_dtype_are_taken():
    """Under torch.autocast the layer takes what the op before it produced (bf16 from an
    autocast nn.Linear), as nn.Linear does; outside autocast a dtype mismatch is refused."""
    layer = LinearAttention(16, 2, kind="gated_deltanet")
    x = torch.randn(2, 9, 16).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.isfinite(layer(x)).all()
    with pytest.raises(TypeError, match="dtype torch.bfloat16 but the module's weights are torch.float32"):
        layer(x)


def test_a_redrawn_performer_projection_survives_reset_parameters():
    layer = _layer("performer")
    layer.feature_map.redraw(seed=7)
    drawn = layer.feature_map.W.clone()
    layer.reset_parameters()
    assert layer.feature_map.seed == 7 and torch.equal(layer.feature_map.W, drawn)


# --- production options: SiLU on q, k, v; Mamba-2's gate; output gate with RMSNorm ---------

PRODUCTION = dict(activation="silu", gate="mamba", output_gate=True)
PRODUCTION_KINDS = ("linear", "retnet", "ssd", "deltanet", "gated_deltanet")


def _production(kind):
    kw = dict(PRODUCTION)
    if kind not in ("ssd", "gated_deltanet"):
        kw.pop("gate")
    return _layer(kind, **kw)


@pytest.mark.parametrize("kind", PRODUCTION_KINDS)
def test_production_options_keep_every_equivalence(kind):
    """With the options on, packed == separate and the one-token decode == the parallel form."""
    layer = _production(kind)
    x = torch.randn(1, 19, 16, dtype=D64)
    cu = torch.tensor([0, 7, 19])
    with torch.no_grad():
        full, _ = layer(x, return_state=True)
        packed = layer(x, cu_seqlens=cu)
        alone = torch.cat([layer(x[:, :7]), layer(x[:, 7:])], dim=1)
        y, state = layer(x[:, :10], return_state=True)
        steps = [y]
        for t in range(10, 19):
            y_t, state = layer(x[:, t:t + 1], state=state, pos_offset=t, return_state=True)
            steps.append(y_t)
    assert (packed - alone).abs().max() < 1e-10
    assert (torch.cat(steps, dim=1) - full).abs().max() < 1e-10


def test_production_options_compute_what_fla_computes():
    """Gated DeltaNet with the options, written out in float64 from fla's GatedDeltaNet layer
    (fla/layers/gated_deltanet.py, no short convolution): q, k, v = silu(proj), L2-normalised q
    and k, beta = sigmoid(b_proj x), g = -exp(A_log) softplus(a_proj x + dt_bias), the gated
    delta rule, o = RMSNorm(o) * silu(g_proj x), then o_proj."""
    import torch.nn.functional as F

    from linattn_lib import delta_rule_attention

    layer = _production("gated_deltanet")
    dt = F.softplus(layer.dt_bias)
    assert ((layer.A_log.exp() > 0) & (layer.A_log.exp() < 16)).all()
    assert ((dt > 1e-3 - 1e-12) & (dt < 0.1 + 1e-12)).all()
    x = torch.randn(2, 13, 16, dtype=D64)
    B, T, H, dh = 2, 13, 2, 8

    def heads(t):
        return t.view(B, T, H, dh).transpose(1, 2)

    q, k, v = (heads(t) for t in F.silu(layer.qkv(x)).chunk(3, dim=-1))
    beta = torch.sigmoid(layer.beta_proj(x)).transpose(1, 2)
    g = (-layer.A_log.exp() * F.softplus(layer.decay_proj(x) + layer.dt_bias)).transpose(1, 2)
    o = delta_rule_attention(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, beta, log_decay=g,
                             form="recurrent")
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * layer.out_norm
    o = o * F.silu(heads(layer.gate_proj(x)))
    y = layer.proj(o.transpose(1, 2).reshape(B, T, H * dh))
    assert (layer(x) - y).abs().max() < 1e-10


def test_production_options_are_checked_and_reset():
    with pytest.raises(ValueError, match=r"LinearAttention: unknown gate='exp'"):
        LinearAttention(16, 2, kind="ssd", gate="exp")
    with pytest.raises(ValueError, match=r"LinearAttention: unknown activation='gelu'"):
        LinearAttention(16, 2, activation="gelu")
    layer = _production("gated_deltanet")
    layer.apply(_nanogpt_init)
    with torch.no_grad():
        layer.A_log.zero_()
        layer.dt_bias.zero_()
    layer.reset_parameters()
    dt = torch.nn.functional.softplus(layer.dt_bias)
    assert (layer.A_log != 0).all() and ((dt > 1e-3 - 1e-12) & (dt < 0.1 + 1e-12)).all()
    assert layer.gate_proj.weight.std() > 0.05


def test_fla_spellings_and_parameter_marks():
    """fla's qk_activation="elu" is its elu+1, so the layer takes that spelling for the same map;
    A_log and dt_bias carry fla's `_no_weight_decay` mark, which training code reads to keep the
    decay's parameters out of weight decay (a user porting from fla found both missing)."""
    torch.manual_seed(0)
    a = LinearAttention(16, 2, kind="deltanet", activation="elu")
    b = LinearAttention(16, 2, kind="deltanet", activation="elu+1")
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    assert torch.equal(a.double()(x), b.double()(x))
    layer = fla_layer(16, 2)
    marked = {n for n, p in layer.named_parameters() if getattr(p, "_no_weight_decay", False)}
    assert marked == {"A_log", "dt_bias"}


@pytest.mark.parametrize("kind", ["retnet", "ssd", "deltanet", "gated_deltanet"])
def test_float16_layers_train_with_finite_gradients(kind):
    """A layer cast with .half(): a reader found inf gradients in 3 to 9 of 10 seeds for these
    kinds, from the output RMS norm's backward (rsqrt cubed overflows float16 once a head's
    RMS is below about 0.025); the norm now runs in float32, as fla's does."""
    bad = 0
    for seed in range(6):
        torch.manual_seed(seed)
        layer = LinearAttention(16, 2, kind=kind).half()
        x = torch.randn(2, 70, 16, dtype=torch.half, requires_grad=True)
        layer(x).float().sum().backward()
        grads = [x.grad] + [p.grad for p in layer.parameters() if p.grad is not None]
        bad += not all(torch.isfinite(g).all() for g in grads)
    assert bad == 0


def test_cosformer_refuses_to_resume_packed_sequences():
    """cosFormer's positions restart in every packed sequence; one pos_offset cannot continue
    sequences of different lengths, so a state or an offset with cu_seqlens is refused (a
    reader found outputs 50% off, silently); unpacked, each row resumes at its offset."""
    torch.manual_seed(0)
    layer = LinearAttention(16, 2, kind="cosformer").double()
    cu = torch.tensor([0, 2, 42])
    x = torch.randn(1, 42, 16, dtype=torch.float64)
    _, state = layer(x, cu_seqlens=cu, return_state=True)  # a fresh start is fine
    step = torch.randn(1, 2, 16, dtype=torch.float64)
    for kwargs in (dict(state=state), dict(pos_offset=2)):
        with pytest.raises(ValueError, match="restart at 0 in every packed sequence"):
            layer(step, cu_seqlens=torch.tensor([0, 1, 2]), **kwargs)


@pytest.mark.parametrize("short_conv", [False, True])
def test_a_saved_state_loads_with_torch_loads_defaults(short_conv, tmp_path):
    """torch.load reads only allow-listed types by default (weights_only=True since torch 2.6):
    a prompt's state, saved to continue later, loads as the state types it was saved as, and
    continuing from it equals continuing from the one in memory."""
    torch.manual_seed(0)
    layer = LinearAttention(16, 2, short_conv=short_conv)
    x = torch.randn(2, 9, 16)
    with torch.no_grad():
        _, state = layer(x[:, :6], return_state=True)
        torch.save({"state": state}, tmp_path / "state.pt")
        loaded = torch.load(tmp_path / "state.pt")["state"]
        assert type(loaded) is type(state)
        assert torch.equal(layer(x[:, 6:], state=loaded), layer(x[:, 6:], state=state))


def test_a_linear_layers_state_given_to_a_softmax_layer_is_named():
    """A LinearAttentionState is a pair too: the softmax layer refuses it as what it is, not
    as a KV cache of the wrong shape; its own cache (a plain tuple) still resumes."""
    x = torch.randn(1, 4, 8)
    _, linear_state = LinearAttention(8, 2)(x, return_state=True)
    softmax = SoftmaxAttention(8, 2)
    with pytest.raises(TypeError, match="KV cache .* of a softmax layer, got LinearAttentionState"):
        softmax(x, state=linear_state)
    _, cache = softmax(x, return_state=True)
    assert softmax(x[:, :1], state=cache).shape == (1, 1, 8)
