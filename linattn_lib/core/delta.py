"""The delta rule (DeltaNet) and its gated form (Gated DeltaNet): a state that overwrites.

Plain linear attention only ever *adds* to its state, S_t = S_{t-1} + k_t v_t^T: a key that
comes back with a new value retrieves the sum of everything stored under it. The delta rule
first asks the state what it currently predicts for the key, S_{t-1}^T k_t, and writes only
the correction towards the new value v_t (S is Dk x Dv, beta_t the write strength, g_t <= 0
the log of the gate alpha_t = exp(g_t), 0 for plain DeltaNet):

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
        = A - beta_t k_t (k_t^T A - v_t^T)        with A = exp(g_t) S_{t-1}
    o_t = S_t^T q_t                               (no normaliser)

The second line is one step of gradient descent, step size beta_t, on the regression loss
||S^T k_t - v_t||^2 / 2 of the (decayed) state: the state is a fast-weight memory trained
online to map keys to values (Schlag, Irie & Schmidhuber 2021, "Linear Transformers Are
Secretly Fast Weight Programmers"). With beta_t = 1 and a unit key the correction is
complete: afterwards S_t^T k_t = v_t exactly, the old value under k_t is replaced. Gated
DeltaNet (Yang, Kautz & Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta
Rule", ICLR 2025) multiplies the old state by the gate first, so a head can also forget
everything at once (g_t -> -inf resets it). In their (Dv x Dk) convention the update reads
S_t = S_{t-1} (alpha_t (I - beta_t k_t k_t^T)) + beta_t v_t k_t^T; the state here is its
transpose, as in the rest of the library (read as o_t = q_t^T S_t).

Three forms, agreeing to rounding in float64:

* ``"recurrent"``: the definition, one rank-one correction per token.
* ``"chunked"``: the WY representation with the UT transform (Yang, Wang, Zhang, Shen & Kim,
  "Parallelizing Linear Transformers with the Delta Rule over Sequence Length", NeurIPS
  2024). Inside a chunk the products of the C transitions are never formed: one unit lower
  triangular solve per chunk gives the pseudo-values U = U~ - W S of all its tokens at once
  (see `_ut_transform`), and only the state passes from chunk to chunk.
* ``"quadratic"``: the same algebra over the whole sequence as one chunk, a T x T system; for
  teaching and tests.

Backends: ``backend="torch"`` runs the forms above in torch (any dtype, autograd through the
ops); ``backend="triton"`` runs the chunked form on the Triton kernels of kernels/delta_rule.py
with their own backward (core/delta_triton.py; on CPU tensors in the Triton interpreter);
``"auto"`` (the default) picks Triton for CUDA tensors of fp32/fp16/bf16, torch otherwise (and
where a gradient is needed on Hopper with a Triton that miscompiles the backward, 3.4 to 3.7.0).

Decays follow the numerics rule of `state.py`: a decay between positions j < i is
exp(g_{j+1} + ... + g_i), summed over the interval (`segsum`, `sum_after`, cumulative sums
from a chunk's start), never a difference of prefix sums, so every exponent is <= 0.
"""
from __future__ import annotations

import functools
from typing import Literal, overload

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _validate as V
from . import delta_ops  # noqa: F401 - registers torch.ops.linattn.delta_fwd / delta_bwd for torch.compile
from .delta_triton import delta_rule_triton
from .masks import segsum
from .packed_ops import func_transform_active, make_host_op
from .state import LinearAttentionState, compute_dtype, expand_log_decay, sum_after
from .triton_ops import kernels_imported, load_kernels, triton_supports
from .varlen import check_cu_seqlens, sequence_spans

FORMS = ("recurrent", "chunked", "quadratic")
BACKENDS = ("auto", "torch", "triton")
DEFAULT_CHUNK_SIZE = 64  # of backend="torch"; the kernels pick their own (see `delta_rule_attention`)

# How far ||k_t|| may stray from 1 under check_unit_keys=True: a few roundings of the dtype in
# which the keys were normalised (half precision keeps about 3 significant digits).
UNIT_KEY_TOLERANCE = {torch.float64: 1e-8, torch.float32: 1e-5}
UNIT_KEY_TOLERANCE_LOW_PRECISION = 1e-2

