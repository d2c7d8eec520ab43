"""The performance model held to published GPU times (linattn_lib/chapters/perf_calibration.py):
the transcribed table, the calibrated model's arithmetic on hand-made components, the fit
and its bounds, leave-one-out on a toy case with a known answer, a refit on synthetic
measured rows, the stored fit reproduced from its stored inputs, and the two published fla
ops replayed (perf_fla.py). Nothing here compiles: the stored components stand in for the
model's compiles.
"""
from __future__ import annotations

import math
import re

import pytest

from linattn_lib.core.triton_ops import load_kernels
from linattn_lib.results import load_result

K = load_kernels()
pytestmark = pytest.mark.skipif(K is None, reason="the Triton kernels do not import here")
if K is not None:
    from linattn_lib.chapters import perf_calibration as pc
    from linattn_lib.chapters import perf_fla as pf
    from linattn_lib.chapters import perf_model as pm

SHAPES = {"B1_T8192_H96_D128": (1, 8192, 96, 128), "B2_T16384_H16_D128": (2, 16384, 16, 128),
          "B4_T2048_H16_D128": (4, 2048, 16, 128), "B4_T4096_H64_D128": (4, 4096, 64, 128),
          "B8_T2048_H32_D256": (8, 2048, 32, 256), "B8_T1024_H8_D64": (8, 1024, 8, 64)}


def test_the_published_table_as_transcribed():
    pub = load_result("published_h100.json")
    src = pub["source"]
    assert (src["repository"], src["path"]) == ("pytorch/helion", "examples/fla/BENCHMARKS.md")
    assert re.fullmatch(r"[0-9a-f]{40}", src["commit"]) and re.fullmatch(r"[0-9a-f]{40}", pub["registry"]["commit"])
    assert pub["registry"]["repository"] == "fla-org/flash-linear-attention"
    assert {k: tuple(v[x] for x in "BTHD") for k, v in pub["shapes"].items()} == SHAPES
    assert all(pc.parse_shape(name) == shape and pc.shape_name(*shape) == name for name, shape in SHAPES.items())
    assert sorted((r["op"], r["shape"]) for r in pub["rows"]) == sorted((op, s) for op in pc.OPS for s in SHAPES)
    for r in pub["rows"]:
        for who in ("fla", "helion"):
            assert 0 < r[who]["fwd"] < r[who]["fwd+bwd"], r
    cell = {(r["op"], r["shape"]): r for r in pub["rows"]}
    # cells read off the file's H100 tables
    assert cell["linear_attn", "B2_T16384_H16_D128"]["fla"] == {"fwd": 0.609, "fwd+bwd": 2.585}
    assert cell["linear_attn", "B2_T16384_H16_D128"]["helion"] == {"fwd": 0.457, "fwd+bwd": 1.355}
    assert cell["retention", "B8_T2048_H32_D256"]["fla"]["fwd+bwd"] == 9.079
    assert cell["retention", "B4_T4096_H64_D128"]["helion"]["fwd+bwd"] == 6.260
    assert cell["linear_attn", "B8_T1024_H8_D64"]["helion"]["fwd"] == 0.143
    second = {(r["op"], r["shape"]): r["fla"] for r in pub["second_run"]["rows"]}
    assert set(second) == set(cell) and second["linear_attn", "B2_T16384_H16_D128"]["fwd+bwd"] == 3.336
    assert len(pc.published_rows(pub)) == 24 and pc.published_rows(pub, "helion")[1]["ms"] == 2.010


# one launch: [HBM s, chain s, chain steps, MMA s]
HBM = [10e-6, 2e-6, 4, 1e-6]       # 10 us of HBM at the datasheet
CHAIN = [1e-6, 8e-6, 100, 0.0]     # 8 us of chain along 100 sequential steps
TOY = {"forward": [HBM, CHAIN], "backward": [HBM], "syncs": 0}


