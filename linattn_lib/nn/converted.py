"""Linear attention made from a trained softmax layer: learnable feature maps and adapters.

Chapter 11 converts a trained softmax `TinyLM` into linear attention, the way Hedgehog
(Zhang et al., 2024) and LoLCATs (Zhang et al., 2025) convert large models:

* `HedgehogFeatureMap`: per head, phi(x) = [softmax(x W + b), softmax(-(x W + b))], with W
  starting at the identity. Both halves are positive, so phi(q) . phi(k) > 0 and the
  normalised linear attention is a weighted mean of the values, like softmax attention.
* `ConvertedAttention`: a softmax layer's own query, key, value and output projections with a
  feature map for the queries and one for the keys. `window=0` is linear attention, computed by
  the library's `linear_attention` (chunked; Triton on a GPU) with a constant-size state for
  generation. `window=w > 0` is LoLCATs' hybrid: each query's last w keys through softmax,
  every older key through the feature maps, in one normalisation, with a learnable weight per
  head on the linear part. That variant runs its quadratic form here (contexts of ~100
  tokens); it is for measuring quality, not speed.
* `LoRALinear` / `add_lora`: low-rank adapters (Hu et al., 2022) on frozen projections.

`weights(x)` returns a layer's (B, H, T, T) attention matrix, the quantity that attention
transfer matches against the teacher's softmax weights.
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _validate as V
from ..core.linear import linear_attention
from ..core.state import DEFAULT_EPS as EPS
from ..core.state import LinearAttentionState
from .layers import SoftmaxAttention, _merge_heads, _split_heads


class HedgehogFeatureMap(nn.Module):
    """phi(x) = [softmax(x W_h + b_h), softmax(-(x W_h + b_h))] for each head h.

    x: (B, H, T, d_head) -> (B, H, T, 2 * feature_dim). W_h starts as the identity (so that
    feature_dim defaults to d_head) and b_h at zero.
    """

    def __init__(self, n_heads: int, d_head: int, feature_dim: int | None = None) -> None:
        super().__init__()
        if feature_dim is not None:
            V.check_positive_int("HedgehogFeatureMap", "feature_dim", feature_dim)
        f = d_head if feature_dim is None else int(feature_dim)
        self.weight = nn.Parameter(torch.eye(d_head, f).repeat(n_heads, 1, 1))
        self.bias = nn.Parameter(torch.zeros(n_heads, f))

    def forward(self, x: Tensor) -> Tensor:
        z = torch.einsum("bhtd,hdf->bhtf", x, self.weight) + self.bias[:, None]
        return torch.cat([torch.softmax(z, -1), torch.softmax(-z, -1)], -1)


class ConvertedAttention(nn.Module):
    """A softmax layer turned into linear attention (window=0) or LoLCATs' window hybrid.

    Copies `teacher`'s projections (the teacher is left alone). The feature maps start at the
    identity; attention transfer trains them, LoRA then adapts the copied projections.
    """

    def __init__(self, teacher: SoftmaxAttention, *, window: int = 0, feature_dim: int | None = None) -> None:
        super().__init__()
        V.check_instance("ConvertedAttention", "teacher", teacher, SoftmaxAttention, "a SoftmaxAttention layer")
        self.window = V.check_int("ConvertedAttention", "window", window, low=0)
        self.n_heads, self.d_head = teacher.n_heads, teacher.d_head
        self.qkv, self.proj = copy.deepcopy(teacher.qkv), copy.deepcopy(teacher.proj)
        self.phi_q = HedgehogFeatureMap(self.n_heads, self.d_head, feature_dim)
        self.phi_k = HedgehogFeatureMap(self.n_heads, self.d_head, feature_dim)
        # log of the weight of the linear part against the window's softmax part (LoLCATs' gamma)
        self.log_mix = nn.Parameter(torch.zeros(self.n_heads)) if window else None

    def feature_parameters(self) -> list[nn.Parameter]:
        """What attention transfer trains: the two feature maps (and the window's mixing weight)."""
        extra = [self.log_mix] if self.log_mix is not None else []
        return [*self.phi_q.parameters(), *self.phi_k.parameters(), *extra]

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return tuple(_split_heads(t, self.n_heads) for t in self.qkv(x).chunk(3, dim=-1))

    def weights(self, x: Tensor) -> Tensor:
        """The (B, H, T, T) causal attention matrix of `x` (B, T, d_model); rows sum to 1."""
        q, k, _ = self._qkv(x)
        return self._weights(q, k)

    def _weights(self, q: Tensor, k: Tensor) -> Tensor:
        T = q.shape[2]
        lag = torch.arange(T, device=q.device)[:, None] - torch.arange(T, device=q.device)
        kernel = self.phi_q(q) @ self.phi_k(k).transpose(-1, -2)
        if not self.window:
            a = kernel.masked_fill(lag < 0, 0.0)
            return a / (a.sum(-1, keepdim=True) + EPS)
        # one softmax over both parts, in log space: exp(q.k / sqrt(d)) near, gamma phi(q).phi(k) far
        near = (lag >= 0) & (lag < self.window)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.d_head)
        far = torch.log(kernel.clamp_min(1e-30)) + self.log_mix[:, None, None]
        logits = torch.where(near, scores, far.masked_fill(lag < self.window, float("-inf")))
        return torch.softmax(logits, -1)

    def check_state(self, fn: str, name: str, state: object, *, batch: int, device: torch.device) -> None:
        """A linear student's state is the `LinearAttentionState` its previous call returned."""
        if self.window:
            raise ValueError(f"{fn}: `{name}`: the sliding-window student has no recurrent form here")
        V.check_instance(fn, name, state, LinearAttentionState, "a LinearAttentionState")

    def forward(self, x: Tensor, *, state: LinearAttentionState | None = None, pos_offset: int = 0,
                return_state: bool = False) -> Tensor | tuple[Tensor, LinearAttentionState | None]:
        return self._forward(x, state=state, pos_offset=pos_offset, return_state=return_state)

    def _forward(self, x: Tensor, *, state=None, pos_offset: int = 0, return_state: bool = False):
        q, k, v = self._qkv(x)
        if self.window:
            if state is not None or pos_offset:
                raise ValueError("ConvertedAttention: the sliding-window student runs whole sequences only "
                                 "(its quadratic form); generation needs window=0")
            o, state = self._weights(q, k) @ v, None
        else:
            o, state = linear_attention(self.phi_q(q), self.phi_k(k), v, normalize=True, eps=EPS,
                                        initial_state=state, return_state=True)
        y = self.proj(_merge_heads(o))
        return (y, state) if return_state else y


