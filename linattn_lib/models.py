"""A small model zoo: one decoder-only Transformer whose attention is pluggable.

Every linear variant is the same engine, `linear_attention`, with a different feature map and
decay; each keeps a constant-size recurrent state when generating, while softmax keeps a KV
cache. Attention kinds:

| kind        | feature map phi            | decay log a_t                         | normalised |
|-------------|----------------------------|---------------------------------------|------------|
| "softmax"   | (exact attention)          | -                                     | (softmax)  |
| "performer" | FAVOR+ positive features   | none                                  | yes        |
| "linear"    | elu + 1                    | none                                  | yes        |
| "cosformer" | relu, times cos/sin(pi i/2M) | none (the cos re-weighting)         | yes        |
| "retnet"    | identity                   | fixed per head: log(1 - 2^(-5-h))     | no (+ norm)|
| "ssd"       | identity                   | data-dependent: -softplus(w . x_t + b)| no (+ norm)|

Unnormalised variants (RetNet, Mamba-2 / SSD style) normalise each head's output instead
(a per-head RMS norm, as RetNet's GroupNorm does).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _validate as V
from .attention import LinearAttentionState, linear_attention
from .features import RandomFeatureMap, elu_plus_one
from .ssm import retnet_log_decay

ATTENTION_KINDS = ("softmax", "performer", "linear", "cosformer", "retnet", "ssd")
LINEAR_KINDS = ATTENTION_KINDS[1:]


def _split_heads(x: Tensor, n_heads: int) -> Tensor:
    B, T, C = x.shape
    return x.view(B, T, n_heads, C // n_heads).transpose(1, 2)  # (B, H, T, dh)


def _merge_heads(x: Tensor) -> Tensor:
    B, H, T, dh = x.shape
    return x.transpose(1, 2).reshape(B, T, H * dh)


class LinearAttention(nn.Module):
    """Multi-head causal linear attention, ready to drop into a model.

    Projections -> heads -> feature map -> `linear_attention` (optionally with a decay) ->
    optional per-head output norm -> output projection. `forward(x, state=..., pos_offset=...,
    return_state=True)` resumes from a previous state, so generation is the same call with T = 1.

    Args:
        d_model, n_heads: model width and number of heads (d_model % n_heads == 0).
        kind: one of "performer", "linear", "cosformer", "retnet", "ssd" (see the module doc).
        num_features: random features per head for "performer" (default floor(d ln d)).
        max_len: cosFormer's M, the longest sequence the re-weighting is defined for.
        seed: seed of the Performer projection.
        chunk_size: chunk length of the chunked algorithm.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        kind: str = "linear",
        num_features: Optional[int] = None,
        max_len: int = 1024,
        seed: Optional[int] = 0,
        chunk_size: int = 64,
    ) -> None:
        super().__init__()
        fn = "LinearAttention"
        V.check_choice(fn, "kind", kind, LINEAR_KINDS)
        if d_model % n_heads:
            raise ValueError(f"{fn}: d_model={d_model} must be divisible by n_heads={n_heads}")
        self.kind, self.n_heads, self.d_head = kind, n_heads, d_model // n_heads
        self.max_len, self.chunk_size = max_len, chunk_size
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.normalize = kind in ("performer", "linear", "cosformer")
        if kind == "performer":
            self.feature_map = RandomFeatureMap(self.d_head, num_features, kind="positive", seed=seed)
        if kind == "retnet":
            self.register_buffer("log_decay", retnet_log_decay(n_heads).float())
        if kind == "ssd":
            self.decay_proj = nn.Linear(d_model, n_heads)
            # softplus(b) = -log(0.95): tokens start out remembering ~20 steps back
            nn.init.zeros_(self.decay_proj.weight)
            nn.init.constant_(self.decay_proj.bias, math.log(math.expm1(-math.log(0.95))))
        if not self.normalize:
            self.out_norm = nn.Parameter(torch.ones(self.d_head))

    def _features(self, q: Tensor, k: Tensor, pos_offset: int) -> tuple[Tensor, Tensor]:
        if self.kind == "linear":
            return elu_plus_one(q), elu_plus_one(k)
        if self.kind == "performer":
            # queries: subtract each row's max (cancels in that query's ratio); keys: no
            # stabiliser, because a max over all keys would change as tokens arrive and break
            # the equality of the parallel and the recurrent forms
            fm = self.feature_map
            return fm(q, is_query=True, stabilize=True), fm(k, is_query=False, stabilize=False)
        if self.kind == "cosformer":
            T = q.shape[2]
            if pos_offset + T > self.max_len:
                raise ValueError(f"LinearAttention(cosformer): position {pos_offset + T} exceeds max_len={self.max_len} (M)")
            i = torch.arange(pos_offset + 1, pos_offset + T + 1, device=q.device, dtype=torch.float64)
            ang = (math.pi / 2 * i / self.max_len).to(q.dtype)[:, None]
            rq, rk = F.relu(q), F.relu(k)
            # cos(a_i - a_j) = cos a_i cos a_j + sin a_i sin a_j: one linear attention on [cos, sin] features
            return torch.cat([rq * ang.cos(), rq * ang.sin()], -1), torch.cat([rk * ang.cos(), rk * ang.sin()], -1)
        return q * self.d_head**-0.5, k  # retnet / ssd: no feature map, scaled like softmax

    def _decay(self, x: Tensor) -> Optional[Tensor]:
        if self.kind == "retnet":
            return self.log_decay.to(x.dtype)
        if self.kind == "ssd":
            return -F.softplus(self.decay_proj(x)).transpose(1, 2)  # (B, H, T), data-dependent
        return None

    def forward(
        self,
        x: Tensor,
        *,
        state: Optional[LinearAttentionState] = None,
        pos_offset: int = 0,
        return_state: bool = False,
    ):
        """x: (B, T, d_model) -> (B, T, d_model) [, new state]."""
        q, k, v = (_split_heads(t, self.n_heads) for t in self.qkv(x).chunk(3, dim=-1))
        phi_q, phi_k = self._features(q, k, pos_offset)
        o, new_state = linear_attention(
            phi_q, phi_k, v, causal=True, normalize=self.normalize, log_decay=self._decay(x),
            chunk_size=self.chunk_size, initial_state=state, return_state=True,
        )
        if not self.normalize:
            o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * self.out_norm
        y = self.proj(_merge_heads(o))
        return (y, new_state) if return_state else y


