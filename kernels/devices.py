"""Where a kernel runs: a device's compute capability and SM count, asked of torch.cuda once.

Every launcher looks its device up (`configs.select_config` by capability, the state walks'
split-T by SM count), a dozen times a training step's forward+backward, and torch.cuda's query
costs a few microseconds of Python each time: a tensor's CUDA device (which has its index) is
asked once and remembered (fla caches it the same way). `configs` re-exports both functions,
which is where the launchers find them; chunk_state imports `multiprocessor_count` by name, so
a test that patches it patches it there too (or in every module, as `record_launches` does).
"""
from __future__ import annotations

import functools

import torch

Capability = tuple | None


def device_capability(device: torch.device | str | None) -> Capability:
    """(major, minor) of a CUDA device; None for CPU (the interpreter)."""
    props = _cuda_properties(device)
    return None if props is None else props[0]


def _cuda_properties(device: torch.device | str | None) -> tuple[tuple[int, int], int] | None:
    """((major, minor), SMs) of a CUDA device (torch.cuda asked once per device), None for
    any other."""
    if not isinstance(device, torch.device):
        device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda":
        return None
    if device.index is None:  # "cuda": the current device, which may change
        device = torch.device("cuda", torch.cuda.current_device())
    return _cuda_properties_of(device)


@functools.cache
def _cuda_properties_of(device: torch.device) -> tuple[tuple[int, int], int]:
    props = torch.cuda.get_device_properties(device)
    return (props.major, props.minor), props.multi_processor_count


def multiprocessor_count(device: torch.device | str | None) -> int | None:
    """SMs of a CUDA device; None for CPU (the interpreter) and meta tensors."""
    props = _cuda_properties(device)
    return None if props is None else props[1]


# Triton's interpreter (the kernels on CPU tensors) in Triton 3.6.0 and older reads a
# runtime scalar as int() of a one-element numpy array; NumPy 2.4 made that an error, so
# every kernel with a loop fails there with an InterpreterError that names neither cause
# (Triton 3.7.1 squeezes the array first). The check reads the interpreter's own line.
_OLD_INDEX = 'lambda self: int(self.handle.data))'


def interpreter_problem(interpreter_source: str, numpy_int_of_array_fails: bool) -> str | None:
    """Why Triton's interpreter cannot run the kernels here, or None: given its source and
    whether int() of a one-element numpy array raises (NumPy >= 2.4)."""
    if numpy_int_of_array_fails and _OLD_INDEX in interpreter_source:
        import numpy
        import triton

        return (f"Triton {triton.__version__}'s interpreter, which runs the kernels on CPU "
                f"tensors, fails with NumPy {numpy.__version__} (it calls int() on one-element "
                "arrays, an error since NumPy 2.4; Triton 3.7.1 fixed it): install "
                "triton>=3.7.1 or numpy<2.4, or use backend='torch' on CPU")
    return None


@functools.cache
def interpreter_check() -> None:
    """Raise RuntimeError (`interpreter_problem`) once, before the first interpreted launch,
    if this Triton and NumPy cannot run the interpreter."""
    import inspect

    import numpy
    from triton.runtime import interpreter

    try:
        int(numpy.zeros(1))
        fails = False
    except TypeError:
        fails = True
    try:
        source = inspect.getsource(interpreter)
    except (OSError, TypeError):  # no source installed: nothing to read, nothing to say
        return
    problem = interpreter_problem(source, fails)
    if problem:
        raise RuntimeError(problem)
