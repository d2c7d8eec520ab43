"""LinearAttention(write="additive"): the delta kinds' layer with the running sum
S <- alpha_t S + beta_t k_t v_t^T in place of the delta rule (chapter 10's control that isolates
the write rule: same unit keys, beta, decay, output norm and parameters)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from decode_steps import decode_stepwise

from linattn_lib import LinearAttention
from linattn_lib.nn.layers import DELTA_KINDS, LINEAR_KINDS

D64 = torch.float64


def _pair(kind, **kw):
    torch.manual_seed(0)
    delta = LinearAttention(16, 2, kind=kind, chunk_size=8, **kw).double()
    additive = LinearAttention(16, 2, kind=kind, chunk_size=8, write="additive", **kw).double()
    additive.load_state_dict(delta.state_dict())  # the same parameters
    return delta, additive


def _reference(layer, x):
    """The additive layer written out in float64, one token at a time."""
    q, k, v, _ = layer._project(x, None, None)
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    beta = torch.sigmoid(layer.beta_proj(x)).transpose(1, 2)
    g = layer._decay(x)
    S = x.new_zeros(x.shape[0], layer.n_heads, layer.d_head, layer.d_head)
    outs = []
    for t in range(x.shape[1]):
        if g is not None:
            S = g[:, :, t, None, None].exp() * S
        S = S + beta[:, :, t, None, None] * k[:, :, t, :, None] * v[:, :, t, None, :]
        outs.append((q[:, :, t, :, None] * S).sum(-2))
    o = torch.stack(outs, dim=2)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.norm_eps) * layer.out_norm
    return layer.proj(o.transpose(1, 2).flatten(2))


@pytest.mark.parametrize("kind", DELTA_KINDS)
def test_additive_write_is_the_running_sum(kind):
    delta, additive = _pair(kind)
    x = torch.randn(2, 21, 16, dtype=D64)
    assert (additive(x) - _reference(additive, x)).abs().max() < 1e-12
    assert (additive(x) - delta(x)).abs().max() > 1e-3  # a different rule, same parameters


@pytest.mark.parametrize("kind", DELTA_KINDS)
def test_additive_write_decodes_and_packs_like_the_parallel_form(kind):
    _, layer = _pair(kind, short_conv=True)
    x = torch.randn(1, 15, 16, dtype=D64)
    with torch.no_grad():
        full, st_full = layer(x, return_state=True)
        steps, st = decode_stepwise(layer, x, 6)
        assert (steps - full).abs().max() < 1e-12
        assert (st.attn.S - st_full.attn.S).abs().max() < 1e-12
        cu = torch.tensor([0, 6, 15])
        packed = layer(x, cu_seqlens=cu)
        alone = torch.cat([layer(x[:, :6]), layer(x[:, 6:])], dim=1)
        assert (packed - alone).abs().max() < 1e-12


@pytest.mark.parametrize("kind", [k for k in LINEAR_KINDS if k not in DELTA_KINDS])
def test_additive_write_is_refused_where_it_means_nothing(kind):
    with pytest.raises(ValueError, match="write='additive' applies to the delta kinds"):
        LinearAttention(16, 2, kind=kind, write="additive")
    with pytest.raises(ValueError, match="write"):
        LinearAttention(16, 2, kind="deltanet", write="sum")


def test_mqar_builds_the_additive_control(tmp_path):
    out = tmp_path / "additive.json"
    from linattn_lib.experiments import mqar

    model = mqar.build_model(mqar.config_for("deltanet", write="additive", d_model=16))
    assert [b.attn.write for b in model.blocks] == ["additive"] * len(model.blocks)
    assert all(b.attn.kind == "deltanet" for b in model.blocks)
    payload = mqar.main(["--task", "zoology", "--kinds", "deltanet", "--state-kinds", "--d-model", "16",
                         "--steps", "3", "--seq-len", "16", "--vocab-size", "32", "--pairs", "2", "4",
                         "--batch-size", "4", "--jobs", "1", "--write", "additive", "--out", str(out), "--no-progress"])
    assert {r["config"]["write"] for r in payload["results"]} == {"additive"}


def test_committed_additive_sweep_is_the_control():
    from linattn_lib.results import load_result

    res = load_result("mqar_additive.json")
    assert "--write additive" in res["meta"]["command"]
    cells = {(r["d_model"], r["config"]["seed"]) for r in res["results"]}
    assert cells == {(d, s) for d in (16, 32, 64) for s in (0, 1, 2)}
    assert all(r["kind"] == "deltanet" and r["config"]["write"] == "additive" for r in res["results"])
