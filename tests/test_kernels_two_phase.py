"""The two-phase causal forward (kernels/chunk_state.py, kernels/chunk_output.py) on its own.

Phase 1 stores the state on entry to every chunk, phase 2 computes every chunk's outputs from
it. Both are checked against float64: the outputs and the final state against
`reference_linear_attention` (quadratic form), the stored entry states (S_n, z_n) and the
denominators d + eps against a float64 token-by-token recurrence run on the very inputs the
kernels saw (fp16 inputs rounded first). Tolerances are those of test_kernels_interpret.py:
relative RMS 1e-5 in float32, 3e-3 in float16.

The cases are a hand-picked cover of T in {1, 17, 63, 64, 65, 200} (around the chunks of 32
and 64), Dk in {16, 48 (padded), 128 (several blocks)}, Dv in {16, 100 (several value tiles,
the last one masked)}, several batches and heads, decays from none to strong (exp(g * 64)
underflows) and a reset (g = -1e4 at one token), with and without initial state and
normaliser -- not the full product, so that the file runs in well under a minute in the
interpreter. The forward through autograd (and its NaN/inf behaviour) is tested in
test_kernels_interpret.py, which runs these kernels too.
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from linattn_lib import LinearAttentionState  # noqa: E402
from linattn_lib.core.reference import reference_linear_attention  # noqa: E402
from linattn_lib.core.triton_ops import load_kernels  # noqa: E402
from linattn_lib.experiments.kernel_selftest import draw_log_decay  # noqa: E402

K = load_kernels()
if K is None:  # pragma: no cover - triton imports but the kernels do not
    pytest.skip("the Triton kernels do not import here", allow_module_level=True)

DEVICE = torch.device(os.environ.get("LINATTN_KERNEL_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu"))
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def make_inputs(B: int, H: int, T: int, Dk: int, Dv: int, decay: str | None, normalize: bool, resume: bool,
                dtype: torch.dtype, seed: int = 0) -> dict:
    """Inputs in `dtype` (q, k, v) and fp32 (g, S0, z0); positive features when normalising."""
    gen = torch.Generator().manual_seed(seed)
    if normalize:
        q, k = torch.rand(B, H, T, Dk, generator=gen), torch.rand(B, H, T, Dk, generator=gen)
    else:
        q, k = torch.randn(B, H, T, Dk, generator=gen) / Dk**0.5, torch.randn(B, H, T, Dk, generator=gen)
    x = {"q": q.to(dtype), "k": k.to(dtype), "v": torch.randn(B, H, T, Dv, generator=gen).to(dtype),
         "g": draw_log_decay(decay, B, H, T, gen), "S0": None, "z0": None}
    if resume:
        x["S0"] = torch.randn(B, H, Dk, Dv, generator=gen)
        x["z0"] = torch.rand(B, H, Dk, generator=gen) * 5 if normalize else None
    return x


def recurrence(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 states after every token, (B, H, T, Dk, Dv) and (B, H, T, Dk), token by token."""
    k, v = x["k"].double(), x["v"].double()
    B, H, T, Dk = k.shape
    g = torch.zeros(B, H, T, dtype=torch.float64)
    if x["g"] is not None:
        g = g + (x["g"].double() if x["g"].dim() == 3 else x["g"].double().view(1, H, 1))
    S = torch.zeros(B, H, Dk, v.shape[-1], dtype=torch.float64) if x["S0"] is None else x["S0"].double()
    z = torch.zeros(B, H, Dk, dtype=torch.float64) if x["z0"] is None else x["z0"].double()
    Ss, zs = [], []
    for t in range(T):
        a = torch.exp(g[..., t])
        S = a[..., None, None] * S + k[..., t, :, None] * v[..., t, None, :]
        z = a[..., None] * z + k[..., t, :]
        Ss.append(S)
        zs.append(z)
    return torch.stack(Ss, 2), torch.stack(zs, 2)


