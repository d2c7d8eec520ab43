"""Token-by-token decoders equal their parallel forms; the recurrent state is constant in size,
the KV cache grows linearly; bad input raises a clear error."""
import pytest
import torch

from linattn_lib import LinearAttentionState, linear_attention, linear_attention_decode_step, softmax_attention
from linattn_lib.core.decode import KVCacheDecoder, RecurrentDecoder

D64 = torch.float64
TOL = 1e-10


def maxdiff(a, b):
    return (a - b).abs().max().item()


def decode(decoder, q, k, v, log_decay=None):
    outs = []
    for t in range(q.shape[2]):
        extra = ()
        if log_decay is not None:
            extra = (log_decay if log_decay.dim() == 1 else log_decay[:, :, t],)
        outs.append(decoder.step(q[:, :, t], k[:, :, t], v[:, :, t], *extra))
    return torch.stack(outs, dim=2)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("decay", [None, "head", "token"])
def test_recurrent_decoder_equals_parallel(normalize, decay, make_qkv):
    q, k, v = make_qkv()
    log_decay = {None: None, "head": -torch.rand(3, dtype=D64), "token": -torch.rand(2, 3, 21, dtype=D64)}[decay]
    dec = RecurrentDecoder(2, 3, 5, 4, normalize=normalize, dtype=D64)
    out = decode(dec, q, k, v, log_decay)
    expect, state = linear_attention(q, k, v, normalize=normalize, log_decay=log_decay, form="quadratic", return_state=True)
    assert maxdiff(out, expect) < TOL
    assert maxdiff(dec.state.S, state.S) < TOL
    if normalize:
        assert maxdiff(dec.state.z, state.z) < TOL
    assert dec.tokens_seen == 21


def test_recurrent_decoder_resumes_from_a_prefill(make_qkv):
    """Prefill the prompt in parallel, then decode the rest token by token."""
    q, k, v = make_qkv(T=30)
    full = linear_attention(q, k, v, form="quadratic")
    _, state = linear_attention(q[:, :, :12], k[:, :, :12], v[:, :, :12], return_state=True)
    dec = RecurrentDecoder(2, 3, 5, 4, dtype=D64, initial_state=state)
    assert maxdiff(decode(dec, q[:, :, 12:], k[:, :, 12:], v[:, :, 12:]), full[:, :, 12:]) < TOL


def test_kv_cache_decoder_equals_softmax_attention(make_qkv):
    q, k, v = make_qkv(T=37)
    for scale in (None, 0.7):
        dec = KVCacheDecoder(2, 3, 5, 4, scale=scale, capacity=4, dtype=D64)
        out = decode(dec, q, k, v)
        assert maxdiff(out, softmax_attention(q, k, v, causal=True, scale=scale)) < TOL


def test_memory_constant_versus_linear(make_qkv):
    B, H, Dk, Dv = 1, 2, 8, 8
    rec = RecurrentDecoder(B, H, Dk, Dv)
    kv = KVCacheDecoder(B, H, Dk, Dv, capacity=1)
    q, k, v = (x.float() for x in make_qkv(B, H, 40, Dk, Dv))
    state_bytes = rec.nbytes
    assert state_bytes == 4 * B * H * (Dk * Dv + Dk)
    for t in range(40):
        rec.step(q[:, :, t], k[:, :, t], v[:, :, t])
        kv.step(q[:, :, t], k[:, :, t], v[:, :, t])
        assert rec.nbytes == state_bytes
        assert kv.nbytes == 4 * B * H * (t + 1) * (Dk + Dv)
    cap = kv.capacity_nbytes // (4 * B * H * (Dk + Dv))
    assert cap == 64  # doubled from 1 until 40 tokens fit


