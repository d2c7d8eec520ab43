"""Record the Triton launches a call makes, and optionally stub them out: no GPU needed.

`record_launches()` patches the method every `kernel[grid](...)` ends in
(`triton.runtime.jit.JITFunction.run`, and `InterpretedFunction.run` for the interpreter), so
each launch is appended to a list as a `Launch(name, fn, grid, args, kwargs)`. With
`stub=True` (the default) nothing is launched, and the launchers of `linattn_lib.kernels` see
CPU tensors as a CUDA device would show them: the compiled JITFunction instead of the
interpreter (`launchable`), and the given SM count and compute capability wherever they ask
for them (`device_capability`, `multiprocessor_count`, `torch.cuda.get_device_properties`,
`torch.cuda.get_device_capability`). Their Python therefore runs exactly as it would for CUDA
tensors -- the same configs, grids and arguments -- on a machine with no GPU and no Triton
driver. That is what the host-overhead count (`host_overhead.py`), the GPU dry run and the
no-host-sync test (tests/test_hot_path.py) use.

Example::

    import torch
    from linattn_lib import linear_attention
    from linattn_lib.experiments.launches import record_launches

    q, k, v = (torch.randn(1, 2, 256, 64) for _ in range(3))
    with record_launches() as launches:          # H100/H200-like: 132 SMs, sm_90
        linear_attention(q, k, v, backend="triton")
    print([(launch.name, launch.grid) for launch in launches])
    # [('chunk_state_kernel', (2, 3, 2)), ('chunk_output_kernel', (2, 8, 2))]
    print(launches[0].kwargs["num_warps"], launches[0].kwargs["BT"])   # 4 32

The outputs of a stubbed call are the launchers' uninitialised buffers: shapes and dtypes
are right, the values are not.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..core.triton_ops import require_kernels

H100_SMS = 132
H100_CAPABILITY = (9, 0)


@dataclass
class Launch:
    """One `kernel[grid](*args, **kwargs)`: the kernel's name, its JITFunction (or
    InterpretedFunction), the grid as a tuple (a callable grid resolved on the bound
    arguments), and the arguments exactly as passed (num_warps, num_stages and the
    constexprs among the keywords)."""

    name: str
    fn: Any
    grid: tuple
    args: tuple
    kwargs: dict

    @property
    def programs(self) -> int:
        """Programs in the grid (the product of its sizes)."""
        n = 1
        for g in self.grid:
            n *= int(g)
        return n


def _resolve_grid(fn, grid, args: tuple, kwargs: dict) -> tuple:
    """The grid as a tuple; a callable grid is called, as Triton does, on the bound arguments."""
    if not callable(grid):
        return tuple(grid)
    python_fn = getattr(fn, "fn", fn)
    params = inspect.signature(python_fn).parameters
    bound = inspect.signature(python_fn).bind_partial(*args, **{k: v for k, v in kwargs.items() if k in params})
    bound.apply_defaults()
    return tuple(grid(dict(bound.arguments)))


def _name(fn) -> str:
    try:
        return fn.__name__  # a JITFunction's own name
    except AttributeError:
        python_fn = getattr(fn, "fn", fn)
        return getattr(python_fn, "__name__", type(fn).__name__)


def _recording_run(launches: list[Launch], original, stub: bool, keep_args: bool):
    def run(self, *args, grid, warmup, **kwargs):
        if warmup:  # a compile without a launch (kernel.warmup): not a launch
            return None if stub else original(self, *args, grid=grid, warmup=warmup, **kwargs)
        # kwargs is this call's own dict: kept as it is, not copied (the host-overhead count
        # times the library's Python, so the record costs as little as it can)
        launches.append(Launch(_name(self), self, _resolve_grid(self, grid, args, kwargs),
                               args if keep_args else (), kwargs))
        if stub:
            return None
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    return run


def _device_properties(sm_count: int, capability: tuple[int, int]):
    return types.SimpleNamespace(
        name="stub (record_launches)", major=capability[0], minor=capability[1], multi_processor_count=sm_count,
        total_memory=80 * 2**30, warp_size=32, regs_per_multiprocessor=65536,
        max_threads_per_multi_processor=2048, L2_cache_size=50 * 2**20,
    )


_ABSENT = object()


@contextlib.contextmanager
def _patched(patches: list[tuple[object, str, object]]) -> Iterator[None]:
    """setattr each (owner, name, value) for the duration; restored in reverse order (an
    attribute the owner only inherited is deleted again)."""
    saved = [(owner, name, vars(owner).get(name, _ABSENT)) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in reversed(saved):
            if value is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


def _launcher_patches(sm_count: int, capability: tuple[int, int]) -> list[tuple[object, str, object]]:
    """Make every loaded module of linattn_lib.kernels see CPU tensors as a CUDA device: each
    module-level reference to `launchable`, `device_capability` or `multiprocessor_count` (the
    launchers import them by name) is replaced, and so are torch.cuda's device queries."""
    K = require_kernels("record_launches")
    configs = sys.modules[K.launchable.__module__]
    replacements = {
        configs.launchable: lambda kernel, device: kernel,
        configs.device_capability: lambda device: tuple(capability),
        configs.multiprocessor_count: lambda device: sm_count,
        # the cached query behind both: a stubbed device must not be remembered as a real one
        sys.modules[f"{K.__name__}.devices"]._cuda_properties: lambda device: (tuple(capability), sm_count),
    }
    patches = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == K.__name__ or name.startswith(K.__name__ + ".")):
            continue
        for attr, value in list(vars(module).items()):
            if callable(value) and not isinstance(value, type):
                try:
                    new = replacements.get(value)
                except TypeError:  # an unhashable callable
                    new = None
                if new is not None:
                    patches.append((module, attr, new))
    props = _device_properties(sm_count, capability)
    patches += [(torch.cuda, "get_device_properties", lambda device=None: props),
                (torch.cuda, "get_device_capability", lambda device=None: tuple(capability))]
    return patches


@contextlib.contextmanager
def record_launches(stub: bool = True, *, sm_count: int = H100_SMS, capability: tuple[int, int] = H100_CAPABILITY,
                    cuda_like: bool = False, keep_args: bool = True) -> Iterator[list[Launch]]:
    """Record every Triton launch made inside the block; yields the list they are appended to.

    stub=True: nothing runs; the launchers see the device as a GPU with `sm_count` SMs and
    compute `capability` (default an H100/H200: 132 SMs, sm_90), so CPU tensors take the CUDA
    path's configs and grids and no GPU or Triton driver is needed. stub=False: the kernels
    run as usual (compiled on CUDA, interpreted on CPU) and are recorded; nothing else is
    patched. cuda_like=True (with stub=True): every tensor also reports `is_cuda` True and
    `is_cpu` False, so the library's own device decisions take their CUDA branch too
    (`backend="auto"` picks the kernels, value checks are off, bfloat16 is accepted).
    keep_args=False: each Launch's args are () (kwargs, the constexprs and launch options, are
    kept): the record then holds no reference to the tensors, which would otherwise change
    what autograd does (a gradient still referenced elsewhere is copied, not stolen, into
    `.grad`). Not thread-safe: the patches are process-wide while the block runs.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []
    patches = [(cls, "run", _recording_run(launches, cls.__dict__["run"], stub, keep_args))
               for cls in (JITFunction, InterpretedFunction)]
    if stub:
        patches += _launcher_patches(sm_count, capability)
    if stub and cuda_like:
        patches += [(torch.Tensor, "is_cuda", property(lambda self: True)),
                    (torch.Tensor, "is_cpu", property(lambda self: False))]
    with _patched(patches):
        yield launches
