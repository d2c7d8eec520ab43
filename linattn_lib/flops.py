"""Every FLOP and byte count the library and the book use, each written once.

Conventions (as in Kaplan et al. 2020, Table 1): one FLOP is one multiplication or one
addition, so an (m x k) @ (k x n) matrix product costs ``2*m*k*n`` FLOPs (`matmul_flops`);
all counts are exact Python ints unless stated. Sections:

* a Transformer layer (chapter 1): `attention_core_flops`, `projection_flops`, `ffn_flops`,
  `layer_flops`, `flop_crossover_length`; memory `score_matrix_bytes`, `qkvo_bytes`;
* the two multiplication orders of feature attention (chapters 2, 3 and 7): `attention_flops`,
  `flop_crossover`, `attention_layer_flops`, `flop_ratio`;
* the chunked algorithm (bench): `chunk_flops`, `chunked_forward_flops`, `FLOPS_FORMULA`,
  `io_bytes`, `state_bytes`;
* the Triton kernels' traffic (appendix): `Cost`, `chunk_fwd_traffic`, `chunk_fwd_min_traffic`,
  `two_phase_forward_traffic`, `token_loop_cost`, `decode_step_cost`, `flash_attention_cost`.

Imports only torch, the standard library and `_validate`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import _validate as V

BYTES_PER_ELEMENT = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}


def _bytes_per_element(dtype: str | torch.dtype) -> int:
    """Bytes of one element: a name of `BYTES_PER_ELEMENT` ("fp16", ...) or a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    try:
        return BYTES_PER_ELEMENT[dtype]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(BYTES_PER_ELEMENT)}") from None


def _check_positive(fn: str, **values: int) -> None:
    for name, v in values.items():
        V.check_positive_int(fn, name, v)


def matmul_flops(m: int, k: int, n: int) -> int:
    """FLOPs of an (m x k) @ (k x n) matrix product: ``2 * m * k * n`` (a multiply and an add
    per term of each of the m n sums)."""
    return 2 * m * k * n


# --------------------------------------------------------------------------------------
# one Transformer layer, forward, one sequence of T tokens (chapter 1)
# --------------------------------------------------------------------------------------


def attention_core_flops(T: int, d: int, *, causal: bool = False) -> int:
    """FLOPs of ``Q K^T`` plus ``A V`` for one layer and one sequence: ``4 * T^2 * d``.

    The count does not depend on the number of heads: H heads of width d/H cost
    ``H * 4 * T^2 * (d/H)``. With ``causal=True`` only the lower triangle is computed, which
    halves the count (``2 * T^2 * d``; the diagonal is ignored). That causal count is the
    context term ``2 * n_layer * n_ctx * d_attn`` per token of Kaplan et al. 2020 (Table 1)
    times T tokens. The softmax itself (a few FLOPs per score) is left out; `attention_flops`
    counts the normaliser of feature attention.
    """
    _check_positive("attention_core_flops", T=T, d=d)
    flops = 4 * T * T * d
    return flops // 2 if causal else flops


def projection_flops(T: int, d: int) -> int:
    """FLOPs of the Q, K, V and output projections, ``4 * 2*T*d*d = 8 * T * d^2``."""
    _check_positive("projection_flops", T=T, d=d)
    return 8 * T * d * d


def ffn_flops(T: int, d: int, *, d_ff: int | None = None) -> int:
    """FLOPs of the two-layer feed-forward block, ``2 * 2*T*d*d_ff`` (``16 * T * d^2`` for d_ff = 4d)."""
    d_ff = 4 * d if d_ff is None else d_ff
    _check_positive("ffn_flops", T=T, d=d, d_ff=d_ff)
    return 4 * T * d * d_ff


def layer_flops(T: int, d: int, *, d_ff: int | None = None, causal: bool = False) -> int:
    """Attention core + projections + FFN: the forward FLOPs of one layer on one sequence,
    ``4 T^2 d (halved when causal) + 8 T d^2 + 4 T d d_ff``."""
    return attention_core_flops(T, d, causal=causal) + projection_flops(T, d) + ffn_flops(T, d, d_ff=d_ff)