def test_recurrent_decoder_is_differentiable(make_qkv):
    q, k, v = make_qkv(T=8)
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    decode(RecurrentDecoder(2, 3, 5, 4, dtype=D64), *xs).sum().backward()
    ys = [x.clone().requires_grad_() for x in (q, k, v)]
    linear_attention(*ys, form="quadratic").sum().backward()
    for a, b in zip(xs, ys):
        assert maxdiff(a.grad, b.grad) < 1e-9


@pytest.mark.parametrize("wants", ["q_t", "v_t", "log_decay_t", "state.S"])
def test_decode_step_refuses_to_drop_a_gradient_silently(wants, make_qkv):
    """The in-place decode step cuts its output off the graph: while gradients are recorded,
    an input that asks for one is refused (naming it and the differentiable call), so a loss
    cannot silently miss it; under no_grad / inference_mode the same call runs."""
    from linattn_lib import linear_attention_decode_step as step

    q, k, v = (x[:, :, 0] for x in make_qkv(T=1))
    g = -torch.rand(3, dtype=D64)

    def call():
        x = dict(q_t=q, v_t=v, log_decay_t=g,
                 state_S=torch.zeros(2, 3, 5, 4, dtype=D64))
        x[wants.replace(".", "_")] = x[wants.replace(".", "_")].clone().requires_grad_()
        state = LinearAttentionState(x["state_S"], torch.zeros(2, 3, 5, dtype=D64))
        return step(x["q_t"], k, x["v_t"], state, log_decay_t=x["log_decay_t"])

    with pytest.raises(RuntimeError, match=rf"`{wants}` requires grad.*no_grad.*linear_attention\("):
        call()
    with torch.no_grad():
        assert call().shape == (2, 3, 4)
    with torch.inference_mode():
        assert call().shape == (2, 3, 4)


def test_decoder_errors(make_qkv):
    dec = RecurrentDecoder(2, 3, 5, 4, dtype=D64)
    q, k, v = (x[:, :, 0] for x in make_qkv())
    with pytest.raises(ValueError, match=r"`q_t` has shape \(2, 3, 4\); expected \(B=2, H=3, D=5\)"):
        dec.step(q[..., :4], k, v)
    with pytest.raises(ValueError, match=r"`v_t` must be a 3-d tensor laid out as \(B, H, D\)"):
        dec.step(q, k, v[0])
    with pytest.raises(TypeError, match=r"`k_t` has dtype torch.float32 but the decoder takes torch.float64"):
        dec.step(q, k.float(), v)
    with pytest.raises(ValueError, match=r"`log_decay_t` must be <= 0"):
        dec.step(q, k, v, torch.full((3,), 0.1, dtype=D64))
    with pytest.raises(ValueError, match=r"`log_decay_t` has shape \(2, 3, 1\); expected \(H,\) = \(3,\) per head or \(B, H\) = \(2, 3\)"):
        dec.step(q, k, v, torch.zeros(2, 3, 1, dtype=D64))
    with pytest.raises(ValueError, match=r"`dk` must be a positive int, got 0"):
        RecurrentDecoder(2, 3, 0, 4)
    with pytest.raises(ValueError, match=r"normalize=True needs `initial_state.z`"):
        RecurrentDecoder(2, 3, 5, 4, initial_state=LinearAttentionState(torch.zeros(2, 3, 5, 4)))
    with pytest.raises(ValueError, match=r"`initial_state.S` has shape \(2, 3, 4, 5\)"):
        RecurrentDecoder(2, 3, 5, 4, normalize=False, initial_state=LinearAttentionState(torch.zeros(2, 3, 4, 5)))
    kv = KVCacheDecoder(2, 3, 5, 4, dtype=D64)
    with pytest.raises(ValueError, match=r"`k_t` has shape \(2, 2, 5\); expected \(B=2, H=3, D=5\)"):
        kv.step(q, k[:, :2], v)
    with pytest.raises(ValueError, match=r"`capacity` must be a positive int, got 0"):
        KVCacheDecoder(2, 3, 5, 4, capacity=0)
    with pytest.raises(TypeError, match=r"`scale` must be a number"):
        KVCacheDecoder(2, 3, 5, 4, scale="auto")
    assert kv.tokens_seen == 0  # a rejected step leaves the cache untouched


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_recurrent_decoder_sums_16_bit_tokens_in_float32(dtype):
    """Over 2000 tokens a 16-bit running sum would drift (bf16 keeps 8 bits: late increments
    vanish); the decoder keeps its state in float32 like the parallel form, so both stay as
    close to the float64 truth as their 16-bit inputs allow."""
    g = torch.Generator().manual_seed(0)
    T = 2000
    q, k = torch.rand(1, 1, T, 4, generator=g), torch.rand(1, 1, T, 4, generator=g)
    v = torch.randn(1, 1, T, 4, generator=g) + 1
    q, k, v = (x.to(dtype) for x in (q, k, v))
    truth = linear_attention(q.double(), k.double(), v.double())
    parallel = linear_attention(q, k, v)
    dec = RecurrentDecoder(1, 1, 4, 4, dtype=dtype)
    o = torch.stack([dec.step(q[:, :, t], k[:, :, t], v[:, :, t]) for t in range(T)], dim=2)
    assert o.dtype == dtype and dec.state.S.dtype == torch.float32
    err_parallel = (parallel.double() - truth).abs().max().item()
    err_decoder = (o.double() - truth).abs().max().item()
    assert err_decoder <= 2 * err_parallel + 1e-3, (err_decoder, err_parallel)


