"""The fast chunked torch path (linattn_lib.core.torch_chunked) against the float64 reference.

Forward and gradients on awkward lengths and chunk sizes, every option (causal or not,
normalised or not, decay per head or per token, initial state in, final state out), a float64
gradcheck through the custom backward, resuming from a state, and a smoke test of the bench CLI.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import linattn_lib.core.torch_chunked as fast
from linattn_lib import LinearAttentionState, linear_attention
from linattn_lib.core.reference import reference_linear_attention

ROOT = Path(__file__).resolve().parents[1]
TS = (1, 7, 63, 64, 65, 200)
CHUNKS = (16, 64)
DECAYS = (None, "head", "token")


# tiny shapes: extra threads only add synchronisation (the `one_thread` fixture of conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error of a against the reference b (flash-linear-attention's metric)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def close(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float = 1e-6) -> bool:
    """||a - b|| <= rtol ||b|| + atol sqrt(n): relative, with a floor for gradients that are ~0
    (at T = 1 a normalised output is v whatever q is, so dq is pure round-off)."""
    a, b = a.double(), b.double()
    return (a - b).norm().item() <= rtol * b.norm().item() + atol * b.numel() ** 0.5


def both(q, k, v, log_decay, init, **kw):
    """(fast path, float64 quadratic reference) on the same inputs, with the final state."""
    kw = dict(kw, log_decay=log_decay, initial_state=init, return_state=True)
    fast_out = linear_attention(q, k, v, form="chunked", backend="torch", **kw)
    d = lambda x: None if x is None else x.detach().double()  # noqa: E731
    init64 = None if init is None else LinearAttentionState(d(init.S), d(init.z))
    ref_kw = dict(kw, log_decay=d(log_decay), initial_state=init64)
    ref_kw.pop("chunk_size", None)
    ref = reference_linear_attention(d(q), d(k), d(v), form="quadratic", **ref_kw)
    return fast_out, ref


# ------------------------------------------------------------------------------- forward


@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_forward_matches_float64_reference(T, chunk_size, make_inputs):
    for normalize, decay, state in itertools.product((True, False), DECAYS, (False, True)):
        q, k, v, g, init = make_inputs(T=T, decay=decay, state=state)
        (o, st), (o_ref, st_ref) = both(q, k, v, g, init, normalize=normalize, chunk_size=chunk_size)
        case = f"T={T} C={chunk_size} normalize={normalize} decay={decay} state={state}"
        assert o.dtype == torch.float32 and o.shape == o_ref.shape, case
        assert rel_err(o, o_ref) < 2e-6, case
        assert rel_err(st.S, st_ref.S) < 2e-6, case
        if normalize:
            assert rel_err(st.z, st_ref.z) < 2e-6, case
        else:
            assert st.z is None, case


@pytest.mark.parametrize("T", TS)
def test_noncausal_matches_reference(T, make_inputs):
    for normalize, state in itertools.product((True, False), (False, True)):
        q, k, v, _, init = make_inputs(T=T, state=state)
        (o, st), (o_ref, st_ref) = both(q, k, v, None, init, causal=False, normalize=normalize, chunk_size=16)
        assert rel_err(o, o_ref) < 2e-6
        assert rel_err(st.S, st_ref.S) < 2e-6


def test_many_blocks_and_multi_head_blocks(monkeypatch, make_inputs):
    """Tiny blocks: a long sequence crosses many block boundaries (carrying the state), a short
    one puts several heads in one block; both must not change the result."""
    for block_tokens, T in ((32, 200), (64, 7), (48, 65)):
        monkeypatch.setattr(fast, "BLOCK_TOKENS", block_tokens)
        for decay in DECAYS:
            q, k, v, g, init = make_inputs(T=T, decay=decay, state=True, grad=True)
            (o, st), (o_ref, st_ref) = both(q, k, v, g, init, chunk_size=8)
            assert rel_err(o, o_ref) < 2e-6 and rel_err(st.S, st_ref.S) < 2e-6
            # the backward walks the same blocks: every gradient equals float64 autograd's
            fast_grads = _loss_grads(q, k, v, g, init, (o, st), True)
            d = lambda x: None if x is None else x.detach().double().requires_grad_()  # noqa: E731
            q64, k64, v64, g64 = d(q), d(k), d(v), d(g)
            init64 = LinearAttentionState(d(init.S), d(init.z))
            ref = reference_linear_attention(q64, k64, v64, form="quadratic", log_decay=g64, initial_state=init64, return_state=True)
            ref_grads = _loss_grads(q64, k64, v64, g64, init64, ref, True)
            for name, a, b in zip(["q", "k", "v", "log_decay", "S0", "z0"] if g is not None else ["q", "k", "v", "S0", "z0"], fast_grads, ref_grads):
                tol = 1e-4 if name == "log_decay" else 1e-5
                assert b.abs().max() > 1e-3 and close(a, b, tol), f"d{name}: blocks of {block_tokens}, T={T}, decay={decay}"


@pytest.mark.parametrize("n", (1, 5, 16, 36, 61, 64, 256))
@pytest.mark.parametrize("decay", (False, True))
def test_state_scan_equals_the_recurrence(n, decay):
    """_Scan (one matmul, or two levels for long blocks) == the loop E_{i+1} = e^g_i E_i + inc_i,
    forwards and backwards."""
    h, F = 3, 5
    gen = torch.Generator().manual_seed(n)
    gamma = -torch.rand(h, n, generator=gen, dtype=torch.float64) if decay else None
    carry = torch.randn(h, F, generator=gen, dtype=torch.float64)
    inc = torch.randn(h * n, F, generator=gen, dtype=torch.float64)
    a = (lambda i: gamma[:, i : i + 1].exp()) if decay else (lambda i: 1.0)
    steps = inc.view(h, n, F)
    E, after = fast._Scan(gamma, h, n, torch.float64, "cpu")(carry, inc)
    S, want = carry, []
    for i in range(n):
        want.append(S)
        S = a(i) * S + steps[:, i]
    assert torch.allclose(E, torch.stack(want, 1).view(h * n, F)) and torch.allclose(after, S)
    E, before = fast._Scan(gamma, h, n, torch.float64, "cpu")(carry, inc, reverse=True)
    S, want = carry, [None] * n
    for i in reversed(range(n)):
        want[i] = S
        S = a(i) * S + steps[:, i]
    assert torch.allclose(E, torch.stack(want, 1).view(h * n, F)) and torch.allclose(before, S)


def test_low_precision_inputs_compute_in_float32(make_inputs):
    """fp16 / bf16 inputs: the output is rounded to the input dtype once, at the end; the state
    is float32 and as accurate as a float32 computation (1e-6), far below the dtype's own
    rounding (fp16 ~5e-4, bf16 ~4e-3), so nothing was accumulated in low precision. The
    gradients, in the input dtype, equal float64 autograd's to the dtype's precision."""
    for dtype, unit in ((torch.float16, 2.0**-11), (torch.bfloat16, 2.0**-8)):
        q, k, v, g, init = make_inputs(T=65, decay="token", dtype=dtype, grad=True)
        o, st = linear_attention(q, k, v, log_decay=g, return_state=True, backend="torch")
        assert o.dtype == dtype and st.S.dtype == torch.float32
        # the reference sees the same (already rounded) inputs, in float64
        d = lambda x: x.detach().double().requires_grad_()  # noqa: E731
        q64, k64, v64, g64 = d(q), d(k), d(v), d(g)
        o_ref, st_ref = reference_linear_attention(q64, k64, v64, log_decay=g64, form="quadratic", return_state=True)
        assert rel_err(o, o_ref) < 2 * unit, dtype  # one rounding of o to the dtype
        assert rel_err(st.S, st_ref.S) < 2e-6 and rel_err(st.z, st_ref.z) < 2e-6, dtype  # float32 accumulation
        w = torch.randn(o.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        (o.float() * w.float()).sum().backward()
        (o_ref * w).sum().backward()
        for name, x, x64 in (("q", q, q64), ("k", k, k64), ("v", v, v64), ("log_decay", g, g64)):
            assert x.grad.dtype == dtype, name
            assert rel_err(x.grad, x64.grad) < (8 if name == "log_decay" else 4) * unit, (dtype, name, rel_err(x.grad, x64.grad))


def test_float64_stays_float64(make_inputs):
    q, k, v, g, init = make_inputs(T=30, decay="head", state=True, dtype=torch.float64)
    (o, st), (o_ref, st_ref) = both(q, k, v, g, init, chunk_size=8)
    assert o.dtype == torch.float64 and st.S.dtype == torch.float64
    assert rel_err(o, o_ref) < 1e-12 and rel_err(st.S, st_ref.S) < 1e-12


# ------------------------------------------------------------------------------- gradients


def _loss_grads(q, k, v, g, init, outs, normalize):
    """Gradients of a loss that touches the output and both parts of the final state."""
    o, st = outs
    gen = torch.Generator().manual_seed(1)
    w = lambda x: torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.dtype)  # noqa: E731
    loss = (o * w(o)).sum() + (st.S * w(st.S)).sum()
    if normalize:
        loss = loss + (st.z * w(st.z)).sum()
    wrt = [q, k, v] + ([g] if g is not None else []) + ([x for x in init if x is not None] if init else [])
    return torch.autograd.grad(loss, wrt)


@pytest.mark.parametrize("T", (1, 7, 64, 65, 200))
@pytest.mark.parametrize("decay", DECAYS)
def test_gradients_match_reference_autograd(T, decay, make_inputs):
    """float32 fast path vs float64 autograd through the reference, every input's gradient."""
    for normalize, state in itertools.product((True, False), (False, True)):
        q, k, v, g, init = make_inputs(T=T, decay=decay, state=state, grad=True)
        if init is not None and not normalize:
            init = LinearAttentionState(init.S, None)
        kw = dict(normalize=normalize, log_decay=g, initial_state=init, return_state=True)
        fast_grads = _loss_grads(q, k, v, g, init, linear_attention(q, k, v, chunk_size=16, backend="torch", **kw), normalize)

        d = lambda x: None if x is None else x.detach().double().requires_grad_()  # noqa: E731
        q64, k64, v64, g64 = d(q), d(k), d(v), d(g)
        init64 = None if init is None else LinearAttentionState(d(init.S), d(init.z))
        kw64 = dict(kw, log_decay=g64, initial_state=init64)
        ref = reference_linear_attention(q64, k64, v64, form="quadratic", **kw64)
        ref_grads = _loss_grads(q64, k64, v64, g64, init64, ref, normalize)
        names = ["q", "k", "v"] + (["log_decay"] if g is not None else []) + (["S0", "z0"][: 2 if normalize else 1] if init else [])
        for name, a, b in zip(names, fast_grads, ref_grads):
            tol = 1e-4 if name == "log_decay" else 1e-5  # dg sums q.dq - k.dk over the sequence
            assert a.shape == b.shape and close(a, b, tol), f"d{name}: T={T} {decay} normalize={normalize} state={state}"


