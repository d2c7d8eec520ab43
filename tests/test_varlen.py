"""Packed variable-length batches (`cu_seqlens`, linattn_lib.core.varlen).

The definition is `varlen_by_splitting`: each sequence run alone through
`linear_attention(..., backend="torch")`, with its own initial state. The packed fast path
(`varlen_by_padding` / `pad_and_batch`: pad, batch, run once per bucket, gather back) must
give the same outputs, final states and gradients (q, k, v, log_decay, initial state) for
every form, with sequence boundaries inside chunks and exactly on them, empty sequences,
per-head and per-token decay, normalised or not, causal or not: float64 to 1e-12 relative.
"""
from __future__ import annotations

import functools
import itertools
import math
import random

import pytest
import torch

from linattn_lib import LinearAttentionState, linear_attention
from linattn_lib.core.reference import reference_linear_attention
from linattn_lib.core.torch_chunked import chunked_linear_attention
from linattn_lib.core.varlen import (
    MAX_PADDING_FACTOR,
    _buckets,
    check_cu_seqlens,
    check_varlen,
    pad_and_batch,
    sequence_spans,
    varlen_by_padding,
    varlen_by_splitting,
)

CHUNK = 16
FORMS = ("recurrent", "quadratic", "chunked")
DECAYS = (None, "head", "token")
LENGTHS = {  # chunk_size 16: boundaries inside a chunk, on a chunk edge, empty sequences
    "mixed": [5, 16, 0, 37, 1],
    "chunk_multiples": [16, 32, 16],
    "empty_ends": [0, 3, 20, 0],
    "one": [23],
    "many_buckets": [40, 1, 2, 1, 9, 3, 17, 0, 5],
}
H, DK, DV = 2, 5, 3


# tiny shapes: extra threads only add synchronisation (the `one_thread` fixture of conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error of a against b (0 when both are 0)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def packed_inputs(lengths, *, dtype=torch.float64, decay=None, init=False, normalize=True, seed=0, strength=1.0):
    """Leaves (q, k, v, log_decay, S0, z0; None where absent) and cu_seqlens (int32)."""
    g = torch.Generator().manual_seed(seed)
    T, N = sum(lengths), len(lengths)
    q = torch.rand(1, H, T, DK, generator=g, dtype=torch.float64)
    k = torch.rand(1, H, T, DK, generator=g, dtype=torch.float64)
    v = torch.randn(1, H, T, DV, generator=g, dtype=torch.float64)
    ld = {None: None, "head": lambda: -strength * torch.rand(H, generator=g, dtype=torch.float64),
          "token": lambda: -strength * torch.rand(1, H, T, generator=g, dtype=torch.float64)}[decay]
    ld = None if ld is None else ld()
    S0 = torch.randn(N, H, DK, DV, generator=g, dtype=torch.float64) if init else None
    z0 = torch.rand(N, H, DK, generator=g, dtype=torch.float64) if init and normalize else None
    leaves = [None if x is None else x.to(dtype).requires_grad_() for x in (q, k, v, ld, S0, z0)]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    return leaves, cu


def outputs_and_grads(run, leaves, cu, normalize, seed=1):
    """(o, S, z) and the gradients of a random linear function of all three w.r.t. the leaves."""
    q, k, v, ld, S0, z0 = leaves
    init = None if S0 is None else LinearAttentionState(S0, z0)
    o, st = run(q, k, v, cu, log_decay=ld, initial_state=init, return_state=True)
    g = torch.Generator().manual_seed(seed)
    loss = sum((x.double() * torch.randn(x.shape, generator=g, dtype=torch.float64)).sum()
               for x in (o, st.S, st.z) if x is not None)
    present = [x for x in leaves if x is not None]
    grads = torch.autograd.grad(loss, present)
    assert (st.z is None) == (not normalize)
    assert st.S.shape == (len(cu) - 1, H, DK, DV)
    return [o, st.S, st.z], list(grads)


def splitting(form, **kw):
    """The definition: each sequence alone through linear_attention(form=form, backend="torch")."""
    fn = functools.partial(linear_attention, form=form, backend="torch", chunk_size=CHUNK)
    return functools.partial(varlen_by_splitting, fn, **kw)


