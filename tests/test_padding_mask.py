"""`LinearAttention(..., attention_mask=...)`: a padded batch (left or right padding, as Hugging
Face models pass it) gives, at each row's real tokens, the outputs, gradients and final state
(the short convolution's cache included) of that row alone without its padding; padding
positions give 0 and receive no gradient. Every kind, with fla's layer options for the delta
kinds, float64 on the torch path; three kinds on the Triton kernels (interpreter, float32)."""
from __future__ import annotations

import pytest
import torch

from linattn_lib import LinearAttention
from linattn_lib.nn import LINEAR_KINDS
from linattn_lib.nn.layers import FLA_PRESETS

LENGTHS = (21, 13, 1)  # a full row, a padded one, a single token
LAYERS = [(kind, {}) for kind in LINEAR_KINDS] + [(k, FLA_PRESETS[k]) for k in ("deltanet", "gated_deltanet")]


def padded(side: str, T: int = 21) -> torch.Tensor:
    """(B, T) bool: row b's LENGTHS[b] tokens at the end (left padding), at the start (right),
    or "inside": every third position padding, the second row also padded at its end and the
    third a single token."""
    positions = torch.arange(T)
    if side == "inside":
        holes = positions % 3 != 2
        return torch.stack([holes, holes & (positions < 19), positions == 0])
    return torch.stack([positions >= T - n if side == "left" else positions < n for n in LENGTHS])


def _attn_and_conv(state):
    return (state.attn, state.conv) if hasattr(state, "conv") else (state, None)


def _close(got, want, tol) -> bool:
    """|got - want| <= tol, relative to want's scale where that is above 1 (gradients of a
    squared output reach ~60 in float32, where rounding differs from one CPU to another)."""
    return bool((got - want).abs().max() <= tol * max(1.0, want.abs().max().item()))


def check_against_unpadded(layer, x, mask, tol):
    returns_state = layer.kind != "cosformer"  # its next position differs per row
    out = layer(x, attention_mask=mask, return_state=returns_state)
    y, state = out if returns_state else (out, None)
    (grad,) = torch.autograd.grad(y.square().sum(), x)
    for b in range(x.shape[0]):
        real = mask[b].bool()
        x_b = x[b:b + 1, real].detach().requires_grad_()
        out_b = layer(x_b, return_state=returns_state)
        y_b, state_b = out_b if returns_state else (out_b, None)
        (grad_b,) = torch.autograd.grad(y_b.square().sum(), x_b)
        assert _close(y[b, real], y_b[0], tol)
        assert _close(grad[b, real], grad_b[0], tol)
        assert not y[b, ~real].any() and not grad[b, ~real].any()
        if returns_state:
            (a, conv), (a_b, conv_b) = _attn_and_conv(state), _attn_and_conv(state_b)
            assert _close(a.S[b], a_b.S[0], tol)
            if a.z is not None:
                assert _close(a.z[b], a_b.z[0], tol)
            if conv is not None:
                assert _close(conv[b], conv_b[0], tol)


@pytest.mark.parametrize("side", ["left", "right", "inside"])
@pytest.mark.parametrize("kind, options", LAYERS, ids=[k + ("-fla" if o else "") for k, o in LAYERS])
def test_padded_rows_equal_the_rows_alone(kind, options, side):
    torch.manual_seed(0)
    layer = LinearAttention(16, 2, kind=kind, chunk_size=8, **options).double()
    x = torch.randn(len(LENGTHS), 21, 16, dtype=torch.float64, requires_grad=True)
    check_against_unpadded(layer, x, padded(side), 1e-12)


@pytest.mark.parametrize("kind, options", LAYERS, ids=[k + ("-fla" if o else "") for k, o in LAYERS])
def test_padding_that_overflows_or_is_nan_changes_nothing(kind, options):
    """Padding is selected out, not multiplied by 0: the Performer's unstabilised key features
    of a huge padding vector are inf (inf * 0 = NaN), and a caller may fill padding with NaN.
    Also past fla's output gate (on in its Gated DeltaNet), whose gate is NaN there; the
    real tokens' input gradients stay those of the clean batch."""
    torch.manual_seed(0)
    layer = LinearAttention(16, 2, kind=kind, chunk_size=8, **options).double()
    mask = padded("left")
    x = torch.randn(len(LENGTHS), 21, 16, dtype=torch.float64)

    def run(x):
        x = x.requires_grad_()
        y = layer(x, attention_mask=mask)
        return y.detach(), torch.autograd.grad(y.square().sum(), x)[0][mask]

    clean = run(x)
    for fill in (1e6, float("nan")):
        y, grad = run(x.masked_fill(~mask[..., None], fill))
        assert torch.equal(y, clean[0]) and torch.equal(grad, clean[1]), fill


@pytest.mark.parametrize("kind", ["linear", "retnet", "gated_deltanet"])
def test_padded_rows_on_the_kernels(kind):
    """The Triton path (a per-head decay becomes a per-token one, 0 on padding); a 0/1 long mask."""
    pytest.importorskip("triton")
    torch.manual_seed(0)
    layer = LinearAttention(32, 2, kind=kind, backend="triton")
    x = torch.randn(len(LENGTHS), 21, 32, requires_grad=True)
    check_against_unpadded(layer, x, padded("left").long(), 1e-4)  # float32: two kernel variants


