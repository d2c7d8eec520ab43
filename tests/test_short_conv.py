"""The short causal convolution (issue 32, item 5) and fla's layer presets.

* `ShortConvolution` is y[t] = sum_s w[K-1-s] x[t-s] (float64, written out), resumable from
  its cache, and packed sequences equal separate ones (a zero-length one keeps its cache);
* with short_conv=True every kind keeps the layer's equivalences: packed == separate (outputs
  and both parts of the state), one-token decode == parallel form, fullgraph compile == eager;
* `fla_layer("deltanet" | "gated_deltanet")` computes what fla's DeltaNet / GatedDeltaNet
  layers compute, written out from fla/layers/*.py in float64 (separate q, k, v convolutions
  with SiLU, L2 norm, beta without bias, the (gated) delta rule, RMSNorm(eps=1e-5) [times
  silu(g_proj x)], o_proj);
* a TinyLM with layer_options generates from its states what its parallel form computes.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from decode_steps import decode_stepwise

from linattn_lib import LinearAttention, ModelConfig, TinyLM, delta_rule_attention
from linattn_lib.nn import FLA_PRESETS, ConvLayerState, ShortConvolution, fla_layer
from linattn_lib.nn.models import LINEAR_KINDS

D64 = torch.float64


def test_short_convolution_is_the_causal_filter():
    torch.manual_seed(0)
    conv = ShortConvolution(6, 4, bias=True).double()
    x = torch.randn(2, 11, 6, dtype=D64)
    y, cache = conv(x)
    w, b = conv.conv.weight[:, 0], conv.conv.bias
    padded = torch.cat([torch.zeros(2, 3, 6, dtype=D64), x], dim=1)
    expect = sum(w[:, 3 - s] * padded[:, 3 - s:3 - s + 11] for s in range(4)) + b
    assert (y - expect).abs().max() < 1e-14
    assert torch.equal(cache, x[:, -3:].transpose(1, 2))
    # resumed in three calls (one of one token, one shorter than the kernel)
    y1, c = conv(x[:, :2])
    y2, c = conv(x[:, 2:3], c)
    y3, c = conv(x[:, 3:], c)
    assert (torch.cat([y1, y2, y3], 1) - y).abs().max() < 1e-14 and torch.equal(c, cache)


def test_short_convolution_packed_equals_separate():
    torch.manual_seed(1)
    conv = ShortConvolution(5, 4).double()
    cu = torch.tensor([0, 2, 2, 9, 10])
    x = torch.randn(1, 10, 5, dtype=D64)
    cache = torch.randn(4, 5, 3, dtype=D64)
    y, new = conv(x, cache, cu)
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if s == e:
            assert torch.equal(new[n], cache[n])
            continue
        y_n, c_n = conv(x[:, s:e], cache[n:n + 1])
        assert (y[:, s:e] - y_n).abs().max() < 1e-14 and (new[n] - c_n[0]).abs().max() < 1e-14


def _conv_layer(kind, **kw):
    torch.manual_seed(0)
    return LinearAttention(16, 2, kind=kind, chunk_size=8, short_conv=True, **kw).double()


@pytest.mark.parametrize("kind", LINEAR_KINDS)
def test_conv_layer_keeps_every_equivalence(kind):
    layer = _conv_layer(kind, activation="silu")
    x = torch.randn(1, 19, 16, dtype=D64)
    cu = torch.tensor([0, 2, 19])  # the first sequence is shorter than the kernel
    with torch.no_grad():
        full, st_full = layer(x, return_state=True)
        packed, st = layer(x, cu_seqlens=cu, return_state=True)
        assert isinstance(st, ConvLayerState) and st.conv.shape == (2, 48, 3)
        for n, (s, e) in enumerate([(0, 2), (2, 19)]):
            y_n, st_n = layer(x[:, s:e], return_state=True)
            assert (packed[:, s:e] - y_n).abs().max() < 1e-10
            assert (st.conv[n] - st_n.conv[0]).abs().max() < 1e-12
            assert (st.attn.S[n] - st_n.attn.S[0]).abs().max() < 1e-10
        steps, state = decode_stepwise(layer, x, 10)
    assert (steps - full).abs().max() < 1e-10
    assert (state.attn.S - st_full.attn.S).abs().max() < 1e-10 and torch.equal(state.conv, st_full.conv)


def test_conv_layer_checks_its_state():
    layer = _conv_layer("deltanet")
    bare = LinearAttention(16, 2, kind="deltanet").double()
    x = torch.randn(2, 5, 16, dtype=D64)
    _, st = layer(x, return_state=True)
    _, st_bare = bare(x, return_state=True)
    with pytest.raises(TypeError, match=r"`state` must be a ConvLayerState\(attn, conv\)"):
        layer(x, state=st_bare)
    with pytest.raises(TypeError, match=r"`state` must be a LinearAttentionState\(S, z\)"):
        bare(x, state=st)
    with pytest.raises(ValueError, match=r"`state.conv`"):
        layer(x, state=ConvLayerState(st.attn, st.conv[..., :2]))
    with pytest.raises(ValueError, match=r"`state.conv`.*(NaN|finite)"):
        layer(x, state=ConvLayerState(st.attn, st.conv * float("nan")))
    with pytest.raises(ValueError, match=r"kernel_size"):
        ShortConvolution(4, 1)


@pytest.mark.parametrize("kind", ["linear", "deltanet", "gated_deltanet"])
def test_conv_layer_compiles_as_one_graph(kind):
    layer = fla_layer(16, 2, kind).double() if kind in FLA_PRESETS else _conv_layer(kind)
    x = torch.randn(2, 20, 16, dtype=D64, requires_grad=True)

    def run(fn):
        y, st = fn(x, return_state=True)
        (g,) = torch.autograd.grad(y.square().sum() + st.conv.sum(), x)
        return y.detach(), g

    torch._dynamo.reset()
    y, g = run(layer)
    yc, gc = run(torch.compile(layer, fullgraph=True, backend="aot_eager"))
    assert (yc - y).abs().max() < 1e-12 and (gc - g).abs().max() < 1e-12


def _fla_forward(layer, x, gated):
    """fla's DeltaNet / GatedDeltaNet layer forward, written out (float64, no cache)."""
    B, T, C = x.shape
    H, dh = layer.n_heads, layer.d_head
    w_q, w_k, w_v = layer.qkv.weight.chunk(3, dim=0)  # q_proj, k_proj, v_proj
    c_q, c_k, c_v = layer.conv.conv.weight.chunk(3, dim=0)  # q_conv1d, k_conv1d, v_conv1d

    def short_conv(t, w):  # ShortConvolution(activation="silu"): causal depthwise, then SiLU
        return F.silu(F.conv1d(F.pad(t.transpose(1, 2), (3, 0)), w, groups=C).transpose(1, 2))

    def heads(t):
        return t.view(B, T, H, dh).transpose(1, 2)

    q, k, v = (heads(short_conv(F.linear(x, w), c)) for w, c in ((w_q, c_q), (w_k, c_k), (w_v, c_v)))
    beta = torch.sigmoid(F.linear(x, layer.beta_proj.weight)).transpose(1, 2)  # b_proj, no bias
    g = None
    if gated:
        g = (-layer.A_log.exp() * F.softplus(F.linear(x, layer.decay_proj.weight) + layer.dt_bias)).transpose(1, 2)
    q = F.normalize(q, dim=-1) * dh**-0.5  # use_qk_l2norm_in_kernel=True, scale = K^-0.5
    o = delta_rule_attention(q, F.normalize(k, dim=-1), v, beta, log_decay=g, form="recurrent")
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * layer.out_norm  # RMSNorm(eps=1e-5)
    if gated:
        o = o * F.silu(heads(layer.gate_proj(x)))  # FusedRMSNormGated(o, g_proj(x))
    return layer.proj(o.transpose(1, 2).reshape(B, T, C))