def flop_crossover_length(d: int, *, d_ff: int | None = None, causal: bool = False) -> int:
    """The length T at which the attention core's FLOPs equal the FFN's.

    ``4 T^2 d = 4 T d d_ff`` gives ``T = d_ff`` (= 4d by default); causal: ``T = 2 * d_ff``.
    (Not the measured softmax/linear wall-time crossover: that is
    `chapters.dispatch.crossover_length`.)
    """
    d_ff = 4 * d if d_ff is None else d_ff
    _check_positive("flop_crossover_length", d=d, d_ff=d_ff)
    return 2 * d_ff if causal else d_ff


def score_matrix_bytes(T: int, heads: int = 1, *, dtype: str | torch.dtype = "fp32", batch: int = 1) -> int:
    """Bytes of the materialised T x T score (or weight) matrices: ``batch * heads * T^2 * bytes``.

    This is one layer; a naive implementation keeps at least one such tensor alive (training
    keeps one per layer for the backward pass). `dtype`: "fp32", "fp16", "bf16", "fp8" or a
    torch dtype.
    """
    _check_positive("score_matrix_bytes", T=T, heads=heads, batch=batch)
    return batch * heads * T * T * _bytes_per_element(dtype)


def qkvo_bytes(T: int, d: int, *, dtype: str | torch.dtype = "fp32", batch: int = 1) -> int:
    """Bytes of Q, K, V and the output O for one layer: ``4 * batch * T * d * bytes``
    (`io_bytes` with one head of width d).

    This is what an exact IO-aware kernel (FlashAttention) reads and writes; its extra memory
    is the row statistics (max and sum), ``O(batch * heads * T)``.
    """
    _check_positive("qkvo_bytes", T=T, d=d, batch=batch)
    return io_bytes(batch, 1, T, d, d, _bytes_per_element(dtype))


# --------------------------------------------------------------------------------------
# feature attention: (phi_Q phi_K^T) V against phi_Q (phi_K^T V)  (chapters 2, 3, 7)
# --------------------------------------------------------------------------------------


def attention_flops(T: int, m: int, dv: int, *, order: str, normalize: bool = True) -> int:
    """Floating-point operations of one head of feature attention (a multiply-add = 2 FLOPs).

    order="quadratic": A = phi_Q phi_K^T (2 T^2 m), A V (2 T^2 dv), and when normalising the row
    sums (T^2) and the division (T dv).
    order="associative": S = phi_K^T V (2 T m dv), phi_Q S (2 T m dv), and when normalising
    z = phi_K^T 1 (T m), phi_Q z (2 T m) and the division (T dv).
    The causal prefix-sum form does the same work per token as the associative one.
    """
    fn = "attention_flops"
    for name, val in (("T", T), ("m", m), ("dv", dv)):
        V.check_positive_int(fn, name, val)
    V.check_choice(fn, "order", order, ("quadratic", "associative"))
    if order == "quadratic":
        return 2 * T * T * m + 2 * T * T * dv + ((T * T + T * dv) if normalize else 0)
    return 4 * T * m * dv + ((3 * T * m + T * dv) if normalize else 0)


def flop_crossover(m: int, dv: int, *, normalize: bool = True) -> int:
    """The smallest T at which the associative order needs fewer FLOPs than the quadratic one.

    From `attention_flops`: quadratic minus associative is T * (a T - c) with
    a = 2 m + 2 dv (+ 1 when normalising) and c = 4 m dv (+ 3 m), so it is positive exactly for
    T > c / a: about 2 m dv / (m + dv), e.g. 65 for m = dv = 64.
    """
    V.check_positive_int("flop_crossover", "m", m)
    V.check_positive_int("flop_crossover", "dv", dv)
    a = 2 * m + 2 * dv + (1 if normalize else 0)
    c = 4 * m * dv + (3 * m if normalize else 0)
    return c // a + 1


def attention_layer_flops(T: int, d_model: int, heads: int, *, m: int | None = None, core_only: bool = False) -> int:
    """Forward FLOPs of one non-causal attention layer on one sequence of T tokens.

    m=None: exact softmax attention (scores, row sums, A V per head: `attention_flops` in the
    "quadratic" order with m = d_head). m given: linear attention with m features per head (the
    "associative" order). Unless core_only, the Q/K/V/O projections (8 T d^2) and the
    feed-forward block (16 T d^2) are added; they are the same for both. The feature map's own
    cost is left out.
    """
    if d_model % heads:
        raise ValueError(f"attention_layer_flops: d_model={d_model} is not divisible by heads={heads}")
    dh = d_model // heads
    core = heads * (attention_flops(T, dh, dh, order="quadratic") if m is None else attention_flops(T, m, dh, order="associative"))
    return core if core_only else core + projection_flops(T, d_model) + ffn_flops(T, d_model)


