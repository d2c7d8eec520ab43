"""The Triton backend: the causal forward and backward around the kernels in `linattn_lib.kernels`.

`linear_attention(..., backend="triton")` lands in `linear_attention_triton`; `backend="auto"`
does too for CUDA tensors. On CUDA the kernels are compiled; on CPU tensors they run in the
Triton interpreter (numpy, one program at a time: slow, but the very same kernel source, so
the CPU tests check the code a GPU would run). bfloat16 needs a GPU: the interpreter has no
bfloat16 arithmetic. Under torch.compile the kernels run as torch custom ops (custom_ops.py:
autograd, fake implementations, `torch.compile(fullgraph=True)` without a graph break), which
call `causal_forward` / `causal_backward` here; in eager mode the causal op calls the same two
functions through `_CausalEager`, without the dispatcher.

What runs where (the maths is in the headers of kernels/chunk_state.py, chunk_output.py and
chunk_grad.py):

    causal forward    chunk_state            every chunk's entry state, sequential over chunks
                      chunk_output           every chunk's outputs, in parallel -> o, den, state
    causal backward   chunk_bwd_prep         1 / den and dL/dden per token (fp32)
                      chunk_state            the entry states again (recomputed, unless
                                             keep_chunk_states kept them)
                      chunk_state, reversed  the state gradient of every chunk, from the end;
                                             the gradient of the initial state
                      chunk_dqk, chunk_dv    dq, dk, dv of every chunk, in parallel
                      decay_grad             the log-decay's gradient (a suffix sum)
    non-causal        noncausal_state + noncausal_output, forward and backward (custom_ops.py)
    decoding          decode (one token, state updated in place; wrapper in decode.py)

Gradients flow to q, k, v, the log-decay and the initial state (S0 and z0). Packed sequences
(`cu_seqlens`) run through the same kernels (kernels/sequences.py).
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from .once import once_differentiable
from .state import DEFAULT_EPS, LinearAttentionState

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_kernels = None
_import_error: BaseException | None = None


def load_kernels() -> ModuleType | None:
    """The kernels package `linattn_lib.kernels`, imported once; None when it cannot be.

    `kernels_import_error()` then says why (no triton, or a triton too old for the kernels).

    The kernels live in the top-level `kernels/` folder, installed as `linattn_lib.kernels`.
    From a plain source checkout (no `pip install -e .`) that name does not exist yet, so the
    folder is loaded under it by path.
    """
    global _kernels, _import_error
    if _kernels is not None or _import_error is not None:
        return _kernels
    try:
        if importlib.util.find_spec("triton") is None:
            raise ImportError("the `triton` package is not installed")
        try:
            _kernels = importlib.import_module("linattn_lib.kernels")
        except ModuleNotFoundError as e:
            if e.name != "linattn_lib.kernels":
                raise
            init = Path(__file__).resolve().parents[2] / "kernels" / "__init__.py"  # the checkout root
            spec = importlib.util.spec_from_file_location(
                "linattn_lib.kernels", init, submodule_search_locations=[str(init.parent)]
            )
            if spec is None or not init.exists():
                raise
            module = importlib.util.module_from_spec(spec)
            sys.modules["linattn_lib.kernels"] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules["linattn_lib.kernels"]
                raise
            _kernels = module
    except Exception as e:  # no triton, or a triton too old for the kernels
        _import_error = e
    return _kernels


def kernels_import_error() -> BaseException | None:
    """Why `load_kernels()` returned None (None when the kernels imported or were not tried)."""
    return _import_error


def triton_available() -> bool:
    """True when `backend="triton"` can run here: Triton and `linattn_lib.kernels` import.

    CUDA tensors then run compiled kernels and CPU tensors run them in the Triton interpreter
    (which works whether or not TRITON_INTERPRET=1 is set). `backend="auto"` picks Triton for
    CUDA tensors only; for "is there a GPU for the fast path" ask `torch.cuda.is_available()`.
    """
    return load_kernels() is not None


@torch.compiler.assume_constant_result
def kernels_imported() -> bool:
    """`triton_available()`, run eagerly even while `torch.compile` traces (an import cannot
    be traced): so a compiled first call loads the kernels too, and every later trace reads
    them as the constant they are. Ask it before anything that loads the kernels."""
    return triton_available()


def triton_supports(q: Tensor, v: Tensor) -> bool:
    """True when the kernels are available and take these inputs: float32, float16 or bfloat16,
    and head dims Dk = q.shape[-1], Dv = v.shape[-1] up to `MAX_HEAD_DIM` (256)."""
    K = load_kernels()
    return K is not None and q.dtype in SUPPORTED_DTYPES and max(q.shape[-1], v.shape[-1]) <= K.MAX_HEAD_DIM


def require_kernels(fn: str) -> ModuleType:
    """`load_kernels()`, or a RuntimeError naming `fn` and why the kernels do not import."""
    K = load_kernels()
    if K is None:
        raise RuntimeError(f"{fn}: the Triton backend is not available: {_import_error}")
    return K


def _check_inputs(fn: str, q: Tensor, v: Tensor) -> None:
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{fn}: the Triton kernels take float32, float16 or bfloat16 inputs, got {q.dtype} "
            "(use backend='torch' for float64)"
        )
    if q.device.type not in ("cuda", "cpu"):
        raise ValueError(f"{fn}: the Triton kernels run on CUDA (or on CPU in the interpreter), got {q.device}")
    if q.is_cpu and q.dtype == torch.bfloat16:
        raise TypeError(
            f"{fn}: bfloat16 on CPU would run in the Triton interpreter, which has no bfloat16 "
            "arithmetic; use a CUDA device, float16/float32, or backend='torch'"
        )
    K = require_kernels(fn)
    for name, d in (("Dk", q.shape[-1]), ("Dv", v.shape[-1])):
        if d > K.MAX_HEAD_DIM:
            raise ValueError(
                f"{fn}: the Triton kernels support head dims up to {K.MAX_HEAD_DIM}, got {name}={d}; "
                "use backend='torch'"
            )


def _f32(g: Tensor | None) -> Tensor | None:
    """The log-decay as the kernels read it, float32 and contiguous: converted once per pass
    here (a no-op for a float32 one), not once per launcher."""
    if g is None or (g.dtype == torch.float32 and g.is_contiguous()):
        return g  # as .to() would, without its argument parsing (~1 us a call)
    return g.to(torch.float32).contiguous()


def _state_grads(dS: Tensor | None, dz: Tensor | None, S: Tensor, z: Tensor | None):
    """Gradients of the final state as a pair that is either (None, None) or two tensors."""
    if dS is None and dz is None:
        return None, None
    dS = torch.zeros_like(S) if dS is None else dS.float()
    if z is not None:
        dz = torch.zeros_like(z) if dz is None else dz.float()
    return dS, dz


def _final_state_term(dS_T: Tensor | None, S_T, dz_T, z_T) -> Tensor | None:
    """<dS_T, S_T> (+ <dz_T, z_T>) per (sequence, head), fp32: what the final state adds to the
    gradient of every log-decay of its sequence (None without a final-state gradient)."""
    if dS_T is None:
        return None
    end = (dS_T * S_T).sum((-2, -1))
    if dz_T is not None:
        end = end + (dz_T * z_T).sum(-1)
    return end.float()


def causal_forward(q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, S0: Tensor | None, z0: Tensor | None,
                   normalize: bool, eps: float, return_state: bool,
                   cu_seqlens: Tensor | None = None, keep_states: bool = False) -> tuple[Tensor, ...]:
    """The causal forward: (o, den, S_T, z_T); den is None unless normalize, S_T and z_T
    None unless return_state (z_T also unless normalize). Not differentiable by itself: the
    autograd Function below and the torch custom op (custom_ops.py) pair it with
    `causal_backward`. cu_seqlens: packed sequences (B = 1; states one per sequence).
    keep_states: also return (h, hz), every chunk's entry state (hz None unless normalize),
    for the backward to take instead of recomputing them."""
    K = require_kernels("linear_attention")
    init = (S0, z0) if S0 is not None else None
    g = _f32(g)
    # two phases: every chunk's entry state (chunk_state), then all chunks in parallel
    o, den, S_T, z_T, *states = K.chunk_fwd_two_phase(
        q, k, v, log_decay=g, normalize=normalize, eps=eps, initial_state=init,
        store_final_state=return_state, cu_seqlens=cu_seqlens, return_entry_states=keep_states,
    )
    out = (o, (den if normalize else None), S_T, (z_T if normalize else None))
    return (*out, states[0], states[1] if normalize else None) if keep_states else out


def causal_backward(q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, S0: Tensor | None, z0: Tensor | None,
                    o: Tensor, den: Tensor | None, S_T: Tensor | None, z_T: Tensor | None,
                    do: Tensor | None, dS_T: Tensor | None, dz_T: Tensor | None,
                    normalize: bool, needs: tuple[bool, ...],
                    cu_seqlens: Tensor | None = None,
                    entry_states: tuple[Tensor, Tensor | None] | None = None) -> tuple[Tensor | None, ...]:
    """Gradients (dq, dk, dv, dg, dS0, dz0) of the causal forward, each None where `needs`
    (six flags, in that order) is False or the input is None. entry_states: (h, hz) from
    `causal_forward(..., keep_states=True)`, or None to recompute them.

    The two-phase backward (kernels/chunk_grad.py): the state gradient of every chunk from the
    end, then every chunk's dq, dk and dv in parallel, with 1 / den and dL/dden in fp32 on chip
    (no loss scaling, no fp32 copy of dO). The log-decay's gradient is a suffix sum of the
    kernels' per-token q . dq - k . dk, plus the final state's term at the last token.
    """
    K = require_kernels("linear_attention")
    need_q, need_k, need_v, need_g, need_S0, need_z0 = needs
    if do is None:
        do = torch.zeros_like(o)
    dS_T, dz_T = _state_grads(dS_T, dz_T, S_T, z_T) if S_T is not None else (None, None)
    end_state = (dS_T, dz_T) if dS_T is not None else None
    # The tail past the last nonzero cotangent is left out (its gradients are exactly 0);
    # with a gradient of the final state every token is used.
    # (Packed sequences have no padding: every token is used.)
    out = K.chunk_bwd_two_phase(
        q, k, v, do, o=o if normalize else None, den=den if normalize else None, log_decay=_f32(g),
        initial_state=(S0, z0) if S0 is not None else None, final_state_grad=end_state,
        skip_dead_tail=end_state is None and cu_seqlens is None,
        need_initial_state_grad=need_S0 or need_z0, need_log_decay_grad=need_g, cu_seqlens=cu_seqlens,
        log_decay_end=_final_state_term(dS_T, S_T, dz_T, z_T) if need_g else None,
        entry_states=entry_states,
    )
    dg = None
    if need_g:  # a decay per head: the sum of its tokens' gradients
        dg = (out["dG"].sum((0, 2)) if g.dim() == 1 else out["dG"]).to(g.dtype)
    dS0 = out["dS0"].to(S0.dtype) if need_S0 else None
    dz0 = out["dz0"].to(z0.dtype) if (need_z0 and out["dz0"] is not None) else None
    return (out["dq"] if need_q else None, out["dk"] if need_k else None, out["dv"] if need_v else None,
            dg, dS0, dz0)


class _CausalEager(torch.autograd.Function):
    """The causal op in eager mode: `causal_forward` and `causal_backward`, exactly as the custom
    op `torch.ops.linattn.causal_fwd` and its registered backward call them, without the
    dispatcher. Through the custom op a training step's forward+backward pays about 0.3 ms of
    host time in torch's custom-op and autograd wrappers (measured with the launches stubbed,
    `python -m linattn_lib.experiments.host_overhead`), more than the launchers themselves; a
    plain autograd Function pays a fraction of it. Under torch.compile the custom op is used
    (it has the fake implementation the tracer needs), so compiled and eager run the same
    kernels with the same arguments."""

    @staticmethod
    def forward(ctx, q, k, v, g, S0, z0, normalize, eps, return_state, cu_seqlens, keep_states):
        o, den, S_T, z_T, *states = causal_forward(q, k, v, g, S0, z0, normalize, eps, return_state,
                                                   cu_seqlens, keep_states)
        h, hz = states or (None, None)
        ctx.save_for_backward(q, k, v, g, S0, z0, o, den, S_T, z_T, cu_seqlens, h, hz)
        ctx.normalize = normalize
        ctx.set_materialize_grads(False)  # unused outputs get None (the backward skips them)
        return o, S_T, z_T

    @staticmethod
    @once_differentiable("linear_attention(backend='triton')", "backend='torch' with form='quadratic' "
                         "or form='recurrent' is plain torch and has them.")
    def backward(ctx, do, dS_T, dz_T):
        q, k, v, g, S0, z0, o, den, S_T, z_T, cu_seqlens, h, hz = ctx.saved_tensors
        inputs = (q, k, v, g, S0, z0)
        needs = tuple(bool(n) and x is not None for n, x in zip(ctx.needs_input_grad[:6], inputs))
        grads = causal_backward(q, k, v, g, S0, z0, o, den, S_T, z_T, do, dS_T, dz_T, ctx.normalize, needs,
                                cu_seqlens, None if h is None else (h, hz))
        return *grads, None, None, None, None, None


def _eager(q: Tensor) -> bool:
    """Whether to call the kernels without the custom op's dispatcher: not while torch.compile
    traces (it needs the op), and only for real tensors (a meta tensor takes the op's fake).
    q stands for every input: `linear_attention` has checked that they share its device."""
    return not torch.compiler.is_compiling() and q.device.type in ("cuda", "cpu")


def linear_attention_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    normalize: bool = True,
    log_decay: Tensor | None = None,
    eps: float = DEFAULT_EPS,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
    cu_seqlens: Tensor | None = None,
    keep_chunk_states: bool = False,
) -> Tensor | tuple[Tensor, LinearAttentionState]:
    """Linear attention with the Triton kernels (inputs already validated by `linear_attention`).

    Same contract as `linear_attention(..., form="chunked")`: o has the dtype of v; the
    returned state is float32. Differentiable in q, k, v, log_decay and initial_state.

    The kernels run as the torch custom ops `torch.ops.linattn.causal_fwd` and
    `noncausal_fwd` (registered, with their backward ops, by custom_ops.py, which
    `linattn_lib` imports), so `torch.compile(fullgraph=True)` traces this without a break;
    in eager mode the causal kernels are called through `_CausalEager` instead, the same
    functions without the dispatcher's host cost.
    """
    fn = "linear_attention"
    _check_inputs(fn, q, v)
    if log_decay is not None and not causal:
        raise ValueError(f"{fn}: `log_decay` needs causal=True")
    S0 = z0 = None
    if initial_state is not None:
        S0 = initial_state.S
        z0 = initial_state.z if normalize else None
    eps = float(eps)
    # by name through the dispatcher, not imported: custom_ops.py imports this module
    if causal and _eager(q):
        o, S, z = _CausalEager.apply(q, k, v, log_decay, S0, z0, normalize, eps, return_state, cu_seqlens,
                                     keep_chunk_states)
    elif causal:
        op = torch.ops.linattn.causal_fwd_keep if keep_chunk_states else torch.ops.linattn.causal_fwd
        o, _, S, z, *_ = op(q, k, v, log_decay, S0, z0, normalize, eps, return_state, cu_seqlens)
    else:
        if cu_seqlens is not None:
            raise ValueError(f"{fn}: the non-causal kernels take no packed sequences (linear_attention "
                             "pads them into a batch)")
        o, _, S, z = torch.ops.linattn.noncausal_fwd(q, k, v, S0, z0, normalize, eps)
    if not return_state:
        return o
    return o, LinearAttentionState(S, z if normalize else None)


# --------------------------------------------------------------------------------------
# the fused FAVOR+ feature map (kernels/favor.py)
# --------------------------------------------------------------------------------------


class _PositiveRandomFeatures(torch.autograd.Function):
    """phi = exp(W x' - |x'|^2/2 - c) / sqrt(m) from the fused kernel; the backward in torch.

    With x' = s x and the shift c held constant (the reference detaches it),
    d phi_i / d x' = phi_i (w_i - x') and d phi_i / d w_i = phi_i x', so with G = dphi * phi:
    dx = s (G W - x' sum_i G_i) and dW = G^T x' (summed over rows) -- two matmuls and a
    row sum from the saved output: nothing is recomputed.
    """

    @staticmethod
    def forward(ctx, x, W, input_scale: float, stabilize):
        phi = _kernels.favor_features(x, W, input_scale=input_scale, stabilize=stabilize)
        ctx.save_for_backward(x, W, phi)
        ctx.input_scale = input_scale
        return phi

    @staticmethod
    @once_differentiable("positive_random_features(backend='triton')", "backend='torch' is plain torch "
                         "and has them.")
    def backward(ctx, dphi):
        x, W, phi = ctx.saved_tensors
        s = ctx.input_scale
        G = dphi.float() * phi.float()  # (..., T, m)
        xs = x.float() * s
        dx = dW = None
        if ctx.needs_input_grad[0]:
            dx = (s * (G @ W.float() - xs * G.sum(-1, keepdim=True))).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dW = (G.reshape(-1, G.shape[-1]).T @ xs.reshape(-1, xs.shape[-1])).to(W.dtype)
        return dx, dW, None, None


def positive_random_features_triton(
    x: Tensor, W: Tensor, *, input_scale: float = 1.0, stabilize: str | None = None
) -> Tensor:
    """`positive_random_features(..., backend="triton")`: FAVOR+ features from one fused kernel.

    x: (..., T, d) with d <= 256, float32/float16/bfloat16, on CUDA (or CPU: the interpreter);
    W: (m, d), any m. Same values as the torch map (computed in fp32, returned in x's dtype) and
    differentiable in x and W.
    """
    fn = "positive_random_features"
    require_kernels(fn)
    _check_inputs(fn, x, x)  # dtype, device, d <= 256
    if x.dim() < 2:
        raise ValueError(f"{fn}: backend='triton' needs x of shape (..., T, d), got {tuple(x.shape)}")
    return _PositiveRandomFeatures.apply(x, W.to(device=x.device, dtype=x.dtype), float(input_scale), stabilize)
