"""Looking inside the Triton kernels: what they keep on chip, what they move, what they compile to.

Used by the book's appendix on the kernels (book/appendix_kernels.ipynb).

* `memory_map(kernel)` reads a `@triton.jit` kernel's source and sorts its `tl.load` / `tl.store`
  calls into those inside the chunk loop and those outside it, and finds the loop-carried
  values: what a program keeps in registers from one chunk to the next.
* `count_interpreter_traffic()` counts, while kernels run in the Triton interpreter, the bytes
  every `tl.load` / `tl.store` moves (masked-off elements excluded) and the FLOPs of every
  `tl.dot`: a measurement of the kernel's memory traffic on CPU.
* `chunk_fwd_traffic` is the same count in closed form for `chunk_fwd_kernel`, and
  `flash_attention_cost`, `token_loop_cost` and `decode_step_cost` give FLOPs and bytes of the
  alternatives (these closed forms, and `Cost`, are defined in `linattn_lib.flops` and
  re-exported here); `roofline_time` and `GPU_PEAKS` turn them into roofline bounds.
* `compile_report` compiles a kernel ahead of time for a GPU target (no GPU needed) and reports
  the sizes of its PTX and SASS, its shared memory, registers and spills.
* `ctas_per_sm` is the CUDA occupancy rule (registers x threads and shared memory per CTA
  against an SM's, `SM_RESOURCES`); `loop_loads` reads from a compiled kernel's TTGIR which
  loads inside its loops the software pipeliner made asynchronous (cp.async / TMA).
* `draw_chunk_algorithm` and `plot_roofline` draw the appendix's two figures.
"""
from __future__ import annotations

import ast
import contextlib
import inspect
import os
import re
import subprocess
import tempfile
import textwrap
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..core.triton_ops import require_kernels
from ..flops import (  # noqa: F401  (re-exported: the appendix calls them as ka.<name>)
    Cost,
    chunk_fwd_min_traffic,
    chunk_fwd_traffic,
    decode_step_cost,
    flash_attention_cost,
    matmul_flops,
    token_loop_cost,
)

if TYPE_CHECKING:  # annotations only: matplotlib is imported by the figure functions themselves
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# --------------------------------------------------------------------------------------
# rooflines
# --------------------------------------------------------------------------------------

# Dense 16-bit tensor-core throughput (FLOP/s) and memory bandwidth (B/s) from the vendor's
# datasheets (keys of book/references.bib in `source`).
GPU_PEAKS = {
    "T4": {"flops": 65e12, "bandwidth": 320e9, "source": "nvidia2019t4"},
    # What a kernel gets on a T4 when its matmuls compile to FP32 FMA instructions instead of
    # tensor-core MMAs (Triton does that on sm_75; see compile_report's mma_instructions).
    "T4 (FP32 FMA)": {"flops": 8.1e12, "bandwidth": 320e9, "source": "nvidia2019t4"},
    "A100 SXM 80GB": {"flops": 312e12, "bandwidth": 2.039e12, "source": "nvidia2021a100"},
    "H100 SXM": {"flops": 989.4e12, "bandwidth": 3.35e12, "source": "nvidia2023h100"},
}


def ridge_point(gpu: str) -> float:
    """The intensity (FLOP/B) above which `gpu` is compute-bound: peak FLOP/s over bandwidth."""
    p = GPU_PEAKS[gpu]
    return p["flops"] / p["bandwidth"]


def roofline_time(cost: Cost, gpu: str) -> float:
    """Lower bound on the run time (s): max(FLOPs / peak FLOP/s, bytes / bandwidth)."""
    p = GPU_PEAKS[gpu]
    return max(cost.flops / p["flops"], cost.bytes / p["bandwidth"])


# --------------------------------------------------------------------------------------
# measuring the traffic in the Triton interpreter
# --------------------------------------------------------------------------------------

@dataclass
class Traffic:
    """What kernels did while `count_interpreter_traffic` was active."""

    load_bytes: int = 0
    store_bytes: int = 0
    dot_flops: int = 0
    loads: int = 0
    stores: int = 0
    dots: int = 0
    dot_shapes: Counter = field(default_factory=Counter)

    @property
    def bytes(self) -> int:
        return self.load_bytes + self.store_bytes

    def cost(self) -> Cost:
        return Cost(flops=self.dot_flops, bytes=self.bytes)