def flop_ratio(T: int, d_model: int, heads: int, m: int, *, core_only: bool = False) -> float:
    """FLOPs of exact attention divided by FLOPs of linear attention (m features per head).

    For the attention core alone this is about T / m (precisely (2 m' + 2 d_h + 1) T / (4 m d_h + ...)
    with m' = d_h): it grows *linearly* with T, not exponentially.
    """
    return attention_layer_flops(T, d_model, heads, core_only=core_only) / attention_layer_flops(
        T, d_model, heads, m=m, core_only=core_only
    )


# --------------------------------------------------------------------------------------
# the chunked algorithm and its memory traffic (bench)
# --------------------------------------------------------------------------------------


def chunk_flops(C: int, Dk: int, Dv: int) -> int:
    """Matmul FLOPs of one chunk of C tokens and one head of the chunked forward:
    ``2 C^2 Dk + 2 C^2 Dv + 4 C Dk Dv``.

    The intra-chunk scores q k^T (2 C^2 Dk) and their product with v (2 C^2 Dv) -- the full
    C x C matrices, masked half included, because that is what the matmuls compute -- the past
    through the state q S (2 C Dk Dv) and the chunk's state increment k^T v (2 C Dk Dv).
    """
    return 2 * C * C * Dk + 2 * C * C * Dv + 4 * C * Dk * Dv


def chunked_forward_flops(B: int, H: int, T: int, Dk: int, Dv: int, C: int, normalize: bool = True) -> int:
    """FLOPs of the chunked forward, counted as the torch path does them (see FLOPS_FORMULA):
    ``B * H * ceil(T / C) * chunk_flops(C, Dk, Dv')`` with C = min(C, T).

    Dv' = Dv + 1 when normalising (the ones column of v that carries the denominator). Padding
    of the last chunk is counted too. Not counted: the scan that turns increments into entry
    states, masks, copies and the final division.
    """
    C = min(C, T)
    chunks = B * H * math.ceil(T / C)
    return chunks * chunk_flops(C, Dk, Dv + int(normalize))


FLOPS_FORMULA = (
    "FLOPs per chunk of C tokens and head: 2C^2*Dk (q k^T) + 2C^2*Dv' (A v') + 2C*Dk*Dv' (q E) "
    "+ 2C*Dk*Dv' (k^T v'), with Dv' = Dv + 1 (the ones column that carries the normaliser); "
    "times B*H*ceil(T/C) chunks. Not counted: the scan over chunk states, masks, copies, the division."
)


def io_bytes(B: int, H: int, T: int, Dk: int, Dv: int, itemsize: int, mode: str = "fwd") -> int:
    """Bytes an attention kernel must move at least: ``B H T (2 Dk + 2 Dv) itemsize`` to read
    q, k, v and write o (mode="fwd"); mode="fwd+bwd" adds the backward's reads of q, k, v, o,
    do and writes of dq, dk, dv, ``B H T ((2 Dk + 3 Dv) + (2 Dk + Dv)) itemsize``."""
    per_token = 2 * Dk + 2 * Dv
    if mode == "fwd+bwd":
        per_token += (2 * Dk + 3 * Dv) + (2 * Dk + Dv)
    return B * H * T * per_token * itemsize


def state_bytes(Dk: int, Dv: int, itemsize: int = 4) -> int:
    """Bytes of one head's linear-attention state, S (Dk x Dv) and z (Dk): ``(Dk Dv + Dk) itemsize``."""
    return (Dk * Dv + Dk) * itemsize


