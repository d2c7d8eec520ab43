"""A back-of-the-envelope cost model of one Transformer layer (chapter 1).

Conventions (as in Kaplan et al. 2020, Table 1):

* one FLOP is one multiplication or one addition, so multiplying an (a x b) matrix by a
  (b x c) matrix costs ``2*a*b*c`` FLOPs;
* counts are for the **forward pass of one layer on one sequence of T tokens**;
  ``d`` is the model width (``heads * head_dim``);
* left out: the softmax itself (a few FLOPs per score, O(heads * T^2)), layer norms,
  residuals, biases and embeddings, which are all small next to the matrix products.

With these conventions, per layer and sequence:

    attention core          4 * T^2 * d       Q K^T and A V, 2*T*T*d each, summed over heads
    Q, K, V, O projections  8 * T * d^2       four (T x d) @ (d x d) products
    feed-forward (FFN)      4 * T * d * d_ff  two products; 16 * T * d^2 for d_ff = 4d

So the attention core overtakes the FFN only when ``T > d_ff`` (``T > 4d``), or ``T > 2*d_ff``
when the causal half of the score matrix is skipped (`flop_crossover_length`). All counts are
exact Python ints.

The formulas are written once, in `linattn_lib.flops`; this module re-exports them
(``costs.attention_core_flops`` is ``flops.attention_core_flops``) and adds the published
model shapes, the formatting and the tables of chapter 1.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .. import _validate as V
from ..flops import (  # noqa: F401  (re-exported: the chapter calls them as costs.<name>)
    BYTES_PER_ELEMENT,
    attention_core_flops,
    ffn_flops,
    flop_crossover_length,
    layer_flops,
    projection_flops,
    qkvo_bytes,
    score_matrix_bytes,
)


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Transformer that matter for the cost model."""

    name: str
    d: int
    heads: int
    layers: int
    n_ctx: int  # the context length the model was trained with

    @property
    def head_dim(self) -> int:
        return self.d // self.heads


#: Published shapes: BERT-base (Devlin et al. 2019), GPT-2 XL (Radford et al. 2019; 25 heads in
#: the released configuration), GPT-3 175B (Brown et al. 2020, Table 2.1).
MODELS = (
    ModelShape("BERT-base", d=768, heads=12, layers=12, n_ctx=512),
    ModelShape("GPT-2 XL", d=1600, heads=25, layers=48, n_ctx=1024),
    ModelShape("GPT-3 175B", d=12288, heads=96, layers=96, n_ctx=2048),
)


def format_count(x: float) -> str:
    """A count in 3 significant digits with a power of ten: ``3.30e12``."""
    return f"{x:.2e}".replace("e+", "e")


def format_bytes(n: float) -> str:
    """Bytes in binary units with 3 significant digits: ``4 GiB``, ``192 GiB``, ``1.5 MiB``."""
    units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n /= 1024
        i += 1
    return f"{n:.0f} {units[i]}" if n >= 100 else f"{n:.3g} {units[i]}"  # 1000-1023: no "1e+03"


def describe_costs(T: int, d: int, heads: int, layers: int = 1, *, dtype: str = "fp16", causal: bool = False) -> str:
    """A few lines summarising the cost of one forward pass (used by chapter 1's live calculator)."""
    for name, value in (("T", T), ("d", d), ("heads", heads), ("layers", layers)):
        V.check_positive_int("describe_costs", name, value)
    core = attention_core_flops(T, d, causal=causal)
    proj, ffn = projection_flops(T, d), ffn_flops(T, d)
    total = core + proj + ffn
    scores = score_matrix_bytes(T, heads, dtype=dtype)
    core_label = "attention core 2T^2d" if causal else "attention core 4T^2d"
    lines = [
        f"per layer, one sequence of T = {T} tokens (d = {d}, "
        + (f"{heads} heads of {d // heads}):" if d % heads == 0 else f"{heads} heads: d is not a multiple of them):"),
        f"  {core_label:<22}: {format_count(core):>9} FLOPs ({core / total:6.1%} of the layer)",
        f"  {'projections 8Td^2':<22}: {format_count(proj):>9} FLOPs ({proj / total:6.1%})",
        f"  {'FFN 16Td^2':<22}: {format_count(ffn):>9} FLOPs ({ffn / total:6.1%})",
        f"  {'core / FFN':<22}: {core / ffn:9.3g}   (= 1 at T = {flop_crossover_length(d, causal=causal)})",
        f"  {'score matrices ' + dtype:<22}: {format_bytes(scores):>9}   (Q, K, V, O: {format_bytes(qkvo_bytes(T, d, dtype=dtype))})",
        f"all {layers} layers: {format_count(total * layers)} FLOPs; {format_bytes(scores * layers)} of score matrices if every layer keeps its own",
    ]
    return "\n".join(lines)


def cost_table(models: Sequence[ModelShape] = MODELS, lengths: Iterable[int] = (2048, 8192, 32768), *, dtype: str = "fp16") -> str:
    """A fixed-width table of per-layer forward costs for each model and sequence length."""
    lengths = list(lengths)
    header = f"{'model':<11} {'d':>6} {'heads':>5} {'T':>6} {'core FLOPs':>10} {'FFN FLOPs':>10} {'core/FFN':>8} {'scores (' + dtype + ')':>14}"
    rows = [header, "-" * len(header)]
    for m in models:
        for T in lengths:
            core, ffn = attention_core_flops(T, m.d), ffn_flops(T, m.d)
            rows.append(
                f"{m.name:<11} {m.d:>6} {m.heads:>5} {T:>6} {format_count(core):>10} {format_count(ffn):>10} "
                f"{core / ffn:>8.3g} {format_bytes(score_matrix_bytes(T, m.heads, dtype=dtype)):>14}"
            )
    return "\n".join(rows)