@contextlib.contextmanager
def count_interpreter_traffic() -> Iterator[Traffic]:
    """Count the bytes of every tl.load / tl.store and the FLOPs of every tl.dot.

    Works for kernels that run in the Triton interpreter (CPU tensors); masked-off elements
    are not counted, exactly as a GPU would not move them. Yields a `Traffic` that fills up
    while the block runs.
    """
    from triton.runtime.interpreter import InterpreterBuilder

    traffic = Traffic()
    orig_load, orig_store, orig_dot = (InterpreterBuilder.create_masked_load,
                                       InterpreterBuilder.create_masked_store, InterpreterBuilder.create_dot)

    def load(self, ptrs, mask, other, *args, **kwargs):
        ret = orig_load(self, ptrs, mask, other, *args, **kwargs)
        traffic.loads += 1
        traffic.load_bytes += int(mask.data.sum()) * ret.data.dtype.itemsize
        return ret

    def store(self, ptrs, value, mask, *args, **kwargs):
        traffic.stores += 1
        traffic.store_bytes += int(mask.data.sum()) * ptrs.get_element_ty().primitive_bitwidth // 8
        return orig_store(self, ptrs, value, mask, *args, **kwargs)

    def dot(self, a, b, d, *args, **kwargs):
        (m, k), n = a.data.shape[-2:], b.data.shape[-1]
        traffic.dots += 1
        traffic.dot_flops += matmul_flops(m, k, n)
        traffic.dot_shapes[(m, k, n)] += 1
        return orig_dot(self, a, b, d, *args, **kwargs)

    InterpreterBuilder.create_masked_load = load
    InterpreterBuilder.create_masked_store = store
    InterpreterBuilder.create_dot = dot
    try:
        yield traffic
    finally:
        InterpreterBuilder.create_masked_load = orig_load
        InterpreterBuilder.create_masked_store = orig_store
        InterpreterBuilder.create_dot = orig_dot


# --------------------------------------------------------------------------------------
# reading the kernel source
# --------------------------------------------------------------------------------------

@dataclass
class MemoryMap:
    """Where a kernel touches global memory, relative to its main loop."""

    loads_in_loop: list
    stores_in_loop: list
    loads_outside: list
    stores_outside: list
    loop_carried: list   # assigned before the loop and reassigned inside it: kept on chip


def _source_fn(kernel):
    fn = getattr(kernel, "fn", kernel)
    return textwrap.dedent(inspect.getsource(fn))


def _root_name(node, aliases: dict) -> str:
    """The pointer argument a load/store address is built from: q_base + ... -> q_ptr."""
    while isinstance(node, (ast.BinOp, ast.Subscript, ast.Attribute)):
        node = node.left if isinstance(node, ast.BinOp) else node.value
    name = node.id if isinstance(node, ast.Name) else ast.unparse(node)
    seen = set()
    while name in aliases and name not in seen:
        seen.add(name)
        name = aliases[name]
    return name