def test_calibrated_launches_and_calls_by_hand():
    over = pm.GPUS[pc.GPU].launch_overhead  # 3 us a launch
    c = pc.Constants(eta=0.5, latency=0.1e-6, host_fwd=0.0, host_bwd=0.0)
    # HBM: 10 / 0.5 = 20 us; chain: 8 + 0.1 x 100 = 18 us > 1 / 0.5
    assert pc.gpu_time([HBM, CHAIN], c) == pytest.approx(20e-6 + 18e-6 + 2 * over, rel=1e-12)
    assert pc.raw_time(TOY, "fwd") == pytest.approx(10e-6 + 8e-6 + 2 * over, rel=1e-12)
    assert pc.call_time(TOY, "fwd+bwd", c) == pytest.approx(20e-6 + 18e-6 + 20e-6 + 3 * over, rel=1e-12)
    host = pc.Constants(eta=1.0, host_fwd=100e-6, host_bwd=300e-6)
    assert pc.call_time(TOY, "fwd", host) == pytest.approx(100e-6)         # the GPU waits for the host
    assert pc.call_time(TOY, "fwd+bwd", host) == pytest.approx(400e-6)
    synced = {**TOY, "syncs": 2}  # the GPU drains first: the forward's host time runs before its launches
    assert pc.call_time(synced, "fwd", host) == pytest.approx(100e-6 + 18e-6 + 2 * over)
    assert pc.call_time(synced, "fwd+bwd", host) == pytest.approx(100e-6 + 300e-6)
    with pytest.raises(ValueError, match="timed must be"):
        pc.call_time(TOY, "bwd", c)


def test_leave_one_out_on_a_toy_case_with_a_known_answer():
    # a model of one constant a, prediction a x size; fitted by the mean of measured / size.
    # Shapes s1..s3 measure 2 x size, s4 measures 4 x size: leaving s4 out fits a = 2 and predicts
    # it 50% low; leaving s1 out fits a = (2 + 2 + 4) / 3 and predicts it 33% high
    rows = [{"shape": f"s{i}", "size": size, "ms": (4 if i == 4 else 2) * size}
            for i, size in ((1, 1.0), (2, 3.0), (3, 5.0), (4, 2.0))]
    fitted = lambda rs: sum(r["ms"] / r["size"] for r in rs) / len(rs)
    loo = pc.leave_one_out(rows, fitted, lambda a, r: a * r["size"])
    assert list(loo) == ["s1", "s2", "s3", "s4"]
    assert loo["s4"] == [pytest.approx(-0.5)]
    assert loo["s1"] == loo["s2"] == loo["s3"] == [pytest.approx(8 / 3 / 2 - 1)]


def _toy_comps() -> dict:
    """Components a fit can tell the four constants apart on: HBM-bound, chain-bound (long chains)
    and host-bound (tiny) ops, one with a sync."""
    one, two = "B1_T64_H1_D16", "B2_T128_H4_D32"
    op = lambda fwd, bwd, syncs=0: {"forward": [fwd], "backward": [bwd], "syncs": syncs}
    return {("hbm", one): op([400e-6, 50e-6, 10, 0.0], [900e-6, 50e-6, 10, 0.0]),
            ("chain", one): op([20e-6, 100e-6, 400, 0.0], [30e-6, 200e-6, 800, 0.0]),
            ("tiny", two): op([1e-6, 1e-6, 1, 0.0], [2e-6, 1e-6, 1, 0.0]),
            ("hbm", two): op([300e-6, 20e-6, 5, 0.0], [800e-6, 20e-6, 5, 0.0], syncs=2)}


def test_refit_on_measured_rows_recovers_the_constants():
    truth = pc.Constants(eta=0.8, latency=0.5e-6, host_fwd=150e-6, host_bwd=700e-6)
    comps = _toy_comps()
    rows = [{"kernel" if i % 2 else "op": op, "shape": shape, "part" if i % 2 else "timed": timed,
             "measured_ms": pc.call_time(comps[op, shape], t, truth) * 1e3}
            for i, ((op, shape), (timed, t)) in enumerate(
                (k, p) for k in comps for p in (("forward", "fwd"), ("forward_backward", "fwd+bwd")))]
    asked = []
    missing = comps.pop(("tiny", "B2_T128_H4_D32"))  # computed on demand, as a GPU check's new shape would be
    c, errors = pc.refit_measured(rows, comps, compute=lambda *a: asked.append(a) or missing)
    assert asked == [("tiny", 2, 128, 4, 32)]
    for name in pc.NAMES:
        assert getattr(c, name) == pytest.approx(getattr(truth, name), rel=2e-3), name
    assert max(abs(e) for e in errors) < 1e-3
    # the computed component was kept: held to fixed constants, nothing is computed again
    c2, again = pc.refit_measured(rows, comps, compute=lambda *a: asked.append(a), fit_fn=lambda *_: truth)
    assert c2 is truth and len(asked) == 1 and max(abs(e) for e in again) < 1e-9


