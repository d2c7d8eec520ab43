"""Chapter 11's figures and tables: hybrid stacks (recall, bits per character, decoding cost)
and the conversion of a softmax model (attention maps, bits per character by stage).

Every function takes the committed result's dict (`load_result("hybrid_mqar.json")` etc.), so
a reader who re-runs a sweep sees their own numbers in the same figures.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import PowerNorm
from matplotlib.figure import Figure

from .plots import method_color, plain_log_labels

STACK_ORDER = ("all softmax", "1:3", "1:7 first", "1:7 middle", "1:7 last", "all linear")
STACK_COLORS = {
    "all softmax": method_color("softmax"), "all linear": method_color("gated_deltanet"),
    "1:3": "tab:purple", "1:7 first": "tab:brown", "1:7 middle": "tab:pink", "1:7 last": "tab:grey",
}
METHOD_LABELS = {"hedgehog": "Hedgehog (CE on weights)", "lolcats": "LoLCATs (output MSE)",
                 "lolcats_window": "LoLCATs + window 16"}
# Figure 11.6: colour is the student's attention, a method of the book's palette (linear
# attention blue, the window's mix of softmax and linear attention the hybrids' grey); marker
# and line style tell the three conversions apart (the window student's recipe is LoLCATs').
STUDENT_KINDS = {"hedgehog": "linear", "lolcats": "linear", "lolcats_window": "hybrid"}
RECIPE_STYLES = {"hedgehog": ("o", "-"), "lolcats": ("s", "--"), "lolcats_window": ("^", "-.")}
STAGES = ("swap", "transfer", "lora")


def by_stack(results: Sequence[Mapping], value: Callable[[Mapping], float]) -> dict[str, list[float]]:
    """{stack: [value(run) for each seed]} in STACK_ORDER (stacks not in it last)."""
    out: dict[str, list[float]] = {}
    for r in results:
        out.setdefault(r["stack"], []).append(value(r))
    order = [s for s in STACK_ORDER if s in out] + [s for s in out if s not in STACK_ORDER]
    return {s: out[s] for s in order}


def _dots_and_means(ax, table: Mapping[str, Sequence[float]]) -> None:
    for i, (stack, vals) in enumerate(table.items()):
        c = STACK_COLORS.get(stack, "black")
        ax.scatter([i] * len(vals), vals, color=c, s=22, zorder=3, alpha=0.8)
        ax.hlines(statistics.mean(vals), i - 0.3, i + 0.3, color=c, lw=2.5, zorder=2)
    ax.set_xticks(range(len(table)), [s.replace(" ", "\n", 1) if s.startswith("1:7") else s for s in table],
                  fontsize=10)
    ax.grid(axis="y", alpha=0.3)


def draw_stack_recall(mqar: Mapping, pairs: Sequence[str] = ("4", "8")) -> Figure:
    """MQAR recall per stack, one panel per pair count: seeds as dots, their mean as a bar."""
    fig, axes = plt.subplots(1, len(pairs), figsize=(4.6 * len(pairs), 3.4), sharey=True, squeeze=False)
    for ax, n in zip(axes[0], pairs):
        _dots_and_means(ax, by_stack(mqar["results"], lambda r, n=n: r["accuracy"][n]))
        ax.set_title(f"{n} key-value pairs")
        ax.set_ylim(-0.03, 1.03)
    axes[0][0].set_ylabel("recall accuracy")
    fig.tight_layout()
    return fig


def best_ngram(baselines: Mapping, ctx: int) -> tuple[int, float]:
    """(order, bpc) of the best n-gram model reading windows of `ctx` characters."""
    rows = {int(n): v["window"][str(ctx)] for n, v in baselines["orders"].items()}
    n = min(rows, key=rows.get)
    return n, rows[n]


def draw_stack_bpc(charlm: Mapping) -> Figure:
    """Bits per character per stack (seeds as dots, mean as a bar) beside n-gram baselines."""
    ctx = charlm["meta"]["settings"]["ctx"]
    fig, ax = plt.subplots(figsize=(7.2, 3.6))
    _dots_and_means(ax, by_stack(charlm["results"], lambda r: r["bits_per_char"]))
    n, bpc = best_ngram(charlm["baselines"], ctx)
    ax.axhline(bpc, color="dimgrey", ls="--", lw=1.2)
    ax.annotate(f"best n-gram (n = {n}), {bpc:.2f}", (0.01, bpc), xycoords=("axes fraction", "data"),
                xytext=(0, 4), textcoords="offset points", fontsize=10, color="dimgrey")
    ax.set_ylabel("bits per character")
    fig.tight_layout()
    return fig


def draw_decode_cost(decode: Mapping) -> Figure:
    """Per stack, the generation state after the prompt (MB) and the time per token (ms)."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(9.2, 3.6))
    for r in sorted(decode["results"], key=lambda r: STACK_ORDER.index(r["stack"]) if r["stack"] in STACK_ORDER else 99):
        ctx = [row["context"] for row in r["rows"]]
        c = STACK_COLORS.get(r["stack"], "black")
        a.plot(ctx, [row["state_bytes"] / 2**20 for row in r["rows"]], "o-", color=c, label=r["stack"])
        b.plot(ctx, [row["ms_per_token"] for row in r["rows"]], "o-", color=c, label=r["stack"])
    for ax, label in ((a, "state after the prompt (MiB)"), (b, "time per generated token (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, which="both")
        plain_log_labels(ax)
    # below both panels: inside, it covered the softmax stack's line
    handles, labels = a.get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=10, ncol=min(len(labels), 6), loc="lower center", frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def draw_attention_maps(maps: Sequence[tuple[str, np.ndarray]]) -> Figure:
    """Attention matrices side by side (rows: queries, columns: keys), one colour scale (a
    square-root scale, so that the many small weights stay visible beside the few large)."""
    fig, axes = plt.subplots(1, len(maps), figsize=(2.9 * len(maps) + 0.6, 3.2), squeeze=False,
                             layout="constrained")
    top = max(float(np.max(m)) for _, m in maps)
    norm = PowerNorm(0.5, vmin=0, vmax=top)
    for ax, (title, m) in zip(axes[0], maps):
        im = ax.imshow(np.asarray(m), cmap="viridis", norm=norm)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("key")
    axes[0][0].set_ylabel("query")
    fig.colorbar(im, ax=list(axes[0]), shrink=0.85, label="weight")
    return fig


def conversion_table(convert: Mapping) -> dict[str, dict[str, list[float]]]:
    """{method: {stage: [bpc per seed]}}; the scratch model under {"scratch": {"scratch": ...}}."""
    out: dict[str, dict[str, list[float]]] = {}
    for r in convert["results"]:
        for stage, v in r["bpc"].items():
            out.setdefault(r["method"], {}).setdefault(stage, []).append(v)
    return out


def draw_conversion(convert: Mapping) -> Figure:
    """Bits per character of each method after the swap, after transfer and after LoRA, beside
    the teacher and the linear model trained from scratch with the same steps. A linear axis
    with labelled ticks where the results sit (2.4 to 3); each seed a hollow dot above its mean.
    The legend below the axes, starting at the left (what a phone shows first)."""
    table = conversion_table(convert)
    fig, ax = plt.subplots(figsize=(7.4, 4.6))
    x = np.arange(len(STAGES))
    for i, (method, label) in enumerate(METHOD_LABELS.items()):
        if method not in table:
            continue
        c, off = method_color(STUDENT_KINDS[method]), (i - 1) * 0.08
        (marker, ls), means = RECIPE_STYLES[method], [statistics.mean(table[method][s]) for s in STAGES]
        ax.plot(x + off, means, marker=marker, ls=ls, color=c, label=label, lw=2, ms=5, zorder=3)
        for j, s in enumerate(STAGES):
            ax.scatter([j + off + 0.03] * len(table[method][s]), table[method][s], marker=marker,
                       facecolors="none", edgecolors=c, s=28, lw=1.2, zorder=4)
    ax.axhline(convert["teacher"]["bits_per_char"], color=method_color("softmax"), lw=1.5,
               label="softmax teacher", zorder=2)
    steps = {r["method"]: r["steps"] for r in convert["results"] if "steps" in r}
    # the scratch model is the linear students' architecture: their blue, the budget by fill
    for name, fill, hatch in (("scratch", method_color("linear"), None), ("scratch_budget", "none", "///")):
        if name in table:
            s = table[name]["scratch"]
            ax.axhspan(min(s), max(s), facecolor=fill, edgecolor=method_color("linear"), alpha=0.4,
                       hatch=hatch, lw=0, label=f"linear from scratch, {steps[name]} steps")
    values = [v for m in table.values() for vs in m.values() for v in vs]
    values.append(convert["teacher"]["bits_per_char"])
    ax.set_ylim(min(values) - 0.1, max(values) + 0.15)
    ticks = [t for t in (2.2, 2.4, 2.6, 2.8, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5, 6.0)
             if min(values) - 0.1 <= t <= max(values) + 0.15]
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.set_xticks(x, ["after the swap", "after transfer", "after LoRA"])
    ax.set_ylabel("bits per character")
    fig.legend(*ax.get_legend_handles_labels(), fontsize=10, loc="lower left", ncol=2,
               frameon=False)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout(rect=(0, 0.15, 1, 1))
    return fig


def draw_memory_by_context(contexts: Sequence[int], curves: Mapping[str, Sequence[float]],
                           marks: Mapping[str, tuple[float, float]]) -> Figure:
    """Generation memory (GiB) against the context, one line per stack (`curves`: label ->
    GiB at each context), with a dot at `marks[label]` = (context, GiB) where given."""
    fig, ax = plt.subplots(figsize=(7.2, 4.0))
    colors = ("black", "tab:purple", "tab:brown", method_color("gated_deltanet"))
    for (label, gib), c in zip(curves.items(), colors):
        ax.plot(contexts, gib, color=c, lw=2, label=label)
        if label in marks:
            ax.plot(*marks[label], "o", color=c, ms=7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("generation memory (GiB, bf16)")
    ax.grid(alpha=0.3, which="both")
    plain_log_labels(ax)
    ax.legend(fontsize=10, loc="upper left")
    fig.tight_layout()
    return fig