def entry_states(x: dict, S_all: torch.Tensor, z_all: torch.Tensor, BT: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The state before chunk n's tokens, for every n: S0 (or 0), then the state after token n BT - 1."""
    NT = -(-S_all.shape[2] // BT)
    S0 = torch.zeros_like(S_all[:, :, 0]) if x["S0"] is None else x["S0"].double()
    z0 = torch.zeros_like(z_all[:, :, 0]) if x["z0"] is None else x["z0"].double()
    ends = torch.arange(1, NT) * BT - 1
    return torch.cat([S0[:, :, None], S_all[:, :, ends]], 2), torch.cat([z0[:, :, None], z_all[:, :, ends]], 2)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error ||a - b|| / ||b|| (float64)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _on_device(x: dict) -> dict:
    return {n: (t.to(DEVICE) if t is not None else None) for n, t in x.items()}


# B, H, T, Dk, Dv, decay, normalize, initial state, dtype
CASES = [
    (1, 2, 1, 16, 16, None, True, True, torch.float32),
    (2, 1, 17, 48, 100, "head", True, True, torch.float32),
    (1, 3, 63, 16, 100, "token", False, True, torch.float32),
    (2, 2, 64, 128, 16, "token-steep", True, False, torch.float32),
    (1, 2, 65, 48, 16, "token-reset", False, True, torch.float32),
    (1, 2, 200, 48, 100, "token", True, True, torch.float32),
    (3, 1, 200, 16, 16, None, False, False, torch.float32),
    (1, 2, 65, 128, 100, "head", False, True, torch.float32),
    (2, 1, 200, 16, 48, "token-reset", True, True, torch.float32),
    (1, 2, 17, 16, 16, "token", True, True, torch.float16),
    (2, 1, 65, 48, 100, "token-reset", True, False, torch.float16),
    (1, 2, 200, 128, 16, "token-steep", False, True, torch.float16),
    (1, 1, 64, 48, 100, "head", True, True, torch.float16),
    (2, 1, 63, 16, 100, None, False, False, torch.float16),
]


def _id(c: tuple) -> str:
    B, H, T, Dk, Dv, decay, normalize, resume, dtype = c
    return (f"B{B}H{H}T{T}-k{Dk}v{Dv}-{decay or 'nodecay'}-{'norm' if normalize else 'unnorm'}"
            f"{'-resume' if resume else ''}-{str(dtype).replace('torch.', '')}")


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_two_phase_against_float64(case):
    """Entry states, final state, outputs and denominators of the two kernels, each launched
    through its own launcher, against float64."""
    B, H, T, Dk, Dv, decay, normalize, resume, dtype = case
    x = make_inputs(B, H, T, Dk, Dv, decay, normalize, resume, dtype)
    d = _on_device(x)
    cfg_s, cfg_o = (K.select_config(n, Dk, dtype, DEVICE) for n in ("chunk_state", "chunk_output"))
    init = (d["S0"], d["z0"]) if resume else None
    h, hz, S_T, z_T = K.chunk_states(d["k"], d["v"], log_decay=d["g"], track_z=normalize, initial_state=init,
                                     store_final_state=True, config=cfg_s)
    o, den = K.chunk_output(d["q"], d["k"], d["v"], h, hz, log_decay=d["g"], normalize=normalize, config=cfg_o)
    tol = TOL[dtype]

    S_all, z_all = recurrence(x)
    h_ref, hz_ref = entry_states(x, S_all, z_all, cfg_s["BT"])
    assert h.dtype == torch.float32 and h.shape == h_ref.shape
    assert rel(h, h_ref) < tol, f"entry states: rel {rel(h, h_ref):.2e}"
    assert (hz is None) == (not normalize) and (z_T is None) == (not normalize)
    if normalize:
        assert hz.shape == hz_ref.shape and rel(hz, hz_ref) < tol, f"entry z: rel {rel(hz, hz_ref):.2e}"

    state = LinearAttentionState(x["S0"].double(), None if x["z0"] is None else x["z0"].double()) if resume else None
    o_ref, st_ref = reference_linear_attention(
        x["q"].double(), x["k"].double(), x["v"].double(), normalize=normalize, form="quadratic",
        log_decay=None if x["g"] is None else x["g"].double(), initial_state=state, return_state=True)
    assert o.dtype == dtype and o.shape == (B, H, T, Dv)
    assert rel(o, o_ref) < tol, f"o: rel {rel(o, o_ref):.2e}"
    assert rel(S_T, st_ref.S) < tol and rel(S_T, S_all[:, :, -1]) < tol
    if normalize:
        assert rel(z_T, st_ref.z) < tol
        den_ref = (x["q"].double() * z_all).sum(-1) + 1e-6     # d + eps, what chunk_fwd stores
        assert den.dtype == torch.float32 and rel(den, den_ref) < tol, f"den: rel {rel(den, den_ref):.2e}"
    else:
        assert den is None


def test_two_phase_matches_the_one_pass_forward():
    """chunk_fwd_two_phase returns what chunk_fwd's forward returns -- (o, den, S_T, z_T), den
    = d + eps -- so the backward that reads them is unchanged; also with small blocks that
    split Dk into several tiles in both kernels and chunks of 16."""
    x = _on_device(make_inputs(1, 2, 50, 48, 24, "token", True, True, torch.float32, seed=3))
    args = (x["q"], x["k"], x["v"])
    kw = dict(log_decay=x["g"], normalize=True, eps=1e-6, initial_state=(x["S0"], x["z0"]), store_final_state=True)
    want = K.chunk_fwd(*args, **kw)
    small = dict(BT=16, BK=16, BV=16, num_warps=4, num_stages=1)
    for configs in (None, (small, dict(small, BV=32))):
        got = K.chunk_fwd_two_phase(*args, configs=configs, **kw)
        for name, a, b in zip(("o", "den", "S_T", "z_T"), got, want):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert rel(a, b) < 1e-6, (name, configs, rel(a, b))
    o, den, S_T, z_T = K.chunk_fwd_two_phase(*args, log_decay=x["g"], normalize=False)
    assert den is None and S_T is None and z_T is None and o.shape == (1, 2, 50, 24)


def test_an_initial_state_without_z0_reads_as_zeros():
    """initial_state=(S0, None) with a normaliser, as the docstrings allow (z0 "or None"): the
    one-pass forward and the non-causal state pass read it as z0 = 0, like the two-phase
    forward (chunk_fwd and noncausal_state had called None.to())."""
    x = _on_device(make_inputs(1, 2, 40, 16, 16, None, True, True, torch.float32, seed=4))
    args = (x["q"], x["k"], x["v"])
    zeros = torch.zeros_like(x["z0"])
    for fwd in (K.chunk_fwd, K.chunk_fwd_two_phase):
        got = fwd(*args, initial_state=(x["S0"], None), store_final_state=True)
        want = fwd(*args, initial_state=(x["S0"], zeros), store_final_state=True)
        for a, b in zip(got, want):
            assert (a is None and b is None) or torch.equal(a, b)
    noncausal_state = K.noncausal.noncausal_state
    got = noncausal_state(x["k"], x["v"], track_z=True, initial_state=(x["S0"], None))
    want = noncausal_state(x["k"], x["v"], track_z=True, initial_state=(x["S0"], zeros))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_states_stored_in_the_input_dtype():
    """Entry states stored in 16 bits between the phases (what bf16 inputs get by default; fp16
    here, the interpreter has no bf16): the outputs stay within the 16-bit tolerance of
    float64, and the stored states are the fp32 ones rounded."""
    x = make_inputs(1, 2, 130, 48, 40, "token", True, True, torch.float16, seed=2)
    d = _on_device(x)
    kw = dict(log_decay=d["g"], normalize=True, initial_state=(d["S0"], d["z0"]), store_final_state=True)
    o16, den16, S16, _ = K.chunk_fwd_two_phase(d["q"], d["k"], d["v"], state_dtype=torch.float16, **kw)
    o32, den32, S32, _ = K.chunk_fwd_two_phase(d["q"], d["k"], d["v"], **kw)
    state = LinearAttentionState(x["S0"].double(), x["z0"].double())
    o_ref = reference_linear_attention(x["q"].double(), x["k"].double(), x["v"].double(), form="quadratic",
                                       log_decay=x["g"].double(), initial_state=state)
    assert rel(o16, o_ref) < TOL[torch.float16] and rel(o32, o_ref) < TOL[torch.float16]
    assert torch.equal(S16, S32) and torch.equal(den16, den32)  # the running state is fp32 either way
    h16, _, _, _ = K.chunk_states(d["k"], d["v"], log_decay=d["g"], state_dtype=torch.float16)
    h32, _, _, _ = K.chunk_states(d["k"], d["v"], log_decay=d["g"])
    assert h16.dtype == torch.float16 and torch.equal(h16, h32.half())


def test_the_two_phases_share_their_chunk_length():
    """The output kernel reads the states at the state kernel's chunk boundaries: whatever the
    dtype, head dim or GPU, the selected configs agree on BT; mismatched ones are refused."""
    for cap in [None, *K.TARGETS.values()]:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for d in (1, 64, 65, 128, 200, 256):
                cfg_s, cfg_o = (K.select_config(n, d, dtype, cap) for n in ("chunk_state", "chunk_output"))
                assert cfg_s["BT"] == cfg_o["BT"], (cap, dtype, d)
    q = torch.rand(1, 1, 8, 16, device=DEVICE)
    cfg = dict(BT=16, BK=16, BV=16, num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match="one chunk length"):
        K.chunk_fwd_two_phase(q, q, q, configs=(cfg, dict(cfg, BT=32)))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, on the NaN
def test_nonfinite_value_reaches_only_later_states_and_outputs():
    """A NaN value at token 40 (inside chunk 1 of 32): the entry states of chunks 0 and 1 and
    the outputs before 40 are finite and unchanged, the output at 40 and the entry states of
    every later chunk are not finite."""
    x = _on_device(make_inputs(1, 1, 100, 16, 16, "token", True, False, torch.float32, seed=5))
    cfg = dict(BT=32, BK=16, BV=16, num_warps=4, num_stages=1)
    clean_h, clean_hz, _, _ = K.chunk_states(x["k"], x["v"], log_decay=x["g"], config=cfg)
    clean_o, _ = K.chunk_output(x["q"], x["k"], x["v"], clean_h, clean_hz, log_decay=x["g"], config=cfg)
    v = x["v"].clone()
    v[0, 0, 40, 3] = float("nan")
    h, hz, _, _ = K.chunk_states(x["k"], v, log_decay=x["g"], config=cfg)
    o, _ = K.chunk_output(x["q"], x["k"], v, h, hz, log_decay=x["g"], config=cfg)
    assert torch.equal(h[:, :, :2], clean_h[:, :, :2]) and torch.isfinite(hz).all()
    assert (~torch.isfinite(h[0, 0, 2:])).flatten(1).any(1).all()  # every later entry state
    assert torch.isfinite(o[:, :, :40]).all() and rel(o[:, :, :40], clean_o[:, :, :40]) <= 1e-7
    assert not torch.isfinite(o[0, 0, 40]).all() and not torch.isfinite(o[0, 0, 64:]).all()


# ------------------------------------------------------------------ the two-phase backward


def _reference_grads(x: dict, normalize: bool, w: torch.Tensor, wS: torch.Tensor, wz: torch.Tensor | None):
    """Float64 gradients of <o, w> + <S_T, wS> (+ <z_T, wz>) by autograd through the quadratic
    form, for every input that is not None."""
    leaves = {n: (t.double().requires_grad_() if t is not None else None) for n, t in x.items()}
    state = None
    if leaves["S0"] is not None:
        state = LinearAttentionState(leaves["S0"], leaves["z0"] if normalize else None)
    o, st = reference_linear_attention(leaves["q"], leaves["k"], leaves["v"], normalize=normalize,
                                       form="quadratic", log_decay=leaves["g"], initial_state=state,
                                       return_state=True)
    loss = (o * w.double()).sum() + (st.S * wS.double()).sum()
    if normalize:
        loss = loss + (st.z * wz.double()).sum()
    names = [n for n, t in leaves.items() if t is not None and (n != "z0" or normalize)]
    return dict(zip(names, torch.autograd.grad(loss, [leaves[n] for n in names])))


def _kernel_grads(x: dict, normalize: bool, w, wS, wz, cu_seqlens=None):
    """The same gradients through the kernels (causal_forward, causal_backward)."""
    from linattn_lib.core.triton_ops import causal_backward, causal_forward

    d = _on_device(x)
    o, den, S_T, z_T = causal_forward(d["q"], d["k"], d["v"], d["g"], d["S0"], d["z0"] if normalize else None,
                                      normalize, 1e-6, True, cu_seqlens=cu_seqlens)
    needs = tuple(d[n] is not None for n in ("q", "k", "v", "g", "S0")) + (normalize and d["z0"] is not None,)
    grads = causal_backward(d["q"], d["k"], d["v"], d["g"], d["S0"], d["z0"] if normalize else None, o, den,
                            S_T, z_T, w.to(DEVICE, o.dtype), wS.to(DEVICE), None if wz is None else wz.to(DEVICE),
                            normalize, needs, cu_seqlens=cu_seqlens)
    return o, (S_T, z_T), {n: gr for n, gr in zip(("q", "k", "v", "g", "S0", "z0"), grads) if gr is not None}


def _cotangents(x: dict, n_states: int, normalize: bool, seed: int = 7):
    gen = torch.Generator().manual_seed(seed)
    B, H, T, Dk = x["q"].shape
    w = torch.randn(B, H, T, x["v"].shape[-1], generator=gen)
    wS = torch.randn(n_states, H, Dk, x["v"].shape[-1], generator=gen)
    wz = torch.randn(n_states, H, Dk, generator=gen) if normalize else None
    return w.to(x["v"].dtype).float(), wS, wz


GRAD_TOL = {torch.float32: 1e-5, torch.float16: 5e-3}
# The log-decay's gradient is a suffix sum of q . dq - k . dk, terms that largely cancel: the
# torch path's fp32 gradient is off by the same 1.6e-4 on the per-head case.
DECAY_TOL = {torch.float32: 1e-3, torch.float16: 3e-2}


def _tol(name: str, dtype: torch.dtype) -> float:
    return (DECAY_TOL if name == "g" else GRAD_TOL)[dtype]


# head decay + resume, unnormalised per-token decay, the reset, fp16: one of each kind
BACKWARD_CASES = [CASES[1], CASES[2], CASES[8], CASES[9]]


@pytest.mark.parametrize("case", BACKWARD_CASES, ids=_id)
def test_two_phase_backward_against_float64(case):
    """dq, dk, dv, the log-decay's and the initial state's gradients of a loss on the outputs
    and the final state, from the two-phase backward, against float64 autograd through the
    quadratic form (the cotangents rounded as the kernels see them)."""
    B, H, T, Dk, Dv, decay, normalize, resume, dtype = case
    x = make_inputs(B, H, T, Dk, Dv, decay, normalize, resume, dtype, seed=1)
    w, wS, wz = _cotangents(x, B, normalize)
    want = _reference_grads(x, normalize, w, wS, wz)
    _, _, got = _kernel_grads(x, normalize, w, wS, wz)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == (x[name].dtype if name != "g" else torch.float32), name
        err = rel(got[name], want[name])
        assert err < _tol(name, dtype), f"d{name}: rel {err:.2e}"


FUSED = {"chunk_dqk": {"fused_dqkv": True}}


@pytest.mark.parametrize("case", BACKWARD_CASES + [CASES[5]], ids=_id)
def test_one_backward_kernel_gives_the_two_kernels_gradients_bit_for_bit(case):
    """The GPU check's candidate "dq, dk, dv in one kernel" (`chunk_dqkv_kernel`: chunk_dqk's
    programs of a chunk, then chunk_dv's, in one program): the very gradients of the two kernels
    launched apart, bit for bit (the same code per block, in the same order), with a decay per
    head or per token, normalised or not, resumed, fp32 and fp16."""
    B, H, T, Dk, Dv, decay, normalize, resume, dtype = case
    x = make_inputs(B, H, T, Dk, Dv, decay, normalize, resume, dtype, seed=1)
    w, wS, wz = _cotangents(x, B, normalize)
    _, _, apart = _kernel_grads(x, normalize, w, wS, wz)
    with K.overridden(FUSED):
        _, _, fused = _kernel_grads(x, normalize, w, wS, wz)
    assert sorted(fused) == sorted(apart)
    for name in apart:
        assert torch.equal(fused[name], apart[name]), name


def test_one_backward_kernel_on_packed_sequences_and_a_dead_tail():
    """The fused candidate on packed sequences (boundaries inside chunks, an empty one) and on a
    dead tail (the cotangent zero from some token on): the two kernels' gradients, bit for bit."""
    x, cu = _packed((17, 0, 64, 40), 48, 100, "token", True, torch.float32)
    w, wS, wz = _cotangents(x, 4, True)
    runs = [_kernel_grads(x, True, w, wS, wz, cu_seqlens=cu.to(DEVICE))[2]]
    with K.overridden(FUSED):
        runs.append(_kernel_grads(x, True, w, wS, wz, cu_seqlens=cu.to(DEVICE))[2])
    assert all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])
    d = _on_device(make_inputs(2, 1, 150, 40, 72, "head", True, False, torch.float32, seed=3))
    o, den, _, _ = K.chunk_fwd_two_phase(d["q"], d["k"], d["v"], log_decay=d["g"], normalize=True)
    do = torch.randn_like(o)
    do[0, :, 90:] = 0
    run = lambda: K.chunk_bwd_two_phase(d["q"], d["k"], d["v"], do, o=o, den=den, log_decay=d["g"],
                                        skip_dead_tail=True)
    apart = run()
    with K.overridden(FUSED):
        fused = run()
    for name in ("dq", "dk", "dv", "dG"):
        assert torch.equal(fused[name], apart[name]), name


