"""Sliders that work with and without a running kernel.

* `live_slider` wraps `ipywidgets.interact` for readers who run the notebook.
* `static_slider` renders precomputed frames (matplotlib figures) into self-contained HTML with
  an `<input type=range>` whose inline handler swaps the visible frame: it works in the static
  HTML book, offline, with no kernel and no widget manager.
"""
from __future__ import annotations

import base64
import html
import io
import json
from collections.abc import Callable, Iterable, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from .plots import BOOK_RC, PNG_DPI

LAYOUT_DPI = BOOK_RC["figure.dpi"]  # a figure's size on the page, in pixels per inch


def figure_to_png_base64(fig: Figure, *, dpi: int = PNG_DPI) -> str:
    """PNG bytes of a matplotlib figure, base64-encoded; the figure is closed."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def png_width(png_base64: str) -> int:
    """Width in pixels of a base64-encoded PNG (from its IHDR header)."""
    head = base64.b64decode(png_base64[:32])
    if head[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("png_width: not a PNG")
    return int.from_bytes(head[16:20], "big")


class StaticSlider:
    """Precomputed frames behind a range input; displays as HTML (see `static_slider`)."""

    def __init__(self, frames: Sequence[str], labels: Sequence[str], *, name: str, initial: int = 0,
                 density: float = PNG_DPI / LAYOUT_DPI):
        if len(frames) != len(labels) or not frames:
            raise ValueError(f"static_slider: need one label per frame, got {len(frames)} frames and {len(labels)} labels")
        if not 0 <= initial < len(frames):
            raise ValueError(f"static_slider: `initial` must index a frame (0..{len(frames) - 1}), got {initial}")
        self.frames, self.labels, self.name, self.initial = list(frames), [str(x) for x in labels], name, initial
        self.density = density  # PNG pixels per pixel shown: frames drawn at 200 dpi show at 100

    def _repr_html_(self) -> str:
        labels = html.escape(json.dumps(self.labels), quote=True)
        show = (
            "var r=this.closest('.linattn-slider');"
            "r.querySelectorAll('img.frame').forEach(function(im,i){im.style.display=(i==this.value)?'block':'none';},this);"
            "r.querySelector('.linattn-value').textContent=JSON.parse(r.dataset.labels)[this.value];"
        )
        imgs = "".join(
            f'<img class="frame" alt="{html.escape(self.name)} = {html.escape(lab)}" '
            f'width="{round(png_width(png) / self.density)}" '
            f'style="display:{"block" if i == self.initial else "none"};max-width:100%;height:auto" '
            f'src="data:image/png;base64,{png}">'
            for i, (png, lab) in enumerate(zip(self.frames, self.labels))
        )
        return (
            f'<div class="linattn-slider" data-labels="{labels}">'
            f'<label style="font-family:sans-serif">{html.escape(self.name)} = '
            f'<span class="linattn-value">{html.escape(self.labels[self.initial])}</span> '
            f'<input type="range" min="0" max="{len(self.frames) - 1}" step="1" value="{self.initial}" '
            f'oninput="{html.escape(show, quote=True)}" style="width:60%;vertical-align:middle"></label>'
            f"{imgs}</div>"
        )

    def __repr__(self) -> str:
        return f"<static slider over {self.name}: {len(self.frames)} frames ({self.labels[0]} .. {self.labels[-1]})>"


def static_slider(
    draw: Callable[[object], object], values: Iterable, *, name: str, initial: int = 0, fmt: str = "{}",
    dpi: int = PNG_DPI,
) -> StaticSlider:
    """Call `draw(value)` (returning a matplotlib figure) for each value and wrap the frames,
    drawn at `dpi` and shown at the size of the figure's own (layout) dpi.

    The text repr (what nbval compares) names the parameter and its range; the HTML repr is the
    slider the book shows.
    """
    values = list(values)
    frames = [figure_to_png_base64(draw(v), dpi=dpi) for v in values]
    return StaticSlider(frames, [fmt.format(v) for v in values], name=name, initial=initial,
                        density=dpi / LAYOUT_DPI)


def live_slider(draw: Callable[..., object], *, labels: dict[str, str] | None = None, **controls: object) -> None:
    """Show `ipywidgets.interactive(draw, **controls)` for readers with a kernel.

    Displays the controls and returns None. `draw`'s figure is shown, its return value is not
    (a returned figure or tuple would print again under the plot). `labels` names the controls
    on the page (`labels={"lam": "λ"}`; default: the argument names). The plain-text fallback
    is one short line naming the controls and saying what to do: it is what nbval compares,
    and what JupyterLab shows in a saved notebook before the cell runs (the executor saves no
    widget state, so no "model not found" error shows). Without ipywidgets it says how to get it.
    """
    try:
        import ipywidgets
        from IPython.display import display
    except ImportError:  # pragma: no cover - ipywidgets is in the book extra
        print("ipywidgets is not installed: pip install ipywidgets for live sliders")
        return None
    labels = labels or {}
    names = ", ".join(labels.get(n, n) for n in controls)

    class _Interactive(ipywidgets.interactive):
        def __repr__(self) -> str:
            text = f"<live slider over {names}: run this cell to move it>"
            return text if len(text) <= 80 else "<live slider: run this cell to move it>"

    def shown(**values: object) -> None:
        draw(**values)
        # Show the figure inside the widget's output: ipywidgets flushes inline figures only
        # when matplotlib names its backend the old way (not "inline", as matplotlib >= 3.9 does).
        plt.show()

    widget = _Interactive(shown, **controls)
    for child in widget.kwargs_widgets:
        child.description = labels.get(child.description, child.description)
    display(widget)
    return None