_BETA_WHY = (
    "a write strength in [0, 2]: the transition's eigenvalue 1 - beta ||k||^2 stays in [-1, 1] for unit keys; "
    "beta = 0 writes nothing"
)


# --- checks ------------------------------------------------------------------------------


def _check_beta(fn: str, beta: object, q: Tensor, expected: tuple[int, ...], layout: tuple[str, ...]) -> None:
    """beta has the shape `expected` (named by `layout`), q's dtype and device, values in [0, 2]."""
    V.check_shape(fn, "beta", beta, expected, layout)
    V.check_same(fn, [("q", q), ("beta", beta)])
    V.check_values(fn, "beta", beta, low=0.0, why=_BETA_WHY)
    V.check_values(fn, "beta", beta, high=2.0, why=_BETA_WHY)


def _check_unit_keys(fn: str, k: Tensor) -> None:
    """Every key has norm 1 within UNIT_KEY_TOLERANCE; names the worst one (eager mode only)."""
    if not V.values_checked():
        return
    tol = UNIT_KEY_TOLERANCE.get(k.dtype, UNIT_KEY_TOLERANCE_LOW_PRECISION)
    norms = torch.linalg.vector_norm(k.detach().to(compute_dtype(k)), dim=-1)
    err = (norms - 1.0).abs()
    if bool((err > tol).any()):
        where = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
        raise ValueError(
            f"{fn}: check_unit_keys=True but `k` has a key of norm {float(norms[where]):.6g} at index {where} "
            f"({V.describe(k)}); expected ||k|| = 1 within {tol:g} for every key: normalise them first, "
            "k = F.normalize(k, dim=-1)"
        )


def _check_state(fn: str, name: str, state: object, *, B: int, H: int, Dk: int, Dv: int, device) -> Tensor:
    """A (B, H, Dk, Dv) tensor or a LinearAttentionState(S, None); returns S."""
    if isinstance(state, Tensor):
        state = LinearAttentionState(state, None)
    V.check_state(fn, name, state, B=B, H=H, Dk=Dk, Dv=Dv, device=device, normalize=False)
    S, z = state
    if z is not None:
        got = V.describe(z) if isinstance(z, Tensor) else type(z).__name__
        raise ValueError(f"{fn}: `{name}.z` must be None: the delta rule has no normaliser state, got {got}")
    return S


def _check_inputs(fn, q, k, v, beta, log_decay, form, chunk_size, initial_state, return_state, check_unit_keys):
    """All the checks of `delta_rule_attention` but the backend's; returns the initial S (or None)."""
    V.check_qkv(fn, q, k, v)
    V.check_choice(fn, "form", form, FORMS)
    if chunk_size is not None:
        V.check_positive_int(fn, "chunk_size", chunk_size)
    V.check_flag(fn, "return_state", return_state)
    unit = V.check_flag(fn, "check_unit_keys", check_unit_keys)
    V.check_all_finite(fn, (("q", q), ("k", k), ("v", v)))
    B, H, T, Dk = q.shape
    _check_beta(fn, beta, q, (B, H, T), ("B", "H", "T"))
    if log_decay is not None:
        V.check_log_decay(fn, log_decay, q, causal=True)
    if unit:
        _check_unit_keys(fn, k)
    if initial_state is None:
        return None
    return _check_state(fn, "initial_state", initial_state, B=B, H=H, Dk=Dk, Dv=v.shape[-1], device=q.device)


