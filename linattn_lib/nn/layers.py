"""The attention layers of the zoo: `LinearAttention` (every linear kind) and `SoftmaxAttention`.

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

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _validate as V
from ..core.decode import decode_to_new_state
from ..core.delta import delta_rule_attention, delta_rule_decode_step
from ..core.features import RandomFeatureMap, elu_plus_one
from ..core.linear import linear_attention
from ..core.ssm import retnet_log_decay
from ..core.state import LinearAttentionState
from ..core.varlen import check_cu_seqlens
from .conv import ConvLayerState, ShortConvolution, convolve_tokens

# what one layer carries between calls: a linear layer's state (and conv cache), a softmax layer's KV cache
LayerState = LinearAttentionState | ConvLayerState | tuple[Tensor, Tensor] | None
ACTIVATIONS = (None, "silu", "relu", "elu+1", "elu", "identity")  # "elu": fla's name of elu+1

ATTENTION_KINDS = ("softmax", "performer", "linear", "cosformer", "retnet", "ssd", "deltanet", "gated_deltanet")
DELTA_KINDS = ("deltanet", "gated_deltanet")
LINEAR_KINDS = ATTENTION_KINDS[1:]


def _check_width(fn: str, d_model, n_heads, heads_name: str = "n_heads") -> None:
    """d_model and the number of heads are positive ints and the heads split d_model evenly."""
    V.check_positive_int(fn, "d_model", d_model)
    V.check_positive_int(fn, heads_name, n_heads)
    if d_model % n_heads:
        raise ValueError(f"{fn}: `d_model`={d_model} must be divisible by `{heads_name}`={n_heads} "
                         f"(each head gets d_model // {heads_name} channels)")


def _check_input(fn: str, x, module: nn.Module, d_model: int) -> None:
    """x: (B, T, d_model), B, T >= 1, on the device of the module's weights, in their dtype
    (or, under torch.autocast, in any floating dtype: as nn.Linear, the projections cast)."""
    V.check_layout(fn, "x", x, ("B", "T", "d_model"))
    if x.shape[-1] != d_model:
        raise ValueError(f"{fn}: `x` has {x.shape[-1]} channels; expected (B, T, d_model) with d_model={d_model}, got {V.describe(x)}")
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{fn}: `x` must have B >= 1 and T >= 1, got {V.describe(x)}")
    w = next(module.parameters())
    if x.dtype != w.dtype and not (x.is_floating_point() and torch.is_autocast_enabled(x.device.type)):
        raise TypeError(f"{fn}: `x` has dtype {x.dtype} but the module's weights are {w.dtype}; cast one of them")
    if x.device != w.device:
        raise ValueError(f"{fn}: `x` is on {x.device} but the module's weights are on {w.device}")


def _split_heads(x: Tensor, n_heads: int) -> Tensor:
    B, T, C = x.shape
    return x.view(B, T, n_heads, C // n_heads).transpose(1, 2)  # (B, H, T, dh)


def _merge_heads(x: Tensor) -> Tensor:
    B, H, T, dh = x.shape
    return x.transpose(1, 2).reshape(B, T, H * dh)


class _SoftplusGate(nn.Linear):
    """The decay's projection for gate="softplus", log a_t = -softplus(w . x_t + b). It starts
    at w = 0 and softplus(b) = -log(0.95): every token keeps 95% of the state (it remembers
    about 20 tokens back). Its own `reset_parameters` does that, so that resets in any order
    end with it (FSDP resets a parent before its children)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        # nn.Linear's random draw, discarded: the weights built after this one get the random
        # numbers they always got (the book's committed results were trained from them)
        nn.Linear.reset_parameters(self)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)
        nn.init.constant_(self.bias, math.log(math.expm1(-math.log(0.95))))


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
        max_len: cosFormer's M, the longest sequence the re-weighting is defined for (packed
            sequences and padded rows count each sequence's own tokens).
        seed: seed of the Performer projection.
        chunk_size: chunk length of the chunked algorithm.
        form: "chunked" (the fast one), "recurrent" or "quadratic", passed on as `chunk_size` is:
            the two plain-torch forms also have second derivatives (a gradient penalty).
        backend: "auto" (the Triton kernels for CUDA inputs they support, torch otherwise),
            "torch" or "triton"; passed to `linear_attention` / `delta_rule_attention`.
        activation: None (the bare mechanism: nothing), or fla's `qk_activation`: "silu",
            "relu", "elu+1" (fla: "elu") or "identity" on q and k, with SiLU on v in every case (fla's
            DeltaNet). Applied after the projection (and the convolution), before the kind's
            feature map; the delta kinds then L2-normalise q and k, as fla's qk_norm="l2".
        short_conv: a causal depthwise convolution (`ShortConvolution`, kernel `conv_size`) on
            the projected q, k, v, before the activation; the layer's state then becomes a
            `ConvLayerState(attn, conv)` that carries its last conv_size - 1 inputs.
        beta_bias: whether the delta kinds' beta projection has a bias (fla's has none).
        norm_eps: epsilon of the per-head output RMS norm (fla: 1e-5).
        q_scale: the delta kinds multiply the unit queries by d_head^-0.5 (fla's kernels'
            default `scale`; the output norm undoes it except where the norm's eps matters).
        gate: how "ssd" and "gated_deltanet" make their decay: "softplus" (g = -softplus(w.x
            + b), starting at 0.95 a token) or "mamba" (fla's Gated DeltaNet, after Mamba-2:
            g = -exp(A_log) softplus(w.x + dt_bias), A ~ U(0, 16) as in fla, where Mamba-2
            draws A ~ U(1, 16); dt ~ logU(0.001, 0.1)).
        output_gate: multiply the per-head RMS-normalised output by silu(W_g x) (fla's
            FusedRMSNormGated; Qwen3-Next, Kimi Linear) before the output projection.
        write: the delta kinds' write rule: "delta" (S <- S + beta k (v - S^T k)^T) or
            "additive" (S <- S + beta k v^T: the same unit keys, beta, decay and output norm,
            a running sum instead of the correction; chapter 10's control for the write rule).
        keep_chunk_states: passed to `linear_attention` (the layers that run on it: not
            a delta kind with write="delta"): on the Triton path, keep every chunk's state from the forward for
            the backward instead of recomputing it; one pass fewer, more memory.

    `forward(x, cu_seqlens=...)` takes packed sequences (B = 1, the sequences end to end, as
    flash-attn's varlen functions do; cosFormer's positions restart at each sequence), with one
    state row per sequence. A one-token call with a state and no gradient (generation under
    `torch.no_grad()`) runs the library's decode step instead of the chunked form: the same
    output, a fraction of the work. A host model's own initialisation (nanoGPT's `_init_weights`,
    normal(0.02) for every nn.Linear) also reaches the decay's projection and sets every token
    to forget half of the state: `decay_proj.reset_parameters()` restores it (gate="softplus": a
    decay of 0.95), as `TinyLM` leaves it out; `reset_parameters()` redraws every weight of the layer.
    Under `torch.compile` the value checks are not traced (see `linear_attention`): on CUDA a NaN
    or inf in the input is then not refused (on CPU the library op the graph calls checks it).
    `torch.func` transforms work (per-sample gradients: `vmap(grad(loss))` of a
    `functional_call`; see `linear_attention`). `fla_layer(...)` builds the layer as fla
    defines it.
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
        form: str = "chunked",
        backend: str = "auto",
        activation: str | None = None,
        gate: str = "softplus",
        output_gate: bool = False,
        short_conv: bool = False,
        conv_size: int = 4,
        beta_bias: bool = True,
        norm_eps: float = 1e-6,
        q_scale: bool = False,
        write: str = "delta",
        keep_chunk_states: bool = False,
    ) -> None:
        super().__init__()
        fn = "LinearAttention"
        V.check_choice(fn, "kind", kind, LINEAR_KINDS)
        V.check_choice(fn, "backend", backend, ("auto", "torch", "triton"))
        V.check_choice(fn, "form", form, ("chunked", "recurrent", "quadratic"))
        V.check_choice(fn, "activation", activation, ACTIVATIONS)
        V.check_choice(fn, "gate", gate, ("softplus", "mamba"))
        V.check_choice(fn, "write", write, ("delta", "additive"))
        if write == "additive" and kind not in DELTA_KINDS:
            raise ValueError(f"{fn}: write='additive' applies to the delta kinds {DELTA_KINDS}; kind={kind!r} "
                             "adds to its state already")
        self.backend, self.form, self.activation, self.gate, self.write = backend, form, activation, gate, write
        self.output_gate, self.short_conv, self.q_scale, self.keep_chunk_states = (
            V.check_flag(fn, name, flag) for name, flag in (
                ("output_gate", output_gate), ("short_conv", short_conv), ("q_scale", q_scale),
                ("keep_chunk_states", keep_chunk_states)))
        self.norm_eps = V.check_finite_number(fn, "norm_eps", norm_eps, positive=True)
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
        if self.short_conv:
            self.conv = ShortConvolution(3 * d_model, conv_size)
        self.normalize = kind in ("performer", "linear", "cosformer")
        if kind == "performer":
            self.feature_map = RandomFeatureMap(self.d_head, num_features, kind="positive", seed=seed)
        if kind == "retnet":
            self.register_buffer("log_decay", retnet_log_decay(n_heads).float())
        self._make_gates(V.check_flag(fn, "beta_bias", beta_bias))

    def _make_gates(self, beta_bias: bool) -> None:
        """The delta kinds' write strength beta_t = sigmoid(w . x_t), the decay's projection, the
        output norm's scale and the output gate's projection."""
        d_model, n_heads = self.d_model, self.n_heads
        if self.kind in DELTA_KINDS:
            self.beta_proj = nn.Linear(d_model, n_heads, bias=beta_bias)
        if self.kind in ("ssd", "gated_deltanet"):
            self.decay_proj = (_SoftplusGate if self.gate == "softplus" else nn.Linear)(
                d_model, n_heads, bias=self.gate == "softplus")
            if self.gate == "mamba":
                self.A_log, self.dt_bias = nn.Parameter(torch.zeros(n_heads)), nn.Parameter(torch.zeros(n_heads))
                self.A_log._no_weight_decay = self.dt_bias._no_weight_decay = True  # as fla marks them
            self._init_decay()
        if not self.normalize or self.output_gate:
            self.out_norm = nn.Parameter(torch.ones(self.d_head))
        if self.output_gate:
            self.gate_proj = nn.Linear(d_model, d_model, bias=False)

    def _init_decay(self) -> None:
        self.decay_proj.reset_parameters()  # softplus gate (_SoftplusGate): a decay of 0.95
        if self.gate == "mamba":  # as fla's GatedDeltaNet: A ~ U(0, 16) (Mamba-2: U(1, 16)), dt ~ logU(1e-3, 0.1)
            with torch.no_grad():
                self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0, 16).log())
                lo, hi = math.log(1e-3), math.log(0.1)
                dt = torch.exp(torch.rand_like(self.dt_bias) * (hi - lo) + lo).clamp(min=1e-4)
                self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt

    def reset_parameters(self) -> None:
        """Re-initialise every parameter as the constructor did (new random weights, the decay
        starting at 0.95 per token or, gate="mamba", A and dt drawn as fla does, output norm at
        one). The fixed buffers are set again: RetNet's decays, and the Performer projection,
        redrawn from its seed (the same one; a fresh draw when the seed is None). So a model built
        on the meta device (deferred initialisation) is whole after `to_empty` and this, or after
        every submodule's own `reset_parameters` in any order, as FSDP calls them (parents
        first): each submodule with a special initialisation (softplus gate, feature map) owns it."""
        self.qkv.reset_parameters()
        self.proj.reset_parameters()
        if self.kind == "performer":
            self.feature_map.reset_parameters()
        if self.kind == "retnet":
            with torch.no_grad():
                self.log_decay.copy_(retnet_log_decay(self.n_heads))
        if hasattr(self, "beta_proj"):
            self.beta_proj.reset_parameters()
        if hasattr(self, "decay_proj"):
            self._init_decay()
        if hasattr(self, "out_norm"):
            nn.init.ones_(self.out_norm)
        if hasattr(self, "gate_proj"):
            self.gate_proj.reset_parameters()
        if self.short_conv:
            self.conv.reset_parameters()

    def _features(self, q: Tensor, k: Tensor, pos_offset: int, cu_seqlens: Tensor | None = None,
                  mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
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
            self._check_cosformer_positions(pos_offset, T, cu_seqlens, mask)
            i = torch.arange(pos_offset + 1, pos_offset + T + 1, device=q.device, dtype=torch.float64)
            if cu_seqlens is not None:  # positions restart at every packed sequence
                starts = cu_seqlens[:-1].to(q.device)
                i = i - torch.repeat_interleave(starts, cu_seqlens.diff(), output_size=T).double()
            if mask is not None:  # positions count each row's real tokens: (B, 1, T)
                i = (pos_offset + mask.double().cumsum(1))[:, None]
            ang = (math.pi / 2 * i / self.max_len).to(q.dtype)[..., None]
            rq, rk = F.relu(q), F.relu(k)
            # cos(a_i - a_j) = cos a_i cos a_j + sin a_i sin a_j: one linear attention on [cos, sin] features
            return torch.cat([rq * ang.cos(), rq * ang.sin()], -1), torch.cat([rk * ang.cos(), rk * ang.sin()], -1)
        if self.kind in DELTA_KINDS:  # unit keys keep the delta rule's transitions contracting
            q = F.normalize(q, dim=-1)
            return (q * self.d_head**-0.5 if self.q_scale else q), F.normalize(k, dim=-1)
        return q * self.d_head**-0.5, k  # retnet / ssd: no feature map, scaled like softmax

    def _check_cosformer_positions(self, pos_offset: int, T: int, cu_seqlens: Tensor | None,
                                   mask: Tensor | None) -> None:
        """Refuse positions past max_len. A row of T tokens ends at pos_offset + T; packed
        sequences restart at 1 and a padded row counts its own tokens, so there the longest
        sequence, or the most tokens in a row, is read from the values where values are checked
        (CPU tensors; CUDA ones when opted in: `_validate.values_checked`)."""
        longest = T
        if cu_seqlens is not None or mask is not None:
            counts = cu_seqlens.diff() if mask is None else mask.sum(1)
            if not (V.values_checked(counts) and counts.numel()):
                return
            longest = int(counts.max())
        if pos_offset + longest > self.max_len:
            raise ValueError(f"LinearAttention(cosformer): position {pos_offset + longest} exceeds "
                             f"max_len={self.max_len} (M)")

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
        attention_mask: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, LinearAttentionState]:
        """x: (B, T, d_model) -> (B, T, d_model) [, new state].

        `state` is a LinearAttentionState(S (B, H, F, d_head), z (B, H, F) when normalised),
        F = `feature_size`, as returned with return_state=True; `pos_offset` (>= 0) is the
        position of x's first token (cosFormer's re-weighting depends on it). With
        `cu_seqlens` ((N + 1,) cumulative starts, B = 1) the state has N rows, one a sequence
        (cosFormer's positions restart in each: it takes no state or pos_offset there).

        `attention_mask` (B, T), bool or 0/1 as Hugging Face passes it, marks the real tokens
        of a padded batch (left or right padding). A padding token writes nothing to the
        state and does not decay it, and its output is 0: each row's outputs at its real
        tokens, and with return_state its state (after its last real token, the short
        convolution's cache included), are those of the row with its padding removed
        (padding inside a row too). With a `state` it marks the new tokens only (a Hugging
        Face mask's last T columns, as decoding passes it): a padding step leaves the state
        and the cache as they were. It takes no `cu_seqlens` (pack unpadded rows instead);
        cosFormer counts positions over real tokens, from pos_offset, so it returns no state
        with a mask.
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
        if self.kind == "cosformer" and cu_seqlens is not None and (state is not None or pos_offset):
            raise ValueError(f"{fn}(cosformer): with `cu_seqlens` the positions restart at 0 in every packed "
                             "sequence, and one `pos_offset` cannot continue sequences of different lengths; "
                             "resume them unpacked (one row each, with its own call and pos_offset)")
        if attention_mask is not None:
            attention_mask = self._check_mask(fn, attention_mask, x, state, cu_seqlens, return_state)
        return self._forward(x, state=state, pos_offset=pos_offset, return_state=return_state,
                             cu_seqlens=cu_seqlens, mask=attention_mask)

    def _check_mask(self, fn, mask, x, state, cu_seqlens, return_state) -> Tensor:
        """`attention_mask` checked, as a (B, T) bool tensor (True: a token)."""
        if cu_seqlens is not None:
            raise ValueError(f"{fn}: `attention_mask` takes no `cu_seqlens`: pack the rows without their padding")
        if self.kind == "cosformer" and return_state:
            raise ValueError(f"{fn}(cosformer): with `attention_mask` every row has its own next position, "
                             "which one `pos_offset` cannot give: no state is returned")
        return V.check_attention_mask(fn, mask, x)

    def _decode(self, q, k, v, beta, g, state):
        """One token from `state` with the decode-step functions (no gradient): o (B, H, 1, Dv)."""
        g_t = None if g is None else (g if g.dim() == 1 else g[:, :, 0])
        q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]
        # the state comes back as from the chunked form (float64 for float64 inputs, else float32),
        # whatever came in, and the caller's is left as it was
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        if self._delta:
            new = LinearAttentionState(*(None if s is None else s.to(dtype) for s in state[:2]))
            o, new = delta_rule_decode_step(q, k, v, beta[:, :, 0], new, log_decay=g_t)
        else:
            o, new = decode_to_new_state(q, k, v, state, g_t, self.normalize, self.backend, dtype)
        return o.unsqueeze(2), new

    @property
    def _delta(self) -> bool:
        """Whether the layer writes with the delta rule (a delta kind with write="delta")."""
        return self.kind in DELTA_KINDS and self.write == "delta"

    @property
    def feature_size(self) -> int:
        """F, the size of the features phi(q), phi(k); the state S is (B, H, F, d_head)."""
        if self.kind == "performer":
            return self.feature_map.out_features
        if self.kind == "cosformer":
            return 2 * self.d_head
        return self.d_head

    def check_state(self, fn: str, name: str, state: object, *, batch: int, device: torch.device) -> None:
        """`state` fits this layer: S (batch, H, F, d_head) [and z (batch, H, F)], finite, on
        `device`; with short_conv=True, a ConvLayerState whose conv cache is (batch, 3 d_model, K-1)."""
        if self.short_conv != isinstance(state, ConvLayerState):
            want = "a ConvLayerState(attn, conv)" if self.short_conv else "a LinearAttentionState(S, z)"
            raise TypeError(f"{fn}: `{name}` must be {want} for this layer (short_conv={self.short_conv}), "
                            f"got {type(state).__name__}")
        if self.short_conv:
            self.conv.check_cache(fn, f"{name}.conv", state.conv, batch=batch, device=device)
            name, state = f"{name}.attn", state.attn
        V.check_state(
            fn, name, state, B=batch, H=self.n_heads, Dk=self.feature_size, Dv=self.d_head,
            device=device, normalize=self.normalize,
        )

    def _forward(self, x: Tensor, *, state=None, pos_offset: int = 0, return_state: bool = False,
                 cu_seqlens: Tensor | None = None, mask: Tensor | None = None):
        """`forward` without the input checks (for callers that checked already); mask: the
        checked `attention_mask`, (B, T) bool. Padding is selected out (torch.where), never
        multiplied by 0: padding whose features overflow (inf * 0 = NaN) or that the caller
        filled with NaN changes no output (the projections' weight gradients do take NaN
        from NaN inputs, as any linear layer's would: pad with zeros)."""
        conv_cache = None
        if self.short_conv and state is not None:
            state, conv_cache = state
        q, k, v, conv_cache = self._project(x, conv_cache, cu_seqlens, mask)
        phi_q, phi_k = self._features(q, k, pos_offset, cu_seqlens, mask)
        g = self._decay(x)
        beta = torch.sigmoid(self.beta_proj(x)).transpose(1, 2) if self.kind in DELTA_KINDS else None  # (B, H, T)
        if self.write == "additive":  # S += beta_t k_t v_t^T: beta scales the key it writes
            phi_k = phi_k * beta[..., None]
        if mask is not None:  # padding reads nothing (q), writes nothing (k, v, beta), keeps (g 0)
            m = mask[:, None, :]  # (B, 1, T)
            phi_q, phi_k, v = (torch.where(m[..., None], t, 0) for t in (phi_q, phi_k, v))
            beta = None if beta is None else torch.where(m, beta, 0)
            if g is not None:  # a decay per head becomes one per token
                g = torch.where(m, g[:, None] if g.dim() == 1 else g, 0)
        if x.shape[1] == 1 and state is not None and cu_seqlens is None and not torch.is_grad_enabled():
            o, new_state = self._decode(phi_q, phi_k, v, beta, g, state)
        elif self._delta:
            o, new_state = delta_rule_attention(
                phi_q, phi_k, v, beta, log_decay=g, chunk_size=self.chunk_size, initial_state=state,
                return_state=True, backend=self.backend, cu_seqlens=cu_seqlens, form=self.form)
        else:
            o, new_state = linear_attention(
                phi_q, phi_k, v, causal=True, normalize=self.normalize, log_decay=g, chunk_size=self.chunk_size,
                initial_state=state, return_state=True, backend=self.backend, cu_seqlens=cu_seqlens,
                keep_chunk_states=self.keep_chunk_states, form=self.form)
        if mask is not None:
            o = torch.where(mask[:, None, :, None], o, 0)
        if not self.normalize or self.output_gate:
            # in fp32, as fla's RMSNorm: in fp16 the backward of rsqrt (its cube) overflows
            # once a head's RMS is below about 0.025
            o32 = o.to(torch.promote_types(o.dtype, torch.float32))  # fp64 stays fp64
            o = (o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + self.norm_eps)).to(o.dtype) * self.out_norm
        if self.output_gate:
            o = o * F.silu(_split_heads(self.gate_proj(x), self.n_heads))
            if mask is not None:  # a NaN padding token's gate is NaN: selected out again
                o = torch.where(mask[:, None, :, None], o, 0)
        y = self.proj(_merge_heads(o))
        if self.short_conv:
            new_state = ConvLayerState(new_state, conv_cache)
        return (y, new_state) if return_state else y

    def _project(self, x: Tensor, conv_cache: Tensor | None, cu_seqlens: Tensor | None, mask: Tensor | None = None):
        """q, k, v (B, H, T, d_head) after the projection, convolution and activation."""
        qkv = self.qkv(x)
        if self.short_conv:
            if mask is None:
                qkv, conv_cache = self.conv(qkv, conv_cache, cu_seqlens)
            else:  # each row's tokens convolved alone, as if its padding were not there
                qkv, conv_cache = convolve_tokens(self.conv, qkv, mask, conv_cache)
        q, k, v = qkv.chunk(3, dim=-1)
        if self.activation is not None:
            v = F.silu(v)
            if self.activation == "silu":
                q, k = F.silu(q), F.silu(k)
            elif self.activation == "relu":
                q, k = F.relu(q), F.relu(k)
            elif self.activation in ("elu+1", "elu"):
                q, k = elu_plus_one(q), elu_plus_one(k)
        return (*(_split_heads(t, self.n_heads) for t in (q, k, v)), conv_cache)