def memory_map(kernel: object) -> MemoryMap:
    """Sort a `@triton.jit` kernel's loads and stores into inside/outside its (first) for loop.

    Pointers are named by the kernel argument they are computed from (`q_base = q_ptr + ...`
    makes a load from `q_base + ...` a load of `q_ptr`), in source order, without repeats.
    """
    tree = ast.parse(_source_fn(kernel))
    func = tree.body[0]
    aliases = {}
    for node in ast.walk(func):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            root = _root_name(node.value, {})
            if root.endswith("_ptr"):
                aliases[node.targets[0].id] = root
    loop = next(node for node in ast.walk(func) if isinstance(node, ast.For))
    inside = {id(n) for n in ast.walk(loop)}

    def calls(op):
        out_in, out_out = [], []
        for node in ast.walk(func):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == op and isinstance(node.func.value, ast.Name) and node.func.value.id == "tl"):
                name = _root_name(node.args[0], aliases)
                target = out_in if id(node) in inside else out_out
                target.append((node.lineno, name))
        order = lambda xs: list(dict.fromkeys(name for _, name in sorted(xs)))  # noqa: E731
        return order(out_in), order(out_out)

    loads_in, loads_out = calls("load")
    stores_in, stores_out = calls("store")

    def assigned(nodes):
        names = set()
        for n in nodes:
            for sub in ast.walk(n):
                if isinstance(sub, (ast.Assign, ast.AugAssign)):
                    for t in (sub.targets if isinstance(sub, ast.Assign) else [sub.target]):
                        if isinstance(t, ast.Name):
                            names.add(t.id)
        return names

    before = assigned([n for n in func.body if n.lineno < loop.lineno])
    in_loop = assigned(loop.body)
    read_in_loop = {n.id for n in ast.walk(loop) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    carried = sorted(before & in_loop & read_in_loop)
    return MemoryMap(loads_in, stores_in, loads_out, stores_out, carried)


# --------------------------------------------------------------------------------------
# ahead-of-time compilation
# --------------------------------------------------------------------------------------

_TORCH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _nvidia_tool(name: str) -> str | None:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return path if os.access(path, os.X_OK) else None


def sass_stats(cubin: bytes, *, lazy: bool = False) -> dict | None:
    """What ptxas made of a kernel, from its cubin (cuobjdump, shipped with Triton): registers
    and stack bytes per thread, SASS instructions, tensor-core MMA instructions and spill
    instructions (STL/LDL: local-memory stores and loads). None when cuobjdump is missing.

    Disassembling takes a second or two for a large kernel. `lazy`: only when ptxas gave the
    kernel local memory (a stack frame or local bytes); without any there is nowhere a spill
    could go, so spill_instructions is 0 and the instruction counts are None.
    """
    cuobjdump = _nvidia_tool("cuobjdump")
    if cuobjdump is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        usage = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True, text=True).stdout
        stats: dict = {"registers": None, "stack_bytes": None, "sass_instructions": None, "mma_instructions": None}
        m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
        if m:
            stats["registers"], stats["stack_bytes"] = int(m.group(1)), int(m.group(2))
        local = re.search(r"LOCAL:(\d+)", usage)
        if lazy and m and stats["stack_bytes"] == 0 and local and int(local.group(1)) == 0:
            stats["spill_instructions"] = 0
            return stats
        sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True).stdout
    ops = [re.sub(r"^\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?", "", line).split(" ")[0].split(".")[0]
           for line in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+\S", line)]
    counts = Counter(ops)
    stats["sass_instructions"] = len(ops)
    stats["mma_instructions"] = sum(v for k, v in counts.items() if k in ("HMMA", "HGMMA", "IMMA"))
    stats["spill_instructions"] = counts["STL"] + counts["LDL"]
    return stats


# the integer arguments that are sequence lengths or counts: not multiples of 16 in general
SEQUENCE_ARGS = ("T", "NT", "n_rows", "H")


def jit_alignment(arg_names: list[str], signature: dict) -> dict:
    """The `attrs` of an ASTSource that tell the compiler what the JIT knows when the head dims
    are multiples of 16 and the tensors come from torch: every pointer 16-byte aligned, every
    integer but the sequence lengths (`SEQUENCE_ARGS`) a multiple of 16."""
    return {(arg_names.index(name),): [["tt.divisibility", 16]] for name, ty in signature.items()
            if ty.startswith("*") or (ty == "i32" and name not in SEQUENCE_ARGS)}


def compile_report(kernel: str, target: str, dtype: str, d_whole: int, *, config: dict | None = None,
                   aligned: bool = False) -> dict:
    """Compile `kernel` (a name of `linattn_lib.kernels.KERNELS`) for `target` ("sm_80") ahead of time.

    The config is the one the launcher picks for a head dim of `d_whole` and inputs of `dtype`
    ("bf16", "fp16", "fp32") on that target, unless given; the variant compiled is the
    kernel's heaviest (its `compile_spec`). No GPU is needed: Triton lowers to PTX and runs
    ptxas. Returns the config, the shared memory per block (bytes), the PTX (lines), the SASS
    (instructions, from cuobjdump), registers and stack (spill) bytes per thread, the number of
    tensor-core MMA instructions, the cubin size, the shared-memory limit of the target, and
    the loads of each loop (`loop_loads` of the TTGIR). aligned: compile with the alignment the
    JIT sees at head dims that are multiples of 16 (`jit_alignment`), as it would specialise, the
    config's register cap (`configs.MAXNREG`), as the launcher passes it there, and without the
    head-dim masks where the tiles divide `d_whole` (EVEN_D, `sequences.even_dims`).
    """
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    K = require_kernels("compile_report")
    fn, spec = K.KERNELS[kernel]
    if not isinstance(fn, JITFunction):  # TRITON_INTERPRET=1 made it an InterpretedFunction
        fn = JITFunction(fn.fn)
    cap = K.TARGETS[target]
    cfg = config or K.select_config(kernel, d_whole, getattr(torch, _TORCH_DTYPES[dtype]), cap)
    signature, constexprs = spec(cfg, dtype)
    attrs = jit_alignment(fn.arg_names, signature) if aligned else None
    if (aligned and "EVEN_D" in fn.arg_names and all(d_whole % cfg[w] == 0 for w in ("BK", "BV"))
            and not (kernel == "chunk_dqk" and cfg["num_warps"] != 8)):  # as chunk_grad.chunk_dqk decides
        # head dims that are multiples of the tiles: the launcher drops the head-dim masks
        signature["EVEN_D"], constexprs["EVEN_D"] = "constexpr", True
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", cap[0] * 10 + cap[1], 32),
        options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"],
                 # the config's register cap, as the launcher passes it where the JIT sees alignment
                 **({"maxnreg": cfg["maxnreg"]} if aligned and cfg.get("maxnreg") else {})},
    )
    report = {
        "kernel": kernel, "target": target, "dtype": dtype, "config": dict(cfg),
        "shared_bytes": int(compiled.metadata.shared), "smem_limit": K.SMEM_LIMITS[target],
        "ptx_lines": len(compiled.asm["ptx"].splitlines()), "cubin_bytes": len(compiled.asm["cubin"]),
        "registers": None, "stack_bytes": None, "sass_instructions": None, "mma_instructions": None,
        "spill_instructions": None, "loops": loop_loads(compiled.asm["ttgir"]),
    }
    stats = sass_stats(compiled.asm["cubin"])
    if stats is not None:
        report.update(stats)
    return report