@pytest.mark.parametrize("fused", [False, True], ids=["apart", "fused"])
@pytest.mark.parametrize("decay,normalize,dtype", [("token", True, torch.float32), ("head", False, torch.float16)])
def test_head_dims_that_fill_the_tiles_drop_their_masks_bit_for_bit(monkeypatch, decay, normalize, dtype, fused):
    """Where the head dims are multiples of the tiles the launchers tell the kernels (EVEN_D), which
    then mask tiles by token only (`sequences.dim_mask`): the outputs, final states and every
    gradient are those of the same launches with EVEN_D=False, bit for bit. D = 64 in blocks of 32,
    chunk_dqk on 8 warps (the sm_90 configs: 4-warp ones keep their masks); T = 100 ends inside a
    chunk."""
    x = make_inputs(2, 2, 100, 64, 64, decay, normalize, True, dtype, seed=4)
    w, wS, wz = _cotangents(x, 2, normalize)
    blocks = {"BK": 32, "BV": 32}
    changes = {"chunk_dqk": {**blocks, "num_warps": 8, **({"fused_dqkv": True} if fused else {})},
               "chunk_dv": {**blocks, "num_warps": 8}, "chunk_output": blocks, "chunk_state": blocks}
    real = K.configs.launchable
    even = []

    def launchable(masked: bool):
        def wrap(kernel, device):
            launch = real(kernel, device)

            def at(grid):
                def call(*args, **kw):
                    if "EVEN_D" in kw:
                        even.append(kw["EVEN_D"])
                        kw["EVEN_D"] = kw["EVEN_D"] and not masked
                    return launch[grid](*args, **kw)
                return call
            return type("Launch", (), {"__getitem__": lambda self, grid: at(grid)})()
        return wrap

    runs = []
    for masked in (False, True):
        for module in (K.chunk_output, K.chunk_dqk, K.chunk_states):
            monkeypatch.setitem(module.__globals__, "launchable", launchable(masked))
        with K.overridden(changes):
            runs.append(_kernel_grads(x, normalize, w, wS, wz))
    # every walk, the outputs and the backward's parallel kernels were told so
    assert all(even) and len(even) == 2 * (5 if fused else 6)  # 3 walks, 2 or 3 parallel kernels
    (o1, st1, g1), (o0, st0, g0) = runs
    assert torch.equal(o1, o0) and all(torch.equal(a, b) for a, b in zip(st1, st0) if a is not None)
    assert sorted(g1) == sorted(g0) and all(torch.equal(g1[n], g0[n]) for n in g0), decay


