"""Launch configurations of every kernel, the rule that picks one, and where a kernel runs.

Every kernel holds one head dimension whole in a program (padded to a power of two) and tiles
the other. Head dims are rounded up to one of a few buckets so that the set of configs a
launcher can pick stays small and finite: `CONFIGS` lists all of them, and
tests/test_kernels_compile.py compiles each one for every GPU target ahead of time and checks
that it fits that target's shared memory. `select_config` is the only way a launcher picks
a config, and its answers always come from `CONFIGS`.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

# Head dims above this need a different tiling (the "whole" dim would not fit registers).
MAX_HEAD_DIM = 256
# The buckets a whole head dim is padded to. tl.dot needs every dimension >= 16; 64 is the
# smallest bucket because padding 16 to 64 costs little and keeps the config table short.
WHOLE_DIMS = (64, 128, 256)
CHUNK = 64  # BT, tokens per chunk: a 64 x 64 masked score matrix per step


def _cfg(BT: int, whole: int, tile: int, names: tuple[str, str], num_warps: int, num_stages: int) -> dict:
    return {"BT": BT, names[0]: whole, names[1]: tile, "num_warps": num_warps, "num_stages": num_stages}


def _table(names: tuple[str, str]) -> list[dict]:
    """One config per whole-dim bucket: the tile shrinks as the whole dim grows so that the
    fp32 state slice (whole x tile) stays at most 128 x 64 = 32 KiB of registers per program."""
    return [
        _cfg(CHUNK, 64, 64, names, num_warps=4, num_stages=1),
        _cfg(CHUNK, 128, 64, names, num_warps=8, num_stages=1),
        _cfg(CHUNK, 256, 32, names, num_warps=8, num_stages=1),
    ]


# kernel name -> (name of the whole dim, name of the tiled dim) in that kernel's constexprs
DIM_NAMES = {
    "chunk_fwd": ("BK", "BV"),        # Dk whole (q . k), Dv tiled (the value columns)
    "chunk_bwd_dqk": ("BV", "BK"),    # Dv whole (dO . v), Dk tiled (the dq / dk columns)
    "noncausal_state": ("BK", "BV"),  # Dk whole, Dv tiled
    "noncausal_output": ("BA", "BC"),  # input dim whole, output dim tiled
    "decode": ("BK", "BV"),           # Dk whole, Dv tiled (looped inside one program)
}

CONFIGS: dict[str, list[dict]] = {name: _table(dims) for name, dims in DIM_NAMES.items()}


def whole_dim(d: int) -> int:
    """The bucket a head dim held whole in a program is padded to."""
    if d > MAX_HEAD_DIM:
        raise ValueError(f"the Triton kernels support head dims up to {MAX_HEAD_DIM}, got {d}")
    return next(b for b in WHOLE_DIMS if d <= b)


Capability = Optional[tuple[int, int]]


def device_capability(device: Union[torch.device, str, None]) -> Capability:
    """(major, minor) of a CUDA device; None for CPU (the interpreter)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def select_config(kernel: str, d_whole: int, dtype: torch.dtype, device_or_capability=None) -> dict:
    """The launch config of `kernel` for a whole head dim `d_whole` (always one of CONFIGS).

    dtype and the target are arguments so that a per-target choice can be added without
    changing callers; today one table fits every target (the compile test checks this).
    """
    if kernel not in CONFIGS:
        raise KeyError(f"unknown kernel {kernel!r}; expected one of {sorted(CONFIGS)}")
    whole = whole_dim(d_whole)
    name = DIM_NAMES[kernel][0]
    return dict(next(c for c in CONFIGS[kernel] if c[name] == whole))


def dot_precision(dtype: torch.dtype, device_or_capability=None) -> str:
    """input_precision of the kernels' tl.dot calls.

    fp32 inputs get "ieee" (true fp32 products: fp32 in, fp32-accurate out). For 16-bit inputs
    the score and value products run on fp16/bf16 tensor cores whatever this says; the products
    with the fp32 state use "tf32" (fp32 range, 10-bit mantissa, like the inputs).
    """
    return "ieee" if dtype == torch.float32 else "tf32"


# --------------------------------------------------------------------------------------
# where a kernel runs: compiled on CUDA, interpreted on CPU
# --------------------------------------------------------------------------------------

_TWINS: dict = {}


def _twin(fn):
    """The interpreted twin of a @triton.jit function's Python source (cached)."""
    from triton.runtime.interpreter import InterpretedFunction

    if fn not in _TWINS:
        _TWINS[fn] = InterpretedFunction(fn)
    return _TWINS[fn]


class _Interpreted:
    """A kernel launched through the Triton interpreter, whatever TRITON_INTERPRET said.

    `kernel[grid](...)` runs every program of the grid with numpy on CPU tensors. Triton's own
    library functions (tl.zeros, tl.sum, tl.cumsum, ...) are themselves @triton.jit functions;
    when the interpreter was not switched on before `import triton` they are compiled-kind
    functions that refuse to be called from Python, so for the duration of the launch a call
    to any of them runs its interpreted twin instead. The swap is undone afterwards, so the
    same process can still compile kernels for a GPU (the compile test does).
    """

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            from triton.runtime import interpreter
            from triton.runtime.jit import JITFunction

            original = JITFunction.__call__

            def device_call(fn, *a, **kw):  # a call of a @triton.jit helper inside a kernel
                scope = interpreter._patch_lang(fn.fn)
                try:
                    return _twin(fn.fn).rewrite()(*a, **kw)
                finally:
                    scope.restore()

            JITFunction.__call__ = device_call
            try:
                return _twin(self.kernel.fn)[grid](*args, **kwargs)
            finally:
                JITFunction.__call__ = original

        return launch


def launchable(kernel, device):
    """The object to launch `kernel` with, `launchable(kernel, device)[grid](*args)`.

    CUDA tensors get the compiled JITFunction. CPU tensors get the Triton interpreter, which
    runs the same kernel source with numpy, one program after another (slow: for teaching and
    tests). This works whether or not TRITON_INTERPRET=1 was set before Triton was imported,
    and leaves the JITFunction itself untouched for ahead-of-time compilation.
    """
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction):  # TRITON_INTERPRET=1 at import: already one
        return kernel
    if torch.device(device).type == "cuda":
        return kernel
    return _Interpreted(kernel)