@pytest.mark.parametrize("kind", ["deltanet", "gated_deltanet"])
def test_fla_presets_compute_what_fla_computes(kind):
    torch.manual_seed(0)
    layer = fla_layer(32, 4, kind).double()
    assert layer.beta_proj.bias is None and layer.conv.conv.bias is None and layer.conv.kernel_size == 4
    assert (kind == "gated_deltanet") == (layer.gate == "mamba" and layer.output_gate)
    x = torch.randn(2, 21, 32, dtype=D64)
    assert (layer(x) - _fla_forward(layer, x, kind == "gated_deltanet")).abs().max() < 1e-10
    with pytest.raises(ValueError, match=r"fla_layer: unknown kind='linear'"):
        fla_layer(32, 4, "linear")
    assert fla_layer(32, 4, kind, conv_size=3).conv.kernel_size == 3  # options override


def test_tinylm_with_layer_options_generates_from_its_states():
    cfg = ModelConfig(vocab_size=20, block_size=24, n_layer=2, n_head=2, d_model=16,
                      attention="gated_deltanet", softmax_layers=(1,), layer_options=FLA_PRESETS["gated_deltanet"])
    model = TinyLM(cfg).double()
    assert model.blocks[0].attn.short_conv and model.blocks[0].attn.output_gate
    idx = torch.randint(0, 20, (2, 14))
    with torch.no_grad():
        full = model(idx)
        steps = model.stepwise_logits(idx)
        _, states = model(idx, return_states=True)
    assert (steps - full).abs().max() < 1e-10
    attn, conv = states[0]
    expect = sum(t.numel() * 8 for t in (attn.S, conv, *states[1]))
    assert model.state_nbytes(states) == expect
    with pytest.raises(ValueError, match=r"ModelConfig: `layer_options` may not set \['kind'\]"):
        ModelConfig(vocab_size=20, layer_options={"kind": "linear"})