# --------------------------------------------------------------------------------------
# occupancy and software pipelining, read from the compiled artifacts
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SMResources:
    """What one SM of a GPU generation holds, for the occupancy rule of `ctas_per_sm`.

    From the CUDA C++ Programming Guide ("Technical Specifications per Compute Capability")
    and the allocation rules of the CUDA occupancy calculator (cuda_occupancy.h): registers
    are allocated per warp in units of 256, from the register files of the SM's 4
    sub-partitions; shared memory in units of `shared_unit`, plus `reserved_shared` per CTA
    that the CUDA runtime keeps for itself (1 KiB from sm_80 on).
    """

    shared: int            # shared memory per SM (bytes): the largest carve-out
    shared_per_block: int  # the opt-in maximum one CTA may use
    max_threads: int       # resident threads per SM
    max_ctas: int          # resident CTAs per SM
    reserved_shared: int = 1024
    shared_unit: int = 128
    registers: int = 65536           # 32-bit registers per SM (and at most per CTA)
    max_registers_per_thread: int = 255
    register_unit: int = 256         # per warp
    sub_partitions: int = 4


KIB = 1024
SM_RESOURCES = {
    "sm_75": SMResources(64 * KIB, 64 * KIB, 1024, 16, reserved_shared=0, shared_unit=256),
    "sm_80": SMResources(164 * KIB, 163 * KIB, 2048, 32),
    "sm_86": SMResources(100 * KIB, 99 * KIB, 1536, 16),
    "sm_89": SMResources(100 * KIB, 99 * KIB, 1536, 24),
    "sm_90": SMResources(228 * KIB, 227 * KIB, 2048, 32),
}


@dataclass(frozen=True)
class Occupancy:
    """Resident CTAs per SM that each resource allows; `ctas` is the smallest of them."""

    by_registers: int
    by_shared: int
    by_threads: int
    by_ctas: int

    @property
    def ctas(self) -> int:
        return min(self.by_registers, self.by_shared, self.by_threads, self.by_ctas)

    @property
    def limited_by(self) -> str:
        """The resource that sets `ctas` (the first of a tie, in the order of the fields)."""
        limits = {"registers": self.by_registers, "shared memory": self.by_shared,
                  "threads": self.by_threads, "CTAs": self.by_ctas}
        return min(limits, key=limits.__getitem__)


