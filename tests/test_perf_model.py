"""The performance model (linattn_lib/chapters/perf_model.py): its arithmetic on hand-made
launches, the census of the real launchers, fla's launchers replayed (perf_fla.py), the
model's autotuning, and `compare` end to end.

The arithmetic tests use a toy GPU and exact numbers. The census runs the launchers on meta
tensors (nothing is computed). Tests that compile (ptxas, ahead of time, no GPU) need Triton's
NVIDIA tools; their compiles are cached for the session and on disk, and they stay under a
minute on two cores with a cold cache.
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from linattn_lib.core.triton_ops import load_kernels

K = load_kernels()
needs_kernels = pytest.mark.skipif(K is None, reason="the Triton kernels do not import here")
if K is not None:
    from linattn_lib.chapters import kernel_anatomy as ka
    from linattn_lib.chapters import perf_fla as pf
    from linattn_lib.chapters import perf_model as pm
    from linattn_lib.flops import io_bytes
    can_compile = ka._nvidia_tool("cuobjdump") is not None and os.environ.get("TRITON_INTERPRET") != "1"
else:
    can_compile = False
needs_compiler = pytest.mark.skipif(not can_compile, reason="needs Triton's ptxas and cuobjdump (and no interpreter)")

pytestmark = needs_kernels

TOY = None if K is None else pm.GPU("toy", sms=2, bandwidth=1e9, clock=1e9, tensor_flops=1e12, cpi=2.0,
                                    launch_overhead=1e-6)


def _launch(**kw):
    base = dict(kernel="k", grid=(5,), num_warps=4, bytes_hbm=2000, bytes_requested=2000, steps=10,
                instr_per_step=100, instr_fixed=50, ctas_per_sm=2, flops=0)
    return pm.Launch(**{**base, **kw})


def test_chain_bound_launch_by_hand():
    # P = 5, R = min(2, ceil(5/2)) = 2, W = ceil(5 / (2 * 2)) = 2, c = max(2, ceil(2 * 4 / 4)) = 2,
    # I = 10 * 100 + 50 = 1050: chain = 2 * 1050 * 2 / 1e9 = 4.2 us > hbm = 2 us
    row = pm.launch_time(_launch(), TOY)
    assert (row["programs"], row["waves"], row["interval"], row["instr_per_warp"]) == (5, 2, 2, 1050)
    assert row["t_chain"] == pytest.approx(4.2e-6, rel=1e-12)
    assert row["t_hbm"] == pytest.approx(2e-6, rel=1e-12)
    assert row["bound"] == "chain" and row["time"] == pytest.approx(5.2e-6, rel=1e-12)


def test_shared_schedulers_and_waves_by_hand():
    # 8 warps, 2 resident: 16 warps on 4 schedulers, c = max(2, 4) = 4; P = 3: R = min(2, 2) = 2, W = 1
    row = pm.launch_time(_launch(grid=(3,), num_warps=8), TOY)
    assert (row["waves"], row["interval"]) == (1, 4)
    assert row["t_chain"] == pytest.approx(1050 * 4 / 1e9, rel=1e-12)
    # one program per SM: R = 1, 4 warps = one per scheduler, c = cpi = 2; P = 9 on 2 SMs x 1: W = 5
    row = pm.launch_time(_launch(grid=(9,), ctas_per_sm=1), TOY)
    assert (row["waves"], row["interval"]) == (5, 2)
    assert row["t_chain"] == pytest.approx(5 * 1050 * 2 / 1e9, rel=1e-12)


def test_memory_and_mma_bound_launches_and_torch_ops():
    row = pm.launch_time(_launch(bytes_hbm=10**5), TOY)          # 100 us of HBM
    assert row["bound"] == "hbm" and row["time"] == pytest.approx(101e-6, rel=1e-12)
    row = pm.launch_time(_launch(flops=10**8), TOY)              # 100 us at 1 TFLOP/s
    assert row["bound"] == "mma" and row["time"] == pytest.approx(101e-6, rel=1e-12)
    op = pm.Launch("torch:aten.mul", (), 0, 3000, 3000, 0, 0, 0, 1)
    row = pm.launch_time(op, TOY)
    assert op.programs == 0 and row["t_chain"] == 0 and row["time"] == pytest.approx(4e-6, rel=1e-12)
    rows = pm.predict([_launch(), op], TOY)
    assert pm.total_time(rows) == pytest.approx(5.2e-6 + 4e-6, rel=1e-12)
    with pytest.raises(ValueError, match="does not fit"):
        pm.launch_time(_launch(ctas_per_sm=0), TOY)


def test_roofline_is_io_bytes_over_bandwidth():
    roof = pm.roofline(4, 16, 16384, 128, 2, pm.GPUS["H100 SXM"])
    assert roof["forward"] == io_bytes(4, 16, 16384, 128, 128, 2) / 3.35e12
    assert roof["total"] == pytest.approx(3 * roof["forward"], rel=1e-12)  # bwd moves 8 tensors, fwd 4
    # unnormalised the backward needs no o (7 tensors); a per-token log-decay adds g (fp32) and dg
    gated = pm.roofline(4, 16, 16384, 128, 2, pm.GPUS["H100 SXM"], normalize=False, decay="token")
    tensor, g = 4 * 16 * 16384 * 128 * 2, 4 * 16 * 16384 * 4
    assert gated["forward"] * 3.35e12 == pytest.approx(4 * tensor + g, rel=1e-12)
    assert gated["backward"] * 3.35e12 == pytest.approx(7 * tensor + 2 * g, rel=1e-12)


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_traffic_counts_rereads_once_when_their_programs_run_together():
    k, v, h = _meta(1, 16, 256, 32), _meta(1, 16, 256, 32), _meta(1, 16, 4, 32, 32, dtype=torch.float32)
    # chunk_state_kernel: k re-read along grid axis 1, v along axis 0; h passed again as a stand-in
    call = pm.Call("chunk_state_kernel", (4, 4, 16), {"k_ptr": k, "v_ptr": v, "g_ptr": h, "h_ptr": h})
    size = 16 * 256 * 32 * 2
    requested = 4 * size + 4 * size + h.numel() * 4
    # k's sharers spread over 1 + 3 * 4 = 13 programs in launch order, v's over 4
    assert pm.traffic(call, 13) == (2 * size + h.numel() * 4, requested)
    assert pm.traffic(call, 12) == (4 * size + size + h.numel() * 4, requested)
    assert pm.traffic(call, 3) == (requested, requested)
    op = pm.Call("torch:aten.mul", (), {"in": [k, k, v], "out": [h]})
    assert pm.traffic(op, 1) == (2 * size + h.numel() * 4,) * 2


_LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0020*/               @P0 BRA 0x60 ;
        /*0030*/                   HGMMA.64x32x16.F32.BF16 gdesc[UR4], R24, gsb0 ;
        /*0040*/                   NOP ;
        /*0050*/              @!P1 BRA 0x30 ;
        /*0060*/                   EXIT ;
        /*0070*/                   BRA 0x70;
"""


