"""The Triton kernels against the float64 references, with library code only.

    from linattn_lib.experiments.kernel_selftest import run_kernel_selftest
    run_kernel_selftest("cuda")  # {"status": "passed" | "failed" | "not run", "summary", "checks"}

What `python -m linattn_lib.experiments.gpu_check` runs first, so that an installed copy (no
tests/ folder) checks its kernels too: every kernel is compiled for the GPU and compared with
the float64 reference computed from the very inputs it saw (16-bit inputs are rounded first,
so only the kernel's own arithmetic is measured) --

* causal chunked attention: the output, the final state (S and z) and the gradients of q, k,
  v, the log-decay and the initial state, at awkward shapes: T in 1..300 around the chunk of
  64, head dims 16..256 (48 and 200 padded and masked), several heads and batches, resumed
  from a non-zero state, decays from none to underflowing (exp(g * 64) = 0) and with resets;
* the non-causal kernels (the same quantities), the decoding step after a chunked prefill,
  and the fused FAVOR+ feature map (values, dx, dW), with a row, a global and no stabiliser;
* in float32, float16 and bfloat16 (bfloat16 on CUDA only: the interpreter has none).

The metric and the tolerances are those of tests/test_kernels_interpret.py (the CPU suite,
which runs the same kernels in the Triton interpreter and explains them); the cases are a
subset of its grid. On CPU tensors the self-test runs in the interpreter too (slowly:
`quick=True` is the smoke test the CPU suite runs).
"""
from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PASSED, FAILED, NOT_RUN = "passed", "failed", "not run"

# relative RMS error allowed: (outputs and states, gradients, gradient of the log-decay); the
# same tolerances as tests/test_kernels_interpret.py, which explains them
TOLERANCES = {"float32": (1e-5, 1e-5, 1e-4), "float16": (3e-3, 1e-2, 1e-2), "bfloat16": (2e-2, 5e-2, 5e-2)}

# log-decay per token drawn from -U(lo, hi); "head" variants have one value per head
# (tests/test_kernels_interpret.py draws its decays from this table too)
DECAYS = {"head-weak": (0.0, 0.05), "head": (0.0, 1.0), "token": (0.0, 1.0), "token-strong": (1.0, 4.0),
           "token-steep": (2.0, 4.0),      # exp(64 g) <= exp(-128): a state two chunks back underflows
           "token-extreme": (20.0, 40.0)}  # extreme: every chunk-crossing factor underflows to 0

# B, H, T, Dk, Dv, decay, normalize, resume from a non-zero state
CAUSAL_CASES = [
    (1, 2, 1, 16, 16, None, True, True),
    (2, 1, 17, 48, 16, "head", True, True),
    (1, 2, 63, 16, 48, "token", False, True),
    (2, 2, 64, 64, 64, "token-strong", True, True),
    (1, 3, 65, 128, 48, "head-weak", False, False),
    (1, 2, 65, 48, 48, "token-extreme", False, True),
    (1, 2, 200, 48, 128, "token", True, True),
    (1, 1, 130, 128, 128, "token-strong", False, True),
    (1, 2, 45, 16, 16, "token-reset10", True, False),
    (1, 2, 40, 16, 16, "head-reset", False, True),
    (1, 1, 300, 256, 200, "token", True, True),  # the largest head dim, Dv padded
]
HALF_CASES = [0, 1, 2, 3, 6, 7, 8, 10]  # also run in float16 and bfloat16
# B, H, T, Dk, Dv, normalize, resume
NONCAUSAL_CASES = [(1, 2, 1, 16, 48, True, True), (2, 1, 65, 48, 16, False, True), (1, 2, 200, 64, 128, True, False)]
# B, H, T, Dk, Dv, prompt length, decay, normalize
DECODE_CASES = [(2, 3, 24, 48, 80, 10, None, True), (2, 3, 24, 48, 80, 10, "token", True),
                (1, 2, 20, 64, 32, 5, "head", False)]
# input shape (..., T, d), m features, stabiliser
FAVOR_CASES = [((2, 3, 17, 48), 70, None), ((1, 2, 65, 64), 256, "row"), ((2, 1, 200, 16), 33, "global"),
               ((1, 1, 1, 64), 266, "global")]
# what `quick=True` runs (a smoke test of this code, e.g. in the interpreter on CPU)
_QUICK = {"causal": [1, 2, 8], "half": [1], "noncausal": [1], "decode": [1], "favor": [0]}