def _use_triton(fn: str, backend: str, form: str, q: Tensor, v: Tensor, chunk_size: int | None,
                needs_grad: bool = False) -> bool:
    """Whether `backend` runs on the Triton kernels; refuses what backend="triton" cannot do.
    "auto" also keeps to torch where a gradient is needed and this Triton miscompiles the
    kernels' backward on the GPU (`_backward_miscompiled`): "triton" refuses it there, at the
    backward, naming the fix."""
    V.check_choice(fn, "backend", backend, BACKENDS)
    if backend == "auto":
        ok_chunk = chunk_size is None or (chunk_size >= 16 and chunk_size & (chunk_size - 1) == 0)
        return (q.is_cuda and form == "chunked" and ok_chunk and kernels_imported() and triton_supports(q, v)
                and not (needs_grad and _backward_miscompiled(q)))
    if backend == "torch":
        return False
    if form != "chunked":
        raise ValueError(f"{fn}: backend='triton' implements form='chunked' only, got form={form!r}")
    if chunk_size is not None and (chunk_size < 16 or chunk_size & (chunk_size - 1)):
        raise ValueError(f"{fn}: backend='triton' needs chunk_size None or a power of two >= 16, got {chunk_size}")
    if not (kernels_imported() and triton_supports(q, v)):
        raise ValueError(f"{fn}: backend='triton' takes float32, float16 or bfloat16 inputs with head dims up "
                         f"to 256 (and needs triton), got {q.dtype}, Dk={q.shape[-1]}, Dv={v.shape[-1]}")
    if q.is_cpu and q.dtype == torch.bfloat16:  # the interpreter's bf16 dots return NaN, silently
        raise TypeError(f"{fn}: bfloat16 on CPU would run in the Triton interpreter, which has no bfloat16 "
                        "arithmetic; use a CUDA device, float16/float32, or backend='torch'")
    return True


def _backward_miscompiled(q: Tensor) -> bool:
    """Whether the installed Triton miscompiles the delta rule's backward kernels on q's GPU:
    Hopper with Triton 3.4 <= v < 3.7.1 (fla issue #640; kernels/configs.py)."""
    configs = load_kernels().configs
    return configs.miscompiles_transposed_dots(configs.device_capability(q.device))


# --- the three forms (inputs already checked and cast to the compute dtype) ----------------


def _delta_step(S: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor) -> Tensor:
    """One token: S <- A - beta k (k^T A - v^T) with A = exp(g) S.

    S: (B, H, Dk, Dv), k: (B, H, Dk), v: (B, H, Dv), beta and g: (B, H).
    """
    A = torch.exp(g)[..., None, None] * S
    error = (k.unsqueeze(-1) * A).sum(-2) - v  # the decayed state's prediction minus the target
    return A - beta[..., None, None] * k.unsqueeze(-1) * error.unsqueeze(-2)


def _recurrent(q, k, v, beta, g, S):
    """The definition: one correction and one readout per token."""
    outs = []
    for t in range(q.shape[2]):
        S = _delta_step(S, k[:, :, t], v[:, :, t], beta[:, :, t], g[:, :, t])
        outs.append((q[:, :, t, :, None] * S).sum(-2))
    return torch.stack(outs, dim=2), S


