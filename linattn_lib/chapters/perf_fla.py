"""flash-linear-attention's chunk decomposition, as the performance model (perf_model.py) sees it.

What fla runs for the two ops the benchmark times (linattn_lib/experiments/gpu_check.py), read
from fla's source (fla/ops/linear_attn/chunk.py and utils.py, fla/ops/simple_gla/chunk.py,
fla/ops/common/chunk_h.py and chunk_o.py, fla/ops/utils/cumsum.py):

    chunk_linear_attn(normalize=True)   chunk_simple_gla without decay, then the normaliser
                                        `StatefulNormalizeFunction`, in torch around one Triton
                                        cumsum: k_cum = cumsum_t(k), denom = (q scale k_cum)
                                        summed over K + 1e-10, o / denom; its backward runs
                                        12 eager ops and a reversed cumsum, and autograd adds
                                        the two paths' dq and dk
    chunk_simple_gla(g)                 chunk_local_cumsum(g) (x 1/ln 2), then the same
                                        kernels with USE_G; dg.sum(0) and a reversed local
                                        cumsum of dg in the backward
    chunk_linear_attn(normalize=False)  chunk_simple_gla's kernels without decay, nothing else
    chunk_retention                     g_gamma = log(1 - 2^(-5 - h)) per head, made in torch from
                                        two `q.new_tensor`s of host data (two blocking host-to-
                                        device copies: the host waits for the GPU), x 1/ln 2,
                                        then the kernels with USE_G_GAMMA (fixed: no gradient)

The last two are the ops Helion's published H100 table times (book/results/published_h100.json).

    forward    chunk_fwd_h (states h, bf16), chunk_fwd_o
    backward   chunk_fwd_h again (h in fp32), chunk_bwd_dh (fp32), chunk_bwd_dqkwg, chunk_bwd_dv

`Replay` replays fla's Python launchers on meta tensors: each Triton kernel goes to a
`launch(name, grid, args, num_warps, num_stages)` callback with the arguments fla's
launcher, heuristics and autotune config would give it; the eager torch ops run (on meta
tensors: nothing is computed) for a recorder to see. `fla_kernels` cuts the kernels out of
fla's source (never importing fla, which may not import without a GPU) so that they can be
compiled. This module knows nothing of the model; perf_model.py drives it.
"""
from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Container
from pathlib import Path
from typing import Any

import torch

FLA_FILES = {"fla/ops/common/chunk_h.py": ("chunk_fwd_kernel_h", "chunk_bwd_kernel_dh"),
             "fla/ops/common/chunk_o.py": ("chunk_fwd_kernel_o", "chunk_bwd_kernel_dqkwg", "chunk_bwd_kernel_dv"),
             "fla/ops/utils/cumsum.py": ("chunk_local_cumsum_scalar_kernel", "chunk_global_cumsum_vector_kernel")}
_PRELUDE = ("import triton\nimport triton.language as tl\n\n@triton.jit\ndef exp2(x):\n"  # fla.ops.utils.op's
            "    return tl.math.exp2(x.to(tl.float32))")  # (FLA_USE_FAST_OPS unset): all the kernels import
RCP_LN2 = 1.4426950216  # fla.ops.utils.constant
BT = 64                 # chunk_simple_gla's chunk_size

# The fla ops the model compares with ours (perf_model.ROWS): label -> (normalize, decay)
VARIANTS = {"fla chunk_linear_attn(normalize=True)": (True, None),
            "fla chunk_simple_gla (per-token decay g)": (False, "token")}
# ... and those with published GPU times (perf_calibration): every op `Replay` knows
PUBLISHED = {"fla chunk_linear_attn(normalize=False)": (False, None),
             "fla chunk_retention (per-head decay g_gamma)": (False, "head")}
REPLAYED = {**VARIANTS, **PUBLISHED}