def packed(form, impl, **kw):
    """The packed path: through linear_attention ("public"), or on the raw engine the dispatcher
    hands it ("engine": chunked_linear_attention / reference_linear_attention, no checks)."""
    if impl == "public":
        fn = functools.partial(linear_attention, form=form, backend="torch", chunk_size=CHUNK)
        return functools.partial(varlen_by_padding, fn, **kw)
    kw = {"causal": True, "normalize": True, "eps": 1e-6, **kw}
    if form == "chunked":
        fn = functools.partial(chunked_linear_attention, chunk_size=CHUNK)
    else:
        fn = functools.partial(reference_linear_attention, form=form, chunk_size=CHUNK)

    def run(q, k, v, cu, *, log_decay, initial_state, return_state):
        check_varlen("test", q, k, v, cu, log_decay=log_decay, initial_state=initial_state, normalize=kw["normalize"])
        return pad_and_batch(fn, q, k, v, sequence_spans(cu), log_decay=log_decay, initial_state=initial_state,
                             return_state=return_state, **kw)
    return run


def assert_same(lengths, run, ref, *, tol, dtype=torch.float64, decay=None, init=False, normalize=True,
                strength=1.0):
    leaves, cu = packed_inputs(lengths, dtype=dtype, decay=decay, init=init, normalize=normalize,
                               strength=strength)
    got, dgot = outputs_and_grads(run, leaves, cu, normalize)
    leaves64 = [None if x is None else x.detach().double().requires_grad_() for x in leaves]
    want, dwant = outputs_and_grads(ref, leaves64, cu, normalize)
    names = ["o", "S", "z"]
    for name, a, b in zip(names, got, want):
        if b is not None:
            assert rel(a, b) <= tol, f"{name}: relative error {rel(a, b):.3g} > {tol:g}"
    present = [n for n, x in zip(["q", "k", "v", "log_decay", "S0", "z0"], leaves) if x is not None]
    for name, a, b in zip(present, dgot, dwant):
        assert a.dtype == dtype and a.shape == b.shape
        assert rel(a, b) <= tol, f"d{name}: relative error {rel(a, b):.3g} > {tol:g}"


# --------------------------------------------------------------------------------------
# the packed path equals each sequence alone
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["public", "engine"])
@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("form", FORMS)
def test_float64_every_form_and_option(form, decay, normalize, init, impl):
    kw = dict(normalize=normalize)
    assert_same(LENGTHS["mixed"], packed(form, impl, **kw), splitting(form, **kw), tol=1e-12,
                decay=decay, init=init, normalize=normalize)


@pytest.mark.parametrize("lengths", list(LENGTHS), ids=list(LENGTHS))
@pytest.mark.parametrize("decay", DECAYS)
def test_float64_boundaries(lengths, decay):
    """Chunked form (the fast path) on every length pattern; recurrent form as the reference."""
    assert_same(LENGTHS[lengths], packed("chunked", "engine"), splitting("recurrent"), tol=1e-12,
                decay=decay, init=True)


@pytest.mark.parametrize("form", FORMS)
def test_float64_strong_decay(form):
    """Per-token decays down to -30 per step: states forget within a few tokens."""
    assert_same(LENGTHS["mixed"], packed(form, "engine"), splitting(form), tol=1e-12, decay="token",
                init=True, strength=30.0)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("form", FORMS)
def test_float32(form, decay, normalize):
    """float32 packed is as accurate as float32 sequence by sequence, both against float64.

    (Round-off only: about 1e-7, up to ~6e-6 for a per-head decay's gradient, a sum over
    every token of both signs.)"""
    kw = dict(normalize=normalize)
    leaves, cu = packed_inputs(LENGTHS["mixed"], dtype=torch.float32, decay=decay, init=True, normalize=normalize)
    leaves64 = [None if x is None else x.detach().double().requires_grad_() for x in leaves]
    want, dwant = outputs_and_grads(splitting(form, **kw), leaves64, cu, normalize)
    got, dgot = outputs_and_grads(packed(form, "public", **kw), leaves, cu, normalize)
    alone, dalone = outputs_and_grads(splitting(form, **kw), leaves, cu, normalize)
    for a, b, c in zip(got + dgot, alone + dalone, want + dwant):
        if c is not None:
            assert a.dtype == torch.float32
            assert rel(a, c) <= min(2e-5, 2 * rel(b, c) + 1e-7), (rel(a, c), rel(b, c))


