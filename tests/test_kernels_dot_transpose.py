"""No kernel feeds a tl.dot with the transpose of another tl.dot's result (fla issue #640).

Triton 3.4 <= v < 3.7.1 miscompiles `tl.dot(tl.trans(X), ...)` on Hopper (sm_90) when X is the
result of a tl.dot (cast or scaled elementwise on the way): X lives in the wgmma accumulator
layout, its transpose in a linear layout whose lowering to the next wgmma's operand is wrong at
BK = 64 (fla-org/flash-linear-attention#640: wrong dk and dg in `chunk_bwd_kernel_dqkwg`, fixed
in Triton 3.7.1; fla refuses that backward on Hopper for Triton in [3.4, 3.7.1)). The GPU
machine this project is checked on has Triton 3.6.0. The kernels therefore never transpose a
dot result for another dot: they compute the transposed product from the loaded tiles
(P^T = K Q^T as tl.dot(k, tl.trans(q))) or the transposed output from transposed operands
(dk^T = q^T W, stored through transposed pointers). Transposing a *loaded* tile is fine (a
shared-memory view), and so is a dot result used untransposed. The delta rule's backward still
holds the pattern and refuses on Hopper under those Triton releases (`REFUSED` below).

`transposed_dot_operands` reads the kernels' Python source (the AST, no compilation): in each
@triton.jit function a name is a dot result if it is assigned from an expression that holds a
tl.dot, a name that is a dot result, or a call of a @triton.jit helper that returns one
(flow-insensitive and conservative: a name once tainted stays tainted); it flags every tl.dot
whose operand holds `tl.trans(...)` / `.T` / `tl.permute(...)` of a dot result, or a name
assigned from one.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"
TRANSPOSES = ("trans", "permute")


def _is_jit(fn: ast.FunctionDef) -> bool:
    for dec in fn.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if isinstance(target, ast.Attribute) and target.attr == "jit" or isinstance(target, ast.Name) and target.id == "jit":
            return True
    return False


def _callee(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _is_dot(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and _callee(node) in ("dot", "dot_scaled")


def _transposed(node: ast.AST) -> ast.AST | None:
    """The expression `node` transposes (tl.trans(x), x.trans(), x.T, tl.permute(x, ...)), else None."""
    if isinstance(node, ast.Attribute) and node.attr == "T":
        return node.value
    if isinstance(node, ast.Call) and _callee(node) in TRANSPOSES:
        if isinstance(node.func, ast.Attribute) and not (isinstance(node.func.value, ast.Name)
                                                         and node.func.value.id in ("tl", "language")):
            return node.func.value  # the method form, x.trans()
        return node.args[0] if node.args else None
    return None


class _Scan:
    """Dot-result taint through the @triton.jit functions of some sources, per call context.

    A function is analysed for each set of its parameters that hold dot results at some call
    (`analyse`), which is what Triton's inliner sees; within a function the analysis is
    flow-insensitive (a name once tainted stays tainted: conservative)."""

    def __init__(self, functions: dict[str, tuple[str, ast.FunctionDef]]):
        self.functions = functions            # name -> (file, node)
        self.memo: dict = {}
        self.findings: set[str] = set()

    def analyse(self, name: str, tainted_params: frozenset) -> tuple[bool, ...]:
        """Which returned values (per position of a returned tuple) hold a dot result."""
        key = (name, tainted_params)
        if key in self.memo:
            return self.memo[key]
        self.memo[key] = (False,)             # no recursion in Triton; a cycle reads clean
        path, fn = self.functions[name]
        env = _Env(self, set(tainted_params))
        changed = True
        while changed:
            changed = False
            for node in ast.walk(fn):
                if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and node.value is not None:
                    changed |= env.assign(node)
        returns: tuple[bool, ...] = ()
        for node in ast.walk(fn):
            if isinstance(node, ast.Return) and node.value is not None:
                per = env.per_position(node.value)
                width = max(len(returns), len(per))
                returns = tuple((returns[i] if i < len(returns) else False) or (per[i] if i < len(per) else per[-1])
                                for i in range(width))
        for node in ast.walk(fn):
            if _is_dot(node):
                operands = list(node.args[:2]) + [k.value for k in node.keywords if k.arg in ("input", "other")]
                if any(env.holds_transposed(op) for op in operands):
                    self.findings.add(f"{path}:{node.lineno} {fn.name}: {ast.unparse(node)}")
        self.memo[key] = returns or (False,)
        return self.memo[key]


class _Env:
    """The tainted names of one function in one call context."""

    def __init__(self, scan: _Scan, tainted: set[str]):
        self.scan, self.tainted, self.transposed = scan, tainted, set()

    def call_returns(self, call: ast.Call) -> tuple[bool, ...] | None:
        name = _callee(call)
        if name not in self.scan.functions or not isinstance(call.func, ast.Name):
            return None
        params = [a.arg for a in self.scan.functions[name][1].args.args]
        hot = {params[i] for i, a in enumerate(call.args) if i < len(params) and self.holds(a)}
        hot |= {k.arg for k in call.keywords if k.arg and self.holds(k.value)}
        return self.scan.analyse(name, frozenset(hot))

    def holds(self, node: ast.AST) -> bool:
        for sub in ast.walk(node):
            if _is_dot(sub) or isinstance(sub, ast.Name) and sub.id in self.tainted:
                return True
            if isinstance(sub, ast.Call):
                returns = self.call_returns(sub)
                if returns is not None and any(returns):
                    return True
        return False

    def holds_transposed(self, node: ast.AST) -> bool:
        """Whether `node` is (elementwise in) the transpose of a dot result. A dot's or a helper's
        result is not: the walk stops at calls of tl.dot and of @triton.jit helpers."""
        if isinstance(node, ast.Name):
            return node.id in self.transposed
        inner = _transposed(node)
        if inner is not None and self.holds(inner):
            return True
        if _is_dot(node) or isinstance(node, ast.Call) and _callee(node) in self.scan.functions:
            return False
        return any(self.holds_transposed(child) for child in ast.iter_child_nodes(node))

    def per_position(self, value: ast.AST) -> tuple[bool, ...]:
        if isinstance(value, ast.Tuple):
            return tuple(self.holds(e) for e in value.elts)
        if isinstance(value, ast.Call):
            returns = self.call_returns(value)
            if returns is not None:
                return returns
        return (self.holds(value),)

    def assign(self, node) -> bool:
        """Taint the names `node` assigns; True when something new was learnt."""
        before = (len(self.tainted), len(self.transposed))
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        per = self.per_position(node.value)
        for target in targets:
            if isinstance(target, ast.Tuple):
                for i, elt in enumerate(target.elts):
                    if per[i] if i < len(per) else per[-1]:
                        self.tainted |= {n.id for n in ast.walk(elt) if isinstance(n, ast.Name)}
            elif any(per) or isinstance(node, ast.AugAssign) and isinstance(target, ast.Name) and target.id in self.tainted:
                self.tainted |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        if self.holds_transposed(node.value):
            self.transposed |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        return (len(self.tainted), len(self.transposed)) != before


def transposed_dot_operands(sources: dict[str, str]) -> list[str]:
    """'file:line function: call' for every tl.dot in `sources` (name -> Python source) with an
    operand that is the transpose of a dot result. The @triton.jit functions of all sources
    are read together (a helper defined in one file and called in another is followed, with
    the taint of its arguments at each call); every function is analysed as a kernel too."""
    functions = {}
    for path, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and _is_jit(node):
                functions[node.name] = (path, node)
    scan = _Scan(functions)
    for name in functions:
        scan.analyse(name, frozenset())
    return sorted(scan.findings, key=lambda h: (h.split(":")[0], int(h.split(":")[1].split()[0])))


def kernel_sources() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(KERNEL_DIR.glob("*.py"))}


# --------------------------------------------------------------------------------------
# the tests
# --------------------------------------------------------------------------------------

# The pattern as it was in kernels/chunk_grad.py (chunk_dqk_kernel, chunk_dv_kernel) before
# the rewrite, and as fla had it (chunk_bwd_kernel_dqkwg, fla/ops/common/chunk_o.py).
OLD_CHUNK_GRAD = '''
@triton.jit
def _products(do_ptr, v_ptr, BT: tl.constexpr, BV: tl.constexpr):
    A = tl.zeros([BT, BT], dtype=tl.float32)
    for i_v in range(0, 4):
        do = tl.load(do_ptr)
        v = tl.load(v_ptr)
        A = tl.dot(do, tl.trans(v), acc=A)
    return A, do

@triton.jit
def chunk_dqk_kernel(q_ptr, k_ptr, M, r, e, acc):
    A, _ = _products(q_ptr, k_ptr, 64, 32)
    W = M * (r[:, None] * A + e[:, None])
    q = tl.load(q_ptr).to(tl.float32)
    k = tl.load(k_ptr).to(tl.float32)
    dq = tl.dot(W, k, acc=acc)
    dk = tl.dot(tl.trans(W), q, acc=acc)

@triton.jit
def chunk_dv_kernel(q_ptr, k_ptr, do_ptr, M):
    P = tl.zeros([64, 64], dtype=tl.float32)
    for i_k in range(0, 4):
        q = tl.load(q_ptr)
        k = tl.load(k_ptr)
        P = tl.dot(q, tl.trans(k), acc=P)
    P = M * P
    do = tl.load(do_ptr).to(tl.float32)
    dv = tl.dot(tl.trans(P), do)
'''
FLA_640 = '''
@triton.jit
def chunk_bwd_kernel_dqkwg(b_do, b_v, b_k, b_q, b_dk):
    b_ds = tl.dot(b_do, tl.trans(b_v))
    b_ds = b_ds.to(b_k.dtype)
    b_dk += tl.dot(tl.trans(b_ds), b_q)
    b_dsT = b_ds.T
    b_dk += tl.dot(b_dsT, b_q)
'''
SAFE = '''
@triton.jit
def fine(q_ptr, k_ptr, do_ptr):
    q = tl.load(q_ptr)
    k = tl.load(k_ptr)
    do = tl.load(do_ptr)
    P = tl.dot(q, tl.trans(k))           # a loaded tile transposed
    Pt = tl.dot(k, tl.trans(q))          # the transposed product, from the loads
    dv = tl.dot(Pt.to(do.dtype), do)     # a dot result, untransposed
    dkT = tl.dot(tl.trans(q), P)         # the transposed output, from a transposed load
    return dv, dkT
'''


def test_the_scan_flags_the_old_chunk_grad_and_fla_640():
    hits = transposed_dot_operands({"old.py": OLD_CHUNK_GRAD})
    assert [h.split()[1] for h in hits] == ["chunk_dqk_kernel:", "chunk_dv_kernel:"], hits
    assert "tl.trans(W)" in hits[0] and "tl.trans(P)" in hits[1]
    fla = transposed_dot_operands({"fla.py": FLA_640})
    assert len(fla) == 2 and "tl.trans(b_ds)" in fla[0] and "b_dsT" in fla[1], fla


def test_the_scan_passes_transposed_loads_and_untransposed_dot_results():
    assert transposed_dot_operands({"safe.py": SAFE}) == []


# The delta rule's backward still holds the pattern (A^T dO, ds^T Q, (A^-1)^T dU, ...): its
# kernels refuse on Hopper under the Triton releases that miscompile it
# (configs.TRANSPOSED_DOT_KERNELS, checked in delta_rule.launch). Its functions with the
# pattern; the set must shrink to nothing as they are rewritten, and nothing may join it.
REFUSED = {"delta_bwd_state_kernel", "delta_bwd_dqk_kernel", "delta_bwd_wy_kernel", "_wy_bwd_values",
           "_wy_bwd_keys"}


def _function(hit: str) -> str:
    return hit.split()[1].rstrip(":")


def test_no_kernel_transposes_a_dot_result_for_another_dot():
    sources = kernel_sources()
    assert "chunk_grad.py" in sources and "delta_rule.py" in sources
    hits = transposed_dot_operands(sources)
    unguarded = [h for h in hits if _function(h) not in REFUSED or not h.startswith("delta_rule.py:")]
    assert unguarded == [], "tl.dot of a transposed dot result (fla #640; miscompiled on Hopper by Triton " \
                            "3.4 <= v < 3.7.1):\n" + "\n".join(unguarded)
    assert {_function(h) for h in hits} == REFUSED, "update REFUSED (and the refusal) to what is left"


def test_the_kernels_that_keep_the_pattern_refuse_on_hopper_with_a_bad_triton(monkeypatch):
    import torch

    pytest.importorskip("triton")
    from linattn_lib.core.triton_ops import load_kernels

    K = load_kernels()
    assert {f"{name}_kernel" for name in K.configs.TRANSPOSED_DOT_KERNELS} == {f for f in REFUSED if f.endswith("_kernel")}
    bad = K.configs.miscompiles_transposed_dots
    assert bad((9, 0), (3, 4, 0)) and bad((9, 0), (3, 6, 0)) and bad((9, 0), (3, 7, 0))
    assert not bad((9, 0), (3, 7, 1)) and not bad((9, 0), (3, 3, 1)) and not bad((9, 0), (3, 8, 0))
    assert not bad((8, 0), (3, 6, 0)) and not bad((10, 0), (3, 6, 0)) and not bad(None, (3, 6, 0))
    monkeypatch.setattr(K.configs, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(K.configs, "triton_version", lambda: (3, 6, 0))
    for name in K.configs.TRANSPOSED_DOT_KERNELS:
        with pytest.raises(RuntimeError, match="#640"):
            K.delta_rule.launch(name, torch.device("cuda"), (1,), {})
    monkeypatch.setattr(K.configs, "triton_version", lambda: (3, 7, 1))
    K.configs.refuse_transposed_dots("the delta rule's backward", torch.device("cuda"))   # fixed: no refusal


@pytest.mark.parametrize("name", ["chunk_grad.py", "chunk_output.py", "delta_rule.py"])
def test_the_scan_sees_the_kernels_dots(name):
    """The scan reads real dots in the kernel files (it would pass trivially on files it
    could not parse into @triton.jit functions)."""
    text = kernel_sources()[name]
    tree = ast.parse(text)
    jit = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and _is_jit(n)]
    assert jit and any(_is_dot(n) for f in jit for n in ast.walk(f))


def test_auto_keeps_the_delta_rule_on_torch_where_its_backward_would_be_refused(monkeypatch):
    """backend="auto" on a Hopper GPU whose Triton miscompiles the backward: a call that needs a
    gradient runs torch (no kernel launched, no RuntimeError at the backward), one that does not
    still runs the kernels. The GPU is simulated: record_launches(cuda_like=True) shows CPU tensors
    as an sm_90 device's and stubs the launches; the installed Triton is declared bad."""
    import torch
    import torch.nn.functional as F

    pytest.importorskip("triton")
    from linattn_lib import delta_rule_attention
    from linattn_lib.core.triton_ops import load_kernels
    from linattn_lib.experiments.launches import record_launches

    configs = load_kernels().configs
    q, k = (F.normalize(torch.randn(1, 2, 64, 16), dim=-1) for _ in range(2))
    v, beta = torch.randn(1, 2, 64, 16), torch.rand(1, 2, 64)
    for bad in (False, True):
        monkeypatch.setattr(configs, "TRANSPOSED_DOT_BAD",
                            ((3, 4, 0), (99, 0, 0)) if bad else ((3, 4, 0), (3, 7, 1)))
        with record_launches(cuda_like=True) as launches:
            delta_rule_attention(q, k, v.requires_grad_(), beta)
            trained = [x.name for x in launches]
            del launches[:]
            with torch.no_grad():
                delta_rule_attention(q, k, v, beta)
            inferred = [x.name for x in launches]
        assert inferred and inferred[0].startswith("delta_"), inferred
        assert (trained == []) if bad else (trained == inferred), (bad, trained)
