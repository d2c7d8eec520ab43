"""Tests that kill five hand mutations a review found the rest of the suite let through.

Each test names the mutation it catches in its docstring. All of them run on the CPU: the
custom-op test runs the Triton kernels in Triton's interpreter (skipped where Triton or the
kernels do not import), the performance-model test records launches on meta tensors.
"""
from __future__ import annotations

import math

import pytest
import torch

from linattn_lib.core.rotary import DEFAULT_BASE, rotary_angles, rotary_embedding
from linattn_lib.core.torch_chunked import _Scan
from linattn_lib.experiments.mqar import IGNORE, make_zoology_batch

D64 = torch.float64


# ------------------------------------------------------------------------------ 1. rotary angles


def _far_positions(T: int, seed: int) -> torch.Tensor:
    """T float64 positions in [2e5, 3e5), fractional: fp32 spaces numbers there 1/64 apart."""
    g = torch.Generator().manual_seed(seed)
    return 2e5 + 1e5 * torch.rand(T, generator=g, dtype=D64)


@pytest.mark.parametrize("base", [DEFAULT_BASE, 500.0])
def test_rotary_far_positions_match_float64_angles(base):
    """Catches: the rotary angles (position x frequency) rounded to float32 before cos / sin.

    The existing dtype test uses positions below 300, where a float32 angle is off by ~1e-5 at
    most. At positions 2e5..3e5 float32 spacing is 1/64, so a rounded angle moves cos and sin by
    up to ~1e-2 (and pair 0 always turns at one radian per position, whatever the base). Here
    float64 input at such positions is compared with cos / sin of angles formed in float64 by
    the test itself (math.cos of p * base^(-2i/D)), to 1e-9; both `rotary_angles` and
    `rotary_embedding` are checked, so the rounding is caught in either the table or the rotation.
    """
    T, D = 48, 8
    pos = _far_positions(T, seed=3)
    angles = torch.tensor([[p * base ** (-2 * i / D) for i in range(D // 2)] for p in pos.tolist()], dtype=D64)
    table = rotary_angles(pos, D, base=base)
    assert table.dtype == D64
    assert (table - angles).abs().max().item() < 1e-9

    x = 2 * torch.rand(1, 2, T, D, generator=torch.Generator().manual_seed(4), dtype=D64) - 1
    cos, sin = angles.cos(), angles.sin()
    a, b = x[..., 0::2], x[..., 1::2]
    expect = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    y = rotary_embedding(x, positions=pos, base=base)
    assert y.dtype == D64
    assert (y - x).abs().max().item() > 0.1  # the rotation does something
    assert (y - expect).abs().max().item() < 1e-9


# ------------------------------------------------------------------------------ 2. the fake of causal_fwd


def test_causal_fwd_fake_gives_one_state_per_packed_sequence():
    """Catches: the fake (meta) implementation of `linattn::causal_fwd` counting
    `cu_seqlens.shape[0]` sequences instead of `cu_seqlens.shape[0] - 1`.

    Nothing else runs the fake with packed sequences and initial states. Three sequences packed
    into one row (cu_seqlens has four entries), initial states S0, z0 of three rows and
    return_state: the real op (Triton interpreter on the CPU) returns S_T (3, H, Dk, Dv) and
    z_T (3, H, Dk); the fake, under FakeTensorMode, must give exactly the same shapes and dtypes
    for every output (the mutant gives 4 rows of state).
    """
    pytest.importorskip("triton")
    from linattn_lib.core import custom_ops  # noqa: F401  (registers torch.ops.linattn)
    from linattn_lib.core.triton_ops import triton_available

    if not triton_available():
        pytest.skip("the Triton kernels do not import here")
    H, T, Dk, Dv, N = 2, 24, 16, 16, 3
    g = torch.Generator().manual_seed(5)
    q, k = (0.1 + torch.rand(1, H, T, Dk, generator=g) for _ in range(2))
    v = torch.randn(1, H, T, Dv, generator=g)
    S0, z0 = torch.randn(N, H, Dk, Dv, generator=g), 1 + torch.rand(N, H, Dk, generator=g)
    cu = torch.tensor([0, 5, 13, T], dtype=torch.int32)
    args = (None, S0, z0, True, 1e-6, True, cu)
    real = torch.ops.linattn.causal_fwd(q, k, v, *args)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake_in = [mode.from_tensor(x) for x in (q, k, v, S0, z0, cu)]
        fake = torch.ops.linattn.causal_fwd(*fake_in[:3], None, *fake_in[3:5], True, 1e-6, True, fake_in[5])
    assert real[2].shape == (N, H, Dk, Dv) and real[3].shape == (N, H, Dk)
    assert [(tuple(x.shape), x.dtype) for x in fake] == [(tuple(x.shape), x.dtype) for x in real]


# ------------------------------------------------------------------------------ 3. the reversed scan fallback


def _scan_loop(gamma, carry, inc, reverse):
    """The scan of `_Scan`'s docstring in float64, one chunk at a time.

    Forwards E_0 = carry, E_{i+1} = exp(gamma_i) E_i + inc_i; backwards F_{n-1} = carry,
    F_{i-1} = exp(gamma_i) F_i + inc_i. Returns the n states and the one past the far end."""
    h, n = inc.shape[:2]
    a = torch.ones(h, n, dtype=D64) if gamma is None else gamma.exp()
    E = torch.empty_like(inc)
    state = carry.clone()
    for i in (range(n - 1, -1, -1) if reverse else range(n)):
        E[:, i] = state
        state = a[:, i, None, None] * state + inc[:, i]
    return E, state


@pytest.mark.parametrize("n", [5, 24])  # one level, and two levels (n > 16 with a divisor)
@pytest.mark.parametrize("decay", [False, True])
def test_reversed_scan_sequential_fallback_walks_backwards(n, decay):
    """Catches: `_Scan._sequential` (torch_chunked.py) walking the chunks forwards when
    reverse=True (its `order` range not reversed).

    The scan falls back to that loop only when the state past the block's far end does not sum
    to a finite number (`math.isfinite(float(beyond.sum()))` fails). No test got there. Here
    every state is finite but the far-end state sums to inf: backwards, chunk 0's increment
    enters only that far-end state, and it holds 1e308 in two entries (their sum overflows).
    The n states and the far-end state must equal a plain float64 loop walking backwards; a
    forward walk instead starts at chunk 0 and puts 1e308 into every later state.
    """
    h, Dk, Dv = 2, 3, 4
    g = torch.Generator().manual_seed(6 + n)
    inc = torch.randn(h, n, Dk, Dv, generator=g, dtype=D64)
    inc[:, 0, 0, 0] = inc[:, 0, 1, 1] = 1e308
    carry = torch.randn(h, Dk, Dv, generator=g, dtype=D64)
    gamma = -torch.rand(h, n, generator=g, dtype=D64) if decay else None
    scan = _Scan(gamma, h, n, D64, torch.device("cpu"))
    _, beyond_matmul = scan._matmul(carry, inc.reshape(h * n, Dk, Dv), reverse=True)
    assert not math.isfinite(float(beyond_matmul.sum()))  # so __call__ takes the sequential fallback

    E, beyond = scan(carry, inc.reshape(h * n, Dk, Dv), reverse=True)
    E_ref, beyond_ref = _scan_loop(gamma, carry, inc, reverse=True)
    assert torch.isfinite(E).all() and torch.isfinite(beyond).all()
    torch.testing.assert_close(E.view(h, n, Dk, Dv), E_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(beyond, beyond_ref, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------ 4. live-length bytes


@pytest.mark.parametrize(("B", "H", "T", "D"), [(2, 3, 256, 64), (1, 4, 16384, 128), (3, 2, 96, 32)])
def test_live_length_kernel_bytes_are_what_it_reads_and_writes(B, H, T, D):
    """Catches: the performance model's byte count of `live_length_kernel` halved (e.g. its
    `PART_READ` fraction of dO, or dO's bytes, divided by two).

    The kernel (kernels/chunk_grad_prep.py) runs P = min(ceil(T / BT), 16) programs per (b, h) row;
    when no dO row is zero each reads P blocks of BT tokens x Dv of dO from the row's end, i.e.
    min(T, P BT) tokens, and atomically updates one int32 length per row. So its HBM bytes are
    B H min(T, P BT) Dv itemsize(dO) + 4 B H, nothing re-read. The launch is taken from the
    model's own census of the unnormalised backward (meta tensors, nothing runs); shapes cover
    a row read whole (T <= 16 BT) and one read only 16 blocks deep.
    """
    pytest.importorskip("triton")
    from linattn_lib.chapters import perf_model as pm
    from linattn_lib.core.triton_ops import triton_available

    if not triton_available():
        pytest.skip("the Triton kernels do not import here")
    calls = [c for c in pm.census(B, H, T, D, normalize=False)["backward"] if c.kernel == "live_length_kernel"]
    assert len(calls) == 1
    call = calls[0]
    BT, P, do = call.args["BT"], call.args["P"], call.args["do_ptr"]
    assert P == min(-(-T // BT), 16) and call.grid == (P, B * H)
    assert do.shape == (B, H, T, D) and do.dtype == torch.bfloat16
    expect = B * H * min(T, P * BT) * D * 2 + B * H * 4
    assert pm.traffic(call, 132) == (expect, expect)
    assert pm.traffic(call, 1) == (expect, expect)


# ------------------------------------------------------------------------------ 5. zoology keys


@pytest.mark.parametrize(("num_pairs", "seq_len", "vocab_size"), [(1, 4, 5), (2, 8, 9), (3, 12, 13)])
def test_zoology_keys_never_use_token_zero(num_pairs, seq_len, vocab_size):
    """Catches: `make_zoology_batch` drawing keys from [0, vocab_size/2) instead of
    [1, vocab_size/2) (Zoology reserves token 0; the keys are `pick(half - 1, n) + 1`).

    The existing range test has a large vocabulary and rarely draws 0. With vocab_size 5, 9 or
    13 the key range has 1 to 5 tokens, so over 64 x 8 sequences a mutant that allowed 0 would
    draw it almost surely (each sequence holds key 0 with probability >= 1/3). Keys sit at the
    even positions 0, 2, .., 2n - 2 and again at every query (where the target is not IGNORE);
    none may be 0, all must be below vocab_size // 2, and the values at the odd pair positions
    must lie in [vocab_size // 2, vocab_size).
    """
    half, context = vocab_size // 2, 2 * num_pairs
    gen = torch.Generator().manual_seed(7)
    for _ in range(8):
        x, y = make_zoology_batch(64, num_pairs, seq_len, vocab_size, generator=gen)
        keys, values = x[:, 0:context:2], x[:, 1:context:2]
        queried = x[y != IGNORE]
        assert queried.numel() == 64 * num_pairs
        for tokens in (keys, queried):
            assert bool((tokens >= 1).all()) and bool((tokens < half).all())
        assert bool((values >= half).all()) and bool((values < vocab_size).all())
