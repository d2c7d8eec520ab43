"""Bad input gets a clear error that names the argument, what it got and what was expected."""
import numpy as np
import pytest
import torch

from linattn_lib import LinearAttentionState, linear_attention, softmax_attention


def qkv(B=2, H=3, T=5, Dk=4, Dv=6, dtype=torch.float32):
    return torch.rand(B, H, T, Dk, dtype=dtype), torch.rand(B, H, T, Dk, dtype=dtype), torch.rand(B, H, T, Dv, dtype=dtype)


@pytest.mark.parametrize("fn", [linear_attention, softmax_attention])
def test_wrong_rank(fn):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"`q` must be a 4-d tensor laid out as \(B, H, T, D\), got shape \(3, 5, 4\)"):
        fn(q[0], k, v)


@pytest.mark.parametrize("fn", [linear_attention, softmax_attention])
def test_mismatched_bht(fn):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"`v` has shape \(2, 3, 4, 6\).*expected the same \(B, H, T\) = \(2, 3, 5\)"):
        fn(q, k, v[:, :, :4])
    with pytest.raises(ValueError, match=r"`k` has shape \(1, 3, 5, 4\)"):
        fn(q, k[:1], v)


def test_dk_mismatch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"`k` has feature size Dk=3 but `q` has Dk=4"):
        linear_attention(q, k[..., :3], v)


def test_mixed_dtypes_and_non_float():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"`k` has dtype torch.float64 but `q` has dtype torch.float32"):
        linear_attention(q, k.double(), v)
    with pytest.raises(TypeError, match=r"`v` must have a floating-point dtype"):
        linear_attention(q, k, v.long())
    with pytest.raises(TypeError, match=r"`q` must be a torch.Tensor, got ndarray"):
        linear_attention(q.numpy(), k, v)


def test_mixed_devices():
    q, k, v = qkv()
    meta = torch.empty_like(v, device="meta")
    with pytest.raises(ValueError, match=r"`v` is on meta but `q` is on cpu"):
        linear_attention(q, k, meta)


def test_log_decay_errors():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"`log_decay` must be <= 0"):
        linear_attention(q, k, v, log_decay=torch.tensor([0.1, -0.2, -0.3]))
    with pytest.raises(ValueError, match=r"`log_decay` has shape \(2,\); expected \(H,\) = \(3,\) per head or \(B, H, T\) = \(2, 3, 5\)"):
        linear_attention(q, k, v, log_decay=torch.tensor([-0.1, -0.2]))
    with pytest.raises(ValueError, match=r"`log_decay` needs causal=True"):
        linear_attention(q, k, v, causal=False, log_decay=-torch.ones(3))
    with pytest.raises(ValueError, match=r"NaN or infinite"):
        linear_attention(q, k, v, log_decay=torch.tensor([-float("inf"), -0.2, -0.3]))


def test_unknown_form_backend_and_chunk():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"unknown form='parallel'; expected one of 'quadratic', 'recurrent', 'chunked'"):
        linear_attention(q, k, v, form="parallel")
    with pytest.raises(ValueError, match=r"unknown backend='cuda'"):
        linear_attention(q, k, v, backend="cuda")
    with pytest.raises(ValueError, match=r"`chunk_size` must be a positive int, got 0"):
        linear_attention(q, k, v, chunk_size=0)
    with pytest.raises(ValueError, match=r"backend='triton' implements form='chunked' only"):
        linear_attention(q, k, v, form="recurrent", backend="triton")


def test_bad_initial_state():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"`initial_state.S` has shape \(2, 3, 6, 4\); expected \(B, H, Dk, Dv\) = \(2, 3, 4, 6\)"):
        linear_attention(q, k, v, initial_state=LinearAttentionState(torch.zeros(2, 3, 6, 4), torch.zeros(2, 3, 4)))
    with pytest.raises(ValueError, match=r"normalize=True needs `initial_state.z`"):
        linear_attention(q, k, v, initial_state=LinearAttentionState(torch.zeros(2, 3, 4, 6), None))


def test_empty_sequence():
    q, k, v = qkv(T=0)
    with pytest.raises(ValueError, match=r"sequence length T must be at least 1"):
        linear_attention(q, k, v)


# ------------------------------------------------------------------ found in review


def test_linear_attention_rejects_bad_scalars_and_flags():
    q = torch.rand(2, 3, 5, 4)
    for eps in (float("nan"), float("inf"), True, "1e-6"):
        with pytest.raises((ValueError, TypeError), match="eps"):
            linear_attention(q, q, q, eps=eps)
    for flag in ("causal", "normalize"):
        with pytest.raises(TypeError, match=f"`{flag}` must be True or False"):
            linear_attention(q, q, q, **{flag: "no"})
    # integral numbers that are not Python ints are fine
    assert linear_attention(q, q, q, chunk_size=np.int64(2)).shape == (2, 3, 5, 4)


