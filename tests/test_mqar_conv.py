"""The with/without-convolution MQAR sweep (experiments/mqar_conv.py) and its committed result."""
from __future__ import annotations

import json

from linattn_lib.experiments import mqar_conv
from linattn_lib.results import load_result


def _base() -> dict:
    return json.loads(mqar_conv.BASE.read_text())


def test_jobs_use_the_committed_sweeps_settings_and_rates():
    base = _base()
    jobs = mqar_conv.jobs_for(base, ["linear", "deltanet"], [16, 32], [0, 1], mqar_conv.VARIANTS)
    assert len(jobs) == 2 * 2 * 2 * 2
    for kind, d, _seed, _variant, common in jobs:
        assert common["lr"] == base["meta"]["lr"][kind][str(d)]
        assert common["steps"] == base["meta"]["config"]["steps"]
        assert common["seq_len"] == base["meta"]["config"]["seq_len"]
    assert {j[3] for j in jobs} == {"none", "conv"}


def test_shift_runs_are_the_committed_ones():
    runs = mqar_conv.shift_runs(_base(), ["deltanet"], [32], [1, 2])
    assert len(runs) == 2 and all(r["variant"] == "shift" for r in runs)
    assert all(r["kind"] == "deltanet" and r["d_model"] == 32 for r in runs)
    assert sorted(r["config"]["seed"] for r in runs) == [1, 2]
    assert all(r["config"]["token_shift"] for r in runs)


def test_summary_orders_seeds():
    runs = [dict(variant="conv", kind="linear", d_model=16, config=dict(seed=s), accuracy={"2": a})
            for s, a in [(2, 0.3), (0, 0.1), (1, 0.2)]]
    assert mqar_conv.summary(runs) == {"conv": {"linear": {"16": {"2": [0.1, 0.2, 0.3]}}}}


def test_quick_run_trains_both_variants(tmp_path):
    out = tmp_path / "conv.json"
    payload = mqar_conv.main(["--quick", "--out", str(out), "--no-progress"])
    assert json.loads(out.read_text())["summary"] == payload["summary"]
    assert set(payload["summary"]) == {"shift", "none", "conv"}
    trained = [r for r in payload["results"] if r["variant"] != "shift"]
    assert {r["variant"] for r in trained} == {"none", "conv"}
    assert all(not r["config"]["token_shift"] for r in trained)
    assert [r["config"]["short_conv"] for r in trained] == [False, True]
    assert not (tmp_path / "conv.json.partial").exists()


def test_committed_sweep_is_complete():
    res = load_result("mqar_conv.json")
    summary = res["summary"]
    for variant in ("shift", "none", "conv"):
        for kind in mqar_conv.KINDS:
            for d in ("16", "32"):
                assert all(len(summary[variant][kind][d][n]) == 3 for n in ("2", "4", "8"))
    assert res["meta"]["command"].startswith("python -m linattn_lib.experiments.mqar_conv")