def test_the_fit_stays_inside_its_bounds():
    comps = _toy_comps()
    # measured 3x faster than HBM at the datasheet allows, and hosts faster than nothing: eta stops at 1
    rows = [{"op": op, "shape": s, "timed": t, "ms": pc.raw_time(comps[op, s], t) * 1e3 / 3}
            for op, s in comps for t in pc.TIMED]
    c = pc.fit(rows, comps)
    for name, (lo, hi) in pc.BOUNDS.items():
        assert lo <= getattr(c, name) <= hi, name
    assert c.eta == pc.BOUNDS["eta"][1] and c.latency == c.host_fwd == c.host_bwd == 0.0
    with pytest.raises(ValueError, match="no rows"):
        pc.fit([], comps)


def _stored():
    cal = load_result("perf_calibration.json")
    comps = {(label, shape): c for label, by in cal["components"].items() for shape, c in by.items()}
    return cal, comps


def test_the_stored_fit_is_reproduced_from_its_stored_inputs():
    cal, comps = _stored()
    pub = load_result("published_h100.json")
    rows = pc.published_rows(pub)
    c = pc.fit(rows, comps)
    for name in pc.NAMES:
        assert getattr(c, name) == pytest.approx(cal["constants"][name], rel=1e-3, abs=1e-12), name
    stored = pc.Constants(**cal["constants"])
    assert [r["calibrated_ms"] for r in cal["table"]] == [round(pc.predicted_ms(comps, r, stored), 4) for r in rows]
    assert [r["published_ms"] for r in cal["table"]] == [r["ms"] for r in rows]
    # one shape left out, refitted: its stored leave-one-out errors
    shape = "B2_T16384_H16_D128"
    held = pc.fit([r for r in rows if r["shape"] != shape], comps)
    errs = [pc.predicted_ms(comps, r, held) / r["ms"] - 1 for r in rows if r["shape"] == shape]
    assert errs == pytest.approx(cal["loo"][shape], abs=2e-3)
    assert cal["bands"]["fwd"]["large"] == list(pc.band(cal["loo"], rows, "fwd"))
    for name, (lo, hi) in pc.BOUNDS.items():
        assert lo <= cal["constants"][name] <= hi


def test_the_stored_restatement_follows_from_the_stored_fit():
    cal, comps = _stored()
    pub = load_result("published_h100.json")
    assert pc.restate(pub, comps, cal) == cal["restated"]
    assert pc.head_to_head(comps, cal) == cal["head_to_head"]
    for r in cal["restated"]:
        lo, hi = r["ours_interval_ms"]
        assert lo <= r["ours_ms"] <= hi or math.isclose(lo, r["ours_ms"], rel_tol=1e-3)


def test_the_published_ops_are_replayed():
    cfg = {name: options[0] for name, options in pf.fla_candidates(64).items()}
    B, H, T, D = 2, 3, 200, 64
    lin = pm.replay_calls(B, H, T, D, pf.PUBLISHED["fla chunk_linear_attn(normalize=False)"], cfg, {})
    ret = pm.replay_calls(B, H, T, D, pf.PUBLISHED["fla chunk_retention (per-head decay g_gamma)"], cfg, {})
    kernels = ["chunk_fwd_kernel_h", "chunk_fwd_kernel_o", "chunk_fwd_kernel_h", "chunk_bwd_kernel_dh",
               "chunk_bwd_kernel_dqkwg", "chunk_bwd_kernel_dv"]
    assert [c.kernel for part in lin.values() for c in part] == kernels  # no eager op at all
    assert [c.kernel for part in ret.values() for c in part if c.grid] == kernels
    # g_gamma = log(1 - 2^(-5 - h)) x 1/ln 2, made in torch; the kernels read it with USE_G_GAMMA
    assert [c.kernel for c in ret["forward"] if not c.grid] == ["torch:aten.rsub", "torch:aten.pow",
                                                                  "torch:aten.rsub", "torch:aten.log", "torch:aten.mul"]
    for c in (c for part in ret.values() for c in part if c.grid):
        assert c.args["USE_G_GAMMA"] is True and c.args["g_gamma"].shape == (H,) and c.args["USE_G"] is False
    assert {v: pf.syncs_of(v) for v in pf.PUBLISHED.values()} == {(False, None): 0, (False, "head"): 2}
    with pytest.raises(ValueError, match="no op"):
        pc.components("fla chunk_gla", 1, 64, 1, 64)