@pytest.mark.parametrize("dk, state_dtype, on_kernel", [
    (64, torch.float32, True),
    (300, torch.float32, False),   # over the kernels' 256: e.g. Performer's 266 features
    (64, torch.float64, False),    # a state the kernel does not take
])
def test_auto_decode_step_runs_the_kernel_only_where_it_fits(dk, state_dtype, on_kernel):
    """backend="auto" on CUDA tensors (CPU ones dressed as CUDA, the launches stubbed) takes
    the decode kernel for what it supports and torch for the rest, as linear_attention decides,
    instead of raising (LinearAttention's generation passes its backend on, "auto" by default)."""
    pytest.importorskip("triton")
    from linattn_lib import linear_attention_decode_step
    from linattn_lib.experiments.launches import record_launches

    g = torch.Generator().manual_seed(0)
    q, k = (torch.rand(1, 2, dk, generator=g) for _ in range(2))
    v = torch.randn(1, 2, 8, generator=g)

    def fresh():
        return LinearAttentionState(torch.zeros(1, 2, dk, 8, dtype=state_dtype),
                                    torch.zeros(1, 2, dk, dtype=state_dtype))

    with torch.no_grad():
        with record_launches(cuda_like=True) as launches:
            o = linear_attention_decode_step(q, k, v, fresh())
        expected = linear_attention_decode_step(q, k, v, fresh(), backend="torch")
    assert [launch.name for launch in launches] == (["decode_kernel"] if on_kernel else [])
    if not on_kernel:  # computed by torch: the same numbers
        assert maxdiff(o, expected) < 1e-6


def test_unnormalised_step_reads_and_writes_S_only():
    """normalize=False: S advances as the parallel form's, a z the state holds is left as it was
    (the docstring's promise; an unnormalised call's own state has no z)."""
    torch.manual_seed(0)
    q, k, v = (torch.rand(1, 2, 4, 3, dtype=torch.float64) for _ in range(3))
    _, state = linear_attention(q[:, :, :3], k[:, :, :3], v[:, :, :3], return_state=True)  # S and z
    z = state.z.clone()
    o = linear_attention_decode_step(q[:, :, 3], k[:, :, 3], v[:, :, 3], state, normalize=False)
    full, want = linear_attention(q, k, v, normalize=False, return_state=True)
    assert (o - full[:, :, 3]).abs().max() < 1e-12 and (state.S - want.S).abs().max() < 1e-12
    assert torch.equal(state.z, z)