def test_parse_sass_finds_the_loop_by_its_backward_branch():
    total, body, flops_body, flops_rest = pm.parse_sass(_LISTING)
    assert (total, body) == (7, 2)            # NOPs left out; the loop is 0x30..0x50; BRA 0x70 is no loop
    assert flops_body == 2 * 64 * 32 * 16 // 4 and flops_rest == 2 * 16 * 8 * 16
    assert pm.parse_sass(_LISTING.replace("BRA 0x30", "BRA 0x60"))[1] == 0


def test_recording_records_without_running_and_puts_launchable_back():
    configs = __import__("sys").modules["linattn_lib.kernels.configs"]
    original = configs.launchable
    with pm.recording() as calls:
        assert K.chunk_state.launchable is not original
        K.chunk_states(_meta(1, 2, 64, 32), _meta(1, 2, 64, 32))
    assert K.chunk_state.launchable is original and configs.launchable is original
    assert [c.kernel for c in calls] == ["chunk_state_kernel"]


def _kernels(calls):
    return [c.kernel for c in calls if not c.kernel.startswith("torch:")]


def _ops(calls):
    return [c.kernel for c in calls if c.kernel.startswith("torch:")]


@pytest.mark.parametrize("target", ["sm_90", "sm_80"])
def test_census_of_the_forward_has_the_launchers_grids(target):
    """The launches a GPU of `target` would make: select_config's configs for that target (the
    census runs on meta tensors, which have no GPU generation of their own)."""
    B, H, T, D = 1, 2, 256, 64
    cen = pm.census(B, H, T, D, target=target)
    state = K.select_config("chunk_state", D, torch.bfloat16, K.TARGETS[target])
    out = K.select_config("chunk_output", D, torch.bfloat16, K.TARGETS[target])
    cdiv = lambda a, b: -(-a // b)
    assert [(c.kernel, c.grid) for c in cen["forward"]] == [
        ("chunk_state_kernel", (cdiv(D, state["BK"]), cdiv(D, state["BV"]) + 1, B * H)),  # + 1: z's programs
        ("chunk_output_kernel", (cdiv(D, out["BV"]), cdiv(T, out["BT"]), B * H))]
    assert [c.num_warps for c in cen["forward"]] == [state["num_warps"], out["num_warps"]]
    assert cen["forward"][0].args["BT"] == state["BT"] and cen["forward"][0].args["T"] == T
    dqk = next(c for c in cen["backward"] if c.kernel == "chunk_dqk_kernel")
    assert dqk.grid[0] == cdiv(D, K.select_config("chunk_dqk", D, torch.bfloat16, K.TARGETS[target])["BK"])
    # the patch is undone: off CUDA select_config is back to the sm_80+ choice
    assert K.select_config("chunk_output", D, torch.bfloat16, torch.device("meta")) == \
        K.select_config("chunk_output", D, torch.bfloat16, K.TARGETS["sm_80"])


@pytest.mark.parametrize("normalize,decay", [(True, None), (True, "head"), (False, "token")])
def test_census_of_each_compared_op(normalize, decay):
    B, H, T, D = 2, 2, 256, 64
    cen = pm.census(B, H, T, D, normalize=normalize, decay=decay)
    state = next(c for c in cen["forward"] if c.kernel == "chunk_state_kernel")
    assert state.args["DECAY"] == pm.DECAYS.index(decay) and state.args["HAS_Z"] == normalize
    # a decay's exps are taken for all chunks at once (chunk_decay_kernel) before the forward,
    # and once for both walks of the backward
    decays = [c for part in cen.values() for c in part if c.kernel == "chunk_decay_kernel"]
    assert [c.kernel for c in cen["backward"]].count("chunk_decay_kernel") == (decay is not None)
    assert len(decays) == (0 if decay is None else 2) and cen["forward"][-2] is state
    if decay is not None:  # the output kernel's prefix sums are made with the walk's decays
        assert decays[0].args["PREFIX"] == (decay == "token") and decays[1].args["KA"] and decays[1].args["KR"]
    if decay is not None:
        assert decays[0].args["g_ptr"].shape == ((H,) if decay == "head" else (B, H, T))
        assert state.args["ka_ptr"].shape == (B * H * -(-T // state.args["BT"]) * state.args["BT"],)
    # the per-token decay's gradient is a kernel's suffix sums; a per-head decay is fixed (no gradient),
    # and the only torch op left is the zeroed lengths of the dead tail (unnormalised: found from dO)
    assert [c.kernel for c in cen["backward"]].count("decay_grad_kernel") == (decay == "token")
    assert len(_ops(cen["backward"])) <= 1
    # every kernel the model meets has its re-read rule (an empty one says: none)
    kernels = {c.kernel for part in cen.values() for c in part if c.fn is not None}
    assert kernels <= set(pm.REREAD), kernels - set(pm.REREAD)
    with pytest.raises(ValueError, match="decay"):
        pm.census(B, H, T, D, decay="channel")


def _first(D):
    return {name: options[0] for name, options in pf.fla_candidates(D).items()}


def test_fla_linear_attn_replays_its_kernels_and_normaliser():
    B, H, T, D = 2, 3, 200, 128
    cfg = {**_first(D), "chunk_fwd_kernel_h": {"BK": 32, "BV": 64, "num_warps": 4, "num_stages": 2},
           "chunk_bwd_kernel_dh": {"BK": 64, "BV": 32, "num_warps": 4, "num_stages": 2}}
    calls = pm.replay_calls(B, H, T, D, (True, None), cfg, {})
    NT = 4  # ceil(200 / 64)
    fwd, bwd = calls["forward"], calls["backward"]
    assert [(c.kernel, c.grid) for c in fwd if c.fn is None and c.grid] == [
        ("chunk_fwd_kernel_h", (4, 2, 6)), ("chunk_fwd_kernel_o", (1, NT, 6))]
    assert [(c.kernel, c.grid) for c in bwd if c.grid] == [
        ("chunk_fwd_kernel_h", (4, 2, 6)), ("chunk_bwd_kernel_dh", (2, 4, 6)),
        ("chunk_bwd_kernel_dqkwg", (1, NT, 6)), ("chunk_bwd_kernel_dv", (1, NT, 6))]
    h_fwd, h_bwd = (next(c for c in part if c.kernel == "chunk_fwd_kernel_h") for part in (fwd, bwd))
    assert h_fwd.args["h"].dtype == torch.bfloat16 and h_bwd.args["h"].dtype == torch.float32
    assert h_fwd.args["USE_G"] is False and h_fwd.args["g"] is None and h_fwd.num_warps == 4
    assert next(c for c in bwd if c.kernel == "chunk_bwd_kernel_dh").args["dh"].shape == (B, NT, H, D, D)
    # the normaliser in torch; without fla's source its cumsum is an eager copy of the same bytes
    assert _ops(fwd) == ["torch:aten._to_copy", "torch:aten.mul", "torch:aten.mul", "torch:aten.sum",
                         "torch:aten.add", "torch:aten.div", "torch:aten.clone"]  # B > 1: k_cum[:, -1:] copied
    assert _ops(bwd)[:3] == ["torch:aten.zeros_like", "torch:aten.div", "torch:aten.mul"]
    assert _ops(bwd)[-2:] == ["torch:aten.add", "torch:aten.add"]  # autograd's sums of dq and dk
    big = B * T * H * D * 2
    gpu = pm.GPUS["H100 SXM"]
    ops = [pm.launch_of(c, gpu) for c in fwd if c.kernel.startswith("torch:")]
    assert [x.bytes_hbm for x in ops[:2]] == [2 * big, 2 * big] and ops[2].bytes_hbm == 3 * big  # q*s, *k_cum


def test_fla_simple_gla_replays_the_gated_kernels():
    B, H, T, D = 1, 2, 128, 64
    calls = pm.replay_calls(B, H, T, D, (False, "token"), _first(D), {})
    fwd, bwd = calls["forward"], calls["backward"]
    assert _kernels(fwd) == ["chunk_fwd_kernel_h", "chunk_fwd_kernel_o"]
    assert _kernels(bwd) == ["chunk_fwd_kernel_h", "chunk_bwd_kernel_dh", "chunk_bwd_kernel_dqkwg",
                             "chunk_bwd_kernel_dv"]
    for c in fwd + bwd:
        if c.grid:
            assert c.args["USE_G"] is True and c.args["g"].shape == (B, T, H) and c.args["g"].dtype == torch.float32
    dqkwg = next(c for c in bwd if c.kernel == "chunk_bwd_kernel_dqkwg")
    assert dqkwg.args["dg"].shape == (1, B, T, H) and dqkwg.args["BK"] == dqkwg.args["BV"] == 64
    # the local cumsums of g and dg (eager copies without the source) and dg.sum(0)
    assert _ops(fwd) == ["torch:aten._to_copy"] and _ops(bwd) == ["torch:aten.sum", "torch:aten._to_copy"]
    with pytest.raises(ValueError, match="no chunk op"):
        pm.replay_calls(B, H, T, D, (True, "token"), _first(D), {})


def test_replay_launches_the_cumsum_kernels_it_has():
    B, H, T, D = 1, 2, 128, 64
    fake = {"chunk_global_cumsum_vector_kernel": "fn", "chunk_local_cumsum_scalar_kernel": "fn"}
    lin = pm.replay_calls(B, H, T, D, (True, None), _first(D), fake)
    cum = [c for part in lin.values() for c in part if c.kernel == "chunk_global_cumsum_vector_kernel"]
    assert [(c.grid, c.args["REVERSE"], c.args["o"].dtype, c.fn) for c in cum] == [
        ((2, 2), False, torch.bfloat16, "fn"), ((2, 2), True, torch.bfloat16, "fn")]  # BS = 32: 2 blocks of D
    assert cum[0].args["BT"] == _first(D)["chunk_global_cumsum_vector_kernel"]["BT"]
    gla = pm.replay_calls(B, H, T, D, (False, "token"), _first(D), fake)
    loc = [c for part in gla.values() for c in part if c.kernel == "chunk_local_cumsum_scalar_kernel"]
    assert [(c.grid, c.args["HAS_SCALE"], c.args["REVERSE"]) for c in loc] == [((2, 2), True, False),
                                                                               ((2, 2), False, True)]
    assert loc[0].args["scale"] == pf.RCP_LN2 and loc[0].args["o"].dtype == torch.float32


_FAKE_KERNEL = '''import triton

@triton.autotune(configs=[], key=["T"])
@triton.jit(do_not_specialize=["T"])
def {name}(x, T, BT: tl.constexpr):
    pass


def launcher():
    return 1
'''


def test_fla_kernels_are_cut_out_of_its_source(tmp_path):
    assert pf.fla_source(str(tmp_path)) is None or os.environ.get("LINATTN_FLA_SOURCE")
    for path, names in pf.FLA_FILES.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("".join(_FAKE_KERNEL.format(name=n) for n in names))
    assert set(pf.fla_source(str(tmp_path))) == set(pf.FLA_FILES)
    kernels = pf.fla_kernels(str(tmp_path))
    assert set(kernels) == {n for names in pf.FLA_FILES.values() for n in names}
    import triton

    fn = kernels["chunk_fwd_kernel_h"]  # the autotune decorator is gone, the JIT's do_not_specialize kept
    assert isinstance(fn, triton.runtime.jit.JITFunction) and [p.name for p in fn.params] == ["x", "T", "BT"]
    assert fn.params[1].do_not_specialize


def _stub(call, target):
    return pm.SassStats(registers=64, shared_bytes=16384, total=300, body=100, flops_body=4096)


def test_tuned_launches_pick_the_models_fastest_config():
    gpu = pm.GPUS["H100 SXM"]
    slow = {"BK": 32, "BV": 32, "num_warps": 8, "num_stages": 2}
    fast = {"BK": 32, "BV": 32, "num_warps": 4, "num_stages": 2}
    cands = {**{n: [o[0]] for n, o in pf.fla_candidates(64).items()}, "chunk_fwd_kernel_h": [slow, fast]}
    make = lambda cfg: pm.replay_calls(1, 2, 256, 64, (False, "token"), cfg, {})
    stats = lambda call, target: dataclasses.replace(  # 8 warps: twice the loop body, slower
        _stub(call, target), body=25 * call.num_warps, total=200 + 25 * call.num_warps)
    launches, configs = pm.tuned_launches(make, cands, gpu, stats)
    assert configs["chunk_fwd_kernel_h"] == fast
    assert "chunk_global_cumsum_vector_kernel" not in configs  # not launched by this op
    assert [x.kernel for x in launches["forward"]][-2:] == ["chunk_fwd_kernel_h", "chunk_fwd_kernel_o"]


def test_compare_runs_on_the_kernels_with_stub_instructions(monkeypatch):
    r = pm.compare(1, 256, 2, 64, "H200 SXM", stats=_stub)
    assert list(r["times"]) == [row.label for row in pm.ROWS]
    for label, t in r["times"].items():
        assert set(t) == {"forward", "backward", "total"}
        assert 0 < t["forward"] < t["total"]
        assert t["total"] == pytest.approx(t["forward"] + t["backward"], rel=1e-12)
        assert (r["x_roof"][label] > 1) == ("roofline" not in label), label
    assert [row["kernel"] for row in r["tables"]["ours, normalised, no decay"]["forward"]] == [
        "chunk_state_kernel", "chunk_output_kernel"]
    assert set(r["fla_configs"]) == set(pf.VARIANTS)
    # the report fits 80 columns
    monkeypatch.setattr(pm, "compare", lambda *a, **k: r)
    lines = pm.report(1, 256, 2, 64, "H200 SXM", detail=True)
    assert max(map(len, lines)) <= 80 and any("state" in line for line in lines)
    assert sum(label in " ".join(lines) for label in r["times"]) == len(pm.ROWS)


def test_split_gain_splits_small_grids_only():
    """At B = 1, H = 2 the state pass's 40 programs leave most of 132 SMs idle: the launcher
    splits it into runs (forward and backward), the chain of each program shortens by that
    factor and the predicted time falls; at H = 16 (320 programs) nothing is split."""
    from linattn_lib.experiments.perf_predictions import split_gain

    small = split_gain(1, 16384, 2, 128, "H100 SXM", stats=_stub)
    assert small["runs"] == 7
    assert small["split"]["forward"] < 0.6 * small["one walk"]["forward"]
    assert small["split"]["total"] < small["one walk"]["total"]
    cen = pm.census(1, 2, 16384, 128, sms=132)
    states = [c for part in cen.values() for c in part if c.kernel == "chunk_state_kernel"]
    assert len(states) == 3 and all(c.grid[2] == 2 * 7 and c.args["NS"] == 256 // 7 + 1 for c in states)
    merge = next(c for c in cen["forward"] if c.kernel == "chunk_state_merge_kernel")
    assert merge.grid == states[0].grid  # a program per run and tile
    assert [c.kernel for c in cen["forward"]] == ["chunk_state_kernel", "chunk_state_merge_kernel",
                                                 "chunk_output_kernel"]
    big = split_gain(1, 16384, 16, 128, "H100 SXM", stats=_stub)
    assert big["runs"] == 1 and big["split"] == big["one walk"]


@needs_compiler
def test_compare_compiles_the_kernels(monkeypatch):
    """Real instruction counts: ours from the launchers' variants, fla's from its source (when
    $LINATTN_FLA_SOURCE points at it) or by analogy; one candidate config per fla kernel."""
    monkeypatch.setattr(pf, "fla_candidates", lambda D: {
        "chunk_fwd_kernel_h": [{"BK": 32, "BV": 32, "num_warps": 4, "num_stages": 2}],
        "chunk_bwd_kernel_dh": [{"BK": 32, "BV": 32, "num_warps": 4, "num_stages": 2}],
        "chunk_fwd_kernel_o": [{"BK": 64, "BV": 64, "num_warps": 4, "num_stages": 3}],
        "chunk_bwd_kernel_dqkwg": [{"num_warps": 4, "num_stages": 2}],
        "chunk_bwd_kernel_dv": [{"num_warps": 4, "num_stages": 2}],
        "chunk_global_cumsum_vector_kernel": [{"BT": 64, "num_warps": 4, "num_stages": 2}]})
    B, H, T, D = 1, 2, 256, 64
    ours, fla = "ours, normalised, no decay", "fla chunk_linear_attn(normalize=True)"
    r = pm.compare(B, T, H, D, "H100 SXM", only=(ours, fla))
    assert set(r["tables"]) == {ours, fla}
    state, output = r["tables"][ours]["forward"]
    cfg = K.select_config("chunk_state", D, torch.bfloat16, (9, 0))
    assert state["steps"] == T // cfg["BT"] and state["instr_per_step"] > 20     # the loop over chunks
    assert output["steps"] == -(-D // K.select_config("chunk_output", D, torch.bfloat16, (9, 0))["BK"])
    rows = [row for part in r["tables"].values() for rows in part.values() for row in rows if row["programs"]]
    assert all(row["ctas_per_sm"] >= 1 for row in rows)
    # a kernel with a loop needs its STEPS rule (without one its loop would be counted once)
    assert {row["kernel"] for row in rows if row["instr_per_step"]} <= set(pm.STEPS)
    assert r["x_roof"][ours] > 1 and r["x_roof"][fla] > 1
    fla_h = r["tables"][fla]["forward"][0]
    assert fla_h["kernel"] == "chunk_fwd_kernel_h" and fla_h["steps"] == T // 64 and fla_h["instr_per_step"] > 20
    text = " ".join(pm.assumptions(pm.GPUS["H100 SXM"]))
    assert "3.35 TB/s" in text and ("compiled from its source" in text or "BY ANALOGY" in text)


@needs_compiler
@pytest.mark.parametrize("normalize,decay", [(True, None), (True, "head"), (False, "token"), (False, None),
                                             (False, "head")])
def test_the_benchmarked_variants_fit_two_ctas_per_sm(normalize, decay):
    """The compile gates (tests/test_kernels_compile.py) build each parallel kernel's heaviest
    variant; the benchmark shape runs lighter ones (16-bit state gradients without a decay
    gradient, no decay, ...), which may allocate registers differently: each of those fits
    two CTAs per SM on sm_90 too (bf16, B = 1, H = 16, T = 16384, D = 128). Unnormalised without
    a decay, chunk_dqk came to 130-131 registers (one CTA) until its config capped them at 128
    (configs.MAXNREG; with the cap it compiles without a spill, the same instruction count)."""
    parallel = ("chunk_output_kernel", "chunk_dqk_kernel", "chunk_dv_kernel", "chunk_bwd_prep_kernel")
    cen = pm.census(1, 16, 16384, 128, normalize=normalize, decay=decay, target="sm_90", sms=132)
    calls = [c for part in cen.values() for c in part if c.kernel in parallel]
    assert {c.kernel for c in calls} >= set(parallel[1:3])
    for call in calls:
        s = pm.sass_stats_of(call, "sm_90")
        fit = ka.ctas_per_sm(s.registers, call.num_warps, s.shared_bytes, "sm_90")
        assert fit.ctas >= 2, (call.kernel, s.registers, s.shared_bytes)


@needs_compiler
@pytest.mark.parametrize("normalize,decay,plain", [(False, None, (True, True, True)), (True, None, (True, True, False)),
                                                   (False, "token", (False, False, False))])
def test_plain_walks_copy_both_operands_ahead(normalize, decay, plain):
    """A state walk without a decay or key scales reads its keys transposed, so that no load of its
    loop goes through registers (no plain LDG: the keys, loaded token-major and transposed, went
    through registers one chunk ahead, and the H200 timed every walk at 1.2-1.5 us a chunk whatever
    its depth), and runs at configs.PLAIN_WALK_STAGES deep; a decayed walk keeps its registers and
    the config's depth (sm_90, bf16, B = 2, H = 16, T = 16384, D = 128: forward walk, rerun, dH walk)."""
    from linattn_lib.chapters import sass

    cen = pm.census(2, 16, 16384, 128, normalize=normalize, decay=decay, target="sm_90", sms=132)
    walks = [c for part in ("forward", "backward") for c in cen[part] if c.kernel == "chunk_state_kernel"]
    assert len(walks) == 3
    for call, is_plain in zip(walks, plain):
        ops = sass.loop_opcodes(sass.sass_listing(call, "sm_90"))
        assert ("LDG" not in ops) == is_plain and "LDGSTS" in ops, (call.args["DECAY"], ops.count("LDG"))
        assert call.num_stages == (K.configs.PLAIN_WALK_STAGES["sm90"] if is_plain else 2)


@needs_compiler
def test_decayed_walks_can_read_their_keys_transposed():
    """The whole-op sweep's candidate for the walks (configs.walk_keys_t): a decayed walk that reads
    its keys transposed copies them ahead with its values, 3 stages deep (the loop's one plain
    load left: the next chunk's decay, a scalar), and pays for it by decaying them in the
    product's operand layout, once per warp: sm_90, bf16, per-token decay, Triton 3.7.1, 235 SASS
    instructions in the loop against 129."""
    from linattn_lib.chapters import sass

    def forward_walk():
        cen = pm.census(2, 16, 16384, 128, normalize=False, decay="token", target="sm_90", sms=132)
        return next(c for c in cen["forward"] if c.kernel == "chunk_state_kernel")

    before = forward_walk()
    with K.overridden({"chunk_state": {"decayed_keys_t": True}}):
        after = forward_walk()
    ops_b, ops_a = (sass.loop_opcodes(sass.sass_listing(c, "sm_90")) for c in (before, after))
    assert (ops_b.count("LDG"), ops_a.count("LDG")) == (2, 1)
    assert ops_a.count("LDGSTS") == ops_b.count("LDGSTS") + 1
    assert (before.num_stages, after.num_stages) == (2, 3) and 1.5 < len(ops_a) / len(ops_b) < 2


@needs_compiler
def test_backward_kernels_read_a_per_token_decay_from_tables():
    """chunk_dqk and chunk_dv take a per-token decay from chunk_decays' tables (prefix sums, exp(a),
    exp(gc)) instead of scanning the chunk's log-decays, so it costs them about what a decay per
    head does (whose decays are arithmetic, no scan). sm_90, bf16, B = 2, H = 16, T = 16384,
    D = 128, Triton 3.7.1: dv 1128 SASS instructions (scanned: 1317; per head 1098), no shuffles
    (25); dqk, which also sums q . dq - k . dk for dG, 1165 (1333; per head 915)."""
    from linattn_lib.chapters import sass

    def backward(decay):
        cen = pm.census(2, 16, 16384, 128, normalize=False, decay=decay, target="sm_90", sms=132)
        return {c.kernel: c for c in cen["backward"] if c.kernel in ("chunk_dqk_kernel", "chunk_dv_kernel")}

    head, token = backward("head"), backward("token")
    for name, bound in (("chunk_dv_kernel", 1.1), ("chunk_dqk_kernel", 1.35)):
        call = token[name]
        assert {"hi_ptr", "lo_ptr", "ka_ptr", "kr_ptr"} <= set(call.args), name
        ratio = sass.sass_stats_of(call).total / sass.sass_stats_of(head[name]).total
        assert ratio < bound, (name, ratio)
    assert "SHFL" not in sass.sass_listing(token["chunk_dv_kernel"], "sm_90")


@needs_compiler
@pytest.mark.parametrize("normalize,decay", [(False, "token"), (True, None)], ids=["per-token", "normalised"])
def test_one_backward_kernel_fits_two_ctas_and_moves_less(normalize, decay):
    """The GPU check's candidate "dq, dk, dv in one kernel" as sm_90 compiles it (bf16, B = 2,
    H = 16, T = 16384, D = 128): at most the cap's 128 registers (2 CTAs per SM, as the two kernels
    run), no spills, within 10% of the warp instructions of chunk_dqk's programs and chunk_dv's
    together (counted loop by loop, `LOOP_TRIPS`: dO v^T and the decays are formed once a chunk,
    each block's addresses in its block; Triton 3.7.1: per-token 6.2% fewer, normalised 5.3% more),
    and 0.6 GB less HBM traffic or more (q, k, dO and the state gradients read once: 0.67 GB
    normalised, 0.95 per-token, whose state gradients are fp32)."""
    from linattn_lib.chapters import sass

    gpu = pm.GPUS["H200 SXM"]

    def backward(changes):
        with K.overridden(changes):
            cen = pm.census(2, 16, 16384, 128, normalize=normalize, decay=decay, target="sm_90", sms=132)
        return {c.kernel: c for c in cen["backward"]}

    apart, fused = backward({}), backward({"chunk_dqk": {"fused_dqkv": True}})["chunk_dqkv_kernel"]
    listing = sass.sass_listing(fused, "sm_90")
    assert "STL" not in listing and "LDL" not in listing
    one = pm.launch_of(fused, gpu)
    two = [pm.launch_of(apart[name], gpu) for name in ("chunk_dqk_kernel", "chunk_dv_kernel")]
    assert one.ctas_per_sm == 2 and sass.sass_stats_of(fused).registers <= 128
    warp_instructions = lambda launch: launch.programs * launch.num_warps * launch.instr_per_warp
    assert warp_instructions(one) < 1.1 * sum(map(warp_instructions, two))
    assert sum(x.bytes_hbm for x in two) - one.bytes_hbm > 0.6e9


def test_weighted_counts_multiply_the_trips_of_nested_loops():
    """sass.weighted_counts: an instruction counts once per trip of every loop around it (a nested
    loop's trips are per trip of the loop outside), and the trips must name every loop."""
    from linattn_lib.chapters import sass

    lines = ["MOV R0, R1", "IADD R2, R2, 1", "IADD R3, R3, 1", "BRA 0x20", "FADD R4, R4, R4",
             "BRA 0x10", "IADD R5, R5, 1", "BRA 0x60", "EXIT", "BRA 0x90"]  # the last: the end's trap
    listing = "\n".join(f"        /*{16 * i:04x}*/                   {op} ;" for i, op in enumerate(lines))
    assert sass.loop_spans(listing) == [(0x10, 0x50), (0x20, 0x30), (0x60, 0x70)]
    # 1 + 2 (outer) + 2 x 3 x 2 (inner) + 2 x 2 (outer) + 2 x 4 (last) + 2
    assert sass.weighted_counts(listing, [2, 3, 4]) == (1 + 2 + 12 + 4 + 8 + 2, 0)
    with pytest.raises(ValueError):
        sass.weighted_counts(listing, [2, 3])