def ctas_per_sm(n_regs: int, num_warps: int, shared_bytes: int, target: str) -> Occupancy:
    """How many CTAs of a kernel fit on one SM of `target` ("sm_80") at once.

    `n_regs`: registers per thread (ptxas; `sass_stats(...)["registers"]`), `num_warps`: warps
    per CTA (32 threads each), `shared_bytes`: shared memory per CTA (`metadata.shared`).
    Registers: each warp takes n_regs * 32 rounded up to 256, from one of the SM's 4
    sub-partitions (16384 registers each), so 128 registers x 8 warps gives 4 warps per
    sub-partition, 16 per SM: 2 CTAs, and 129 registers give 1. Shared memory: each CTA
    takes its bytes rounded up to the allocation unit plus the runtime's reserved 1 KiB
    (sm_80+), out of the SM's largest carve-out. A CTA over a per-CTA limit fits 0 times.
    """
    sm = SM_RESOURCES[target]
    per_warp = -(-n_regs * 32 // sm.register_unit) * sm.register_unit  # rounded up to the unit
    if n_regs > sm.max_registers_per_thread or per_warp * num_warps > sm.registers:
        by_registers = 0
    elif per_warp == 0:
        by_registers = sm.max_ctas
    else:
        warps = (sm.registers // sm.sub_partitions // per_warp) * sm.sub_partitions
        by_registers = warps // num_warps
    per_cta = -(-shared_bytes // sm.shared_unit) * sm.shared_unit + sm.reserved_shared
    by_shared = 0 if shared_bytes > sm.shared_per_block else sm.shared // per_cta if per_cta else sm.max_ctas
    return Occupancy(by_registers, by_shared, sm.max_threads // (num_warps * 32), sm.max_ctas)


# Ops that copy global memory to shared memory asynchronously: cp.async (sm_80+), TMA (sm_90+).
_ASYNC_LOADS = re.compile(r"\b(ttg\.async_copy_global_to_local|ttng\.async_tma_copy_global_to_local"
                          r"|ttng\.async_tma_gather|ttng\.async_copy_global_to_local)\b")
_DOTS = re.compile(r"\b(tt\.dot|tt\.dot_scaled|ttng\.warp_group_dot|ttng\.tc_gen5_mma)\b")
_TILE_LOAD = re.compile(r"\btt\.(load|descriptor_load)\b.*: (tensor|!tt\.tensordesc)<\d+x\d+")


def loop_loads(ttgir: str) -> list[dict]:
    """The global loads and matmuls of each loop (scf.for body) of a kernel's TTGIR
    (`compiled.asm["ttgir"]`), after Triton's software pipeliner has run.

    A tile load the pipeliner overlapped with the previous iteration's compute is either an
    async copy into shared memory (`ttg.async_copy_global_to_local`: cp.async;
    `ttng.async_tma_*`: TMA) or a `tt.load` of the next iteration's tile whose result the loop
    carries (it is yielded: a prefetch into registers); any other `tt.load` of a tile is
    waited for where it is used. One dict per loop, in source order, each op counted in its
    innermost loop: dots (tt.dot and warp-group dots), async (async copies), prefetched and
    sync_tiles (the 2-D tile loads of each kind), ops (the async op names).
    """
    loops: list[dict] = []
    regions: list[int | None] = []  # per open region: the index of its loop, None if not a loop
    for raw in ttgir.splitlines():
        line = raw.strip()
        if line.startswith("}") and regions:
            regions.pop()
        inner = next((i for i in reversed(regions) if i is not None), None)
        if inner is not None:
            _count_loop_line(loops[inner], line, yields=regions[-1] == inner)
        if line.endswith("{"):
            if " scf.for " in f" {line}":
                loops.append({"dots": 0, "async": 0, "prefetched": 0, "sync_tiles": 0, "ops": [], "tiles": []})
                regions.append(len(loops) - 1)
            else:
                regions.append(None)
    return [{k: v for k, v in loop.items() if k != "tiles"} for loop in loops]


def _count_loop_line(loop: dict, line: str, yields: bool) -> None:
    """Add one TTGIR line of a loop body to `loop_loads`' counts for that loop."""
    loop["dots"] += len(_DOTS.findall(line))
    found = _ASYNC_LOADS.findall(line)
    loop["async"] += len(found)
    loop["ops"] += [op for op in found if op not in loop["ops"]]
    if _TILE_LOAD.search(line):
        loop["tiles"].append(line.split(" = ")[0].split(":")[0])
        loop["sync_tiles"] += 1
    elif yields and line.startswith("scf.yield"):
        carried = set(re.findall(r"%[\w.]+", line.split(" : ")[0]))
        n = sum(name in carried for name in loop["tiles"])
        loop["prefetched"] += n
        loop["sync_tiles"] -= n


# --------------------------------------------------------------------------------------
# figures, in colours that are not the book's method colours: purple for work on chip, gold
# --------------------------------------------------------------------------------------
_ON_CHIP, _STATE, _STATE_EDGE = "tab:purple", "#ffe066", "darkgoldenrod"  # for the state


def draw_chunk_algorithm(T: int = 8, BT: int = 2, current: int = 2) -> Figure:
    """The chunked algorithm in two stacked panels (readable at phone width), for T / BT chunks
    with chunk `current` in flight.

    Top: the T x T causal mixing matrix. Blocks on the diagonal are computed as masked
    BT x BT matmuls in registers; blocks below it are never formed, their contribution arrives
    through the state. Bottom: one program's data flow: the chunk's q, k, v tiles come from
    global memory (HBM), the state S (Dk x BV, fp32) stays in registers for the whole
    sequence, and only the output tile (and the denominators) go back to memory.
    """
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(7, 10.5), gridspec_kw={"height_ratios": [1, 1]})
    _draw_mixing_matrix(ax0, T // BT, current)
    _draw_program_dataflow(ax1, current)
    fig.tight_layout()
    return fig


def _draw_mixing_matrix(ax0: Axes, n: int, current: int) -> None:
    """Top panel of `draw_chunk_algorithm`: the causal mixing matrix, in chunk units."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    for i in range(n):
        for j in range(i + 1):
            if i == j:
                tri = plt.Polygon([(j, n - i), (j, n - i - 1), (j + 1, n - i - 1)], closed=True,
                                  facecolor=_ON_CHIP, edgecolor="none", alpha=0.9 if i == current else 0.45)
                ax0.add_patch(tri)
                ax0.add_patch(Rectangle((j, n - i - 1), 1, 1, fill=False, edgecolor=_ON_CHIP, lw=1.5))
            else:  # never formed: hatched in the colour of the state they come through
                ax0.add_patch(Rectangle((j, n - i - 1), 1, 1, facecolor=_STATE, alpha=0.45 if i == current
                                        else 0.2, hatch="//", edgecolor=_STATE_EDGE, lw=0.8))
    ax0.add_patch(Rectangle((0, 0), n, n, fill=False, edgecolor="black", lw=1))
    ax0.set_xlim(-0.1, n + 0.1)
    ax0.set_ylim(-0.1, n + 0.1)
    ax0.set_aspect("equal")
    ax0.set_xticks([c + 0.5 for c in range(n)], [f"c{c}" for c in range(n)])
    ax0.set_yticks([n - c - 0.5 for c in range(n)], [f"c{c}" for c in range(n)])
    ax0.set_xlabel("key chunk")
    ax0.set_ylabel("query chunk")
    ax0.set_title("mixing matrix, chunk by chunk")
    ax0.text(n * 0.97, n * 0.93, "diagonal blocks: masked\n$C\\times C$ matmuls, on chip\n\n"
             "blocks below: never formed;\nthey reach the query\nthrough the state S",
             ha="right", va="top", fontsize=10)


def _draw_program_dataflow(ax1: Axes, current: int) -> None:
    """Bottom panel of `draw_chunk_algorithm`: the memory hierarchy of one program."""
    from matplotlib.patches import FancyArrowPatch, Rectangle

    ax1.set_xlim(0, 10)
    ax1.set_ylim(0, 7)
    ax1.axis("off")
    ax1.set_title(f"one program: chunk c{current}, one tile of value columns")
    ax1.add_patch(Rectangle((0.2, 5.0), 9.6, 1.7, facecolor="#e8e8e8", edgecolor="gray"))
    ax1.text(0.35, 6.45, "global memory (HBM)", fontsize=10.5, weight="bold", va="center")
    ax1.add_patch(Rectangle((0.2, 0.2), 9.6, 4.3, facecolor="#f6f1fb", edgecolor=_ON_CHIP))
    # on a patch of the region's own colour, above the arrows that pass it
    ax1.text(0.35, 4.25, "on chip: registers / shared memory of one program", fontsize=10.5, weight="bold",
             va="center", zorder=3, bbox=dict(facecolor="#f6f1fb", edgecolor="none", pad=1.0))

    def box(x, y, w, h, label, color):
        ax1.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="black", lw=0.8))
        ax1.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=10)

    def arrow(x0, y0, x1, y1, color="black"):
        ax1.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle="-|>", mutation_scale=11, color=color, lw=1.2))

    for x, lab in [(0.5, "q chunk\n$C\\times d_k$"), (2.3, "k chunk\n$C\\times d_k$"), (4.1, "v tile\n$C\\times B_V$")]:
        box(x, 5.2, 1.5, 0.95, lab, "white")
        arrow(x + 0.75, 5.2, x + 0.75, 3.75, "dimgray")
    box(6.4, 5.2, 1.5, 0.95, "o tile\n$C\\times B_V$", "white")
    box(8.1, 5.2, 1.5, 0.95, "den\n$C$ (fp32)", "white")
    box(0.5, 2.75, 3.3, 0.95, "A = (q kᵀ) ∘ decay\n$C\\times C$, masked", "#dccbee")
    box(4.1, 2.75, 1.5, 0.95, "o = A v\n+ q S", "#dccbee")
    box(0.5, 0.55, 4.2, 1.25, "state S: $d_k\\times B_V$ fp32  (and z: $d_k$)\nkept for the whole sequence\n"
        "S ← exp(g) S + kᵀ v  after each chunk", _STATE)
    arrow(3.8, 3.2, 4.1, 3.2)
    arrow(4.45, 1.8, 4.45, 2.75, _STATE_EDGE)
    arrow(5.6, 3.2, 7.15, 5.2, "dimgray")
    arrow(5.6, 3.0, 8.85, 5.2, "dimgray")
    ax1.text(6.0, 1.2, "per chunk:\nread q, k, v tiles\nwrite o tile (+ den)\n"
             "the state never\ngoes to memory", fontsize=10, va="center")


def plot_roofline(
    points: dict, gpus: Sequence[str] = ("T4 (FP32 FMA)", "A100 SXM 80GB", "H100 SXM"), *, ax: Axes | None = None
) -> Figure:
    """Rooflines of `gpus` (log-log: attainable TFLOP/s against FLOP/byte) with `points`,
    a dict label -> Cost (or intensity), drawn as markers on the x axis of their intensity."""
    import matplotlib.pyplot as plt
    import numpy as np

    if ax is None:
        fig, ax = plt.subplots(figsize=(8, 4.6))
    else:
        fig = ax.figure
    x = np.logspace(-1, 4.3, 200)
    for name, style in zip(gpus, ("-", "--", "-.", ":")):
        p = GPU_PEAKS[name]
        ax.plot(x, np.minimum(p["flops"], p["bandwidth"] * x) / 1e12, style, color="black", lw=1.2,
                label=f"{name}: ridge {p['flops'] / p['bandwidth']:.0f} FLOP/B")
    markers = iter("osD^vP*X")
    top = GPU_PEAKS[gpus[-1]]
    for label, cost in points.items():
        intensity = cost.intensity if isinstance(cost, Cost) else float(cost)
        y = min(top["flops"], top["bandwidth"] * intensity) / 1e12
        shown = f"{intensity:.3g}" if intensity < 1000 else f"{intensity:,.0f}"
        ax.plot([intensity], [y], next(markers), ms=8, label=f"{label}: {shown} FLOP/B")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte of memory traffic)")
    ax.set_ylabel("attainable TFLOP/s")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="lower right")
    return fig
