"""TinyLM and SoftmaxAttention with an `attention_mask`: a padded batch computes each row as
it would alone (logits, loss, generation), left or right padded, for every kind of layer and
for hybrids. float64, so "as alone" is to rounding."""
from __future__ import annotations

import pytest
import torch

from linattn_lib.nn.layers import SoftmaxAttention
from linattn_lib.nn.models import ModelConfig, TinyLM

LENGTHS = (5, 9, 7)
MODELS = [
    ("softmax", (), {}), ("linear", (), {}), ("performer", (), {}), ("cosformer", (), {}),
    ("retnet", (0,), {}), ("ssd", (), {"short_conv": True}), ("deltanet", (), {}),
    ("gated_deltanet", (1,), {"short_conv": True}),
]


def _model(attention: str, softmax_layers: tuple, options: dict) -> TinyLM:
    cfg = ModelConfig(vocab_size=11, block_size=32, n_layer=2, n_head=2, d_model=16, attention=attention,
                      softmax_layers=softmax_layers, layer_options=options)
    return TinyLM(cfg).double().eval()


def _padded(prompts: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(p) for p in prompts)
    idx = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.bool)
    for i, p in enumerate(prompts):
        span = slice(T - len(p), T) if side == "left" else slice(0, len(p))
        idx[i, span], mask[i, span] = p, True
    idx[~mask] = 3  # padding holds some token: it must not matter which
    return idx, mask


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("attention,softmax_layers,options", MODELS, ids=lambda x: str(x))
def test_padded_batch_equals_each_row_alone(attention, softmax_layers, options, side):
    torch.manual_seed(0)
    model = _model(attention, softmax_layers, options)
    prompts = [torch.randint(0, 11, (n,)) for n in LENGTHS]
    idx, mask = _padded(prompts, side)
    targets = torch.randint(0, 11, idx.shape)
    logits, loss = model(idx, targets, attention_mask=mask)
    for i, p in enumerate(prompts):
        torch.testing.assert_close(logits[i][mask[i]], model(p[None])[0], rtol=0, atol=1e-12)
    # the loss is over the tokens only, whatever the padding's targets
    want = torch.nn.functional.cross_entropy(logits[mask], targets[mask])
    torch.testing.assert_close(loss, want, rtol=0, atol=1e-12)
    if attention == "cosformer":  # its rows would continue from different positions
        with pytest.raises(ValueError, match="cosFormer"):
            model.generate(idx, 3, greedy=True, attention_mask=mask)
        # prompts of one length: an all-ones mask (as a tokenizer returns it) is no padding
        same = idx[:, :LENGTHS[-1]]
        want = model.generate(same, 3, greedy=True)
        assert torch.equal(model.generate(same, 3, greedy=True, attention_mask=torch.ones_like(same)), want)
        return
    out = model.generate(idx, 6, greedy=True, attention_mask=mask)
    assert torch.equal(out[:, :idx.shape[1]], idx)
    for i, p in enumerate(prompts):
        alone = model.generate(p[None], 6, greedy=True)[0, len(p):]
        assert torch.equal(out[i, idx.shape[1]:], alone), (i, out[i], alone)


def test_forward_continues_padded_rows_with_position_ids():
    """A decoding loop written by hand: prefill with the mask, then each row's next token at
    its own position (its token count), from the returned states."""
    torch.manual_seed(0)
    model = _model("retnet", (1,), {})
    idx, mask = _padded([torch.tensor([3, 4, 5]), torch.tensor([1, 2, 3, 4, 5])], "left")
    with torch.no_grad():
        _, states = model(idx, attention_mask=mask, return_states=True)
        nxt = torch.tensor([[7], [8]])
        logits = model(nxt, states=states, pos_offset=idx.shape[1], position_ids=mask.sum(1, keepdim=True))
        for i, row in enumerate(([3, 4, 5, 7], [1, 2, 3, 4, 5, 8])):
            alone = model(torch.tensor([row]))[0, -1]
            torch.testing.assert_close(logits[i, 0], alone, rtol=0, atol=1e-12)