def _ut_transform(k: Tensor, v: Tensor, beta: Tensor, g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """W and U~ of the WY representation of one block of tokens, and its decay mask.

    Over a block of C tokens entered with state S_0, write every update as an addition,
    S_i = a_i S_{i-1} + k_i u_i^T, with the pseudo-value u_i = beta_i (v_i - a_i S_{i-1}^T k_i).
    Unrolling S_{i-1} and writing L[i, j] = exp(g_{j+1} + ... + g_i), gam_i = exp(g_1 + ... + g_i):

        u_i + beta_i sum_{j<i} L[i, j] (k_i . k_j) u_j = beta_i (v_i - gam_i S_0^T k_i)

    a unit lower triangular system (I + tril(diag(beta) (K K^T * L), -1)) U = diag(beta) (V - gam K S_0).
    With T_c = (I + tril(...))^{-1} diag(beta), U = U~ - W S_0 where U~ = T_c V and W = T_c (gam K):
    both come from one triangular solve (no inverse formed) and need no S_0, so every chunk
    computes them in parallel. Leading axes are batch axes; returns (W, U~, L).
    """
    C = k.shape[-2]
    L = torch.exp(segsum(g))  # (..., C, C), 1 on the diagonal, 0 above it
    strict = torch.ones(C, C, dtype=torch.bool, device=k.device).tril(-1)
    eye = torch.eye(C, dtype=k.dtype, device=k.device)
    system = eye + torch.where(strict, beta.unsqueeze(-1) * (k @ k.transpose(-1, -2)) * L, 0.0)
    gam = torch.exp(torch.cumsum(g, dim=-1)).unsqueeze(-1)  # decay from the block's start, <= 1
    rhs = beta.unsqueeze(-1) * torch.cat([gam * k, v], dim=-1)
    sol = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    return sol[..., : k.shape[-1]], sol[..., k.shape[-1]:], L


def _block_pieces(q, k, v, beta, g):
    """Everything a block needs that does not depend on its entry state S_0."""
    W, U_tilde, L = _ut_transform(k, v, beta, g)
    C = q.shape[-2]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    scores = torch.where(causal, (q @ k.transpose(-1, -2)) * L, 0.0)  # (q_i . k_j) L[i, j], j <= i
    q_in = q * torch.exp(torch.cumsum(g, dim=-1)).unsqueeze(-1)  # reads S_0 decayed to position i
    k_out = k * torch.exp(sum_after(g)).unsqueeze(-1)  # writes decayed to the block's end
    total = torch.exp(g.sum(-1))  # decay across the whole block
    return W, U_tilde, scores, q_in, k_out, total


def _block_apply(S, W, U_tilde, scores, q_in, k_out, total):
    """One block with entry state S: pseudo-values, outputs and the exit state."""
    U = U_tilde - W @ S
    o = q_in @ S + scores @ U
    S = total[..., None, None] * S + k_out.transpose(-1, -2) @ U
    return o, S


def _quadratic(q, k, v, beta, g, S):
    """The parallel form: the whole sequence as one block, a T x T triangular system.

    O = (Q K^T * M)(I + tril(diag(beta) K K^T * M, -1))^{-1} diag(beta) V with the decay mask M,
    plus, with an initial state S_0, the terms that read it (gam Q S_0) and correct for it (-W S_0).
    """
    return _block_apply(S, *_block_pieces(q, k, v, beta, g))


def _chunked(q, k, v, beta, g, S, chunk_size):
    """WY / UT form: every chunk's W, U~ and masks at once, then the state from chunk to chunk."""
    B, H, T, _ = q.shape
    C = chunk_size
    pad = (-T) % C
    if pad:  # zero keys and values with beta = 0, g = 0 leave the state as it is
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    N = q.shape[2] // C
    qc, kc, vc = (x.reshape(B, H, N, C, x.shape[-1]) for x in (q, k, v))
    pieces = _block_pieces(qc, kc, vc, beta.reshape(B, H, N, C), g.reshape(B, H, N, C))
    outs = []
    for n in range(N):
        o, S = _block_apply(S, *(p[:, :, n] for p in pieces))
        outs.append(o)
    return torch.cat(outs, dim=2)[:, :, :T], S


# --- public API ----------------------------------------------------------------------------


@overload
def delta_rule_attention(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, *, log_decay: Tensor | None = ..., form: str = ...,
    chunk_size: int | None = ..., initial_state: Tensor | LinearAttentionState | None = ...,
    return_state: Literal[False] = ..., check_unit_keys: bool = ..., backend: str = ...,
    cu_seqlens: Tensor | None = ...,
) -> Tensor: ...


@overload
def delta_rule_attention(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, *, log_decay: Tensor | None = ..., form: str = ...,
    chunk_size: int | None = ..., initial_state: Tensor | LinearAttentionState | None = ...,
    return_state: Literal[True], check_unit_keys: bool = ..., backend: str = ...,
    cu_seqlens: Tensor | None = ...,
) -> tuple[Tensor, LinearAttentionState]: ...


def delta_rule_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    *,
    log_decay: Tensor | None = None,
    form: str = "chunked",
    chunk_size: int | None = None,
    initial_state: Tensor | LinearAttentionState | None = None,
    return_state: bool = False,
    check_unit_keys: bool = False,
    backend: str = "auto",
    cu_seqlens: Tensor | None = None,
) -> Tensor | tuple[Tensor, LinearAttentionState]:
    """Causal delta-rule attention (DeltaNet; Gated DeltaNet with `log_decay`).

        S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t

    Args:
        q, k: (B, H, T, Dk). DeltaNet L2-normalises the keys (and usually the queries):
            pass ``k = F.normalize(k, dim=-1)``; the stability argument below needs ||k_t|| = 1.
            q is not scaled (fla's ops scale it by Dk^-0.5: pass q * Dk**-0.5 to match them).
        v: (B, H, T, Dv).
        beta: (B, H, T) write strengths in [0, 2], same dtype and device as q (DeltaNet uses
            a sigmoid, in [0, 1): in half precision sigmoid(x) is exactly 0 for x <= -18;
            2 * sigmoid reaches the reflections). beta = 0 writes nothing: the token only
            decays the state. The transition I - beta k k^T leaves the directions orthogonal to
            k alone (eigenvalue 1) and scales the component along k by 1 - beta ||k||^2. For a
            unit key and beta in [0, 2] that is in [-1, 1]: every transition is non-expansive (spectral norm 1: the old state
            never grows, only the writes add; chapter 10 measures the norm staying flat for beta
            below 2 and growing like sqrt(t) at beta = 2, a Householder reflection); beta > 2
            (or beta < 0) would amplify the component along k, exponentially over time.
        log_decay: None (DeltaNet) or the log of the gate alpha_t, <= 0 (Gated DeltaNet):
            (H,) per head or (B, H, T) per token.
        form: "recurrent" (token loop), "chunked" (WY representation / UT transform) or
            "quadratic" (one T x T triangular system). All three agree.
        chunk_size: chunk length of the chunked form; T need not be a multiple of it. None:
            DEFAULT_CHUNK_SIZE (64) on torch, the kernels' own on Triton (64 for fp16 / bf16, 32
            for fp32); backend="triton" takes powers of two >= 16.
        initial_state: S_0, a (B, H, Dk, Dv) tensor or a LinearAttentionState(S, None) (e.g. the
            state returned by a previous call on the preceding piece of the sequence).
        return_state: also return the final state as LinearAttentionState(S, None).
        check_unit_keys: refuse keys whose norm is not 1 (within UNIT_KEY_TOLERANCE).
        backend: "torch" (the forms above in torch), "triton" (the chunked form on the Triton
            kernels, forward and backward: fp32 / fp16 / bf16, head dims up to 256; compiled
            on CUDA, interpreted on CPU) or "auto" (Triton for CUDA tensors it supports with
            form="chunked", torch otherwise, and torch where a gradient is needed on Hopper
            with Triton 3.4 to 3.7.0, which miscompiles the kernels' backward). Gradients reach q, k, v, beta, log_decay and
            initial_state on every backend.
        cu_seqlens: packed variable-length sequences, as in `linear_attention`: B = 1, the N
            sequences laid end to end along T, cu_seqlens the (N + 1,) int32/int64 cumulative
            starts (0, ..., T). Each sequence runs alone (on the chosen backend), from its own
            row of initial_state (then (N, H, Dk, Dv)); the returned state has one row per
            sequence (a sequence of length 0 passes its initial state through). The starts are
            read on the host: one sync for CUDA tensors.

    Returns:
        o (B, H, T, Dv) in the dtype of v, or (o, state) when return_state=True. Sums are kept in
        float64 for float64 inputs and in float32 otherwise; the state is returned in that dtype
        (float32 on Triton).

    Raises:
        ValueError (or TypeError for a wrong type) naming the argument, with its shape, dtype and
        what was expected.

    Checks: as `linear_attention`'s. Shapes, dtypes and devices always; the values (q, k, v
    finite, beta in [0, 2], log_decay <= 0) for CPU tensors in eager mode, for CUDA tensors
    only when opted in; not traced by torch.compile (on CPU the library op that the compiled
    graph calls still checks). Unchecked, a NaN or inf is computed with:
    in the chunked and quadratic forms it meets the causal mask's zeros in a matmul
    (0 * NaN = NaN) and reaches outputs *before* its position too (every earlier output of
    its chunk, of the whole sequence in the quadratic form).

    torch.func (grad, vmap, per-sample gradients) works as for `linear_attention`.
    """
    fn = "delta_rule_attention"
    if cu_seqlens is not None:
        return _packed(fn, q, k, v, beta, cu_seqlens, initial_state, return_state, log_decay=log_decay,
                       form=form, chunk_size=chunk_size, check_unit_keys=check_unit_keys, backend=backend)
    S0 = _check_inputs(fn, q, k, v, beta, log_decay, form, chunk_size, initial_state, return_state, check_unit_keys)
    if form != "quadratic" and func_transform_active():
        # torch.func (grad, vmap): the loops and kernels go through the host op, which it
        # differentiates and maps (packed_ops.py); the quadratic form is plain torch. Also
        # for inputs the transform does not see: torch refuses the library's own autograd
        # Functions whenever a transform is running
        o, S, _ = _host_op(q, k, v, beta, log_decay, S0, None, None, True, False, form, 0.0, chunk_size, backend)
        return (o, LinearAttentionState(S, None)) if return_state else o
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, beta, log_decay, S0))
    if _use_triton(fn, backend, form, q, v, chunk_size, needs_grad):
        o, S = delta_rule_triton(q, k, v, beta, log_decay=log_decay, initial_state=S0, chunk_size=chunk_size)
        return (o, LinearAttentionState(S, None)) if return_state else o
    if torch.compiler.is_compiling() and form != "quadratic":
        # the loop over chunks or tokens (its length depends on T), as one op opaque to the
        # compiler (packed_ops.py): traced, it would be unrolled for every new length
        o, S, _ = _host_op(q, k, v, beta, log_decay, S0, None, None, True, False, form, 0.0, chunk_size, backend)
        return (o, LinearAttentionState(S, None)) if return_state else o
    chunk_size = DEFAULT_CHUNK_SIZE if chunk_size is None else chunk_size
    B, H, T, Dk = q.shape
    dtype = compute_dtype(q)
    qq, kk, vv, bb = (x.to(dtype) for x in (q, k, v, beta))
    g = expand_log_decay(log_decay, B, H, T, dtype=dtype, device=q.device)
    S = q.new_zeros(B, H, Dk, v.shape[-1], dtype=dtype) if S0 is None else S0.to(dtype)
    # in the compute dtype even under torch.autocast, which would run the matmuls in bf16
    with torch.autocast(q.device.type, enabled=False):
        if form == "recurrent":
            o, S = _recurrent(qq, kk, vv, bb, g, S)
        elif form == "quadratic":
            o, S = _quadratic(qq, kk, vv, bb, g, S)
        else:
            o, S = _chunked(qq, kk, vv, bb, g, S, int(chunk_size))
    o = o.to(v.dtype)
    return (o, LinearAttentionState(S, None)) if return_state else o