def test_padded_rows_compile_as_one_graph():
    torch.manual_seed(0)
    layer = LinearAttention(16, 2, kind="gated_deltanet", chunk_size=8, **FLA_PRESETS["gated_deltanet"]).double()
    x = torch.randn(len(LENGTHS), 21, 16, dtype=torch.float64)
    mask = padded("left")
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    y, y_c = layer(x, attention_mask=mask), compiled(x, attention_mask=mask)
    assert (y - y_c).abs().max() < 1e-12


def test_generation_continues_from_a_left_padded_prompt(monkeypatch):
    """Prefill a left-padded batch of prompts, then decode: each row continues as its prompt
    alone would (attention state and convolution cache), through the decode step."""
    import linattn_lib.nn.layers as layers

    step, steps_run = layers.delta_rule_decode_step, []
    monkeypatch.setattr(layers, "delta_rule_decode_step", lambda *a, **kw: steps_run.append(1) or step(*a, **kw))
    torch.manual_seed(0)
    layer = LinearAttention(16, 2, kind="gated_deltanet", chunk_size=8, **FLA_PRESETS["gated_deltanet"]).double()
    prompts, more = torch.randn(3, 21, 16, dtype=torch.float64), torch.randn(3, 4, 16, dtype=torch.float64)
    mask = padded("left")
    with torch.no_grad():
        _, state = layer(prompts, attention_mask=mask, return_state=True)
        steps = []
        for t in range(more.shape[1]):  # one token at a time: the decode path
            y, state = layer(more[:, t:t + 1], state=state, return_state=True)
            steps.append(y)
        steps = torch.cat(steps, 1)
        for b, n in enumerate(LENGTHS):
            alone = torch.cat([prompts[b:b + 1, 21 - n:], more[b:b + 1]], 1)
            assert (layer(alone)[0, n:] - steps[b]).abs().max() < 1e-12
    assert len(steps_run) == more.shape[1]


@pytest.mark.parametrize("kind, options", [(k, o) for k, o in LAYERS if k != "cosformer"],
                         ids=[k + ("-fla" if o else "") for k, o in LAYERS if k != "cosformer"])
def test_a_mask_with_a_state_marks_the_new_tokens(kind, options):
    """Continue padded rows from their states, with a mask over the new tokens only: a
    second padded chunk (training's next segment), then decoding steps some of which are
    padding (a batch whose rows finished). Each row equals its real tokens alone, and a
    padding step leaves its state and convolution cache as they were."""
    torch.manual_seed(0)
    layer = LinearAttention(16, 2, kind=kind, chunk_size=8, **options).double()
    x = torch.randn(3, 21, 16, dtype=torch.float64)
    more, steps = torch.randn(3, 9, 16, dtype=torch.float64), torch.randn(3, 3, 16, dtype=torch.float64)
    first, second = padded("left"), padded("inside", 9)
    step_mask = torch.tensor([[True, False, True], [False, False, True], [True, True, True]])
    _, state = layer(x, attention_mask=first, return_state=True)
    y, state = layer(more, state=state, attention_mask=second, return_state=True)
    with torch.no_grad():
        ys = []
        for t in range(3):
            y_t, state = layer(steps[:, t:t + 1], state=state, attention_mask=step_mask[:, t:t + 1],
                               return_state=True)
            ys.append(y_t)
    ys = torch.cat(ys, 1)
    assert not y[~second].any() and not ys[~step_mask].any()
    for b in range(3):
        tokens = torch.cat([x[b, first[b]], more[b, second[b]], steps[b, step_mask[b]]])[None]
        y_b, state_b = layer(tokens, return_state=True)
        n1, n2 = int(first[b].sum()), int(second[b].sum())
        assert (y[b, second[b]] - y_b[0, n1:n1 + n2]).abs().max() < 1e-12
        assert (ys[b, step_mask[b]] - y_b[0, n1 + n2:]).abs().max() < 1e-12
        (a, conv), (a_b, conv_b) = _attn_and_conv(state), _attn_and_conv(state_b)
        assert (a.S[b] - a_b.S[0]).abs().max() < 1e-12
        if conv is not None:
            assert (conv[b] - conv_b[0]).abs().max() < 1e-12


def test_cosformer_max_len_bounds_each_sequence_not_the_row():
    """cosFormer's positions restart in every packed sequence and count a padded row's own
    tokens, so max_len bounds those: two packed sequences of 6 and 5 tokens, or a row of 6
    tokens padded to 9, fit max_len = 8 (and equal the sequences alone); a sequence of 9 does
    not, packed, padded or alone."""
    torch.manual_seed(0)
    layer = LinearAttention(16, 2, kind="cosformer", max_len=8).double()
    a, b = (torch.randn(1, n, 16, dtype=torch.float64) for n in (6, 5))
    cu = torch.tensor([0, 6, 11], dtype=torch.int32)
    packed = layer(torch.cat([a, b], 1), cu_seqlens=cu)
    assert _close(packed, torch.cat([layer(a), layer(b)], 1), 1e-12)
    mask = torch.arange(9)[None] >= 3  # 3 padding tokens, then 6
    row = torch.cat([torch.randn(1, 3, 16, dtype=torch.float64), a], 1)
    assert _close(layer(row, attention_mask=mask)[:, 3:], layer(a), 1e-12)
    long = torch.randn(1, 9, 16, dtype=torch.float64)
    for call in (lambda: layer(long), lambda: layer(torch.cat([a, long], 1), cu_seqlens=torch.tensor([0, 6, 15])),
                 lambda: layer(torch.cat([long, long], 1), attention_mask=torch.arange(18)[None] >= 9)):
        with pytest.raises(ValueError, match="position 9 exceeds max_len=8"):
            call()