def test_the_published_tables_are_parsed_from_the_markdown():
    from linattn_lib.experiments import perf_predictions as pp

    md = """# H100 (sm_90)

## linear_attn (vanilla)

| Shape | acc (h/fla) | helion fwd | fla fwd | fwd %FLA | helion f+b | fla f+b | f+b %FLA |
|---|---|---|---|---|---|---|---|
| B2_T16384_H16_D128 | ok 3.3e-03/3.3e-03 | 0.457ms | 0.609ms | 133.4% | 1.355ms | 2.585ms | 190.7% |

## gla

| B2_T16384_H16_D128 | ok | 0.828ms | 1.478ms | 178.4% | 2.559ms | 5.798ms | 226.6% |

# B200 (sm_100)

## linear_attn (vanilla)

| B2_T16384_H16_D128 | ok 3.3e-03/3.3e-03 | 0.250ms | 0.320ms | 128.1% | 0.969ms | 1.571ms | 162.1% |
"""
    assert pp.parse_benchmarks(md, pp.FIRST_RUN[2]) == [
        {"op": "linear_attn", "shape": "B2_T16384_H16_D128", "fla": {"fwd": 0.609, "fwd+bwd": 2.585},
         "helion": {"fwd": 0.457, "fwd+bwd": 1.355}}]
    registry = "X = 1\nSHAPE_CONFIGS = {\n    'B8_T1024_H8_D64': {'B': 8, 'T': 1024, 'H': 8, 'D': 64},\n}\n"
    assert pp.registry_shapes(registry) == {"B8_T1024_H8_D64": {"B": 8, "T": 1024, "H": 8, "D": 64}}


def test_the_large_shapes_are_those_the_gpu_is_busy_on():
    cal, comps = _stored()
    c = pc.Constants(**cal["constants"])
    for label in pc.OPS.values():
        for shape in SHAPES:
            for t in pc.TIMED:
                assert pc.host_bound(comps[label, shape], t, c) == (shape not in pc.LARGE), (label, shape, t)


def test_intervals_and_verdicts():
    bands = {"fwd": {"large": (-0.2, 0.25), "all": (-0.5, 1.0)}}
    # measured = predicted / (1 + error): an error of +25% means the measurement is 1/1.25 of the prediction
    assert pc.measured_interval(1.0, bands, "fwd", False) == pytest.approx((0.8, 1.25))
    assert pc.measured_interval(1.0, bands, "fwd", True) == pytest.approx((0.5, 2.0))
    assert [pc.verdict((0.8, 1.25), x) for x in (1.3, 1.0, 0.7)] == ["<", "~", ">"]


def test_the_cli_refits_on_measured_rows(tmp_path, capsys):
    import json

    from linattn_lib.experiments import perf_predictions as pp

    cal, comps = _stored()
    truth = pc.Constants(eta=0.9, latency=0.3e-6, host_fwd=60e-6, host_bwd=250e-6)
    rows = [{"op": name, "shape": list(SHAPES[shape]), "timed": t,
             "measured_ms": pc.call_time(comps[label, shape], t, truth) * 1e3}
            for name, label in pc.OPS.items() for shape in SHAPES for t in pc.TIMED]
    path = tmp_path / "measured.json"
    path.write_text(json.dumps({"rows": rows}))
    pp.main(["--calibrate", "--measured", str(path)])
    out = capsys.readouterr().out
    assert out.startswith("on the H100 SXM")
    assert "\nrefitted on 24 measured rows: eta 0.9, latency_us 0.3, host_fwd_us 60, host_bwd_us 250" in out
    assert "B2_T16384_H16_D128" in out and "+0%" in out