def _packed(fn, q, k, v, beta, cu_seqlens, initial_state, return_state, **kw):
    """`delta_rule_attention` over packed sequences: each span alone, outputs laid back end to
    end, one state row per sequence."""
    _check_inputs(fn, q, k, v, beta, kw["log_decay"], kw["form"], kw["chunk_size"], None, return_state,
                  kw["check_unit_keys"])
    if q.shape[0] != 1:
        raise ValueError(f"{fn}: with `cu_seqlens` the sequences are packed along T, so B must be 1, "
                         f"got `q` with {V.describe(q)}")
    H, Dk, Dv = q.shape[1], q.shape[-1], v.shape[-1]
    N = check_cu_seqlens(fn, cu_seqlens, q.shape[2], q.device)
    S0 = None if initial_state is None else _check_state(
        fn, "initial_state", initial_state, B=N, H=H, Dk=Dk, Dv=Dv, device=q.device)
    g = kw.pop("log_decay")
    if torch.compiler.is_compiling():  # the loop below, as one op opaque to the compiler
        o, S, _ = _host_op(q, k, v, beta, g, S0, None, cu_seqlens, True, False, kw["form"], 0.0,
                           kw["chunk_size"], kw["backend"])
        return (o, LinearAttentionState(S, None)) if return_state else o
    outs, states = [], []
    for i, (s, e) in enumerate(sequence_spans(cu_seqlens, q.shape[2], fn)):
        start = None if S0 is None else S0[i:i + 1]
        if e == s:  # no tokens: the state passes through
            states.append(q.new_zeros(1, H, Dk, Dv, dtype=compute_dtype(q)) if start is None else start)
            continue
        g_i = None if g is None else (g if g.dim() == 1 else g[:, :, s:e])
        o, st = delta_rule_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], beta[:, :, s:e], log_decay=g_i,
                                     initial_state=start, return_state=True, **kw)
        outs.append(o)
        states.append(st.S)
    o = torch.cat(outs, dim=2)
    if not return_state:
        return o
    dtype = functools.reduce(torch.promote_types, [S.dtype for S in states])
    return o, LinearAttentionState(torch.cat([S.to(dtype) for S in states]), None)