class LoRALinear(nn.Module):
    """y = base(x) + (alpha / rank) * x A^T B^T with `base` frozen, A random and B zero at first."""

    def __init__(self, base: nn.Linear, rank: int = 8, alpha: float = 16.0, *, generator: torch.Generator | None = None) -> None:
        super().__init__()
        V.check_instance("LoRALinear", "base", base, nn.Linear, "an nn.Linear")
        V.check_positive_int("LoRALinear", "rank", rank)
        self.base = base.requires_grad_(False)
        a = torch.randn(rank, base.in_features, generator=generator) / math.sqrt(base.in_features)
        self.down = nn.Parameter(a.to(base.weight))
        self.up = nn.Parameter(torch.zeros(base.out_features, rank, dtype=base.weight.dtype))
        self.scale = float(alpha) / rank

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + F.linear(F.linear(x, self.down), self.up) * self.scale


def add_lora(layer: ConvertedAttention, rank: int = 8, alpha: float = 16.0, *,
             generator: torch.Generator | None = None) -> list[nn.Parameter]:
    """Wrap `layer`'s qkv and output projections in `LoRALinear`; return the adapters' parameters."""
    V.check_instance("add_lora", "layer", layer, ConvertedAttention, "a ConvertedAttention layer")
    layer.qkv = LoRALinear(layer.qkv, rank, alpha, generator=generator)
    layer.proj = LoRALinear(layer.proj, rank, alpha, generator=generator)
    return [layer.qkv.down, layer.qkv.up, layer.proj.down, layer.proj.up]
