"""The short causal convolution production linear-attention layers put in front of q, k, v.

Mamba, H3, Based, DeltaNet and Gated DeltaNet (fla's `ShortConvolution`) mix each channel
with its own previous K - 1 values (K = 4) before the attention: a token's key then also
carries its neighbours, which is what lets one layer bind a key to the value after it (Zoology,
Arora et al. 2023, found it decides multi-query associative recall at small widths).

    y[t, c] = sum_{s=0}^{K-1} w[c, K-1-s] x[t-s, c]   (+ b[c]),  x[t] = 0 before the start

It is depthwise (one K-tap filter per channel) and causal, so it costs O(T C K) and its
recurrent state is just the last K - 1 inputs: a (B, C, K-1) cache, carried beside the
attention state when generating (`ConvLayerState`). With `cu_seqlens` (packed sequences, B = 1)
every sequence starts from its own cache row and nothing crosses a sequence boundary.
`convolve_tokens` convolves each row of a padded batch over its own tokens alone.

`ShiftedEmbedding` is the cheapest mixing of all, RWKV's token shift on the embeddings
(chapter 7's MQAR models have it in front of their first layer).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _validate as V
from ..core.state import LinearAttentionState


class ConvLayerState(NamedTuple):
    """What a `LinearAttention` layer with `short_conv=True` carries between calls.

    * attn: the attention's LinearAttentionState (S, z).
    * conv: (B, C, K-1), the last K - 1 inputs of the convolution (C = 3 d_model: q, k, v).
    """

    attn: LinearAttentionState
    conv: Tensor


torch.serialization.add_safe_globals([ConvLayerState])  # as LinearAttentionState (core/state.py)


class ShortConvolution(nn.Module):
    """Causal depthwise convolution over time on (B, T, C), kernel `kernel_size`.

    `forward(x, cache=None, cu_seqlens=None)` returns (y, new_cache): y (B, T, C) and the
    last K - 1 inputs, (B, C, K-1) (N rows with `cu_seqlens`), to resume from. No activation
    here: the layer applies its own (fla's ShortConvolution(activation='silu') is this
    followed by SiLU). Weights start as torch's `nn.Conv1d` (uniform, fan-in K).
    """

    def __init__(self, channels: int, kernel_size: int = 4, *, bias: bool = False) -> None:
        super().__init__()
        fn = "ShortConvolution"
        V.check_positive_int(fn, "channels", channels)
        V.check_int(fn, "kernel_size", kernel_size, low=2)
        self.channels, self.kernel_size = int(channels), int(kernel_size)
        self.conv = nn.Conv1d(self.channels, self.channels, self.kernel_size, groups=self.channels,
                              bias=V.check_flag(fn, "bias", bias))

    def reset_parameters(self) -> None:
        self.conv.reset_parameters()

    def check_cache(self, fn: str, name: str, cache: object, *, batch: int, device: torch.device) -> None:
        """`cache` is a finite (batch, C, K-1) tensor on `device`."""
        V.check_layout(fn, name, cache, ("B", "C", "K-1"))
        V.check_shape(fn, name, cache, (batch, self.channels, self.kernel_size - 1), ("B", "C", "K-1"))
        if cache.device != device:
            raise ValueError(f"{fn}: `{name}` is on {cache.device} but the inputs are on {device}")
        V.check_values(fn, name, cache)

    def forward(self, x: Tensor, cache: Tensor | None = None, cu_seqlens: Tensor | None = None,
                ) -> tuple[Tensor, Tensor]:
        if cu_seqlens is not None:
            return self._packed(x, cache, cu_seqlens)
        B, T, C = x.shape
        K = self.kernel_size
        past = x.new_zeros(B, C, K - 1) if cache is None else cache.to(x.dtype)
        if not torch.compiler.is_compiling():  # eager: torch's depthwise convolution
            full = torch.cat([past, x.transpose(1, 2)], dim=-1)  # (B, C, K-1+T): cache, then x
            y = F.conv1d(full, self.conv.weight, self.conv.bias, groups=C)
            return y.transpose(1, 2), full[..., T:].contiguous()
        full = torch.cat([past.transpose(1, 2), x], dim=1)  # (B, K-1+T, C)
        # compiled: K shifted multiply-adds, as inductor's lowering of conv1d's backward guards
        # on T (torch 2.13): a compiled model recompiled at every new length. (Eager, they take
        # 1.2-1.7x conv1d's time on CPU.)
        w = self.conv.weight[:, 0]  # (C, K)
        y = torch.zeros_like(x) if self.conv.bias is None else self.conv.bias.expand(B, T, C)
        for s in range(K):  # tap s reads input t - s, at full[:, K-1-s + t]
            y = y + w[:, K - 1 - s] * full[:, K - 1 - s:K - 1 - s + T]
        return y, full[:, T:].transpose(1, 2).contiguous()

    def _packed(self, x: Tensor, cache: Tensor | None, cu_seqlens: Tensor) -> tuple[Tensor, Tensor]:
        """B = 1, sequences end to end: the taps gathered per token, masked at each start."""
        _, T, C = x.shape
        K, N = self.kernel_size, cu_seqlens.numel() - 1
        cu = cu_seqlens.to(x.device, torch.long)
        lengths = cu.diff()
        seq = torch.repeat_interleave(torch.arange(N, device=x.device), lengths, output_size=T)
        pos = torch.arange(T, device=x.device) - cu[:-1][seq]  # position within its sequence
        past = x.new_zeros(N, C, K - 1) if cache is None else cache.to(x.dtype)
        # ext[n, j] is input j - (K-1) of sequence n for j < K - 1 (its cache), then x itself
        xs, w = x[0], self.conv.weight[:, 0]  # (T, C), (C, K)
        y = torch.zeros_like(xs) if self.conv.bias is None else self.conv.bias.expand(T, C).clone()
        for s in range(K):  # tap s reads input t - s
            inside = (pos >= s)[:, None]
            src = xs[(torch.arange(T, device=x.device) - s).clamp(min=0)]
            from_cache = past[seq, :, (K - 1 - s + pos).clamp(0, K - 2)]  # (T, C)
            y = y + w[:, K - 1 - s] * torch.where(inside, src, from_cache)
        # the new cache: the last K - 1 inputs of each sequence, reaching into its old cache
        j = torch.arange(K - 1, device=x.device)
        rel = lengths[:, None] - (K - 1) + j  # (N, K-1) positions within the sequence
        idx = (cu[:-1, None] + rel).clamp(0, max(T - 1, 0))
        n = torch.arange(N, device=x.device)[:, None]
        new = torch.where((rel >= 0)[..., None], xs[idx], past[n, :, (rel + K - 1).clamp(0, K - 2)])
        return y.unsqueeze(0), new.transpose(1, 2).contiguous()


def convolve_tokens(conv: ShortConvolution, x: Tensor, mask: Tensor,
                     cache: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """`conv` over each row's tokens alone (mask True), for any padding: the tokens are moved
    to the end of their row in order, the padding before them as zeros (what an empty cache
    holds), convolved, and moved back. Returns (y, cache): y (B, T, C), garbage at padding;
    the cache, each row's last K - 1 tokens. A cache to continue from: K - 1 tokens before."""
    if cache is not None:
        ext = torch.cat([cache.transpose(1, 2).to(x.dtype), x], dim=1)
        ext_mask = F.pad(mask, (cache.shape[-1], 0), value=True)
        y, cache = convolve_tokens(conv, ext, ext_mask)
        return y[:, cache.shape[-1]:], cache
    order = torch.argsort(mask.to(torch.uint8), dim=1, stable=True)  # padding first, tokens in order
    moved = torch.where(mask.gather(1, order)[..., None], x.gather(1, order[..., None].expand_as(x)), 0)
    y, cache = conv(moved)
    back = torch.argsort(order, dim=1)[..., None].expand_as(y)
    return y.gather(1, back), cache


class ShiftedEmbedding(nn.Module):
    """Token embedding plus a learned mix of the previous token's embedding (a token shift).

    e_t = E[x_t] + W E[x_{t-1}] (E[x_{-1}] = 0). It shares `weight` with the embedding it
    wraps, so a tied output head stays tied. It sees one sequence at a time in parallel form
    only: a model using it must not be run token by token (its generate() would lose the
    shift), which MQAR never does.
    """

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.weight = embedding.weight
        d = embedding.weight.shape[1]
        self.mix = nn.Linear(d, d, bias=False)
        nn.init.normal_(self.mix.weight, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        e = F.embedding(idx, self.weight)
        prev = F.pad(e, (0, 0, 1, 0))[:, :-1]  # e_{t-1}, zero at t = 0
        return e + self.mix(prev)