@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("form", FORMS)
def test_noncausal_is_each_sequence_alone(form, normalize, init):
    kw = dict(causal=False, normalize=normalize)
    assert_same(LENGTHS["mixed"], packed(form, "public", **kw), splitting(form, **kw), tol=1e-12,
                init=init, normalize=normalize)


def test_without_return_state_and_int64_cu_seqlens():
    (q, k, v, ld, _, _), cu = packed_inputs(LENGTHS["mixed"], decay="head")
    fn = functools.partial(linear_attention, backend="torch", chunk_size=CHUNK)
    o = varlen_by_padding(fn, q, k, v, cu.long(), log_decay=ld)
    assert isinstance(o, torch.Tensor) and o.shape == v.shape and o.is_contiguous()
    assert rel(o, varlen_by_splitting(fn, q, k, v, cu, log_decay=ld)) <= 1e-12


def test_strided_inputs():
    """Packed data often arrives as (T_total, H, D) (flash-attn's layout): a transposed view."""
    (q, k, v, ld, S0, z0), cu = packed_inputs(LENGTHS["mixed"], decay="token", init=True)
    q2, k2, v2 = (x.detach().transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    assert not q2.is_contiguous()
    init = LinearAttentionState(S0, z0)
    fn = functools.partial(linear_attention, backend="torch", chunk_size=CHUNK)
    o, st = varlen_by_padding(fn, q2, k2, v2, cu, log_decay=ld, initial_state=init, return_state=True)
    want, st_want = varlen_by_splitting(fn, q, k, v, cu, log_decay=ld, initial_state=init, return_state=True)
    assert rel(o, want) <= 1e-12 and rel(st.S, st_want.S) <= 1e-12 and rel(st.z, st_want.z) <= 1e-12


def test_splitting_is_running_each_sequence_alone():
    """The definition itself, spelled out for one sequence: its slice and its state row."""
    lengths = LENGTHS["mixed"]
    (q, k, v, ld, S0, z0), cu = packed_inputs(lengths, decay="token", init=True)
    fn = functools.partial(linear_attention, backend="torch", chunk_size=CHUNK)
    o, st = varlen_by_splitting(fn, q, k, v, cu, log_decay=ld, initial_state=LinearAttentionState(S0, z0),
                                return_state=True)
    i, s, e = 3, 21, 58
    alone, st_i = linear_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], log_decay=ld[:, :, s:e],
                                   initial_state=LinearAttentionState(S0[i:i + 1], z0[i:i + 1]),
                                   form="recurrent", return_state=True)
    assert rel(o[:, :, s:e], alone) <= 1e-12 and rel(st.S[i:i + 1], st_i.S) <= 1e-12
    assert torch.equal(st.S[2], S0[2]) and torch.equal(st.z[2], z0[2])  # empty: passes through


def test_empty_sequence_without_initial_state_has_zero_state():
    (q, k, v, _, _, _), cu = packed_inputs([3, 0, 4])
    fn = functools.partial(linear_attention, backend="torch")
    for run in (varlen_by_splitting, varlen_by_padding):
        _, st = run(fn, q, k, v, cu, return_state=True)
        assert st.S.dtype == torch.float64 and not st.S[1].any() and not st.z[1].any()


@pytest.mark.parametrize("form", FORMS)
def test_linear_attention_cu_seqlens(form):
    fn = functools.partial(linear_attention, form=form, backend="torch", chunk_size=CHUNK)
    assert_same(LENGTHS["mixed"], lambda *a, **kw: fn(a[0], a[1], a[2], cu_seqlens=a[3], **kw),
                splitting(form), tol=1e-12, decay="token", init=True)


@pytest.mark.parametrize("decay,normalize", [("token", True), ("head", False)])
def test_triton_kernels_take_packed_sequences(decay, normalize):
    """backend="triton" (the interpreter here) runs the packed layout in the kernels themselves,
    no padding: float32 against each sequence alone in float64."""
    pytest.importorskip("triton")
    fn = functools.partial(linear_attention, backend="triton", normalize=normalize)
    lengths = [5, 32, 0, 70, 1]  # boundaries inside and at the kernels' 32-token chunks (fp32)
    assert_same(lengths, lambda *a, **kw: fn(a[0], a[1], a[2], cu_seqlens=a[3], **kw),
                # a per-head decay's gradient sums terms that cancel: the torch path's fp32 error
                # on this case is 2e-4, the kernels' 1e-4 (packed or sequence by sequence)
                splitting("quadratic", normalize=normalize), tol=5e-4 if decay == "head" else 2e-6,
                dtype=torch.float32, decay=decay, init=True, normalize=normalize)