def _rel(a, b) -> float:
    """Relative RMS error ||a - b|| / ||b||, in float64."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _rel_decay_grad(dg, dg_ref, x: dict, grads: dict) -> float:
    """Error of d(log-decay) against the size of the terms q.dq - k.dk it sums (which cancel)."""
    terms = (x["q"] * grads["q"]).sum(-1).abs() + (x["k"] * grads["k"]).sum(-1).abs()
    terms = terms.detach().flip(-1).cumsum(-1).flip(-1)
    if dg_ref.dim() == 1:  # per head: summed over batch and time
        terms = terms.sum((0, 2))
    scale = dg_ref.detach().double().norm() + terms.double().norm()
    return float((dg.detach().double().cpu() - dg_ref.detach().double().cpu()).norm() / scale.cpu())


def draw_log_decay(decay: str | None, B: int, H: int, T: int, gen: torch.Generator) -> torch.Tensor | None:
    """A log-decay of kind `decay` for (B, H, T) inputs: None, a key of `DECAYS` (-U(lo, hi),
    (H,) for "head..." kinds, else (B, H, T), drawn from `gen`), or a reset pattern:
    "token-reset10" (-0.01 per token, -1e5 at every 10th), "token-reset" (-0.05 U per token,
    -1e4 at token min(T - 1, 37), mid-chunk) or "head-reset" (a weak head beside one that
    resets at every token). The kernel tests draw theirs here too."""
    import torch

    if decay is None:
        return None
    if decay == "token-reset10":  # -0.01 per token, a reset (exp(-1e5) = 0) at every 10th
        g = torch.full((B, H, T), -0.01)
        g[..., 9::10] = -1e5
        return g
    if decay == "token-reset":  # weak decay and one reset, mid-chunk
        g = -0.05 * torch.rand(B, H, T, generator=gen)
        g[..., min(T - 1, 37)] = -1e4
        return g
    if decay == "head-reset":  # one head decays weakly, the next resets at every token
        return torch.tensor([-0.01, -1e5] * H)[:H]
    lo, hi = DECAYS[decay]
    shape = (H,) if decay.startswith("head") else (B, H, T)
    return -(lo + (hi - lo) * torch.rand(shape, generator=gen))


def _inputs(B, H, T, Dk, Dv, decay, normalize, resume, dtype, device, seed=0):
    """The same inputs as float64 CPU leaves (reference) and `dtype` leaves on `device`."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    if normalize:  # positive features: a positive denominator
        q, k = torch.rand(B, H, T, Dk, generator=gen), torch.rand(B, H, T, Dk, generator=gen)
    else:  # signed features: cancellation
        q, k = torch.randn(B, H, T, Dk, generator=gen) / Dk**0.5, torch.randn(B, H, T, Dk, generator=gen)
    x = {"q": q.to(dtype), "k": k.to(dtype), "v": torch.randn(B, H, T, Dv, generator=gen).to(dtype)}
    g = draw_log_decay(decay, B, H, T, gen)
    if g is not None:
        x["g"] = g
    if resume:
        x["S0"] = torch.randn(B, H, Dk, Dv, generator=gen)
        if normalize:
            x["z0"] = torch.rand(B, H, Dk, generator=gen) * 5
    ref = {n: t.double().requires_grad_() for n, t in x.items()}
    dev = {n: t.to(device).requires_grad_() for n, t in x.items()}
    return ref, dev


def _attention(x: dict, *, causal: bool, normalize: bool, reference: bool):
    from ..core.linear import linear_attention
    from ..core.reference import reference_linear_attention
    from ..core.state import LinearAttentionState

    state = LinearAttentionState(x["S0"], x.get("z0")) if "S0" in x else None
    kw = dict(causal=causal, normalize=normalize, log_decay=x.get("g"), initial_state=state, return_state=True)
    if reference:
        return reference_linear_attention(x["q"], x["k"], x["v"], form="quadratic", **kw)
    return linear_attention(x["q"], x["k"], x["v"], backend="triton", **kw)


