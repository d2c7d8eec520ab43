"""The committed GPU results (book/results/gpu/) as appendix A.5.2 reads them."""
from __future__ import annotations

from linattn_lib.chapters import gpu_results as gr


def test_the_two_runs_merge_and_the_tables_fit_a_page():
    runs = gr.load_runs()
    assert len(runs) == 2
    rows = gr.bench_rows(runs)
    # the first run's rows, then the second's where the first had none
    assert gr.times(rows, "unnormalised", gr.OURS)[1] is not None
    assert gr.times(rows, "unnormalised", gr.OURS, "B=1 T=8192 H=96 D=128")[0] is not None
    # fla refuses its per-token backward under this Triton: a forward, no backward
    fwd, fb = gr.times(rows, "per-token decay", gr.FLA)
    assert fwd is not None and fb is None
    timed = (gr.times(rows, "unnormalised", gr.OURS)[1], gr.times(rows, "unnormalised", gr.FLA)[1])
    lines = gr.main_table(rows) + gr.kernel_table(gr.kernel_pairs(runs), timed)
    assert max(map(len, lines)) <= 44  # a phone's width of code


def test_the_kernel_pairs_follow_one_forward_backward():
    pairs = gr.kernel_pairs(gr.load_runs())
    assert [p[0] for p in pairs] == [r[0] for r in gr.ROLES]
    assert all(isinstance(x, float) and x > 0 for p in pairs for x in p[1:])