# kernel -> {argument: grid axes whose programs all read the same elements} (perf_model.traffic)
REREAD: dict[str, dict[str, tuple[int, ...]]] = {
    "chunk_fwd_kernel_h": {"k": (1,), "v": (0,), "g": (0, 1)}, "chunk_bwd_kernel_dh": {"q": (1,), "do": (0,), "g": (0, 1)},
    "chunk_fwd_kernel_o": {"q": (0,), "k": (0,), "g": (0,)}, "chunk_bwd_kernel_dqkwg": {"v": (0,), "do": (0,), "g": (0,)},
    "chunk_bwd_kernel_dv": {"q": (0,), "k": (0,), "g": (0,)},
    "chunk_local_cumsum_scalar_kernel": {}, "chunk_global_cumsum_vector_kernel": {},
}
_cdiv = lambda a, b: -(-a // b)
# kernel -> sequential steps of one program (trips of its main loop), from its arguments
STEPS: dict[str, Callable[[dict], int]] = {
    "chunk_fwd_kernel_h": lambda a: _cdiv(a["T"], a["BT"]), "chunk_bwd_kernel_dh": lambda a: _cdiv(a["T"], a["BT"]),
    "chunk_fwd_kernel_o": lambda a: _cdiv(a["K"], a["BK"]), "chunk_bwd_kernel_dqkwg": lambda a: _cdiv(a["V"], a["BV"]),
    "chunk_bwd_kernel_dv": lambda a: _cdiv(a["K"], a["BK"]),
    "chunk_global_cumsum_vector_kernel": lambda a: _cdiv(a["T"], a["BT"]),
}
# fla kernel -> our kernel of the same loop structure (its SASS stands in without fla's source);
# without the source the two cumsums run as eager copies of the same bytes instead
ANALOGS = {"chunk_fwd_kernel_h": "chunk_state_kernel", "chunk_bwd_kernel_dh": "chunk_state_kernel",
           "chunk_fwd_kernel_o": "chunk_output_kernel", "chunk_bwd_kernel_dqkwg": "chunk_output_kernel",
           "chunk_bwd_kernel_dv": "chunk_output_kernel"}


def fla_source(root: str | None = None) -> dict[str, str] | None:
    """{path: text} of fla's kernel files (`FLA_FILES`), read from `root` or else $LINATTN_FLA_SOURCE:
    a checkout, the site-packages folder holding an installed `fla`, or a bare git repository
    (its HEAD); None when neither has them."""
    for r in filter(None, (root, os.environ.get("LINATTN_FLA_SOURCE"))):
        if all(os.path.isfile(os.path.join(r, p)) for p in FLA_FILES):
            return {p: Path(r, p).read_text() for p in FLA_FILES}
        if os.path.isfile(os.path.join(r, "HEAD")):  # a bare git repository
            shown = [subprocess.run(["git", f"--git-dir={r}", "show", f"HEAD:{p}"], capture_output=True, text=True)
                     for p in FLA_FILES]
            if all(s.returncode == 0 for s in shown):
                return {p: s.stdout for p, s in zip(FLA_FILES, shown)}
    return None


_KERNELS: dict[str, dict[str, Any]] = {}


def fla_kernels(root: str | None = None) -> dict[str, Any]:
    """fla's kernels (`FLA_FILES`) as JITFunctions, cut out of its files without the autotune and
    heuristics decorators (`Replay` sets what they would), in a temporary module; {} without a source."""
    if (texts := fla_source(root)) is None:
        return {}
    parts = [_PRELUDE] + ["\n\n@triton.jit(do_not_specialize=['T'])\n" + ast.get_source_segment(text, node)
                          for path, text in texts.items() for node in ast.parse(text).body
                          if isinstance(node, ast.FunctionDef) and node.name in FLA_FILES[path]]
    source = "".join(parts) + "\n"
    digest = hashlib.sha1(source.encode()).hexdigest()[:12]
    if digest not in _KERNELS:
        path = os.path.join(tempfile.gettempdir(), f"linattn_fla_kernels_{digest}.py")
        with open(path, "w") as f:
            f.write(source)
        spec = importlib.util.spec_from_file_location(f"_linattn_fla_{digest}", path)
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _KERNELS[digest] = {n: getattr(module, n) for names in FLA_FILES.values() for n in names}
    return _KERNELS[digest]


def fla_candidates(D: int) -> dict[str, list[dict[str, int]]]:
    """Configs (constexprs, num_warps, num_stages) fla's autotuners may pick on Hopper: part of the
    state kernels' and the global cumsum's spaces, chunk_fwd_o's three, and the warps of the rest
    (dqkwg and dv at their launchers' BK = BV = min(128, D); the local cumsum at BT = 64)."""
    cfg = lambda nw, ns, **meta: {**meta, "num_warps": nw, "num_stages": ns}
    state = [cfg(4, 2, BK=32, BV=32), cfg(4, 2, BK=64, BV=64)]
    return {"chunk_fwd_kernel_h": state, "chunk_bwd_kernel_dh": state,
            "chunk_fwd_kernel_o": [cfg(8, 3, BK=128, BV=128), cfg(4, 3, BK=64, BV=64), cfg(2, 3, BK=32, BV=32)],
            "chunk_bwd_kernel_dqkwg": [cfg(2, 2), cfg(4, 2)], "chunk_bwd_kernel_dv": [cfg(2, 2), cfg(4, 2)],
            "chunk_local_cumsum_scalar_kernel": [cfg(nw, 3) for nw in (1, 2, 4)],
            "chunk_global_cumsum_vector_kernel": [cfg(nw, 2, BT=bt) for bt in (16, 32, 64, 128) for nw in (2, 4, 8)]}


Launcher = Callable[[str, tuple[int, ...], dict[str, Any], int, int], None]


class Replay:
    """fla's launchers at (B, H, T, D) on meta tensors (layout (B, T, H, D), BT = 64): kernels go to
    `launch` with `configs[kernel]`; eager ops run. `compiled`: the kernels fla's source gave
    (the cumsums run as eager copies when they are missing)."""

    def __init__(self, B: int, H: int, T: int, D: int, configs: dict[str, dict[str, int]], launch: Launcher,
                 compiled: Container[str], dtype: torch.dtype = torch.bfloat16) -> None:
        self.B, self.H, self.T, self.D, self.NT, self.dtype = B, H, T, D, _cdiv(T, BT), dtype
        self.configs, self.launch, self.compiled = configs, launch, compiled
        self.g_gamma: torch.Tensor | None = None  # chunk_retention's per-head log-decay (x 1/ln 2)
        self.syncs = 0  # host waits for the GPU (blocking copies of host data) in fla's Python
        self.tile = min(128, max(16, 1 << (D - 1).bit_length()))  # dqkwg's and dv's CONST_TILING on Hopper

    def meta(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """An empty meta tensor (input dtype unless given)."""
        return torch.empty(*shape, dtype=dtype or self.dtype, device="meta")

    def _kernel(self, name: str, grid: Callable[[dict], tuple[int, ...]], **args: Any) -> None:
        cfg = dict(self.configs[name])
        nw, ns = cfg.pop("num_warps"), cfg.pop("num_stages")
        self.launch(name, grid(cfg), {**args, **cfg}, nw, ns)

    def _gate(self, g: torch.Tensor | None) -> dict[str, Any]:  # the arguments all five kernels share
        return dict(g=g, g_gamma=self.g_gamma, cu_seqlens=None, USE_G=g is not None,
                    USE_G_GAMMA=self.g_gamma is not None, IS_VARLEN=False,
                    STATE_V_FIRST=False, T=self.T, H=self.H, K=self.D, V=self.D, BT=BT)

    def fwd_h(self, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, fp32: bool) -> torch.Tensor:
        """chunk_fwd_h: every chunk's entry state (bf16 in the forward, fp32 in the backward)."""
        B, H, D = self.B, self.H, self.D
        h = self.meta(B, self.NT, H, D, D, dtype=torch.float32 if fp32 else None)
        self._kernel("chunk_fwd_kernel_h", lambda c: (_cdiv(D, c["BK"]), _cdiv(D, c["BV"]), B * H), k=k, v=v, h=h,
                     gk=None, gv=None, h0=None, ht=None, split_offsets=None, BS=BT, USE_GK=False, USE_GV=False,
                     USE_INITIAL_STATE=False, STORE_FINAL_STATE=False, **self._gate(g))
        return h

    def fwd_o(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: torch.Tensor, g: torch.Tensor | None,
              scale: float) -> torch.Tensor:
        """chunk_fwd_o: the outputs, every chunk in parallel."""
        o = torch.empty_like(v)
        self._kernel("chunk_fwd_kernel_o", lambda c: (_cdiv(self.D, c["BV"]), self.NT, self.B * self.H), q=q, k=k,
                     v=v, h=h, o=o, chunk_indices=None, scale=scale, HV=self.H, **self._gate(g))
        return o

    def bwd_dh(self, q: torch.Tensor, do: torch.Tensor, g: torch.Tensor | None, scale: float) -> torch.Tensor:
        """chunk_bwd_dh: every chunk's state gradient, from the end (fp32)."""
        B, H, D = self.B, self.H, self.D
        dh = self.meta(B, self.NT, H, D, D, dtype=torch.float32)
        self._kernel("chunk_bwd_kernel_dh", lambda c: (_cdiv(D, c["BK"]), _cdiv(D, c["BV"]), B * H), q=q, do=do,
                     dh=dh, dht=None, dh0=None, scale=scale, HQ=H, NG=1, gk=None, gv=None, split_offsets=None, BS=BT,
                     USE_GK=False, USE_GV=False, STORE_INITIAL_STATE_GRADIENT=False, USE_FINAL_STATE_GRADIENT=False,
                     **self._gate(g))
        return dh

    def bwd_dqkwg(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: torch.Tensor, do: torch.Tensor,
                  dh: torch.Tensor, g: torch.Tensor | None, scale: float) -> tuple:
        """chunk_bwd_dqkwg: dq, dk (and dg, one per K block, summed in torch) of every chunk."""
        NK = _cdiv(self.D, self.tile)
        dq, dk = torch.empty_like(q), torch.empty_like(k)
        dg = None if g is None else self.meta(NK, *g.shape, dtype=torch.float32)
        self._kernel("chunk_bwd_kernel_dqkwg", lambda c: (NK, self.NT, self.B * self.H), q=q, k=k, v=v, h=h, do=do,
                     dh=dh, dq=dq, dk=dk, dw=None, dv=None, dg=dg, chunk_indices=None, scale=scale, B=self.B,
                     HV=self.H, BK=self.tile, BV=self.tile, USE_DW=False, **self._gate(g))
        return dq, dk, None if dg is None else dg.sum(0)

    def bwd_dv(self, q: torch.Tensor, k: torch.Tensor, do: torch.Tensor, dh: torch.Tensor, g: torch.Tensor | None,
               scale: float) -> torch.Tensor:
        """chunk_bwd_dv: dv of every chunk."""
        dv = torch.empty_like(do)
        self._kernel("chunk_bwd_kernel_dv", lambda c: (_cdiv(self.D, self.tile), self.NT, self.B * self.H), q=q, k=k,
                     do=do, dv=dv, dh=dh, chunk_indices=None, scale=scale, HV=self.H, BK=self.tile, BV=self.tile,
                     **self._gate(g))
        return dv

    def _cumsum(self, name: str, s: torch.Tensor, out: torch.dtype, grid: Callable, **args: Any) -> torch.Tensor:
        if name not in self.compiled:  # without fla's source: the same bytes, as an eager copy
            return s.to(out, copy=True)
        o = torch.empty_like(s, dtype=out)
        self._kernel(name, grid, s=s, o=o, cu_seqlens=None, T=self.T, B=self.B, H=self.H, IS_VARLEN=False, **args)
        return o

    def local_cumsum(self, g: torch.Tensor, reverse: bool, scale: float | None = None) -> torch.Tensor:
        """chunk_local_cumsum of a (B, T, H) gate within chunks of BT (fp32 out)."""
        return self._cumsum("chunk_local_cumsum_scalar_kernel", g, torch.float32, lambda c: (self.NT, self.B * self.H),
                            scale=scale, chunk_indices=None, BT=BT, REVERSE=reverse, HAS_SCALE=scale is not None)

    def global_cumsum(self, s: torch.Tensor, reverse: bool, out: torch.dtype) -> torch.Tensor:
        """chunk_global_cumsum of a (B, T, H, S) tensor over the whole sequence (BS = min(32, S))."""
        S = s.shape[-1]
        BS = min(32, 1 << (S - 1).bit_length())
        return self._cumsum("chunk_global_cumsum_vector_kernel", s, out, lambda c: (_cdiv(S, BS), self.B * self.H),
                            scale=None, S=S, BS=BS, REVERSE=reverse, HAS_SCALE=False)

    def retention_gamma(self, q: torch.Tensor) -> torch.Tensor:
        """chunk_retention's g_gamma, as its Python makes it, then x 1/ln 2 (chunk_simple_gla's forward);
        counts the two blocking host-to-device copies of `q.new_tensor`."""
        f32 = torch.float32
        self.syncs += 2
        return (1 - q.new_tensor(2., dtype=f32).pow(-5. - q.new_tensor(range(self.H), dtype=f32))).log() * RCP_LN2

    def forward(self, normalize: bool, decay: str | None) -> tuple:
        """The forward of a `REPLAYED` op; returns what its backward needs (last: the normaliser's
        tensors, chunk_retention's g_gamma, or None)."""
        if (normalize, decay) not in REPLAYED.values():
            raise ValueError(f"fla has no chunk op modelled for normalize={normalize}, decay={decay}")
        B, T, H, D = self.B, self.T, self.H, self.D
        q, k, v = (self.meta(B, T, H, D) for _ in range(3))
        scale = D**-0.5  # every op's default
        if decay == "head":
            self.g_gamma = self.retention_gamma(q)
        g = self.local_cumsum(self.meta(B, T, H, dtype=torch.float32), False, RCP_LN2) if decay == "token" else None
        o = self.fwd_o(q, k, v, self.fwd_h(k, v, g, fp32=False), g, scale)
        if not normalize:
            return q, k, v, g, scale, o, self.g_gamma
        # StatefulNormalizeFunction.forward (z_init None, not reversed, no cu_seqlens)
        k_cum = self.global_cumsum(k, False, k.dtype)
        denom = (q * scale * k_cum).sum(-1, keepdim=True) + 1e-10
        o_out = o / denom
        z_state = k_cum[:, -1:].contiguous()
        return q, k, v, g, scale, o_out, (o, k_cum, denom, z_state)

    def backward(self, saved: tuple) -> tuple:
        """The backward of `forward` (its returned tuple) for a cotangent of o: (dq, dk, dv, dg)."""
        q, k, v, g, scale, o_out, norm = saved
        do = torch.empty_like(o_out)
        if isinstance(norm, torch.Tensor):  # chunk_retention's g_gamma, saved by its forward
            self.g_gamma, norm = norm, None
        if norm is not None:  # StatefulNormalizeFunction.backward, dz_state materialised by autograd as zeros
            o, k_cum, denom, z_state = norm
            dz_state = torch.zeros_like(z_state)
            d_o_in = do / denom
            ddenom = -(do * o).sum(-1, keepdim=True) / (denom * denom)
            dq_n = ddenom * scale * k_cum
            dk_cum = ddenom * scale * q
            dk_cum[:, -1:].add_(dz_state.to(dk_cum.dtype))
            dk_n = self.global_cumsum(dk_cum, True, k.dtype)
            do = d_o_in
        h = self.fwd_h(k, v, g, fp32=True)  # chunk_simple_gla_bwd
        dh = self.bwd_dh(q, do, g, scale)
        dq, dk, dg = self.bwd_dqkwg(q, k, v, h, do, dh, g, scale)
        dv = self.bwd_dv(q, k, do, dh, g, scale)
        if g is not None:
            dg = self.local_cumsum(dg, True)
        if norm is not None:  # autograd sums the gradients of q and k from both paths
            dq, dk = dq + dq_n, dk + dk_n
        return dq, dk, dv, dg


def syncs_of(variant: tuple[bool, str | None]) -> int:
    """Host waits for the GPU in fla's Python for one forward and backward of `variant` (a
    `REPLAYED` value): `Replay` run on a tiny shape, launching nothing."""
    replay = Replay(1, 1, BT, 16, {}, lambda *a: None, (), torch.float32)
    replay._kernel = lambda *a, **k: None
    replay.backward(replay.forward(*variant))
    return replay.syncs


def assumptions(root: str | None = None) -> list[str]:
    """What the fla rows assume, one sentence each."""
    src = fla_source(root)
    how = ("compiled from its source (cut out of chunk_h.py, chunk_o.py and utils/cumsum.py, without the autotune "
           "and heuristics decorators; constexprs as those would set them)" if src else
           "BY ANALOGY: no fla source ($LINATTN_FLA_SOURCE), so ours at fla's tiles, the cumsums as eager copies")
    return [
        f"fla: its kernels {how}; its launchers and torch code transcribed from fla's Python; autotuning: "
        "the model's best of a few of each autotuner's configs; the Triton path throughout (tilelang's dqkwg "
        "refuses simple_gla's fp32 h; Triton 3.4 to 3.7.0 on Hopper would refuse the gated dqkwg).",
        "fla chunk_linear_attn(normalize=True): chunk_simple_gla's kernels without decay (BT 64, h bf16, "
        "recomputed in fp32 for the backward) + its normaliser: a Triton cumsum of k (and of dk), 5 eager ops "
        "forward, 12 backward (the zeros autograd gives the unused z_state included) and autograd's 2 sums of "
        "dq and dk; an eager op reads and writes its tensors once at HBM bandwidth.",
        "fla chunk_simple_gla (per-token g): the same kernels compiled with USE_G (a constexpr of all five) + "
        "a local cumsum of g (x 1/ln 2) forward, dg.sum(0) and a reversed local cumsum of dg backward.",
        "Each in its own layout: ours (B, H, T, D), fla (B, T, H, D), contiguous; log-decay fp32 "
        "(B, H, T) / (B, T, H) (gpu_check hands fla transposes: input_guard's copies are not counted); "
        "ours' per-head decay is fixed (no gradient), as RetNet's and fla's g_gamma.",
    ]