def test_one_backward_kernel_replaces_both_launches_where_the_configs_agree():
    """Under the candidate the backward launches chunk_dqkv_kernel once per chunk (grid (1, chunks,
    B H)) instead of chunk_dqk_kernel and chunk_dv_kernel, with chunk_dqk's blocks and chunk_dv's as
    BKV x BVO; configs that differ in chunk length, warps or rounding keep the two kernels."""
    from linattn_lib.chapters import perf_model as pm

    def backward(changes):
        with K.overridden(changes):
            return {c.kernel: c for c in pm.census(2, 4, 1024, 128, decay="token", sms=132)["backward"]}

    apart, fused = backward({}), backward(FUSED)
    assert {"chunk_dqk_kernel", "chunk_dv_kernel"} <= set(apart) and "chunk_dqkv_kernel" not in apart
    assert "chunk_dqkv_kernel" in fused and not {"chunk_dqk_kernel", "chunk_dv_kernel"} & set(fused)
    one, dqk, dv = fused["chunk_dqkv_kernel"], apart["chunk_dqk_kernel"], apart["chunk_dv_kernel"]
    assert one.grid == (1, *dqk.grid[1:]) and one.num_warps == dqk.num_warps
    assert (one.args["BK"], one.args["BV"], one.args["BKV"], one.args["BVO"]) == (
        dqk.args["BK"], dqk.args["BV"], dv.args["BK"], dv.args["BV"])
    other = dict(FUSED, chunk_dv={"num_warps": 2 * dqk.num_warps})
    assert "chunk_dqkv_kernel" not in backward(other)