def test_softmax_layer_cache_carries_the_key_mask():
    torch.manual_seed(0)
    layer = SoftmaxAttention(8, 2).double()
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    y, cache = layer(x, attention_mask=mask, return_state=True)
    assert len(cache) == 3 and torch.equal(cache[2], mask)
    assert (y[0, :2] == 0).all()  # padding's outputs
    torch.testing.assert_close(y[0, 2:], layer(x[:1, 2:])[0], rtol=0, atol=1e-12)
    step = torch.randn(2, 1, 8, dtype=torch.float64)
    y1, cache = layer(step, state=cache, return_state=True)
    assert torch.equal(cache[2][:, -1], torch.tensor([True, True]))
    whole = layer(torch.cat([x[:1, 2:], step[:1]], dim=1))[0, -1]
    torch.testing.assert_close(y1[0, 0], whole, rtol=0, atol=1e-12)


@pytest.mark.parametrize("case,message", [
    ("state", "no `states`"), ("shape", r"\(B, T\)"), ("values", "0 \\(padding\\) and 1"),
    ("empty row", "needs a token"), ("positions", "position_ids"),
])
def test_bad_masks_are_refused(case, message):
    model = _model("linear", (0,), {})
    idx = torch.randint(0, 11, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.long)
    kw = {}
    if case == "state":
        _, states = model(idx, return_states=True)
        kw = dict(states=states, pos_offset=5)
    elif case == "shape":
        mask = mask[:, :4]
    elif case == "values":
        mask = mask * 2
    elif case == "empty row":
        mask[1] = 0
    else:
        kw = dict(position_ids=torch.arange(5).expand(2, 5))
    with pytest.raises(ValueError, match=message):
        model(idx, attention_mask=mask, **kw)


def test_softmax_layer_mask_with_a_state_marks_the_new_tokens():
    torch.manual_seed(0)
    layer = SoftmaxAttention(8, 2).double()
    x, more = torch.randn(2, 4, 8, dtype=torch.float64), torch.randn(2, 3, 8, dtype=torch.float64)
    _, cache = layer(x, return_state=True)  # no mask: a two-part cache
    new = torch.tensor([[1, 0, 1], [1, 1, 1]], dtype=torch.bool)
    y, cache = layer(more, state=cache, attention_mask=new, return_state=True)
    assert len(cache) == 3 and cache[2][:, :4].all() and torch.equal(cache[2][:, 4:], new)
    assert (y[0, 1] == 0).all()
    alone = layer(torch.cat([x[:1], more[:1, new[0]]], dim=1))[0, 4:]
    torch.testing.assert_close(y[0, new[0]], alone, rtol=0, atol=1e-12)


@pytest.mark.parametrize("case,message", [
    ("values", "0 \\(padding\\) and 1"), ("mask shape", r"\(B, T\)"),
    ("cache batch", "expected \\(B=2"), ("key mask length", "key mask"), ("width", "channels"),
])
def test_softmax_layer_refuses_bad_masks_and_caches(case, message):
    """SoftmaxAttention called directly checks what LinearAttention and TinyLM check: a mask
    of 0 and 1 of the input's (B, T), and a cache that fits the input (it used to take a mask
    of 2s as tokens and fail inside torch on a cache of another batch)."""
    torch.manual_seed(0)
    layer = SoftmaxAttention(8, 2).double()
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    _, cache = layer(x, attention_mask=torch.ones(2, 4, dtype=torch.bool), return_state=True)
    kw = dict(attention_mask=torch.tensor([[1, 1, 2, 1], [1, 1, 1, 1]]))
    if case == "mask shape":
        kw = dict(attention_mask=torch.ones(2, 3, dtype=torch.long))
    elif case == "cache batch":
        kw = dict(state=tuple(t[:1] for t in cache))
    elif case == "key mask length":
        kw = dict(state=(*cache[:2], cache[2][:, :3]))
    elif case == "width":
        x = x[..., :6]
    with pytest.raises(ValueError, match=message):
        layer(x, **kw)