class SoftmaxAttention(nn.Module):
    """Causal multi-head softmax attention with a KV cache for generation (the baseline)."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"SoftmaxAttention: d_model={d_model} must be divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: Tensor, *, state: Optional[tuple[Tensor, Tensor]] = None, pos_offset: int = 0, return_state: bool = False):
        q, k, v = (_split_heads(t, self.n_heads) for t in self.qkv(x).chunk(3, dim=-1))
        if state is not None:  # the KV cache: every past key and value
            k, v = torch.cat([state[0], k], dim=2), torch.cat([state[1], v], dim=2)
        T, S = q.shape[2], k.shape[2]
        # query t (absolute position S - T + t) may see keys 0 .. S - T + t
        mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(diagonal=S - T)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = self.proj(_merge_heads(o))
        return (y, (k, v)) if return_state else y


@dataclass
class ModelConfig:
    """Size and attention choice of a `TinyLM`. `softmax_layers` makes a hybrid model."""

    vocab_size: int
    block_size: int = 128
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    attention: str = "linear"
    num_features: Optional[int] = None
    softmax_layers: tuple = field(default_factory=tuple)
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        kind = "softmax" if layer in cfg.softmax_layers else cfg.attention
        if kind == "softmax":
            self.attn = SoftmaxAttention(cfg.d_model, cfg.n_head)
        else:
            self.attn = LinearAttention(
                cfg.d_model, cfg.n_head, kind=kind, num_features=cfg.num_features,
                max_len=cfg.block_size, seed=cfg.seed + layer,
            )
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model))

    def forward(self, x, *, state=None, pos_offset=0):
        a, state = self.attn(self.ln1(x), state=state, pos_offset=pos_offset, return_state=True)
        x = x + a
        return x + self.mlp(self.ln2(x)), state


class TinyLM(nn.Module):
    """A GPT-style decoder-only language model with pluggable attention.

    `forward(idx, targets)` is the parallel (training) form; `generate` prefills the prompt in
    parallel and then decodes one token at a time from the per-layer states (a constant-size
    state for linear layers, a KV cache for softmax layers).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        V.check_choice("TinyLM", "attention", cfg.attention, ATTENTION_KINDS)
        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied embeddings
        for name, p in self.named_parameters():
            if p.dim() == 2 and "feature_map" not in name and "decay_proj" not in name:
                nn.init.normal_(p, std=0.02)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: Tensor, targets: Optional[Tensor] = None, *, states=None, pos_offset: int = 0, return_states: bool = False):
        """idx: (B, T) token ids -> logits (B, T, vocab) [, loss] [, states]."""
        V.check_tensor("TinyLM", "idx", idx, ndim=2, floating=False)
        B, T = idx.shape
        if pos_offset + T > self.cfg.block_size:
            raise ValueError(f"TinyLM: positions up to {pos_offset + T} exceed block_size={self.cfg.block_size}")
        pos = torch.arange(pos_offset, pos_offset + T, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        states = states or [None] * len(self.blocks)
        new_states = []
        for block, st in zip(self.blocks, states):
            x, st = block(x, state=st, pos_offset=pos_offset)
            new_states.append(st)
        logits = self.head(self.ln_f(x))
        out = (logits,)
        if targets is not None:
            out += (F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)),)
        if return_states:
            out += (new_states,)
        return out[0] if len(out) == 1 else out

    @torch.no_grad()
    def stepwise_logits(self, idx: Tensor) -> Tensor:
        """Logits computed one token at a time from the recurrent states (equals `forward`)."""
        states, outs = None, []
        for t in range(idx.shape[1]):
            logits, states = self(idx[:, t : t + 1], states=states, pos_offset=t, return_states=True)
            outs.append(logits)
        return torch.cat(outs, dim=1)

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, *, temperature: float = 1.0, greedy: bool = False, generator: Optional[torch.Generator] = None) -> Tensor:
        """Continue `idx` (B, T0) by `max_new_tokens` tokens, up to block_size in total."""
        if idx.shape[1] + max_new_tokens > self.cfg.block_size:
            raise ValueError(
                f"TinyLM.generate: prompt {idx.shape[1]} + {max_new_tokens} new tokens exceeds block_size={self.cfg.block_size}"
            )
        logits, states = self(idx, states=None, return_states=True)
        out = [idx]
        pos = idx.shape[1]
        for _ in range(max_new_tokens):
            last = logits[:, -1] / max(temperature, 1e-8)
            nxt = last.argmax(-1, keepdim=True) if greedy else torch.multinomial(torch.softmax(last, -1), 1, generator=generator)
            out.append(nxt)
            logits, states = self(nxt, states=states, pos_offset=pos, return_states=True)
            pos += 1
        return torch.cat(out, dim=1)

    def state_nbytes(self, states) -> int:
        """Bytes held by per-layer generation states (KV caches grow, linear states do not)."""
        total = 0
        for st in states:
            for t in st:
                if t is not None:
                    total += t.numel() * t.element_size()
        return total
