"""`linear_attention`: the one public entry point, and the one place that picks a backend.

It checks the inputs, then hands them to the compiled Triton kernels (`triton_ops.py`, on
CUDA), the fast torch chunked path (`torch_chunked.py`, the CPU default) or the plain
reference forms (`reference.py`, the quadratic and recurrent forms for teaching). The
recurrence they all compute is stated in `state.py`.
"""
from __future__ import annotations

from typing import Literal, overload

import torch
from torch import Tensor

from .. import _validate as V
from . import custom_ops  # noqa: F401  (registers torch.ops.linattn.*, which the Triton path calls)
from .packed_ops import func_transform_active, make_host_op
from .reference import FORMS, reference_linear_attention
from .state import DEFAULT_EPS, LinearAttentionState
from .torch_chunked import chunked_linear_attention
from .triton_ops import _check_inputs, kernels_imported, linear_attention_triton, triton_supports
from .varlen import check_varlen, pad_and_batch, sequence_spans

BACKENDS = ("auto", "torch", "triton")


@overload
def linear_attention(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool = ..., normalize: bool = ...,
    log_decay: Tensor | None = ..., form: str = ..., chunk_size: int = ...,
    eps: float = ..., backend: str = ...,
    initial_state: LinearAttentionState | None = ...,
    return_state: Literal[False] = ..., cu_seqlens: Tensor | None = ...,
    keep_chunk_states: bool = ...,
) -> Tensor: ...


@overload
def linear_attention(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool = ..., normalize: bool = ...,
    log_decay: Tensor | None = ..., form: str = ..., chunk_size: int = ...,
    eps: float = ..., backend: str = ...,
    initial_state: LinearAttentionState | None = ...,
    return_state: Literal[True], cu_seqlens: Tensor | None = ...,
    keep_chunk_states: bool = ...,
) -> tuple[Tensor, LinearAttentionState]: ...


def linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    normalize: bool = True,
    log_decay: Tensor | None = None,
    form: str = "chunked",
    chunk_size: int = 64,
    eps: float = DEFAULT_EPS,
    backend: str = "auto",
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
    cu_seqlens: Tensor | None = None,
    keep_chunk_states: bool = False,
) -> Tensor | tuple[Tensor, LinearAttentionState]:
    """Linear attention over feature maps: o_i = sum_j w_ij (q_i . k_j) v_j [/ sum_j w_ij (q_i . k_j)].

    Args:
        q, k: (B, H, T, Dk) *features* phi(q), phi(k) (apply the feature map first). q is not
            scaled: fla's ops scale it by Dk^-0.5 by default (pass q * Dk**-0.5 to match them).
        v: (B, H, T, Dv).
        causal: sum over j <= i (True) or over all j (False).
        normalize: divide by the kernel row sums (plus `eps`); False gives the unnormalised
            form used by RetNet and Mamba-2 / SSD (and by fla's gated and delta-rule ops). The
            row sums need non-negative features: with signed ones they can cross zero.
        log_decay: optional log of the per-step decay, <= 0, shape (H,) or (B, H, T); then
            w_ij = exp(log_decay[j+1] + ... + log_decay[i]). Needs causal=True.
        form: "quadratic", "recurrent" or "chunked" (all three agree). Second derivatives
            (a gradient penalty, MAML) need "quadratic" or "recurrent": the chunked form's
            backward, torch's and the kernels', is written by hand and differentiable once,
            and a backward with create_graph=True through it raises NotImplementedError.
        chunk_size: chunk length of the chunked form on the torch path (the Triton kernels use
            the chunk length of their launch config, `linattn_lib.kernels.select_config`).
        eps: added to the denominator when normalize=True.
        backend: "auto" (compiled Triton on CUDA for fp16/bf16/fp32, torch otherwise), "torch", or "triton"
            (on CPU tensors: the Triton interpreter, slow, for teaching and tests). Only the
            chunked form has a Triton implementation.
        initial_state: a LinearAttentionState to resume from (e.g. the state returned by a
            previous call on the preceding piece of the sequence). With causal=False every
            query sees it beside all the keys: o_i = q_i (S0 + K^T V) / (q_i . (z0 + sum_j
            k_j) + eps).
        return_state: also return the final LinearAttentionState (causal=False: S0 + K^T V
            and z0 + sum_j k_j, as the causal form's state after the last token).
        cu_seqlens: packed variable-length sequences (as flash-attn's varlen functions and
            fla): an int32/int64 (N + 1,) tensor of cumulative starts, cu[0] = 0, cu[N] = T;
            q, k, v are then (1, H, T_total, D), log_decay (H,) or (1, H, T_total), and the
            initial and final states have one row per sequence, S (N, H, Dk, Dv) and
            z (N, H, Dk). Each sequence's output and state equal running it alone: the
            Triton kernels take the packed layout as it is (causal), the torch paths (and
            the non-causal kernels) run zero-padded batches of similar lengths
            (`linattn_lib.core.varlen`, which reads the spans on the host).
        keep_chunk_states: the causal Triton path keeps every chunk's entry state from the
            forward for the backward, which then skips the pass that recomputes them: one
            read of k and v fewer (about a tenth of a training step's traffic at
            T = 16384, d = 128 by appendix A.5.1's count; 10-12% of the forward+backward
            measured on an H200, appendix A.5.2), for
            B H ceil(T / C) d_k d_v more numbers held until the backward (bf16 for bf16
            inputs, fp32 otherwise; C the launch config's chunk length, 64 at d = 128 on an
            H100: twice the size of q). The same gradients either way. No effect elsewhere
            (the torch paths, causal=False, under no_grad).

    Returns:
        o of shape (B, H, T, Dv) in the dtype of v, or (o, state) when return_state=True.

    Checks. Shapes, dtypes, devices and the Python arguments are always checked (metadata
    only: free). The *values* -- q, k, v finite, log_decay finite and <= 0, initial_state
    finite, cu_seqlens starting at 0, non-decreasing and ending at T_total -- are checked
    for CPU tensors in eager mode (a sum and a min / max per tensor, a few percent of the
    torch path's forward; the element-wise search for the offending index only when that
    screen fails). For CUDA tensors they are opt-in
    (`linattn_lib._validate.CHECK_DEVICE_VALUES = True`, or LINATTN_CHECK_VALUES=1 in the
    environment), because each would cost a pass over its input and a device-to-host sync
    on every training step; unchecked, the kernels give NaN in exactly the outputs that
    depend on a non-finite input, and a bad cu_seqlens gives wrong outputs, not an access
    outside the tensors (the kernels clamp its starts); one that ends before T_total (trailing
    padding) leaves the rows after it unwritten, in the output and in the gradients: make the
    padding a sequence of its own, or pass the real tokens only. The kernels' grids hold at most
    65535 rows of batch x heads (packed: sequences x heads) and of chunks, CUDA's limit: a larger
    call is refused with a message (on every device), and can be split in two. Under torch.compile they are not traced:
    a compiled CUDA call is never checked; on CPU the causal chunked and recurrent forms and
    packed sequences, which the compiled graph calls as one library op, still check inside it.
    The causal CUDA path (forward and backward) makes no host synchronisation, packed
    sequences included (tests/test_hot_path.py): the kernels size their per-chunk buffers by
    the bound ceil(T_total / BT) + N - 1, not by the chunk count. With cu_seqlens and
    causal=False the spans are read on the host (one sync, and then checked) to pad the
    sequences into batches.

    torch.func. `grad`, `vjp`, `jacrev`, `vmap` and per-sample gradients
    (`vmap(grad(loss))`, as DP-SGD takes them) work on every form and backend: under a
    transform the causal chunked and recurrent paths and the kernels run as one op whose
    vmap rule folds the mapped dim into the batch (core/packed_ops.py, core/func_rules.py).
    Its backward recomputes the forward (one forward more per gradient), and the value
    checks are skipped for the transform's tensors. That backward is differentiable once:
    a second derivative through it (grad of grad, jacrev of jacrev) raises, as forward mode
    (`jvp`, `jacfwd`, `hessian`) does; form="quadratic" is plain torch and has both. vmap
    over packed sequences is refused.
    """
    fn = "linear_attention"
    V.check_qkv(fn, q, k, v)
    check_engine(fn, form, backend, chunk_size)
    for name, flag in (("causal", causal), ("normalize", normalize), ("return_state", return_state),
                       ("keep_chunk_states", keep_chunk_states)):
        V.check_flag(fn, name, flag)
    eps = V.check_eps(fn, eps)
    V.check_all_finite(fn, (("q", q), ("k", k), ("v", v)))
    if log_decay is not None:
        V.check_log_decay(fn, log_decay, q, causal=causal)
    packed = cu_seqlens is not None
    if packed:
        check_varlen(fn, q, k, v, cu_seqlens, log_decay=log_decay, initial_state=initial_state, normalize=normalize)
    elif initial_state is not None:
        B, H, _, Dk = q.shape
        V.check_state(fn, "initial_state", initial_state, B=B, H=H, Dk=Dk, Dv=v.shape[-1], device=q.device, normalize=normalize)
    use_triton = _use_triton(fn, backend, form, q, v)
    kw = dict(causal=causal, normalize=normalize, log_decay=log_decay, eps=eps,
              initial_state=initial_state, return_state=return_state)
    if func_transform_active() and (packed or use_triton or (causal and form != "quadratic")):
        # torch.func (grad, vmap): the paths that loop or launch kernels go through the host
        # op, which it differentiates and maps (packed_ops.py); the quadratic form is plain
        # torch. Also for inputs the transform does not see (captured constants): torch
        # refuses the library's own autograd Functions whenever a transform is running
        return _host_compiled(q, k, v, cu_seqlens, form=form, chunk_size=chunk_size, backend=backend, **kw)
    if use_triton and (not packed or causal):  # the kernels take packed sequences as they are
        return linear_attention_triton(q, k, v, cu_seqlens=cu_seqlens, **kw,
                                       keep_chunk_states=keep_chunk_states and causal and torch.is_grad_enabled())
    if torch.compiler.is_compiling() and (packed or (causal and form != "quadratic")):
        # a loop on the host (over packed sequences, or the causal torch paths' blocks and
        # tokens, whose count depends on T), as one op opaque to the compiler (packed_ops.py)
        return _host_compiled(q, k, v, cu_seqlens, form=form, chunk_size=chunk_size, backend=backend, **kw)
    if use_triton:
        engine = linear_attention_triton
    elif form == "chunked" and backend in ("auto", "torch"):
        engine, kw = chunked_linear_attention, dict(kw, chunk_size=chunk_size)
    else:
        engine, kw = reference_linear_attention, dict(kw, form=form, chunk_size=chunk_size)
    if packed:  # each sequence alone, exactly: zero-padded batches (varlen.py; the spans read and checked on the host)
        return pad_and_batch(engine, q, k, v, sequence_spans(cu_seqlens, q.shape[2], fn), **kw)
    return engine(q, k, v, **kw)


