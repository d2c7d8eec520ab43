"""What a compiled kernel is made of, read without a GPU: `compiled_kernel` compiles a recorded launch
(`perf_model.Call`) ahead of time for an NVIDIA target with Triton (ptxas and cuobjdump ship with it), as
the JIT would specialise it, and `SassStats` holds its registers, shared memory and SASS instruction
counts (one warp's, in all and in the main loop's body, `loop_of`). The performance model (perf_model.py)
and the kernel fit (experiments/kernel_fit.py) read kernels through this module.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from . import kernel_anatomy as ka

Call = Any  # a perf_model.Call: kernel name, grid, arguments by name, warps, stages, the JITFunction

@dataclass(frozen=True)
class SassStats:
    """A compiled kernel: registers per thread, shared memory, one warp's instructions in all and
    in the main loop's body (NOPs excluded), and tensor-core FLOPs in the body and outside it."""

    registers: int
    shared_bytes: int
    total: int
    body: int
    flops_body: int = 0
    flops_rest: int = 0


_SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?(\S+)([^;]*);")


def _mma_flops(op: str) -> int:
    """FLOPs of one warp's share of an MMA instruction (HMMA: per warp; HGMMA: per warpgroup of 4)."""
    m = re.match(r"HGMMA\.(\d+)x(\d+)x(\d+)", op)
    if m:
        return 2 * math.prod(int(x) for x in m.groups()) // 4
    m = re.match(r"HMMA\.168(\d+)", op)  # m16 n8 kK
    return 2 * 16 * 8 * int(m.group(1)) if m else 0


def loop_of(sass: str) -> tuple[list[tuple[int, str, str]], list[bool]]:
    """A `cuobjdump -sass` listing's instructions (address, opcode, operands) and which are in the loop:
    the longest backward branch (BRA to a lower address), its body target..branch (none without one)."""
    ins = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in map(_SASS_LINE.match, sass.splitlines())
           if m and not m.group(2).startswith("NOP")]
    loops = [(int(t.group(1), 16), addr) for addr, op, rest in ins
             if op.startswith("BRA") and (t := re.search(r"0x([0-9a-f]+)", rest)) and int(t.group(1), 16) < addr]
    lo, hi = max(loops, key=lambda ab: ab[1] - ab[0]) if loops else (1, 0)
    return ins, [lo <= addr <= hi for addr, _, _ in ins]


def loop_spans(sass: str) -> list[tuple[int, int]]:
    """Every loop of a listing, (first, last address) of its body, in address order: a backward
    branch's target..branch, branches to one target merged into the widest."""
    ins, _ = loop_of(sass)
    spans: dict[int, int] = {}
    for addr, op, rest in ins:
        t = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if t and int(t.group(1), 16) < addr:
            spans[int(t.group(1), 16)] = max(addr, spans.get(int(t.group(1), 16), 0))
    return sorted(spans.items())


def weighted_counts(sass: str, trips: list[int]) -> tuple[int, int]:
    """(instructions, MMA FLOPs) one warp issues when the listing's loops (`loop_spans`) run
    trips[i] times each time they are entered (a nested loop: per trip of the loop around it)."""
    ins, _ = loop_of(sass)
    spans = loop_spans(sass)
    if len(spans) != len(trips):
        raise ValueError(f"weighted_counts: {len(spans)} loops in the listing, {len(trips)} trip counts")
    weight = lambda addr: math.prod(n for (lo, hi), n in zip(spans, trips) if lo <= addr <= hi)
    return (sum(weight(a) for a, _, _ in ins), sum(weight(a) * _mma_flops(op) for a, op, _ in ins))


def parse_sass(sass: str) -> tuple[int, int, int, int]:
    """(total, loop body, MMA FLOPs in the body, outside it) of a `cuobjdump -sass` listing (`loop_of`)."""
    ins, in_body = loop_of(sass)
    flops = [_mma_flops(op) for _, op, _ in ins]
    body_flops = sum(f for f, b in zip(flops, in_body) if b)
    return len(ins), sum(in_body), body_flops, sum(flops) - body_flops


_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
           torch.int64: "i64", torch.bool: "i1"}


