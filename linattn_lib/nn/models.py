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
| "deltanet"  | L2-normalised q, k         | none; the delta rule, beta_t = sigmoid(w . x_t) | no (+ norm)|
| "gated_deltanet" | L2-normalised q, k    | as "ssd", on the delta rule           | no (+ norm)|

Unnormalised variants (RetNet, Mamba-2 / SSD style, the delta rule) normalise each head's
output instead (a per-head RMS norm, as RetNet's GroupNorm does). The two delta-rule kinds
run `delta_rule_attention` (core/delta.py) instead of `linear_attention`: the state is
corrected towards v_t for the key k_t (S <- S - beta_t k_t (k_t^T S - v_t^T)) instead of
only added to, which needs unit keys and beta in [0, 2] to stay bounded.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _validate as V
from ..core.decode import linear_attention_decode_step
from ..core.delta import delta_rule_attention, delta_rule_decode_step
from ..core.features import RandomFeatureMap, elu_plus_one
from ..core.linear import linear_attention
from ..core.ssm import retnet_log_decay
from ..core.state import LinearAttentionState
from ..core.varlen import check_cu_seqlens

# what one layer carries between calls: a linear layer's state, a softmax layer's KV cache
LayerState = LinearAttentionState | tuple[Tensor, Tensor] | None

ATTENTION_KINDS = ("softmax", "performer", "linear", "cosformer", "retnet", "ssd", "deltanet", "gated_deltanet")
DELTA_KINDS = ("deltanet", "gated_deltanet")
LINEAR_KINDS = ATTENTION_KINDS[1:]


def _check_width(fn: str, d_model, n_heads, heads_name: str = "n_heads") -> None:
    """d_model and the number of heads are positive ints and the heads split d_model evenly."""
    V.check_positive_int(fn, "d_model", d_model)
    V.check_positive_int(fn, heads_name, n_heads)
    if d_model % n_heads:
        raise ValueError(
            f"{fn}: `d_model`={d_model} must be divisible by `{heads_name}`={n_heads} "
            f"(each head gets d_model // {heads_name} channels)"
        )


def _check_input(fn: str, x, module: nn.Module, d_model: int) -> None:
    """x: (B, T, d_model), B, T >= 1, in the dtype and on the device of the module's weights."""
    V.check_layout(fn, "x", x, ("B", "T", "d_model"))
    if x.shape[-1] != d_model:
        raise ValueError(f"{fn}: `x` has {x.shape[-1]} channels; expected (B, T, d_model) with d_model={d_model}, got {V.describe(x)}")
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{fn}: `x` must have B >= 1 and T >= 1, got {V.describe(x)}")
    w = next(module.parameters())
    if x.dtype != w.dtype:
        raise TypeError(f"{fn}: `x` has dtype {x.dtype} but the module's weights are {w.dtype}; cast one of them")
    if x.device != w.device:
        raise ValueError(f"{fn}: `x` is on {x.device} but the module's weights are on {w.device}")


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
        kind: one of "performer", "linear", "cosformer", "retnet", "ssd", "deltanet",
            "gated_deltanet" (see the module doc).
        num_features: random features per head for "performer" (default floor(d ln d)).
        max_len: cosFormer's M, the longest sequence the re-weighting is defined for.
        seed: seed of the Performer projection.
        chunk_size: chunk length of the chunked algorithm.
        backend: "auto" (the Triton kernels for CUDA inputs they support, torch otherwise),
            "torch" or "triton"; passed to `linear_attention` / `delta_rule_attention`.
        activation: None or "silu": applied to q, k and v after the projection, before the
            kind's feature map (fla's layers without a short convolution do this; Gated
            DeltaNet then L2-normalises q and k, as every delta kind here does).
        gate: how "ssd" and "gated_deltanet" make their decay: "softplus" (g = -softplus(w.x
            + b), starting at 0.95 a token) or "mamba" (Mamba-2's and fla's Gated DeltaNet:
            g = -exp(A_log) softplus(w.x + dt_bias), A ~ U(0, 16), dt ~ logU(0.001, 0.1)).
        output_gate: multiply the per-head RMS-normalised output by silu(W_g x) (fla's
            FusedRMSNormGated; Qwen3-Next, Kimi Linear) before the output projection.

    `forward(x, cu_seqlens=...)` takes packed sequences (B = 1, the sequences end to end, as
    flash-attn's varlen functions do; cosFormer's positions restart at each sequence), with one
    state row per sequence. A one-token call with a state and no gradient (generation under
    `torch.no_grad()`) runs the library's decode step instead of the chunked form: the same
    output, a fraction of the work. `reset_parameters()` restores the initial weights after a
    host model's own initialisation (nanoGPT's `_init_weights` would reset the decay's bias).
    Under `torch.compile` the value checks are skipped (see `linear_attention`): a NaN or inf
    in the input is then not refused.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        kind: str = "linear",
        num_features: int | None = None,
        max_len: int = 1024,
        seed: int | None = 0,
        chunk_size: int = 64,
        backend: str = "auto",
        activation: str | None = None,
        gate: str = "softplus",
        output_gate: bool = False,
    ) -> None:
        super().__init__()
        fn = "LinearAttention"
        V.check_choice(fn, "kind", kind, LINEAR_KINDS)
        V.check_choice(fn, "backend", backend, ("auto", "torch", "triton"))
        V.check_choice(fn, "activation", activation, (None, "silu"))
        V.check_choice(fn, "gate", gate, ("softplus", "mamba"))
        self.backend, self.activation, self.gate = backend, activation, gate
        self.output_gate = V.check_flag(fn, "output_gate", output_gate)
        _check_width(fn, d_model, n_heads)
        V.check_positive_int(fn, "max_len", max_len)
        V.check_positive_int(fn, "chunk_size", chunk_size)
        if num_features is not None:
            V.check_positive_int(fn, "num_features", num_features)
        seed = V.check_seed(fn, "seed", seed)
        d_model, n_heads, max_len, chunk_size = int(d_model), int(n_heads), int(max_len), int(chunk_size)
        self.d_model = d_model
        self.kind, self.n_heads, self.d_head = kind, n_heads, d_model // n_heads
        self.max_len, self.chunk_size = max_len, chunk_size
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.normalize = kind in ("performer", "linear", "cosformer")
        if kind == "performer":
            self.feature_map = RandomFeatureMap(self.d_head, num_features, kind="positive", seed=seed)
        if kind == "retnet":
            self.register_buffer("log_decay", retnet_log_decay(n_heads).float())
        if kind in DELTA_KINDS:
            self.beta_proj = nn.Linear(d_model, n_heads)  # beta_t = sigmoid(.) in (0, 1)
        if kind in ("ssd", "gated_deltanet"):
            self.decay_proj = nn.Linear(d_model, n_heads, bias=gate == "softplus")
            if gate == "mamba":
                self.A_log = nn.Parameter(torch.zeros(n_heads))
                self.dt_bias = nn.Parameter(torch.zeros(n_heads))
            self._init_decay()
        if not self.normalize or self.output_gate:
            self.out_norm = nn.Parameter(torch.ones(self.d_head))
        if self.output_gate:
            self.gate_proj = nn.Linear(d_model, d_model, bias=False)

    def _init_decay(self) -> None:
        if self.gate == "mamba":  # as fla's GatedDeltaNet (and Mamba-2): A ~ U(0, 16), dt ~ logU(1e-3, 0.1)
            self.decay_proj.reset_parameters()
            with torch.no_grad():
                self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0, 16).log())
                lo, hi = math.log(1e-3), math.log(0.1)
                dt = torch.exp(torch.rand_like(self.dt_bias) * (hi - lo) + lo).clamp(min=1e-4)
                self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
            return
        # softplus(b) = -log(0.95): tokens start out remembering ~20 steps back
        nn.init.zeros_(self.decay_proj.weight)
        nn.init.constant_(self.decay_proj.bias, math.log(math.expm1(-math.log(0.95))))

    def reset_parameters(self) -> None:
        """Re-initialise every parameter as the constructor did (new random weights, the decay
        starting at 0.95 per token, output norm at one); the Performer projection is kept."""
        self.qkv.reset_parameters()
        self.proj.reset_parameters()
        if hasattr(self, "beta_proj"):
            self.beta_proj.reset_parameters()
        if hasattr(self, "decay_proj"):
            self._init_decay()
        if hasattr(self, "out_norm"):
            nn.init.ones_(self.out_norm)
        if hasattr(self, "gate_proj"):
            self.gate_proj.reset_parameters()

    def _features(self, q: Tensor, k: Tensor, pos_offset: int, cu_seqlens: Tensor | None = None,
                  ) -> tuple[Tensor, Tensor]:
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
            if cu_seqlens is not None:  # positions restart at every packed sequence
                starts = cu_seqlens[:-1].to(q.device)
                i = i - torch.repeat_interleave(starts, cu_seqlens.diff(), output_size=T).double()
            ang = (math.pi / 2 * i / self.max_len).to(q.dtype)[:, None]
            rq, rk = F.relu(q), F.relu(k)
            # cos(a_i - a_j) = cos a_i cos a_j + sin a_i sin a_j: one linear attention on [cos, sin] features
            return torch.cat([rq * ang.cos(), rq * ang.sin()], -1), torch.cat([rk * ang.cos(), rk * ang.sin()], -1)
        if self.kind in DELTA_KINDS:  # unit keys keep the delta rule's transitions contracting
            return F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        return q * self.d_head**-0.5, k  # retnet / ssd: no feature map, scaled like softmax

    def _decay(self, x: Tensor) -> Tensor | None:
        if self.kind == "retnet":
            return self.log_decay.to(x.dtype)
        if self.kind in ("ssd", "gated_deltanet"):
            # -softplus(z) as logsigmoid(-z), the same function: AOT autograd (backend="aot_eager",
            # torch 2.13) compiled softplus's backward after a cumsum into a failing view
            if self.gate == "mamba":
                z = self.decay_proj(x) + self.dt_bias
                return (self.A_log.exp() * F.logsigmoid(-z)).transpose(1, 2)
            return F.logsigmoid(-self.decay_proj(x)).transpose(1, 2)  # (B, H, T), data-dependent
        return None

    def forward(
        self,
        x: Tensor,
        *,
        state: LinearAttentionState | None = None,
        pos_offset: int = 0,
        return_state: bool = False,
        cu_seqlens: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, LinearAttentionState]:
        """x: (B, T, d_model) -> (B, T, d_model) [, new state].

        `state` is a LinearAttentionState(S (B, H, F, d_head), z (B, H, F) when normalised),
        F = `feature_size`, as returned with return_state=True; `pos_offset` (>= 0) is the
        position of x's first token (cosFormer's re-weighting depends on it). With
        `cu_seqlens` ((N + 1,) cumulative starts, B = 1) the state has N rows, one a sequence.
        """
        fn = "LinearAttention"
        _check_input(fn, x, self, self.d_model)
        pos_offset = V.check_int(fn, "pos_offset", pos_offset, low=0)
        return_state = V.check_flag(fn, "return_state", return_state)
        rows = x.shape[0] if cu_seqlens is None else check_cu_seqlens(fn, cu_seqlens, x.shape[1], x.device)
        if cu_seqlens is not None and x.shape[0] != 1:
            raise ValueError(f"{fn}: with `cu_seqlens` the sequences are packed along T, so B must be 1, "
                             f"got `x` with {V.describe(x)}")
        if state is not None:
            self.check_state(fn, "state", state, batch=rows, device=x.device)
        return self._forward(x, state=state, pos_offset=pos_offset, return_state=return_state,
                             cu_seqlens=cu_seqlens)

    def _decode(self, q, k, v, beta, g, state):
        """One token from `state` with the decode-step functions (no gradient): o (B, H, 1, Dv)."""
        g_t = None if g is None else (g if g.dim() == 1 else g[:, :, 0])
        if self.kind in DELTA_KINDS:
            o, new = delta_rule_decode_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], beta[:, :, 0], state, log_decay=g_t)
            return o.unsqueeze(2), new
        new = LinearAttentionState(state[0].clone(), None if state[1] is None else state[1].clone())
        o = linear_attention_decode_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], new, log_decay_t=g_t,
                                         normalize=self.normalize, backend=self.backend)
        return o.unsqueeze(2), new

    @property
    def feature_size(self) -> int:
        """F, the size of the features phi(q), phi(k); the state S is (B, H, F, d_head)."""
        if self.kind == "performer":
            return self.feature_map.out_features
        if self.kind == "cosformer":
            return 2 * self.d_head
        return self.d_head

    def check_state(self, fn: str, name: str, state: object, *, batch: int, device: torch.device) -> None:
        """`state` fits this layer: S (batch, H, F, d_head) [and z (batch, H, F)], finite, on `device`."""
        V.check_state(
            fn, name, state, B=batch, H=self.n_heads, Dk=self.feature_size, Dv=self.d_head,
            device=device, normalize=self.normalize,
        )

    def _forward(self, x: Tensor, *, state=None, pos_offset: int = 0, return_state: bool = False,
                 cu_seqlens: Tensor | None = None):
        """`forward` without the input checks (for callers that checked already)."""
        qkv = self.qkv(x)
        if self.activation == "silu":
            qkv = F.silu(qkv)
        q, k, v = (_split_heads(t, self.n_heads) for t in qkv.chunk(3, dim=-1))
        phi_q, phi_k = self._features(q, k, pos_offset, cu_seqlens)
        g = self._decay(x)
        beta = torch.sigmoid(self.beta_proj(x)).transpose(1, 2) if self.kind in DELTA_KINDS else None  # (B, H, T)
        if x.shape[1] == 1 and state is not None and cu_seqlens is None and not torch.is_grad_enabled():
            o, new_state = self._decode(phi_q, phi_k, v, beta, g, state)
        elif self.kind in DELTA_KINDS:
            o, new_state = delta_rule_attention(
                phi_q, phi_k, v, beta, log_decay=g, chunk_size=self.chunk_size, initial_state=state,
                return_state=True, backend=self.backend, cu_seqlens=cu_seqlens,
            )
        else:
            o, new_state = linear_attention(
                phi_q, phi_k, v, causal=True, normalize=self.normalize, log_decay=g, chunk_size=self.chunk_size,
                initial_state=state, return_state=True, backend=self.backend, cu_seqlens=cu_seqlens,
            )
        if not self.normalize or self.output_gate:
            o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * self.out_norm
        if self.output_gate:
            o = o * F.silu(_split_heads(self.gate_proj(x), self.n_heads))
        y = self.proj(_merge_heads(o))
        return (y, new_state) if return_state else y