def _use_triton(fn: str, backend: str, form: str, q: Tensor, v: Tensor) -> bool:
    """Whether the call runs on the kernels. auto: the compiled kernels on CUDA for the inputs
    they support (fp16/bf16/fp32, head dims up to 256); float64 and wider heads stay on torch."""
    use_triton = backend == "triton" or (
        backend == "auto" and q.is_cuda and form == "chunked" and kernels_imported() and triton_supports(q, v)
    )
    if use_triton and form != "chunked":
        raise ValueError(f"{fn}: backend='triton' implements form='chunked' only, got form={form!r}")
    if use_triton and not kernels_imported():
        raise RuntimeError(f"{fn}: backend='triton' needs the `triton` package and linattn_lib.kernels")
    return use_triton


def check_engine(fn: str, form: str, backend: str, chunk_size: int, q: Tensor | None = None,
                 v: Tensor | None = None) -> None:
    """`linear_attention`'s engine options (form, backend, chunk_size), checked in the name of
    `fn`, a function that passes them on; with q and v, also whether backend="triton" takes
    them. Errors then name the function the user called."""
    V.check_choice(fn, "form", form, FORMS)
    V.check_choice(fn, "backend", backend, BACKENDS)
    V.check_positive_int(fn, "chunk_size", chunk_size)
    if backend == "triton" and q is not None:
        if form != "chunked":
            raise ValueError(f"{fn}: backend='triton' implements form='chunked' only, got form={form!r}")
        _check_inputs(fn, q, v)


def _host_compiled(q, k, v, cu_seqlens, *, causal, normalize, log_decay, eps, initial_state, return_state,
                   form, chunk_size, backend):
    S0, z0 = (None, None) if initial_state is None else initial_state
    o, S, z = _host_op(q, k, v, None, log_decay, S0, z0, cu_seqlens, causal, normalize, form, eps, chunk_size,
                       backend)
    return (o, LinearAttentionState(S, z if normalize else None)) if return_state else o


def _host_eager(q, k, v, beta, g, S0, z0, cu_seqlens, *, causal, normalize, form, eps, chunk_size, backend):
    """linear_attention in eager mode (packed sequences, or a batch with cu_seqlens None), as
    (o, S, z): the state after every token (a non-causal call's too: its keys' and values'
    sum, with the initial state), z None unless normalising."""
    state = None if S0 is None else LinearAttentionState(S0, z0)
    o, st = linear_attention(q, k, v, causal=causal, normalize=normalize, log_decay=g, form=form,
                             chunk_size=chunk_size, eps=eps, initial_state=state, backend=backend,
                             cu_seqlens=cu_seqlens, return_state=True)
    return o, st.S, st.z


_host_op = make_host_op("linear_host", _host_eager)