def _signature(call: Call) -> tuple[dict, dict, dict]:
    """signature, constexprs, attrs as the JIT specialises the call (aligned pointers, ints % 16, 1, None)."""
    sig, ce, attrs = {}, {}, {}
    for i, p in enumerate(call.fn.params):
        val = call.args[p.name] if p.name in call.args else p.default
        spec, is_int = not p.do_not_specialize, isinstance(val, int) and not isinstance(val, bool)
        if p.is_constexpr or val is None or (is_int and val == 1 and spec):
            sig[p.name], ce[p.name] = "constexpr", val
        elif isinstance(val, torch.Tensor):
            sig[p.name], attrs[(i,)] = "*" + _DTYPES[val.dtype], [["tt.divisibility", 16]]
        elif is_int:
            sig[p.name] = "i32" if -2**31 <= val < 2**31 else "i64"
            if spec and val % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[p.name] = "i1" if isinstance(val, bool) else "fp32"
    return sig, ce, attrs


def _read_cubin(cubin: bytes) -> SassStats:
    """A cubin's registers and `parse_sass` numbers, from cuobjdump; cached on disk (it takes seconds)."""
    cache = Path(tempfile.gettempdir()) / f"linattn_sass_{hashlib.sha1(cubin).hexdigest()}.json"
    if cache.exists():
        return SassStats(**json.loads(cache.read_text()))
    tool = ka._nvidia_tool("cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        run = lambda flag: subprocess.run([tool, flag, str(path)], capture_output=True, text=True).stdout
        regs = re.search(r"REG:(\d+)", run("-res-usage"))
        stats = SassStats(int(regs.group(1)) if regs else 255, 0, *parse_sass(run("-sass")))
    cache.write_text(json.dumps(asdict(stats)))
    return stats


_COMPILED: dict[tuple, tuple[Any, SassStats]] = {}


def compiled_kernel(call: Call, target: str = "sm_90") -> tuple[Any, SassStats]:
    """(Triton's compiled kernel, its `SassStats`) of `call`'s kernel compiled ahead of time for `target` (no
    GPU; ptxas and cuobjdump ship with Triton) with its arguments' dtypes and constexprs; cached per variant."""
    import triton
    from triton.compiler import ASTSource

    if not isinstance(call.fn, triton.runtime.jit.JITFunction) or ka._nvidia_tool("cuobjdump") is None:
        raise RuntimeError(f"sass_stats_of({call.kernel}): needs a JITFunction (TRITON_INTERPRET unset) and cuobjdump")
    sig, ce, attrs = _signature(call)
    options = {"num_warps": call.num_warps, "num_stages": call.num_stages}
    options.update({"maxnreg": call.maxnreg} if call.maxnreg is not None else {})  # the config's cap
    key = (call.kernel, id(call.fn), repr(sig), repr(ce), repr(sorted(attrs)), repr(options), target)
    if key not in _COMPILED:
        gpu = triton.backends.compiler.GPUTarget("cuda", int(target[3:]), 32)
        c = triton.compile(ASTSource(fn=call.fn, signature=sig, constexprs=ce, attrs=attrs), gpu, options)
        _COMPILED[key] = c, replace(_read_cubin(c.asm["cubin"]), shared_bytes=int(c.metadata.shared))
    return _COMPILED[key]


def sass_stats_of(call: Call, target: str = "sm_90") -> SassStats:
    """The SASS numbers of `call`'s kernel compiled for `target` (`compiled_kernel`)."""
    return compiled_kernel(call, target)[1]


def sass_listing(call: Call, target: str = "sm_90") -> str:
    """`cuobjdump -sass` of `call`'s kernel compiled as `compiled_kernel` compiles it."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(compiled_kernel(call, target)[0].asm["cubin"])
        return subprocess.run([ka._nvidia_tool("cuobjdump"), "-sass", str(path)], capture_output=True,
                              text=True).stdout


def sass_weighted(call: Call, trips: list[int], target: str = "sm_90") -> tuple[int, int]:
    """`weighted_counts` of `call`'s kernel compiled as `compiled_kernel` compiles it."""
    return weighted_counts(sass_listing(call, target), trips)


def loop_opcodes(sass: str) -> list[str]:
    """The opcodes (without modifiers) of a listing's loop body (`loop_of`), in order."""
    ins, in_body = loop_of(sass)
    return [op.split(".")[0] for (_, op, _), b in zip(ins, in_body) if b]