def test_state_gradients_stored_in_16_bits_without_a_decay_gradient():
    """chunk_bwd_two_phase with 16-bit storage (fp16 here, the interpreter has no bf16): asked
    for the log-decay's gradient it keeps the state gradients in fp32 -- dk and dv, which
    read only those, equal the fp32-storage ones bit for bit --; not asked, dG is None
    and dk, dv (from 16-bit state gradients) stay within the fp16 tolerance of float64."""
    x = make_inputs(1, 2, 130, 48, 40, "head", True, False, torch.float16, seed=3)
    w, _, _ = _cotangents(x, 1, True)
    want = _reference_grads(x, True, w, torch.zeros(1, 2, 48, 40), torch.zeros(1, 2, 48))
    d = _on_device(x)
    o, den, _, _ = K.chunk_fwd_two_phase(d["q"], d["k"], d["v"], log_decay=d["g"])
    run = lambda **kw: K.chunk_bwd_two_phase(d["q"], d["k"], d["v"], w.to(DEVICE, o.dtype), o=o, den=den,
                                             log_decay=d["g"], **kw)
    full, with_dg = run(), run(state_dtype=torch.float16)
    without_dg = run(state_dtype=torch.float16, need_log_decay_grad=False)
    assert torch.equal(with_dg["dk"], full["dk"]) and torch.equal(with_dg["dv"], full["dv"])
    assert with_dg["dG"] is not None and without_dg["dG"] is None
    assert not torch.equal(without_dg["dk"], full["dk"])
    for name in ("q", "k", "v"):
        err = rel(without_dg["d" + name], want[name])
        assert err < GRAD_TOL[torch.float16], f"d{name}: rel {err:.2e}"


@pytest.mark.parametrize("programs", [2, 16])
def test_dead_tail_lengths_read_from_the_end_equal_the_full_scan(monkeypatch, programs):
    """The lengths of chunk_bwd_prep (1 + the last token whose dO is not all zero): read from
    the end (unnormalised, live_length_kernel, with fewer programs a row than blocks and more)
    as the full scan beside r and e (normalised) finds them -- rows with no dead tail, a tail
    across blocks of 16, one nonzero element at token 0, a NaN (not zero), no live token."""
    monkeypatch.setattr(K.chunk_grad_prep, "LIVE_LENGTH_PROGRAMS", programs)
    gen = torch.Generator().manual_seed(6)
    last = [99, 40, 0, 63, -1, 16]
    do = torch.randn(1, len(last), 100, 24, generator=gen)
    for h, t in enumerate(last):
        do[0, h, t + 1:] = 0
    do[0, 2, 0], do[0, 2, 0, 5] = 0, 1.0
    do[0, 3, 63], do[0, 3, 63, 7] = 0, float("nan")
    cfg = dict(BT=16, BK=16, BV=32, num_warps=4, num_stages=1)
    d = do.to(DEVICE)
    _, _, from_end = K.chunk_bwd_prep(d, None, None, find_lengths=True, config=cfg)
    _, _, scanned = K.chunk_bwd_prep(d, d, torch.ones(1, len(last), 100, device=DEVICE), find_lengths=True,
                                     config=cfg)
    want = torch.tensor([last], dtype=torch.int32) + 1
    assert torch.equal(from_end.cpu(), want) and torch.equal(scanned.cpu(), want)


def test_decay_grad_sums_each_sequence_from_its_end():
    """decay_grad: dG_t = the key blocks' partials summed, then over the tokens from t to the
    end of t's sequence, plus the final state's term of that sequence -- against float64, for
    batched rows and for packed sequences (one empty, one of one token, lengths across the
    blocks of 16 tokens the config walks)."""
    gen = torch.Generator().manual_seed(4)
    cfg = dict(BT=16, BK=32, BV=32, num_warps=4, num_stages=1)
    suffix = lambda x: x.double().sum(0).flip(-1).cumsum(-1).flip(-1)
    parts, end = torch.randn(2, 2, 3, 50, generator=gen), torch.randn(2, 3, generator=gen)
    got = K.decay_grad(parts.to(DEVICE), end.to(DEVICE), config=cfg)
    assert got.shape == (2, 3, 50) and rel(got, suffix(parts) + end.double()[..., None]) < 1e-6
    assert rel(K.decay_grad(parts.to(DEVICE), None, config=cfg), suffix(parts)) < 1e-6
    cu = torch.tensor([0, 17, 17, 49, 50], dtype=torch.int32)
    packed, end = torch.randn(2, 1, 3, 50, generator=gen), torch.randn(4, 3, generator=gen)
    got = K.decay_grad(packed.to(DEVICE), end.to(DEVICE), cu.to(DEVICE), config=cfg)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        want = suffix(packed[..., a:b]) + end.double()[i, :, None]
        assert rel(got[..., a:b], want) < 1e-6, i


def test_decayed_bf16_keys_are_rounded_once():
    """The state walk forms its decayed bf16 keys in bf16 pairs (`_decayed`: ea = hi + lo,
    then fma(k, hi, (k lo) rounded)), which the interpreter cannot run; emulated here in exact
    arithmetic, it is (k ea) rounded once to bf16 but for a rare tie, within half a bf16 ulp
    and a hair -- where rounding ea to bf16 first (one product, k hi) is off a quarter of the
    time (seed 0), by up to 1.3 ulp."""
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1 << 16, generator=gen).to(torch.bfloat16)
    ea = torch.exp(-8 * torch.rand(1 << 16, generator=gen))      # fp32 decays in (e^-8, 1]
    hi = ea.to(torch.bfloat16)
    lo = (ea - hi.float()).to(torch.bfloat16)
    k_lo = (k.float() * lo.float()).to(torch.bfloat16)           # a product of two bf16 is exact in fp32
    exact = k.double() * ea.double()
    fused = _round_bf16(k.double() * hi.double() + k_lo.double())  # one rounding, as HFMA2's
    once = _round_bf16(exact)
    assert (fused != once).float().mean() < 1e-3
    ulp = lambda x: 2.0 ** (torch.floor(torch.log2(x.abs())) - 7)  # noqa: E731
    nz = exact != 0
    assert ((fused - exact).abs()[nz] / ulp(exact[nz])).max() < 0.5 + 2 ** -6
    rounded_ea = (k.float() * hi.float()).to(torch.bfloat16).double()
    assert (rounded_ea != once).float().mean() > 0.2
    assert ((rounded_ea - exact).abs()[nz] / ulp(exact[nz])).max() > 0.75


