"""The length-based dispatcher: its stated rule, the crossover interpolation, and both branches;
and the experiment that measures the crossover (linattn_lib.experiments.crossover)."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

from linattn_lib import elu_plus_one, linear_attention
from linattn_lib.chapters.dispatch import (
    FALLBACK_CROSSOVER,
    MEASURED_CROSSOVER,
    Crossover,
    auto_attention,
    choose_attention,
    choose_form,
    crossover_from_times,
    crossover_length,
    crossover_table,
)
from linattn_lib.experiments import crossover
from linattn_lib.experiments.crossover import measure_crossover


def test_rule_interpolates_the_measured_crossovers():
    table = MEASURED_CROSSOVER["cpu"]
    for d, t_star in table.items():
        assert crossover_length(d, "cpu") == t_star
        assert choose_attention(t_star - 1, d, "cpu") == "softmax"
        assert choose_attention(t_star, d, "cpu") == "linear"
    # log-linear between measured head dimensions, constant outside them
    assert crossover_length(8, table={16: 100, 64: 300}) == 100
    assert crossover_length(32, table={16: 100, 64: 300}) == 200
    assert crossover_length(512, table={16: 100, 64: 300}) == 300
    assert crossover_length(64, "cuda" if "cuda" not in MEASURED_CROSSOVER else "meta") == FALLBACK_CROSSOVER
    assert choose_attention(100, 64, crossover=100) == "linear"
    c = [Crossover("cpu", 32, 4, 1, True, t_star=300.0), Crossover("cpu", 64, 4, 1, True, t_star=None)]
    assert crossover_table(c) == {32: 300.0}


def test_crossover_interpolation():
    L = [64, 128, 256, 512]
    # linear is 2x slower at 128 and 2x faster at 256: crossing in the geometric middle
    assert crossover_from_times(L, [1, 1, 1, 1], [4, 2, 0.5, 0.25]) == pytest.approx(math.sqrt(128 * 256))
    assert crossover_from_times(L, [1, 1, 1, 1], [2, 2, 2, 2]) is None
    assert crossover_from_times(L, [1, 1, 1, 1], [0.5] * 4) == 64.0
    # a noisy early flip does not count: the last change from slower to faster does
    assert crossover_from_times(L, [1, 1, 1, 1], [0.9, 2, 0.5, 0.5]) == pytest.approx(math.sqrt(128 * 256))


def test_auto_attention_branches():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))
    o, choice = auto_attention(q, k, v, crossover=17, return_choice=True)
    assert choice == "softmax"
    torch.testing.assert_close(o, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    o, choice = auto_attention(q, k, v, crossover=16, return_choice=True)
    assert choice == "linear"
    torch.testing.assert_close(o, linear_attention(elu_plus_one(q), elu_plus_one(k), v))


def test_choose_form_and_measure_smoke():
    assert choose_form(64, 16, 16) == "quadratic"
    assert choose_form(65, 16, 16) == "chunked"
    before = torch.get_num_threads()
    c = measure_crossover(8, lengths=(16, 32), heads=1, repeats=1, threads=1)
    assert torch.get_num_threads() == before and c.threads == 1
    assert c.lengths == [16, 32] and (c.d, c.heads, c.batch, c.causal) == (8, 1, 1, True)
    assert len(c.softmax_s) == len(c.linear_s) == 2 and all(t > 0 for t in c.softmax_s + c.linear_s)
    # the crossover is the one its own times give
    assert c.t_star == crossover_from_times(c.lengths, c.softmax_s, c.linear_s)
    assert c.to_dict()["d"] == 8 and c.to_dict()["ratio"] == (None if c.t_star is None else c.t_star / 8)


def test_measure_crossover_locates_a_known_crossover(monkeypatch):
    """With timings that cross at a known length (softmax ~ T^2, linear ~ 300 T: equal at
    T = 300), measure_crossover reports that crossover, between the lengths it was given."""
    calls = []

    def fake_time(kind, T, d, *, device="cpu", heads=4, batch=1, causal=True, repeats=5):
        calls.append((kind, T, d, heads, batch, causal, repeats))
        return float(T * T) if kind == "softmax" else 300.0 * T

    monkeypatch.setattr(crossover, "time_attention", fake_time)
    L = (64, 128, 256, 512, 1024)
    c = measure_crossover(16, lengths=L, heads=3, batch=2, repeats=2, threads=1)
    assert c.softmax_s == [float(T * T) for T in L] and c.linear_s == [300.0 * T for T in L]
    assert c.t_star == pytest.approx(300.0) and c.ratio == pytest.approx(300.0 / 16)
    assert sorted(calls) == sorted((k, T, 16, 3, 2, True, 2) for k in ("softmax", "linear") for T in L)
    # linear never faster: no crossover; always faster: the first length
    monkeypatch.setattr(crossover, "time_attention", lambda kind, T, d, **kw: 1.0 if kind == "softmax" else 2.0)
    assert measure_crossover(16, lengths=L, threads=None).t_star is None
    monkeypatch.setattr(crossover, "time_attention", lambda kind, T, d, **kw: 2.0 if kind == "softmax" else 1.0)
    assert measure_crossover(16, lengths=L, threads=None).t_star == 64.0


def test_time_attention_times_the_named_computation(monkeypatch):
    """time_attention times softmax (SDPA) or linear (elu+1) attention on its (B, H, T, d)
    inputs: the function handed to the timer computes exactly that."""
    seen = {}

    def fake_time_fn(fn, **kw):
        seen["out"] = fn()
        return 0.125

    monkeypatch.setattr(crossover, "time_fn", fake_time_fn)
    for kind in ("softmax", "linear"):
        assert crossover.time_attention(kind, 40, 8, heads=3, batch=2) == 0.125
        q, k, v = crossover._inputs(40, 8, 3, 2, "cpu")
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True) if kind == "softmax" else \
            linear_attention(elu_plus_one(q), elu_plus_one(k), v)
        assert seen["out"].shape == (2, 3, 40, 8)
        torch.testing.assert_close(seen["out"], want)


def test_cli_writes_json(tmp_path):
    out = tmp_path / "x.json"
    payload = crossover.main(["--d", "8", "16", "--lengths", "8", "16", "--heads", "1", "--repeats", "1", "--out", str(out)])
    assert out.is_file() and payload["meta"]["command"].startswith("python -m linattn_lib.experiments.crossover")
    assert json.loads(out.read_text()) == json.loads(json.dumps(payload))
    assert payload["meta"]["timing_threads"] == 1
    assert [c["d"] for c in payload["crossovers"]] == [8, 16]
    for c in payload["crossovers"]:
        assert c["lengths"] == [8, 16] and c["heads"] == 1 and c["threads"] == 1
        assert len(c["softmax_s"]) == len(c["linear_s"]) == 2 and all(t > 0 for t in c["softmax_s"] + c["linear_s"])
        assert c["t_star"] == crossover_from_times(c["lengths"], c["softmax_s"], c["linear_s"])
        assert c["ratio"] == (None if c["t_star"] is None else c["t_star"] / c["d"])


def test_bad_input():
    with pytest.raises(ValueError, match="T"):
        choose_attention(0, 64)
    with pytest.raises(ValueError, match="same"):
        crossover_from_times([1, 2], [1.0], [1.0, 2.0])


def test_dispatch_does_not_import_the_experiments():
    """The chapter's decision helpers only read measurements: importing them loads no experiment
    (the measuring CLI is linattn_lib.experiments.crossover)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    code = ("import sys, linattn_lib.chapters.dispatch as d; "
            "assert not [m for m in sys.modules if m.startswith('linattn_lib.experiments')]; "
            "assert not hasattr(d, 'measure_crossover') and not hasattr(d, 'main')")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=root, env=env)