@pytest.mark.parametrize("normalize", (True, False))
@pytest.mark.parametrize("decay", ("head", "token"))
def test_gradcheck_float64_with_decay(normalize, decay, monkeypatch, make_inputs):
    """torch.autograd.gradcheck through the custom backward: q, k, v, log_decay, S0, z0."""
    monkeypatch.setattr(fast, "BLOCK_TOKENS", 6)  # several blocks even at this size
    q, k, v, g, init = make_inputs(B=1, H=2, T=7, Dk=2, Dv=2, decay=decay, state=True, dtype=torch.float64, grad=True)
    inputs = (q, k, v, g, init.S, init.z) if normalize else (q, k, v, g, init.S)

    def f(q, k, v, g, S0, z0=None):
        o, st = fast.chunked_linear_attention(
            q, k, v, causal=True, normalize=normalize, log_decay=g, eps=1e-6, chunk_size=3,
            initial_state=LinearAttentionState(S0, z0), return_state=True,
        )
        return (o, st.S) + ((st.z,) if normalize else ())

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


# ------------------------------------------------------------------------------- state resume


@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("normalize", (True, False))
def test_piecewise_with_state_resume_equals_one_pass(decay, normalize, make_inputs):
    T, cuts = 150, (0, 1, 40, 64, 129, 150)
    q, k, v, g, _ = make_inputs(T=T, decay=decay)
    kw = dict(normalize=normalize, chunk_size=32, backend="torch", return_state=True)
    o_all, st_all = linear_attention(q, k, v, log_decay=g, **kw)
    pieces, state = [], None
    for a, b in zip(cuts[:-1], cuts[1:]):
        gp = None if g is None else (g if g.dim() == 1 else g[..., a:b])
        o, state = linear_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], log_decay=gp, initial_state=state, **kw)
        pieces.append(o)
    assert rel_err(torch.cat(pieces, dim=2), o_all) < 2e-6
    assert rel_err(state.S, st_all.S) < 2e-6