def _round_bf16(x: torch.Tensor) -> torch.Tensor:
    """float64 to the nearest bf16 (ties to even), in one rounding (as float64, exactly)."""
    m, e = torch.frexp(x)                           # x = m 2^e, 0.5 <= |m| < 1
    return torch.ldexp(torch.round(torch.ldexp(m, torch.full_like(e, 8))), e - 8)


def test_bf16_state_gradients_cost_dk_and_dv_less_than_their_own_rounding():
    """Why bf16 inputs may store the state gradients in bf16 (chunk_bwd_two_phase), in float64
    on the backward's chunk formulas (module docstring of kernels/chunk_grad.py; no kernel):
    rounding every dH_n to bf16 moves dk and dv by less than rounding dk and dv themselves to
    bf16 does, while it doubles the error of the log-decay's gradient left by the bf16 entry
    states -- which is why that case keeps them in fp32."""
    gen = torch.Generator().manual_seed(0)
    T, D, C = 1024, 64, 64
    bf = lambda t: t.to(torch.bfloat16).double()
    q, k, v, do = (bf(torch.randn(T // C, C, D, generator=gen, dtype=torch.float64) / D**0.25) for _ in range(4))
    g = torch.nn.functional.logsigmoid(torch.randn(T // C, C, generator=gen, dtype=torch.float64) + 4)
    gc = g.cumsum(1)                                    # chunk start -> token i
    a = gc[:, -1:] - gc                                 # token j -> chunk end
    E = torch.where(torch.ones(C, C, dtype=torch.bool).tril(), (gc[:, :, None] - gc[:, None, :]).exp(), 0.0)
    S, dH = torch.zeros(T // C, D, D, dtype=torch.float64), torch.zeros(T // C, D, D, dtype=torch.float64)
    for n in range(1, T // C):                          # entry states, and gradients leaving each chunk
        S[n] = gc[n - 1, -1].exp() * S[n - 1] + (a[n - 1].exp()[:, None] * k[n - 1]).T @ v[n - 1]
        m = T // C - 1 - n
        dH[m] = gc[m + 1, -1].exp() * dH[m + 1] + (gc[m + 1].exp()[:, None] * q[m + 1]).T @ do[m + 1]

    def grads(S, dH):
        W = E * (do @ v.transpose(1, 2))
        dq = W @ k + gc.exp()[..., None] * (do @ S.transpose(1, 2))
        dk = W.transpose(1, 2) @ q + a.exp()[..., None] * (v @ dH.transpose(1, 2))
        dv = (E * (q @ k.transpose(1, 2))).transpose(1, 2) @ do + a.exp()[..., None] * (k @ dH)
        dG = ((q * dq).sum(-1) - (k * dk).sum(-1)).flatten().flip(0).cumsum(0).flip(0)
        return dk, dv, dG

    exact, rounded = grads(S, dH), grads(bf(S), bf(dH))
    for x, y in zip(exact[:2], rounded[:2]):
        assert rel(y, x) < 0.7 * rel(bf(x), x)
    entry_only = grads(bf(S), dH)[2]
    assert rel(rounded[2], exact[2]) > 1.5 * rel(entry_only, exact[2])


# ------------------------------------------------------------------ packed sequences


PACKED = [  # lengths, Dk, Dv, decay, normalize, dtype: boundaries inside and at the chunk edges
    ((5, 32, 0, 70, 1), 16, 24, "token", True, torch.float32),
    ((33, 31, 64), 48, 16, "head", False, torch.float32),
    ((1, 64, 65, 2), 16, 16, "token-reset", True, torch.float32),
    ((17, 0, 40), 16, 16, "token", True, torch.float16),
]


def _packed(lengths, Dk, Dv, decay, normalize, dtype):
    """Packed inputs (1, H, sum(lengths), D), their cu_seqlens, and per-sequence initial states."""
    H, N, T = 2, len(lengths), sum(lengths)
    x = make_inputs(1, H, T, Dk, Dv, decay if decay != "head" else None, normalize, False, dtype, seed=11)
    if decay == "head":
        x["g"] = -torch.rand(H, generator=torch.Generator().manual_seed(4))
    gen = torch.Generator().manual_seed(12)
    x["S0"] = torch.randn(N, H, Dk, Dv, generator=gen)
    x["z0"] = torch.rand(N, H, Dk, generator=gen) * 3 if normalize else None
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return x, cu


def _one_sequence(x: dict, cu, i: int) -> dict:
    a, b = int(cu[i]), int(cu[i + 1])
    out = {n: x[n][:, :, a:b] for n in ("q", "k", "v")}
    out["g"] = None if x["g"] is None else (x["g"] if x["g"].dim() == 1 else x["g"][:, :, a:b])
    out["S0"] = x["S0"][i:i + 1]
    out["z0"] = None if x["z0"] is None else x["z0"][i:i + 1]
    return out


@pytest.mark.parametrize("case", PACKED, ids=lambda c: "-".join(map(str, c[0])) + f"-{c[3]}-{c[5]}".replace("torch.", ""))
def test_packed_sequences_equal_each_sequence_alone(case):
    """Packed sequences (cu_seqlens) through both phases forward and backward: every sequence's
    output, final state and gradients equal those of the float64 reference run on it alone
    with its own initial state -- boundaries inside a chunk, at a chunk edge, empty sequences."""
    lengths, Dk, Dv, decay, normalize, dtype = case
    x, cu = _packed(lengths, Dk, Dv, decay, normalize, dtype)
    w, wS, wz = _cotangents(x, len(lengths), normalize)
    o, (S_T, z_T), got = _kernel_grads(x, normalize, w, wS, wz, cu_seqlens=cu.to(DEVICE))
    tol = TOL[dtype]
    dg_head = torch.zeros(x["q"].shape[1], dtype=torch.float64)
    for i, n in enumerate(lengths):
        a, b = int(cu[i]), int(cu[i + 1])
        xi = _one_sequence(x, cu, i)
        si = slice(i, i + 1)
        state = LinearAttentionState(xi["S0"].double(), None if xi["z0"] is None else xi["z0"].double())
        if n == 0:  # an empty sequence: its final state is its initial state, and so are the gradients
            st, want = state, {"S0": wS[si], **({"z0": wz[si]} if normalize else {})}
        else:
            want = _reference_grads(xi, normalize, w[:, :, a:b], wS[si], None if wz is None else wz[si])
            o_ref, st = reference_linear_attention(
                xi["q"].double(), xi["k"].double(), xi["v"].double(), normalize=normalize, form="quadratic",
                log_decay=None if xi["g"] is None else xi["g"].double(), initial_state=state, return_state=True)
        if n:
            assert rel(o[:, :, a:b], o_ref) < tol, (i, rel(o[:, :, a:b], o_ref))
        assert rel(S_T[si], st.S) < tol and (z_T is None or rel(z_T[si], st.z) < tol), i
        for name, ref in want.items():
            if name == "g" and ref.dim() == 1:
                dg_head += ref
                continue
            part = {"S0": got.get("S0", None), "z0": got.get("z0", None)}.get(name)
            mine = part[si] if part is not None else got[name][:, :, a:b]
            if n or name in ("S0", "z0"):
                assert rel(mine, ref) < _tol(name, dtype), (i, name, rel(mine, ref))
    if x["g"] is not None and x["g"].dim() == 1:
        assert rel(got["g"], dg_head) < _tol("g", dtype)


@pytest.mark.parametrize("dtype,decay,normalize", [(torch.float16, "token", True), (torch.float32, "head", False),
                                                   (torch.float16, None, False)])
def test_packed_chunk_count_below_its_bound(dtype, decay, normalize):
    """The packed launches are sized by the bound NT = ceil(T / BT) + N - 1 (no host sync for the
    true count, sequences.py); lengths 1, 63, 65, 130 have fewer chunks (7 < 8 at BT 64 in fp16,
    11 < 12 at BT 32 in fp32), so the grids have padding slots, whose programs must do nothing.
    Outputs, final states and every gradient equal those of the same kernels run on each sequence
    alone."""
    from linattn_lib.kernels.chunk_state import state_config
    from linattn_lib.kernels.sequences import packed_layout

    lengths = (1, 63, 65, 130)
    x, cu = _packed(lengths, 16, 24, decay, normalize, dtype)
    BT = state_config(16, 24, 8, dtype, DEVICE, normalize)["BT"]
    cu_pad, offsets, indices, NT, N = packed_layout(cu.to(DEVICE), sum(lengths), 1, 2, BT)
    real = sum(-(-n // BT) for n in lengths)
    assert NT == -(-sum(lengths) // BT) + N - 1 > real and int(offsets[-1]) == real
    assert indices[real:, 0].tolist() == [N] * (NT - real) and cu_pad.tolist()[-2:] == [sum(lengths)] * 2
    w, wS, wz = _cotangents(x, len(lengths), normalize)
    o, (S_T, z_T), got = _kernel_grads(x, normalize, w, wS, wz, cu_seqlens=cu.to(DEVICE))
    dg_head = 0
    for i in range(len(lengths)):
        a, b = int(cu[i]), int(cu[i + 1])
        si = slice(i, i + 1)
        o_i, (S_i, z_i), want = _kernel_grads(_one_sequence(x, cu, i), normalize, w[:, :, a:b], wS[si],
                                              None if wz is None else wz[si])
        assert rel(o[:, :, a:b], o_i) < TOL[dtype], (i, rel(o[:, :, a:b], o_i))
        assert rel(S_T[si], S_i) < 1e-5 and (z_T is None or rel(z_T[si], z_i) < 1e-5), i
        for name, ref in want.items():
            if name == "g" and ref.dim() == 1:
                dg_head = dg_head + ref
                continue
            mine = got[name][si] if name in ("S0", "z0") else got[name][:, :, a:b]
            assert rel(mine, ref) < _tol(name, dtype), (i, name, rel(mine, ref))
    if decay == "head":
        assert rel(got["g"], dg_head) < 1e-5


# ------------------------------------------------------------------ split-T


SPLIT_CASES = [  # B, H, T, Dk, Dv, decay, reverse, initial state, dtype; chunks of 16
    (2, 1, 100, 16, 24, "token", False, True, torch.float32),
    (1, 2, 100, 48, 16, "head", True, True, torch.float32),
    (1, 1, 150, 16, 16, "token-reset", False, False, torch.float32),
    (1, 1, 130, 16, 16, "token-steep", True, False, torch.float32),
    (1, 2, 77, 16, 16, None, False, True, torch.float16),
]
SMALL = dict(BT=16, BK=16, BV=16, num_warps=4, num_stages=1)


@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: "-".join(map(str, c[:7])) + f"-{c[8]}".replace("torch.", ""))
def test_split_state_pass_equals_one_walk(case):
    """Split-T: the chunks walked in 2, 3 and 7 runs in parallel and merged give the entry
    states and final states of one walk (and, forward, of the float64 recurrence); forward and
    reversed (the state gradient, with key scales and z weights), through decays that
    underflow between runs and a reset."""
    B, H, T, Dk, Dv, decay, reverse, resume, dtype = case
    x = make_inputs(B, H, T, Dk, Dv, decay, True, resume, dtype, seed=8)
    d = _on_device(x)
    kw = dict(log_decay=d["g"], initial_state=(d["S0"], d["z0"]) if resume else None, store_final_state=True,
              config=SMALL, reverse=reverse)
    if reverse:
        gen = torch.Generator().manual_seed(9)
        kw.update(key_scale=(torch.rand(B, H, T, generator=gen) + 0.5).to(DEVICE),
                  z_weights=torch.randn(B, H, T, generator=gen).to(DEVICE))
    one = K.chunk_states(d["k"], d["v"], splits=1, **kw)
    if not reverse:
        S_all, z_all = recurrence(x)
        h_ref, hz_ref = entry_states(x, S_all, z_all, SMALL["BT"])
        assert rel(one[0], h_ref) < TOL[dtype] and rel(one[1], hz_ref) < TOL[dtype]
    for splits in (2, 3, 7):
        got = K.chunk_states(d["k"], d["v"], splits=splits, **kw)
        for name, a, b in zip(("h", "hz", "S_T", "z_T"), got, one):
            assert a.shape == b.shape and a.dtype == b.dtype, (splits, name)
            assert rel(a, b) < 1e-6, (splits, name, rel(a, b))


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reversed"])
@pytest.mark.parametrize("name", ["chunk_state_wide", "chunk_state_few", "chunk_state_few_wide"])
def test_wide_state_tiles_equal_the_narrow_ones(reverse, name):
    """The sm_90 configs `state_config` picks for launches of many programs (value tiles of 64,
    "chunk_state_wide") and of few (8 warps, "chunk_state_few") walk the same states as the
    narrow one: entry states, final states and z, forward and reversed (key scales, z
    weights), a per-token decay with a reset, Dv = 100 (the last value tile masked), fp32 and
    fp16 in the interpreter."""
    wide = K.select_config(name, 128, torch.bfloat16, K.TARGETS["sm_90"])
    narrow = K.select_config("chunk_state", 128, torch.bfloat16, K.TARGETS["sm_90"])
    assert (wide["BV"], wide["num_warps"]) != (narrow["BV"], narrow["num_warps"]) and wide["BT"] == narrow["BT"]
    for dtype in (torch.float32, torch.float16):
        x = make_inputs(2, 1, 150, 48, 100, "token-reset", True, True, dtype, seed=11)
        d = _on_device(x)
        kw = dict(log_decay=d["g"], initial_state=(d["S0"], d["z0"]), store_final_state=True, reverse=reverse,
                  track_z=True)
        if reverse:
            gen = torch.Generator().manual_seed(12)
            kw.update(key_scale=(torch.rand(2, 1, 150, generator=gen) + 0.5).to(DEVICE),
                      z_weights=torch.randn(2, 1, 150, generator=gen).to(DEVICE))
        want = K.chunk_states(d["k"], d["v"], config=dict(narrow, num_stages=1), **kw)
        got = K.chunk_states(d["k"], d["v"], config=dict(wide, num_stages=1), **kw)
        for name, a, b in zip(("h", "hz", "S_T", "z_T"), got, want):
            assert a.shape == b.shape and a.dtype == b.dtype, name
            assert rel(a, b) < 1e-6, (dtype, name, rel(a, b))


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reversed"])
@pytest.mark.parametrize("decay", ["head", "token-reset"])
def test_decayed_walks_reading_their_keys_transposed_walk_the_same_states(reverse, decay):
    """The GPU check's candidate "decayed_keys_t" (configs.walk_keys_t): a decayed walk without key
    scales reads its keys transposed and decays them along their columns, and walks the same
    entry and final states, forward and reversed, Dv = 100, fp32 and fp16 in the interpreter."""
    cfg = dict(K.select_config("chunk_state", 128, torch.bfloat16, K.TARGETS["sm_90"]), num_stages=1)
    assert not K.configs.walk_keys_t(cfg, 2, None) and K.configs.walk_keys_t(cfg, 0, None)
    assert K.configs.walk_keys_t(dict(cfg, decayed_keys_t=True), 2, None)
    assert not K.configs.walk_keys_t(dict(cfg, decayed_keys_t=True), 2, torch.ones(1))
    for dtype in (torch.float32, torch.float16):
        d = _on_device(make_inputs(2, 1, 150, 48, 100, decay, False, True, dtype, seed=13))
        kw = dict(log_decay=d["g"], initial_state=(d["S0"], None), store_final_state=True, reverse=reverse)
        want = K.chunk_states(d["k"], d["v"], config=cfg, **kw)
        got = K.chunk_states(d["k"], d["v"], config=dict(cfg, decayed_keys_t=True), **kw)
        for name, a, b in zip(("h", "S_T"), got[::2], want[::2]):
            assert a.shape == b.shape and a.dtype == b.dtype, name
            assert rel(a, b) < 1e-6, (dtype, name, rel(a, b))


def test_split_count_fills_the_gpu_only_when_the_grid_does_not():
    """One run off a GPU or when the programs occupy every SM; else about two programs per
    SM, runs of at least 16 chunks; packed sequences are not split."""
    split = K.split_count
    assert split(80, 256, None) == 1 and split(320, 256, 132) == 1 and split(132, 256, 132) == 1
    assert split(131, 256, 132) == 3
    assert split(80, 256, 132) == 4 and split(20, 256, 132) == 14 and split(20, 64, 132) == 4
    assert split(4, 8, 132) == 1
    q = torch.rand(1, 1, 40, 16, device=DEVICE)
    with pytest.raises(ValueError, match="split-T"):
        K.chunk_states(q, q, splits=2, cu_seqlens=torch.tensor([0, 40], device=DEVICE))


def test_split_engine_forward_and_backward(monkeypatch):
    """When `split_count` asks for runs the launchers split every state pass (forward, the
    backward's recompute and its reversed state gradient): outputs, final states and every
    gradient equal the unsplit run's."""
    case = (1, 2, 200, 48, 24, "token", True, True, torch.float32)
    x = make_inputs(*case, seed=12)
    w, wS, wz = _cotangents(x, 1, True)
    o1, st1, g1 = _kernel_grads(x, True, w, wS, wz)
    monkeypatch.setattr(K.chunk_state, "split_count", lambda p, n, sms: 3)
    o3, st3, g3 = _kernel_grads(x, True, w, wS, wz)
    assert rel(o3, o1) < 1e-6 and rel(st3[0], st1[0]) < 1e-6 and rel(st3[1], st1[1]) < 1e-6
    assert sorted(g3) == sorted(g1)
    for name in g1:
        assert rel(g3[name], g1[name]) < 1e-5, (name, rel(g3[name], g1[name]))


def test_state_config_follows_the_programs_per_sm(monkeypatch):
    """`state_config` on an sm_90 of 132 SMs at D = 128: 8 warps for 1 to 2 programs per SM
    (B * H = 16: 256 narrow programs without z; with z's column the narrow tiles give 320,
    the wide ones 192; B * H = 32 without z: 512 narrow, 256 wide), the narrow config below
    (split-T's), the wide tiles on 4 warps beyond (B * H = 64); off a GPU always the narrow
    config."""
    pick = lambda rows, z: K.chunk_state.state_config(128, 128, rows, torch.bfloat16, "cuda", z)
    narrow = K.select_config("chunk_state", 128, torch.bfloat16, K.TARGETS["sm_90"])
    monkeypatch.setattr(K.configs, "device_capability", lambda d: K.TARGETS["sm_90"])
    monkeypatch.setattr(K.chunk_state, "multiprocessor_count", lambda d: None)
    assert pick(16, False) == narrow
    monkeypatch.setattr(K.chunk_state, "multiprocessor_count", lambda d: 132)
    assert pick(16, False) == K.select_config("chunk_state_few", 128, torch.bfloat16, K.TARGETS["sm_90"])
    assert pick(16, False)["num_warps"] == 8
    few_wide = K.select_config("chunk_state_few_wide", 128, torch.bfloat16, K.TARGETS["sm_90"])
    assert pick(16, True) == few_wide and pick(32, False) == few_wide
    assert pick(4, False) == narrow and pick(4, True) == narrow
    assert pick(64, False) == K.select_config("chunk_state_wide", 128, torch.bfloat16, K.TARGETS["sm_90"])