# --------------------------------------------------------------------------------------
# buckets: bounded padding, few calls
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(20))
def test_buckets_bound_the_padding(seed):
    rng = random.Random(seed)
    lengths = [rng.choice([0, 1, rng.randint(1, 9), rng.randint(1, 300)]) for _ in range(rng.randint(1, 60))]
    if not any(lengths):
        lengths[0] = 1
    buckets = _buckets(lengths)
    ids = sorted(i for b, _ in buckets for i in b)
    assert ids == [i for i, L in enumerate(lengths) if L > 0]
    for b, T_b in buckets:
        assert T_b == max(lengths[i] for i in b)
        assert len(b) * T_b <= MAX_PADDING_FACTOR * sum(lengths[i] for i in b)
    assert len(buckets) <= math.log(max(lengths)) / math.log(MAX_PADDING_FACTOR) + 1


def test_buckets_of_alike_lengths_are_one():
    assert _buckets([30, 31, 29, 32]) == [([3, 1, 0, 2], 32)]
    assert _buckets([30, 0, 31]) == [([2, 0], 31)]
    assert len(_buckets(LENGTHS["many_buckets"])) > 1


# --------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------


def _error_case(case):
    (q, k, v, ld, S0, z0), cu = packed_inputs([3, 4, 2], decay="token", init=True)
    init = LinearAttentionState(S0, z0)
    return {
        "list": dict(cu=[0, 3, 7, 9]),
        "float": dict(cu=cu.double()),
        "2d": dict(cu=cu.view(1, -1)),
        "one_entry": dict(cu=cu[:1]),
        "start": dict(cu=torch.tensor([1, 3, 7, 9])),
        "end": dict(cu=torch.tensor([0, 3, 7, 8])),
        "decreasing": dict(cu=torch.tensor([0, 5, 3, 9])),
        "device": dict(cu=cu.to("meta")),
        "batch": dict(q=q.expand(2, -1, -1, -1), k=k.expand(2, -1, -1, -1), v=v.expand(2, -1, -1, -1)),
        "state_rows": dict(init=LinearAttentionState(S0[:2], z0[:2])),
        "decay_shape": dict(ld=ld[..., :-1]),
        "decay_type": dict(ld=[-0.1, -0.2]),
    }[case], dict(q=q, k=k, v=v, cu=cu, ld=ld, init=init)


ERRORS = {
    "list": (TypeError, "`cu_seqlens` must be a torch.Tensor"),
    "float": (TypeError, "int32 or torch.int64"),
    "2d": (ValueError, "must be a 1-d tensor"),
    "one_entry": (ValueError, "N >= 1"),
    "start": (ValueError, "must start at 0"),
    "end": (ValueError, r"end at the packed length T_total = 9"),
    "decreasing": (ValueError, r"non-decreasing.*cu_seqlens\[1\] = 5 > cu_seqlens\[2\] = 3"),
    "device": (ValueError, "is on meta"),
    "batch": (ValueError, r"one batch row.*\(1, H, T_total, Dk\)"),
    "state_rows": (ValueError, "number of sequences N = 3"),
    "decay_shape": (ValueError, r"\(1, H, T_total\) = \(1, 2, 9\)"),
    "decay_type": (TypeError, "`log_decay` must be a torch.Tensor"),
}


@pytest.mark.parametrize("run", [varlen_by_splitting, varlen_by_padding])
@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_names_the_problem(case, run):
    bad, args = _error_case(case)
    args.update(bad)
    exc, match = ERRORS[case]
    with pytest.raises(exc, match=match):
        run(linear_attention, args["q"], args["k"], args["v"], args["cu"], log_decay=args["ld"],
            initial_state=args["init"])


def test_check_cu_seqlens_returns_the_count_and_spans_are_read_apart():
    """check_cu_seqlens returns N (from the shape: no host read on CUDA); the spans, which only
    the padding paths need, come from sequence_spans."""
    cu = torch.tensor([0, 5, 5, 9], dtype=torch.int32)
    assert check_cu_seqlens("f", cu, 9, torch.device("cpu")) == 3
    assert sequence_spans(cu) == [(0, 5), (5, 5), (5, 9)]