def test_the_cli_refits_on_a_gpu_checks_results(tmp_path, capsys):
    """`--measured gpu_check.json`: fla's two replayed ops are taken from the GPU check's
    benchmark rows (ours' rows too, where the model predicts them; rows with an error are not)."""
    import json

    from linattn_lib.experiments import perf_predictions as pp
    from linattn_lib.experiments.gpu_bench import VARIANTS

    cal, comps = _stored()
    truth = pc.Constants(eta=0.85, latency=0.4e-6, host_fwd=80e-6, host_bwd=300e-6)
    variant = {label: v for v, label in pc.GPU_CHECK_FLA.items()}
    assert set(variant) == set(pc.OPS.values()) and set(pc.GPU_CHECK_OURS) == set(VARIANTS)
    rows = [dict(zip("BTHD", SHAPES[shape]), shape="B=..", provider="fla", variant=variant[label],
                 forward_ms=pc.call_time(comps[label, shape], "fwd", truth) * 1e3,
                 forward_backward_ms=pc.call_time(comps[label, shape], "fwd+bwd", truth) * 1e3)
            for label in pc.OPS.values() for shape in SHAPES]
    rows.append(dict(B=2, T=64, H=1, D=16, shape="B=..", provider="fla", variant="unnormalised", error="boom"))
    rows.append(dict(B=2, T=64, H=1, D=16, shape="B=..", provider="sdpa", variant="unnormalised", forward_ms=1.0))
    assert len(pc.rows_from_gpu_check({"sections": {"benchmark": {"rows": rows}}})) == 24
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps({"sections": {"benchmark": {"rows": rows}}}))
    pp.main(["--calibrate", "--measured", str(path)])
    out = capsys.readouterr().out
    assert "\nrefitted on 24 measured rows: eta 0.85, latency_us 0.4, host_fwd_us 80, host_bwd_us 300" in out


def _stub(call, target):
    return pm.SassStats(registers=64, shared_bytes=16384, total=300, body=100, flops_body=4096)


def test_components_keep_what_the_model_times_made_of():
    B, T, H, D = 2, 1024, 4, 64
    gpu = pm.GPUS[pc.GPU]
    ret = pc.components("fla chunk_retention (per-head decay g_gamma)", B, T, H, D, stats=_stub)
    assert (len(ret["forward"]), len(ret["backward"]), ret["syncs"]) == (7, 4, 2)  # 5 eager ops, 2 kernels
    assert set(ret["configs"]) == {"chunk_fwd_kernel_h", "chunk_bwd_kernel_dh", "chunk_fwd_kernel_o",
                                   "chunk_bwd_kernel_dqkwg", "chunk_bwd_kernel_dv"}
    ours = pc.components("ours, unnormalised, per-token decay", B, T, H, D, stats=_stub)
    assert ours["syncs"] == 0 and ours["configs"] == {}
    calls = pm.census(B, H, T, D, normalize=False, decay="token", target=gpu.target, sms=gpu.sms)
    rows = pm.predict([pm.launch_of(c, gpu, _stub) for c in calls["forward"]], gpu)
    assert len(ours["forward"]) == len(rows)
    for part, row in zip(ours["forward"], rows):
        assert part[0] == pytest.approx(row["t_hbm"], rel=1e-4) and part[3] == pytest.approx(row["t_mma"], rel=1e-4)
        assert part[2] == (row["waves"] * max(row["steps"], 1) if row["programs"] else 0)
    # the raw model of the components is the model's own total (5 digits kept)
    total = pm.total_time(rows)
    assert pc.gpu_time(ours["forward"], pc.Constants()) == pytest.approx(total, rel=1e-4)


def test_components_carry_to_the_h200_by_its_bandwidth():
    """on_gpu scales only the HBM seconds, by the H100 / H200 bandwidth ratio; gpu_of reads the
    GPU check's device name."""
    comps = _toy_comps()
    h200 = pc.on_gpu(comps, "H200 SXM")
    f = 3.35 / 4.8
    for key, c in comps.items():
        for part in ("forward", "backward"):
            for old, new in zip(c[part], h200[key][part]):
                assert new[0] == pytest.approx(old[0] * f) and new[1:] == old[1:]
    assert pc.gpu_of({"sections": {"environment": {"gpu": "NVIDIA H200"}}}) == "H200 SXM"
    assert pc.gpu_of({"sections": {"environment": {"gpu": "NVIDIA H100 80GB HBM3"}}}) == pc.GPU
