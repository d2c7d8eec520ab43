"""linattn_lib.chapters.kernel_anatomy: the traffic model against the interpreter, the source map, the compile report."""
from __future__ import annotations

import math

import pytest
import torch

from linattn_lib.chapters import kernel_anatomy as ka


def test_cost_arithmetic_and_rooflines():
    c = ka.Cost(flops=300.0, bytes=100.0)
    assert c.intensity == 3.0
    assert (c / 10).flops == 30.0 and (c / 10).bytes == 10.0
    assert ka.ridge_point("H100 SXM") == pytest.approx(989.4e12 / 3.35e12)
    # memory-bound: the time is bytes / bandwidth; compute-bound: FLOPs / peak
    assert ka.roofline_time(ka.Cost(1e9, 1e9), "A100 SXM 80GB") == pytest.approx(1e9 / 2.039e12)
    assert ka.roofline_time(ka.Cost(1e15, 1e9), "A100 SXM 80GB") == pytest.approx(1e15 / 312e12)


def test_closed_forms_by_hand():
    cfg = {"BT": 64, "BK": 128, "BV": 64}
    c = ka.chunk_fwd_traffic(128, 128, 128, cfg, 2)
    # two value tiles, each reads q and k (128 x 128 x 2 B each); v read and o written once; den fp32
    assert c.bytes == 2 * 2 * 128 * 128 * 2 + 2 * 128 * 128 * 2 + 128 * 4
    # per chunk and tile: 2*64*64*128 + 2*64*64*64 + 4*64*128*64; 2 chunks x 2 tiles
    assert c.flops == 4 * (2 * 64 * 64 * 128 + 2 * 64 * 64 * 64 + 4 * 64 * 128 * 64)
    assert ka.chunk_fwd_traffic(128, 128, 128, cfg, 2, decay="head").bytes == c.bytes + 2 * 2 * 4
    assert ka.chunk_fwd_traffic(128, 128, 128, cfg, 2, decay="token").bytes == c.bytes + 2 * 128 * 4
    with pytest.raises(ValueError):
        ka.chunk_fwd_traffic(128, 128, 128, cfg, 2, decay="bogus")
    fa = ka.flash_attention_cost(1024, 64, 2, block_q=None)
    assert fa.flops == 2 * 1024 * 1024 * 64 and fa.bytes == 4 * 1024 * 64 * 2
    # 8 query blocks of 128: block i reads the k, v rows of blocks 0..i, 128 * 36 rows each
    fa = ka.flash_attention_cost(1024, 64, 2)
    assert fa.bytes == (2 * 1024 * 64 + 2 * 128 * 36 * 64) * 2
    assert ka.flash_attention_cost(1024, 64, 2, causal=False).bytes == (2 * 1024 + 2 * 8 * 1024) * 64 * 2
    # the figure: ~32 KiB per token at T = 16384, d = 128, bf16
    assert 32 * 1024 <= ka.flash_attention_cost(16384, 128, 2).bytes / 16384 <= 33 * 1024
    assert ka.decode_step_cost(64, 64, 2).intensity < 1          # the state dominates the bytes
    assert ka.token_loop_cost(10, 64, 64, 2).bytes == 10 * ka.decode_step_cost(64, 64, 2).bytes


triton = pytest.importorskip("triton")
from linattn_lib.core.triton_ops import load_kernels  # noqa: E402

K = load_kernels()
needs_kernels = pytest.mark.skipif(K is None, reason="the Triton kernels do not import here")


@needs_kernels
@pytest.mark.parametrize("B,H,T,Dk,Dv,dtype,decay", [
    (1, 2, 128, 64, 64, torch.float32, None),
    (1, 1, 200, 48, 100, torch.float16, "token"),   # partial last chunk, padded Dk, two value tiles
    (2, 1, 96, 64, 128, torch.float32, "head"),
])
def test_interpreter_traffic_matches_the_model(B, H, T, Dk, Dv, dtype, decay):
    torch.manual_seed(0)
    q, k = torch.rand(B, H, T, Dk, dtype=dtype), torch.rand(B, H, T, Dk, dtype=dtype)
    v = torch.randn(B, H, T, Dv, dtype=dtype)
    g = None if decay is None else (-torch.rand(H) if decay == "head" else -torch.rand(B, H, T))
    with ka.count_interpreter_traffic() as traffic:
        K.chunk_fwd(q, k, v, log_decay=g)
    cfg = K.select_config("chunk_fwd", Dk, dtype, None)
    model = ka.chunk_fwd_traffic(T, Dk, Dv, cfg, q.element_size(), decay=decay)
    assert traffic.bytes == B * H * model.bytes
    assert traffic.dot_flops == B * H * model.flops
    assert traffic.stores == B * H * math.ceil(Dv / cfg["BV"]) * math.ceil(T / cfg["BT"]) * 2  # o and den, per chunk and tile