def _host_eager(q, k, v, beta, g, S0, z0, cu_seqlens, *, causal, normalize, form, eps, chunk_size, backend):
    """delta_rule_attention in eager mode (packed sequences, or a batch with cu_seqlens None),
    as (o, S, None)."""
    o, st = delta_rule_attention(q, k, v, beta, log_decay=g, initial_state=S0, return_state=True, form=form,
                                 chunk_size=chunk_size, check_unit_keys=False, backend=backend,
                                 cu_seqlens=cu_seqlens)
    return o, st.S, None


_host_op = make_host_op("delta_host", _host_eager)


def delta_rule_decode_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    state: Tensor | LinearAttentionState | None,
    *,
    log_decay: Tensor | None = None,
) -> tuple[Tensor, LinearAttentionState]:
    """One generation step of the delta rule: absorb token t, read it out.

    Args:
        q, k: (B, H, Dk) this token's query and key (unit keys, as for `delta_rule_attention`).
        v: (B, H, Dv).
        beta: (B, H) write strengths in [0, 2], same dtype and device as q.
        state: S_{t-1}, a (B, H, Dk, Dv) tensor or LinearAttentionState(S, None); None starts
            from zeros.
        log_decay: None, (H,) per head or (B, H) for this token, <= 0 (Gated DeltaNet).

    Returns:
        (o, new_state): o (B, H, Dv) in the dtype of v, new_state = LinearAttentionState(S_t, None)
        with S_t in float64 if q or the state is float64, else float32. Stepping through a
        sequence gives the outputs and final state of ``delta_rule_attention(form="recurrent")``.
    """
    fn = "delta_rule_decode_step"
    V.check_layout(fn, "q", q, ("B", "H", "Dk"))
    B, H, Dk = q.shape
    V.check_shape(fn, "k", k, (B, H, Dk), ("B", "H", "Dk"))
    V.check_layout(fn, "v", v, ("B", "H", "Dv"))
    V.check_shape(fn, "v", v, (B, H, v.shape[-1]), ("B", "H", "Dv"))
    V.check_same(fn, [("q", q), ("k", k), ("v", v)])
    V.check_all_finite(fn, (("q", q), ("k", k), ("v", v)))
    _check_beta(fn, beta, q, (B, H), ("B", "H"))
    if log_decay is not None:
        V.check_step_log_decay(fn, "log_decay", log_decay, B=B, H=H, device=q.device)
    Dv = v.shape[-1]
    S = None if state is None else _check_state(fn, "state", state, B=B, H=H, Dk=Dk, Dv=Dv, device=q.device)
    dtype = compute_dtype(q) if S is None else torch.promote_types(compute_dtype(q), compute_dtype(S))
    S = q.new_zeros(B, H, Dk, Dv, dtype=dtype) if S is None else S.to(dtype)
    g = q.new_zeros(B, H, dtype=dtype) if log_decay is None else log_decay.to(dtype).expand(B, H)
    qq, kk, vv, bb = (x.to(dtype) for x in (q, k, v, beta))
    S = _delta_step(S, kk, vv, bb, g)
    o = (qq.unsqueeze(-1) * S).sum(-2)
    return o.to(v.dtype), LinearAttentionState(S, None)