# fla's layer definitions (fla/layers/delta_net.py, gated_deltanet.py, read at commit bc3b101)
# in this layer's options. Beside them fla keeps separate q, k, v convolutions (one here, over
# the 3 d_model channels: the same function).
FLA_PRESETS = {
    # DeltaNet(use_short_conv=True, conv_size=4, qk_activation="silu", qk_norm="l2",
    # use_beta=True, use_gate=False): b_proj without bias, chunk_delta_rule(scale=K^-0.5),
    # then an RMSNorm(eps=1e-5) per head
    "deltanet": dict(short_conv=True, conv_size=4, activation="silu", beta_bias=False, norm_eps=1e-5, q_scale=True),
    # GatedDeltaNet(use_short_conv=True, conv_size=4, use_gate=True): as DeltaNet, plus
    # g = -exp(A_log) softplus(a_proj(x) + dt_bias) and FusedRMSNormGated (o_norm(o, g_proj(x)))
    "gated_deltanet": dict(short_conv=True, conv_size=4, activation="silu", beta_bias=False, norm_eps=1e-5,
                           q_scale=True, gate="mamba", output_gate=True),
}


def fla_layer(d_model: int, n_heads: int, kind: str = "gated_deltanet", **options: object) -> LinearAttention:
    """A `LinearAttention` configured as fla's layer of that kind (`FLA_PRESETS`): short
    convolution, SiLU, L2-normalised q and k, beta without bias, and for Gated DeltaNet
    Mamba-2's gate and the gated output norm. `options` override single presets. Heads are
    d_model // n_heads wide, keys and values alike, as in fla's DeltaNet; fla's Gated DeltaNet
    defaults to head_dim=256 with values twice as wide (expand_v=2), which this layer cannot make."""
    V.check_choice("fla_layer", "kind", kind, tuple(FLA_PRESETS))
    return LinearAttention(d_model, n_heads, kind=kind, **{**FLA_PRESETS[kind], **options})


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
        """`state` is a KV cache (keys, values), each (batch, H, S, d_head), S >= 1, finite, on
        `device`; after a padded prefill also the keys' mask, (batch, S) bool (True: a token)."""
        if not isinstance(state, (tuple, list)) or len(state) not in (2, 3) or hasattr(state, "_fields"):
            raise TypeError(f"{fn}: `{name}` must be a KV cache (keys, values[, key mask]) of a softmax layer, "
                            f"got {type(state).__name__}")
        for part, t in zip(("keys", "values"), state):
            V.check_layout(fn, f"{name}[{part!r}]", t, ("B", "H", "S", "d_head"))
            S = t.shape[2]
            V.check_shape(fn, f"{name}[{part!r}]", t, (batch, self.n_heads, S, self.d_head), ("B", "H", "S", "d_head"))
            if t.device != device:
                raise ValueError(f"{fn}: `{name}` is on {t.device} but the inputs are on {device}")
            V.check_values(fn, f"{name}[{part!r}]", t)
        if state[0].shape != state[1].shape:
            raise ValueError(f"{fn}: `{name}` keys {tuple(state[0].shape)} and values {tuple(state[1].shape)} must have one shape")
        if len(state) == 3 and (not isinstance(state[2], Tensor) or state[2].dtype != torch.bool
                                or tuple(state[2].shape) != tuple(state[0].shape[::2])):
            raise ValueError(f"{fn}: `{name}`'s key mask must be a (B, S) = {tuple(state[0].shape[::2])} bool "
                             f"tensor, got {V.describe(state[2])}")

    def forward(
        self, x: Tensor, *, state: tuple[Tensor, ...] | None = None, pos_offset: int = 0,
        return_state: bool = False, attention_mask: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, tuple[Tensor, ...]]:
        """x (B, T, d_model) -> y (B, T, d_model) [, KV cache]. `attention_mask` (B, T), bool
        or 0/1, marks the real tokens of a padded batch (with a `state`: of the new tokens):
        padding is no key of any query, its outputs are 0, and the returned cache also holds
        the keys' mask, which the next calls extend."""
        fn = "SoftmaxAttention"
        _check_input(fn, x, self, self.n_heads * self.d_head)
        if state is not None:
            self.check_state(fn, "state", state, batch=x.shape[0], device=x.device)
        if attention_mask is not None:
            attention_mask = V.check_attention_mask(fn, attention_mask, x)
        return self._forward(x, state=state, pos_offset=pos_offset, return_state=return_state, mask=attention_mask)

    def _forward(self, x: Tensor, *, state: tuple[Tensor, ...] | None = None, pos_offset: int = 0,
                 return_state: bool = False, mask: Tensor | None = None):
        q, k, v = (_split_heads(t, self.n_heads) for t in self.qkv(x).chunk(3, dim=-1))
        keys = mask  # which keys are tokens: None when all are
        if state is not None:  # the KV cache: every past key and value (and which are tokens)
            k, v = torch.cat([state[0], k], dim=2), torch.cat([state[1], v], dim=2)
            if len(state) == 3 or mask is not None:
                past = state[2] if len(state) == 3 else q.new_ones(q.shape[0], state[0].shape[2], dtype=torch.bool)
                keys = torch.cat([past, mask if mask is not None else past.new_ones(q.shape[0], q.shape[2])], 1)
        T, S = q.shape[2], k.shape[2]
        # query t (absolute position S - T + t) may see keys 0 .. S - T + t
        allowed = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(diagonal=S - T)
        if keys is not None:
            allowed = allowed & keys[:, None, None, :]
            # a padding query may see no key: let it see all (no NaN); its output is set to 0
            allowed = allowed | ~allowed.any(-1, keepdim=True)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        if mask is not None:
            o = torch.where(mask[:, None, :, None], o, 0.0)
        y = self.proj(_merge_heads(o))
        cache = (k, v) if keys is None else (k, v, keys)
        return (y, cache) if return_state else y
