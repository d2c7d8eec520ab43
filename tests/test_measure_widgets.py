"""The measuring helpers and the static slider the book relies on."""
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from linattn_lib.chapters.widgets import StaticSlider, static_slider  # noqa: E402
from linattn_lib.measure import fit_loglog_slope, peak_memory_bytes, time_fn  # noqa: E402


def test_loglog_slope_recovers_exponent():
    xs = [256, 512, 1024, 2048]
    assert abs(fit_loglog_slope(xs, [3 * x**2 for x in xs]) - 2) < 1e-12
    assert abs(fit_loglog_slope(xs, [5 * x for x in xs]) - 1) < 1e-12


def test_peak_memory_sees_a_large_temporary():
    n = 64 * 2**20 // 4  # a 64 MiB float32 temporary, freed before fn returns
    peak = peak_memory_bytes(lambda: torch.ones(n).sum())
    if peak is None:
        pytest.skip("no peak-RSS reset on this platform")
    assert 0.9 * 4 * n <= peak <= 3 * 4 * n


def test_time_fn_is_positive():
    assert time_fn(lambda: torch.ones(10).sum(), repeats=3) > 0


def test_static_slider_html_has_every_frame():
    def draw(a):
        fig, ax = plt.subplots(figsize=(1, 1))
        ax.plot([0, a])
        return fig

    s = static_slider(draw, [1, 2, 3], name="λ", fmt="{:.1f}", initial=1)
    html = s._repr_html_()
    assert html.count('<img class="frame"') == 3
    assert 'type="range"' in html and 'max="2"' in html and 'value="1"' in html
    assert "λ = <span" in html and "2.0" in html
    assert repr(s) == "<static slider over λ: 3 frames (1.0 .. 3.0)>"
    with pytest.raises(ValueError, match="one label per frame"):
        StaticSlider(["a"], ["1", "2"], name="x")


def test_static_slider_frames_are_drawn_at_twice_their_shown_size():
    """Frames are PNGs at PNG_DPI shown at the figure's layout dpi (sharp on a phone's screen):
    each <img> says half its PNG's width."""
    from linattn_lib.chapters.plots import BOOK_RC, PNG_DPI
    from linattn_lib.chapters.widgets import png_width

    def draw(a):
        fig, ax = plt.subplots(figsize=(2, 1.5))
        ax.plot([0, a])
        return fig

    s = static_slider(draw, [1, 2], name="x")
    html = s._repr_html_()
    assert PNG_DPI == 2 * BOOK_RC["figure.dpi"]
    for frame in s.frames:
        # a 2-inch figure (its tight box about as wide): about 400 px, not 200
        assert 300 < png_width(frame) < 600
        assert html.count(f'width="{round(png_width(frame) / 2)}"') >= 1
    with pytest.raises(ValueError, match="not a PNG"):
        png_width("aGVsbG8gd29ybGQsIHRoaXMgaXMgbm90IGEgUE5H")


def test_book_style_shows_inline_figures_as_retina_pngs():
    """In a notebook, importing the plots module makes inline figures retina PNGs (a later
    `%matplotlib inline` reads the formats from the same InlineBackend)."""
    from IPython.core.interactiveshell import InteractiveShell
    from matplotlib_inline.backend_inline import InlineBackend

    from linattn_lib.chapters import plots

    InteractiveShell.instance()  # a notebook's shell
    try:
        plots.use_book_style()
        assert InlineBackend.instance().figure_formats == {"retina"}
    finally:
        InteractiveShell.clear_instance()


def test_measure_helpers_reject_degenerate_input():
    from linattn_lib.measure import fit_loglog_slope, time_fn

    with pytest.raises(ValueError, match="two distinct x"):
        fit_loglog_slope([1.0], [1.0])
    with pytest.raises(ValueError, match="repeats"):
        time_fn(lambda: None, repeats=0)


def test_timed_calls_counts_warmups_repeats_and_the_budget():
    from linattn_lib.measure import timed_calls

    calls = []
    times = timed_calls(lambda: calls.append(1), warmup=2, repeats=3, device="cpu")
    assert len(calls) == 5 and len(times) == 3 and all(t >= 0 for t in times)
    calls.clear()
    # a warm-up call of ~20 ms against a 1 ms budget: one timed call instead of five
    slow = lambda: (calls.append(1), time.sleep(0.02))  # noqa: E731
    assert len(timed_calls(slow, warmup=1, repeats=5, budget_s=1e-3, device="cpu")) == 1
    # no warm-up: nothing to judge the budget by, so every repeat runs
    assert len(timed_calls(lambda: None, warmup=0, repeats=4, budget_s=1e-9, device="cpu")) == 4
    # the process clock does not count sleeping
    assert max(timed_calls(lambda: time.sleep(0.02), warmup=0, repeats=2, device="cpu", clock="process")) < 0.015
    with pytest.raises(ValueError, match="clock"):
        timed_calls(lambda: None, clock="gpu")


def test_flushing_the_caches_runs_before_each_timed_call(monkeypatch):
    from linattn_lib import measure

    order = []
    monkeypatch.setattr(measure, "flush_cpu_caches", lambda: order.append("flush"))
    measure.timed_calls(lambda: order.append("call"), warmup=1, repeats=2, device="cpu", flush_caches=True)
    assert order == ["call", "flush", "call", "flush", "call"]


def test_torch_threads_restores_the_setting_and_rss_is_read():
    from linattn_lib.measure import rss_bytes, torch_threads

    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    with torch_threads(None):
        assert torch.get_num_threads() == before
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="positive int or None"):
        with torch_threads(0):
            pass
    rss = rss_bytes()
    assert rss is None or rss > 2**20  # an interpreter with torch loaded holds more than 1 MiB