# --------------------------------------------------------------------------------------
# the Triton kernels: FLOPs and bytes of traffic (appendix)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cost:
    """FLOPs and bytes of memory traffic of a computation (totals, or per token)."""

    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOPs per byte moved."""
        return self.flops / self.bytes

    def __truediv__(self, n: float) -> Cost:
        return Cost(self.flops / n, self.bytes / n)


def chunk_fwd_traffic(
    T: int, Dk: int, Dv: int, config: dict, dtype_bytes: int, *, normalize: bool = True,
    decay: str | None = None,
) -> Cost:
    """Bytes moved and tensor-core FLOPs of one (batch, head) of `chunk_fwd_kernel`.

    Counted the way the kernel issues them: each of the ceil(Dv / BV) programs of a head loads
    all of q and k and its own columns of v, chunk by chunk; o is stored once, the fp32
    denominators once (by the first value tile). `tl.dot` works on padded tiles, so the FLOPs
    use BT, BK and BV, not T, Dk and Dv: ``n_tiles * ceil(T / BT) * chunk_flops(BT, BK, BV)``.
    Bytes: ``n_tiles * 2 T Dk b + T Dv b`` loaded, ``T Dv b (+ 4 T)`` stored. `decay` is None,
    "head" (one scalar load per chunk and program) or "token" (T fp32 loads per program).
    No initial or final state (the default call).
    """
    BT, BK, BV = config["BT"], config["BK"], config["BV"]
    n_tiles = math.ceil(Dv / BV)
    n_chunks = math.ceil(T / BT)
    loads = n_tiles * 2 * T * Dk * dtype_bytes + T * Dv * dtype_bytes
    if decay == "head":
        loads += n_tiles * n_chunks * 4
    elif decay == "token":
        loads += n_tiles * T * 4
    elif decay is not None:
        raise ValueError(f"decay must be None, 'head' or 'token', got {decay!r}")
    stores = T * Dv * dtype_bytes + (T * 4 if normalize else 0)
    flops = n_tiles * n_chunks * chunk_flops(BT, BK, BV)
    return Cost(flops=flops, bytes=loads + stores)


def two_phase_forward_traffic(
    T: int, Dk: int, Dv: int, state_config: dict, output_config: dict, dtype_bytes: int, *,
    state_bytes: int = 4, normalize: bool = True, decay: str | None = None,
) -> dict[str, Cost]:
    """Bytes moved and tensor-core FLOPs of one (batch, head) of the two-phase forward,
    {"chunk_decay": Cost, "chunk_state": Cost, "chunk_output": Cost}, counted the way the
    kernels issue them (as `chunk_fwd_two_phase` launches them).

    With NT = ceil(T / BT) chunks, n_k = ceil(Dk / BK) key blocks and n_v = ceil(Dv / BV)
    value tiles (each kernel's own BK, BV; one BT) and b bytes per input element:

    chunk_decay   with a decay only (else no bytes): reads it once per chunk (a decay per
                  head: one scalar) or token, stores every chunk's BT key decays and its
                  decay across the chunk, and with a decay per token two fp32 prefix sums
                  per token of the chunk (padding included), for the output kernel.
    chunk_state   its n_k n_v state programs read k n_v times and v n_k times and store
                  NT entry states of Dk Dv values (`state_bytes` each); with the normaliser
                  n_k more programs (one per key block) read k once more and store NT fp32 z's of Dk values.
                  Every one of them reads the key decays and chunk decays back.
                  One (BK x BT) @ (BT x BV) product per chunk and state program.
    chunk_output  each of its n_v NT programs reads q and k of its chunk (so q and k n_v
                  times in all), its block of the state (all of them once), z (Dk fp32 per
                  program), its value tile, and the decay (one scalar per head) or the two
                  prefix sums of its chunk; stores o, and den (fp32) once.
                  Per key block two products (scores, q S), then one (scores @ v).

    decay: None, "head" or "token" (fp32 log-decays).
    """
    BT, K1, V1 = state_config["BT"], state_config["BK"], state_config["BV"]
    K2, V2 = output_config["BK"], output_config["BV"]
    if output_config["BT"] != BT:
        raise ValueError("two_phase_forward_traffic: the two phases share one chunk length")
    if decay not in (None, "head", "token"):
        raise ValueError(f"decay must be None, 'head' or 'token', got {decay!r}")
    NT, nk, nv = math.ceil(T / BT), math.ceil(Dk / K1), math.ceil(Dv / V1)
    walkers = nk * nv + (nk if normalize else 0)        # programs that walk the sequence
    walk_decays = 0 if decay is None else NT * BT * 4 + NT * 4    # read back by every walker
    prefix = 2 * NT * BT * 4 if decay == "token" else 0
    pre_pass = 0 if decay is None else {"head": NT * 4, "token": T * 4}[decay] + walk_decays + prefix
    state_in = nv * T * Dk * dtype_bytes + nk * T * Dv * dtype_bytes + walkers * walk_decays
    state_in += T * Dk * dtype_bytes if normalize else 0    # the z programs: k once more
    state_out = NT * Dk * Dv * state_bytes + (NT * Dk * 4 if normalize else 0)
    state_flops = nk * nv * NT * matmul_flops(K1, BT, V1)
    nv2, nk2 = math.ceil(Dv / V2), math.ceil(Dk / K2)
    g_out = {None: 0, "head": nv2 * NT * 4, "token": nv2 * prefix}[decay]
    out_in = (nv2 * 2 * T * Dk * dtype_bytes + NT * Dk * Dv * state_bytes + T * Dv * dtype_bytes + g_out
              + (nv2 * NT * Dk * 4 if normalize else 0))
    out_out = T * Dv * dtype_bytes + (T * 4 if normalize else 0)
    out_flops = nv2 * NT * (nk2 * (matmul_flops(BT, K2, BT) + matmul_flops(BT, K2, V2)) + matmul_flops(BT, BT, V2))
    return {"chunk_decay": Cost(flops=0, bytes=pre_pass),
            "chunk_state": Cost(flops=state_flops, bytes=state_in + state_out),
            "chunk_output": Cost(flops=out_flops, bytes=out_in + out_out)}


def chunk_fwd_min_traffic(T: int, Dk: int, Dv: int, BT: int, dtype_bytes: int) -> Cost:
    """The same kernel if every input were read once (no re-reads across value tiles, no padding):
    ``T / BT * chunk_flops(BT, Dk, Dv)`` FLOPs, `io_bytes` of q, k, v, o plus 4 T bytes of
    denominators."""
    return Cost(flops=T * chunk_flops(BT, Dk, Dv) // BT,
                bytes=io_bytes(1, 1, T, Dk, Dv, dtype_bytes) + T * 4)


def decode_step_cost(Dk: int, Dv: int, dtype_bytes: int) -> Cost:
    """One generated token with `decode_kernel`: the state is read and written once.

    FLOPs ``4 Dk Dv + 4 Dk`` (update and read-out of S and z); bytes: q, k, v read and o
    written (`io_bytes` of one token) plus the fp32 state read and written,
    ``2 * state_bytes(Dk, Dv)``.
    """
    return Cost(flops=4 * Dk * Dv + 4 * Dk,
                bytes=io_bytes(1, 1, 1, Dk, Dv, dtype_bytes) + 2 * state_bytes(Dk, Dv))


def token_loop_cost(T: int, Dk: int, Dv: int, dtype_bytes: int) -> Cost:
    """A kernel that walks the tokens one by one with its fp32 state in global memory:
    T times `decode_step_cost`.

    Per token it reads q, k, v, writes o, and reads and writes the Dk x Dv state (and z):
    2 Dk Dv FLOPs for the update and 2 Dk Dv for the read-out.
    """
    per = decode_step_cost(Dk, Dv, dtype_bytes)
    return Cost(per.flops * T, per.bytes * T)


def flash_attention_cost(T: int, D: int, dtype_bytes: int, *, causal: bool = True,
                         block_q: int | None = 128) -> Cost:
    """Exact softmax attention computed block by block (FlashAttention), one (batch, head).

    FLOPs: 4 T^2 D (two matmuls, `attention_core_flops`), halved by a causal mask, as a float.
    Bytes: q read and o written once; k and v read once per block of `block_q` queries, as
    the kernels do (FlashAttention-2 keeps a query block on chip and streams every key and
    value block it attends to through it): with n = ceil(T / block_q) blocks that is n T
    rows of k and of v, or block_q n (n + 1) / 2 when causal -- about T D b bytes per token
    (32 KiB at T = 16384, D = 128 in bf16 with 128-query blocks), where reading each input
    once would be 4 D b. Much of the re-reading is served by L2 on a real GPU; this counts
    what the kernel asks of memory. block_q=None: every input read once (`io_bytes`), the
    ideal an IO-aware kernel approaches only when T fits one block.
    """
    flops = float(attention_core_flops(T, D, causal=causal))
    if block_q is None:
        return Cost(flops=flops, bytes=io_bytes(1, 1, T, D, D, dtype_bytes))
    n = math.ceil(T / block_q)
    kv_rows = block_q * n * (n + 1) // 2 if causal else n * T
    kv_rows = min(kv_rows, n * T)
    return Cost(flops=flops, bytes=(2 * T * D + 2 * kv_rows * D) * dtype_bytes)
