"""Small plotting helpers shared by the chapters (matplotlib only)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import FixedLocator, FuncFormatter, LogFormatterSciNotation, NullLocator

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.axis import Axis
    from matplotlib.figure import Figure
    from matplotlib.image import AxesImage
    from torch import Tensor

from ..measure import fit_loglog_slope

# One colour per method across the book, one family per group: exact softmax in black,
# additive linear attention in blues, decayed or gated updates in greens, the delta rule in
# reds and oranges. Keys are the library's kind names (`TinyLM`, `mqar`, `charlm`).
METHOD_COLORS: dict[str, str] = {
    "softmax": "black", "hybrid": "grey", "sliding_window": "dimgrey",
    "linear": "tab:blue", "performer": "lightskyblue", "cosformer": "navy",
    "taylor": "tab:cyan", "retnet": "tab:green", "ssd": "yellowgreen",
    "gla": "darkgreen", "rwkv6": "olive", "deltanet": "tab:red",
    "gated_deltanet": "tab:orange", "kda": "tab:brown",
}
_ALIASES = {"exact": "softmax", "mamba2": "ssd", "mamba-2": "ssd", "favor+": "performer",
            "based": "taylor", "gated deltanet": "gated_deltanet", "delta rule": "deltanet",
            "decayed": "ssd", "softmax_fused": "softmax"}

# The book's figure style: text at least 10 pt (10 px or more on the page at 1280 px, for
# figures up to 10 inches wide), applied when this module is imported.
MIN_FONT_PT = 10
MAX_FIGURE_INCHES = 9.5  # at the 1280-px column (~690 px) 10-pt text stays >= 10 px
# Figures are laid out at 100 dpi (their size on the page) and drawn with twice the pixels
# (PNG_DPI), so that they stay sharp on phones and other high-density screens: a notebook's
# inline figures are "retina" PNGs (IPython halves their shown size), static sliders' frames
# likewise (widgets.py), and saved figures use savefig.dpi.
PNG_DPI = 200
BOOK_RC = {
    "font.size": 11, "axes.titlesize": 11, "axes.labelsize": 11, "xtick.labelsize": 10,
    "ytick.labelsize": 10, "legend.fontsize": 10, "legend.title_fontsize": 10,
    "figure.titlesize": 12, "figure.dpi": 100, "savefig.dpi": PNG_DPI,
}


def method_color(name: str) -> str:
    """The book's colour for a method (a kind name such as "deltanet", or a common alias)."""
    key = name.lower().strip()
    key = _ALIASES.get(key, key)
    if key not in METHOD_COLORS:
        raise KeyError(f"method_color: no colour for {name!r}; known: {sorted(METHOD_COLORS)}")
    return METHOD_COLORS[key]


# How the prose names each kind, for legends and tick labels (the keys of METHOD_COLORS).
METHOD_LABELS: dict[str, str] = {
    "softmax": "softmax", "hybrid": "hybrid", "sliding_window": "sliding window",
    "linear": "linear", "performer": "Performer", "cosformer": "cosFormer",
    "taylor": "Based (Taylor)", "retnet": "RetNet", "ssd": "SSD (Mamba-2)", "gla": "GLA",
    "rwkv6": "RWKV-6", "deltanet": "DeltaNet", "gated_deltanet": "Gated DeltaNet", "kda": "KDA",
}


def method_label(name: str) -> str:
    """The book's name for a method on a figure (a kind name such as "gated_deltanet", or a
    common alias): "Gated DeltaNet", not the identifier."""
    method_color(name)  # the same names, the same error for an unknown one
    key = name.lower().strip()
    return METHOD_LABELS[_ALIASES.get(key, key)]


def use_book_style() -> None:
    """Set matplotlib's defaults to the book's style (text sizes, resolution); in a notebook,
    show inline figures as retina PNGs (twice the pixels at the same size)."""
    plt.rcParams.update(BOOK_RC)
    try:
        from IPython import get_ipython
        from matplotlib_inline.backend_inline import InlineBackend
    except ImportError:  # plain Python: nothing is shown inline
        return
    shell = get_ipython()
    if shell is not None:
        # a later `%matplotlib inline` reads the formats from here, so the order of the
        # setup cell's import and magic does not matter
        InlineBackend.instance(parent=shell).figure_formats = {"retina"}


use_book_style()


def _np(x):
    try:
        import torch

        if isinstance(x, torch.Tensor):
            return x.detach().cpu().double().numpy()
    except ImportError:  # pragma: no cover
        pass
    return np.asarray(x, dtype=float)


