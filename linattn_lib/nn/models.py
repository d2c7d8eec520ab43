"""A small model zoo: `TinyLM`, a decoder-only Transformer whose attention is pluggable.

The attention layers live in `layers.py` (`LinearAttention`, `SoftmaxAttention`, the kinds
table); they are re-exported here, where earlier versions defined them. `ModelConfig` picks a
kind per model (and `softmax_layers` for hybrids); `TinyLM.generate` decodes from the per-layer
states: a constant-size state for a linear layer, a growing KV cache for a softmax one.
"""
from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _validate as V
from .layers import (  # noqa: F401  (re-exported: the public home of these names before layers.py)
    ATTENTION_KINDS,
    DELTA_KINDS,
    LINEAR_KINDS,
    LayerState,
    LinearAttention,
    SoftmaxAttention,
    _check_width,
)


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
        softmax_layers: indices of the layers that use softmax attention instead, e.g. (0,);
            default () (none).
        seed: seed of the initial weights and of the Performer projections.
        layer_options: keyword options of every linear layer (`LinearAttention`), e.g.
            {"short_conv": True} or `FLA_PRESETS["gated_deltanet"]`; softmax layers ignore them.
            Default None: no options (the config then holds a new, empty dict).
    """

    vocab_size: int
    block_size: int = 128
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    attention: str = "linear"
    num_features: int | None = None
    softmax_layers: tuple = ()
    seed: int = 0
    layer_options: dict | None = None

    def __post_init__(self) -> None:
        if self.layer_options is None:
            self.layer_options = {}
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
        V.check_instance(fn, "layer_options", self.layer_options, dict, "a dict of LinearAttention options")
        reserved = {"kind", "num_features", "max_len", "seed"} & set(self.layer_options)
        if reserved:
            raise ValueError(f"{fn}: `layer_options` may not set {sorted(reserved)}: the config's own fields do")

    def to_dict(self) -> dict:
        """The fields as a plain dict (`ModelConfig(**d)` rebuilds it): what results files store."""
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
                max_len=cfg.block_size, seed=cfg.seed + layer, **cfg.layer_options,
            )
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model))

    def forward(self, x: Tensor, *, state: LayerState = None, pos_offset: int = 0,
                mask: Tensor | None = None) -> tuple[Tensor, LayerState]:
        masked = {} if mask is None else {"mask": mask}  # a converted layer (converted.py) takes none
        a, state = self.attn._forward(self.ln1(x), state=state, pos_offset=pos_offset, return_state=True, **masked)
        x = x + a
        return x + self.mlp(self.ln2(x)), state


class TinyLM(nn.Module):
    """A GPT-style decoder-only language model with pluggable attention.

    `forward(idx, targets)` is the parallel (training) form; `generate` prefills the prompt in
    parallel and then decodes one token at a time from the per-layer states (a constant-size
    state for linear layers, a KV cache for softmax layers). Both take an `attention_mask`
    for padded batches: prompts of different lengths generate together, each as it would
    alone.
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
        """The number of parameters (every tensor of `parameters()`, embeddings included)."""
        return sum(p.numel() for p in self.parameters())

    def _check_idx(self, fn: str, name: str, idx, *, allow_ignore: bool = False) -> None:
        """Token ids: an integer (B, T) tensor, B, T >= 1, every id in [0, vocab_size)."""
        V.check_tensor(fn, name, idx, layout=("B", "T"), floating=False)
        if idx.dtype == torch.bool or idx.is_floating_point() or idx.is_complex():
            raise TypeError(f"{fn}: `{name}` must hold integer token ids (e.g. torch.long), got {V.describe(idx)}")
        if idx.shape[0] == 0 or idx.shape[1] == 0:
            raise ValueError(f"{fn}: `{name}` must have B >= 1 and T >= 1, got {V.describe(idx)}")
        vocab = self.cfg.vocab_size
        # a value check: on CPU in eager mode only (V.values_checked), as the layers' checks
        # (so never under torch.func, which cannot map the boolean indexing below)
        if not V.values_checked(idx):
            return
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
        attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, ...]:
        """idx: (B, T) token ids -> logits (B, T, vocab) [, loss] [, states].

        targets: (B, T) ids for the cross-entropy loss (-100 marks a position to ignore).
        states / pos_offset: resume from the per-layer states of a previous call that ended at
        position pos_offset (what `generate` does).
        attention_mask: (B, T), bool or 0/1, marks the real tokens of a padded batch (left or
        right padding, as tokenizers pad). Each row is then computed as if alone: its tokens
        take positions 0, 1, ... in order, padding is no key of any layer, and padded
        positions are left out of the loss (their logits mean nothing). Not with `states`;
        the returned states continue each row after its last token (cosFormer, whose
        rows would continue from different positions, returns none for a padded batch).
        position_ids: (B, T) positions of the tokens, for rows that continue from different
        positions: after a padded prompt, row b's next token is at its token count
        (`attention_mask.sum(1)`), not at pos_offset. Default: pos_offset + 0 .. T-1.
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
        if attention_mask is not None:
            attention_mask = self._check_mask(fn, attention_mask, idx, states, pos_offset, return_states)
        if position_ids is not None:
            V.check_tensor(fn, "position_ids", position_ids, layout=("B", "T"), floating=False)
            bad = position_ids.dtype == torch.bool or position_ids.is_floating_point() or position_ids.is_complex()
            if bad or position_ids.shape != idx.shape or attention_mask is not None or (
                    V.values_checked(position_ids) and not bool(((position_ids >= 0)
                                                                 & (position_ids < self.cfg.block_size)).all())):
                raise ValueError(f"{fn}: `position_ids` must be (B, T) = {tuple(idx.shape)} positions below "
                                 f"block_size={self.cfg.block_size}, without `attention_mask` (which sets them), "
                                 f"got {V.describe(position_ids)}")
        return self._forward(idx, targets, states=states, pos_offset=pos_offset, return_states=return_states,
                             mask=attention_mask, positions=position_ids)

    def _check_mask(self, fn: str, mask, idx: Tensor, states, pos_offset: int, return_states: bool) -> Tensor | None:
        """`attention_mask` checked, as (B, T) bool (True: a token); None where it marks no
        padding and cosFormer layers return states."""
        mask = V.check_attention_mask(fn, mask, idx)
        if states is not None or pos_offset:
            raise ValueError(f"{fn}: `attention_mask` takes no `states` or `pos_offset`: it marks a padded "
                             "prompt; continue from the states it returns")
        other = [type(b.attn).__name__ for b in self.blocks if not isinstance(b.attn, (LinearAttention, SoftmaxAttention))]
        if other:
            raise ValueError(f"{fn}: `attention_mask` needs LinearAttention or SoftmaxAttention layers, got {other}")
        if return_states and any(getattr(b.attn, "kind", None) == "cosformer" for b in self.blocks):
            # its layers continue every row from one position (read here: generation, not training)
            if torch.compiler.is_compiling() or not bool(mask.all()):
                raise ValueError(f"{fn}: cosFormer continues all rows from one position, so a padded batch "
                                 "(rows with different token counts) returns no states; pass prompts of one "
                                 "length (an all-ones mask, or none)")
            return None  # no padding: the same as no mask
        if V.values_checked(mask) and not bool(mask.any(1).all()):
            raise ValueError(f"{fn}: every row of `attention_mask` needs a token; rows "
                             f"{(~mask.any(1)).nonzero().flatten().tolist()} have none")
        return mask

    def _forward(self, idx: Tensor, targets: Tensor | None = None, *, states=None, pos_offset: int = 0,
                 return_states: bool = False, mask: Tensor | None = None, positions: Tensor | None = None):
        """`forward` without the input checks (for `generate`, whose inputs were checked once).
        mask: the checked `attention_mask`; positions: (B, T) positions of the tokens when
        they differ per row (decoding after a padded prompt), else pos_offset + 0 .. T-1."""
        B, T = idx.shape
        if pos_offset + T > self.cfg.block_size:
            raise ValueError(
                f"TinyLM: positions up to {pos_offset + T} (`pos_offset`={pos_offset} + T={T}) exceed "
                f"block_size={self.cfg.block_size}"
            )
        if mask is not None:  # each row's tokens at 0, 1, ...; padding anywhere (it is no key)
            positions = (mask.long().cumsum(1) - 1).clamp(min=0)
        if positions is None:
            positions = torch.arange(pos_offset, pos_offset + T, device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        states = [None] * len(self.blocks) if states is None else states
        new_states = []
        for block, st in zip(self.blocks, states):
            x, st = block(x, state=st, pos_offset=pos_offset, mask=mask)
            new_states.append(st)
        logits = self.head(self.ln_f(x))
        out = (logits,)
        if targets is not None:
            if mask is not None:  # padding is no target
                targets = targets.masked_fill(~mask, -100)
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
    def generate(self, idx: Tensor, max_new_tokens: int, *, temperature: float = 1.0, greedy: bool = False,
                 generator: torch.Generator | None = None, attention_mask: Tensor | None = None) -> Tensor:
        """Continue `idx` (B, T0) by `max_new_tokens` (>= 0) tokens, up to block_size in total.

        Samples from softmax(logits / temperature) (temperature > 0, finite), or takes the
        argmax when greedy=True. attention_mask: (B, T0), bool or 0/1, for prompts of
        different lengths padded into one batch (left or right): each row continues after its
        own last token, as it would alone (cosFormer models: prompts of one length only, an
        all-ones mask). Returns (B, T0 + max_new_tokens): the prompts as given, padding
        included, then the new tokens.
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
        mask = None if attention_mask is None else self._check_mask(fn, attention_mask, idx, None, 0, True)
        logits, states = self._forward(idx, states=None, return_states=True, mask=mask)
        B, pos = idx.shape
        last, lengths = logits[:, -1], None
        if mask is not None:  # each row's last token, and how many it has
            ends = (mask.long() * torch.arange(pos, device=idx.device)).argmax(1)
            last, lengths = logits[torch.arange(B, device=idx.device), ends], mask.sum(1, keepdim=True)
        out = [idx]
        for step in range(max_new_tokens):
            last = last / temperature
            nxt = last.argmax(-1, keepdim=True) if greedy else torch.multinomial(torch.softmax(last, -1), 1, generator=generator)
            out.append(nxt)
            positions = None if lengths is None else lengths + step
            logits, states = self._forward(nxt, states=states, pos_offset=pos, return_states=True, positions=positions)
            last = logits[:, -1]
            pos += 1
        return torch.cat(out, dim=1)

    def state_nbytes(self, states: Sequence[LayerState]) -> int:
        """Bytes held by per-layer generation states (KV caches grow, linear states do not)."""
        leaves = torch.utils._pytree.tree_leaves(list(states))
        return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, Tensor))