class SoftmaxAttention(nn.Module):
    """Causal multi-head softmax attention with a KV cache for generation (the baseline)."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        _check_width("SoftmaxAttention", d_model, n_heads)
        self.n_heads, self.d_head = n_heads, d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def reset_parameters(self) -> None:
        """Re-initialise the projections as the constructor did."""
        self.qkv.reset_parameters()
        self.proj.reset_parameters()

    def check_state(self, fn: str, name: str, state: object, *, batch: int, device: torch.device) -> None:
        """`state` is a KV cache (keys, values), each (batch, H, S, d_head), S >= 1, finite, on `device`."""
        if not isinstance(state, (tuple, list)) or len(state) != 2:
            raise TypeError(f"{fn}: `{name}` must be a KV cache (keys, values) of a softmax layer, got {type(state).__name__}")
        for part, t in zip(("keys", "values"), state):
            V.check_layout(fn, f"{name}[{part!r}]", t, ("B", "H", "S", "d_head"))
            S = t.shape[2]
            V.check_shape(fn, f"{name}[{part!r}]", t, (batch, self.n_heads, S, self.d_head), ("B", "H", "S", "d_head"))
            if t.device != device:
                raise ValueError(f"{fn}: `{name}` is on {t.device} but the inputs are on {device}")
            V.check_values(fn, f"{name}[{part!r}]", t)
        if state[0].shape != state[1].shape:
            raise ValueError(f"{fn}: `{name}` keys {tuple(state[0].shape)} and values {tuple(state[1].shape)} must have one shape")

    def forward(
        self, x: Tensor, *, state: tuple[Tensor, Tensor] | None = None, pos_offset: int = 0,
        return_state: bool = False,
    ) -> Tensor | tuple[Tensor, tuple[Tensor, Tensor]]:
        return self._forward(x, state=state, pos_offset=pos_offset, return_state=return_state)

    def _forward(self, x: Tensor, *, state: tuple[Tensor, Tensor] | None = None, pos_offset: int = 0, return_state: bool = False):
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
    """Size and attention choice of a `TinyLM`. `softmax_layers` makes a hybrid model.

    Attributes:
        vocab_size: the number of token ids.
        block_size: the longest sequence, prompt and generated tokens together (positions
            are learnt embeddings; cosFormer's M).
        n_layer: the number of blocks.
        n_head: heads per attention layer (`d_model` % `n_head` == 0).
        d_model: the model width.
        attention: the attention of every layer: "softmax", "performer", "linear",
            "cosformer", "retnet", "ssd", "deltanet" or "gated_deltanet" (see `LinearAttention`).
        num_features: random features per head for "performer" (default floor(d ln d)).
        softmax_layers: indices of the layers that use softmax attention instead, e.g. (0,).
        seed: seed of the initial weights and of the Performer projections.
    """

    vocab_size: int
    block_size: int = 128
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    attention: str = "linear"
    num_features: int | None = None
    softmax_layers: tuple = field(default_factory=tuple)
    seed: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, fn: str = "ModelConfig") -> None:
        """Every field has a usable value; raises otherwise (called on creation and by TinyLM)."""
        for name in ("vocab_size", "block_size", "n_layer"):
            V.check_positive_int(fn, name, getattr(self, name))
        _check_width(fn, self.d_model, self.n_head, "n_head")
        V.check_choice(fn, "attention", self.attention, ATTENTION_KINDS)
        if self.num_features is not None:
            V.check_positive_int(fn, "num_features", self.num_features)
        V.check_seed(fn, "seed", self.seed)
        layers = self.softmax_layers
        if isinstance(layers, (str, bytes)) or not isinstance(layers, (tuple, list, range)):
            raise TypeError(
                f"{fn}: `softmax_layers` must be a tuple of layer indices, e.g. (0,) for a softmax first "
                f"layer, got {type(layers).__name__} {layers!r}"
            )
        for i in layers:
            if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < self.n_layer:
                raise ValueError(
                    f"{fn}: `softmax_layers` holds {i!r}; expected layer indices in 0..{self.n_layer - 1} "
                    f"(n_layer={self.n_layer}), got {tuple(layers)!r}"
                )
        if len(set(int(i) for i in layers)) != len(layers):
            raise ValueError(f"{fn}: `softmax_layers` lists a layer twice: {tuple(layers)!r}")

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

    def forward(self, x: Tensor, *, state: LayerState = None, pos_offset: int = 0) -> tuple[Tensor, LayerState]:
        a, state = self.attn._forward(self.ln1(x), state=state, pos_offset=pos_offset, return_state=True)
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
        V.check_instance("TinyLM", "cfg", cfg, ModelConfig, "a ModelConfig")
        cfg.validate("TinyLM")  # the fields may have been changed since the config was made
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

    def _check_idx(self, fn: str, name: str, idx, *, allow_ignore: bool = False) -> None:
        """Token ids: an integer (B, T) tensor, B, T >= 1, every id in [0, vocab_size)."""
        V.check_tensor(fn, name, idx, layout=("B", "T"), floating=False)
        if idx.dtype == torch.bool or idx.is_floating_point() or idx.is_complex():
            raise TypeError(f"{fn}: `{name}` must hold integer token ids (e.g. torch.long), got {V.describe(idx)}")
        if idx.shape[0] == 0 or idx.shape[1] == 0:
            raise ValueError(f"{fn}: `{name}` must have B >= 1 and T >= 1, got {V.describe(idx)}")
        vocab = self.cfg.vocab_size
        ids = idx[idx != -100] if allow_ignore else idx
        if ids.numel() and (bool((ids < 0).any()) or bool((ids >= vocab).any())):
            ignore = " (or -100, ignored by the loss)" if allow_ignore else ""
            raise ValueError(
                f"{fn}: `{name}` holds token ids in [{int(ids.min())}, {int(ids.max())}]; expected ids in "
                f"[0, vocab_size) = [0, {vocab}){ignore}"
            )

    def _check_states(self, fn: str, states, batch: int, device) -> None:
        """One state per layer (None for a layer that starts fresh), each fitting its layer."""
        if not isinstance(states, (list, tuple)) or len(states) != len(self.blocks):
            got = f"{type(states).__name__} of length {len(states)}" if isinstance(states, (list, tuple)) else type(states).__name__
            raise ValueError(
                f"{fn}: `states` must be a list of n_layer={len(self.blocks)} per-layer states "
                f"(as returned with return_states=True), got {got}"
            )
        for i, (block, st) in enumerate(zip(self.blocks, states)):
            if st is not None:
                block.attn.check_state(fn, f"states[{i}]", st, batch=batch, device=device)

    def forward(
        self, idx: Tensor, targets: Tensor | None = None, *,
        states: Sequence[LayerState] | None = None, pos_offset: int = 0, return_states: bool = False,
    ) -> Tensor | tuple[Tensor, ...]:
        """idx: (B, T) token ids -> logits (B, T, vocab) [, loss] [, states].

        targets: (B, T) ids for the cross-entropy loss (-100 marks a position to ignore).
        states / pos_offset: resume from the per-layer states of a previous call that ended at
        position pos_offset (what `generate` does).
        """
        fn = "TinyLM"
        self._check_idx(fn, "idx", idx)
        if targets is not None:
            self._check_idx(fn, "targets", targets, allow_ignore=True)
            if targets.shape != idx.shape:
                raise ValueError(f"{fn}: `targets` has shape {tuple(targets.shape)}; expected the shape of `idx`, {tuple(idx.shape)}")
        pos_offset = V.check_int(fn, "pos_offset", pos_offset, low=0)
        return_states = V.check_flag(fn, "return_states", return_states)
        if states is not None:
            self._check_states(fn, states, idx.shape[0], idx.device)
        return self._forward(idx, targets, states=states, pos_offset=pos_offset, return_states=return_states)

    def _forward(self, idx: Tensor, targets: Tensor | None = None, *, states=None, pos_offset: int = 0, return_states: bool = False):
        """`forward` without the input checks (for `generate`, whose inputs were checked once)."""
        B, T = idx.shape
        if pos_offset + T > self.cfg.block_size:
            raise ValueError(
                f"TinyLM: positions up to {pos_offset + T} (`pos_offset`={pos_offset} + T={T}) exceed "
                f"block_size={self.cfg.block_size}"
            )
        pos = torch.arange(pos_offset, pos_offset + T, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        states = [None] * len(self.blocks) if states is None else states
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
        self._check_idx("TinyLM.stepwise_logits", "idx", idx)
        states, outs = None, []
        for t in range(idx.shape[1]):
            logits, states = self._forward(idx[:, t : t + 1], states=states, pos_offset=t, return_states=True)
            outs.append(logits)
        return torch.cat(outs, dim=1)

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, *, temperature: float = 1.0, greedy: bool = False, generator: torch.Generator | None = None) -> Tensor:
        """Continue `idx` (B, T0) by `max_new_tokens` (>= 0) tokens, up to block_size in total.

        Samples from softmax(logits / temperature) (temperature > 0, finite), or takes the
        argmax when greedy=True.
        """
        fn = "TinyLM.generate"
        self._check_idx(fn, "idx", idx)
        max_new_tokens = V.check_int(fn, "max_new_tokens", max_new_tokens, low=0)
        temperature = V.check_finite_number(fn, "temperature", temperature, positive=True)
        greedy = V.check_flag(fn, "greedy", greedy)
        if generator is not None:
            V.check_instance(fn, "generator", generator, torch.Generator, "None or a torch.Generator")
        if idx.shape[1] + max_new_tokens > self.cfg.block_size:
            raise ValueError(
                f"{fn}: prompt {idx.shape[1]} + {max_new_tokens} new tokens (`max_new_tokens`) exceeds block_size={self.cfg.block_size}"
            )
        logits, states = self._forward(idx, states=None, return_states=True)
        out = [idx]
        pos = idx.shape[1]
        for _ in range(max_new_tokens):
            last = logits[:, -1] / temperature
            nxt = last.argmax(-1, keepdim=True) if greedy else torch.multinomial(torch.softmax(last, -1), 1, generator=generator)
            out.append(nxt)
            logits, states = self._forward(nxt, states=states, pos_offset=pos, return_states=True)
            pos += 1
        return torch.cat(out, dim=1)

    def state_nbytes(self, states: Sequence[LayerState]) -> int:
        """Bytes held by per-layer generation states (KV caches grow, linear states do not)."""
        total = 0
        for st in states:
            for t in st:
                if t is not None:
                    total += t.numel() * t.element_size()
        return total