def _loss(o, state, seed=1):
    """A random linear functional of the output and the final state (reaches dS_T and dz_T)."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def w(t):
        return torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.device)

    total = (o.double() * w(o)).sum() + (state.S.double() * w(state.S)).sum()
    return total + (state.z.double() * w(state.z)).sum() if state.z is not None else total


def _check_attention(case, dtype, causal: bool, device) -> dict:
    """Errors of outputs, final states and every gradient against the float64 reference."""
    import torch

    B, H, T, Dk, Dv, decay, normalize, resume = case
    ref_in, dev_in = _inputs(B, H, T, Dk, Dv, decay, normalize, resume, dtype, device)
    o, state = _attention(dev_in, causal=causal, normalize=normalize, reference=False)
    o_ref, state_ref = _attention(ref_in, causal=causal, normalize=normalize, reference=True)
    name = str(dtype).replace("torch.", "")
    tol_out, tol_grad, tol_dg = TOLERANCES[name]
    problems = []
    if o.dtype != dtype or tuple(o.shape) != (B, H, T, Dv):
        problems.append(f"output is {o.dtype} {tuple(o.shape)}, expected {dtype} {(B, H, T, Dv)}")
    errors = {"o": (_rel(o, o_ref), tol_out), "S_T": (_rel(state.S, state_ref.S), tol_out)}
    if normalize:
        errors["z_T"] = (_rel(state.z, state_ref.z), tol_out)
    names = list(dev_in)
    grads = torch.autograd.grad(_loss(o, state), [dev_in[n] for n in names])
    grads_ref = torch.autograd.grad(_loss(o_ref, state_ref), [ref_in[n] for n in names])
    ref_grads = dict(zip(names, grads_ref))
    for n, g, g_ref in zip(names, grads, grads_ref):
        if not torch.isfinite(g).all():
            problems.append(f"d{n} is not finite")
        if n == "g":
            errors["dg"] = (_rel_decay_grad(g, g_ref, ref_in, ref_grads), tol_dg)
        else:
            errors[f"d{n}"] = (_rel(g, g_ref), tol_grad)
    return {"errors": errors, "problems": problems}


def _check_decode(case, dtype, device) -> dict:
    """Prefill with the chunked kernel, then the decoding kernel token by token, against the
    float64 parallel form at every position and its final state."""
    import torch

    from ..core.decode import linear_attention_decode_step
    from ..core.linear import linear_attention
    from ..core.reference import reference_linear_attention

    B, H, T, Dk, Dv, T0, decay, normalize = case
    ref, x = _inputs(B, H, T, Dk, Dv, decay, normalize, False, dtype, device)
    q, k, v = (x[n].detach() for n in ("q", "k", "v"))
    g = x["g"].detach() if "g" in x else None
    rq, rk, rv = (ref[n].detach() for n in ("q", "k", "v"))
    rg = ref["g"].detach() if "g" in ref else None
    full, final = reference_linear_attention(rq, rk, rv, normalize=normalize, log_decay=rg, return_state=True)
    g_pre = None if g is None else (g if g.dim() == 1 else g[:, :, :T0])
    _, state = linear_attention(q[:, :, :T0], k[:, :, :T0], v[:, :, :T0], normalize=normalize, log_decay=g_pre,
                                backend="triton", return_state=True)
    outs = []
    for t in range(T0, T):
        g_t = None if g is None else (g if g.dim() == 1 else g[:, :, t])
        outs.append(linear_attention_decode_step(q[:, :, t], k[:, :, t], v[:, :, t], state, log_decay_t=g_t,
                                                 normalize=normalize, backend="triton"))
    tol = TOLERANCES[str(dtype).replace("torch.", "")][0]
    errors = {"o": (_rel(torch.stack(outs, dim=2), full[:, :, T0:]), tol), "S_T": (_rel(state.S, final.S), tol)}
    if normalize:
        errors["z_T"] = (_rel(state.z, final.z), tol)
    return {"errors": errors, "problems": []}


def _check_favor(case, dtype, device) -> dict:
    """The fused FAVOR+ kernel against the torch map in float64: values, dx and dW."""
    import torch

    from ..core.features import positive_random_features

    shape, m, stabilize = case
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 1.5).to(dtype)
    W = torch.randn(m, shape[-1], generator=gen).to(dtype)
    s = shape[-1] ** -0.25
    x_ref, W_ref = x.double().requires_grad_(), W.double().requires_grad_()
    x_dev, W_dev = x.to(device).requires_grad_(), W.to(device).requires_grad_()
    ref = positive_random_features(x_ref, W_ref, input_scale=s, stabilize=stabilize)
    got = positive_random_features(x_dev, W_dev, input_scale=s, stabilize=stabilize, backend="triton")
    tol_out, tol_grad, _ = TOLERANCES[str(dtype).replace("torch.", "")]
    problems = [] if got.dtype == dtype and got.shape == ref.shape else [f"features are {got.dtype} {tuple(got.shape)}"]
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (ref * w).sum().backward()
    (got.double() * w.to(device)).sum().backward()
    errors = {"features": (_rel(got, ref), tol_out), "dx": (_rel(x_dev.grad, x_ref.grad), tol_grad),
              "dW": (_rel(W_dev.grad, W_ref.grad), tol_grad)}
    return {"errors": errors, "problems": problems}


def _case_name(kind: str, case) -> str:
    if kind == "favor":
        shape, m, stabilize = case
        return f"favor {'x'.join(map(str, shape))} m={m} {stabilize or 'no'}-stabiliser"
    if kind == "decode":
        B, H, T, Dk, Dv, T0, decay, normalize = case
        return f"decode B{B} H{H} T{T0}+{T - T0} k{Dk} v{Dv} {decay or 'no-decay'} {'norm' if normalize else 'unnorm'}"
    if kind == "noncausal":
        B, H, T, Dk, Dv, normalize, resume = case
        decay = None
    else:
        B, H, T, Dk, Dv, decay, normalize, resume = case
    return (f"{kind} B{B} H{H} T{T} k{Dk} v{Dv} {decay or 'no-decay'} {'norm' if normalize else 'unnorm'}"
            f"{' resumed' if resume else ''}")


def selftest_plan(device: str | torch.device, quick: bool = False) -> list[tuple[str, tuple, torch.dtype]]:
    """(kind, case, dtype) of every check `run_kernel_selftest` runs on `device`."""
    import torch

    def pick(kind, cases):
        return [cases[i] for i in _QUICK[kind]] if quick else list(cases)

    halves = [torch.float16] + ([torch.bfloat16] if torch.device(device).type == "cuda" else [])  # the interpreter has no bf16
    everything = [torch.float32] + halves
    plan = [("causal", c, torch.float32) for c in pick("causal", CAUSAL_CASES)]
    half_cases = [CAUSAL_CASES[i] for i in (_QUICK["half"] if quick else HALF_CASES)]
    plan += [("causal", c, dt) for dt in halves for c in half_cases]
    plan += [("noncausal", c, dt) for dt in everything for c in pick("noncausal", NONCAUSAL_CASES)]
    plan += [("decode", c, dt) for dt in everything for c in pick("decode", DECODE_CASES)]
    plan += [("favor", c, dt) for dt in everything for c in pick("favor", FAVOR_CASES)]
    return plan


def run_kernel_selftest(device: str | torch.device = "cuda", quick: bool = False,
                        log: Callable[[str], object] | None = None, deadline: float | None = None,
                        skip: set[tuple[str, str]] = frozenset()) -> dict:
    """Every kernel against the float64 references on `device` (CUDA: compiled; CPU: the
    Triton interpreter, slow). Returns {"status": passed | failed | not run | cut, "summary",
    "checks": [{"name", "dtype", "errors": {what: [error, tolerance]}, "status", ...}]}:
    one failing check does not stop the others. `log(line)` is told about each failure.
    deadline (time.monotonic()): the quick subset runs first (every kind of check), then the
    rest while time is left; status "cut" when some were left out and none failed.
    skip: (name, dtype) of checks not to run again (an earlier run passed them)."""
    t0 = time.perf_counter()
    from ..core import triton_ops

    if not triton_ops.triton_available():
        return {"status": NOT_RUN, "checks": [],
                "reason": f"the Triton kernels do not import here: {triton_ops.kernels_import_error()}"}
    checks = []
    plan = selftest_plan(device, quick)
    if deadline is not None and not quick:  # what matters most first, should the time run out
        first = selftest_plan(device, True)
        plan = first + [p for p in plan if p not in first]
    plan = [p for p in plan if (_case_name(p[0], p[1]), str(p[2]).replace("torch.", "")) not in skip]
    for kind, case, dtype in plan:
        if deadline is not None and time.monotonic() > deadline:
            break
        row = {"name": _case_name(kind, case), "dtype": str(dtype).replace("torch.", "")}
        try:
            if kind in ("causal", "noncausal"):
                if kind == "noncausal":
                    B, H, T, Dk, Dv, normalize, resume = case
                    case = (B, H, T, Dk, Dv, None, normalize, resume)
                res = _check_attention(case, dtype, kind == "causal", device)
            elif kind == "decode":
                res = _check_decode(case, dtype, device)
            else:
                res = _check_favor(case, dtype, device)
            row["errors"] = {k: [float(f"{e:.3g}"), t] for k, (e, t) in res["errors"].items()}
            bad = [f"{k}: rel {e:.2e} >= {t:.0e}" for k, (e, t) in res["errors"].items() if not e < t]
            row["problems"] = res["problems"] + bad
            row["status"] = FAILED if row["problems"] else PASSED
        except Exception as e:  # a kernel that does not compile or launch
            row["status"] = FAILED
            row["problems"] = [f"{type(e).__name__}: {e}"[:500]]
            row["traceback"] = traceback.format_exc()[-2000:]
        if row["status"] == FAILED and log is not None:
            log(f"  FAILED {row['name']} [{row['dtype']}]: {'; '.join(row['problems'])}")
        checks.append(row)
    failed = sum(r["status"] == FAILED for r in checks)
    status = FAILED if failed else "cut" if len(checks) < len(plan) else PASSED
    cut = f" (cut at the time budget: {len(plan) - len(checks)} not run)" if len(checks) < len(plan) else ""
    return {"status": status, "summary": f"{len(checks) - failed} passed, {failed} failed of {len(checks)} checks{cut}",
            "seconds": round(time.perf_counter() - t0, 1), "device": str(device), "checks": checks}
