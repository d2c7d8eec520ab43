"""The chapter 1 cost model: closed forms, the published figures it reproduces, input checks."""
import math

import pytest
import torch

from linattn_lib.chapters import costs
from linattn_lib.chapters.costs import (
    MODELS,
    attention_core_flops,
    cost_table,
    describe_costs,
    ffn_flops,
    flop_crossover_length,
    format_bytes,
    layer_flops,
    projection_flops,
    qkvo_bytes,
    score_matrix_bytes,
)

GiB = 2**30


def test_closed_forms():
    T, d = 100, 64
    assert attention_core_flops(T, d) == 4 * T * T * d
    assert attention_core_flops(T, d, causal=True) == 2 * T * T * d
    assert projection_flops(T, d) == 8 * T * d * d
    assert ffn_flops(T, d) == 16 * T * d * d
    assert ffn_flops(T, d, d_ff=100) == 4 * T * d * 100
    assert layer_flops(T, d) == 4 * T * T * d + 24 * T * d * d


def test_core_count_matches_matmul_shapes():
    # QK^T: (T x dh) @ (dh x T) and AV: (T x T) @ (T x dh), for each of H heads: 2*a*b*c each.
    T, H, dh = 37, 3, 8
    per_head = 2 * T * dh * T + 2 * T * T * dh
    assert attention_core_flops(T, H * dh) == H * per_head


def test_flop_crossover_is_where_core_equals_ffn():
    for d in (64, 768, 12288):
        T = flop_crossover_length(d)
        assert T == 4 * d
        assert attention_core_flops(T, d) == ffn_flops(T, d)
        assert attention_core_flops(T - 1, d) < ffn_flops(T - 1, d)
        assert attention_core_flops(T + 1, d) > ffn_flops(T + 1, d)
        Tc = flop_crossover_length(d, causal=True)
        assert attention_core_flops(Tc, d, causal=True) == ffn_flops(Tc, d)


def test_gpt3_scale_figures_of_chapter_1():
    d, N = 12288, 8192  # Brown et al. 2020, Table 2.1 (d_model); the text's N
    core, ffn = attention_core_flops(N, d), ffn_flops(N, d)
    assert math.isclose(core, 3.30e12, rel_tol=5e-3)
    assert math.isclose(ffn, 1.98e13, rel_tol=5e-3)
    assert core * 6 == ffn
    assert round(core / 2.1e10) == 157
    assert flop_crossover_length(d) == 49152


def test_score_matrix_memory():
    assert score_matrix_bytes(32768) == 4 * GiB  # 2^30 fp32 entries
    assert score_matrix_bytes(32768, 32, dtype="fp16") == 64 * GiB
    assert score_matrix_bytes(32768, 96, dtype="bf16") == 192 * GiB
    assert score_matrix_bytes(10, 2, dtype="fp8", batch=3) == 600
    assert qkvo_bytes(32768, 12288, dtype="fp16") == 3 * GiB


def test_score_matrix_bytes_match_a_real_tensor():
    B, H, T = 2, 3, 16
    s = torch.zeros(B, H, T, T, dtype=torch.float16)
    assert score_matrix_bytes(T, H, dtype="fp16", batch=B) == s.numel() * s.element_size()


def test_formatting_and_tables_are_deterministic():
    assert format_bytes(4 * GiB) == "4 GiB"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(100) == "100 B"
    assert costs.format_count(3.2985e12) == "3.30e12"
    table = cost_table(MODELS, [2048, 8192], dtype="fp16")
    assert table == cost_table(MODELS, [2048, 8192], dtype="fp16")
    assert len(table.splitlines()) == 2 + 2 * len(MODELS)
    assert "3.30e12" in table and "1.98e13" in table
    text = describe_costs(8192, 12288, 96, 96)
    assert "49152" in text and "12 GiB" in text


def test_published_shapes():
    by_name = {m.name: m for m in MODELS}
    assert by_name["GPT-3 175B"].head_dim == 128
    assert by_name["BERT-base"].head_dim == 64
    assert by_name["GPT-2 XL"].head_dim == 64


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, None])
def test_rejects_non_positive_or_non_int_sizes(bad):
    with pytest.raises(ValueError, match="positive int"):
        attention_core_flops(bad, 64)
    with pytest.raises(ValueError, match="positive int"):
        score_matrix_bytes(16, bad)


def test_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="unknown dtype 'fp64'"):
        score_matrix_bytes(16, dtype="fp64")


def test_describe_costs_says_when_heads_do_not_divide_d():
    from linattn_lib.chapters.costs import describe_costs

    assert "12 heads of 64)" in describe_costs(8192, 768, 12, 12)
    assert "d is not a multiple of them" in describe_costs(10, 10, 3)


def test_every_count_is_written_once_in_flops():
    """The chapter modules re-export the counts of linattn_lib.flops; they do not redefine them."""
    from linattn_lib import flops
    from linattn_lib.chapters import estimators, expressivity, kernel_anatomy

    homes = {
        costs: ("attention_core_flops", "projection_flops", "ffn_flops", "layer_flops", "flop_crossover_length",
                "score_matrix_bytes", "qkvo_bytes"),
        estimators: ("attention_flops", "flop_crossover"),
        expressivity: ("attention_layer_flops", "flop_ratio"),
        kernel_anatomy: ("Cost", "chunk_fwd_traffic", "chunk_fwd_min_traffic", "token_loop_cost",
                         "decode_step_cost", "flash_attention_cost"),
    }
    for module, names in homes.items():
        for name in names:
            assert getattr(module, name) is getattr(flops, name), (module.__name__, name)
    assert not hasattr(costs, "crossover_length")  # renamed: dispatch.crossover_length is the measured one


def test_shared_counts_agree_with_each_other():
    from linattn_lib import flops

    T, d, H = 256, 64, 4
    # the attention core is the quadratic order of feature attention without its normaliser
    assert flops.attention_core_flops(T, d) == H * flops.attention_flops(T, d // H, d // H, order="quadratic", normalize=False)
    assert flops.projection_flops(T, d) == 4 * flops.matmul_flops(T, d, d)
    assert flops.qkvo_bytes(T, d, dtype="fp16") == flops.io_bytes(1, 1, T, d, d, 2)
    assert flops.score_matrix_bytes(T, H, dtype=torch.bfloat16) == flops.score_matrix_bytes(T, H, dtype="bf16")
    # the bench's chunked count and the kernel's, on tiles that fit the head exactly
    C = 64
    kernel = flops.chunk_fwd_traffic(T, d, d, dict(BT=C, BK=d, BV=d), 4)
    assert kernel.flops == flops.chunked_forward_flops(1, 1, T, d, d, C, normalize=False)
    assert flops.chunk_fwd_min_traffic(T, d, d, C, 4).flops == kernel.flops
    assert flops.token_loop_cost(T, d, d, 2).bytes == T * flops.decode_step_cost(d, d, 2).bytes