def plot_matrix(
    ax: Axes, M: Tensor | np.ndarray, *, title: str = "", cmap: str = "viridis",
    vmin: float | None = None, vmax: float | None = None, colorbar: bool = True,
) -> AxesImage:
    """Heat map of a 2-d matrix (e.g. an attention or mixing matrix), rows = queries."""
    im = ax.imshow(_np(M), cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
    ax.set_title(title)
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
    if colorbar:
        plt.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    return im


class _PlainLogFormatter(LogFormatterSciNotation):
    """Labels the ticks matplotlib's log axis labels, as plain numbers from 0.0001 to 99999
    (0.02, 4096 rather than 2x10^-2: a reader found those minor-tick labels confusing), and
    as powers of ten beyond; on a base-2 axis from 1024 on as K and M (1024 and 2^20), as
    context lengths are written."""

    def __call__(self, x: float, pos: int | None = None) -> str:
        label = super().__call__(x, pos)
        if label and self._base == 2 and abs(x) >= 1024:  # token counts: 4K, 256K, 1M
            return f"{x / 2**20:g}M" if abs(x) >= 2**20 else f"{x / 1024:g}K"
        return f"{x:g}" if label and 1e-4 <= abs(x) < 1e5 else label


def plain_log_labels(ax: Axes) -> None:
    """Plain-number tick labels on the log axes of `ax` (of any base: 4096, not 2^12)."""
    for axis, scale in ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale())):
        if scale == "log":
            base = axis.get_transform().base
            axis.set_major_formatter(_PlainLogFormatter(base=base))
            axis.set_minor_formatter(_PlainLogFormatter(base=base, labelOnlyBase=False))


def byte_log_labels(axis: Axis) -> None:
    """Label a log axis of byte counts in binary units, as the text counts them (KiB, MiB, GiB):
    ticks every factor of 4 (1 MiB, 4 MiB, 16 MiB, 64 MiB, 256 MiB, 1 GiB, ...)."""
    units = ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B"))

    def label(x: float, pos: int | None = None) -> str:
        scale, unit = next((s, u) for s, u in units if x >= s)
        return f"{x / scale:g} {unit}"

    axis.set_major_locator(FixedLocator([4.0**i for i in range(21)]))
    axis.set_major_formatter(FuncFormatter(label))
    axis.set_minor_locator(NullLocator())


def plot_scaling(
    ax: Axes, xs: Sequence[float], series: Mapping[str, Sequence[float]], *,
    xlabel: str = "T", ylabel: str = "", fit: bool = True, legend_loc: str = "best",
) -> dict[str, float]:
    """Log-log plot of several series against xs, each labelled with its fitted exponent
    (rounded to 2 decimals: a flat series reads "slope 0.00", never "-0.00")."""
    slopes = {}
    for name, ys in series.items():
        label = name
        if fit and len(xs) > 1:
            slopes[name] = fit_loglog_slope(xs, ys)
            label = f"{name} (slope {round(slopes[name], 2) + 0.0:.2f})"
        ax.loglog(xs, _np(ys), "o-", label=label)
    plain_log_labels(ax)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc=legend_loc)
    return slopes


def small_multiples(n: int, *, ncols: int | None = None, size: float = 2.6) -> tuple[Figure, list[Axes]]:
    """A row (or grid) of n axes for a static sweep of one parameter; by default as many
    columns as fit in MAX_FIGURE_INCHES."""
    ncols = ncols or max(1, min(n, int(MAX_FIGURE_INCHES // size)))
    nrows = -(-n // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(size * ncols, size * nrows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    return fig, list(axes.flat[:n])


def plot_attention_approximations(
    exact: Tensor | np.ndarray,
    approximations: Mapping[str, object],
    *,
    row_errors: Mapping[str, Sequence[float]] | None = None,
    row_error_label: str = "row error",
    suptitle: str = "",
    size: float = 2.5,
) -> Figure:
    """The exact attention matrix beside approximations of it, on one colour scale.

    `approximations` maps a panel title to a (T, T) matrix. The colour scale runs from 0 to the
    largest exact weight, so negative approximate weights show as the darkest colour. With
    `row_errors` (title -> one error per query) a last panel plots them against the query index.
    Returns the figure (callers show it, or hand it to `widgets.static_slider`).
    """
    n = 1 + len(approximations) + (1 if row_errors else 0)
    nrows = -(-n // max(1, min(int(MAX_FIGURE_INCHES // size), 3)))  # at most 3 a row
    ncols = -(-n // nrows)
    fig, grid = plt.subplots(nrows, ncols, figsize=(size * ncols, size * 1.05 * nrows), squeeze=False)
    for ax in grid.flat[n:]:
        fig.delaxes(ax)
    axes = list(grid.flat[:n])
    E = _np(exact)
    vmax = float(E.max())
    plot_matrix(axes[0], E, title="exact softmax", vmin=0.0, vmax=vmax, colorbar=False)
    for ax, (title, M) in zip(axes[1:], approximations.items()):
        plot_matrix(ax, M, title=title, vmin=0.0, vmax=vmax, colorbar=False)
        ax.set_ylabel("")
    if row_errors:
        ax = axes[-1]
        for title, errs in row_errors.items():
            ax.plot(_np(errs), label=title.split("\n")[0], lw=1.2)
        ax.set_xlabel("query i")
        ax.set_ylabel(row_error_label)
        ax.set_ylim(bottom=0)
        ax.legend()
        ax.grid(True, alpha=0.3)
    if suptitle:
        fig.suptitle(suptitle, fontsize=11)
    fig.tight_layout()
    return fig