def test_linear_attention_names_empty_axes():
    for shape, axis in (((0, 1, 4, 2), "batch size B"), ((1, 0, 4, 2), "number of heads H"), ((1, 1, 4, 0), "feature size Dk")):
        x = torch.rand(shape)
        with pytest.raises(ValueError, match=axis):
            linear_attention(x, x, torch.rand(shape[:3] + (2,)))


def test_initial_state_errors_name_the_state_layout_and_values():
    q, v = torch.rand(2, 3, 5, 4), torch.rand(2, 3, 5, 6)
    bad_z = LinearAttentionState(torch.zeros(2, 3, 4, 6), torch.zeros(2, 3, 4, 1))
    with pytest.raises(ValueError, match=r"`initial_state.z` must be a 3-d tensor laid out as \(B, H, Dk\)"):
        linear_attention(q, q, v, initial_state=bad_z)
    bad_S = LinearAttentionState(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match=r"laid out as \(B, H, Dk, Dv\)"):
        linear_attention(q, q, v, initial_state=bad_S)
    nan_S = LinearAttentionState(torch.full((2, 3, 4, 6), float("nan")), torch.ones(2, 3, 4))
    with pytest.raises(ValueError, match="`initial_state.S` contains NaN"):
        linear_attention(q, q, v, initial_state=nan_S)


def test_masks_check_their_inputs():
    from linattn_lib.core.masks import causal_mask, decay_mask, segsum

    with pytest.raises(ValueError, match="log_decay"):
        decay_mask(torch.tensor([2.0, 3.0, 1.0]))  # growth, not decay
    with pytest.raises(TypeError, match="log_decay"):
        decay_mask(torch.tensor([0, -1, -2]))  # integers
    with pytest.raises(ValueError, match="at least one axis"):
        segsum(torch.tensor(1.0))
    with pytest.raises(ValueError, match="`T` must be a positive int"):
        causal_mask(3.5)
    assert torch.equal(causal_mask(3), torch.ones(3, 3).tril())


# ------------------------------------------------------------------ the shared scalar checks


def test_scalar_checks_accept_numpy_and_refuse_lookalikes():
    from linattn_lib import _validate as V

    assert V.check_flag("f", "causal", np.bool_(False)) is False
    for bad in ("no", "False", 1, 0, None, torch.tensor(True)):
        with pytest.raises(TypeError, match=r"f: `causal` must be True or False"):
            V.check_flag("f", "causal", bad)
    assert V.check_finite_number("f", "scale", np.float32(0.5)) == 0.5
    assert V.check_finite_number("f", "scale", -2) == -2.0  # no sign constraint unless asked
    for bad, exc in (("x", TypeError), (True, TypeError), (torch.tensor(1.0), TypeError),
                     (float("nan"), ValueError), (float("-inf"), ValueError)):
        with pytest.raises(exc, match=r"f: `scale` must be a"):
            V.check_finite_number("f", "scale", bad)
    with pytest.raises(ValueError, match=r"`t` must be a finite number > 0, got 0"):
        V.check_finite_number("f", "t", 0, positive=True)
    with pytest.raises(ValueError, match=r"`t` must be a finite number >= 0, got -1"):
        V.check_finite_number("f", "t", -1, nonnegative=True)
    assert V.check_int("f", "n", np.int64(0), low=0) == 0
    with pytest.raises(TypeError, match=r"`n` must be an int, got float 2.0"):
        V.check_int("f", "n", 2.0)
    with pytest.raises(ValueError, match=r"`n` must be an int in \[0, inf\], got -3"):
        V.check_int("f", "n", -3, low=0)
    assert V.check_seed("f", "seed", None) is None and V.check_seed("f", "seed", np.int64(-1)) == -1
    with pytest.raises(TypeError, match=r"`seed` must be None or an int seed, got str 'a'"):
        V.check_seed("f", "seed", "a")
    with pytest.raises(TypeError, match=r"`dtype` must be a floating-point torch.dtype"):
        V.check_dtype("f", "dtype", torch.int64)


def test_layout_names_and_in_place_overlap():
    from linattn_lib import _validate as V

    with pytest.raises(ValueError, match=r"f: `q_t` must be a 3-d tensor laid out as \(B, H, D\), got shape \(2, 8\)"):
        V.check_tensor("f", "q_t", torch.zeros(2, 8), layout=("B", "H", "D"))
    with pytest.raises(ValueError, match=r"`x` must be a 3-d tensor, got"):  # no guessed layout for 3-d
        V.check_tensor("f", "x", torch.zeros(2, 8), ndim=3)
    V.check_no_overlap("f", "S", torch.zeros(2, 3)[:, ::2])  # strided but not overlapping: fine
    V.check_no_overlap("f", "S", torch.zeros(1, 3).expand(1, 3))  # size-1 axis: nothing shared
    with pytest.raises(ValueError, match=r"f: `state.S` is updated in place but axis 0 has stride 0"):
        V.check_no_overlap("f", "state.S", torch.zeros(1, 3).expand(4, 3))