def test_chunk_size_does_not_change_the_result(make_inputs):
    q, k, v, g, init = make_inputs(T=200, decay="token", state=True)
    outs = [linear_attention(q, k, v, log_decay=g, initial_state=init, chunk_size=c, backend="torch") for c in (1, 3, 64, 128, 256)]
    for o in outs[1:]:
        assert rel_err(o, outs[0]) < 2e-6


# ------------------------------------------------------------------------------- bench CLI


def test_bench_flop_count_formula():
    from linattn_lib.flops import chunked_forward_flops

    B, H, T, D, C = 1, 8, 16384, 64, 64
    per_chunk = 2 * C * C * D + 2 * C * C * (D + 1) + 4 * C * D * (D + 1)  # v' = [v, 1]
    assert chunked_forward_flops(B, H, T, D, D, C) == B * H * (T // C) * per_chunk
    assert chunked_forward_flops(B, H, T, D, D, C, normalize=False) == B * H * (T // C) * (8 * C * D * D)


def test_bench_sweep_cli_writes_json_and_plot(tmp_path):
    from linattn_lib.experiments.bench import main

    argv = ["sweep", "--quick", "--device", "cpu", "--providers", "linattn-torch,naive-quadratic,sdpa,linattn-triton",
            "--no-progress", "--out", str(tmp_path)]
    assert main(argv) == 0
    data = json.loads((tmp_path / "sweep-cpu-quick.json").read_text())
    assert data["command"].startswith("python -m linattn_lib.experiments.bench sweep")
    assert {"hardware", "torch_version", "library_version", "config", "records"} <= set(data)
    done = {(r["provider"], r["mode"]) for r in data["records"] if "median_s" in r}
    assert {("linattn-torch", "fwd"), ("sdpa", "fwd+bwd"), ("naive-quadratic", "fwd")} <= done
    assert all("skipped" in r for r in data["records"] if r["provider"] == "linattn-triton")  # no CUDA here
    assert (tmp_path / "sweep-cpu-quick.png").stat().st_size > 0


def test_bench_sweep_table_has_rows_only_for_chunk_sizes_that_ran():
    """A skipped provider's own chunk length (fla's 64 on a CPU) adds no row of skips and
    repeated times; one that ran at its own chunk length does."""
    from linattn_lib.experiments.bench import format_sweep

    def rec(provider, C, ran=True):
        return dict(provider=provider, mode="fwd", T=64, D=16, chunk_size=C,
                    **({"median_s": 1e-3} if ran else {"skipped": "no CUDA"}))

    records = [rec("linattn-torch", 16), rec("sdpa", None), rec("fla", 64, ran=False)]
    rows = [line.split() for line in format_sweep(records, ["linattn-torch", "sdpa", "fla"], False).splitlines()]
    assert [row[3] for row in rows if row[0] == "fwd"] == ["16"]
    records[-1] = rec("fla", 64)
    rows = [line.split() for line in format_sweep(records, ["linattn-torch", "sdpa", "fla"], False).splitlines()]
    assert [row[3] for row in rows if row[0] == "fwd"] == ["16", "64"]


def test_bench_targets_cli_quick(tmp_path):
    """`python -m linattn_lib.experiments.bench --quick`: the targets table at tiny sizes, in a subprocess."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "linattn_lib.experiments.bench", "--quick", "--no-plot", "--no-progress", "--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "CPU targets" in out.stdout and "counted FLOPs" in out.stdout
    data = json.loads((tmp_path / "targets-cpu-quick.json").read_text())
    # at these sizes the verdicts mean nothing, but each must be the one its own numbers give
    assert [t["verdict"] for t in data["targets"]] == expected_verdicts(data["results"])
    f, g, m = data["results"]["forward"], data["results"]["growth"], data["results"]["memory"]
    assert math.isclose(f["speedup_vs_sdpa"], f["sdpa_s"] / f["linattn_s"])
    assert f["linattn_s"] == statistics.median(f["linattn_times_s"]) and f["sdpa_s"] == statistics.median(f["sdpa_times_s"])
    assert math.isclose(f["matmul_fraction"], (f["linattn_flops"] / f["linattn_s"]) / (2 * f["matmul_n"] ** 3 / f["matmul_s"]))
    c = data["config"]
    from linattn_lib.flops import chunked_forward_flops

    assert f["linattn_flops"] == chunked_forward_flops(c["B"], c["H"], c["T"], c["D"], c["D"], c["chunk_size"])
    lo, hi = (str(t) for t in c["growth_T"])
    assert g["median_s"][hi] == statistics.median(g["times_s"][hi]) and math.isclose(g["ratio"], g["median_s"][hi] / g["median_s"][lo])
    assert m["qkvo_bytes"] == 4 * c["B"] * c["H"] * c["memory_T"] * c["D"] * 4  # q, k, v, o in float32


def expected_verdicts(res):
    """The five verdicts that the measurements in `res` call for, from the stated goals."""
    from linattn_lib.experiments import bench_targets

    f, g, m = res["forward"], res["growth"], res["memory"]
    v = lambda ok: "n/a" if ok is None else ("PASS" if ok else "FAIL")  # noqa: E731
    total = m.get("total_peak_bytes")
    return [
        v(f["sdpa_s"] / f["linattn_s"] >= bench_targets.TARGET_SPEEDUP_VS_SDPA),
        v((f["linattn_flops"] / f["linattn_s"]) / (2 * f["matmul_n"] ** 3 / f["matmul_s"]) >= bench_targets.TARGET_MATMUL_FRACTION),
        v(g["median_s"][str(g["T"][1])] / g["median_s"][str(g["T"][0])] <= bench_targets.TARGET_GROWTH),
        v(None if total is None else total < bench_targets.TARGET_MEMORY * m["qkvo_bytes"]),
        v(None if "fla_naive_s" not in f else f["fla_naive_s"] / f["linattn_s"] >= bench_targets.TARGET_SPEEDUP_VS_FLA_NAIVE),
    ]


def _synthetic_targets(speedup, fraction, growth, memory_ratio, fla_speedup=None):
    """A results dict for format_targets with the five ratios chosen (fla's None: not installed)."""
    n = 128
    mm_s = 1e-3
    lin_s = 1e-3
    flops = fraction * (2 * n**3 / mm_s) * lin_s
    forward = dict(linattn_s=lin_s, sdpa_s=speedup * lin_s, matmul_s=mm_s, linattn_flops=flops, matmul_n=n,
                   alt_chunk_size=128, alt_s=lin_s, alt_flops=flops, linattn_flops_per_s=flops / lin_s,
                   matmul_flops_per_s=2 * n**3 / mm_s, speedup_vs_sdpa=speedup, matmul_fraction=fraction,
                   alt_matmul_fraction=fraction)
    if fla_speedup is not None:
        forward.update(fla_naive_s=fla_speedup * lin_s, speedup_vs_fla_naive=fla_speedup)
    growth = dict(T=[128, 512], median_s={"128": 1.0, "512": growth}, ratio=growth)
    qkvo = 1 << 20
    memory = dict(T=1024, qkvo_bytes=qkvo, total_peak_bytes=None if memory_ratio is None else int(memory_ratio * qkvo),
                  inputs_rss_bytes=0, fwd_bwd_peak_bytes=0)
    return dict(shape=dict(B=1, H=2, T=512, D=16), chunk_size=16, rounds=1, forward=forward, growth=growth, memory=memory)


def test_targets_verdicts_follow_the_goals():
    """format_targets: PASS exactly when a measurement meets its goal, FAIL when it misses it
    (on both sides of each threshold), n/a when memory could not be measured or fla is missing."""
    from linattn_lib.experiments import bench_targets

    meta = dict(hardware="test", torch_version="x", library_version="y", threads=1)
    eps = 1e-6
    good = (bench_targets.TARGET_SPEEDUP_VS_SDPA * (1 + eps), bench_targets.TARGET_MATMUL_FRACTION * (1 + eps),
            bench_targets.TARGET_GROWTH * (1 - eps), bench_targets.TARGET_MEMORY * (1 - eps),
            bench_targets.TARGET_SPEEDUP_VS_FLA_NAIVE * (1 + eps))
    bad = (bench_targets.TARGET_SPEEDUP_VS_SDPA * (1 - eps), bench_targets.TARGET_MATMUL_FRACTION * (1 - eps),
           bench_targets.TARGET_GROWTH * (1 + eps), bench_targets.TARGET_MEMORY * (1 + eps),
           bench_targets.TARGET_SPEEDUP_VS_FLA_NAIVE * (1 - eps))
    for i in range(5):
        values = list(good)
        values[i] = bad[i]
        res = _synthetic_targets(*values)
        table, rows = bench_targets.format_targets(res, meta)
        verdicts = [bench_targets.verdict(r["ok"]) for r in rows]
        assert verdicts == ["FAIL" if j == i else "PASS" for j in range(5)], (i, verdicts)
        assert verdicts == expected_verdicts(res)
        assert [line.split()[-1] for line in table.splitlines() if line.rstrip().endswith(("PASS", "FAIL", "n/a"))] == verdicts
    _, rows = bench_targets.format_targets(_synthetic_targets(*good[:3], None, None), meta)
    assert [bench_targets.verdict(r["ok"]) for r in rows] == ["PASS", "PASS", "PASS", "n/a", "n/a"]


def test_bench_matmuls_only_ceiling_computes_the_four_products():
    """The ceiling the targets table compares against really does the forward's matmuls:
    per chunk, q (k^T v') + (q k^T) v' with v' = [v, 1], blockwise, every chunk written."""
    from linattn_lib.experiments.bench_targets import chunk_matmuls_only

    g = torch.Generator().manual_seed(3)
    B, H, T, D, C = 2, 3, 200, 16, 32  # T not a multiple of C: the last chunk is padded
    q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
    out = chunk_matmuls_only(q, k, v, chunk_size=C)()
    N = -(-T // C)
    pad = lambda x: torch.nn.functional.pad(x, (0, 0, 0, N * C - T)).reshape(B * H * N, C, -1)  # noqa: E731
    qc, kc, vc = pad(q), pad(k), pad(v)
    va = torch.cat([vc, torch.ones(B * H * N, C, 1)], -1)
    want = qc @ (kc.transpose(1, 2) @ va) + (qc @ kc.transpose(1, 2)) @ va
    assert out.shape == want.shape
    assert rel_err(out, want) < 1e-5


@pytest.mark.parametrize("form", ["chunked", "quadratic"])
def test_reset_gate_keeps_float32_precision(form):
    """One huge log-decay (a reset, g = -1e4) followed by slow decay: differences of prefix sums
    would keep only ~1e-3 of absolute precision in float32 (errors of 1e-4 in o, 5e-4 in z).
    The decay factors are summed from the right place instead, so float32 stays at ~1e-6."""
    from linattn_lib.core.reference import reference_linear_attention

    g_ = torch.Generator().manual_seed(0)
    T = 200
    q, k, v = torch.rand(1, 2, T, 4, generator=g_), torch.rand(1, 2, T, 4, generator=g_), torch.randn(1, 2, T, 4, generator=g_)
    g = torch.full((1, 2, T), -1e-3)
    g[..., 0], g[..., 70] = -1e4, -5e3
    want, ws = linear_attention(*(x.double() for x in (q, k, v)), log_decay=g.double(), form="recurrent", return_state=True)
    runs = [linear_attention(q, k, v, log_decay=g, form=form, return_state=True)]
    if form == "chunked":
        runs.append(reference_linear_attention(q, k, v, log_decay=g, form="chunked", chunk_size=64, return_state=True))
    for o, st in runs:
        assert rel_err(o, want) < 2e-6 and rel_err(st.z, ws.z) < 2e-6 and rel_err(st.S, ws.S) < 2e-6


def test_bench_rejects_unknown_modes_and_providers():
    from linattn_lib.experiments.bench import main

    for argv in (["sweep", "--quick", "--mode", "bwd"], ["sweep", "--quick", "--providers", "flash"]):
        with pytest.raises(SystemExit, match="unknown"):
            main(argv + ["--no-progress", "--no-plot"])