@needs_kernels
def test_counting_is_undone_afterwards():
    from triton.runtime.interpreter import InterpreterBuilder

    before = InterpreterBuilder.create_masked_load
    with ka.count_interpreter_traffic():
        assert InterpreterBuilder.create_masked_load is not before
    assert InterpreterBuilder.create_masked_load is before


@needs_kernels
def test_memory_map_of_the_forward_kernel():
    mm = ka.memory_map(K.chunk_fwd_kernel)
    assert mm.loop_carried == ["S", "z"]                      # the state stays on chip
    assert {"q_ptr", "k_ptr", "v_ptr"} <= set(mm.loads_in_loop)
    assert set(mm.stores_in_loop) == {"o_ptr", "den_ptr"}    # only outputs are written per chunk
    assert set(mm.stores_outside) == {"st_ptr", "zt_ptr"}    # the final state, once
    assert set(mm.loads_outside) == {"s0_ptr", "z0_ptr"}


@needs_kernels
def test_compile_report_for_a100():
    rep = ka.compile_report("chunk_fwd", "sm_80", "bf16", 128)
    assert rep["config"] == K.select_config("chunk_fwd", 128, torch.bfloat16, (8, 0))
    assert 0 < rep["shared_bytes"] <= rep["smem_limit"]
    assert rep["ptx_lines"] > 100 and rep["cubin_bytes"] > 0
    if rep["sass_instructions"] is not None:  # cuobjdump ships with Triton's NVIDIA backend
        assert rep["mma_instructions"] > 0 and rep["registers"] <= 255


@pytest.mark.parametrize("B,H,T,dk,dv,decay,normalize", [
    (1, 2, 200, 48, 100, "token", True), (1, 1, 70, 16, 16, None, False), (2, 1, 64, 32, 20, "head", True)])
def test_two_phase_traffic_model_matches_the_interpreter(B, H, T, dk, dv, decay, normalize):
    """`two_phase_forward_traffic` counts, on paper, exactly the bytes and FLOPs the two
    forward kernels move and compute in the interpreter (masked elements excluded)."""
    from linattn_lib.flops import two_phase_forward_traffic

    gen = torch.Generator().manual_seed(0)
    q, k = (torch.rand(B, H, T, dk, generator=gen) for _ in range(2))
    v = torch.randn(B, H, T, dv, generator=gen)
    g = {None: None, "token": -torch.rand(B, H, T, generator=gen), "head": -torch.rand(H, generator=gen)}[decay]
    cs, co = (K.select_config(n, dk, torch.float32, None) for n in ("chunk_state", "chunk_output"))
    with ka.count_interpreter_traffic() as t_decay:  # as chunk_fwd_two_phase launches them
        decays = None if g is None else K.chunk_decays(g, B, H, T, cs["BT"], prefix=True)
    with ka.count_interpreter_traffic() as t_state:
        h, hz, _, _ = K.chunk_states(k, v, log_decay=g, track_z=normalize, decays=decays)
    with ka.count_interpreter_traffic() as t_out:
        K.chunk_output(q, k, v, h, hz, log_decay=g, normalize=normalize, decays=decays)
    model = two_phase_forward_traffic(T, dk, dv, cs, co, 4, normalize=normalize, decay=decay)
    for t, name in ((t_decay, "chunk_decay"), (t_state, "chunk_state"), (t_out, "chunk_output")):
        assert t.bytes == B * H * model[name].bytes, name
        assert t.dot_flops == B * H * model[name].flops, name
